"""Command-line interface: ``specdecode generate`` and ``specdecode models``.

Errors a user can cause print one line on stderr and exit with status 1 (2 for
malformed command lines); set SPECDECODE_DEBUG=1 to see a traceback.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Sequence

from . import models
from .errors import SpecDecodeError

EXIT_ERROR = 1


def _stats_block(label: str, stats: dict) -> str:
    per_pos = ", ".join(
        f"{a}/{d}" for a, d in zip(stats["accepted_per_position"], stats["drafted_per_position"])
    )
    lines = [
        f"--- {label}",
        f"tokens: prompt {stats['prompt_tokens']}, completion {stats['completion_tokens']}",
        f"drafted {stats['drafted']}, accepted {stats['accepted']}, acceptance_rate {stats['acceptance_rate']:.3f}, "
        f"mean_accepted_length {stats['mean_accepted_length']:.2f}, target_forward_passes {stats['target_forward_passes']}",
    ]
    if per_pos:
        lines.append(f"per-position acceptance (accepted/drafted): {per_pos}")
    if stats["k_histogram"]:
        lines.append("steps by K drafted: " + ", ".join(f"K={k}: {n}" for k, n in stats["k_histogram"].items()))
    lines.append(
        f"prefill_s {stats['prefill_s']:.3f}, decode_s {stats['decode_s']:.3f} "
        f"(draft_s {stats['draft_s']:.3f}, verify_s {stats['verify_s']:.3f}), "
        f"decode_tokens_per_s {stats['decode_tokens_per_s']:.2f}"
    )
    return "\n".join(lines)


def _colour_tokens(dec, result) -> str:
    """Accepted drafts in green, the target's own tokens plain (for --show-acceptance)."""
    out, run, run_flag = [], b"", None
    for tok, flag in zip(result.token_ids, result.from_draft):
        if flag != run_flag and run:
            out.append((run, run_flag))
            run = b""
        run_flag = flag
        run += dec.target.token_bytes(tok)
    if run:
        out.append((run, run_flag))
    text = "".join(
        ("\x1b[32m" + b.decode("utf-8", "replace") + "\x1b[0m") if f else b.decode("utf-8", "replace") for b, f in out
    )
    return text


def cmd_generate(args: argparse.Namespace) -> int:
    from .api import Decoder
    from .engine import GenerationResult

    if args.prompt is None and args.chat is None:
        raise SpecDecodeError("give --prompt TEXT or --chat TEXT")
    if args.max_tokens < 1:
        raise SpecDecodeError(f"--max-tokens {args.max_tokens} is out of range: expected >= 1")
    if args.logprobs is not None and not (0 <= args.logprobs <= 20):
        raise SpecDecodeError(f"--logprobs {args.logprobs} is out of range: expected 0..20")
    messages = [{"role": "user", "content": args.chat}] if args.chat is not None else None
    gen_kwargs = dict(
        messages=messages, max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p,
        top_k=args.top_k, min_p=args.min_p, repetition_penalty=args.repetition_penalty,
        frequency_penalty=args.frequency_penalty, presence_penalty=args.presence_penalty, seed=args.seed,
        stop=args.stop or None, logprobs=args.logprobs,
    )
    # Validate sampling options before loading models (fast, clear errors).
    from .sampling import SamplingParams

    SamplingParams(temperature=args.temperature, top_k=args.top_k, top_p=args.top_p, min_p=args.min_p,
                   repetition_penalty=args.repetition_penalty, frequency_penalty=args.frequency_penalty,
                   presence_penalty=args.presence_penalty, seed=args.seed)
    k = args.num_speculative_tokens
    if k != "auto" and not (0 <= k <= 32):
        raise SpecDecodeError(f"--num-speculative-tokens {k} is out of range: expected 0..32 or auto")

    with Decoder(target=args.target, draft=args.draft, num_speculative_tokens=args.num_speculative_tokens,
                 n_ctx=args.ctx_size, n_threads=args.threads, progress=not args.quiet, backend=args.backend,
                 draft_backend=args.draft_backend, dtype=args.dtype, device=args.device,
                 draft_vocab=args.draft_vocab) as dec:
        prompt = args.prompt
        if args.json or args.compare:
            if args.compare:
                result, base, report = dec.compare(prompt, **gen_kwargs)
            else:
                result = dec.generate(prompt, **gen_kwargs)
            obj = result.to_dict()
            obj["target"], obj["draft"] = args.target, args.draft
            if args.compare:
                obj["baseline"] = {**base.to_dict(), **report}
            if args.json:
                print(json.dumps(obj, ensure_ascii=False))
                return 0
            if args.show_acceptance:
                print(_colour_tokens(dec, result))
            else:
                print(result.text)
            print(_stats_block(f"speculative (draft {args.draft}, K={args.num_speculative_tokens})",
                               obj["stats"]), file=sys.stderr)
            print(_stats_block("plain (draft none)", base.stats.to_dict()), file=sys.stderr)
            print(f"speedup {report['speedup']}x, parity: {json.dumps(report['parity'])}", file=sys.stderr)
            return 0

        if args.show_acceptance:
            result = dec.generate(prompt, **gen_kwargs)
            print(_colour_tokens(dec, result))
        else:
            result = None
            for item in dec.stream(prompt, **gen_kwargs):
                if isinstance(item, GenerationResult):
                    result = item
                else:
                    sys.stdout.write(item)
                    sys.stdout.flush()
            sys.stdout.write("\n")
        print(_stats_block(f"speculative (draft {args.draft}, K={args.num_speculative_tokens}), "
                           f"finish_reason {result.finish_reason}", result.stats.to_dict()), file=sys.stderr)
    return 0


def cmd_models(args: argparse.Namespace) -> int:
    if args.models_cmd == "convert":
        for name in args.names:
            print(models.convert_to_hf(name, dtype=args.dtype, progress=not args.quiet))
        return 0
    if args.models_cmd == "pull":
        for name in args.names:
            path = models.pull(name, progress=not args.quiet)
            print(path)
        return 0
    rows = models.list_models()
    if args.json:
        print(json.dumps(rows))
        return 0
    print(f"{'name':32} {'size':>10}  {'cached':6}  description")
    for r in rows:
        print(f"{r['name']:32} {r['size'] / 2**20:8.0f}MB  {'yes' if r['cached'] else 'no':6}  {r['description']}")
    print(f"cache: {models.cache_dir()} (set ${models.CACHE_ENV} to move it)")
    return 0


def k_value(text: str) -> int | str:
    """argparse type for --num-speculative-tokens: an integer or 'auto'."""
    if text == "auto":
        return text
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer 0..32 or 'auto', got {text!r}") from None


def _non_negative_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer >= 0, got {text!r}") from None
    if value < 0:
        raise argparse.ArgumentTypeError(f"{value} is out of range: expected an integer >= 0")
    return value


def add_backend_options(p: argparse.ArgumentParser) -> None:
    """--backend, --draft-backend, --dtype, --device (shared by generate, serve and bench)."""
    p.add_argument("--backend", choices=["auto", "llama.cpp", "torch"], default="auto",
                   help="target backend; auto: llama.cpp for .gguf files and registry names, torch for "
                        "Hugging Face folders (default: %(default)s)")
    p.add_argument("--draft-backend", choices=["auto", "llama.cpp", "torch"], default="auto",
                   help="draft model backend, as --backend")
    p.add_argument("--dtype", choices=["float32", "bfloat16", "float16"], default="float32",
                   help="torch backend weights (default: %(default)s)")
    p.add_argument("--device", choices=["cpu", "cuda", "auto"], default="cpu",
                   help="torch backend device (default: %(default)s)")
    p.add_argument("--draft-vocab", type=_non_negative_int, default=0, metavar="N",
                   help="a draft model on the torch backend (--draft-backend torch) scores only token ids "
                        "< N, the prompt's tokens and end-of-generation ids (FR-Spec; cheaper drafts, same "
                        "output; default: 0 = all)")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="specdecode", description="Lossless speculative decoding of LLMs.")
    sub = p.add_subparsers(dest="command", required=True)

    g = sub.add_parser("generate", help="generate text speculatively and print statistics")
    src = g.add_mutually_exclusive_group()
    src.add_argument("--prompt", help="raw prompt text")
    src.add_argument("--chat", help="a user message, rendered with the model's own chat template")
    g.add_argument("--target", default=models.DEFAULT_TARGET, help="registry name or .gguf path (default: %(default)s)")
    g.add_argument("--draft", default=models.DEFAULT_DRAFT,
                   help="registry name, .gguf path, Hugging Face folder, 'ngram' (prompt lookup), 'none' (plain decoding) or 'auto' "
                        "(n-gram when it matches, else the default draft model when it pays) (default: %(default)s)")
    g.add_argument("--num-speculative-tokens", "-k", type=k_value, default="auto",
                   help="K, drafted tokens per step (0..32), or 'auto': chosen each step from measured costs "
                        "(default: %(default)s)")
    g.add_argument("--max-tokens", type=int, default=256)
    g.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    g.add_argument("--top-p", type=float, default=1.0)
    g.add_argument("--top-k", type=int, default=0)
    g.add_argument("--min-p", type=float, default=0.0)
    g.add_argument("--repetition-penalty", type=float, default=1.0)
    g.add_argument("--frequency-penalty", type=float, default=0.0)
    g.add_argument("--presence-penalty", type=float, default=0.0)
    g.add_argument("--seed", type=int, default=None)
    g.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    g.add_argument("--logprobs", type=int, default=None, metavar="N",
                   help="record the N most likely tokens per emitted token (target's raw distribution)")
    g.add_argument("--compare", action="store_true", help="also run plain decoding; report speedup and parity")
    g.add_argument("--json", action="store_true", help="print one JSON object on stdout")
    g.add_argument("--show-acceptance", action="store_true", help="colour accepted drafts green")
    g.add_argument("--ctx-size", type=int, default=4096, help="context window in tokens")
    g.add_argument("--threads", type=int, default=None, help="CPU threads (default: all cores)")
    g.add_argument("--quiet", action="store_true", help="no progress bars")
    add_backend_options(g)
    g.set_defaults(func=cmd_generate)

    m = sub.add_parser("models", help="list or pull registry models")
    msub = m.add_subparsers(dest="models_cmd", required=True)
    ml = msub.add_parser("list", help="list registry models and whether they are cached")
    ml.add_argument("--json", action="store_true")
    ml.set_defaults(func=cmd_models, quiet=False)
    mp = msub.add_parser("pull", help="download, assemble and verify models")
    mp.add_argument("names", nargs="+", choices=list(models.REGISTRY), metavar="NAME")
    mp.add_argument("--quiet", action="store_true")
    mp.set_defaults(func=cmd_models)
    mc = msub.add_parser("convert", help="dequantize a registry GGUF once into a cached Hugging Face folder "
                                         "(for --backend torch)")
    mc.add_argument("names", nargs="+", choices=list(models.REGISTRY), metavar="NAME")
    mc.add_argument("--dtype", choices=["float32", "bfloat16", "float16"], default="bfloat16")
    mc.add_argument("--quiet", action="store_true")
    mc.set_defaults(func=cmd_models)

    from .bench import add_bench_parser
    from .server import add_serve_parser

    add_serve_parser(sub)
    add_bench_parser(sub)
    return p


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except SpecDecodeError as e:
        print(f"specdecode: error: {e}", file=sys.stderr)
        return EXIT_ERROR
    except KeyboardInterrupt:
        print("specdecode: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:
        return 0
    except Exception as e:  # unexpected: still one line unless debugging
        if os.environ.get("SPECDECODE_DEBUG"):
            raise
        print(f"specdecode: internal error: {type(e).__name__}: {e} (set SPECDECODE_DEBUG=1 for a traceback)",
              file=sys.stderr)
        return EXIT_ERROR


if __name__ == "__main__":
    sys.exit(main())
