"""The same request sent twice to one Decoder (an agent retrying, a user regenerating): the
second time suffix drafting has the whole answer, so the win should approach the machine's
copy limit L = 33 T(1) / T(33), what a perfect 32-token copy verified in one forward gains
over one-token decoding.

Runs, in one process and in this order: plain, speculative (first), speculative (the
repeat), plain; prints decode tokens/s of each, the repeat's speedup over the two plain
runs, and L from the controller's cost curve. Greedy, default pair, -k auto.

    python benchmarks/repeat_request.py [--max-tokens 200] [--prompt TEXT]
"""

from __future__ import annotations

import argparse
import json

import specdecode
from specdecode.parity import parity_report

DEFAULT_PROMPT = ("Explain how a hash table works: hashing, buckets, collisions and resizing, "
                  "with a short Python example.")


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--max-tokens", type=int, default=200)
    ap.add_argument("--prompt", default=DEFAULT_PROMPT)
    return ap


def main(argv=None) -> None:
    args = build_parser().parse_args(argv)
    messages = [{"role": "user", "content": args.prompt}]
    with specdecode.Decoder(draft="auto", num_speculative_tokens="auto", progress=False) as dec:
        dec.generate(messages=messages, max_tokens=8, plain=True)  # warm-up
        runs = {}
        for name, plain in (("plain_before", True), ("first", False), ("repeat", False), ("plain_after", True)):
            runs[name] = dec.generate(messages=messages, max_tokens=args.max_tokens, plain=plain, record_top2_gaps=plain)
        T = dec.drafter.target_cost
        limit = 33 * T(1) / T(33)
    rate = {k: r.stats.decode_tokens_per_s for k, r in runs.items()}
    plain = (runs["plain_before"].stats.completion_tokens + runs["plain_after"].stats.completion_tokens) / (
        runs["plain_before"].stats.decode_s + runs["plain_after"].stats.decode_s)
    parity = {k: parity_report(runs[k], runs["plain_before"])["status"] for k in ("first", "repeat")}
    out = {"tokens_per_s": {k: round(v, 2) for k, v in rate.items()},
           "repeat_speedup": round(rate["repeat"] / plain, 3), "first_speedup": round(rate["first"] / plain, 3),
           "copy_limit_L": round(limit, 3), "T1_ms": round(T(1) * 1e3, 1), "T33_ms": round(T(33) * 1e3, 1),
           "repeat_k_histogram": runs["repeat"].stats.to_dict()["k_histogram"],
           "repeat_mean_accepted_length": round(runs["repeat"].stats.mean_accepted_length, 2),
           "parity_with_plain": parity, "controller": runs["repeat"].stats.controller_note}
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
