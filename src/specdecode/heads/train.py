"""``specdecode heads train``: training draft heads on a frozen target.

What is trained: Medusa-1 residual heads (:mod:`specdecode.drafters.heads`) over the
target's frozen output projection restricted to a vocabulary subset.

Labels: self-distillation. Head k at position t is taught the target's own greedy
prediction at position t + k (argmax of its logits there), not the corpus token: at
drafting time a head's guess is kept only when it is what the target itself would emit,
and the target's greedy choice is a cleaner signal than text the target would not have
written (Medusa, Cai et al. 2024, Sec. 2.3.2, self-distillation; here with hard labels,
which need no V-sized teacher distributions in memory).

Data: the corpus's files (a text file, or a folder's text files; ``stdlib``: the Python
standard library's source; the command's default is the target's own answers,
:func:`specdecode.heads.corpus.self_corpus`), split into
windows of ``window`` tokens, shuffled with the seed; a held-out 10% of the windows
measures each head's top-1 accuracy. Features: one pass of the frozen target over every
window (final hidden states [T, H] kept in bfloat16, labels [T]), then epochs of Adam
over random batches of positions. Deterministic for a seed and a thread count.

Budget: ``tokens`` corpus tokens in all (features and training scale with it). Measured on
this 2-core machine, see the README.
"""

from __future__ import annotations

import sys
import sysconfig
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Sequence

import numpy as np

from ..backends.residual_heads import residual_heads
from ..drafters.heads import MAX_HEADS, DraftHeads, heads_meta
from ..errors import SpecDecodeError

STDLIB = "stdlib"  # the corpus name of the Python standard library's source
TEXT_SUFFIXES = (".py", ".txt", ".md", ".rst", ".json", ".c", ".h", ".js", ".ts", ".java", ".go", ".rs", ".html")


@dataclass
class TrainConfig:
    """heads: K; tokens: corpus tokens used (features of all of them); window: tokens per
    window; vocab_subset: S; epochs, batch, lr: Adam's schedule; held_out: fraction of
    windows for evaluation; seed."""

    heads: int = 4
    tokens: int = 100_000
    window: int = 256
    vocab_subset: int = 8192
    epochs: int = 2
    batch: int = 256
    lr: float = 1e-3
    held_out: float = 0.1
    seed: int = 0
    corpus: str | None = None


def check_config(cfg: TrainConfig) -> None:
    """Raises SpecDecodeError naming the first out-of-range option."""
    checks = [("--heads", cfg.heads, 1, MAX_HEADS), ("--tokens", cfg.tokens, 256, 10**9), ("--window", cfg.window, 8, 8192),
              ("--vocab-subset", cfg.vocab_subset, 16, 10**7), ("--epochs", cfg.epochs, 1, 1000),
              ("--batch", cfg.batch, 1, 65536)]
    for name, v, lo, hi in checks:
        if not isinstance(v, int) or not lo <= v <= hi:
            raise SpecDecodeError(f"{name} {v} is out of range: expected {lo}..{hi}", param=name)
    if not 0 < cfg.lr < 1:
        raise SpecDecodeError(f"--lr {cfg.lr} is out of range: expected 0 < lr < 1", param="--lr")
    if cfg.window <= cfg.heads:
        raise SpecDecodeError(f"--window {cfg.window} must be larger than --heads {cfg.heads}", param="--window")


def corpus_files(corpus: str | None) -> tuple[list[Path], str]:
    """The corpus's text files, sorted, and how to name the corpus. Raises SpecDecodeError
    when it does not exist or holds no text files."""
    if corpus is None or corpus == STDLIB:
        root = Path(sysconfig.get_paths()["stdlib"])
        files = sorted(p for p in root.glob("*.py"))
        where = f"Python {sys.version_info.major}.{sys.version_info.minor} standard library ({root})"
    else:
        root = Path(corpus).expanduser()
        if root.is_file():
            files, where = [root], str(root)
        elif root.is_dir():
            files = sorted(p for p in root.rglob("*") if p.is_file() and p.suffix.lower() in TEXT_SUFFIXES)
            where = str(root)
        else:
            raise SpecDecodeError(f"corpus {root} does not exist", param="--corpus")
    if not files:
        raise SpecDecodeError(f"corpus {where} holds no text files ({', '.join(TEXT_SUFFIXES)})", param="--corpus")
    return files, where


def windows(backend, files: Sequence[Path], cfg: TrainConfig) -> np.ndarray:
    """[N, window] token windows from the files (files and windows in a seeded order),
    cfg.tokens in all; special-token texts (a chat template's markers) read as those tokens."""
    rng = np.random.default_rng(cfg.seed)
    order = rng.permutation(len(files))
    need = max(2, cfg.tokens // cfg.window)
    out: list[list[int]] = []
    for i in order:
        try:
            text = files[i].read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError):
            continue
        ids = backend.tokenize(text, add_special=False, parse_special=True)
        for s in range(0, len(ids) - cfg.window + 1, cfg.window):
            out.append(ids[s:s + cfg.window])
            if len(out) >= need:
                break
        if len(out) >= need:
            break
    if len(out) < 2:
        raise SpecDecodeError(f"the corpus gives {len(out)} window(s) of {cfg.window} tokens: at least 2 are needed "
                              f"(a larger corpus, or a smaller --window)", param="--corpus")
    # Shuffled, so that the held-out windows (the first tenth) come from every file.
    return np.array(out, dtype=np.int64)[rng.permutation(len(out))]


def features(model, wins: np.ndarray, progress: Callable[[int], None] | None = None):
    """The frozen target over each window from position 0: final hidden states [N, T, H]
    (bfloat16) and its greedy predictions [N, T] (the labels)."""
    import torch

    decoder, head = model.get_decoder(), model.get_output_embeddings()
    dev = head.weight.device
    hs, labels = [], []
    with torch.inference_mode():
        for w in wins:
            h = decoder(input_ids=torch.tensor(w[None], device=dev)).last_hidden_state[0]  # [T, H]
            labels.append(head(h).argmax(-1).cpu())
            hs.append(h.to(torch.bfloat16).cpu())
            if progress:
                progress(len(w))
    return torch.stack(hs), torch.stack(labels)


class _Heads:
    """The trainable parameters and their forward (float32, CPU)."""

    def __init__(self, k: int, hidden: int, w_out, b_out) -> None:
        import torch

        self.W = torch.zeros(k, hidden, hidden, requires_grad=True)
        self.b = torch.zeros(k, hidden, requires_grad=True)
        self.w_out, self.b_out = w_out, b_out  # [S, H] frozen

    def logits(self, h, k: int):
        """h [B, H] -> subset logits [B, S] of head k (0-based)."""
        import torch

        return residual_heads(h, self.W[k:k + 1], self.b[k:k + 1], self.w_out, self.b_out, torch.einsum,
                              torch.nn.functional.silu)[:, 0]


def _accuracy(heads: _Heads, H, L, sub_index, K: int, batch: int = 2048) -> list[float]:
    """Top-1 accuracy per head on windows H [N, T, Hd] with labels L [N, T] (a label outside
    the subset counts as a miss)."""
    import torch

    N, T, _ = H.shape
    correct, total = [0] * K, [0] * K
    with torch.no_grad():
        flat = H[:, : T - K].reshape(-1, H.shape[-1])
        for s in range(0, flat.shape[0], batch):
            h = flat[s:s + batch].float()
            idx = torch.arange(s, min(s + batch, flat.shape[0]))
            n, t = idx // (T - K), idx % (T - K)
            for k in range(K):
                target = sub_index[L[n, t + k + 1]]  # head k+1 at t: the target's prediction at t + k + 1
                pred = heads.logits(h, k).argmax(-1)
                correct[k] += int(((pred == target) & (target >= 0)).sum())
                total[k] += len(idx)
    return [c / t for c, t in zip(correct, total)]


def train_heads(backend, cfg: TrainConfig, progress: bool = True,
                log: Callable[[str], None] = print) -> tuple[DraftHeads, dict]:
    """Train cfg.heads heads for the torch backend's model; returns (heads, report) where
    report holds the held-out top-1 accuracy per head before and after training, the
    tokens, the corpus and the seconds spent. Raises SpecDecodeError for bad options."""
    import torch
    from tqdm import tqdm

    from ..backends.torch import TorchBackend

    check_config(cfg)
    if not isinstance(backend, TorchBackend):
        raise SpecDecodeError(f"training heads needs the torch backend (--backend torch); {backend.name} is on "
                              f"{type(backend).__name__}", param="--backend")
    torch.manual_seed(cfg.seed)
    t0 = time.perf_counter()
    files, where = corpus_files(cfg.corpus)
    wins = windows(backend, files, cfg)
    model = backend.model
    with tqdm(total=int(wins.size), unit="tok", desc="target features", disable=not progress) as bar:
        H, L = features(model, wins, bar.update)
    return _fit(backend, model.get_output_embeddings(), H, L, cfg, where, t0, progress, log)


def train_heads_on_ids(backend, sequences, cfg: TrainConfig | None = None, progress: bool = True,
                       log: Callable[[str], None] = print) -> tuple[DraftHeads, dict]:
    """Train heads for a target over codes (a :class:`specdecode.backends.module.ModuleBackend`
    given its ``output_head``) on id sequences [N, T] (N >= 2 of one length T > cfg.heads:
    e.g. the training images' codes), labelled by the target's own greedy predictions as
    :func:`train_heads` does; cfg's corpus, tokens and window do not apply. Returns (heads,
    report). Raises SpecDecodeError for a target without hidden states or bad sequences."""
    import torch
    from dataclasses import replace

    from ..backends.base import SeqForward

    cfg = cfg or TrainConfig()
    if not backend.supports_hidden_states or getattr(backend, "output_head", None) is None:
        raise SpecDecodeError(f"training heads needs the target's hidden states: give {backend.name} its "
                              f"output_head (ModuleBackend(..., output_head=model.head))", param="output_head")
    try:
        wins = np.asarray(sequences, dtype=np.int64)
    except (TypeError, ValueError):
        raise SpecDecodeError("sequences must be id sequences of one length (an [N, T] array)",
                              param="sequences") from None
    if wins.ndim != 2 or len(wins) < 2 or wins.shape[1] <= cfg.heads:
        raise SpecDecodeError(f"sequences of shape {wins.shape}: expected [N >= 2, T > {cfg.heads} heads]",
                              param="sequences")
    check_config(replace(cfg, window=max(8, wins.shape[1]), tokens=max(cfg.tokens, 256)))  # no window here
    torch.manual_seed(cfg.seed)
    t0 = time.perf_counter()
    wins = wins[np.random.default_rng(cfg.seed).permutation(len(wins))]
    hs, labels = [], []
    for w in wins:
        backend.rollback(0)
        (logits,), hidden = backend.forward_batch_hidden([SeqForward(0, [int(t) for t in w], range(len(w)))], {0})
        labels.append(torch.as_tensor(logits.argmax(-1)))
        hs.append(hidden[0].hidden.detach().to(torch.bfloat16).cpu())
    backend.rollback(0)
    return _fit(backend, backend.output_head, torch.stack(hs), torch.stack(labels), cfg,
                f"{len(wins)} id sequences of {wins.shape[1]}", t0, progress, log)


def _fit(backend, head, H, L, cfg: TrainConfig, where: str, t0: float, progress: bool,
         log: Callable[[str], None]) -> tuple[DraftHeads, dict]:
    """Adam over the heads on the target's features H [N, T, Hd] and greedy labels L [N, T]
    (the first tenth held out); head: the target's output projection (frozen)."""
    import torch
    from tqdm import tqdm

    n_eval = max(1, int(round(len(H) * cfg.held_out)))
    t_feat = time.perf_counter() - t0
    H_train, L_train, H_eval, L_eval = H[n_eval:], L[n_eval:], H[:n_eval], L[:n_eval]

    K, T = cfg.heads, H.shape[1]
    counts = torch.bincount(L_train.reshape(-1), minlength=backend.n_vocab)
    counts[list(backend.eog_ids)] += counts.max() + 1  # the end of generation can always be drafted
    S = min(cfg.vocab_subset, int((counts > 0).sum()))
    subset = torch.argsort(counts, descending=True, stable=True)[:S].sort().values
    sub_index = torch.full((backend.n_vocab,), -1, dtype=torch.long)
    sub_index[subset] = torch.arange(S)
    w_out = head.weight.detach().index_select(0, subset.to(head.weight.device)).float().cpu()
    b_out = head.bias.detach().index_select(0, subset).float().cpu() if getattr(head, "bias", None) is not None \
        else None
    heads = _Heads(K, H.shape[-1], w_out, b_out)
    before = _accuracy(heads, H_eval, L_eval, sub_index, K)
    log("held-out top-1 accuracy before training: " + ", ".join(f"head {k + 1} {a:.3f}" for k, a in enumerate(before)))

    opt = torch.optim.Adam([heads.W, heads.b], lr=cfg.lr)
    n_pos = H_train.shape[0] * (T - K)
    steps_per_epoch = max(1, n_pos // cfg.batch)
    total = steps_per_epoch * cfg.epochs
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=cfg.lr, total_steps=total, pct_start=0.05)
    gen = torch.Generator().manual_seed(cfg.seed)
    flat_h = H_train[:, : T - K].reshape(-1, H.shape[-1])
    history = []
    with tqdm(total=total, unit="step", desc="heads", disable=not progress) as bar:
        for epoch in range(cfg.epochs):
            perm = torch.randperm(n_pos, generator=gen)
            for s in range(steps_per_epoch):
                idx = perm[s * cfg.batch:(s + 1) * cfg.batch]
                n, t = idx // (T - K), idx % (T - K)
                h = flat_h[idx].float()
                loss = 0.0
                for k in range(K):
                    target = sub_index[L_train[n, t + k + 1]]
                    loss = loss + torch.nn.functional.cross_entropy(heads.logits(h, k), target, ignore_index=-1)
                opt.zero_grad()
                (loss / K).backward()
                opt.step()
                sched.step()
                bar.update()
                bar.set_postfix(loss=f"{loss.item() / K:.3f}")
            acc = _accuracy(heads, H_eval, L_eval, sub_index, K)
            history.append(acc)
            (bar.write if progress else log)(f"epoch {epoch + 1}: held-out top-1 accuracy " +
                                             ", ".join(f"head {k + 1} {a:.3f}" for k, a in enumerate(acc)))
    report = {"held_out_accuracy": [round(a, 4) for a in history[-1]],
              "held_out_accuracy_untrained": [round(a, 4) for a in before],
              "tokens": int(L.numel()), "train_windows": int(len(H) - n_eval), "held_out_windows": n_eval,
              "window": T, "vocab_subset": S, "epochs": cfg.epochs, "steps": total, "seed": cfg.seed,
              "corpus": where, "labels": "self-distillation (the target's greedy prediction)",
              "features_s": round(t_feat, 1), "seconds": round(time.perf_counter() - t0, 1)}
    meta = heads_meta(backend, K, {**report, "kind_why": "Medusa-1 residual heads over the frozen output projection"})
    out = DraftHeads(heads.W.detach().numpy().copy(), heads.b.detach().numpy().copy(), subset.numpy(), meta)
    return out, report
