#!/usr/bin/env python
"""Trainer throughput: fp32 vs bf16 autocast, alternated, with model FLOP/s against the matmul peak.

    python bench/bench_trainer.py --data RUN/data [--profile] --out results/bench_trainer.json
"""
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from sglang_eagle3.bench.trainer_speed import main  # noqa: E402

if __name__ == "__main__":
    raise SystemExit(main())
