"""bench/bench_trainer.py: every trainer configuration is timed on a tiny random target."""
from __future__ import annotations

import json

import bench_env

env, keep_threads = bench_env.env, bench_env.keep_threads             # the shared fixtures; keep_threads is autouse


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
