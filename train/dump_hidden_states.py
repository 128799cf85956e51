#!/usr/bin/env python
"""Store the target's EAGLE-3 features for offline draft training: same as `eagle3 dump-hidden-states`.

Examples:
  python train/dump_hidden_states.py --target ~/.cache/sglang_eagle3/SmolLM2-135M-Instruct \
      --data data/smollm2 --out dumps/smollm2
  torchrun --nproc_per_node 8 train/dump_hidden_states.py --target ... --data ... --out ...   # one shard set per GPU
A killed run resumes where it stopped when started again with the same arguments. After the data grew,
  ... --data data/smollm2_v2 --out dumps/smollm2_v2 --reuse dumps/smollm2
copies the rows the first dump holds and runs the target over the new ones only.
"""
import sys

from sglang_eagle3.cli import main

if __name__ == "__main__":
    sys.exit(main(["dump-hidden-states", *sys.argv[1:]]))
