#!/usr/bin/env bash
# The GPU path in one go (< 8 minutes on one GPU): the GPU tests, then bench_decode on CUDA (CUDA graphs vs
# eager, decode step and verify cost), JSON + Markdown + PNG under ${OUT:-results}.
#   bash bench/gpu_check.sh            # in the project venv (make venv), on a machine with a CUDA GPU
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-$( [ -x .venv/bin/python ] && echo .venv/bin/python || echo python )}
OUT=${OUT:-results}
mkdir -p "$OUT"
$PY -c "import torch; assert torch.cuda.is_available(), 'no CUDA device'; print('GPU:', torch.cuda.get_device_name())"
$PY -m pytest -q -x tests/engine/test_gpu.py 2>&1 | tail -3
timeout 420 $PY bench/bench_decode.py --device cuda --dtype bfloat16 --parts speed,step --n 4 --max-new-tokens 64 \
    --tree-sizes 1,4,8,16,32,64 --repeats 20 --out "$OUT/bench_decode_gpu.json"
