"""The two sampling rules side by side on the same prompts and seeds: acceptance of a draft
model's sampled drafts, tokens per target forward and decode speed under the "gumbel" rule
(position-keyed noise: the draft draws with the target's noise of that position) and the
"rejection" rule (Leviathan et al. 2023, Algorithm 1). Also whether each rule's output for a
seed is the same at two K (the promise of the "gumbel" rule).

    python benchmarks/sampling_rules.py --per-category 3 --max-tokens 96 --out benchmarks/results/sampling_rules

Prints a table; with --out writes results.json there.
"""

from __future__ import annotations

import argparse
import json
import platform
from pathlib import Path

from specdecode import Decoder
from specdecode.assembly import registry
from specdecode.bench.suite import load_prompts, select_prompts


def cpu() -> str:
    try:
        info = Path("/proc/cpuinfo").read_text()
    except OSError:
        return platform.processor()
    name = next((line.split(":", 1)[1].strip() for line in info.splitlines() if line.startswith("model name")), "?")
    return f"{name} ({'AVX-512' if ' avx512f' in info else 'AVX2'})"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--target", default=registry.DEFAULT_TARGET)
    ap.add_argument("--draft", default=registry.DEFAULT_DRAFT)
    ap.add_argument("--categories", default="code_editing,chat")
    ap.add_argument("--per-category", type=int, default=3)
    ap.add_argument("--max-tokens", type=int, default=96)
    ap.add_argument("--temperature", type=float, default=0.8)
    ap.add_argument("-k", type=int, default=4)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()

    prompts = select_prompts(load_prompts(None, args.max_tokens), args.categories.split(","), args.per_category)
    rows = []
    with Decoder(target=args.target, draft=args.draft, num_speculative_tokens=args.k, progress=False) as dec:
        dec.generate("def f():", max_tokens=8)  # warm-up
        for i, p in enumerate(prompts):
            for rule in ("gumbel", "rejection"):
                kw = dict(prompt=p.prompt) if p.messages is None else dict(messages=p.messages)
                r = dec.generate(**kw, max_tokens=p.max_tokens, temperature=args.temperature, seed=1000 + i,
                                 sampling_rule=rule)
                other_k = dec.generate(**kw, max_tokens=p.max_tokens, temperature=args.temperature, seed=1000 + i,
                                       sampling_rule=rule, num_speculative_tokens=1)
                s = r.stats
                rows.append({"prompt": p.id, "category": p.category, "rule": rule, "drafted": s.drafted,
                             "accepted": s.accepted, "acceptance_rate": s.acceptance_rate,
                             "mean_accepted_length": s.mean_accepted_length,
                             "decode_tokens_per_s": s.decode_tokens_per_s,
                             "same_text_at_k1": r.token_ids == other_k.token_ids})
    summary = {}
    for rule in ("gumbel", "rejection"):
        rs = [r for r in rows if r["rule"] == rule]
        drafted, accepted = sum(r["drafted"] for r in rs), sum(r["accepted"] for r in rs)
        summary[rule] = {"acceptance_rate": round(accepted / drafted, 4) if drafted else 0.0,
                         "mean_accepted_length": round(sum(r["mean_accepted_length"] for r in rs) / len(rs), 3),
                         "decode_tokens_per_s": round(sum(r["decode_tokens_per_s"] for r in rs) / len(rs), 2),
                         "same_text_at_k1": f"{sum(r['same_text_at_k1'] for r in rs)}/{len(rs)}"}
    meta = {"target": args.target, "draft": args.draft, "k": args.k, "temperature": args.temperature,
            "prompts": len(prompts), "cpu": cpu()}
    print(json.dumps(meta))
    print(f"{'rule':10} {'acceptance':>10} {'mean acc len':>12} {'tok/s':>8} {'same text at K=1':>17}")
    for rule, s in summary.items():
        print(f"{rule:10} {s['acceptance_rate']:>10.3f} {s['mean_accepted_length']:>12.2f} "
              f"{s['decode_tokens_per_s']:>8.2f} {s['same_text_at_k1']:>17}")
    if args.out:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        (out / "results.json").write_text(json.dumps({"meta": meta, "summary": summary, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
