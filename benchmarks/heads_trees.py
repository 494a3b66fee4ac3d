"""Draft heads as chains and as trees, side by side on held-out prompts (the built-in suite's
chat and code-editing categories, which the self-distilled training corpus does not hold).

For each prompt, in one process: plain decoding, heads drafting a chain of K tokens, and
heads drafting a tree of each head's top W candidates (K deep, --nodes nodes: ``max_tree_nodes``), greedy, on the torch
backend. Prints per configuration: acceptance (accepted / drafted: a tree's every node
counts as drafted), mean accepted length (tokens per target pass), decode tokens/s and the
speedup over plain, and parity with plain.

    python benchmarks/heads_trees.py --heads heads.safetensors [--target smollm2-135m-instruct]
        [--dtype bfloat16] [--k 4] [--width 3] [--categories chat,code_editing] [--max-tokens 128]
"""

from __future__ import annotations

import argparse
import json
from collections import Counter

from specdecode.api import Decoder
from specdecode.bench import load_prompts, select_prompts
from specdecode.parity import parity_report


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--heads", required=True)
    ap.add_argument("--target", default="smollm2-135m-instruct")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--k", type=int, default=4)
    ap.add_argument("--width", type=int, default=3)
    ap.add_argument("--nodes", type=int, default=0, help="tree nodes (default: 2 K)")
    ap.add_argument("--categories", default="chat,code_editing")
    ap.add_argument("--per-category", type=int, default=4)
    ap.add_argument("--max-tokens", type=int, default=128)
    return ap


def main(argv=None) -> None:
    args = build_parser().parse_args(argv)
    prompts = select_prompts(load_prompts(None), args.categories.split(","), args.per_category)
    nodes = args.nodes or 2 * args.k
    out: dict = {}
    with Decoder(args.target, draft=f"heads:{args.heads}", num_speculative_tokens=args.k, backend="torch",
                 dtype=args.dtype, progress=False, tree_width=args.width) as dec:
        dec.generate(prompt="Hello", max_tokens=4, plain=True)  # warm-up
        for p in prompts:
            ids = dec.prompt_ids(p.prompt, p.messages)
            runs = {}
            for name, n in (("plain", 0), ("chain", 0), (f"tree w{args.width}", nodes)):
                runs[name] = dec.generate(prompt_ids=ids, max_tokens=args.max_tokens, plain=name == "plain",
                                          max_tree_nodes=n, record_top2_gaps=name == "plain")
            for name, r in runs.items():
                row = out.setdefault(p.category, {}).setdefault(name, [])
                row.append({"tokens": r.stats.completion_tokens, "decode_s": r.stats.decode_s,
                            "drafted": r.stats.drafted, "accepted": r.stats.accepted,
                            "passes": r.stats.target_forward_passes,
                            "parity": parity_report(r, runs["plain"])["status"] if name != "plain" else "-"})
    report = {}
    for cat, by in out.items():
        plain_rate = sum(x["tokens"] for x in by["plain"]) / sum(x["decode_s"] for x in by["plain"])
        for name, rows in by.items():
            rate = sum(x["tokens"] for x in rows) / sum(x["decode_s"] for x in rows)
            drafted = sum(x["drafted"] for x in rows)
            report[f"{cat} / {name}"] = {
                "tokens_per_s": round(rate, 2), "speedup": round(rate / plain_rate, 3),
                "acceptance": round(sum(x["accepted"] for x in rows) / drafted, 3) if drafted else None,
                "mean_accepted_length": round(sum(x["tokens"] for x in rows) / sum(x["passes"] for x in rows), 3),
                "parity": dict(Counter(x["parity"] for x in rows))}
    print(json.dumps({"target": args.target, "dtype": args.dtype, "k": args.k, "tree_nodes": nodes,
                      "width": args.width, "results": report}, indent=1))


if __name__ == "__main__":
    main()
