"""Measure the prompt-lookup acceptance priors of the controller (controller.MATCH_PRIORS).

Decodes the built-in suite's held-out prompts (4-8 of each category; `specdecode bench
--per-category 3` runs prompts 1-3) plainly and greedily with the target, then at every
position of each output looks the context up as NgramDrafter does and counts, per kind
of match (match-length band, unique continuation or not), how often the first proposed
token equals the target's next token and how often each further one does once the one
before it did. Prints the table as it goes into MATCH_PRIORS, and a replay of the
controller over the same outputs with the cached cost curve T(n): the speedup it would
reach with no overheads, beside that of the bench's oracle (specdecode.bench.oracle), which
knows each draft's outcome, at the controller's K cap (limits.AUTO_KMAX).

    python benchmarks/ngram_priors.py [--target NAME] [--out outputs.json]
"""

from __future__ import annotations

import argparse
import json
import sys
from collections import defaultdict
from pathlib import Path


def held_out(rows, per_category_skip=3):
    seen: dict[str, int] = defaultdict(int)
    for r in rows:
        seen[r.category] += 1
        if seen[r.category] > per_category_skip:
            yield r


def acceptance_table(examples):
    from specdecode.control.controller import MATCH_BANDS, match_band
    from specdecode.drafters import NgramDrafter
    from specdecode.limits import AUTO_KMAX

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
    return {k: (v[1] / v[0], v[3] / max(v[2], 1), v[0]) for k, v in st.items()}, MATCH_BANDS


def replay(examples, make_controller, T, kmax):
    """Per category: plain time, time of a controller replayed over fixed greedy outputs
    (each step costing T(k + 1), K <= kmax), and time of the oracle over prompt lookup with
    K <= kmax (seconds)."""
    from specdecode.bench.oracle import oracle_replay
    from specdecode.drafters import NgramDrafter
    from specdecode.sampling import Sampler, SamplingParams

    per = defaultdict(lambda: [0.0, 0.0, 0.0])
    for ex in examples:
        out, prompt = ex["output"], ex["prompt"]
        ctl = make_controller()
        ctl.start(prompt, Sampler(SamplingParams()))
        i, t = 0, 0.0
        while i < len(out):
            d = ctl.propose(prompt + out[:i], max(0, min(kmax, len(out) - i - 1)))
            k, n = len(d.token_ids), 0
            while n < k and d.token_ids[n] == out[i + n]:
                n += 1
            ctl.observe(n)
            t += T(k + 1)
            i += n + 1
        c = per[ex["category"]]
        c[0] += len(out) * T(1)
        c[1] += t
        c[2] += oracle_replay(prompt, out, T, [NgramDrafter()], kmax=kmax).time_s
    return per


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--target", default="qwen2.5-coder-1.5b-instruct")
    ap.add_argument("--out", type=Path, default=None, help="save (or reuse) the plain outputs here")
    args = ap.parse_args()

    from specdecode.assembly import registry
    from specdecode.api import Decoder
    from specdecode.control.controller import Source, SpeculationController
    from specdecode.control.costcache import cached_forward_curve
    from specdecode.drafters import NgramDrafter
    from specdecode.bench import load_prompts
    from specdecode.limits import AUTO_KMAX, COST_CURVE_NS

    with Decoder(target=args.target, draft="none", num_speculative_tokens=0, progress=False) as dec:
        if args.out and args.out.exists():
            examples = json.loads(args.out.read_text())
        else:
            examples = []
            for p in held_out(load_prompts(None)):
                ids = dec.prompt_ids(p.prompt, p.messages)
                r = dec.engine.generate(ids, max_tokens=p.max_tokens)
                examples.append({"id": p.id, "category": p.category, "prompt": ids, "output": r.token_ids})
                print(f"{p.id}: {len(r.token_ids)} tokens", file=sys.stderr, flush=True)
            if args.out:
                args.out.write_text(json.dumps(examples))
        T = cached_forward_curve(dec.target, COST_CURVE_NS, registry.cache_dir())

    table, bands = acceptance_table(examples)
    print("band  unique  drafts  first  further")
    for (b, u), (a1, a, n) in sorted(table.items()):
        print(f"{bands[b]:>4}  {str(u):6} {n:7d}  {a1:5.2f}  {a:7.2f}")
    kmax = AUTO_KMAX
    per = replay(examples, lambda: SpeculationController([Source(NgramDrafter(), 2e-4)], T, kmax=kmax), T, kmax)
    print(f"\nreplay with T(n), no overheads, K <= {kmax}: category  controller  oracle")
    for cat, (plain, spec, oracle) in per.items():
        print(f"  {cat:14} {plain / spec:5.2f}x  {plain / oracle:5.2f}x")
    tot = [sum(v[i] for v in per.values()) for i in range(3)]
    print(f"  {'overall':14} {tot[0] / tot[1]:5.2f}x  {tot[0] / tot[2]:5.2f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
