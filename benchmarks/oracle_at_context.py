"""The bench's oracle with the cost curve at the prompt's context, beside the 64-token curve.

``specdecode bench`` replays each greedy output with the lookup oracle (every step's best
lookup draft and K, knowing the outcome) on the cost curve measured after 64 tokens. On a CPU
with llama.cpp's flash attention, a block of K + 1 rows grows dearer with the context
(``python benchmarks/cost_curves.py --vary flash_attn=auto,off --contexts 64,1000,2500``),
so for long prompts that oracle overstates what any choice of drafts could reach. This
script measures T(n) after 64, 1,000 and 2,500 tokens, decodes each prompt plainly, and
replays the outputs with the oracle twice: on the 64-token curve and on the curve measured
nearest the middle of the prompt's generation (prompt tokens plus half its output). Lookup drafters are kept across prompts in suite order, as in the bench.

    python benchmarks/oracle_at_context.py --categories edit_whole,edit_search_replace
"""

from __future__ import annotations

import argparse
import os

from specdecode.api import Decoder
from specdecode.assembly import registry
from specdecode.bench import cpu_name, load_prompts, lookup_drafters, oracle_replay, oracle_speedup, select_prompts
from specdecode.control.measure import measure_forward_curve
from specdecode.limits import MAX_NUM_SPECULATIVE_TOKENS

SIZES = (1, 2, 3, 4, 5, 6, 7, 8, 9, 12, 16, 24, 32, 33)


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--target", default=registry.DEFAULT_TARGET)
    ap.add_argument("--ctx-size", type=int, default=4096)
    ap.add_argument("--contexts", default="64,1000,2500")
    ap.add_argument("--categories", default="edit_whole,edit_search_replace")
    ap.add_argument("--per-category", type=int, default=None)
    return ap


def main(argv=None) -> None:
    args = build_parser().parse_args(argv)
    contexts = [int(c) for c in args.contexts.split(",")]
    prompts = select_prompts(load_prompts(None), args.categories.split(","), args.per_category)
    with Decoder(target=args.target, draft="none", n_ctx=args.ctx_size, progress=False) as dec:
        curves = {c: measure_forward_curve(dec.target, SIZES, context=c, rounds=3).curve for c in contexts}
        runs = []
        for p in prompts:
            ids = dec.prompt_ids(p.prompt, p.messages, p.tools)
            out = dec.generate_ids(ids, max_tokens=p.max_tokens, temperature=0, grammar=p.grammar).token_ids
            runs.append((p, ids, out))
            print(f"{p.id}: {len(ids)} prompt tokens, {len(out)} generated", flush=True)
    flash = os.environ.get("SPECDECODE_LLAMA_FLASH_ATTN", "auto")
    lines = [f"# the oracle at the prompt's context: {cpu_name()}, {os.cpu_count()} CPUs, target {args.target}, "
             f"flash attention {flash}", ""]
    for c, curve in curves.items():
        lines.append(f"T(n) after {c} tokens (ms): " + ", ".join(f"T({n}) {curve(n) * 1000:.0f}" for n in (1, 4, 16, 33))
                     + f"; L = {33 * curve(1) / curve(33):.2f}")
    lines += ["", "| category | prompts | oracle, 64-token curve | oracle, curve at the context | L at the context |",
              "|---|---|---|---|---|"]
    short, near = lookup_drafters("auto"), lookup_drafters("auto")  # kept across prompts, as in the bench
    per_cat: dict[str, list] = {}
    for p, ids, out in runs:
        c = min(contexts, key=lambda c: abs(c - (len(ids) + len(out) / 2)))
        a = oracle_replay(ids, out, curves[contexts[0]], short, MAX_NUM_SPECULATIVE_TOKENS)
        b = oracle_replay(ids, out, curves[c], near, MAX_NUM_SPECULATIVE_TOKENS)
        per_cat.setdefault(p.category, []).append((a, b, 33 * curves[c](1) / curves[c](33)))
    for cat, rs in per_cat.items():
        ls = [L for _, _, L in rs]
        lines.append(f"| {cat} | {len(rs)} | {oracle_speedup([a for a, _, _ in rs]):.2f}x | "
                     f"{oracle_speedup([b for _, b, _ in rs]):.2f}x | {min(ls):.2f}-{max(ls):.2f} |")
    print("\n" + "\n".join(lines))


if __name__ == "__main__":
    main()
