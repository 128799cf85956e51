"""bench/bench_decode.py end to end on a tiny random target, and how bench_step orders its timings."""
from __future__ import annotations

import json
import os

import bench_env
import pytest
from bench_env import PNG_MAGIC

env, keep_threads = bench_env.env, bench_env.keep_threads             # the shared fixtures; keep_threads is autouse


def test_bench_decode_end_to_end_on_a_tiny_target(env, tmp_path):
    """Every CPU part but llama.cpp / compile runs, writes JSON + Markdown + PNG, marks the targets, and uses the
    draft's tuned batch-1 tree as the demo tree."""
    import importlib.util
    import shutil
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
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
