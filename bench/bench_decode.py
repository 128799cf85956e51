#!/usr/bin/env python
"""What decides speculative decoding speed on this machine: sglang_eagle3/bench/decode_cli.py (--help)."""
from sglang_eagle3.bench.decode_cli import main

if __name__ == "__main__":
    raise SystemExit(main())
