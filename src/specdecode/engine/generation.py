"""What the engine keeps per generation and per slot, and what a step's verification gives
the commit (:class:`Verified`). The step itself is :class:`specdecode.engine.core.SpeculativeEngine`.

Dimension letters: K = drafted tokens this step, A = accepted drafts, V = vocabulary size.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import NamedTuple, Sequence

import numpy as np

from ..backends.base import HiddenRows
from ..backends.sharing import common_prefix_len
from ..drafters.base import Drafter
from ..output import OutputAccumulator
from ..sampling import Sampler
from ..verify import VerifyResult


@dataclass(eq=False)
class Generation:
    """One generation in progress (made by :meth:`SpeculativeEngine.begin`).

    committed: prompt and emitted tokens. slot: the engine slot (KV sequence) it runs in.
    k: its cap on drafted tokens per step. done: no further step is needed. prefilling: its
    prompt is still being read in chunks (it cannot step yet).
    """

    committed: list[int]  # prompt and emitted tokens
    drafter: Drafter
    sampler: Sampler
    out: OutputAccumulator
    slot: "Slot"
    k: int
    prompt_len: int
    invariant: bool = False  # verified batch-invariantly (GenerationOptions.invariant)
    tree_nodes: int = 0  # the node budget of its trees of drafts (0: chains)
    prefilling: bool = False  # begun chunked, its prompt not all read yet (SpeculativeEngine.prefill)

    @property
    def done(self) -> bool:
        return self.out.finish_reason is not None or self.room < 0

    @property
    def room(self) -> int:
        """Drafts that still fit: a step commits up to k+1 tokens; prompt plus output never
        exceeds n_ctx."""
        return self.slot.n_ctx - len(self.committed) - 1


@dataclass(eq=False)
class Slot:
    """One KV sequence of the target (and of shared draft models) and what it caches.

    seq: the sequence id. drafter: this slot's drafter (forked from the engine's).
    tokens, cached_len: the target's cache of seq holds tokens[:cached_len] (for prefix reuse
        across generations). tokens is the running generation's committed list itself, so a
        step moves a length instead of copying the context.
    gen: the generation running in it, or None when free.
    canonical: cells [0, canonical) were read by prompt forwards whose calls began at 0 and at
        every multiple of the target's ``prefill_split`` (the calls a fresh prefill makes), so
        the whole calls among them hold what a fresh prefill of the same tokens computes, bit
        for bit: what a batch-invariant generation may reuse (:meth:`invariant_reusable`).
        Moved by :meth:`note_read` and, when a prefill rolls the cache back, cut to what stays.
    """

    seq: int
    drafter: Drafter
    n_ctx: int
    tokens: list[int] = field(default_factory=list)
    cached_len: int = 0
    gen: Generation | None = None
    last_used: int = 0
    canonical: int = 0

    def reusable(self, prompt_ids: Sequence[int]) -> int:
        """How much of the cache a generation of prompt_ids [L] keeps: the common prefix of
        the cached tokens and prompt_ids[:-1] (the last prompt token is fed with the first step)."""
        return common_prefix_len(self.tokens, prompt_ids, min(self.cached_len, len(prompt_ids) - 1))

    def invariant_reusable(self, prompt_ids: Sequence[int], split: int | None) -> int:
        """How much of the cache a batch-invariant generation (a seed, strict mode) keeps: the
        whole calls of ``split`` tokens from position 0 that are both canonical and in the
        common prefix, so that its prompt's cells are a fresh prefill's (issue 61: a seed threw
        the whole cache away); 0 without a split (a backend that reads a prompt in one call)."""
        if not split:
            return 0
        keep = min(self.canonical, self.reusable(prompt_ids))
        if keep == self.canonical == len(prompt_ids) - 1:
            return keep  # the same prompt read again: the same calls, its last one too
        return keep // split * split

    def note_read(self, start: int, n: int, split: int | None) -> None:
        """n prompt tokens were read from position start in one forward (calls of split from
        start): canonical grows where they continue it from a call boundary."""
        if split and start == self.canonical and start % split == 0:
            self.canonical = start + n

    def forget(self) -> None:
        """Nothing cached is reused (the cache itself is rolled back by the next prefill)."""
        self.tokens, self.cached_len = [], 0


class Verified(NamedTuple):
    """One generation's verified block, ready to commit.

    draft_ids: [A'] the drafts the commit reads (a chain's K drafts; a tree's accepted path).
    num_drafted: drafted tokens verified (a tree: its nodes). result: the acceptance rule's
    outcome. gaps: the top-2 gaps of the committed positions (None unless recorded).
    logits: the target's verification logits the commit reads ([K+1, V] for a chain, the
    accepted path's rows [A+1, V] for a tree). hidden: the target's hidden states of the
    verified rows kept, for a drafter that reads them (else None).
    """

    draft_ids: list[int]
    num_drafted: int
    result: VerifyResult
    gaps: list[float] | None
    logits: np.ndarray
    hidden: HiddenRows | None = None
