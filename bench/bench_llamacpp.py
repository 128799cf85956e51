#!/usr/bin/env python
"""llama.cpp (pinned build, `make llamacpp`) with and without our draft, beside our engine on the same draft,
prompts and chain length.

    python bench/bench_llamacpp.py [--draft checkpoints/smollm2-135m-eagle3] [--draft-lengths 1,2,3,4]
"""
from sglang_eagle3.bench.llamacpp import main

if __name__ == "__main__":
    raise SystemExit(main())
