"""``specdecode heads train``: train draft heads for a target (:mod:`specdecode.heads_train`)."""

from __future__ import annotations

import argparse
import os
from pathlib import Path

from .errors import SpecDecodeError
from .limits import DTYPES


def add_heads_parser(subparsers) -> argparse.ArgumentParser:
    """Add ``heads train`` to the CLI's subparsers."""
    from . import models
    from .heads_train import TrainConfig

    d = TrainConfig()
    h = subparsers.add_parser("heads", help="train draft heads on the target itself (blockwise parallel decoding)")
    hs = h.add_subparsers(dest="heads_cmd", required=True)
    t = hs.add_parser("train", help="train K residual heads on the target's final hidden states",
                      description="Train K draft heads (Medusa-1 residual heads over the target's frozen output "
                                  "projection) on the target's final hidden states over a text corpus, with the "
                                  "target's own greedy predictions as labels; writes a safetensors heads file for "
                                  "--draft heads:FILE. Runs the target on the torch backend.")
    t.add_argument("--target", default=models.DEFAULT_TARGET, help="registry name, .gguf path or Hugging Face folder "
                                                                   "(default: %(default)s)")
    t.add_argument("--out", required=True, help="the heads file to write (safetensors)")
    t.add_argument("--heads", type=int, default=d.heads, help="K, heads to train (default: %(default)s)")
    t.add_argument("--tokens", type=int, default=d.tokens,
                   help="corpus tokens to train and evaluate on: the time budget (default: %(default)s)")
    t.add_argument("--corpus", default=None, metavar="PATH",
                   help="a text file or a folder of text files (default: the Python standard library's source)")
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
    return h


def cmd_heads_train(args: argparse.Namespace) -> int:
    """Train and write the heads file (atomically: nothing is written when anything fails)."""
    import json

    from .heads_train import TrainConfig, check_config, corpus_files, train_heads
    from .loading import load_backend

    cfg = TrainConfig(heads=args.heads, tokens=args.tokens, window=args.window, vocab_subset=args.vocab_subset,
                      epochs=args.epochs, batch=args.batch, lr=args.lr, seed=args.seed, corpus=args.corpus)
    check_config(cfg)
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
        if args.threads < 1:
            raise SpecDecodeError(f"--threads {args.threads} is out of range: expected >= 1", param="--threads")
        import torch

        torch.set_num_threads(args.threads)
    backend = load_backend(args.target, backend="torch", dtype=args.dtype, progress=not args.quiet)
    try:
        heads, report = train_heads(backend, cfg, progress=not args.quiet)
    finally:
        backend.close()
    heads.save(out)
    print(json.dumps(report, indent=2))
    print(f"specdecode: wrote {out} ({heads.num_heads} heads for {args.target}); use --draft heads:{out} "
          f"--backend torch", flush=True)
    return 0
