"""Command-line options shared by ``generate``, ``serve`` and ``bench``, declared once.

:func:`add_model_options` declares the target, the draft, the backends, dtype, device,
context size, threads and K; :func:`add_sampling_options` the sampling settings.
:func:`decoder_from_args` turns parsed arguments into a loaded :class:`Decoder`. Ranges
come from :mod:`specdecode.limits`; an out-of-range value is a SpecDecodeError naming the
option, raised before any model is loaded.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path
from typing import TYPE_CHECKING

from .assembly import registry
from .backends.llama_cpp.lib import FLASH_ATTENTION_ENV
from .drafters.kinds import draft_help
from .errors import SpecDecodeError
from .limits import (BACKENDS, DEFAULT_DEVICE, DEFAULT_DTYPE, DEFAULT_GPU_LAYERS, check_gpu_layers, DEFAULT_SAMPLING_RULE, DEVICES, DRAFT_VOCAB_METHODS, DTYPES,
                     SAMPLING_RULES,
                     MAX_NUM_SPECULATIVE_TOKENS, MAX_PARALLEL, MAX_THREADS, MIN_N_CTX, check_num_speculative_tokens, check_parallel,
                     check_tree_width, check_max_tree_nodes, DEFAULT_TREE_NODES, DEFAULT_TREE_WIDTH, MAX_TREE_NODES)
from .sampling import SamplingParams

if TYPE_CHECKING:
    from .api import Decoder

# (flag, SamplingParams field, type, help). Defaults are SamplingParams' own.
SAMPLING_OPTIONS = (
    ("--temperature", "temperature", float, "0 = greedy"),
    ("--top-p", "top_p", float, "nucleus sampling: keep the smallest set with this much probability"),
    ("--top-k", "top_k", int, "keep the k most likely tokens (0 = off)"),
    ("--min-p", "min_p", float, "drop tokens below this fraction of the top probability"),
    ("--repetition-penalty", "repetition_penalty", float, "CTRL-style penalty over the last 64 tokens (1 = off)"),
    ("--frequency-penalty", "frequency_penalty", float, "OpenAI-style, over the last 64 tokens"),
    ("--presence-penalty", "presence_penalty", float, "OpenAI-style, over the last 64 tokens"),
)


def k_value(text: str) -> int | str:
    """argparse type for --num-speculative-tokens: an integer or 'auto' (range checked later)."""
    if text == "auto":
        return text
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"expected an integer 0..{MAX_NUM_SPECULATIVE_TOKENS} or 'auto', got {text!r}") from None


def non_negative_int(text: str) -> int:
    """argparse type: an integer >= 0."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer >= 0, got {text!r}") from None
    if value < 0:
        raise argparse.ArgumentTypeError(f"{value} is out of range: expected an integer >= 0")
    return value


def draft_vocab_value(text: str) -> int | str:
    """argparse type of --draft-vocab: an integer >= 0, or slem / tli."""
    if text in DRAFT_VOCAB_METHODS:
        return text
    try:
        return non_negative_int(text)
    except argparse.ArgumentTypeError as e:
        raise argparse.ArgumentTypeError(f"{e}, or one of {', '.join(DRAFT_VOCAB_METHODS)}") from None


def add_model_options(p: argparse.ArgumentParser, draft: bool = True) -> None:
    """--target, --backend, --dtype, --device, --ctx-size, --threads, --gpu-layers,
    --draft-gpu-layers, --draft-backend, --draft-vocab and, with ``draft``, --draft and
    --num-speculative-tokens/-k."""
    p.add_argument("--target", default=registry.DEFAULT_TARGET,
                   help="registry name, .gguf path or Hugging Face folder (default: %(default)s)")
    if draft:
        p.add_argument("--draft", default="auto", help=draft_help(registry.DEFAULT_DRAFT))
        p.add_argument("--num-speculative-tokens", "-k", type=k_value, default="auto",
                       help=f"K, drafted tokens per step (0..{MAX_NUM_SPECULATIVE_TOKENS}), or 'auto': chosen each "
                            "step from measured costs (default: %(default)s)")
    p.add_argument("--backend", choices=BACKENDS, default="auto",
                   help="target backend; auto: llama.cpp for .gguf files and registry names, torch for "
                        "Hugging Face folders (default: %(default)s)")
    p.add_argument("--draft-backend", choices=BACKENDS, default="auto", help="draft model backend, as --backend")
    p.add_argument("--dtype", choices=DTYPES, default=DEFAULT_DTYPE, help="torch backend weights (default: %(default)s)")
    p.add_argument("--device", choices=DEVICES, default=DEFAULT_DEVICE, help="torch backend device (default: %(default)s)")
    p.add_argument("--draft-vocab", type=draft_vocab_value, default=0, metavar="N|slem|tli",
                   help="N: a draft model on the torch backend (--draft-backend torch) scores only token ids "
                        "< N, the prompt's tokens and end-of-generation ids (FR-Spec; cheaper drafts, same "
                        "output; default: 0 = all). slem or tli: how a draft model with another tokenizer than "
                        "the target's drafts (string-level exact match or token-level intersection; by default "
                        "SLEM for greedy generations, TLI for sampled ones)")
    if draft:
        add_tree_options(p)
    p.add_argument("--ctx-size", type=int, default=None, metavar="N",
                   help="context window in tokens of each slot (default: what the target was trained for, capped so "
                        "that the KV caches of every slot and a draft model fit in half the memory available; a "
                        "larger N is capped at the trained context with a warning). The choice is printed at start")
    p.add_argument("--threads", type=int, default=None, help="CPU threads (default: all cores)")
    p.add_argument("--gpu-layers", "-ngl", default=DEFAULT_GPU_LAYERS, metavar="N|all|auto",
                   help="layers of a GGUF target on the GPU of llama.cpp's build (CUDA, Metal, Vulkan...): N, all, or "
                        "auto: all where the weights and the context's KV cache fit the device's free memory, else as "
                        "many as fit (said in one line); a CPU-only build runs on the CPU (default: %(default)s)")
    p.add_argument("--draft-gpu-layers", "-ngld", default=DEFAULT_GPU_LAYERS, metavar="N|all|auto",
                   help="a GGUF draft model's layers on the GPU, as --gpu-layers (default: %(default)s)")
    p.add_argument("--flash-attn", "-fa", choices=("on", "off", "auto"), default=None,
                   help="llama.cpp's attention path for every GGUF model: on, off or auto (llama.cpp's own choice). "
                        "Default: chosen once per model and machine on the CPU by timing both (kept for every later "
                        "start, whatever --ctx-size and --parallel), or SPECDECODE_LLAMA_FLASH_ATTN")


def add_tree_options(p: argparse.ArgumentParser) -> None:
    """--max-tree-nodes N and --tree-width W: trees of drafts (generate, serve, bench)."""
    p.add_argument("--max-tree-nodes", type=int, nargs="?", const=DEFAULT_TREE_NODES, default=None, metavar="N",
                   help=f"allow trees of drafts of up to N nodes (the flag alone: {DEFAULT_TREE_NODES}): draft heads, a "
                        f"draft model on the torch backend and prompt lookup draft several candidates per position, "
                        f"verified in one forward with a tree mask; under -k auto the controller cuts each tree to "
                        f"what pays under the measured cost (0..{MAX_TREE_NODES}; default 0, chains: on the "
                        f"development CPUs trees measured no faster; on llama.cpp N > 0 loads branch sequences)")
    p.add_argument("--tree-width", type=int, default=DEFAULT_TREE_WIDTH, metavar="W",
                   help="candidates per node of a tree of drafts (each head's, or the draft model's, top W; "
                        "default: %(default)s)")


def add_parallel_option(p: argparse.ArgumentParser) -> None:
    """--parallel N: slots for concurrent generations (continuous batching)."""
    p.add_argument("--parallel", "-np", type=int, default=1, metavar="N",
                   help=f"slots for concurrent requests, batched into shared forward passes (llama.cpp backend; "
                        f"1..{MAX_PARALLEL}); each slot keeps its own KV cache of --ctx-size tokens and a new "
                        f"request takes the free slot whose cache shares the longest prefix with its prompt "
                        f"(at least half of it; else the least recently used slot) (default: %(default)s)")


def add_sampling_options(p: argparse.ArgumentParser, seed: int | None = None) -> None:
    """The SamplingParams fields as options (--temperature, --top-p, ..., --seed)."""
    defaults = SamplingParams()
    for flag, field, kind, help_text in SAMPLING_OPTIONS:
        p.add_argument(flag, type=kind, default=getattr(defaults, field), help=f"{help_text} (default: %(default)s)")
    p.add_argument("--seed", type=int, default=seed,
                   help="same seed, same output: at any K, with any drafter or none, alone or in a batch under "
                        "the default --sampling-rule (default: %(default)s)")
    p.add_argument("--sampling-rule", choices=SAMPLING_RULES, default=DEFAULT_SAMPLING_RULE,
                   help="how sampled drafts are verified: 'gumbel', each position's token the Gumbel-max choice "
                        "under noise keyed by (seed, position), so a seed fixes the text; 'rejection', Leviathan "
                        "et al.'s rule, whose draws depend on K and which accepts more of a draft model's drafts; "
                        "'auto', gumbel with a --seed, rejection without (default: %(default)s)")


def sampling_kwargs(args: argparse.Namespace) -> dict:
    """The sampling options as keyword arguments of SamplingParams / Decoder.stream."""
    return {field: getattr(args, field) for _, field, _, _ in SAMPLING_OPTIONS} | {
        "seed": args.seed, "sampling_rule": args.sampling_rule}


def sampling_from_args(args: argparse.Namespace) -> SamplingParams:
    """SamplingParams from parsed options. Raises SpecDecodeError naming a bad value."""
    return SamplingParams(**sampling_kwargs(args))


def check_model_args(args: argparse.Namespace) -> None:
    """Range checks that need no model (K, context size, threads); SpecDecodeError names the option.
    --flash-attn, where given, is set as SPECDECODE_LLAMA_FLASH_ATTN (what the llama.cpp backend reads)."""
    if hasattr(args, "num_speculative_tokens"):
        check_num_speculative_tokens(args.num_speculative_tokens, "--num-speculative-tokens")
    if args.ctx_size is not None and args.ctx_size < MIN_N_CTX:
        raise SpecDecodeError(f"--ctx-size {args.ctx_size} is out of range: expected >= {MIN_N_CTX}",
                              param="--ctx-size")
    if args.threads is not None and not 1 <= args.threads <= MAX_THREADS:
        raise SpecDecodeError(f"--threads {args.threads} is out of range: expected 1..{MAX_THREADS}", param="--threads")
    check_parallel(vars(args).get("parallel", 1), "--parallel")
    args.gpu_layers = check_gpu_layers(args.gpu_layers, "--gpu-layers")
    args.draft_gpu_layers = check_gpu_layers(args.draft_gpu_layers, "--draft-gpu-layers")
    check_tree_width(vars(args).get("tree_width", DEFAULT_TREE_WIDTH), "--tree-width")
    check_max_tree_nodes(vars(args).get("max_tree_nodes"), "--max-tree-nodes")
    if vars(args).get("flash_attn"):  # pinned for this process and the servers it starts
        os.environ[FLASH_ATTENTION_ENV] = args.flash_attn


def decoder_kwargs(args: argparse.Namespace, progress: bool = True) -> dict:
    """Keyword arguments of :class:`Decoder` from parsed model options."""
    return dict(target=args.target, draft=args.draft, num_speculative_tokens=args.num_speculative_tokens,
                n_ctx=args.ctx_size, n_threads=args.threads, progress=progress, backend=args.backend,
                draft_backend=args.draft_backend, dtype=args.dtype, device=args.device, draft_vocab=args.draft_vocab,
                parallel=vars(args).get("parallel", 1), tree_width=vars(args).get("tree_width", DEFAULT_TREE_WIDTH),
                max_tree_nodes=vars(args).get("max_tree_nodes"),
                kv_per_sequence=bool(vars(args).get("strict", False)),  # serve --strict: a cache per slot
                background_costs=bool(vars(args).get("background_costs", False)),  # serve: measured between requests
                gpu_layers=args.gpu_layers, draft_gpu_layers=args.draft_gpu_layers)


def decoder_from_args(args: argparse.Namespace, progress: bool = True) -> "Decoder":
    """Check the model options, then load the target and drafter they name."""
    from .api import Decoder

    check_model_args(args)
    return Decoder(**decoder_kwargs(args, progress))


def read_input(path: str, option: str) -> str:
    """The text of a file, or of standard input for "-" (as llama.cpp's -f). Raises
    SpecDecodeError naming the option and the file when it cannot be read."""
    p = Path(path).expanduser()
    try:
        if path == "-":
            return sys.stdin.buffer.read().decode("utf-8")
        return p.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise SpecDecodeError(f"{option} {path}: no such file", param=option) from None
    except IsADirectoryError:
        raise SpecDecodeError(f"{option} {path}: is a folder, expected a file", param=option) from None
    except UnicodeDecodeError as e:
        where = "standard input" if path == "-" else path
        raise SpecDecodeError(f"{option} {where}: not UTF-8 text ({e.reason} at byte {e.start})", param=option) from None
    except OSError as e:
        raise SpecDecodeError(f"{option} {path}: cannot be read: {e.strerror}", param=option) from None
