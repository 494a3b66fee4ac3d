"""The target's cost curve T(n), one forward of n tokens after a context, at each value of a
setting read when the model loads, side by side: the numbers behind the copy limit
L = 33 T(1) / T(33) and the curve the controller plans with.

For each value of ``--vary`` (``flash_attn`` or ``buffers``, as ``specdecode bench --vary``
spells them; without it, the target as the environment configures it) the target is loaded
once with that value. Then, for each context length (``--contexts``) and each repeat
(``--repeats``), every value's curve is measured in turn (``--rounds`` interleaved rounds
each, as the controller measures it), the values' order reversed on every other repeat.
Prints one Markdown row per measurement: T(n) in ms at ``--sizes`` and L. With ``--sparse``,
also what interpolating the same measurement between only those sizes gives at each size
(llama.cpp's repacked kernels take rows in groups of 4 and 8, so T(n) is not smooth in n and
a curve measured at a few sizes misprices the blocks between them). With
``--invariant-block``, each value's measured invariant block: the most tokens a strict
(batch-invariant) verification may hold.

    python benchmarks/cost_curves.py --vary flash_attn=auto,off --contexts 64,1000,2500 --invariant-block
    python benchmarks/cost_curves.py --vary buffers=auto,none --contexts 64
    python benchmarks/cost_curves.py --sizes 1-33 --sparse 1,2,3,4,5,6,7,8,9,12,16,24,32,33

Decoding speed at each value is ``specdecode bench --vary SETTING=V1,V2``.
"""

from __future__ import annotations

import argparse
import contextlib
import os

from specdecode.api import load_backend
from specdecode.assembly import registry
from specdecode.bench import cpu_name, parse_vary
from specdecode.bench.vary import check_loaded, loading_with
from specdecode.control.costmodel import CostCurve
from specdecode.control.invariance import measure_invariant_block
from specdecode.control.measure import measure_forward_curve

DEFAULT_SIZES = "1,2,3,4,5,8,16,32,33"


def int_list(text: str) -> tuple[int, ...]:
    """"1,2,8" or "1-33" (a range, both ends included) or both, as sorted distinct integers."""
    out: set[int] = set()
    try:
        for part in text.split(","):
            lo, _, hi = part.partition("-")
            out.update(range(int(lo), int(hi or lo) + 1))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected integers and ranges like 1,2,8 or 1-33, got {text!r}") from None
    if not out or min(out) < 1:
        raise argparse.ArgumentTypeError(f"expected integers >= 1, got {text!r}")
    return tuple(sorted(out))


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--target", default=registry.DEFAULT_TARGET, help="registry name or .gguf path (llama.cpp)")
    ap.add_argument("--ctx-size", type=int, default=4096, help="context window in tokens (default: %(default)s)")
    ap.add_argument("--vary", default=None, metavar="SETTING=V1,V2",
                    help="a load setting and its values, as specdecode bench --vary: flash_attn or buffers")
    ap.add_argument("--contexts", type=int_list, default=(64,), help="context lengths before the block (default: 64)")
    ap.add_argument("--sizes", type=int_list, default=int_list(DEFAULT_SIZES),
                    help=f"block sizes n timed (default: {DEFAULT_SIZES})")
    ap.add_argument("--sparse", type=int_list, default=None,
                    help="also show the measurement interpolated between only these sizes (each one of --sizes)")
    ap.add_argument("--rounds", type=int, default=3, help="interleaved rounds per measurement (default: %(default)s)")
    ap.add_argument("--repeats", type=int, default=2, help="measurements per value and context (default: %(default)s)")
    ap.add_argument("--invariant-block", action="store_true", help="also measure each value's invariant block")
    return ap


def load_targets(args) -> dict[str, object]:
    """One loaded target per value of --vary (one named by its environment without it)."""
    vary = parse_vary(args.vary) if args.vary else None
    if vary is not None and vary.setting.kind != "load":
        raise SystemExit(f"--vary {args.vary}: {vary.setting.name} is an option of each generation, not of the "
                         "model's load; its cost is specdecode bench --vary's to measure")
    targets = {}
    for value in vary.values if vary else ["as configured"]:
        with loading_with(vary.setting, value) if vary else contextlib.nullcontext():
            t = load_backend(args.target, backend="llama.cpp", n_ctx=args.ctx_size, progress=False)
        targets[value] = t
        print(f"{value}: " + (check_loaded(vary.setting, value, t) if vary else t.weights_note), flush=True)
    return targets


def row(name: str, curve: CostCurve, sizes: tuple[int, ...]) -> str:
    return (f"| {name} | " + " | ".join(f"{curve(n) * 1000:.1f}" for n in sizes)
            + f" | {33 * curve(1) / curve(33):.2f} |")


def measure(args, targets: dict) -> None:
    names = list(targets)
    print("\n| context | value | " + " | ".join(f"T({n}) ms" for n in args.sizes) + " | L |")
    print("|---" * (len(args.sizes) + 3) + "|")
    for c in args.contexts:
        for rep in range(args.repeats):
            for name in names if rep % 2 == 0 else names[::-1]:
                curve = measure_forward_curve(targets[name], args.sizes, context=c, rounds=args.rounds).curve
                print(row(f"{c} | {name}", curve, args.sizes), flush=True)
                if args.sparse:
                    sparse = CostCurve(args.sparse, tuple(curve(n) for n in args.sparse))
                    print(row(f"{c} | {name}, interpolated from {len(args.sparse)} sizes", sparse, args.sizes),
                          flush=True)


def main(argv=None) -> None:
    args = build_parser().parse_args(argv)
    if args.sparse and not set(args.sparse) <= set(args.sizes):
        raise SystemExit(f"--sparse {args.sparse} must be sizes of --sizes {args.sizes}")
    if max(args.sizes) < 33:
        print("(L extrapolates T(33): --sizes stops below 33)")
    targets = load_targets(args)
    try:
        print(f"# T(n) of {args.target}: {cpu_name()}, {os.cpu_count()} CPUs")
        measure(args, targets)
        if args.invariant_block:
            print()
            for name, t in targets.items():
                print(f"invariant block, {name}: {measure_invariant_block(t)} tokens", flush=True)
    finally:
        for t in targets.values():
            t.close()


if __name__ == "__main__":
    main()
