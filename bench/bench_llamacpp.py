#!/usr/bin/env python
"""llama.cpp (pinned build, `make llamacpp`) with and without our draft, beside our engine on the same draft,
prompts and chain length.

    python bench/bench_llamacpp.py [--draft checkpoints/smollm2-135m-eagle3] [--draft-lengths 1,2,3,4]
"""
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from sglang_eagle3.bench.llamacpp import main  # noqa: E402

if __name__ == "__main__":
    raise SystemExit(main())
