#!/usr/bin/env bash
# The llama.cpp backend on a CUDA GPU, in one run: build llama-cpp-python for CUDA (where nvcc is
# there) into a virtual environment of its own, run the README's first command with every layer
# on the GPU, then `specdecode bench --config auto:auto` on code_editing and chat with the draft
# model (its layers on the GPU too), and benchmarks/gpu_check.sh for the torch backend. Writes
# $OUT (default bench-out/gguf-gpu); records the card's name beside every figure (env.txt).
#
#   bash benchmarks/gguf_gpu_check.sh           # models from the registry (needs the package index)
#   VENV=/opt/venv-cuda bash benchmarks/gguf_gpu_check.sh   # reuse a CUDA build made earlier
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-bench-out/gguf-gpu}
VENV=${VENV:-.venv-cuda}
mkdir -p "$OUT"
{
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
  nvcc --version | tail -1
} > "$OUT/env.txt" 2>&1
cat "$OUT/env.txt"
if [ ! -x "$VENV/bin/python" ]; then
  command -v nvcc >/dev/null || { echo "no nvcc: the CUDA toolkit is needed to build llama.cpp for CUDA"; exit 1; }
  python -m venv "$VENV"
  # one architecture (the card's own) keeps the build to minutes
  CMAKE_ARGS="-DGGML_CUDA=on -DCMAKE_CUDA_ARCHITECTURES=native" CMAKE_BUILD_PARALLEL_LEVEL=$(nproc) \
    "$VENV/bin/pip" install llama-cpp-python==0.3.36 > "$OUT/build.txt" 2>&1 || { tail -20 "$OUT/build.txt"; exit 1; }
  "$VENV/bin/pip" install -e . >> "$OUT/build.txt" 2>&1 || { tail -20 "$OUT/build.txt"; exit 1; }
fi
PY="$VENV/bin/python"
"$PY" -c "from specdecode.backends.llama_cpp.offload import list_devices; [print(d) for d in list_devices()]" \
  | tee "$OUT/devices.txt"
timeout 600 "$PY" -m specdecode generate --chat-file examples/edit_function.txt --compare --gpu-layers all \
  2>&1 | tee "$OUT/readme_command_1.txt" | grep -E "layers|^device:|^speedup|^controller:"
timeout 1500 "$PY" -m specdecode bench --config auto:auto --categories code_editing,chat --per-category 3 \
  --max-tokens 128 --out "$OUT/bench" 2>&1 | tee "$OUT/bench.txt" | tail -25
timeout 480 bash benchmarks/gpu_check.sh > "$OUT/torch.txt" 2>&1; tail -15 "$OUT/torch.txt"
echo "results in $OUT"
