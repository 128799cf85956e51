#!/usr/bin/env python
"""bf16 greedy fidelity of each decode path (AMX, AVX-512 BF16, eager PyTorch, transformers) against transformers
in float32, teacher-forced, with misses split by the reference's top-1/top-2 margin (see
sglang_eagle3/bench/fidelity.py).

    python bench/bench_fidelity.py [--n 20] [--tokens 64] [--paths amx,avx512,eager,transformers,float32] \
        --out results/bench_fidelity.json
"""
from sglang_eagle3.bench.fidelity import main

if __name__ == "__main__":
    raise SystemExit(main())
