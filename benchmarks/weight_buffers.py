"""The weights' buffer type chosen for this machine (specdecode.backends.llama_buffers) against
plain memory (``SPECDECODE_LLAMA_BUFFERS=none``: what specdecode did on AMX builds before),
side by side in one run: issue 35's measurements, for any CPU kind (say which).

1. T(n) of the default target after 64 tokens for both (3 interleaved rounds, alternating twice),
   with T(4) / T(1).
2. README command 1 (the chat in examples/edit_function.txt, 256 tokens): plain decoding and
   the default speculation with each buffer choice, alternating, twice, each run from the same
   suffix history (the one before the first); decode tokens/s, the
   chosen buffers' plain rate over plain memory's, speculation's speedup over the plain run of
   the same buffers, and parity of the two plain runs (exact, or a near-tie with its gap).

    python benchmarks/weight_buffers.py
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from specdecode.api import Decoder
from specdecode.assembly import registry
from specdecode.backends.llama_buffers import BUFFERS_ENV
from specdecode.bench.runner import history_as, history_keepers
from specdecode.control.measure import measure_forward_curve
from specdecode.parity import parity_report

sys.path.insert(0, str(Path(__file__).resolve().parent))
from strict_cost import cpu_name  # noqa: E402

SIZES = (1, 2, 3, 4, 5, 8, 16, 32, 33)
CHAT = Path(__file__).resolve().parent.parent / "examples" / "edit_function.txt"


def load(requested: str | None, args) -> Decoder:
    if requested:
        os.environ[BUFFERS_ENV] = requested  # read when the model loads
    else:
        os.environ.pop(BUFFERS_ENV, None)
    try:
        return Decoder(target=args.target, draft=args.draft, n_ctx=args.ctx_size, progress=False)
    finally:
        os.environ.pop(BUFFERS_ENV, None)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--target", default=registry.DEFAULT_TARGET)
    ap.add_argument("--draft", default="auto")
    ap.add_argument("--ctx-size", type=int, default=4096)
    ap.add_argument("--max-tokens", type=int, default=256)
    args = ap.parse_args()
    decoders = {"chosen": load(None, args), "none": load("none", args)}
    names = list(decoders)
    try:
        print(f"# weights' buffers: chosen against plain memory, {cpu_name()}, {os.cpu_count()} CPUs, target "
              f"{decoders['chosen'].target.name}")
        for name, dec in decoders.items():
            print(f"{name}: {dec.target.weights_note}")
        print("\n| buffers | " + " | ".join(f"T({n}) ms" for n in SIZES) + " | T(4)/T(1) |\n" + "|---" * (len(SIZES) + 2) + "|")
        for rnd in range(2):
            for name in names if rnd == 0 else names[::-1]:
                c = measure_forward_curve(decoders[name].target, SIZES, rounds=3).curve
                print(f"| {name} | " + " | ".join(f"{c(n) * 1000:.0f}" for n in SIZES) + f" | {c(4) / c(1):.2f} |",
                      flush=True)
        messages = [{"role": "user", "content": CHAT.read_text()}]
        runs = [(name, plain) for name in names for plain in (True, False)]
        total = {r: [0, 0.0] for r in runs}
        plain_results: dict[str, list] = {name: [] for name in names}
        # Each run starts from the suffix history as it was before the first (the same chat again
        # would otherwise be drafted from its own earlier answer).
        keepers = {name: history_keepers([dec.drafter]) for name, dec in decoders.items()}
        before = {name: [k.history_state() for k in keepers[name]] for name in names}
        print()
        for rnd in range(2):
            for name, plain in runs if rnd == 0 else runs[::-1]:
                with history_as(keepers[name], before[name]):
                    r = decoders[name].generate(messages=messages, max_tokens=args.max_tokens, temperature=0,
                                                plain=plain, record_top2_gaps=plain)
                total[name, plain][0] += r.stats.completion_tokens
                total[name, plain][1] += r.stats.decode_s
                if plain:
                    plain_results[name].append(r)
                print(f"round {rnd + 1} {name} {'plain' if plain else 'speculative'}: {r.stats.completion_tokens} tokens, "
                      f"{r.stats.target_forward_passes} passes, {r.stats.decode_tokens_per_s:.1f} tok/s", flush=True)
        rate = {r: n / s for r, (n, s) in total.items()}
        print("\n| buffers | plain tok/s | speculative tok/s | speculative / its plain |\n|---|---|---|---|")
        for name in names:
            print(f"| {name} | {rate[name, True]:.1f} | {rate[name, False]:.1f} | {rate[name, False] / rate[name, True]:.2f}x |")
        print(f"\nplain decoding, chosen over plain memory: {rate['chosen', True] / rate['none', True]:.2f}x; "
              f"speculative, chosen over plain memory's plain: {rate['chosen', False] / rate['none', True]:.2f}x")
        print("parity of the plain runs:", parity_report(plain_results["chosen"][0], plain_results["none"][0]))
    finally:
        for d in decoders.values():
            d.close()


if __name__ == "__main__":
    main()
