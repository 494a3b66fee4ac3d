"""What strict mode costs in a batch (``serve --strict``, ``"speculative": {"strict": true}``).

The same suite prompts all at once, one joining each step, on engines of ``--parallel`` slots:
the default (one KV cache the slots share), the default with a cache per slot
(``kv_per_sequence``, what ``serve --strict`` loads) and strict generations there (a shared
cache refuses them). Prints each one's aggregate decode tokens/s (all completion tokens over
the wall time), its ratio to the default, and how many of its answers equal, token for token,
plain decoding's alone in strict mode (one token a forward, on one thread), run first on a
one-slot Decoder: every strict one, or strict mode is broken; the default may differ at a
near-tie, as batched numerics round differently.

Strict mode alone (one generation at a time) is ``specdecode bench --vary strict=off,on``.

    python benchmarks/strict_batch.py --per-category 1 --max-tokens 96 --parallel 4
"""

from __future__ import annotations

import argparse
import time

from specdecode import Decoder, GenerationResult, SpeculativeEngine
from specdecode.assembly import registry
from specdecode.bench import cpu_name, load_prompts, select_prompts

RUNS = (("default", False, {}), ("default, a cache per slot", True, {}),
        ("strict, a cache per slot", True, {"batch_invariant": "on"}))


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--target", default=registry.DEFAULT_TARGET)
    ap.add_argument("--draft", default="auto")
    ap.add_argument("--ctx-size", type=int, default=4096)
    ap.add_argument("--categories", default="code_editing,chat,repeat,agent,extraction")
    ap.add_argument("--per-category", type=int, default=1)
    ap.add_argument("--max-tokens", type=int, default=96)
    ap.add_argument("--parallel", type=int, default=4, help="slots of the batched engines (default: %(default)s)")
    return ap


def batched(engine: SpeculativeEngine, requests: list[dict]) -> list[GenerationResult]:
    """Run the requests (``begin``'s keywords, ``prompt_ids`` among them) together, one more
    joining every step while a slot is free; each ends as soon as it is done, freeing its slot.
    Returns their results in the requests' order."""
    pending = list(enumerate(requests))
    running: list = []
    results: dict[int, GenerationResult] = {}
    while pending or running:
        if pending and engine.free_slots():
            i, r = pending.pop(0)
            running.append((i, engine.begin(r["prompt_ids"], **{k: v for k, v in r.items() if k != "prompt_ids"})))
        live = [g for _, g in running if not g.done]
        if live:
            engine.step(live)
        for i, g in list(running):
            if g.done:
                results[i] = engine.end(g)[-1]
                running.remove((i, g))
    return [results[i] for i in range(len(requests))]


def main(argv=None) -> None:
    args = build_parser().parse_args(argv)
    prompts = select_prompts(load_prompts(None), args.categories.split(","), args.per_category)
    with Decoder(target=args.target, draft="none", n_ctx=args.ctx_size, progress=False) as dec:
        solo = [dec.generate(prompt_ids=dec.prompt_ids(p.prompt, p.messages, p.tools), max_tokens=args.max_tokens,
                             temperature=0, grammar=p.grammar, batch_invariant="on").token_ids for p in prompts]
    rates = {}
    for name, per_slot, extra in RUNS:
        with Decoder(target=args.target, draft=args.draft, n_ctx=args.ctx_size, parallel=args.parallel,
                     kv_per_sequence=per_slot, progress=False) as dec:
            reqs = [{"prompt_ids": dec.prompt_ids(p.prompt, p.messages, p.tools), "max_tokens": args.max_tokens,
                     "grammar": p.grammar, **extra} for p in prompts]
            start = time.perf_counter()
            results = batched(dec.engine, reqs)
            wall = time.perf_counter() - start
        same = sum(r.token_ids == s for r, s in zip(results, solo))
        rates[name] = (sum(r.stats.completion_tokens for r in results) / wall, same)
        print(f"{name}: {rates[name][0]:.1f} tok/s together, {same}/{len(prompts)} equal", flush=True)
    print(f"\n{args.target}, draft {args.draft}, {len(prompts)} suite prompts ({args.categories}) at once on "
          f"{args.parallel} slots, greedy, {args.max_tokens} tokens; {cpu_name()}")
    print("| run | tok/s together | / default | = plain decoding alone, strict |\n|---|---|---|---|")
    base = rates["default"][0]
    for name, (rate, same) in rates.items():
        print(f"| {name} | {rate:.1f} | {rate / base:.2f}x | {same}/{len(prompts)} |")


if __name__ == "__main__":
    main()
