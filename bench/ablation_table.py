#!/usr/bin/env python
"""Several drafts' bench_acceptance results side by side (the EAGLE-3 paper's ablation table).

    python bench/ablation_table.py --row "EAGLE-3=results/abl_fused.json" --row "top layer=results/abl_top.json" \
        --sets mt_bench,gsm8k --out results/ablation.json
"""
from sglang_eagle3.bench.ablation import main

if __name__ == "__main__":
    raise SystemExit(main())
