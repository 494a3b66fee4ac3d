"""The ``specdecode heads`` command: ``specdecode heads corpus`` (the target's own answers
as a training corpus, :mod:`specdecode.heads.corpus`) and ``specdecode heads train``
(train draft heads for a target, :mod:`specdecode.heads.train`)."""

from __future__ import annotations

import argparse
import os
from pathlib import Path

from ..errors import SpecDecodeError
from ..limits import DTYPES, MAX_THREADS, check_parallel


TARGET_HELP = "registry name, .gguf path or Hugging Face folder (default: %(default)s)"


def add_heads_parser(subparsers) -> argparse.ArgumentParser:
    """Add ``heads`` (``heads train`` and ``heads corpus``) to the CLI's subparsers."""
    from ..assembly import registry
    from .train import TrainConfig

    d = TrainConfig()
    h = subparsers.add_parser("heads", help="train draft heads on the target itself (blockwise parallel decoding)")
    hs = h.add_subparsers(dest="heads_cmd", required=True)
    t = hs.add_parser("train", help="train K residual heads on the target's final hidden states",
                      description="Train K draft heads (Medusa-1 residual heads over the target's frozen output "
                                  "projection) on the target's final hidden states over a text corpus, with the "
                                  "target's own greedy predictions as labels; writes a safetensors heads file for "
                                  "--draft heads:FILE. Training runs the target on the torch backend; the heads then "
                                  "draft for the same model on either backend.")
    t.add_argument("--target", default=registry.DEFAULT_TARGET, help=TARGET_HELP)
    t.add_argument("--out", required=True, help="the heads file to write (safetensors)")
    t.add_argument("--heads", type=int, default=d.heads, help="K, heads to train (default: %(default)s)")
    t.add_argument("--tokens", type=int, default=d.tokens,
                   help="corpus tokens to train and evaluate on: the time budget (default: %(default)s)")
    t.add_argument("--corpus", default="self", metavar="PATH|self|stdlib",
                   help="a text file or a folder of text files; 'self' (default): the target's own answers to built-in "
                        "code tasks and instructions, generated first (about --tokens tokens, cached; Medusa-2's "
                        "self-distillation); 'stdlib': the Python standard library's source")
    t.add_argument("--window", type=int, default=d.window, help="tokens per training window (default: %(default)s)")
    t.add_argument("--vocab-subset", type=int, default=d.vocab_subset,
                   help="the heads predict only the S most frequent label tokens (default: %(default)s)")
    t.add_argument("--epochs", type=int, default=d.epochs, help="passes over the training positions (default: %(default)s)")
    t.add_argument("--batch", type=int, default=d.batch, help="positions per step (default: %(default)s)")
    t.add_argument("--lr", type=float, default=d.lr, help="Adam's peak learning rate (default: %(default)s)")
    t.add_argument("--seed", type=int, default=d.seed, help="same seed, same heads (default: %(default)s)")
    t.add_argument("--dtype", choices=DTYPES, default="bfloat16", help="the target's weights (default: %(default)s)")
    t.add_argument("--threads", type=int, default=None, help="CPU threads (default: all cores)")
    t.add_argument("--quiet", action="store_true", help="no progress bars")
    t.set_defaults(func=cmd_heads_train)

    c = hs.add_parser("corpus", help="have the target answer made-up code tasks and instructions: a corpus of its "
                                     "own conversations for heads train --corpus",
                      description="Make PROMPTS conversations offline (half code tasks on Python standard-library "
                                  "functions, half instructions from built-in templates), have the target answer each "
                                  "(greedily, or sampled with --temperature) in parallel slots, and write them with its chat template to OUT/code.txt "
                                  "and OUT/chat.txt (self-distillation data, as Medusa-2). Then: specdecode heads "
                                  "train --corpus OUT.")
    c.add_argument("--target", default=registry.DEFAULT_TARGET, help=TARGET_HELP)
    c.add_argument("--out", required=True, help="a folder to create (must not exist, or be empty)")
    c.add_argument("--prompts", type=int, default=200, help="conversations to make (default: %(default)s)")
    c.add_argument("--max-tokens", type=int, default=256, help="longest answer, in tokens (default: %(default)s)")
    c.add_argument("--parallel", "-np", type=int, default=8, help="answers generated at once (default: %(default)s)")
    c.add_argument("--seed", type=int, default=0, help="which prompts, and the sampling seeds (default: %(default)s)")
    c.add_argument("--temperature", type=float, default=0.0,
                   help="0 answers greedily; above 0 samples (0..2; default: %(default)s)")
    c.add_argument("--backend", choices=("auto", "llama.cpp", "torch"), default="auto",
                   help="the target's backend (default: %(default)s; torch serves one at a time)")
    c.add_argument("--threads", type=int, default=None, help="CPU threads (default: all cores)")
    c.add_argument("--quiet", action="store_true", help="no progress bars")
    c.set_defaults(func=cmd_heads_corpus)
    return h


def cmd_heads_corpus(args: argparse.Namespace) -> int:
    """Generate the target's answers and write the corpus folder (atomically)."""
    import json

    from ..api import Decoder
    from .corpus import build_corpus, check_corpus_options, make_prompts

    # Every option is checked before the target loads.
    prompts = make_prompts(args.prompts, args.seed)
    out = check_corpus_options(args.out, args.max_tokens, args.temperature)
    check_parallel(args.parallel, "--parallel")
    parallel = 1 if args.backend == "torch" else args.parallel
    with Decoder(args.target, draft="auto", backend=args.backend, n_threads=args.threads, parallel=parallel,
                 progress=not args.quiet) as dec:
        report = build_corpus(dec, out, prompts, args.max_tokens, seed=args.seed, progress=not args.quiet,
                              temperature=args.temperature)
    print(json.dumps(report, indent=2))
    print(f"specdecode: wrote {out}; next: specdecode heads train --target {args.target} --corpus {out} "
          f"--out heads.safetensors", flush=True)
    return 0


def cmd_heads_train(args: argparse.Namespace) -> int:
    """Train and write the heads file (atomically: nothing is written when anything fails)."""
    import json

    from .train import TrainConfig, check_config, corpus_files, train_heads
    from ..assembly.loading import load_backend

    own = args.corpus == "self"
    cfg = TrainConfig(heads=args.heads, tokens=args.tokens, window=args.window, vocab_subset=args.vocab_subset,
                      epochs=args.epochs, batch=args.batch, lr=args.lr, seed=args.seed,
                      corpus=None if own else args.corpus)
    check_config(cfg)
    if not own:
        corpus_files(cfg.corpus)  # a missing corpus fails before the target loads
    out = Path(args.out)
    if out.exists() and out.is_dir():
        raise SpecDecodeError(f"--out {out} is a folder: give a file name", param="--out")
    parent = out.parent if str(out.parent) else Path(".")
    existing = next((p for p in [parent, *parent.parents] if p.exists()), Path("."))
    if not existing.is_dir() or not os.access(existing, os.W_OK):
        # Found before the half hour of training, not after it.
        raise SpecDecodeError(f"--out {out} cannot be written: {existing} is not a writable folder", param="--out")
    if args.threads is not None:
        if not 1 <= args.threads <= MAX_THREADS:
            raise SpecDecodeError(f"--threads {args.threads} is out of range: expected 1..{MAX_THREADS}",
                                  param="--threads")
        import torch

        torch.set_num_threads(args.threads)
    built = None
    if own:
        from .corpus import self_corpus

        corpus, built = self_corpus(args.target, cfg.tokens, cfg.seed, args.threads, progress=not args.quiet)
        cfg.corpus = str(corpus)
    backend = load_backend(args.target, backend="torch", dtype=args.dtype, progress=not args.quiet)
    try:
        heads, report = train_heads(backend, cfg, progress=not args.quiet)
    finally:
        backend.close()
    heads.save(out)
    if own:
        report["self_corpus"] = built or f"reused {cfg.corpus}"
    print(json.dumps(report, indent=2))
    print(f"specdecode: wrote {out} ({heads.num_heads} heads for {args.target}); use --draft heads:{out} "
          f"(on the llama.cpp or the torch backend)", flush=True)
    return 0
