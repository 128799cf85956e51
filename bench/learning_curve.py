#!/usr/bin/env python
"""τ and held-out accuracy against training tokens, from a run's kept checkpoints (eagle3 train --keep-every N).

    python bench/learning_curve.py --run RUN [--run RUN2 ...] --out checkpoints/DRAFT/learning_curve.json
"""
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from sglang_eagle3.bench.curve import main  # noqa: E402

if __name__ == "__main__":
    raise SystemExit(main())
