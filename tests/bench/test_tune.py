"""bench/tune_spec.py end to end on a tiny random target, the profile loader, SGLang's adaptive-config parser on
what we write, a fake SGLang server, and the machine-free paths the profiles record."""
from __future__ import annotations

import json
import os
import threading
import time
from http.server import ThreadingHTTPServer

import bench_env
import pytest
from bench_env import PNG_MAGIC
from conftest import JSONHandler

from sglang_eagle3.bench import report
from sglang_eagle3.bench.tune import main as tune_main
from sglang_eagle3.bench.tune import profile_tree_at
from sglang_eagle3.bench.tune_grid import ProfileError, adaptive_config, select_best, tree_grid, tree_key
from sglang_eagle3.engine.speculation import SpecConfig

env, keep_threads = bench_env.env, bench_env.keep_threads             # the shared fixtures; keep_threads is autouse


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
