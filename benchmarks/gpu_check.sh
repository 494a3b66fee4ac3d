#!/usr/bin/env bash
# GPU check for the torch backend: on a machine with a CUDA GPU and PyTorch already
# installed, run the torch parity tests on CUDA and the benchmark, writing results to
# $OUT (default bench-out/gpu). Budget: under 8 minutes.
#
#   bash benchmarks/gpu_check.sh                      # models from the registry (needs the package index)
#   TARGET=/models/qwen1.5b-hf DRAFT=/models/qwen0.5b-hf bash benchmarks/gpu_check.sh   # local HF folders
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-bench-out/gpu}
mkdir -p "$OUT"
{
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
  python -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda, torch.cuda.is_available())"
} > "$OUT/env.txt" 2>&1
# The torch backend needs no llama.cpp: install specdecode without its dependencies, then
# only what the torch tests import (PyTorch is already there).
pip install -q --no-deps -e . && pip install -q "transformers>=5.0" accelerate gguf scipy pytest tqdm platformdirs numpy jinja2 > "$OUT/pip.txt" 2>&1
SPECDECODE_TEST_DEVICE=cuda timeout 240 python -m pytest tests/test_torch_backend.py -q \
  -k "not cross_backend" 2>&1 | tee "$OUT/parity_tests.txt" | tail -3
timeout 300 python benchmarks/torch_bench.py --device cuda --dtype bfloat16 --max-tokens 128 \
  --target "${TARGET:-qwen2.5-coder-1.5b-instruct}" --draft "${DRAFT:-qwen2.5-coder-0.5b-instruct}" \
  --out "$OUT/torch_bench.json" 2>&1 | tee "$OUT/torch_bench.txt" | tail -12
echo "results in $OUT"
