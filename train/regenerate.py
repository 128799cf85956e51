#!/usr/bin/env python
"""Replace the answers of chat data with the target's own answers: same as `eagle3 regenerate` (see --help).

Examples:
  python train/regenerate.py ../shared/data/train/sharegpt_prompts.jsonl --out data/regen.jsonl \
      --target ~/.cache/sglang_eagle3/SmolLM2-135M-Instruct --max-new-tokens 512
  python train/regenerate.py ../shared/data/train/sharegpt_1k.jsonl --out data/regen.jsonl \
      --server http://127.0.0.1:30000/v1 --model default --concurrency 64
"""
import sys

from sglang_eagle3.cli import main

if __name__ == "__main__":
    sys.exit(main(["regenerate", *sys.argv[1:]]))
