#!/usr/bin/env python
"""Train an EAGLE-3 draft: same as `eagle3 train` (see --help).

GPU (DeepSpeed ZeRO, bf16):
  deepspeed --num_gpus 8 train/train_eagle3.py --target TARGET --data dumps/x --out runs/x \
      --deepspeed-config train/ds_zero2.json
CPU (gloo, fp32):
  torchrun --nproc_per_node 2 train/train_eagle3.py --target TARGET --data dumps/x --out runs/x
Online (no dump; the target computes features per batch): pass a prepare-data directory as --data.
Resume after a crash: the same command plus --resume.
"""
import sys

from sglang_eagle3.cli import main

if __name__ == "__main__":
    sys.exit(main(["train", *sys.argv[1:]]))
