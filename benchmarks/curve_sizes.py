"""The controller's cost curve measured at every block size (1..33, today's COST_CURVE_NS)
against the sizes it was measured at before (1..9, 12, 16, 24, 32, 33, interpolated between),
side by side in one run.

llama.cpp's CPU_REPACK kernels take rows in groups of 4 and 8 and the rest one at a time, so
T(n) is not smooth in n (T(16) < T(15), T(32) < T(28)): a curve interpolated between 12 and 16
or 24 and 32 makes the blocks just below a cheap size look cheaper than they are.

1. The curve at every size (3 interleaved rounds after 64 tokens) beside what interpolation
   between the old sizes gives there.
2. Decoding: two Decoders of the same models, one whose controller plans with each curve; the
   same suite prompts with each and plain (the drafter off), the order rotating prompt by
   prompt. Prints decode tokens/s, the speedup of each over plain, and the blocks verified.

    python benchmarks/curve_sizes.py --categories code_editing,repeat,edit_whole,chat --per-category 2
"""

from __future__ import annotations

import argparse
import collections
import os
import sys
from pathlib import Path

from specdecode.api import Decoder
from specdecode.assembly import loading, registry
from specdecode.bench.suite import load_prompts, select_prompts
from specdecode.control.costmodel import CostCurve

sys.path.insert(0, str(Path(__file__).resolve().parent))
from flash_attention import interleaved  # noqa: E402
from strict_cost import cpu_name  # noqa: E402

SPARSE = (1, 2, 3, 4, 5, 6, 7, 8, 9, 12, 16, 24, 32, 33)
EVERY = tuple(range(1, 34))
CONFIGS = {"every size": EVERY, "sparse": SPARSE}


def load(ns: tuple[int, ...], args) -> Decoder:
    """A Decoder whose controller measures T(n) at ns (measured now: each load overwrites the
    other's cached curve, as the cache keeps one curve per model and machine)."""
    loading.COST_CURVE_NS = ns
    return Decoder(target=args.target, draft=args.draft, n_ctx=args.ctx_size, progress=False)


def measured_curve(dec: Decoder) -> CostCurve:
    """The curve the Decoder's controller was given (before any live step time)."""
    T = dec.drafter.target_cost
    return getattr(T, "base", T)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--target", default=registry.DEFAULT_TARGET)
    ap.add_argument("--draft", default="auto")
    ap.add_argument("--ctx-size", type=int, default=4096)
    ap.add_argument("--categories", default="code_editing,repeat,edit_whole,chat")
    ap.add_argument("--per-category", type=int, default=2)
    args = ap.parse_args()
    decoders = {name: load(ns, args) for name, ns in CONFIGS.items()}
    try:
        print(f"# controller curve at every size against the sparse sizes: {cpu_name()}, {os.cpu_count()} CPUs, "
              f"target {decoders['every size'].target.name}, weights {decoders['every size'].target.weights_note}\n")
        every, sparse = measured_curve(decoders["every size"]), measured_curve(decoders["sparse"])
        print("| n | " + " | ".join(str(n) for n in EVERY) + " |\n" + "|---" * (len(EVERY) + 1) + "|")
        print("| measured T(n) ms | " + " | ".join(f"{every(n) * 1000:.0f}" for n in EVERY) + " |")
        print("| sparse, interpolated ms | " + " | ".join(f"{sparse(n) * 1000:.0f}" for n in EVERY) + " |\n", flush=True)

        prompts = select_prompts(load_prompts(None), args.categories.split(","), args.per_category)
        runs = [("every size", False), ("sparse", False), ("every size", True)]
        total = {r: [0, 0.0] for r in runs}
        blocks = {name: collections.Counter() for name in CONFIGS}
        answers = {}
        for i, p, (name, plain), r in interleaved(decoders, prompts, runs):
            total[name, plain][0] += r.stats.completion_tokens
            total[name, plain][1] += r.stats.decode_s
            answers[name, plain, i] = r.token_ids
            if not plain:
                blocks[name].update({int(k) + 1: v for k, v in r.stats.k_histogram.items() if int(k) > 0})
            print(f"{p.id} {name}{' plain' if plain else ''}: {r.stats.completion_tokens} tokens, "
                  f"{r.stats.target_forward_passes} passes, {r.stats.decode_tokens_per_s:.1f} tok/s", flush=True)
        same = sum(answers["every size", False, i] == answers["sparse", False, i] for i in range(len(prompts)))
        rate = {r: n / s for r, (n, s) in total.items()}
        plain = rate["every size", True]
        print("\n| curve | tok/s | speedup over plain | blocks verified (K+1: steps) |\n|---|---|---|---|")
        for name in CONFIGS:
            top = ", ".join(f"{n}: {c}" for n, c in sorted(blocks[name].items()))
            print(f"| {name} | {rate[name, False]:.1f} | {rate[name, False] / plain:.2f}x | {top} |")
        print(f"| plain | {plain:.1f} | 1.00x | |\n")
        print(f"every size against sparse: {rate['every size', False] / rate['sparse', False]:.3f}x; the same greedy "
              f"answer in {same} of {len(prompts)} prompts")
    finally:
        for d in decoders.values():
            d.close()


if __name__ == "__main__":
    main()
