"""Plain decoding against llama.cpp's own llama-server, interleaved, at two context lengths.

Issue 60, item 2: "plain within 3% of llama-server plain in decode and in prompt reading, at
200 and at 4,000 tokens of context". One bench run times each prompt once per side, minutes
apart, on a shared machine; this probe alternates the two sides on the same token ids several
rounds (the order flips each round, so that a drift of the machine falls on both), and prints
each side's median decode tokens/s (after the first token) and prompt tokens/s with their ratio.
The prompts are the standard library's own source (argparse.py: code no one here wrote), cut to
about N tokens, so that the continuation is code and runs to --max-tokens.

    python benchmarks/plain_vs_llama_server.py [--target NAME] [--contexts 200,4000] [--rounds 5]

Both sides read the whole prompt every time (specdecode forgets its prefix; llama-server gets
``cache_prompt`` false), use the same threads and the same attention path (llama-server's ``-fa``
is set to the path specdecode chose). Build llama-server first: bash benchmarks/build_llama_server.sh.
"""

from __future__ import annotations

import argparse
import inspect
import statistics

from specdecode.api import Decoder
from specdecode.assembly import registry
from specdecode.bench import cpu_name, decode_rate
from specdecode.bench.llama_server import LlamaServer, default_binary


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--target", default="qwen2.5-coder-1.5b-instruct")
    ap.add_argument("--ctx-size", type=int, default=8192)
    ap.add_argument("--contexts", default="200,4000", help="prompt lengths in tokens")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--llama-server", default=None, help="the llama-server binary (default: the built one)")
    return ap


def prompts(dec: Decoder, lengths: list[int]) -> dict[int, list[int]]:
    import argparse as source

    ids = dec.tokenize(inspect.getsource(source), add_special=False)
    if len(ids) < max(lengths):
        raise SystemExit(f"argparse.py has {len(ids)} tokens, fewer than {max(lengths)}")
    return {n: ids[:n] for n in lengths}


def run_specdecode(dec: Decoder, ids: list[int], max_tokens: int) -> tuple[float, float, int]:
    dec.engine.forget_prefix()
    s = dec.generate_ids(ids, max_tokens=max_tokens, temperature=0).stats
    return (decode_rate(s.completion_tokens, s.first_token_s, s.prefill_s + s.decode_s),
            len(ids) / s.prefill_s if s.prefill_s > 0 else 0.0, s.completion_tokens)


def run_llama_server(server: LlamaServer, ids: list[int], max_tokens: int) -> tuple[float, float, int]:
    r = server.run(ids, max_tokens)
    return r.decode_rate, r.prompt_n / r.prompt_s if r.prompt_s > 0 else 0.0, len(r.tokens)


def main(argv=None) -> None:
    args = build_parser().parse_args(argv)
    binary = args.llama_server or default_binary()
    if binary is None:
        raise SystemExit("no llama-server: bash benchmarks/build_llama_server.sh, or --llama-server PATH")
    lengths = [int(c) for c in args.contexts.split(",")]
    with Decoder(target=args.target, draft="none", n_ctx=args.ctx_size, n_threads=args.threads,
                 progress=False) as dec:
        ids = prompts(dec, lengths)
        flash = dec.target.flash_attention  # "auto", "on" or "off": llama-server's -fa takes the same
        with LlamaServer(binary, registry.resolve(args.target), args.ctx_size, dec.target.n_threads,
                         flash_attn=flash) as server:
            runs = {(side, n): [] for side in ("specdecode", "llama-server") for n in lengths}
            for r in range(args.rounds):
                sides = [("specdecode", lambda x: run_specdecode(dec, x, args.max_tokens)),
                         ("llama-server", lambda x: run_llama_server(server, x, args.max_tokens))]
                for side, fn in (sides if r % 2 == 0 else sides[::-1]):
                    for n in lengths:
                        runs[side, n].append(fn(ids[n]))
                print(f"round {r + 1}: " + "; ".join(f"{side} {n}: {v[-1][0]:.2f} tok/s, prompt {v[-1][1]:.1f} tok/s"
                                                     for (side, n), v in runs.items()), flush=True)
    print(f"\n# plain decoding against llama-server plain: {cpu_name()}, {dec.target.n_threads} threads, "
          f"{args.target}, flash attention {flash}, {args.rounds} rounds interleaved, {args.max_tokens} tokens\n")
    print("| prompt tokens | specdecode decode tok/s | llama-server | ratio | specdecode prompt tok/s | "
          "llama-server | ratio |\n|---|---|---|---|---|---|---|")
    for n in lengths:
        sd = [statistics.median(v[i] for v in runs["specdecode", n]) for i in (0, 1)]
        ls = [statistics.median(v[i] for v in runs["llama-server", n]) for i in (0, 1)]
        print(f"| {n} | {sd[0]:.2f} | {ls[0]:.2f} | {sd[0] / ls[0]:.3f}x | {sd[1]:.1f} | {ls[1]:.1f} | "
              f"{sd[1] / ls[1]:.3f}x |")


if __name__ == "__main__":
    main()
