#!/usr/bin/env python
"""τ and held-out accuracy against training tokens, from a run's kept checkpoints (eagle3 train --keep-every N).

    python bench/learning_curve.py --run RUN [--run RUN2 ...] --out checkpoints/DRAFT/learning_curve.json
"""
from sglang_eagle3.bench.curve import main

if __name__ == "__main__":
    raise SystemExit(main())
