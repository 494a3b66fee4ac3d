#!/usr/bin/env bash
# The GPU offload path of the llama.cpp backend, checked without a GPU: Mesa's software Vulkan
# driver (lavapipe) gives llama.cpp a Vulkan device on the CPU. Every layer of the target and of
# the draft model goes to that device; greedy speculative decoding is compared with plain decoding
# (parity: exact or near-ties only), and the statistics must name the Vulkan device. Slow (a
# software GPU on 2 cores: minutes a run); not part of the test suite. Results in $OUT.
#
# Once, as root (Debian 12 packages), and a virtual environment with llama.cpp built for Vulkan:
#   apt-get install -y mesa-vulkan-drivers libvulkan-dev glslc spirv-headers
#   python -m venv /opt/venv-vulkan
#   CMAKE_ARGS="-DGGML_VULKAN=on" /opt/venv-vulkan/bin/pip install llama-cpp-python==0.3.36
#   /opt/venv-vulkan/bin/pip install -e .
# (Debian 12's Vulkan headers are 1.3.239; the llama.cpp that llama-cpp-python 0.3.36 vendors uses
# VK_EXT_layer_settings, from headers 1.3.261 on, only to turn on a validation layer's best-practice
# checks: with older headers drop that block of ggml-vulkan.cpp's instance creation, as
# docs/measured.md records.)
#
#   PY=/opt/venv-vulkan/bin/python bash benchmarks/vulkan_check.sh
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-python}
OUT=${OUT:-bench-out/vulkan}
TOKENS=${TOKENS:-32}
# a short copy-heavy edit: lavapipe reads a prompt at about 10 tokens/s on 2 cores (smollm2)
CHAT=${CHAT:-$'Rename the parameter b to other and return the whole function:\n\ndef add(a, b):\n    """Add two numbers."""\n    total = a + b\n    return total\n'}
mkdir -p "$OUT"
# lavapipe is a CPU-type Vulkan device, which ggml skips unless named (as CUDA_VISIBLE_DEVICES)
export GGML_VK_VISIBLE_DEVICES=${GGML_VK_VISIBLE_DEVICES:-0}
# llama.cpp's Vulkan flash-attention kernel crashes (SIGSEGV) on lavapipe (llvmpipe 15.0.6, Debian 12)
# for a forward of 3 tokens, the first size past its small-batch path; the plain attention path
# runs every size (docs/measured.md). A real GPU's driver keeps llama.cpp's own choice.
export SPECDECODE_LLAMA_FLASH_ATTN=${SPECDECODE_LLAMA_FLASH_ATTN:-off}
"$PY" - <<'PY' | tee "$OUT/devices.txt"
from specdecode.backends.llama_cpp.offload import list_devices, offload_devices
for d in list_devices():
    print(f"{d.name}\t{d.kind}\t{d.description}\tfree {d.free >> 20} MiB of {d.total >> 20} MiB")
assert offload_devices(list_devices()), "no GPU device: is llama.cpp built with -DGGML_VULKAN=on, lavapipe installed?"
PY
[ "${PIPESTATUS[0]}" = 0 ] || exit 1
run() {  # NAME, then generate's options: greedy, speculative against plain, every layer offloaded
  local name=$1; shift
  echo "== $name: $*" | tee "$OUT/$name.txt"
  timeout 3600 "$PY" -X faulthandler -m specdecode generate --chat "$CHAT" --max-tokens "$TOKENS" \
    --gpu-layers all --draft-gpu-layers all --compare "$@" 2>&1 | tee -a "$OUT/$name.txt" | \
    grep -E "^specdecode: .*layers|^device:|^weights:|^speedup|^--- |^tokens:|^drafted|Fatal|Segmentation"
  echo "exit ${PIPESTATUS[0]}" | tee -a "$OUT/$name.txt"
}
run default-pair --draft qwen2.5-coder-0.5b-instruct -k 4 --ctx-size 1024
run smollm2 --target smollm2-135m-instruct --draft smollm2-135m-instruct -k 4 --ctx-size 1024
echo "results in $OUT"
