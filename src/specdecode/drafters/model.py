"""A smaller model as the drafter (Leviathan et al. 2023, Section 2; Chen et al. 2023).

Dimension letters: K = drafted tokens, V = vocabulary size, L = context length.
"""

from __future__ import annotations

import copy
from typing import Sequence

import numpy as np

from ..backends.base import Backend
from ..backends.sharing import common_prefix_len
from ..errors import SpecDecodeError
from ..sampling import Sampler
from ..backends.vocab import check_vocab_compatible
from .base import ContinuationRule, Draft, IncrementalDrafter
from .tree import TreeDrafting, grow_tree


class OwnedDraftModel(IncrementalDrafter):
    """What a drafter over a draft model keeps: the model (``backend``, closed by the drafter
    that loaded it, shared by its forks), the KV sequence it drafts on (``seq``), and the
    controller's continuation rule (``keep_drafting``). Subclasses set those in __init__."""

    backend: Backend
    seq: int
    keep_drafting: ContinuationRule | None
    _owner: bool
    _closed: bool

    def set_continuation_rule(self, rule: ContinuationRule | None) -> None:
        self.keep_drafting = rule

    def draft_backends(self) -> list[Backend]:
        return [self.backend]

    def close(self) -> None:
        if not self._closed:
            self._closed = True
            if self._owner:
                self.backend.close()

    def _twin(self, seq: int):
        """A copy drafting on the model's KV sequence seq, not owning the model (fork's start).
        Raises SpecDecodeError when the draft model holds fewer sequences."""
        if not 0 <= seq < self.backend.n_seq:
            raise SpecDecodeError(f"the draft model {self.backend.name} holds {self.backend.n_seq} sequence(s): "
                                  f"it cannot draft on sequence {seq}")
        twin = copy.copy(self)
        twin.seq, twin._owner, twin._closed, twin.keep_drafting = seq, False, False, None
        return twin


class ModelDrafter(OwnedDraftModel, TreeDrafting):
    """A smaller model on any backend drafts K tokens autoregressively.

    Greedy generations draft greedily (probs None); sampled ones draw each draft from the
    draft model's distribution shaped by the same Sampler and return it as probs [K, V].
    The draft's KV cache keeps the tokens it has seen; each proposal rolls it back to the
    longest prefix shared with the new context and feeds only the rest. With ``tree_nodes``
    (:class:`specdecode.drafters.tree.TreeDrafting`) a greedy generation on a draft backend that grows trees
    (``supports_tree_draft``: torch) drafts EAGLE-2's dynamic tree of up to that many nodes
    and at most K deep (:func:`specdecode.drafters.tree.grow_tree`), its cells dropped again after drafting.

    vocab_subset: when > 0, the draft model computes logits only for token ids below it
    plus the prompt's tokens and the end-of-generation ids (FR-Spec, Zhao et al. 2025:
    the output projection over a large vocabulary is a large share of a small draft
    model's cost; BPE ids are roughly in merge order, so low ids are the frequent
    tokens). Drafts stay lossless: the target verifies every token against its full
    distribution, and a sampled draft's probs are exactly the restricted distribution it
    was drawn from. Needs a backend whose ``supports_output_subset()`` is true (the torch
    backend with a plain output head).

    A draft vocabulary that differs from the target's by padding (:mod:`specdecode.backends.vocab`:
    Qwen2.5 0.5B's 151,936 ids under a 7B target's 152,064) drafts over the target's ids
    (V = target.n_vocab): draft logits for ids the target lacks are masked out before the
    argmax or the sampling, and ids the draft lacks get probability 0, so drafts are always
    ids < V and probs [K, V] is exactly the distribution each draft was drawn from. The
    whole-draft greedy path on the device is used only when it cannot return an id >= V.
    While the context holds an id the draft model cannot read (a padding id the target
    emitted), the drafter drafts nothing.

    Raises IncompatibleVocabularyError at construction when the vocabularies differ
    (:func:`specdecode.backends.vocab.check_vocab_compatible`: the text of a shared id, sizes far
    apart, or extra ids that are not padding), showing the first mismatches;
    SpecDecodeError when vocab_subset is negative or the backend cannot restrict its output.
    """

    name = "model"

    def __init__(self, backend: Backend, target: Backend | None = None, vocab_subset: int = 0, seq: int = 0) -> None:
        self.backend = backend
        self.seq = seq  # the draft model's KV sequence this drafter uses
        self._owner = True  # closes the backend (forks share it)
        if vocab_subset < 0:
            raise SpecDecodeError(f"draft vocabulary subset {vocab_subset} is out of range: expected >= 0 (0 = all)")
        if vocab_subset and not backend.supports_output_subset():
            raise SpecDecodeError(
                f"a draft vocabulary subset needs a draft model on the torch backend (--draft-backend torch) "
                f"with a plain output head; {backend.name} on {type(backend).__name__} cannot restrict its output"
            )
        self.vocab_subset = vocab_subset
        if target is not None:
            check_vocab_compatible(backend, target)
        # V: drafts and probs are over the target's ids (the draft's own when no target is given).
        self.target_vocab = target.n_vocab if target is not None else backend.n_vocab
        # The device's greedy draft takes the argmax over the draft's whole vocabulary: safe
        # when that has no id >= V, or when an output subset (restricted to ids < V) is set.
        self._greedy_on_device = backend.supports_greedy_draft and (
            backend.n_vocab <= self.target_vocab or bool(vocab_subset))
        self._cached: list[int] = []
        self._sampler: Sampler | None = None
        # Set by the cost-aware controller to stop drafting when further tokens will not pay.
        self.keep_drafting: ContinuationRule | None = None
        self._closed = False

    def fork(self, seq: int) -> "ModelDrafter":
        """A drafter on the same draft model, drafting on its KV sequence seq.
        Raises SpecDecodeError when the draft model holds fewer sequences."""
        twin = self._twin(seq)
        twin._cached, twin._sampler = [], None
        return twin

    def start(self, prompt_ids: Sequence[int], sampler: Sampler) -> None:
        self._sampler = sampler
        if self.vocab_subset:
            ids = set(range(min(self.vocab_subset, self.backend.n_vocab)))
            ids.update(int(t) for t in prompt_ids)
            ids.update(self.backend.eog_ids)
            limit = min(self.backend.n_vocab, self.target_vocab)  # ids both models have
            self.backend.set_output_subset([t for t in ids if t < limit])

    def pending(self, context: Sequence[int]) -> int:
        """Tokens of context this drafter would have to feed before drafting (not cached)."""
        return len(context) - common_prefix_len(self._cached, context)

    def propose(self, context: Sequence[int], k: int) -> Draft:
        sampler = self._sampler
        assert sampler is not None, "start() must be called before propose()"
        k = min(k, self.backend.n_ctx - len(context))
        if k <= 0:
            return Draft([])
        keep = common_prefix_len(self._cached, context, len(context) - 1)  # feed at least one token
        self.backend.rollback(keep, seq=self.seq)
        self._cached = list(context[:keep])
        assert self.backend.seq_len(self.seq) == len(self._cached), "draft KV length must equal its cached tokens"
        if self.target_vocab > self.backend.n_vocab and any(t >= self.backend.n_vocab for t in context[keep:]):
            return Draft([])  # the context holds an id of the target's padding: the draft cannot read it

        if self.drafts_tree(sampler) and self.backend.supports_tree_draft:
            root = self._over_target_ids(self.backend.forward(context[keep:], logits_for=[len(context) - keep - 1],
                                                             seq=self.seq)[0])
            self._cached.extend(context[keep:])
            rows = lambda ids, pos, vis: self.backend.forward_rows(ids, pos, vis, seq=self.seq)  # noqa: E731
            try:
                return grow_tree(rows, len(context), root, k, self.tree_nodes, self.tree_width, self.backend.eog_ids,
                                 self._over_target_ids)
            finally:
                self.backend.rollback(len(context), seq=self.seq)
        if (sampler.params.greedy and not sampler.params.has_penalties and self.keep_drafting is None
                and sampler.constraint is None and self._greedy_on_device and self.seq == 0):
            # The whole greedy draft on the device (torch): one host sync, not one per token.
            drafts = self.backend.greedy_draft(context[keep:], k)
            self._cached.extend(list(context[keep:]) + drafts[:-1])
            return Draft(drafts)
        history = list(context) if sampler.params.has_penalties else []
        drafts: list[int] = []
        rows: list[np.ndarray] = []
        logits = self._over_target_ids(self.backend.forward(context[keep:], logits_for=[len(context) - keep - 1],
                                                             seq=self.seq)[0])
        self._cached.extend(context[keep:])
        p_cum = 1.0
        for i in range(k):
            logits = sampler.constrain(logits, drafts)  # the grammar's state after drafts[:i]
            if sampler.params.greedy:
                tok = sampler.argmax(logits, history)
                if self.keep_drafting is not None:
                    z = logits - logits.max()
                    p_cum *= float(1.0 / np.exp(z).sum())
            else:
                q = sampler.probs(logits, history)
                tok = sampler.draw(q, len(context) + i)
                rows.append(q)
                p_cum *= float(q.max())
            drafts.append(tok)
            if sampler.params.has_penalties:
                history.append(tok)
            if tok in self.backend.eog_ids:  # nothing follows the end of generation
                break
            if i + 1 < k and self.keep_drafting is not None and not self.keep_drafting(i + 1, p_cum):
                break
            if i + 1 < k:
                logits = self._over_target_ids(self.backend.forward([tok], logits_for=[0], seq=self.seq)[0])
                self._cached.append(tok)
        probs = np.stack(rows) if rows else None
        return Draft(drafts, probs)

    def _over_target_ids(self, logits: np.ndarray) -> np.ndarray:
        """The draft's logits [V_draft] over the target's ids [V]: ids >= V are cut (masked
        out: the draft never proposes an id the target lacks), ids the draft lacks get -inf
        (probability 0: it can never propose them)."""
        v, n = self.target_vocab, logits.shape[-1]
        if n > v:
            return logits[:v]
        if n < v:
            out = np.full(v, -np.inf, dtype=np.float32)
            out[:n] = logits
            return out
        return logits

    def finish(self, committed: Sequence[int]) -> None:
        """End of a generation: drop cached tokens that are not part of the committed output."""
        keep = common_prefix_len(self._cached, committed)
        self.backend.rollback(keep, seq=self.seq)
        del self._cached[keep:]
