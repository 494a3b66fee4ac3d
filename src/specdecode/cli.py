"""Command-line interface: ``specdecode generate``, ``models``, ``serve`` and ``bench``.

Errors a user can cause print one line on stderr and exit with status 1 (2 for
malformed command lines); set SPECDECODE_DEBUG=1 to see a traceback.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Sequence

from . import __version__
from .assembly import registry
from .bench.cli import add_bench_parser, add_bench_serve_parser
from .heads.cli import add_heads_parser
from .errors import SpecDecodeError
from .grammar import Grammar
from .limits import BATCH_INVARIANCE, DEFAULT_MAX_TOKENS, DTYPES, MAX_LOGPROBS, check_logprobs, check_text
from .messages import check_messages
from .stats import placement_words
from .options import (add_model_options, add_sampling_options, check_model_args, read_input, sampling_from_args,
                      sampling_kwargs)
from .server.cli import add_serve_parser

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
    if stats.get("controller_note"):
        lines.append(f"controller: {stats['controller_note']}")
    if stats.get("accepted_prediction_tokens") is not None:
        lines.append(f"prediction: {stats['accepted_prediction_tokens']} tokens accepted, "
                     f"{stats['rejected_prediction_tokens']} rejected")
    if stats.get("tree_steps"):
        ranks = ", ".join(f"rank {r}: {n}" for r, n in enumerate(stats["accepted_per_rank"]))
        n = stats["tree_steps"]
        lines.append(f"trees: {n} tree steps of {stats.get('tree_nodes', 0) / n:.1f} nodes, "
                     f"{stats.get('tree_accepted', 0) / n:.2f} accepted per step; accepted nodes by sibling rank: {ranks}")
    if stats.get("invariant_block") == 1:
        lines.append("batch-invariant: decoded without drafts: on this machine's attention path (flash attention off, "
                     "chosen by measurement) no forward of 2+ tokens gives the logits of one-token steps, so drafts "
                     "could change a seeded sample; --batch-invariant off speculates as usual")
    elif stats.get("invariant_block"):
        lines.append(f"batch-invariant: verified in blocks of at most {stats['invariant_block']} tokens, whose logits "
                     "equal one-token steps on this machine, so K and the drafter cannot change the text")
    if stats.get("device"):
        lines.append("device: " + placement_words(stats))
    if stats.get("weights"):
        lines.append(f"weights: {stats['weights']}")
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
    return "".join(
        ("\x1b[32m" + b.decode("utf-8", "replace") + "\x1b[0m") if f else b.decode("utf-8", "replace") for b, f in out
    )


def prompt_from_args(args: argparse.Namespace) -> tuple[str | None, list[dict] | None]:
    """(raw prompt, None) or (None, chat messages) from --prompt/--prompt-file, --chat/--chat-file,
    --messages-file and --system. Raises SpecDecodeError naming the option at fault."""
    if args.messages_file is not None:
        text = read_input(args.messages_file, "--messages-file")
        try:
            value = json.loads(text)
        except json.JSONDecodeError as e:
            raise SpecDecodeError(f"--messages-file {args.messages_file}: not valid JSON ({e.msg} at line {e.lineno}, "
                                  f"column {e.colno})", param="--messages-file") from None
        except RecursionError:
            raise SpecDecodeError(f"--messages-file {args.messages_file}: its arrays and objects nest too deeply to "
                                  "read", param="--messages-file") from None
        try:
            messages = check_messages(value)
        except SpecDecodeError as e:
            raise SpecDecodeError(f"--messages-file {args.messages_file}: {e}", param="--messages-file") from None
    elif args.chat is not None or args.chat_file is not None:
        user = args.chat if args.chat is not None else read_input(args.chat_file, "--chat-file")
        messages = [{"role": "user", "content": user}]
    elif args.prompt is not None or args.prompt_file is not None:
        if args.system is not None:
            raise SpecDecodeError("--system applies to chat input (--chat, --chat-file or --messages-file), "
                                  "not to a raw --prompt", param="--system")
        return (args.prompt if args.prompt is not None else read_input(args.prompt_file, "--prompt-file")), None
    else:
        raise SpecDecodeError("give the input: --prompt TEXT, --chat TEXT, --prompt-file PATH|-, --chat-file PATH|- "
                              "or --messages-file PATH|-")
    if args.system is not None:
        if messages[0]["role"] == "system":
            raise SpecDecodeError("--system given, but the conversation already starts with a system message",
                                  param="--system")
        messages = [{"role": "system", "content": args.system}] + messages
    return None, messages


def grammar_from_args(args: argparse.Namespace) -> Grammar | None:
    """--json-schema FILE, --regex TEXT or --grammar FILE (Lark) as a Grammar, or None.
    Raises SpecDecodeError naming the option when a file cannot be read or is not JSON."""
    if args.json_schema is not None:
        return Grammar.json_schema(read_input(args.json_schema, "--json-schema"), name="--json-schema")
    if args.regex is not None:
        return Grammar("regex", args.regex, name="--regex")
    if args.grammar is not None:
        return Grammar("lark", read_input(args.grammar, "--grammar"), name="--grammar")
    return None


def _check_prompt_gives_tokens(dec, prompt: str | None, args: argparse.Namespace) -> None:
    """An empty raw prompt (which gives no token where the model adds no start token) refused
    naming the option that gave it."""
    if prompt != "":
        return
    try:
        dec.prompt_ids(prompt)
    except SpecDecodeError as e:
        if e.param != "prompt":
            raise
        option = "--prompt" if args.prompt is not None else \
            f"--prompt-file {'standard input' if args.prompt_file == '-' else args.prompt_file}"
        raise SpecDecodeError(f"{option} is empty, and the target {args.target} adds no start token to a prompt, so "
                              "it gives no token to continue from: give some text", param=option) from None


def cmd_generate(args: argparse.Namespace) -> int:
    from .options import decoder_from_args
    from .output import GenerationResult

    # Every check that needs no model comes first (fast, clear errors).
    if args.max_tokens < 1:
        raise SpecDecodeError(f"--max-tokens {args.max_tokens} is out of range: expected >= 1")
    check_logprobs(args.logprobs, "--logprobs")
    sampling_from_args(args)
    check_model_args(args)
    for option in ("prompt", "chat", "system", "regex"):
        if getattr(args, option) is not None:
            check_text(getattr(args, option), f"--{option}")
    for i, stop in enumerate(args.stop or ()):
        check_text(stop, f"--stop ({i + 1})")
    prompt, messages = prompt_from_args(args)
    if args.prediction_file == "-" and "-" in (args.prompt_file, args.chat_file, args.messages_file):
        raise SpecDecodeError("--prediction-file - and the input both read standard input: give one of them a file",
                              param="--prediction-file")
    prediction = read_input(args.prediction_file, "--prediction-file") if args.prediction_file else None
    gen_kwargs = dict(prediction=prediction,messages=messages, max_tokens=args.max_tokens, stop=args.stop or None, logprobs=args.logprobs,
                      grammar=grammar_from_args(args), batch_invariant=args.batch_invariant, **sampling_kwargs(args))
    label = f"speculative (draft {args.draft}, K={args.num_speculative_tokens})"

    with decoder_from_args(args, progress=not args.quiet) as dec:
        _check_prompt_gives_tokens(dec, prompt, args)
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
            print(_colour_tokens(dec, result) if args.show_acceptance else result.text)
            print(_stats_block(label, obj["stats"]), file=sys.stderr)
            print(_stats_block("plain (draft none)", base.stats.to_dict()), file=sys.stderr)
            h = report["halves"]
            print(f"speedup {report['speedup']}x (against the plain run before: {h[0]}x, after: {h[1]}x), "
                  f"parity: {json.dumps(report['parity'])}", file=sys.stderr)
            if report.get("note"):
                print(f"warning: {report['note']}", file=sys.stderr)
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
        print(_stats_block(f"{label}, finish_reason {result.finish_reason}", result.stats.to_dict()), file=sys.stderr)
    return 0


def cmd_models(args: argparse.Namespace) -> int:
    if args.models_cmd == "convert":
        for name in args.names:
            print(registry.convert_to_hf(name, dtype=args.dtype, progress=not args.quiet))
        return 0
    if args.models_cmd == "pull":
        for name in args.names:
            print(registry.pull(name, progress=not args.quiet))
        return 0
    rows = registry.list_models()
    if args.json:
        print(json.dumps(rows))
        return 0
    print(f"{'name':32} {'size':>10}  {'cached':6}  description")
    for r in rows:
        print(f"{r['name']:32} {r['size'] / 2**20:8.0f}MB  {'yes' if r['cached'] else 'no':6}  {r['description']}")
    print(f"cache: {registry.cache_dir()} (set ${registry.CACHE_ENV} to move it)")
    return 0


def add_generate_parser(sub: argparse._SubParsersAction) -> None:
    g = sub.add_parser("generate", help="generate text speculatively and print statistics")
    src = g.add_mutually_exclusive_group()
    src.add_argument("--prompt", help="raw prompt text")
    src.add_argument("--chat", help="a user message, rendered with the model's own chat template")
    src.add_argument("--prompt-file", metavar="PATH|-", help="raw prompt read from a file, or '-' for standard input")
    src.add_argument("--chat-file", metavar="PATH|-", help="the user message read from a file, or '-' for standard input")
    src.add_argument("--messages-file", metavar="PATH|-",
                     help='a conversation: a JSON list of {"role": "system"|"user"|"assistant", "content": ...}')
    g.add_argument("--system", metavar="TEXT", help="a system message before the chat input")
    add_model_options(g)
    g.add_argument("--max-tokens", type=int, default=DEFAULT_MAX_TOKENS, help="exact cap on generated tokens (default: %(default)s)")
    add_sampling_options(g)
    g.add_argument("--batch-invariant", choices=BATCH_INVARIANCE, default="auto",
                   help="verify in blocks whose logits equal one-token steps on this machine (measured once), so "
                        "that K, the drafter and the batch cannot change a token; 'auto': for seeded sampling "
                        "(default: %(default)s)")
    g.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    g.add_argument("--prediction-file", metavar="PATH|-",
                   help="the output expected (e.g. the file being edited): drafts follow it and re-align after each "
                        "change; it never changes the output (needs --draft auto or prediction)")
    structured = g.add_mutually_exclusive_group()
    structured.add_argument("--json-schema", metavar="FILE|-", help="the output is JSON matching this JSON schema")
    structured.add_argument("--regex", metavar="REGEX", help="the output matches this regular expression")
    structured.add_argument("--grammar", metavar="FILE|-", help="the output matches this Lark grammar (llguidance's "
                                                              "dialect)")
    g.add_argument("--logprobs", type=int, default=None, metavar="N",
                   help=f"record the N (0..{MAX_LOGPROBS}) most likely tokens per emitted token (target's raw "
                        "distribution)")
    g.add_argument("--compare", action="store_true", help="also run plain decoding; report speedup and parity")
    g.add_argument("--json", action="store_true", help="print one JSON object on stdout")
    g.add_argument("--show-acceptance", action="store_true", help="colour accepted drafts green")
    g.add_argument("--quiet", action="store_true", help="no progress bars")
    g.set_defaults(func=cmd_generate)


def add_models_parser(sub: argparse._SubParsersAction) -> None:
    m = sub.add_parser("models", help="list, pull or convert registry models")
    msub = m.add_subparsers(dest="models_cmd", required=True)
    ml = msub.add_parser("list", help="list registry models and whether they are cached")
    ml.add_argument("--json", action="store_true")
    ml.set_defaults(func=cmd_models, quiet=False)
    mp = msub.add_parser("pull", help="download, assemble and verify models")
    mp.add_argument("names", nargs="+", choices=list(registry.REGISTRY), metavar="NAME")
    mp.add_argument("--quiet", action="store_true")
    mp.set_defaults(func=cmd_models)
    mc = msub.add_parser("convert", help="dequantize a registry GGUF once into a cached Hugging Face folder "
                                         "(for --backend torch)")
    mc.add_argument("names", nargs="+", choices=list(registry.REGISTRY), metavar="NAME")
    mc.add_argument("--dtype", choices=DTYPES, default="bfloat16")
    mc.add_argument("--quiet", action="store_true")
    mc.set_defaults(func=cmd_models)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="specdecode", description="Lossless speculative decoding of LLMs.")
    p.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    sub = p.add_subparsers(dest="command", required=True)
    add_generate_parser(sub)
    add_models_parser(sub)
    add_serve_parser(sub)
    add_bench_parser(sub)
    add_bench_serve_parser(sub)
    add_heads_parser(sub)
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
