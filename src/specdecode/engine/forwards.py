"""The forwards of one batched step (:meth:`BatchForwards.run`): every generation's block in one
forward, except that a generation verified batch-invariantly goes in forwards of at most the
target's measured ``invariant_block`` tokens, in the target's batch-invariant mode, so that
every row has the logits of a one-token step (docs/architecture.md, "Lossless, defined";
:mod:`specdecode.control.invariance` says which kernels differ and why).

Dimension letters: k_i = drafted tokens of generation i, V = vocabulary size.
"""

from __future__ import annotations

from typing import Any, Callable, Sequence

import numpy as np

from ..backends.base import Backend, SeqForward
from ..backends.checks import check_finite_logits
from ..drafters.base import HiddenStateDrafter


class BatchForwards:
    """Runs a step's forwards on the target and keeps its batch-invariant mode as last set.

    invariance(target, seq) -> the invariant block in tokens, measured on sequence seq (once:
    the result is kept on the target).
    """

    def __init__(self, target: Backend, invariance: Callable[[Backend, int], "int | None"]) -> None:
        self.target = target
        self.invariance = invariance
        self._invariant_mode = False  # the target's set_batch_invariant, as last set

    def run(self, gens: Sequence[Any], items: list[SeqForward]) -> tuple[list[np.ndarray], dict, bool]:
        """The step's forward: one for every generation, except that batch-invariant ones go
        in forwards of at most invariant_block tokens (in that mode), of their own unless the
        whole step fits one. Hidden states only for the sequences whose drafter reads them.
        Returns logits [k_i+1, V] per item, in order, the hidden rows by sequence id, and
        whether the step's time is a sample of T(n): one forward, timed as the cost curve is
        (not a lone one-token step, which batch-invariant mode runs on one thread)."""
        hidden_for = {gen.slot.seq for gen in gens if isinstance(gen.drafter, HiddenStateDrafter)}
        block = max((g.out.stats.invariant_block for g in gens if g.invariant), default=0)
        if block and sum(len(it.token_ids) for it in items) <= block:
            groups = [(list(range(len(gens))), True)]  # it all fits one batch-invariant forward
        else:
            groups = [([i for i, g in enumerate(gens) if not g.invariant], False)]
        for i, gen in enumerate(gens if len(groups[0][0]) < len(gens) else ()):  # packed while they fit
            last, invariant = groups[-1]
            rows = sum(len(items[j].token_ids) for j in last) + len(items[i].token_ids)
            if gen.invariant and (invariant and rows <= gen.out.stats.invariant_block):
                last.append(i)
            elif gen.invariant:
                groups.append(([i], True))
        logits: list = [None] * len(items)
        hidden: dict = {}
        for idx, invariant in groups:
            if not idx:
                continue
            self.set_invariant(invariant)
            part, want = [items[i] for i in idx], {items[i].seq for i in idx} & hidden_for
            if want:
                out, more = self.target.forward_batch_hidden(part, want)
                hidden.update(more)
            else:
                out = self.target.forward_batch(part)
            for i, lg in zip(idx, out):
                logits[i] = lg
        for lg in logits:
            check_finite_logits(self.target, lg[-1])
        used = [g for g in groups if g[0]]
        return logits, hidden, len(used) == 1 and not (used[0][1] and len(items) == 1 and len(items[0].token_ids) == 1)

    def set_invariant(self, on: bool) -> None:
        """Put the target in batch-invariant mode (on) or its fastest (off), where it is not already."""
        if on != self._invariant_mode:
            self.target.set_batch_invariant(on)
            self._invariant_mode = on

    def invariant_block(self, slot: Any) -> int | None:
        """The target's invariant_block, measured on the slot's sequence the first time; None
        while ``invariance`` says it is measured later (a server's calibration, between requests)."""
        if self.target.invariant_block is None:
            slot.forget()
            self._invariant_mode = False
            block = self.invariance(self.target, slot.seq)
            if block is None:
                return None
            self.target.invariant_block = max(1, int(block))
        return self.target.invariant_block
