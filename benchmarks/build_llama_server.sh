#!/usr/bin/env bash
# llama.cpp's own server (`llama-server`), built from the very llama.cpp that the installed
# llama-cpp-python vendors (the same kernels as specdecode's llama.cpp backend), for side-by-side
# runs against `specdecode serve` (issue 60: the peer in the bench). Built for this machine's CPU
# (GGML_NATIVE), as llama-cpp-python's own wheel is; a binary built on one CPU kind may not run on
# another. Needs cmake and a C++ compiler; 10-20 minutes on 2 cores.
#
#   bash benchmarks/build_llama_server.sh            # prints the binary's path on its last line
#   OUT=/opt/llama-server bash benchmarks/build_llama_server.sh
#
# The source is llama-cpp-python's source distribution of the installed version (pip download
# --no-binary), its vendor/llama.cpp folder. Nothing is installed system-wide.
set -euo pipefail
PY=${PY:-python}
VERSION=$("$PY" -c "import importlib.metadata as m; print(m.version('llama_cpp_python'))")
OUT=${OUT:-$HOME/.cache/specdecode/llama-server/$VERSION}
JOBS=${JOBS:-$(nproc)}
if [ -x "$OUT/llama-server" ]; then
  echo "already built: $OUT/llama-server" >&2
  echo "$OUT/llama-server"
  exit 0
fi
WORK=$(mktemp -d)
trap 'rm -rf "$WORK"' EXIT
"$PY" -m pip download --quiet --no-deps --no-binary :all: "llama-cpp-python==$VERSION" -d "$WORK"
tar -xzf "$WORK"/llama_cpp_python-"$VERSION".tar.gz -C "$WORK"
SRC="$WORK/llama_cpp_python-$VERSION/vendor/llama.cpp"
[ -f "$SRC/CMakeLists.txt" ] || { echo "no vendor/llama.cpp in llama-cpp-python $VERSION's sources" >&2; exit 1; }
cmake -S "$SRC" -B "$WORK/build" -G Ninja -DCMAKE_BUILD_TYPE=Release -DGGML_NATIVE=ON -DLLAMA_CURL=OFF \
  -DLLAMA_BUILD_SERVER=ON -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DBUILD_SHARED_LIBS=OFF >&2
cmake --build "$WORK/build" --target llama-server -j "$JOBS" >&2
mkdir -p "$OUT"
cp "$WORK/build/bin/llama-server" "$OUT/llama-server.partial"
mv "$OUT/llama-server.partial" "$OUT/llama-server"   # whole or not at all
"$OUT/llama-server" --version >&2 || true
echo "$OUT/llama-server"
