"""Draft heads on the target's own final hidden state: blockwise parallel decoding (Stern,
Shazeer, Uszkoreit 2018), with Medusa-1's residual heads (Cai et al. 2024, Sec. 2.1.1).

Head k (k = 1..K) reads h_t, the target's final (post-norm) hidden state at position t, and
predicts the token k + 1 places ahead, x_{t+k+1} (the target's own output projection
predicts x_{t+1}, the bonus token of the step that produced h_t):

    z_k = h_t + SiLU(W_k h_t + b_k),    logits_k = W_out[S] z_k (+ b_out[S])    (W_k: [H, H], b_k: [H])

(one function computes it wherever heads run: :func:`specdecode.backends.residual_heads.residual_heads`).
W_out is the target's frozen output projection (with its bias b_out, where it has one), restricted to a vocabulary subset S (the
tokens most frequent among the training labels, as FR-Spec restricts a draft's head:
cheaper heads and training, and a rare token could not be drafted well anyway); logits of
ids outside S are -inf. W_k starts at zero, so an untrained head k guesses x_{t+1} again.

Why these heads: Stern et al. trained the heads jointly with the model; with the target
frozen, Medusa-1's residual form learns only an offset from the target's own prediction
(K H^2 parameters: 9.4M for 4 heads on a 1.5B model with H = 1536), so training on a CPU
takes minutes, and the heads' cost at drafting time is K (H^2 + |S| H) multiply-adds.

The heads file (safetensors): tensors ``weight`` [K, H, H], ``bias`` [K, H] (float32),
``vocab_subset`` [S] (int64); metadata: format, kind, target_sha256 (the target's
identity, :func:`target_sha256`), target_name, hidden_size, vocab_size, num_heads,
training facts (tokens, corpus, labels, seed, held-out accuracy per head).

Dimension letters: K = heads, H = hidden size, S = vocabulary subset, V = vocabulary.
"""

from __future__ import annotations

import copy
import hashlib
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Sequence

import numpy as np

from ..errors import ModelFileError, SpecDecodeError
from ..files import atomic_path, sha256_file
from .base import Draft, HiddenStateDrafter, StepOutcome
from .tree import TreeDrafting

if TYPE_CHECKING:
    from ..backends.base import Backend
    from ..sampling import Sampler

HEADS_PREFIX = "heads:"  # --draft heads:FILE
HEADS_FORMAT = "specdecode-heads/1"
HEADS_KIND = "medusa1-residual"
MAX_HEADS = 16  # heads per file (heads train --heads 1..16)


class HeadsMismatchError(SpecDecodeError):
    """The heads file was trained for another target."""


def target_sha256(backend: "Backend") -> str:
    """The identity heads are tied to: the model file's SHA-256 when the loader knows it (a
    registry model, on either backend: a torch conversion derives from that GGUF,
    ``Backend.known_sha256``); else the SHA-256 of the model file, or of a folder's
    config.json and weight files; else (a model built in memory) of its parameters."""
    if backend.known_sha256 is not None:
        return backend.known_sha256
    path = Path(backend.path) if backend.path is not None else None
    if path is not None and path.is_file():
        return sha256_file(path)
    h = hashlib.sha256()
    if path is not None and path.is_dir():
        for f in sorted(path.iterdir()):
            if f.name == "config.json" or f.suffix in (".safetensors", ".bin", ".gguf"):
                h.update(f.name.encode())
                h.update(sha256_file(f).encode())
        return h.hexdigest()
    for name, tensor in backend.parameters():
        h.update(name.encode())
        h.update(tensor.detach().float().cpu().numpy().tobytes())
    return h.hexdigest()


@dataclass
class DraftHeads:
    """K trained residual heads (see the module docstring), as numpy float32 arrays.

    weight: [K, H, H]; bias: [K, H]; vocab_subset: [S] int64 token ids; meta: the file's
    metadata (str -> str).
    """

    weight: np.ndarray
    bias: np.ndarray
    vocab_subset: np.ndarray
    meta: dict[str, str] = field(default_factory=dict)

    @property
    def num_heads(self) -> int:
        return int(self.weight.shape[0])

    @property
    def hidden_size(self) -> int:
        return int(self.weight.shape[1])

    def save(self, path: str | Path) -> None:
        """Write the safetensors file atomically (a temporary file renamed into place: a
        failure leaves nothing half-written). Raises OSError when it cannot be written."""
        from safetensors.numpy import save_file

        with atomic_path(path) as tmp:
            save_file({"weight": self.weight.astype(np.float32), "bias": self.bias.astype(np.float32),
                       "vocab_subset": self.vocab_subset.astype(np.int64)}, tmp,
                      metadata={k: str(v) for k, v in self.meta.items()})

    @classmethod
    def load(cls, path: str | Path) -> "DraftHeads":
        """Read a heads file. Raises ModelFileError naming the file when it is missing,
        corrupt, or not a specdecode heads file."""
        from safetensors import safe_open

        if not str(path):
            raise ModelFileError("no heads file given: use --draft heads:FILE")
        path = Path(path)
        if path.is_dir():
            raise ModelFileError(f"heads file {path} is a folder: give the .safetensors file")
        if not path.is_file():
            raise ModelFileError(f"heads file {path} does not exist")
        try:
            with safe_open(str(path), framework="numpy") as f:
                meta = dict(f.metadata() or {})
                arrays = {k: f.get_tensor(k) for k in f.keys()}
        except Exception as e:  # safetensors raises its own error types for corrupt headers
            raise ModelFileError(f"heads file {path} is corrupt or not a safetensors file: "
                                 f"{str(e).splitlines()[0] if str(e) else type(e).__name__}") from None
        if meta.get("format") != HEADS_FORMAT or not {"weight", "bias", "vocab_subset"} <= set(arrays):
            raise ModelFileError(f"{path} is not a specdecode heads file (format {meta.get('format')!r}, "
                                 f"tensors {sorted(arrays)})")
        w, b, s = arrays["weight"], arrays["bias"], arrays["vocab_subset"]
        if w.ndim != 3 or w.shape[1] != w.shape[2] or b.shape != w.shape[:2] or s.ndim != 1:
            raise ModelFileError(f"heads file {path} has inconsistent shapes: weight {w.shape}, bias {b.shape}, "
                                 f"vocab_subset {s.shape}")
        if not 1 <= w.shape[0] <= MAX_HEADS or len(s) == 0 or len(np.unique(s)) != len(s) or s.min() < 0:
            raise ModelFileError(f"heads file {path} is malformed: {w.shape[0]} heads (expected 1..{MAX_HEADS}), "
                                 f"a vocabulary subset of {len(s)} ids (expected distinct ids >= 0, at least one)")
        if not (np.isfinite(w).all() and np.isfinite(b).all()):
            raise ModelFileError(f"heads file {path} holds non-finite weights")
        return cls(w.astype(np.float32), b.astype(np.float32), s.astype(np.int64), meta)

    def check_target(self, target: "Backend", path: str | Path = "the heads file") -> None:
        """Raises HeadsMismatchError unless these heads were trained for this target (its
        SHA-256, hidden size and vocabulary)."""
        want = self.meta.get("target_sha256", "")
        have = target_sha256(target)
        if want != have:
            trained_for = self.meta.get("target_name", "?")
            if trained_for == target.name:
                trained_for = f"another file named {trained_for}"
            how = (f"'specdecode heads train --target {target.name}'" if target.has_text else
                   "specdecode.heads.train.train_heads_on_ids")
            raise HeadsMismatchError(
                f"{path} was trained for target {trained_for} (SHA-256 {want[:16]}...), "
                f"not for {target.name} (SHA-256 {have[:16]}...): train heads for this target with {how}",
                param="draft")
        if int(self.vocab_subset.max()) >= target.n_vocab:
            raise HeadsMismatchError(f"{path} names token id {int(self.vocab_subset.max())}, outside the vocabulary "
                                     f"of {target.name} ({target.n_vocab})", param="draft")
        if int(self.meta.get("vocab_size", -1)) != target.n_vocab or self.hidden_size != target.hidden_size:
            raise HeadsMismatchError(
                f"{path} has hidden size {self.hidden_size} and vocabulary {self.meta.get('vocab_size')}; "
                f"{target.name} has {target.hidden_size} and {target.n_vocab}", param="draft")


class HeadsDrafter(HiddenStateDrafter, TreeDrafting):
    """Drafts with K heads on the target's final hidden state (Stern et al. 2018; Medusa-1).

    The engine hands over the hidden states of each verifying forward of this generation
    (and of the prefill's last position) in each step's outcome (:meth:`observe`). Each proposal reads the
    one at position L - 2 of the context [L] (the position whose output gave the last
    committed token), and head k proposes the k-th token after the last committed one:
    greedy, each head's argmax over its subset; sampled, a draw from each head's
    distribution shaped by the generation's Sampler, returned as the draft probabilities
    [k, V] (zero outside the subset), so the speculative sampling rule stays exact. No
    hidden state there (a prefill the backend gave none for, e.g. a long one on llama.cpp,
    or none at all when the whole prompt was cached): no draft. With a tree budget
    (:class:`specdecode.trees.drafting.TreeDrafting`), a greedy generation drafts Medusa's tree of each head's
    top ``tree_width`` tokens instead (:func:`medusa_tree`).

    heads: trained :class:`DraftHeads`; target: the backend they were trained for (checked:
    HeadsMismatchError otherwise); it must declare ``supports_hidden_states``.
    Raises SpecDecodeError when the backend cannot give hidden states.
    """

    name = "heads"

    def __init__(self, heads: DraftHeads, target: "Backend", path: str | Path = "the heads file") -> None:
        if not target.supports_hidden_states:
            raise SpecDecodeError(f"draft heads need the target's hidden states; {target.name} on "
                                  f"{type(target).__name__} does not give them", param="draft")
        heads.check_target(target, path)
        self.heads = heads
        self.target = target
        self.path = str(path)
        self._sampler: "Sampler | None" = None
        self.seq = 0  # the target's KV sequence this drafter's generation runs on
        self._impl = target.make_heads(heads.weight, heads.bias, heads.vocab_subset)
        self._positions: list[int] = []  # of the latest hidden rows handed over
        self._hidden = None  # those rows [M, H]

    @property
    def num_heads(self) -> int:
        return self.heads.num_heads

    def start(self, prompt_ids: Sequence[int], sampler: "Sampler") -> None:
        self._sampler = sampler
        self._positions, self._hidden = [], None  # the prefill's row comes in its outcome, after this

    def observe(self, outcome: StepOutcome) -> None:
        if outcome.hidden is not None:
            self._positions, self._hidden = list(outcome.hidden.positions), outcome.hidden.hidden

    def finish(self, committed: Sequence[int]) -> None:
        self._positions, self._hidden = [], None

    def _row(self, position: int):
        """The latest hidden state [H] handed over at this position, or None."""
        try:
            return self._hidden[self._positions.index(position)]
        except ValueError:
            return None

    def propose(self, context: Sequence[int], k: int) -> Draft:
        sampler = self._sampler
        assert sampler is not None, "start() must be called before propose()"
        k = min(k, self.num_heads)
        h = self._row(len(context) - 2) if k > 0 and len(context) >= 2 else None
        if h is None:
            return Draft([])
        logits = self._impl(h, k)  # [k, V] float32, -inf outside the subset
        if self.drafts_tree(sampler):  # Medusa's tree of each head's top candidates
            return medusa_tree(logits, self.tree_width, self.tree_nodes, self.target.eog_ids)
        history = list(context) if sampler.params.has_penalties else []
        drafts: list[int] = []
        rows: list[np.ndarray] = []
        for i in range(k):
            row = sampler.constrain(logits[i], drafts)
            if sampler.params.greedy:
                tok = sampler.argmax(row, history)
            else:
                q = sampler.probs(row, history)
                tok = sampler.draw(q, len(context) + i)
                rows.append(q)
            drafts.append(tok)
            if sampler.params.has_penalties:
                history.append(tok)
            if tok in self.target.eog_ids:
                break
        return Draft(drafts, np.stack(rows) if rows else None)

    def fork(self, seq: int) -> "HeadsDrafter":
        """The same heads for the generation on the target's sequence seq."""
        if not 0 <= seq < self.target.n_seq:
            raise SpecDecodeError(f"{self.target.name} holds {self.target.n_seq} sequence(s)", param="parallel")
        twin = copy.copy(self)
        twin.seq, twin._sampler, twin._positions, twin._hidden = seq, None, [], None
        return twin


def medusa_tree(logits: np.ndarray, width: int, budget: int, eog_ids=frozenset()) -> Draft:
    """A tree of the heads' candidates (Medusa, Cai et al. 2024, Sec. 2.1.2 tree attention;
    nodes chosen by EAGLE-2's rule, the likeliest paths first): logits [K, V] of K heads, the
    top ``width`` tokens of head d as the children of every depth-(d-1) node, expanded in
    order of their path's probability (the product of the heads' softmax probabilities)
    up to ``budget`` nodes. Returns a Draft with parents (nodes in topological order; an
    end-of-generation token gets no children) and node_probs (each node's path probability,
    non-increasing: every prefix is the likeliest tree of its size,
    :func:`specdecode.control.tree_plan.plan_tree`)."""
    import heapq

    z = logits - logits.max(axis=1, keepdims=True)
    probs = np.exp(z) / np.exp(z).sum(axis=1, keepdims=True)
    top = [np.argsort(-probs[d])[:width] for d in range(len(probs))]
    heap = [(-float(probs[0, t]), 0, j, -1) for j, t in enumerate(top[0])]  # (-path prob, depth, rank, parent)
    heapq.heapify(heap)
    tokens: list[int] = []
    parents: list[int] = []
    node_probs: list[float] = []
    while heap and len(tokens) < budget:
        neg, depth, rank, parent = heapq.heappop(heap)
        tok = int(top[depth][rank])
        if not np.isfinite(neg) or neg == 0.0:
            continue
        tokens.append(tok)
        parents.append(parent)
        node_probs.append(-neg)
        if depth + 1 < len(top) and tok not in eog_ids:
            node = len(tokens) - 1
            for j, t in enumerate(top[depth + 1]):
                heapq.heappush(heap, (neg * float(probs[depth + 1, t]), depth + 1, j, node))
    return Draft(tokens, None, parents, node_probs)


def load_heads_drafter(path: str | Path, target: "Backend") -> HeadsDrafter:
    """``--draft heads:FILE``: load FILE and check it against the target."""
    return HeadsDrafter(DraftHeads.load(path), target, path)


def heads_meta(target: "Backend", num_heads: int, extra: dict[str, Any]) -> dict[str, str]:
    """The metadata a heads file records (see the module docstring)."""
    meta = {"format": HEADS_FORMAT, "kind": HEADS_KIND, "target_sha256": target_sha256(target),
            "target_name": target.name, "hidden_size": str(target.hidden_size), "vocab_size": str(target.n_vocab),
            "num_heads": str(num_heads)}
    meta.update({k: v if isinstance(v, str) else json.dumps(v) for k, v in extra.items()})
    return meta
