"""bench/bench_acceptance.py and bench/tune_spec.py end to end on a tiny random target, the profile loader,
SGLang's adaptive-config parser on what we write, a fake SGLang server, and the report helpers."""
from __future__ import annotations

import json
import math
import os
import threading
import time
from http.server import ThreadingHTTPServer

import pytest
import torch
from conftest import JSONHandler, save_tiny_model_folder

from sglang_eagle3.bench import report
from sglang_eagle3.bench.acceptance import main as acceptance_main
from sglang_eagle3.bench.tune import main as tune_main
from sglang_eagle3.bench.tune import profile_tree_at
from sglang_eagle3.bench.tune_grid import ProfileError, adaptive_config, select_best, tree_grid, tree_key
from sglang_eagle3.cli import main as eagle3_main
from sglang_eagle3.engine.speculation import SpecConfig

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
EVAL = {"mt_bench": [{"turns": ["w1 w2 w3", "w4 w5"]}, {"turns": ["w6 w7", "w8 w9 w10"]}],
        "gsm8k": [{"turns": ["w11 w12"]}, {"turns": ["w13 w14 w15"]}],
        "alpaca": [{"turns": ["w16"]}, {"turns": ["w17 w18"]}]}


@pytest.fixture(scope="module")
def env(tmp_path_factory):
    root = tmp_path_factory.mktemp("bench")
    target = save_tiny_model_folder(root / "target")
    assert eagle3_main(["init-draft", "--target", target, "--out", str(root / "draft"), "--draft-vocab-size", "48",
                        "--dtype", "float32"]) == 0
    (root / "data" / "eval").mkdir(parents=True)
    for name, rows in EVAL.items():
        (root / "data" / "eval" / f"{name}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return {"target": target, "draft": str(root / "draft"), "data": str(root / "data")}


@pytest.fixture(autouse=True)
def keep_threads(monkeypatch, env):
    """The scripts take --threads 1 (fast for tiny models on a busy machine); restore the suite's setting."""
    n = torch.get_num_threads()
    monkeypatch.setenv("EAGLE3_DATA", env["data"])
    yield
    torch.set_num_threads(n)


def acceptance(env, out, *extra):
    return acceptance_main(["--target", env["target"], "--draft", env["draft"], "--n", "2", "--max-new-tokens", "6",
                            "--ignore-eos", "--num-steps", "3", "--topk", "2", "--num-draft-tokens", "6",
                            "--threads", "1", "--out", str(out), *extra])


# ---- bench_acceptance --------------------------------------------------------------------------


def test_acceptance_end_to_end(env, tmp_path, capsys):
    out = tmp_path / "acc.json"
    assert acceptance(env, out, "--datasets", "mt_bench,gsm8k") == 0
    printed = capsys.readouterr().out
    res = json.loads(out.read_text())
    assert res["format"] == "sglang_eagle3.bench_acceptance/1" and list(res["sets"]) == ["mt_bench", "gsm8k"]
    assert res["config"]["spec"] == {"num_steps": 3, "topk": 2, "num_draft_tokens": 6}
    for name, s in res["sets"].items():
        turns = 2 if name == "mt_bench" else 1
        assert s["n_prompts"] == 2 and s["tokens_vanilla"] == s["tokens_spec"] == 2 * turns * 6
        assert s["identical_to_vanilla"] == 2                        # greedy speculative == vanilla (fp32)
        assert all(p["identical"] and p["turns"] == turns for p in s["per_prompt"])
        assert [p["spec_first"] for p in s["per_prompt"]] == [False, True]   # alternated order
        assert sum(s["accept_histogram"].values()) == s["decode_steps"] > 0
        assert sum(int(k) * v for k, v in s["accept_histogram"].items()) == s["tau"] * s["decode_steps"]
        assert 1.0 <= s["tau"] <= 4.0                                # at most num_steps + 1 per step
        for key in ("speedup_median", "speedup_total", "tokens_per_s_vanilla", "tokens_per_s_spec"):
            assert s[key] > 0
        assert s["speedup_total"] == pytest.approx(s["tokens_per_s_spec"] / s["tokens_per_s_vanilla"])
        assert 0 <= s["draft_vocab_coverage"] <= 1
        assert s["draft_vocab_coverage"] == sum(p["in_draft_vocab"] for p in s["per_prompt"]) / s["tokens_vanilla"]
        assert all(len(p["tau_by_turn"]) == turns for p in s["per_prompt"])
    assert list(res["sets"]["mt_bench"]["tau_by_turn"]) == ["1", "2"] and "tau_by_turn" not in res["sets"]["gsm8k"]
    assert res["average"]["tau"] == pytest.approx((res["sets"]["mt_bench"]["tau"] + res["sets"]["gsm8k"]["tau"]) / 2)
    md = (tmp_path / "acc.md").read_text()
    assert "τ by turn: MT-bench turn 1 " in md and "GSM8K turn" not in md
    rows = report.parse_markdown_table(md)
    assert rows[0][:3] == ["Set", "Speed-up", "τ"] and [r[0] for r in rows[1:]] == ["MT-bench", "GSM8K", "Average"]
    assert rows[-1][2] == f"{res['average']['tau']:.2f}" and rows[1][1].endswith("x")
    assert report.parse_markdown_table(printed) == rows
    assert (tmp_path / "acc_hist.png").read_bytes()[:8] == PNG_MAGIC


def test_acceptance_runs_the_profiles_long_context_tree(env, tmp_path, monkeypatch):
    """With the draft's profile (no tree flags), bench_acceptance decodes as the server would: greedy steps of rows
    holding the long-context table's min_tokens or more run its tree; the result's config and caption say so. Here
    every row is that long (min_tokens 1), so every speculative step runs the long-context tree."""
    import shutil

    from sglang_eagle3.engine import scheduler as S
    from sglang_eagle3.engine.profile import host_kind
    from sglang_eagle3.engine.speculation import SpecConfig
    ran = []
    spec_for = S.Scheduler.spec_for
    monkeypatch.setattr(S.Scheduler, "spec_for", lambda self, *a: ran.append(spec_for(self, *a)) or ran[-1]
                        if self.draft is not None else None)
    draft = tmp_path / "draft"
    shutil.copytree(env["draft"], draft)
    long = {"min_tokens": 1, "per_batch_size": {"1": {"num_steps": 1, "topk": 1, "num_draft_tokens": 2}}}
    (draft / "spec_profile.json").write_text(json.dumps({"per_batch_size": {
        "1": {"num_steps": 3, "topk": 2, "num_draft_tokens": 6}}, "by_host": {host_kind(): {
            "per_batch_size": {"1": {"num_steps": 3, "topk": 2, "num_draft_tokens": 6}}, "long_context": long}}}))
    out = tmp_path / "acc.json"
    assert acceptance_main(["--target", env["target"], "--draft", str(draft), "--n", "2", "--max-new-tokens", "6",
                            "--ignore-eos", "--threads", "1", "--datasets", "gsm8k", "--out", str(out)]) == 0
    res = json.loads(out.read_text())
    assert res["config"]["spec"] == {"num_steps": 3, "topk": 2, "num_draft_tokens": 6}
    assert res["config"]["long_context"] == {"min_tokens": 1, "num_steps": 1, "topk": 1, "num_draft_tokens": 2}
    assert ran and all(t == SpecConfig(1, 1, 2) for t in ran)
    assert "from 1 tokens on, the profile's long-context tree 1/1/2" in (tmp_path / "acc.md").read_text()


def test_acceptance_counts_the_target_tokens_the_draft_vocab_holds():
    from types import SimpleNamespace

    from sglang_eagle3.bench.acceptance import bench_prompt, summarize_set

    class Fake:
        def __init__(self, ids):
            self.ids = ids

        def generate(self, convs, params, batch_size):
            return [SimpleNamespace(text="x", token_ids=self.ids, accept_lengths=[1] * (len(self.ids) + 1))], None

    in_vocab = torch.zeros(10, dtype=torch.bool)
    in_vocab[[1, 2, 3]] = True
    row = bench_prompt(Fake([1, 5, 2, 9]), Fake([1, 5, 2, 9]), ["a", "b"], lambda k: None, 0, in_vocab)
    assert row["in_draft_vocab"] == 4 and row["tokens_vanilla"] == 8              # 2 of 4 per turn, two turns
    assert summarize_set([row], greedy=True)["draft_vocab_coverage"] == 0.5
    assert summarize_set([bench_prompt(Fake([1]), Fake([1]), ["a"], lambda k: None, 0)],
                         greedy=True)["draft_vocab_coverage"] is None


def test_acceptance_reports_tau_per_turn():
    """MT-bench asks two turns: τ of each turn pools that turn's steps over the prompts that have it."""
    from types import SimpleNamespace

    from sglang_eagle3.bench.acceptance import bench_prompt, summarize_set
    from sglang_eagle3.bench.acceptance_report import markdown_report

    class Turns:                 # turn k (counted by calls) accepts lengths[k] per step, after the prefill token
        def __init__(self, lengths):
            self.lengths, self.calls = lengths, 0

        def generate(self, convs, params, batch_size):
            steps = self.lengths[self.calls % len(self.lengths)]
            self.calls += 1
            ids = list(range(1 + sum(steps)))
            return [SimpleNamespace(text="x", token_ids=ids, accept_lengths=[1] + steps)], None

    vanilla = Turns([[1] * 4, [1] * 6])
    two = bench_prompt(vanilla, Turns([[3, 1], [1, 1, 2, 1]]), ["a", "b"], lambda k: None)
    one = bench_prompt(Turns([[1] * 5]), Turns([[2, 3]]), ["a"], lambda k: None)
    assert two["tau_by_turn"] == [2.0, 1.25] and one["tau_by_turn"] == [2.5]
    s = summarize_set([two, one], greedy=False, max_accept=3)
    assert s["tau_by_turn"] == {"1": (3 + 1 + 2 + 3) / 4, "2": 1.25}          # turn 1 pooled over both prompts
    assert s["tau"] == pytest.approx((4 + 5 + 5) / 8)
    assert "tau_by_turn" not in summarize_set([one], greedy=False)           # single-turn sets: no split
    result = {"config": {"temperature": 1, "target": "t", "draft": "d", "dtype": "float32", "max_new_tokens": 8,
                         "spec": {"num_steps": 2, "topk": 1, "num_draft_tokens": 3}},
              "sets": {"mt_bench": s}, "average": s}
    assert "τ by turn: MT-bench turn 1 2.25, turn 2 1.25." in markdown_report(result)


def test_acceptance_baseline_draft_side_by_side(env, tmp_path, capsys):
    """--baseline-draft B: B decoded on every prompt beside --draft, each draft's numbers equal to a run of it alone
    (greedy, fp32: deterministic), the three runs' order rotated, the comparison table in the .md."""
    other = tmp_path / "other"
    assert eagle3_main(["init-draft", "--target", env["target"], "--out", str(other), "--draft-vocab-size", "48",
                        "--dtype", "float32", "--seed", "7"]) == 0
    both, alone_a, alone_b = tmp_path / "both.json", tmp_path / "a.json", tmp_path / "b.json"
    sets = ("--datasets", "mt_bench,gsm8k,alpaca")
    assert acceptance(env, both, *sets, "--baseline-draft", str(other)) == 0
    assert acceptance(env, alone_a, *sets) == 0
    assert acceptance_main(["--target", env["target"], "--draft", str(other), "--n", "2", "--max-new-tokens", "6",
                            "--ignore-eos", "--num-steps", "3", "--topk", "2", "--num-draft-tokens", "6",
                            "--threads", "1", "--out", str(alone_b), *sets]) == 0
    res, a, b = (json.loads(f.read_text()) for f in (both, alone_a, alone_b))
    assert res["config"]["baseline_draft"] == str(other) and res["baseline"]["draft"] == str(other)
    for name, s in res["sets"].items():
        base = res["baseline"]["sets"][name]
        for mine, alone in ((s, a["sets"][name]), (base, b["sets"][name])):
            assert (mine["decode_steps"], mine["tau"], mine["accept_histogram"]) == \
                (alone["decode_steps"], alone["tau"], alone["accept_histogram"])
        assert base["identical_to_vanilla"] == 2 and "per_prompt" not in base
        orders = [p["order"] for p in s["per_prompt"]]
        assert orders == [["vanilla", "spec", "baseline"], ["spec", "baseline", "vanilla"]]
        ratios = [p["speedup"] / p["baseline"]["speedup"] for p in s["per_prompt"]]
        assert base["draft_over_baseline_median"] == pytest.approx(report.median(ratios))
    assert res["baseline"]["average"]["tau"] == pytest.approx(b["average"]["tau"])
    md = (tmp_path / "both.md").read_text()
    assert "Side by side with the baseline draft" in md and "| τ draft | τ baseline |" in md
    assert "Baseline greedy outputs identical to vanilla: mt_bench 2/2, gsm8k 2/2, alpaca 2/2." in md
    # resumed: the finished sets of both drafts are reused
    assert acceptance(env, both, *sets, "--baseline-draft", str(other)) == 0
    assert json.loads(both.read_text())["baseline"]["sets"] == res["baseline"]["sets"]
    # a baseline that reads other target layers is refused in one line
    cfg = json.loads((other / "config.json").read_text())
    cfg["eagle_config"]["eagle_aux_hidden_state_layer_ids"] = [0, 1, 2]
    (other / "config.json").write_text(json.dumps(cfg))
    capsys.readouterr()
    assert acceptance(env, tmp_path / "x.json", "--datasets", "gsm8k", "--baseline-draft", str(other)) == 2
    err = capsys.readouterr().err
    assert "--baseline-draft" in err and "aux_layer_ids [0, 1, 2] differs" in err and err.count("\n") == 1
    assert acceptance(env, tmp_path / "x.json", "--datasets", "gsm8k", "--baseline-draft", str(tmp_path / "nope")) == 2
    err = capsys.readouterr().err
    assert "--baseline-draft" in err and "no config.json" in err and err.count("\n") == 1
    # a broken --draft is reported as --draft's problem, not the baseline's
    assert acceptance_main(["--target", env["target"], "--draft", str(tmp_path / "nope"), "--n", "1",
                            "--datasets", "gsm8k", "--baseline-draft", env["draft"], "--out", str(tmp_path / "y.json")]) == 2
    err = capsys.readouterr().err
    last = err.strip().splitlines()[-1]
    assert "error: --draft" in last and "no such folder" in last and "--baseline-draft" not in err


def test_acceptance_resumes_finished_sets(env, tmp_path, capsys):
    out = tmp_path / "acc.json"
    assert acceptance(env, out, "--datasets", "gsm8k") == 0
    first = json.loads(out.read_text())["sets"]["gsm8k"]
    assert acceptance(env, out, "--datasets", "gsm8k,alpaca") == 0
    res = json.loads(out.read_text())
    assert res["sets"]["gsm8k"] == first and res["sets"]["alpaca"]["n_prompts"] == 2   # reused, not re-timed
    assert acceptance(env, out, "--datasets", "gsm8k", "--max-new-tokens", "4") == 0   # other settings: redo
    assert json.loads(out.read_text())["sets"]["gsm8k"]["tokens_spec"] == 2 * 4


def test_acceptance_sampling(env, tmp_path, capsys):
    out = tmp_path / "t1.json"
    assert acceptance(env, out, "--datasets", "mt_bench", "--temperature", "1", "--seed", "3") == 0
    res = json.loads(out.read_text())
    s = res["sets"]["mt_bench"]
    assert res["config"]["seed"] == 3 and "identical_to_vanilla" not in s and s["tau"] >= 1
    assert "Greedy outputs identical" not in (tmp_path / "t1.md").read_text()
    nucleus = tmp_path / "t1p.json"
    assert acceptance(env, nucleus, "--datasets", "mt_bench", "--temperature", "1", "--top-p", "0.9") == 0
    assert json.loads(nucleus.read_text())["config"]["top_p"] == 0.9
    assert "Temperature=1, top_p=0.9;" in (tmp_path / "t1p.md").read_text()


def test_acceptance_bad_inputs(env, tmp_path, capsys):
    assert acceptance(env, tmp_path / "x.json", "--datasets", "nope") == 2
    err = capsys.readouterr().err
    assert "nope.jsonl does not exist" in err and "available: alpaca, gsm8k, mt_bench" in err
    assert err.count("\n") == 1
    assert acceptance(env, tmp_path / "x.json", "--datasets", "gsm8k", "--topk", "4", "--num-steps", "1",
                      "--num-draft-tokens", "9") == 2
    assert "--num-draft-tokens=9 exceeds" in capsys.readouterr().err
    assert acceptance(env, tmp_path / "x.json", "--datasets", "gsm8k", "--top-p", "0") == 2
    assert "--top-p must be in (0, 1], got 0.0" in capsys.readouterr().err


# ---- tune_spec: our engine -----------------------------------------------------------------------


def test_tune_engine_end_to_end(env, tmp_path, capsys):
    out = tmp_path / "prof.json"
    argv = ["--target", env["target"], "--draft", env["draft"], "--dataset", "gsm8k", "--n", "2",
            "--max-new-tokens", "6", "--ignore-eos", "--batch-sizes", "1,2", "--num-steps-grid", "1,3",
            "--topk-grid", "1,2", "--num-draft-tokens-grid", "4,6", "--threads", "1", "--out", str(out)]
    assert tune_main(argv) == 0
    printed = capsys.readouterr().out
    trees = tree_grid([1, 3], [1, 2], [4, 6])
    assert {(t["num_steps"], t["topk"], t["num_draft_tokens"]) for t in trees} == \
        {(1, 1, 2), (1, 2, 3), (3, 1, 4), (3, 2, 4), (3, 2, 6)}
    # a tree of n tokens is at most n - 1 deep: deeper grid points are the same tree drafted for nothing
    assert {(t["num_steps"], t["topk"], t["num_draft_tokens"]) for t in tree_grid([1, 2, 4], [1, 4], [2, 3])} == \
        {(1, 1, 2), (2, 1, 3), (1, 4, 2), (1, 4, 3), (2, 4, 3)}
    grid = json.loads((tmp_path / "prof.grid.json").read_text())
    assert len(grid["rows"]) == 2 * (1 + len(trees))
    spec_rows = [r for r in grid["rows"] if r["tree"] is not None]
    assert all(r["identical_to_vanilla"] is True and r["accept_length"] >= 1 for r in spec_rows)
    assert all(r["tokens"] == r["repeats"] * 2 * 6 and r["tokens_per_s"] > 0 for r in grid["rows"])
    for bs in (1, 2):               # --confirm 3 (default): vanilla and the 3 fastest trees run 3 more times
        mine = [r for r in grid["rows"] if r["batch_size"] == bs]
        again = [r for r in mine if r["repeats"] == 4]
        assert len(again) == 4 and any(r["tree"] is None for r in again)
        assert all(r["repeats"] == 1 for r in mine if r not in again)
        assert {tree_key(r["tree"]) for r in mine if r.get("confirmed")} == \
            {tree_key(r["tree"]) for r in again if r["tree"] is not None}
        prof_entry = json.loads(out.read_text())["per_batch_size"][str(bs)]
        if prof_entry["speculation"]:       # chosen among the trees run again
            assert tree_key({k: prof_entry[k] for k in ("num_steps", "topk", "num_draft_tokens")}) in \
                {tree_key(r["tree"]) for r in again if r["tree"] is not None}
    prof = json.loads(out.read_text())
    assert prof["format"] == "sglang_eagle3.spec_profile/1" and set(prof["per_batch_size"]) == {"1", "2"}
    assert prof["per_batch_size"] == select_best(grid["rows"])
    adaptive = json.loads((tmp_path / "prof.sglang_adaptive.json").read_text())
    assert set(k for k in adaptive if k.isdigit()) == {"1", "2"}
    assert prof["sglang_adaptive"]["path"] == "prof.sglang_adaptive.json"     # outside the repository: the name only
    for bs in (1, 2):
        entry, spec = prof["per_batch_size"][str(bs)], profile_tree_at(str(out), bs)
        if entry["speculation"]:
            assert spec == SpecConfig(entry["num_steps"], entry["topk"], entry["num_draft_tokens"])
            assert entry["speedup"] >= 1.0
        else:                       # slower than vanilla, or no drafted token accepted (then a gain is noise)
            assert spec is None
            assert entry["best_tree"]["speedup"] < 1.0 or entry["best_tree"]["accepted_drafts"] == 0
    assert "Best per batch size" in printed and "Greedy outputs identical to vanilla in 10/10" in printed
    assert "Run again after the grid" in (tmp_path / "prof.md").read_text()
    assert (tmp_path / "prof.png").read_bytes()[:8] == PNG_MAGIC
    assert report.parse_markdown_table((tmp_path / "prof.md").read_text())[0] == ["tree", "bs=1", "bs=2"]
    # resume: nothing left to measure, same rows back
    assert tune_main(argv) == 0
    assert json.loads((tmp_path / "prof.grid.json").read_text())["rows"] == grid["rows"]


# ---- selection, adaptive config and the loader (synthetic measurements) ---------------------------


def row(bs, tps, steps=None, topk=1, ndt=None):
    tree = None if steps is None else {"num_steps": steps, "topk": topk,
                                       "num_draft_tokens": ndt or (steps + 1 if topk == 1 else 8)}
    return {"batch_size": bs, "tree": tree, "tokens_per_s": tps, "accept_length": None if tree is None else 2.0}


ROWS = [row(1, 100), row(1, 180, 3), row(1, 175, 5), row(1, 150, 1), row(1, 200, 3, topk=4, ndt=16),
        row(4, 320), row(4, 330, 1), row(4, 290, 3),
        row(16, 800), row(16, 600, 1), row(16, 500, 3, topk=2, ndt=6)]


def test_select_best_and_adaptive_config():
    best = select_best(ROWS)
    assert best["1"]["speculation"] and (best["1"]["topk"], best["1"]["num_draft_tokens"]) == (4, 16)
    assert best["1"]["speedup"] == pytest.approx(2.0)
    assert best["4"]["speculation"] and best["4"]["num_steps"] == 1
    assert best["16"] == {"speculation": False, "tokens_per_s": 800, "speedup": 1.0,
                          "best_tree": {"num_steps": 1, "topk": 1, "num_draft_tokens": 2, "tokens_per_s": 600,
                                        "speedup": 0.75, "accepted_drafts": None}}
    assert select_best(ROWS, min_speedup=1.2)["4"]["speculation"] is False
    ad = adaptive_config(ROWS, tolerance=0.05)
    assert ad["1"] == {"candidate_steps": [3, 5]}          # chains within 5% of the best chain (180)
    assert ad["4"] == {"candidate_steps": [0, 1]}          # vanilla (320) within 5% of the best chain (330)
    assert ad["16"] == {"candidate_steps": [0]}            # no speculation
    assert "topk=1 chains only" in ad["_comment"]
    with pytest.raises(ProfileError, match="topk"):
        adaptive_config([row(1, 100), row(1, 150, 3, topk=2)])
    lucky = [row(1, 100), {**row(1, 130, 3), "accepted_drafts": 0}, {**row(1, 120, 1), "accepted_drafts": 5}]
    assert (select_best(lucky)["1"]["num_steps"], adaptive_config(lucky)["1"]) == (1, {"candidate_steps": [1]})
    assert select_best(lucky[:2])["1"]["speculation"] is False and adaptive_config(lucky[:2])["1"] == \
        {"candidate_steps": [0]}
    # trees run again after the grid: the choice is among them, not a faster one measured less often
    confirmed = [row(1, 100), {**row(1, 120, 1), "confirmed": True}, row(1, 130, 2), row(2, 190),
                 row(2, 210, 1)]
    best = select_best(confirmed)
    assert (best["1"]["num_steps"], best["1"]["tokens_per_s"]) == (1, 120) and best["2"]["num_steps"] == 1


def test_load_profile_routing_and_errors(tmp_path):
    path = tmp_path / "p.json"
    path.write_text(json.dumps({"per_batch_size": select_best(ROWS)}))
    assert profile_tree_at(str(path), 1) == SpecConfig(3, 4, 16)
    assert profile_tree_at(str(path), 3) == SpecConfig(3, 4, 16)     # largest measured batch size below
    assert profile_tree_at(str(path), 4) == SpecConfig(1, 1, 2)
    assert profile_tree_at(str(path), 64) is None                    # speculation: false
    path.write_text(json.dumps({"per_batch_size": {"2": None, "8": {"num_steps": 2, "topk": 1,
                                                                    "num_draft_tokens": 3}}}))
    assert profile_tree_at(str(path), 1) is None and profile_tree_at(str(path), 9) == SpecConfig(2, 1, 3)
    with pytest.raises(FileNotFoundError, match="tune_spec"):
        profile_tree_at(str(tmp_path / "missing.json"), 1)
    for text, msg in [("{oops", "not valid JSON"), ('{"per_batch_size": {"a": {}}}', "integer batch-size keys"),
                      ('{"per_batch_size": {"1": {"num_steps": 2}}}', r"per_batch_size\[1\]"),
                      ('{"per_batch_size": {"1": {"num_steps": 1, "topk": 4, "num_draft_tokens": 9}}}', "exceeds")]:
        path.write_text(text)
        with pytest.raises(ProfileError, match=msg):
            profile_tree_at(str(path), 1)


def test_adaptive_config_accepted_by_sglang(tmp_path):
    asp = pytest.importorskip("sglang.srt.speculative.adaptive_spec_params",
                              reason="SGLang is not installed")
    path = tmp_path / "adaptive.json"
    report.write_json_atomic(str(path), adaptive_config(ROWS))
    cfg, slots = asp._load_adaptive_config(str(path))
    assert sorted(slots) == [1, 4, 16]
    assert asp.resolve_candidate_steps_from_config(str(path)) == [0, 1, 3, 5]
    params = asp.AdaptiveSpeculativeParams(initial_steps=3, cfg_path=str(path))
    assert params.get_steps_for_batch(1) == 3 and params.get_steps_for_batch(2) == 3   # bs 2 routes to slot 1
    assert params.get_steps_for_batch(16) == 0 and params.get_steps_for_batch(100) == 0
    for _ in range(40):                                 # a slot holding only 0 never starts speculating
        params.on_verify_complete([0, 0], batch_size=16)
    assert params.get_steps_for_batch(16) == 0


# ---- tune_spec: a SGLang server (fake, same response fields) ----------------------------------------


class FakeSGLang(JSONHandler):
    tree = None                    # (steps, topk, ndt) or None
    model = "/models/tiny"
    delay = {}                     # batch size -> seconds per request

    def do_GET(self):
        t = type(self).tree
        self._send({"model_path": type(self).model, "speculative_algorithm": "EAGLE3" if t else None,
                    "speculative_draft_model_path": "/models/draft" if t else None,
                    "speculative_num_steps": t and t[0], "speculative_eagle_topk": t and t[1],
                    "speculative_num_draft_tokens": t and t[2], "speculative_adaptive": False})

    def do_POST(self):
        body = json.loads(self.rfile.read(int(self.headers.get("Content-Length", 0))) or b"{}")
        if self.path == "/flush_cache":
            return self._send({})
        texts, n = body["text"], body["sampling_params"]["max_new_tokens"]
        time.sleep(type(self).delay.get(len(texts), 0.0))
        meta = {"completion_tokens": n}
        if type(self).tree:
            meta.update(spec_verify_ct=n // 2, spec_accept_length=2.0, spec_num_correct_drafts=n // 2)
        self._send([{"text": "x", "meta_info": meta} for _ in texts])


@pytest.fixture
def fake_server():
    srv = ThreadingHTTPServer(("127.0.0.1", 0), FakeSGLang)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    yield srv, f"http://127.0.0.1:{srv.server_address[1]}"
    srv.shutdown()
    srv.server_close()


def test_tune_against_sglang_server(env, tmp_path, fake_server, capsys):
    _, url = fake_server
    out = tmp_path / "srv.json"
    argv = ["--sglang-url", url, "--target", env["target"], "--dataset", "gsm8k", "--n", "2",
            "--max-new-tokens", "8", "--batch-sizes", "1,2", "--out", str(out)]
    FakeSGLang.tree, FakeSGLang.delay = None, {1: 0.08, 2: 0.08}          # launch 1: no speculation
    assert tune_main(argv) == 0
    first = json.loads(out.read_text())
    assert first["per_batch_size"]["1"]["speculation"] is False and first["sglang_adaptive"]["path"] is None
    FakeSGLang.tree, FakeSGLang.delay = (3, 1, 4), {1: 0.02, 2: 0.4}      # launch 2: a chain, fast at bs 1 only
    assert tune_main(argv) == 0
    grid = json.loads((tmp_path / "srv.grid.json").read_text())
    assert grid["setup"]["backend"] == "sglang" and len(grid["rows"]) == 4
    assert {r["accept_length"] for r in grid["rows"] if r["tree"]} == {2.0}
    assert [r["accepted_drafts"] for r in grid["rows"] if r["tree"]] == [8, 8]      # 2 prompts x 8 // 2
    prof = json.loads(out.read_text())
    assert prof["per_batch_size"]["1"]["speculation"] and prof["per_batch_size"]["1"]["num_steps"] == 3
    assert prof["per_batch_size"]["2"]["speculation"] is False
    assert json.loads((tmp_path / "srv.sglang_adaptive.json").read_text())["2"] == {"candidate_steps": [0]}
    assert profile_tree_at(str(out), 1) == SpecConfig(3, 1, 4) and profile_tree_at(str(out), 2) is None
    capsys.readouterr()
    FakeSGLang.model = "/models/other"                                   # another target: refused, not mixed
    try:
        assert tune_main(argv) == 2
    finally:
        FakeSGLang.tree, FakeSGLang.model = None, "/models/tiny"
    assert "holds measurements of /models/tiny" in capsys.readouterr().err
    assert len(json.loads((tmp_path / "srv.grid.json").read_text())["rows"]) == 4


def test_tune_refuses_adaptive_server(env, tmp_path, fake_server, capsys, monkeypatch):
    _, url = fake_server
    monkeypatch.setattr(FakeSGLang, "do_GET", lambda self: self._send(
        {"speculative_algorithm": "EAGLE3", "speculative_adaptive": True}))
    assert tune_main(["--sglang-url", url, "--dataset", "gsm8k", "--out", str(tmp_path / "p.json")]) == 2
    assert "--speculative-adaptive" in capsys.readouterr().err


def test_tune_unreachable_server(env, tmp_path, capsys):
    assert tune_main(["--sglang-url", "http://127.0.0.1:9", "--dataset", "gsm8k", "--timeout", "5",
                      "--out", str(tmp_path / "p.json")]) == 2
    assert "cannot reach the SGLang server" in capsys.readouterr().err


# ---- report helpers --------------------------------------------------------------------------------


def test_tables_and_atomic_files(tmp_path):
    headers, rows = ["set", "speed-up", "tau"], [["a", "1.50x", 2.345], ["bb", None, 1.0]]
    md = report.format_table(headers, rows)
    assert report.parse_markdown_table(md) == [headers, ["a", "1.50x", "2.35"], ["bb", "-", "1.00"]]
    assert md.splitlines()[1].startswith("| --") and md.splitlines()[1].endswith(": |")
    plain = report.format_table(headers, rows, style="plain").splitlines()
    assert plain[0].split() == headers and plain[2].split() == ["a", "1.50x", "2.35"]
    with pytest.raises(ValueError, match="row 1"):
        report.format_table(headers, [["only", "two"]])
    path = tmp_path / "sub" / "r.json"
    report.write_json_atomic(str(path), {"x": torch.tensor(3).item(), "y": [1.5]})
    assert json.loads(path.read_text()) == {"x": 3, "y": [1.5]} and os.listdir(path.parent) == ["r.json"]
    umask = os.umask(0o022)
    try:
        report.write_json_atomic(str(path), {"x": 3, "y": [1.5]})
    finally:
        os.umask(umask)
    assert (path.stat().st_mode & 0o777) == 0o644                  # the usual permissions, not mkstemp's 0600
    with pytest.raises(ValueError):
        report.write_json_atomic(str(path), {"bad": float("nan")})
    assert json.loads(path.read_text()) == {"x": 3, "y": [1.5]}            # a failed write leaves the old file
    assert os.listdir(path.parent) == ["r.json"]
    assert report.sibling("a/b.json", ".md") == "a/b.md" and report.sibling("a/b", "_h.png") == "a/b_h.png"


# ---- ablation table ----------------------------------------------------------------------------


def test_ablation_table_lines_up_drafts_and_refuses_mismatched_runs(env, tmp_path, capsys):
    from sglang_eagle3.bench.ablation import main as ablation_main
    a, b, c = tmp_path / "a.json", tmp_path / "b.json", tmp_path / "c.json"
    assert acceptance(env, a, "--datasets", "mt_bench,gsm8k") == 0
    assert acceptance(env, b, "--datasets", "gsm8k,mt_bench") == 0
    assert acceptance(env, c, "--datasets", "mt_bench,gsm8k", "--max-new-tokens", "4") == 0
    capsys.readouterr()
    out = tmp_path / "abl.json"
    assert ablation_main(["--row", f"fused={a}", "--row", f"again (w=1)={b}", "--out", str(out)]) == 0
    table = json.loads(out.read_text())
    res_a = json.loads(a.read_text())
    assert [r["label"] for r in table["rows"]] == ["fused", "again (w=1)"]
    assert table["rows"][0]["tau"] == {s: res_a["sets"][s]["tau"] for s in ("mt_bench", "gsm8k")}
    assert table["rows"][0]["train"] is None                       # init-draft output: no trainer summary
    rows = report.parse_markdown_table((tmp_path / "abl.md").read_text())
    assert rows[0][:3] == ["Draft", "MT-bench τ", "GSM8K τ"] and [r[0] for r in rows[1:]] == ["fused", "again (w=1)"]
    assert rows[1][1] == f"{res_a['sets']['mt_bench']['tau']:.2f}"
    assert ablation_main(["--row", f"fused={a}", "--row", f"short={c}", "--out", str(out)]) == 2
    assert "max_new_tokens=4" in capsys.readouterr().err
    assert ablation_main(["--row", f"fused={a}", "--sets", "alpaca", "--out", str(out)]) == 2
    assert "no results for set 'alpaca'" in capsys.readouterr().err
    assert ablation_main(["--row", "no-equals-sign", "--out", str(out)]) == 2
    assert ablation_main(["--row", f"x={tmp_path / 'missing.json'}", "--out", str(out)]) == 2


def test_ablation_row_reads_the_trainer_summary_next_to_an_exported_draft(tmp_path):
    from sglang_eagle3.bench.ablation import train_summary
    out = tmp_path / "run"
    (out / "draft").mkdir(parents=True)
    summary = {"export": str(out / "draft"), "steps": 7, "train_tokens": 1234,
               "final_eval": {"acc_0": 0.5, "accept_length": 1.7}, "config": {"features": "top"}}
    (out / "train_summary.json").write_text(json.dumps(summary))
    got = train_summary(str(out / "draft"))
    assert got["final_eval"]["acc_0"] == 0.5 and got["train_tokens"] == 1234 and got["features"] == "top"
    summary["export"] = str(tmp_path / "elsewhere")                 # a summary of another export: ignored
    (out / "train_summary.json").write_text(json.dumps(summary))
    assert train_summary(str(out / "draft")) is None


def test_ablation_per_step_table_lists_every_acc_k():
    from sglang_eagle3.bench.ablation import per_step_table
    rows = [{"label": "a", "train": {"final_eval": {"acc_0": 0.5, "acc_1": 0.25, "accept_length": 1.7}}},
            {"label": "b", "train": None}]
    md = per_step_table(rows)
    header = next(l for l in md.splitlines() if l.startswith("| Draft"))
    assert [c.strip() for c in header.strip("|").split("|")] == ["Draft", "acc_0", "acc_1"]
    line_a = next(l for l in md.splitlines() if l.startswith("| a"))
    assert "0.5" in line_a and "0.25" in line_a and "accept_length" not in md
    assert per_step_table([{"label": "b", "train": None}]) == ""


def test_ablation_table_refuses_files_that_are_not_acceptance_results(tmp_path, capsys):
    from sglang_eagle3.bench.ablation import main as ablation_main
    other = tmp_path / "other.json"
    other.write_text(json.dumps({"sets": {}, "config": {}}))          # right keys, no bench_acceptance format tag
    broken = tmp_path / "broken.json"
    broken.write_text("{not json")
    out = str(tmp_path / "abl.json")
    assert ablation_main(["--row", f"x={other}", "--out", out]) == 2
    assert "not a bench_acceptance result" in capsys.readouterr().err
    assert ablation_main(["--row", f"x={broken}", "--out", out]) == 2
    assert "broken.json: not valid JSON" in capsys.readouterr().err


def test_trainer_speed_reports_every_configuration(env, tmp_path, capsys):
    from sglang_eagle3.bench.trainer_speed import main as trainer_main
    rows = tmp_path / "rows.jsonl"
    rows.write_text("".join(json.dumps({"input_ids": [(i * 7 + j) % 90 for j in range(30)],
                                        "loss_mask": [0] * 10 + [1] * 20}) + "\n" for i in range(3)))
    out = tmp_path / "trainer.json"
    assert trainer_main(["--target", env["target"], "--data", str(rows), "--rows", "2", "--min-len", "10",
                         "--max-len", "40", "--rounds", "1", "--ttt-length", "3", "--threads", "1", "--pack", "2",
                         "--out", str(out)]) == 0
    r = json.loads(out.read_text())
    assert set(r["configs"]) == {"fp32 (before)", "fp32", "bf16 autocast (after)",
                                 "bf16 autocast, online (target features each step)",
                                 "bf16 autocast, 2 rows packed per forward",
                                 "bf16 autocast, 2 rows packed per forward, online (`make train ONLINE=1`)",
                                 "bf16 autocast, 2 rows packed per forward, every chain grown",
                                 "bf16 autocast, 2 rows packed per forward, loss in PyTorch ops (no csrc kernels), "
                                 "every chain grown"}
    assert all(c["tokens_per_s"] > 0 and c["fraction_of_peak"] > 0 for c in r["configs"].values())
    # 10 prompt tokens per row: steps 1-2 skip the chains that end in them, so fewer FLOPs for the same tokens
    assert 0 < r["model_gflop_per_round"] < r["model_gflop_per_round_every_chain_grown"]
    assert r["tokens_per_round"] == 60 and "online" in capsys.readouterr().out
    assert trainer_main(["--target", env["target"], "--data", str(rows), "--rows", "5", "--out", str(out)]) == 2
    assert "fewer than 5 rows" in capsys.readouterr().err


def test_bench_decode_end_to_end_on_a_tiny_target(env, tmp_path):
    """Every CPU part but llama.cpp / compile runs, writes JSON + Markdown + PNG, marks the targets, and uses the
    draft's tuned batch-1 tree as the demo tree."""
    import importlib.util
    import shutil
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    spec = importlib.util.spec_from_file_location("bench_decode", os.path.join(root, "bench", "bench_decode.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    draft = tmp_path / "draft"
    shutil.copytree(env["draft"], draft)
    (draft / "spec_profile.json").write_text(json.dumps({"per_batch_size": {
        "1": {"num_steps": 2, "topk": 1, "num_draft_tokens": 3}}}))
    out = tmp_path / "decode.json"
    assert mod.main(["--target", env["target"], "--draft", str(draft), "--data", env["data"], "--dtype", "float32",
                     "--parts", "speed,step,trees,profile", "--n", "1", "--tree-prompts", "1", "--repeats", "2",
                     "--tree-sizes", "1,2,8", "--trees", "1,1,2", "--max-new-tokens", "4", "--context", "16",
                     "--profile-batches", "1", "--threads", "1", "--out", str(out)]) == 0
    r = json.loads(out.read_text())
    assert r["meta"]["demo_tree"] == [2, 1, 3]
    assert [t["tree"]["num_steps"] for t in r["trees"]["trees"]] == [1, 2]      # the demo tree was added
    md = (tmp_path / "decode.md").read_text()
    assert "demo tree (2/1/3)" in md and "verify of 8 tokens" in md
    assert (tmp_path / "decode.png").read_bytes()[:8] == PNG_MAGIC


def test_bench_step_alternates_runtimes_and_sizes_within_each_repeat(monkeypatch):
    """A slow spell must hit every runtime alike: each repeat times every runtime at every size before the next
    repeat starts, the first two repeats are warm-up, and T=1 is always measured (costs are relative to it)."""
    from sglang_eagle3.bench import decode as D
    calls = []

    def fake_prepared(tm, context, T, batch=1):
        def forward():
            calls.append((tm, T))
            return {"a": 0.010, "b": 0.020}[tm] * (1 + T / 8)
        return forward

    class FakeRuntimes:
        mode = {"a": "auto", "b": "auto"}
        kernels = {"a": "avx512f", "b": "avx2"}
        fused = type("T", (), {"weight_bytes": lambda self: 1_000_000,
                               "forward_flops": lambda self, context, T: 1e9 * T})()

        def step_runtimes(self):
            return ["a", "b"]

        def target(self, name):
            return name
    monkeypatch.setattr(D, "prepared_forward", fake_prepared)
    monkeypatch.setattr(D, "read_bandwidth_gbs", lambda: 10.0)
    monkeypatch.setattr(D, "peak_matmul_gflops", lambda: 100.0)
    out = D.bench_step(FakeRuntimes(), 16, [8, 2], repeats=3)
    one_repeat = [("a", 1), ("a", 2), ("a", 8), ("b", 1), ("b", 2), ("b", 8)]
    assert calls == one_repeat * 5 and out["alternated"] and out["repeats"] == 3
    assert out["a"]["step_s"] == pytest.approx(0.010 * 9 / 8) and out["b"]["step_s"] == pytest.approx(0.020 * 9 / 8)
    assert out["a"]["verify_relative"]["8"] == pytest.approx(2 / (9 / 8))
    assert out["a"]["verify_gflops"]["8"] == pytest.approx(8 / (0.010 * 2)) and out["peak_gflops"] == 100.0
    assert out["a"]["few_row_kernel"] == "avx512f" and out["b"]["few_row_kernel"] == "avx2"


def test_llamacpp_table_shows_each_rows_own_vanilla(tmp_path):
    """bench_llamacpp's rows carry the vanilla measured beside them; the table and the plot show it."""
    from sglang_eagle3.bench.llamacpp import plot, render
    row = {"draft_length": 1, "llamacpp_drafted": 10, "llamacpp_accepted": 4, "llamacpp_accept_rate": 0.4,
           "llamacpp_tau": 1.4, "llamacpp_tokens_per_s": 90.0, "llamacpp_vanilla_tokens_per_s": 100.0,
           "llamacpp_speedup": 0.9, "ours_tau": 1.38, "ours_tokens_per_s": 110.0, "ours_vanilla_tokens_per_s": 100.0,
           "ours_speedup": 1.1, "ours_accept_rate": 0.38}
    r = {"threads": 2, "prompts": 3, "max_new_tokens": 8, "draft": "D", "rows": [row, {**row, "draft_length": 2}]}
    text = render(r)
    assert "measured beside it" in text and " 100.0 |" in text and "0.90x" in text and "1.10x" in text
    assert os.path.exists(plot(r, str(tmp_path / "x.png")))


def test_learning_curve_trend_extrapolates_the_later_half():
    from sglang_eagle3.bench.curve import trend, trend_text
    toks = [1e6 * 2 ** (i / 2) for i in range(9)]                 # 1M .. 16M tokens
    pts = [{"tokens_total": t, "tau": {"a": 1.0 + 0.5 * math.log2(t / 1e6), "b": 2.0 - 0.01 * i}}
           for i, t in enumerate(toks)]
    pts[0]["tau"]["a"] = 9.0                                        # before the later half: not fitted
    t = trend(pts, "a", 3.0)
    assert t["points_fitted"] == 3 and t["from_tokens"] == toks[6]
    assert t["gain_per_doubling"] == pytest.approx(0.5) and t["tokens_for_goal"] == pytest.approx(16e6)
    flat = trend(pts, "b", 3.0)
    assert flat["tokens_for_goal"] is None and "does not rise" in trend_text({"b": flat}, 3.0)
    few = trend(pts[:2], "a", 3.0)
    assert few["points_fitted"] == 2 and "gain_per_doubling" not in few and "too few" in trend_text({"a": few}, 3.0)


def test_tune_sampled_into_a_greedy_profile(env, tmp_path, capsys):
    """--sampled-into PROFILE adds the sampled run's best trees to PROFILE (the rest unchanged); without
    --temperature > 0, or with no such profile, it is refused in one line before anything is measured."""
    greedy = tmp_path / "prof.json"
    base = ["--target", env["target"], "--draft", env["draft"], "--dataset", "gsm8k", "--n", "2", "--max-new-tokens",
            "4", "--ignore-eos", "--batch-sizes", "1", "--num-steps-grid", "1", "--topk-grid", "1,2",
            "--num-draft-tokens-grid", "2,3", "--threads", "1"]
    assert tune_main(base + ["--out", str(greedy)]) == 0
    before = json.loads(greedy.read_text())
    assert tune_main(base + ["--out", str(tmp_path / "t1.json"), "--sampled-into", str(greedy)]) == 2
    assert "--sampled-into needs --temperature" in capsys.readouterr().err
    assert tune_main(base + ["--out", str(tmp_path / "t1.json"), "--temperature", "1",
                             "--sampled-into", str(tmp_path / "none.json")]) == 2
    assert "no such profile" in capsys.readouterr().err
    assert tune_main(base + ["--out", str(tmp_path / "t1.json"), "--temperature", "1", "--sampled-into", str(greedy)]) == 0
    after = json.loads(greedy.read_text())
    sampled = json.loads((tmp_path / "t1.json").read_text())
    assert after["per_batch_size"] == before["per_batch_size"]
    assert after["sampled"]["per_batch_size"] == sampled["per_batch_size"] and after["sampled"]["temperature"] == 1.0


def test_tune_host_table_into_a_profile(env, tmp_path, capsys):
    """--host-table-into PROFILE stores the run's best trees as the table for this kind of host (by_host[kind]);
    SpecProfile.load then takes them on such a host and the profile's own table elsewhere. A sampled host table
    needs the greedy one first; a missing profile is refused in one line."""
    from sglang_eagle3.engine.profile import SpecProfile, host_kind
    from sglang_eagle3.engine.speculation import SpecConfig
    prof = tmp_path / "prof.json"
    base = ["--target", env["target"], "--draft", env["draft"], "--dataset", "gsm8k", "--n", "2", "--max-new-tokens",
            "4", "--ignore-eos", "--batch-sizes", "1", "--num-steps-grid", "1", "--topk-grid", "1,2",
            "--num-draft-tokens-grid", "2,3", "--threads", "1"]
    assert tune_main(base + ["--out", str(prof)]) == 0
    assert tune_main(base + ["--out", str(tmp_path / "h.json"), "--host-table-into", str(tmp_path / "none.json")]) == 2
    assert "no such profile" in capsys.readouterr().err
    assert tune_main(base + ["--out", str(tmp_path / "s.json"), "--temperature", "1",
                             "--host-table-into", str(prof)]) == 2
    assert "no greedy table for host kind" in capsys.readouterr().err
    # a profile whose own table says 1/1/2 at batch 1 and 1/2/2 from batch 4 on; this host's table is the measured
    # one at batch 1 (the size this run measured) and keeps the profile's tree at batch 4 (not measured)
    data = json.loads(prof.read_text())
    four = {"speculation": True, "num_steps": 1, "topk": 2, "num_draft_tokens": 2}
    data["per_batch_size"] = {"1": {"speculation": True, "num_steps": 1, "topk": 1, "num_draft_tokens": 2}, "4": four}
    prof.write_text(json.dumps(data))
    assert tune_main(base + ["--out", str(tmp_path / "h.json"), "--host-table-into", str(prof)]) == 0
    assert "added the table for" in capsys.readouterr().out
    after, measured = json.loads(prof.read_text()), json.loads((tmp_path / "h.json").read_text())
    kind = host_kind()
    assert after["per_batch_size"] == data["per_batch_size"]
    assert after["by_host"][kind]["per_batch_size"] == {"1": measured["per_batch_size"]["1"], "4": four}
    entry = after["by_host"][kind]                     # what was measured, by name and command: no machine paths
    assert entry["dataset"] == "gsm8k" and "grid" not in entry and str(tmp_path) not in json.dumps(entry)
    assert entry["command"].startswith("python bench/tune_spec.py") and "--host-table-into prof.json" in entry["command"]
    assert SpecProfile.load(str(prof)).for_batch_size(8) == SpecConfig(1, 2, 2)
    here, other = SpecProfile.load(str(prof)), SpecProfile.load(str(prof), host="some-other-kind")
    assert here.host == kind and f"[{kind}]" in here.source and other.host is None
    assert other.for_batch_size(1) == SpecConfig(1, 1, 2)
    m = measured["per_batch_size"]["1"]
    want = SpecConfig(m["num_steps"], m["topk"], m["num_draft_tokens"]) if m.get("speculation", True) else None
    assert here.for_batch_size(1) == want
    assert tune_main(base + ["--out", str(tmp_path / "s.json"), "--temperature", "1",
                             "--host-table-into", str(prof)]) == 0
    after = json.loads(prof.read_text())
    assert after["by_host"][kind]["sampled"]["temperature"] == 1.0 and "per_batch_size" in after["by_host"][kind]
    assert str(tmp_path) not in json.dumps(after["by_host"][kind])
    assert SpecProfile.load(str(prof)).sampled is not None
    data["by_host"] = ["not", "an", "object"]
    prof.write_text(json.dumps(data))
    with pytest.raises(Exception, match="by_host"):
        SpecProfile.load(str(prof))


def test_tune_long_context_table_into_a_host_table(env, tmp_path, capsys):
    """--long-context N --host-table-into PROFILE stores the run's best trees as this host's table for steps at N
    tokens or more (by_host[kind].long_context), next to its batch-size table, which stays as it was; without
    --host-table-into, at --temperature > 0, or over prompts shorter than N it is refused in one line before
    anything is measured."""
    from sglang_eagle3.engine.profile import SpecProfile, host_kind
    prof = tmp_path / "prof.json"
    base = ["--target", env["target"], "--draft", env["draft"], "--dataset", "gsm8k", "--n", "2", "--max-new-tokens",
            "4", "--ignore-eos", "--batch-sizes", "1", "--num-steps-grid", "1", "--topk-grid", "1,2",
            "--num-draft-tokens-grid", "2,3", "--threads", "1"]
    assert tune_main(base + ["--out", str(prof)]) == 0
    for extra, phrase in ((["--long-context", "4"], "needs --host-table-into"),
                          (["--long-context", "4", "--temperature", "1", "--host-table-into", str(prof)],
                           "greedy tables only"),
                          (["--long-context", "0", "--host-table-into", str(prof)], "must be >= 1"),
                          (["--long-context", "100000", "--host-table-into", str(prof)], "median of")):
        assert tune_main(base + ["--out", str(tmp_path / "l.json"), *extra]) == 2
        err = capsys.readouterr().err
        assert phrase in err.strip().splitlines()[-1], err             # one line, after any loading bars
    assert tune_main(base + ["--out", str(tmp_path / "h.json"), "--host-table-into", str(prof)]) == 0
    host_table = json.loads(prof.read_text())["by_host"][host_kind()]["per_batch_size"]
    assert tune_main(base + ["--out", str(tmp_path / "l.json"), "--long-context", "2", "--host-table-into",
                             str(prof)]) == 0                      # the tiny set's prompts: 2 tokens (median)
    assert "at 2+ tokens" in capsys.readouterr().out
    entry = json.loads(prof.read_text())["by_host"][host_kind()]
    measured = json.loads((tmp_path / "l.json").read_text())["per_batch_size"]
    assert entry["per_batch_size"] == host_table
    assert entry["long_context"]["min_tokens"] == 2 and entry["long_context"]["per_batch_size"] == measured
    assert SpecProfile.load(str(prof)).long_context[0] == 2


def test_tune_reruns_the_tree_the_profile_holds(env, tmp_path, capsys):
    """A draft whose spec_profile.json holds a tree outside the grid: that tree is measured at its batch size and
    run again with the confirmation (--confirm 1: vanilla, the fastest grid tree and it), so a re-tune chooses
    between the two on equal terms; --no-incumbent measures the grid alone."""
    import shutil
    draft = tmp_path / "draft"
    shutil.copytree(env["draft"], draft)
    held = {"num_steps": 2, "topk": 1, "num_draft_tokens": 3}
    (draft / "spec_profile.json").write_text(json.dumps({"format": "sglang_eagle3.spec_profile/1", "per_batch_size": {
        "1": {"speculation": True, **held}}}))
    base = ["--target", env["target"], "--draft", str(draft), "--dataset", "gsm8k", "--n", "2", "--max-new-tokens",
            "4", "--ignore-eos", "--batch-sizes", "1", "--num-steps-grid", "1", "--topk-grid", "1,2",
            "--num-draft-tokens-grid", "2,3", "--threads", "1", "--confirm", "1", "--confirm-repeats", "2"]
    assert tune_main(base + ["--out", str(tmp_path / "p.json")]) == 0
    rows = json.loads((tmp_path / "p.grid.json").read_text())["rows"]
    by_key = {tree_key(r["tree"]): r for r in rows}
    assert set(by_key) == {tree_key(None), tree_key(held)} | {tree_key(t) for t in tree_grid([1], [1, 2], [2, 3])}
    mine = by_key[tree_key(held)]
    assert mine["incumbent"] is True and mine["confirmed"] is True and mine["repeats"] == 1 + 2
    assert sum(1 for r in rows if r.get("confirmed")) == 2 and by_key[tree_key(None)]["repeats"] == 3
    assert mine["identical_to_vanilla"] is True
    md = (tmp_path / "p.md").read_text()
    assert f"competed beside the grid and in the confirmation runs: bs 1 {tree_key(held)}." in md
    assert str(draft / "spec_profile.json") in md
    chosen = json.loads((tmp_path / "p.json").read_text())["per_batch_size"]["1"]
    if chosen.get("speculation"):
        assert tree_key({k: chosen[k] for k in held}) in {tree_key(r["tree"]) for r in rows if r.get("confirmed")}
    assert tune_main(base + ["--out", str(tmp_path / "q.json"), "--no-incumbent"]) == 0
    rows = json.loads((tmp_path / "q.grid.json").read_text())["rows"]
    assert tree_key(held) not in {tree_key(r["tree"]) for r in rows} and not any(r.get("incumbent") for r in rows)
    assert "competed" not in (tmp_path / "q.md").read_text()
    (draft / "spec_profile.json").write_text("{not json")
    capsys.readouterr()
    assert tune_main(base + ["--out", str(tmp_path / "r.json")]) == 2
    err = [line for line in capsys.readouterr().err.splitlines() if "cpp_extension" not in line]
    assert len(err) == 1 and "spec_profile.json: not valid JSON" in err[0]


def test_bench_fidelity_end_to_end_on_a_tiny_target(env, tmp_path, capsys):
    """Every path this CPU runs against the fp32 reference: JSON + Markdown + PNG; our float32 runtime agrees
    at every step; misses are binned by the reference's margin; an unknown path is one clear error."""
    from sglang_eagle3.bench.fidelity import available_paths
    from sglang_eagle3.bench.fidelity import main as fidelity_main
    out = tmp_path / "fid.json"
    assert fidelity_main(["--target", env["target"], "--data", env["data"], "--datasets", "mt_bench,gsm8k",
                          "--n", "3", "--tokens", "6", "--threads", "1", "--out", str(out)]) == 0
    r = json.loads(out.read_text())
    assert list(r["paths"]) == available_paths() and r["prompts"] == 3
    for name, s in r["paths"].items():
        assert s["steps"] == sum(b["steps"] for b in s["misses_by_margin"]) == len(
            [t for ref in r["reference_tokens"] for t in ref])
        assert s["misses"] == sum(b["misses"] for b in s["misses_by_margin"])
    assert r["paths"]["float32"]["misses"] == 0 and r["paths"]["float32"]["prompts_equal_to_reference"] == 3
    assert "| float32" in (tmp_path / "fid.md").read_text()
    assert (tmp_path / "fid.png").read_bytes()[:8] == PNG_MAGIC
    capsys.readouterr()
    assert fidelity_main(["--target", env["target"], "--data", env["data"], "--paths", "tpu", "--out",
                          str(out)]) == 2
    assert "--paths tpu: not available on this machine" in capsys.readouterr().err
    assert fidelity_main(["--target", str(tmp_path / "missing"), "--out", str(out)]) == 2
    assert f"--target {tmp_path / 'missing'}: no such folder" in capsys.readouterr().err


def test_fidelity_summary_bins_misses_by_the_reference_margin():
    from sglang_eagle3.bench.fidelity import compare, summarize
    ref = torch.tensor([[5.0, 4.95, 0.0], [3.0, 0.0, 0.0], [1.0, 0.8, 0.0]])      # margins 0.05, 3.0, 0.2
    got = torch.tensor([[4.9, 5.0, 0.0], [3.0, 0.1, 0.0], [0.7, 0.9, 0.0]])      # misses at steps 0 and 2
    s = summarize([compare(ref, [0, 0, 0], got)])
    assert s["misses"] == 2 and s["steps"] == 3 and s["first_miss"] == [0] and s["prompts_equal_to_reference"] == 0
    assert [b["misses"] for b in s["misses_by_margin"]] == [1, 1, 0, 0, 0]
    assert abs(s["max_margin_missed"] - 0.2) < 1e-6 and abs(s["margin_at_first_miss"][0] - 0.05) < 1e-6


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
    for bad in ("eagle,eagle", "medusa", "hybrid-fast"):
        with pytest.raises(Exception, match="--drafters"):
            parse_drafters(bad)


def test_acceptance_refuses_drafter_flags_it_would_ignore_before_any_work(env, tmp_path, capsys):
    """--drafter / --tree in the plain benchmark (it measured EAGLE under a "(from no draft)" banner), --drafter,
    --tree or --baseline-draft beside --drafters (the columns name the drafters), an empty --drafters (it ran the
    plain benchmark), a column that needs a draft under --draft none (it said no draft was shipped) and a
    --choose-into that cannot be written (found after the whole run) or given without --drafters: one line each,
    before any model loads or any output is written."""
    out = tmp_path / "a.json"
    profile = tmp_path / "p.json"
    profile.write_text(json.dumps({"per_batch_size": {"1": {"num_steps": 3, "topk": 2, "num_draft_tokens": 6}}}))
    cases = [(["--drafter", "suffix"], "--drafter suffix"), (["--tree", "auto"], "--tree auto"),
             (["--drafters", "eagle", "--drafter", "suffix"], "--drafter suffix"),
             (["--drafters", "eagle-auto", "--tree", "profile"], "--tree profile"),
             (["--drafters", "eagle", "--baseline-draft", env["draft"]], "--baseline-draft"),
             (["--drafters", ""], "--drafters ''"),
             (["--drafters", "suffix,hybrid", "--draft", "none"], "--drafters suffix,hybrid: hybrid"),
             (["--draft", "none"], "--draft none"),
             (["--drafters", "eagle", "--choose-into", str(tmp_path / "missing" / "p.json")], "--choose-into"),
             (["--choose-into", str(profile)], "--choose-into"),
             (["--threads", "-1"], "--threads must be >= 1, got -1"),                  # it was a traceback
             (["--datasets", "mt_bench_turn2"], "--datasets mt_bench_turn2: built from mt_bench by bench_acceptance "
              "--drafters only")]                                    # it ran MT-bench's first turns under that name
    for extra, said in cases:
        assert acceptance(env, out, "--datasets", "gsm8k", *extra) == 2, extra
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and said in err and "no shipped draft" not in err, (extra, err)
    assert not out.exists() and not (tmp_path / "missing").exists()
    # the context drafter alone needs no draft: --draft none runs it (the tree flags shape no column there)
    assert acceptance(env, out, "--datasets", "gsm8k", "--drafters", "suffix", "--draft", "none") == 0
    res = json.loads(out.read_text())
    assert res["columns"] == ["suffix"] and res["sets"]["gsm8k"]["suffix"]["identical_to_vanilla"] == 2
    assert tune_main(["--target", env["target"], "--draft", env["draft"], "--dataset", "code_edit", "--out",
                      str(tmp_path / "t.json")]) == 2                        # the other benchmarks: the same refusal
    assert "--datasets code_edit: built from humaneval" in capsys.readouterr().err


def test_shipped_draft_files_hold_no_machine_paths():
    """The draft folder ships to users: its JSON files record what was run, not where (no /work, /root, /home or
    /tmp paths: tune_spec and learning_curve write repository-relative, ~/ or bare names)."""
    import re

    from sglang_eagle3.paths import REPO_ROOT
    folder = os.path.join(REPO_ROOT, "checkpoints", "smollm2-135m-eagle3")
    machine = re.compile(r"(?<![\w.~$-])/(?:work|root|home|tmp|Users)/")
    for name in sorted(os.listdir(folder)):
        if name.endswith((".json", ".md")):
            with open(os.path.join(folder, name)) as f:
                hit = machine.search(f.read())
            assert hit is None, f"{name}: machine path at {hit.start()}"


def test_portable_paths_drop_the_machine(tmp_path):
    from sglang_eagle3.bench.curve import shareable_path
    from sglang_eagle3.bench.tune import portable_path
    from sglang_eagle3.paths import REPO_ROOT
    assert portable_path(os.path.join(REPO_ROOT, "results", "x.json")) == os.path.join("results", "x.json")
    assert portable_path("/elsewhere/data/eval/mt_bench.jsonl") == "mt_bench.jsonl"
    assert portable_path("relative/as/typed") == "relative/as/typed"
    assert shareable_path(os.path.expanduser("~/runs/a")) == "~/runs/a"
    assert os.path.abspath(os.path.expanduser(shareable_path(str(tmp_path)))) == str(tmp_path)


def test_bench_scripts_refuse_bad_flags_in_one_line(capsys, monkeypatch, tmp_path):
    """bench_decode --parts, bench_serving's flags and bench_llamacpp's (and a missing llama.cpp build): one line
    naming the flag, exit 2, before any model loads."""
    import socket

    from sglang_eagle3.bench import llamacpp as bench_llamacpp
    from sglang_eagle3.bench.decode_cli import main as decode_main
    from sglang_eagle3.bench.serving import main as serving_main
    from sglang_eagle3.formats import llamacpp
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        nobody = f"http://127.0.0.1:{s.getsockname()[1]}"              # closed again: nothing listens there
    cases = [(decode_main, ["--parts", "speed,warp"], "--parts warp: choose from"),
             (serving_main, ["--start", "builtin", "--concurrency", "1,x"], "--concurrency must be comma-separated"),
             (serving_main, ["--start", "builtin", "--concurrency", "0"], "--concurrency levels must be >= 1"),
             (serving_main, ["--concurrency", "1"], "give --url NAME=URL"),
             (serving_main, ["--url", "nourl", "--concurrency", "1", "--out", str(tmp_path / "s.json")],
              "--url 'nourl': expected NAME=URL"),
             # a server that does not answer: named before any data is read (it was an httpx traceback)
             (serving_main, ["--url", f"a={nobody}/v1", "--data", str(tmp_path / "no-data"), "--out",
                             str(tmp_path / "s.json")], f"--url a={nobody}/v1: no server answers there (ConnectError"),
             (serving_main, ["--start", "builtin", "--requests", "0"], "--requests must be >= 1, got 0"),
             (serving_main, ["--start", "builtin", "--max-tokens", "0"], "--max-tokens must be >= 1, got 0"),
             (serving_main, ["--start", "builtin", "--temperature", "-1"], "--temperature must be >= 0, got -1"),
             (serving_main, ["--start", "builtin", "--timeout", "0"], "--timeout must be > 0, got 0"),
             (bench_llamacpp.main, ["--draft-lengths", "1,two"], "--draft-lengths must be comma-separated integers"),
             (bench_llamacpp.main, ["--draft-lengths", "0,2"], "--draft-lengths must all be >= 1")]
    for main, argv, phrase in cases:
        assert main(argv) == 2, argv
        err = capsys.readouterr().err.strip()
        assert phrase in err and "Traceback" not in err and len(err.splitlines()) == 1, (argv, err)
    monkeypatch.setattr(llamacpp, "is_built", lambda: False)
    assert bench_llamacpp.main([]) == 2
    assert "no llama.cpp build: run `make llamacpp` first" in capsys.readouterr().err
