"""bench_acceptance --drafters: vanilla and every drafter side by side on the same prompts."""
from __future__ import annotations

import json
import os

import bench_env
import pytest
from bench_env import PNG_MAGIC, acceptance

from sglang_eagle3.bench import report

env, keep_threads = bench_env.env, bench_env.keep_threads             # the shared fixtures; keep_threads is autouse


def test_drafters_side_by_side_on_the_same_prompts(env, tmp_path, capsys):
    """bench_acceptance --drafters: vanilla and every drafter decode each prompt (greedy: all equal vanilla), the
    built sets come from the eval files, and the report has a column per drafter."""
    from sglang_eagle3.bench.drafters import code_edit_prompts, parse_drafters
    humaneval = os.path.join(env["data"], "eval", "humaneval.jsonl")
    with open(humaneval, "w") as f:
        for i in range(2):
            f.write(json.dumps({"turns": [f"Complete the code I provided.\ndef f{i}(x):\n"],
                                "reference": ["    return x\n"]}) + "\n")
    edits = code_edit_prompts(humaneval, 5)
    assert len(edits) == 2 and "def f0(x):\n    return x" in edits[0][0] and edits[0][0] != edits[1][0]
    out = tmp_path / "d.json"
    columns = ["eagle", "suffix", "hybrid", "hybrid-auto"]
    profile = tmp_path / "profile.json"
    profile.write_text(json.dumps({"per_batch_size": {"1": {"num_steps": 3, "topk": 2, "num_draft_tokens": 6}}}))
    assert acceptance(env, out, "--datasets", "mt_bench,mt_bench_turn2,code_edit", "--drafters",
                      ",".join(columns), "--choose-into", str(profile)) == 0
    res = json.loads(out.read_text())
    from sglang_eagle3.engine.profile import SpecProfile, host_kind
    from sglang_eagle3.engine.settings import resolve_settings
    chosen = json.loads(profile.read_text())["by_host"][host_kind()]["drafting"]
    best = max(columns, key=lambda c: res["average"][c]["speedup_median"])
    assert (chosen["drafter"], chosen["tree"]) == (best.split("-")[0], "auto" if best.endswith("auto") else "profile")
    assert "--drafters" in chosen["measured"]["command"] and chosen["measured"]["datasets"] == list(res["sets"])
    assert SpecProfile.load(str(profile)).drafting == {"drafter": chosen["drafter"], "tree": chosen["tree"]}
    settings = resolve_settings(env["draft"], profile=str(profile), dtype="float32")
    assert settings.drafting.tree == chosen["tree"] and (settings.drafting.drafter, chosen["drafter"]) in \
        (("eagle", "eagle"), ("hybrid", "hybrid"), ("suffix", "suffix"))
    assert res["format"] == "sglang_eagle3.bench_drafters/1" and res["columns"] == columns
    assert list(res["sets"]) == ["mt_bench", "mt_bench_turn2", "code_edit"]
    for name, s in res["sets"].items():
        assert s["n_prompts"] == 2
        for c in ["vanilla", *columns]:
            assert s[c]["identical_to_vanilla"] == 2 and s[c]["tokens"] == s["vanilla"]["tokens"] > 0
            assert s[c]["tau"] >= 1 and 0 <= s[c]["context_share"] <= 1
            assert s[c]["decode_speedup_median"] > 0                 # the speed-up without the prefills
        assert 0 < s["vanilla"]["prefill_share"] < 1 and s["vanilla"]["decode_speedup_median"] == pytest.approx(1)
        assert s["suffix"]["drafted_steps"] == 0 and s["eagle"]["context_share"] == 0
    md = (tmp_path / "d.md").read_text()
    assert report.parse_markdown_table(md)[0][:5] == ["set", "eagle speed-up", "suffix speed-up", "hybrid speed-up",
                                                      "hybrid-auto speed-up"]
    assert (tmp_path / "d.png").read_bytes()[:8] == PNG_MAGIC
    capsys.readouterr()
    for bad in ("eagle,eagle", "medusa", "hybrid-fast", "eagle:beam", "eagle:top-k,eagle:top-k"):
        with pytest.raises(Exception, match="--drafters"):
            parse_drafters(bad)
    assert parse_drafters("eagle,hybrid-auto:top-k") == [("eagle", "eagle", "profile", "sampled"),
                                                         ("hybrid-auto:top-k", "hybrid", "auto", "top-k")]
