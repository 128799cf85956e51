#!/usr/bin/env python
"""Serving benchmark across concurrency: our server (vanilla vs EAGLE-3 with adaptive speculation) or any
OpenAI-compatible servers such as SGLang's (same client, same requests).

    python bench/bench_serving.py --start builtin --concurrency 1,2,4,8,16,32,64 --out results/bench_serving.json
    python bench/bench_serving.py --url vanilla=http://127.0.0.1:30000/v1 --url EAGLE-3=http://127.0.0.1:30001/v1
"""
from sglang_eagle3.bench.serving import main

if __name__ == "__main__":
    raise SystemExit(main())
