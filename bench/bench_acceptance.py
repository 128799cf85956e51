#!/usr/bin/env python
"""Mean acceptance length and speed-up over vanilla decoding per eval set (EAGLE-3 paper's table).

    python bench/bench_acceptance.py --target testbed --draft D --datasets mt_bench,humaneval,gsm8k,alpaca,sum \
        --n 10 --max-new-tokens 256 --out results/acceptance.json
"""
from sglang_eagle3.bench.acceptance import main

if __name__ == "__main__":
    raise SystemExit(main())
