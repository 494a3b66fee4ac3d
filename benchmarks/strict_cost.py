"""What strict mode costs (``speculative.strict``, ``serve --strict``), side by side in one run.

Alone: one Decoder (the default draft "auto", one slot) runs each suite prompt four ways,
interleaved prompt by prompt: the default, strict (``batch_invariant="on"``: blocks of at most
the measured invariant block), plain decoding (the drafter off) and plain decoding in strict
mode (one token a forward, on one thread), on the same loaded target.
In a batch: the same prompts all at once (one joining each step) on engines of ``--parallel``
slots: the default (a shared KV cache), the default with a cache per slot (``kv_per_sequence``,
what ``serve --strict`` loads) and strict there (a shared cache refuses strict generations).
Prints decode tokens/s, their ratios, and how many answers equal plain decoding's alone in strict
mode token for token: every strict one, or strict is broken. Plain decoding outside strict mode
runs a lone step over 512 or more cached cells on all threads, which splits its attention and
rounds differently (a near-tie may flip): how many plain runs equal the strict plain run shows
how often that mattered.

    python benchmarks/strict_cost.py --per-category 1 --max-tokens 96
"""

from __future__ import annotations

import argparse
import platform
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))

from specdecode.api import Decoder  # noqa: E402
from specdecode.bench.suite import load_prompts, select_prompts  # noqa: E402
from test_batching import batched  # noqa: E402


def cpu_name() -> str:
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return platform.processor()


def alone(args, prompts) -> list[str]:
    rows, tok = {"default": [0, 0.0], "strict": [0, 0.0], "plain": [0, 0.0], "plain, strict": [0, 0.0]}, {}
    with Decoder(target=args.target, draft=args.draft, n_ctx=args.ctx_size, progress=False) as dec:
        for i, p in enumerate(prompts):
            modes = [("default", {}), ("strict", {"batch_invariant": "on"}), ("plain", {"plain": True}),
                     ("plain, strict", {"plain": True, "batch_invariant": "on"})]
            for name, extra in modes[i % 4:] + modes[:i % 4]:  # rotate the order
                r = dec.generate(p.prompt, messages=p.messages, max_tokens=args.max_tokens, temperature=0,
                                 grammar=p.grammar, **extra)
                rows[name][0] += r.stats.completion_tokens
                rows[name][1] += r.stats.decode_s
                tok[name, i] = r.token_ids
    same = sum(tok["strict", i] == tok["plain, strict", i] for i in range(len(prompts)))
    loose = sum(tok["plain", i] == tok["plain, strict", i] for i in range(len(prompts)))
    rate = {k: n / s for k, (n, s) in rows.items()}
    return [f"| alone, 1 slot | {rate['default']:.1f} | {rate['strict']:.1f} | {rate['plain']:.1f} | "
            f"{rate['strict'] / rate['default']:.2f}x | {rate['strict'] / rate['plain']:.2f}x | "
            f"{same}/{len(prompts)} (plain itself: {loose}/{len(prompts)}) |"], tok


def together(args, prompts, solo) -> list[str]:
    out = {}
    for name, kv_per_sequence, extra in (("default", False, {}), ("default, a cache per slot", True, {}),
                                         ("strict, a cache per slot", True, {"batch_invariant": "on"})):
        with Decoder(target=args.target, draft=args.draft, n_ctx=args.ctx_size, parallel=args.parallel,
                     kv_per_sequence=kv_per_sequence, progress=False) as dec:
            reqs = [{"prompt_ids": dec.prompt_ids(p.prompt, p.messages), "max_tokens": args.max_tokens,
                     "grammar": p.grammar, **extra} for p in prompts]
            start = time.perf_counter()
            results = batched(dec.engine, reqs, join_every=1)
            wall = time.perf_counter() - start
        same = sum(r.token_ids == solo["plain, strict", i] for i, r in enumerate(results))
        out[name] = (sum(r.stats.completion_tokens for r in results) / wall, same)
    base = out["default"][0]
    return [f"| {len(prompts)} at once, {args.parallel} slots: {name} | {rate:.1f} aggregate | | | "
            f"{rate / base:.2f}x | | {same}/{len(prompts)} |" for name, (rate, same) in out.items()]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--target", default="qwen2.5-coder-1.5b-instruct")
    ap.add_argument("--draft", default="auto")
    ap.add_argument("--ctx-size", type=int, default=4096)
    ap.add_argument("--categories", default="code_editing,chat,repeat,agent,extraction")
    ap.add_argument("--per-category", type=int, default=1)
    ap.add_argument("--max-tokens", type=int, default=96)
    ap.add_argument("--parallel", type=int, default=4)
    ap.add_argument("--no-batch", dest="batch", action="store_false")
    args = ap.parse_args()
    prompts = select_prompts(load_prompts(None), args.categories.split(","), args.per_category)
    lines, solo = alone(args, prompts)
    if args.batch:
        lines += together(args, prompts[:args.parallel * 2], solo)
    print(f"{args.target}, draft {args.draft}, {len(prompts)} suite prompts ({args.categories}), greedy, "
          f"{args.max_tokens} tokens; {cpu_name()}")
    print("| run | default tok/s | strict tok/s | plain tok/s | strict / default | strict / plain | "
          "= plain, strict |")
    print("|---|---|---|---|---|---|---|")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
