"""Where llama.cpp's batched logits differ from one-token steps, and what one thread fixes.

For each cache length L, feeds the same M tokens after L cached ones as one-token forwards
on all the target's threads (2 by default) and on 1 thread (the backend's batch-invariant
mode, ``set_batch_invariant``), and as blocks of n tokens on all threads; prints the largest
logit difference of each against each. Then times T(1) on all threads and on 1 and T(n) of a
few blocks after 600 cached tokens (medians of 7). The numbers behind
``specdecode.control.invariance`` and the README's "A seed fixes the text".

    python benchmarks/invariance_probe.py [--target MODEL] [--threads 2] [L ...]
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import numpy as np

from specdecode.api import load_backend
from specdecode.assembly.registry import DEFAULT_TARGET

M = 24  # tokens compared after the cache
TEXT = Path(__file__).resolve().parent.parent / "examples" / "edit_function.txt"


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--target", default=DEFAULT_TARGET, help="registry name or .gguf path (llama.cpp)")
    ap.add_argument("--threads", type=int, default=2, help="the target's threads (default: %(default)s)")
    ap.add_argument("lengths", type=int, nargs="*", default=[40, 200, 300, 600], help="cache lengths L")
    return ap


def main(argv=None) -> None:
    args = build_parser().parse_args(argv)
    lengths = args.lengths
    be = load_backend(args.target, backend="llama.cpp", n_ctx=4096, n_threads=args.threads, progress=False)
    toks = be.tokenize(TEXT.read_text() * 4)
    n = args.threads

    def threads(lone: int) -> None:
        # One-token forwards on 1 thread (batch-invariant mode) or on all; blocks always on all.
        be.set_batch_invariant(lone == 1)

    def run(L: int, blocks: list[int], lone_threads: int) -> np.ndarray:  # [sum(blocks), V]
        threads(lone_threads)
        be.rollback(0)
        be.forward(toks[:L], logits_for=[])
        rows, i = [], 0
        for k in blocks:
            rows.append(be.forward(toks[L + i:L + i + k], logits_for=list(range(k))))
            i += k
        be.rollback(0)
        return np.concatenate(rows)

    for L in lengths:
        lone_n, lone1 = run(L, [1] * M, n), run(L, [1] * M, 1)
        print(f"L={L}: one-token steps, {n} threads vs 1 thread: max|dlogit| {np.abs(lone_n - lone1).max():.4g}")
        for k in (2, 3, 4, 6, 8, 12):
            blocks = [k] * (M // k) + ([M % k] if M % k else [])
            blk = run(L, blocks, n)
            print(f"  blocks of {k} ({n} threads) vs steps on {n} threads {np.abs(blk - lone_n).max():.4g}, "
                  f"on 1 thread {np.abs(blk - lone1).max():.4g}")

    L = 600
    def t(k: int, lone_threads: int, reps: int = 7) -> float:  # ms
        threads(lone_threads)
        be.rollback(0)
        be.forward(toks[:L], logits_for=[])
        ts = []
        for _ in range(reps):
            a = time.perf_counter()
            be.forward(toks[L:L + k], logits_for=list(range(k)))
            ts.append(time.perf_counter() - a)
            be.rollback(L)
        return statistics.median(ts) * 1e3

    print(f"after {L} cached tokens: T(1) {t(1, n):.1f} ms on {n} threads, {t(1, 1):.1f} on 1; "
          f"T(2) {t(2, n):.1f}, T(3) {t(3, n):.1f}, T(4) {t(4, n):.1f}, T(16) {t(16, n):.1f}, T(33) {t(33, n):.1f}")
    be.close()


if __name__ == "__main__":
    main()
