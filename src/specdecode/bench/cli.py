"""``specdecode bench`` on the command line: its options, and turning them into a
:class:`BenchConfig`. Model and sampling options are the shared ones of
:mod:`specdecode.options`; only the bench's own are declared here."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from ..options import (add_model_options, add_sampling_options, add_tree_options, check_model_args, read_input,
                       sampling_from_args)
from .report import print_table, write_outputs
from .config import DEFAULT_CONFIGS, BenchConfig
from .runner import run_bench
from .suite import DEFAULT_BENCH_MAX_TOKENS
from .vary import SETTINGS


def add_bench_parser(subparsers) -> argparse.ArgumentParser:
    """Add the ``bench`` subcommand (runs :func:`cmd_bench`) to an argparse subparsers object."""
    b = subparsers.add_parser("bench", help="benchmark speculative against plain decoding, per prompt category")
    # Drafts come in through --config, so no --draft / -k here.
    add_model_options(b, draft=False)
    add_tree_options(b)  # with --max-tree-nodes N, each configuration also runs as CONFIG+trees
    add_sampling_options(b, seed=0)  # a fixed seed: sampled runs are comparable across configurations
    b.add_argument("--prompts", default=None, help="JSON Lines prompt file (default: the built-in suite)")
    b.add_argument("--config", action="append", metavar="DRAFT[:K]",
                   help="a configuration to compare with plain decoding, e.g. auto:auto, ngram:4, "
                        "qwen2.5-coder-0.5b-instruct:3 (repeatable; default auto:auto)")
    b.add_argument("--categories", "--category", default=None,
                   help="comma-separated categories to run (e.g. fim: fill-in-the-middle completions)")
    b.add_argument("--per-category", type=int, default=None, help="at most this many prompts per category")
    b.add_argument("--max-tokens", type=int, default=DEFAULT_BENCH_MAX_TOKENS,
                   help="for prompts without their own max_tokens (default: %(default)s)")
    b.add_argument("--no-peer", dest="peer", action="store_false",
                   help="skip the peers (llama-cpp-python's prompt lookup; transformers' generate)")
    b.add_argument("--llama-server", nargs="?", const="", default=None, metavar="PATH",
                   help="also time llama.cpp's own llama-server on every prompt, side by side (PATH: its binary; "
                        "default: the one bash benchmarks/build_llama_server.sh builds, or $SPECDECODE_LLAMA_SERVER)")
    b.add_argument("--llama-server-configs", default="plain,spec-default,ngram-simple,draft", metavar="LIST",
                   help="its configurations (default: %(default)s; draft needs a draft model)")
    b.add_argument("--llama-server-draft", default=None, metavar="NAME",
                   help="its draft model (default: the first draft model a --config names)")
    b.add_argument("--prediction-file", metavar="PATH|-", default=None,
                   help="the predicted output of every selected prompt (replacing the suite's own): each "
                        "configuration that follows one also runs with it, as CONFIG+prediction")
    b.add_argument("--background-load", type=float, default=None, metavar="F",
                   help="run beside a CPU load taking this fraction of the machine (0 < F <= 1; 0.5 on 2 cores "
                        "keeps one core busy): is speculation still never slower on a busy machine?")
    b.add_argument("--vary", default=None, metavar="SETTING=V1,V2",
                   help="run everything at each value of one setting, interleaved prompt by prompt, and print one "
                        "table of the values' rates and ratios (the first value is the reference): "
                        + "; ".join(f"{s.name}={','.join(s.choices)}" for s in SETTINGS.values())
                        + " (flash_attn and buffers load the models once per value)")
    _add_output_options(b, "results", cmd_bench)
    return b


def _add_output_options(b: argparse.ArgumentParser, stem: str, func) -> None:
    """--out (STEM.json, STEM.md and plots), --json, --quiet; the subcommand's function."""
    b.add_argument("--out", default=None, help=f"folder for {stem}.json, {stem}.md and PNG plots")
    b.add_argument("--json", action="store_true", help="print the JSON result on stdout")
    b.add_argument("--quiet", action="store_true", help="no progress bars")
    b.set_defaults(func=func)


def config_from_args(args: argparse.Namespace) -> BenchConfig:
    """The BenchConfig that parsed ``bench`` options describe.
    Raises SpecDecodeError naming an out-of-range option, before any model is loaded."""
    check_model_args(args)
    return BenchConfig(
        target=args.target, prompts=args.prompts, configs=tuple(args.config or DEFAULT_CONFIGS),
        categories=tuple(args.categories.split(",")) if args.categories else None,
        per_category=args.per_category, max_tokens=args.max_tokens, sampling=sampling_from_args(args),
        n_ctx=args.ctx_size, n_threads=args.threads, backend=args.backend, draft_backend=args.draft_backend,
        dtype=args.dtype, device=args.device, draft_vocab=args.draft_vocab, peer=args.peer,
        gpu_layers=args.gpu_layers, draft_gpu_layers=args.draft_gpu_layers,
        progress=not args.quiet, background_load=args.background_load,
        prediction=read_input(args.prediction_file, "--prediction-file") if args.prediction_file else None,
        max_tree_nodes=args.max_tree_nodes, tree_width=args.tree_width, vary=args.vary,
        llama_server=args.llama_server, llama_server_configs=tuple(args.llama_server_configs.split(",")),
        llama_server_draft=args.llama_server_draft,
    )



def cmd_bench(args: argparse.Namespace) -> int:
    """Run the bench; write --out files; print the JSON result (--json) or a table. Returns 0."""
    return _report(args, run_bench(config_from_args(args)), write_outputs, print_table)


def _report(args: argparse.Namespace, result: dict, write, show) -> int:
    """Write the --out files, then print the JSON result (--json) or the table. Returns 0."""
    if args.out:
        write(result, Path(args.out))
    if args.json:
        print(json.dumps(result))
    else:
        show(result)
    return 0


def _int_list(text: str) -> tuple[int, ...]:
    try:
        return tuple(int(x) for x in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None


def add_bench_serve_parser(subparsers) -> argparse.ArgumentParser:
    """Add the ``bench-serve`` subcommand (runs :func:`cmd_bench_serve`)."""
    from .serve import DEFAULT_CONCURRENCY

    b = subparsers.add_parser(
        "bench-serve", help="load-test the server: C concurrent clients, the batched server against the one-slot one",
        description="Drive the OpenAI-compatible server with C concurrent streaming clients (the suite's prompts, "
                    "greedy) and report aggregate decode tokens/s, time to first token and time per output token "
                    "(p50/p95), the gaps between streamed chunks (p50/p99/max) and acceptance per C. Without --url it starts the servers itself, in turn: one slot "
                    "(the baseline) and --parallel slots, and compares their greedy outputs.")
    add_model_options(b)
    b.add_argument("--url", default=None, help="a running server to measure instead (e.g. http://127.0.0.1:8000)")
    b.add_argument("--api-key", default=None, help="its API key, if it needs one")
    b.add_argument("--parallel", "-np", type=int, default=8, metavar="N",
                   help="slots of the batched server started here (default: %(default)s)")
    b.add_argument("--no-baseline", dest="baseline", action="store_false",
                   help="do not also start the one-slot server")
    b.add_argument("--concurrency", type=_int_list, default=DEFAULT_CONCURRENCY, metavar="LIST",
                   help="comma-separated client counts (default: %s)" % ",".join(map(str, DEFAULT_CONCURRENCY)))
    b.add_argument("--requests", type=int, default=None, help="requests per client count (default: every prompt once)")
    b.add_argument("--prompts", default=None, help="JSON Lines prompt file (default: the built-in suite)")
    b.add_argument("--categories", default=None, help="comma-separated categories (default: all but json_schema)")
    b.add_argument("--per-category", type=int, default=2, help="prompts per category (default: %(default)s)")
    b.add_argument("--max-tokens", type=int, default=64, help="completion cap per request (default: %(default)s)")
    b.add_argument("--long-prompts", type=int, default=0, metavar="TOKENS",
                   help="while the clients run, one more sends prompts of about TOKENS tokens, one after another "
                        "(a file, an agent's tool outputs): the clients' inter-token gaps show what a long prefill "
                        "costs them; reported on rows of their own (default: 0, none)")
    b.add_argument("--llama-server", nargs="?", const="", default=None, metavar="PATH",
                   help="also load llama.cpp's own llama-server (plain, --parallel slots) with the same clients "
                        "(PATH: its binary; default: the one bash benchmarks/build_llama_server.sh builds)")
    _add_output_options(b, "serve_results", cmd_bench_serve)
    return b


def cmd_bench_serve(args: argparse.Namespace) -> int:
    """Run bench-serve; write --out files; print the table (or JSON). Returns 0."""
    from .serve import SERVE_CATEGORIES, ServeBenchConfig, run_serve_bench
    from .serve_report import print_table as print_serve_table
    from .serve_report import write_outputs as write_serve_outputs

    check_model_args(args)
    cfg = ServeBenchConfig(
        url=args.url, api_key=args.api_key, target=args.target, draft=args.draft,
        num_speculative_tokens=args.num_speculative_tokens, n_ctx=args.ctx_size, n_threads=args.threads,
        slots=(1, args.parallel) if args.baseline else (args.parallel,), concurrency=args.concurrency,
        requests=args.requests, prompts=args.prompts,
        categories=tuple(args.categories.split(",")) if args.categories else SERVE_CATEGORIES,
        per_category=args.per_category, max_tokens=args.max_tokens, long_prompt_tokens=args.long_prompts,
        progress=not args.quiet, llama_server=args.llama_server,
        extra=dict(backend=args.backend, draft_backend=args.draft_backend, dtype=args.dtype, device=args.device,
                   draft_vocab=args.draft_vocab, gpu_layers=args.gpu_layers, draft_gpu_layers=args.draft_gpu_layers))
    return _report(args, run_serve_bench(cfg), write_serve_outputs, print_serve_table)
