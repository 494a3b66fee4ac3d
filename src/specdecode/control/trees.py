"""The shape of a tree of drafts from the measured cost (Sequoia, Chen et al. 2024: the tree
for the hardware's cost curve; EAGLE-2, Li et al. 2024: nodes by the draft's confidence).

A tree drafter proposes its nodes in the order of their path probability under its own
model (``Draft.node_probs``: each node's chance, by the drafter's reckoning, of being on the
accepted path), so that every prefix of the node list is a tree and the best tree of n nodes
under that model. The expected committed tokens of the first n nodes are
E(n) = 1 + c * sum_{i < n} p_i, c a calibration of the drafter's probabilities learned from
what the target accepts (:class:`TreeCalibration`); the controller keeps the prefix that
maximises E(n) / (T(n + 1) + cost of drafting), down to n = 0, a plain step. Where T(n) is
flat (a GPU, PyTorch bfloat16 on a CPU) wide trees pay; on a compute-bound CPU they shrink
to a chain or to nothing.

Units: seconds.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ..drafters.base import Draft


@dataclass
class TreeCalibration:
    """c = accepted nodes / sum of the drafter's probabilities of the verified nodes, with a
    prior of ``prior_weight`` expected nodes at ``prior``; old steps decay by ``decay``."""

    prior: float = 0.7
    prior_weight: float = 4.0
    decay: float = 0.95

    def __post_init__(self) -> None:
        self.accepted = self.prior * self.prior_weight
        self.expected = self.prior_weight

    @property
    def factor(self) -> float:
        return self.accepted / self.expected if self.expected > 0 else self.prior

    def update(self, expected: float, accepted: int) -> None:
        """A tree whose nodes' probabilities summed to ``expected`` had ``accepted`` accepted."""
        self.accepted = self.decay * self.accepted + accepted
        self.expected = self.decay * self.expected + expected


def plan_tree(draft: Draft, calibration: TreeCalibration, T: np.ndarray, cost_per_node: float) -> Draft:
    """The prefix of a probability-ordered tree that maximises the expected committed tokens
    per second (E(n) / (T[n + 1] + n cost_per_node)); Draft([]) when no prefix beats a plain
    step. T: T(0..) in seconds, at least len(draft) + 1 entries (longer trees are cut there).
    A draft without node_probs is returned as it is."""
    if draft.parents is None or draft.node_probs is None or not draft.token_ids:
        return draft
    n_max = min(len(draft.token_ids), len(T) - 2)
    p = np.asarray(draft.node_probs[:n_max], dtype=np.float64)
    E = 1.0 + calibration.factor * np.concatenate([[0.0], np.cumsum(p)])  # [n_max + 1]
    n = np.arange(n_max + 1)
    rates = E / (T[1:n_max + 2] + n * cost_per_node)
    best = int(np.argmax(rates))
    return Draft(list(draft.token_ids[:best]), None, list(draft.parents[:best]), list(draft.node_probs[:best]))
