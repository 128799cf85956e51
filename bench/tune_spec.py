#!/usr/bin/env python
"""Sweep the draft tree (num_steps, topk, num_draft_tokens) per batch size; keep the fastest.

Our engine (all trees in one run):
    python bench/tune_spec.py --target testbed --draft D --batch-sizes 1,2,4 --out results/spec_profile.json
A running SGLang server (its current tree; relaunch with the next tree and rerun with the same --out):
    python bench/tune_spec.py --sglang-url http://127.0.0.1:30000 --target T --out results/spec_profile.json
Writes the profile (sglang_eagle3/engine/profile.py reads, checks and merges it) and SGLang's
--speculative-adaptive-config file.
"""
from sglang_eagle3.bench.tune import main

if __name__ == "__main__":
    raise SystemExit(main())
