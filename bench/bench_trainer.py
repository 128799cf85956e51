#!/usr/bin/env python
"""Trainer throughput: fp32 vs bf16 autocast, alternated, with model FLOP/s against the matmul peak.

    python bench/bench_trainer.py --data RUN/data [--profile] --out results/bench_trainer.json
"""
from sglang_eagle3.bench.trainer_speed import main

if __name__ == "__main__":
    raise SystemExit(main())
