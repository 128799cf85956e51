"""bench/bench_fidelity.py: each runtime path against the fp32 reference, misses binned by the reference's margin."""
from __future__ import annotations

import json

import bench_env
import torch
from bench_env import PNG_MAGIC

env, keep_threads = bench_env.env, bench_env.keep_threads             # the shared fixtures; keep_threads is autouse


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
