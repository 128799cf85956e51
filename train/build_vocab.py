#!/usr/bin/env python
"""Choose the draft vocab from a prepared dataset: same as `eagle3 build-vocab` (see --help).

Example:
  python train/build_vocab.py data/smollm2 --draft-vocab-size 8192
"""
import sys

from sglang_eagle3.cli import main

if __name__ == "__main__":
    sys.exit(main(["build-vocab", *sys.argv[1:]]))
