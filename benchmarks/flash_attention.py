"""llama.cpp's flash attention on the CPU: "auto" (the default: llama.cpp turns it on) against
"off" (``SPECDECODE_LLAMA_FLASH_ATTN=off``), side by side.

1. The verification cost curve: T(n) of one forward of n tokens after a context of 64, 1,000
   and 2,500 tokens (``measure_forward_curve``, 3 interleaved rounds each), for both settings
   alternately, twice, with the copy limit L = 33 T(1) / T(33) of each.
2. Decoding: the same suite prompts on two Decoders of the same models, one per setting, each
   prompt run with the default drafter and plain (the drafter off), the order rotating prompt by
   prompt. Prints decode tokens/s, each setting's speedup over its own plain decoding, and
   whether the two settings' greedy answers agree (they may differ at a near-tie: the kernels
   round differently).
3. Batch invariance: each setting's measured invariant block (``measure_invariant_block``), the
   most tokens a verification may hold in strict mode and for seeded sampling.

    python benchmarks/flash_attention.py --categories edit_whole,edit_search_replace
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from specdecode.assembly import registry
from specdecode.api import Decoder
from specdecode.backends.llama_lib import FLASH_ATTENTION_ENV
from specdecode.bench.suite import load_prompts, select_prompts
from specdecode.control.invariance import measure_invariant_block
from specdecode.control.measure import measure_forward_curve

sys.path.insert(0, str(Path(__file__).resolve().parent))
from strict_cost import cpu_name  # noqa: E402

MODES = ("auto", "off")
SIZES = (1, 2, 3, 4, 5, 8, 16, 32, 33)


def load(mode: str, args) -> Decoder:
    os.environ[FLASH_ATTENTION_ENV] = mode  # read when each llama.cpp context is created
    return Decoder(target=args.target, draft=args.draft, n_ctx=args.ctx_size, progress=False)


def curves(decoders: dict, contexts: list[int]) -> list[str]:
    lines = ["| context | flash attention | " + " | ".join(f"T({n}) ms" for n in SIZES) + " | L |",
             "|---" * (len(SIZES) + 3) + "|"]
    for rnd in range(2):
        for c in contexts:
            for mode in (MODES if rnd == 0 else MODES[::-1]):
                curve = measure_forward_curve(decoders[mode].target, SIZES, context=c, rounds=3).curve
                t = [curve(n) for n in SIZES]
                lines.append(f"| {c} | {mode} | " + " | ".join(f"{x * 1000:.0f}" for x in t)
                             + f" | {33 * t[0] / t[-1]:.2f} |")
                print(lines[-1], flush=True)
    return lines


def interleaved(decoders: dict, prompts, runs: list[tuple[str, bool]]):
    """Each prompt greedy under every (decoder name, plain) of runs, the order rotated by one
    per prompt so that no run always goes first; yields (prompt index, prompt, run, result)."""
    for i, p in enumerate(prompts):
        first = i % len(runs)
        for name, plain in runs[first:] + runs[:first]:
            dec = decoders[name]
            yield i, p, (name, plain), dec.generate_ids(dec.prompt_ids(p.prompt, p.messages, p.tools),
                                                        max_tokens=p.max_tokens, temperature=0, grammar=p.grammar,
                                                        plain=plain)


def decoding(decoders: dict, prompts) -> list[str]:
    runs = [(mode, plain) for mode in MODES for plain in (False, True)]
    total = {r: [0, 0.0] for r in runs}
    answers = {}
    for i, p, (mode, plain), r in interleaved(decoders, prompts, runs):
        total[mode, plain][0] += r.stats.completion_tokens
        total[mode, plain][1] += r.stats.decode_s
        answers[mode, plain, i] = r.token_ids
        print(f"{p.id} flash attention {mode}{' plain' if plain else ''}: {r.stats.completion_tokens} tokens, "
              f"{r.stats.decode_tokens_per_s:.1f} tok/s", flush=True)
    rate = {r: n / s for r, (n, s) in total.items()}
    same = sum(answers["off", False, i] == answers["auto", False, i] for i in range(len(prompts)))
    return ["| flash attention | default tok/s | plain tok/s | speedup over its plain |", "|---|---|---|---|"] + [
        f"| {m} | {rate[m, False]:.1f} | {rate[m, True]:.1f} | {rate[m, False] / rate[m, True]:.2f}x |" for m in MODES
    ] + ["", f"off against auto: default {rate['off', False] / rate['auto', False]:.2f}x, plain "
         f"{rate['off', True] / rate['auto', True]:.2f}x; the same greedy answer in {same} of {len(prompts)} prompts"]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--target", default=registry.DEFAULT_TARGET, help="target model (a name or a .gguf path)")
    ap.add_argument("--draft", default="auto")
    ap.add_argument("--ctx-size", type=int, default=4096)
    ap.add_argument("--contexts", default="64,1000,2500", help="comma-separated context lengths for the curves")
    ap.add_argument("--categories", default="edit_whole,edit_search_replace")
    ap.add_argument("--per-category", type=int, default=2)
    ap.add_argument("--skip-decoding", action="store_true")
    args = ap.parse_args()
    decoders = {mode: load(mode, args) for mode in MODES}
    try:
        print(f"# flash attention off against auto: {cpu_name()}, {os.cpu_count()} CPUs, "
              f"target {decoders['off'].target.name}\n", flush=True)
        out = curves(decoders, [int(c) for c in args.contexts.split(",")])
        out += [""] + [f"invariant block, flash attention {m}: {measure_invariant_block(decoders[m].target)}"
                       for m in MODES]
        if not args.skip_decoding:
            prompts = select_prompts(load_prompts(None), args.categories.split(","), args.per_category)
            out += [""] + decoding(decoders, prompts)
        print("\n" + "\n".join(out))
    finally:
        for d in decoders.values():
            d.close()


if __name__ == "__main__":
    main()
