"""The child process of :func:`specdecode.backends.llama_cpp.buffers.probe_amx`: load a GGUF model
with the weights in one buffer type, run a 2-token forward, and time T(n).

    python -m specdecode.backends.llama_cpp.probe MODEL BUFFERS THREADS

BUFFERS: amx, repack or none. Prints ``{"survived": true}`` once a 2-token forward after a
64-token context and a 128-token one (a prompt's prefill) have returned (a crash in a kernel
kills this process, not its parent), then ``{"survived": true, "seconds": {"n": s},
"weights": {...}}``: T(n) in seconds at PROBE_NS, the median of 3 interleaved rounds, and the
buffer types holding the weights (MiB, as llama.cpp reported them). Exit status 2 with one
line on stderr when the arguments are wrong or the model does not load.
"""

from __future__ import annotations

import json
import os
import statistics
import sys
import time


PREFILL_ROWS = 128  # a prefill-sized forward: a prompt is forwarded in blocks of up to n_batch rows


def main(argv: list[str]) -> int:
    if len(argv) != 3:
        print("usage: python -m specdecode.backends.llama_cpp.probe MODEL BUFFERS THREADS", file=sys.stderr)
        return 2
    path, buffers, threads = argv
    from ...errors import SpecDecodeError
    from .buffers import BUFFER_CHOICES, BUFFERS_ENV, LEGACY_REPACK_ENV, PROBE_NS
    from .backend import LlamaCppBackend

    if buffers not in BUFFER_CHOICES:
        print(f"llama_probe: BUFFERS {buffers!r} is not a choice: expected {', '.join(BUFFER_CHOICES)}", file=sys.stderr)
        return 2
    if not threads.isdigit() or int(threads) < 1:
        print(f"llama_probe: THREADS {threads!r} is not a positive whole number", file=sys.stderr)
        return 2
    if not os.path.isfile(path):
        print(f"llama_probe: model file {path} does not exist", file=sys.stderr)
        return 2
    os.environ[BUFFERS_ENV] = buffers
    os.environ.pop(LEGACY_REPACK_ENV, None)
    try:
        backend = LlamaCppBackend(path, n_ctx=256, n_threads=int(threads), gpu_layers=0)  # the CPU's kernels only
    except SpecDecodeError as e:
        print(f"llama_probe: {e}", file=sys.stderr)
        return 2
    context = [100 + (7 * i) % 5000 for i in range(64)]
    backend.forward(context, logits_for=[])
    backend.forward([101, 102], logits_for=[0, 1])  # the size that crashes in llama.cpp #20824
    backend.rollback(64)
    backend.forward([300 + i for i in range(PREFILL_ROWS)], logits_for=[PREFILL_ROWS - 1])  # a prompt's prefill
    print(json.dumps({"survived": True}), flush=True)
    backend.rollback(64)
    samples: dict[int, list[float]] = {n: [] for n in PROBE_NS}
    order = list(PROBE_NS)
    for r in range(4):  # one warm-up round, then 3 timed
        for n in order[r % len(order):] + order[:r % len(order)]:
            t0 = time.perf_counter()
            backend.forward([200 + i for i in range(n)], logits_for=list(range(n)))
            if r:
                samples[n].append(time.perf_counter() - t0)
            backend.rollback(64)
    seconds = {str(n): statistics.median(s) for n, s in samples.items()}
    print(json.dumps({"survived": True, "seconds": seconds, "weights": backend.weight_buffers}), flush=True)
    backend.close()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
