#!/usr/bin/env python
"""Tokenize chat data for draft training: same as `eagle3 prepare-data` (see --help).

Example:
  python train/prepare_data.py ../shared/data/train/sharegpt_1k.jsonl ../shared/data/train/alpaca_en_demo.json \
      --target ~/.cache/sglang_eagle3/SmolLM2-135M-Instruct --out data/smollm2 --max-length 2048 \
      --draft-vocab-size 8192
"""
import sys

from sglang_eagle3.cli import main

if __name__ == "__main__":
    sys.exit(main(["prepare-data", *sys.argv[1:]]))
