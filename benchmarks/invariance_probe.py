"""Where llama.cpp's batched logits differ from one-token steps, and what one thread fixes.

For each cache length L, feeds the same M tokens after L cached ones as one-token forwards
on 2 threads and on 1 thread, and as blocks of n tokens on 2 threads; prints the largest
logit difference of each against each. Then times T(1) on 2 and on 1 thread and T(n) of a
few blocks after 600 cached tokens (medians of 7). The numbers behind
``specdecode.control.invariance`` and the README's "A seed fixes the text".

    python benchmarks/invariance_probe.py [MODEL] [L ...]
"""

from __future__ import annotations

import statistics
import sys
import time
from pathlib import Path

import numpy as np

from specdecode.assembly.registry import DEFAULT_TARGET, resolve
from specdecode.backends.llama_cpp import LlamaCppBackend

M = 24  # tokens compared after the cache


def main() -> None:
    name = sys.argv[1] if len(sys.argv) > 1 else DEFAULT_TARGET
    lengths = [int(a) for a in sys.argv[2:]] or [40, 200, 300, 600]
    be = LlamaCppBackend(resolve(name, progress=False), n_ctx=4096)
    text = (Path(__file__).resolve().parent.parent / "examples" / "edit_function.txt").read_text() * 4
    toks = be.tokenize(text)

    def threads(lone: int, batch: int = 2) -> None:
        be._lib.llama_set_n_threads(be._ctx, lone, batch)

    def run(L: int, blocks: list[int], lone_threads: int) -> np.ndarray:  # [sum(blocks), V]
        threads(lone_threads)
        be.rollback(0)
        be.forward(toks[:L], logits_for=[])
        rows, i = [], 0
        for n in blocks:
            rows.append(be.forward(toks[L + i:L + i + n], logits_for=list(range(n))))
            i += n
        be.rollback(0)
        return np.concatenate(rows)

    for L in lengths:
        lone2, lone1 = run(L, [1] * M, 2), run(L, [1] * M, 1)
        print(f"L={L}: one-token steps, 2 threads vs 1 thread: max|dlogit| {np.abs(lone2 - lone1).max():.4g}")
        for n in (2, 3, 4, 6, 8, 12):
            blocks = [n] * (M // n) + ([M % n] if M % n else [])
            blk = run(L, blocks, 2)
            print(f"  blocks of {n} (2 threads) vs steps on 2 threads {np.abs(blk - lone2).max():.4g}, "
                  f"on 1 thread {np.abs(blk - lone1).max():.4g}")

    L = 600
    def t(n: int, lone_threads: int, reps: int = 7) -> float:  # ms
        threads(lone_threads)
        be.rollback(0)
        be.forward(toks[:L], logits_for=[])
        ts = []
        for _ in range(reps):
            a = time.perf_counter()
            be.forward(toks[L:L + n], logits_for=list(range(n)))
            ts.append(time.perf_counter() - a)
            be.rollback(L)
        return statistics.median(ts) * 1e3

    print(f"after {L} cached tokens: T(1) {t(1, 2):.1f} ms on 2 threads, {t(1, 1):.1f} on 1; "
          f"T(2) {t(2, 2):.1f}, T(3) {t(3, 2):.1f}, T(4) {t(4, 2):.1f}, T(16) {t(16, 2):.1f}, T(33) {t(33, 2):.1f}")
    be.close()


if __name__ == "__main__":
    main()
