"""Measure the prompt-lookup acceptance priors of the controller
(``specdecode.control.estimators.MATCH_PRIORS``) and how far lookup drafting could go.

Decodes the built-in suite's held-out prompts (4-8 of each category; ``specdecode bench
--per-category 3`` runs prompts 1-3) plainly and greedily with the target, then at every
position of each output looks the context up as NgramDrafter does and counts, per kind of
match (match-length band, unique continuation or not), how often the first proposed token
equals the target's next token and how often each further one does once the one before it
did. Prints that table beside the priors the controller starts from, then per category the
speedup of the bench's oracle (:func:`specdecode.bench.oracle_replay`: each step's best
prompt-lookup draft and K, knowing the outcome, on the target's cached cost curve T(n), no
overheads) at the controller's K cap (``limits.AUTO_KMAX``): the ceiling of prompt lookup on
this machine. What the controller itself reaches is ``specdecode bench --config ngram:auto``.

    python benchmarks/ngram_priors.py [--target NAME] [--outputs outputs.json]
"""

from __future__ import annotations

import argparse
import json
import sys
from collections import defaultdict
from pathlib import Path

from specdecode.api import Decoder
from specdecode.assembly import registry
from specdecode.bench import load_prompts, oracle_replay
from specdecode.control.costcache import cached_forward_curve
from specdecode.control.estimators import MATCH_BANDS, MATCH_PRIORS, match_band
from specdecode.drafters import NgramDrafter
from specdecode.limits import AUTO_KMAX, COST_CURVE_NS


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--target", default=registry.DEFAULT_TARGET)
    ap.add_argument("--outputs", type=Path, default=None,
                    help="save the plain outputs here, or reuse them when the file exists (JSON)")
    return ap


def held_out(prompts, per_category_skip: int = 3):
    """The suite's prompts after the first ``per_category_skip`` of each category."""
    seen: dict[str, int] = defaultdict(int)
    for p in prompts:
        seen[p.category] += 1
        if seen[p.category] > per_category_skip:
            yield p


def acceptance_table(examples: list[dict]) -> dict[tuple[int, bool], tuple[float, float, int]]:
    """(band index, unique) -> (first-token acceptance, further-token acceptance, lookups)."""
    d = NgramDrafter()
    st = defaultdict(lambda: [0, 0, 0, 0])  # first tries, first accepted, further tries, further accepted
    for ex in examples:
        out = ex["output"]
        for i in range(len(out) - 1):
            ctx = ex["prompt"] + out[:i]
            m = d.lookup(ctx)
            if m.length == 0:
                continue
            prop = ctx[m.start: m.start + AUTO_KMAX]
            n = 0
            while n < len(prop) and i + n < len(out) and prop[n] == out[i + n]:
                n += 1
            r = st[match_band(m.length), m.unique]
            r[0] += 1
            r[1] += n >= 1
            if n >= 1:
                r[2] += min(n + 1, len(prop), len(out) - i) - 1
                r[3] += n - 1
    return {k: (v[1] / v[0], v[3] / max(v[2], 1), v[0]) for k, v in st.items()}


def decode_held_out(args) -> tuple[list[dict], object]:
    """The held-out prompts' greedy plain outputs (or --outputs' saved ones) and the target's T(n)."""
    with Decoder(target=args.target, draft="none", num_speculative_tokens=0, progress=False) as dec:
        if args.outputs and args.outputs.exists():
            examples = json.loads(args.outputs.read_text())
        else:
            examples = []
            for p in held_out(load_prompts(None)):
                ids = dec.prompt_ids(p.prompt, p.messages, p.tools)
                r = dec.engine.generate(ids, max_tokens=p.max_tokens, grammar=p.grammar)
                examples.append({"id": p.id, "category": p.category, "prompt": ids, "output": r.token_ids})
                print(f"{p.id}: {len(r.token_ids)} tokens", file=sys.stderr, flush=True)
            if args.outputs:
                args.outputs.write_text(json.dumps(examples))
        return examples, cached_forward_curve(dec.target, COST_CURVE_NS, registry.cache_dir())


def main(argv=None) -> None:
    args = build_parser().parse_args(argv)
    examples, T = decode_held_out(args)
    table = acceptance_table(examples)
    print("band  unique  lookups  first  further  (prior: first  further)")
    for (b, u), (a1, a, n) in sorted(table.items()):
        p1, p = MATCH_PRIORS[u][b]
        print(f"{MATCH_BANDS[b]:>4}  {str(u):6} {n:8d}  {a1:5.2f}  {a:7.2f}  ({p1:5.2f}  {p:7.2f})")
    per: dict[str, list[float]] = defaultdict(lambda: [0.0, 0.0])
    drafter = NgramDrafter()
    for ex in examples:
        r = oracle_replay(ex["prompt"], ex["output"], T, [drafter], kmax=AUTO_KMAX)
        per[ex["category"]][0] += r.plain_s
        per[ex["category"]][1] += r.time_s
    print(f"\nthe oracle over prompt lookup, replayed with T(n), no overheads, K <= {AUTO_KMAX}: speedup")
    for cat, (plain, oracle) in per.items():
        print(f"  {cat:20} {plain / oracle:5.2f}x")
    plain, oracle = (sum(v[i] for v in per.values()) for i in range(2))
    print(f"  {'overall':20} {plain / oracle:5.2f}x")


if __name__ == "__main__":
    main()
