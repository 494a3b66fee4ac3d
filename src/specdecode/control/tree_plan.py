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

from ..backends.tree_shape import tree_depths
from ..drafters.base import Draft, HiddenStateDrafter, IncrementalDrafter


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


def plan_tree(draft: Draft, calibration: TreeCalibration, T: np.ndarray, cost_per_node: float,
              sunk: float = 0.0, keep_first_path: bool = False) -> Draft:
    """The prefix of a probability-ordered tree that maximises the expected committed tokens
    per second (E(n) / (T[n + 1] + n cost_per_node + sunk), sunk: the seconds already spent
    drafting it); Draft([]) when no prefix beats a plain step. T: T(0..) in seconds, at least
    len(draft) + 1 entries (longer trees are cut there). With keep_first_path (a lookup, whose
    chain the controller has already sized by its own estimates) the first path stays whole
    and only the other nodes are weighed. A chain is returned as it is; a tree without
    node_probs as its first path."""
    if draft.parents is None or not draft.token_ids:
        return draft
    if draft.node_probs is None:
        return draft.chain()
    n_min = 0
    if keep_first_path:
        draft, n_min = first_path_first(draft)
    n_max = min(len(draft.token_ids), len(T) - 2)
    p = np.asarray(draft.node_probs[:n_max], dtype=np.float64)
    E = 1.0 + calibration.factor * np.concatenate([[0.0], np.cumsum(p)])  # [n_max + 1]
    n = np.arange(n_max + 1)
    rates = E / (T[1:n_max + 2] + n * cost_per_node + sunk)
    best = max(min(n_min, n_max), int(np.argmax(rates[n_min:])) + n_min if n_min <= n_max else 0)
    return Draft(list(draft.token_ids[:best]), None, list(draft.parents[:best]), list(draft.node_probs[:best]))


def first_path_first(draft: Draft) -> tuple[Draft, int]:
    """The tree with its first path (:meth:`Draft.chain`) moved to the front, the other nodes
    after it in their order (still a tree at every prefix), and the first path's length."""
    path, at = [], -1
    for i, q in enumerate(draft.parents):
        if q == at:
            path.append(i)
            at = i
    order = path + [i for i in range(len(draft.parents)) if i not in set(path)]
    index = {node: j for j, node in enumerate(order)}
    return Draft([draft.token_ids[i] for i in order], None,
                 [index[draft.parents[i]] if draft.parents[i] >= 0 else -1 for i in order],
                 [draft.node_probs[i] for i in order]), len(path)


def tree_depth(drafter, planned: int, cap: int) -> int:
    """How deep a tree drafter drafts, given its chain's planned K and the step's cap: heads
    their whole depth (one forward drafts every level), a draft model one level past its
    chain's K (each level costs a forward of the draft), a lookup its chain's K."""
    if isinstance(drafter, HiddenStateDrafter):
        return cap
    if isinstance(drafter, IncrementalDrafter):
        return min(cap, planned + 1) if planned else 0
    return planned


def shape_tree(draft: Draft, source, costs, drafted_s: float) -> tuple[Draft, int, int]:
    """A proposal as the controller verifies it: a tree cut to the prefix that pays
    (:func:`plan_tree`, its drafting time sunk; a lookup keeps its first path). Returns (the
    draft, the levels drafted (a tree's depth before the cut: what its drafting time paid
    for), the length of its first path after the cut (a chain: its length), which the
    chain's acceptance estimate learns from)."""
    if draft.parents is None:
        return draft, len(draft.token_ids), len(draft.token_ids)
    levels = max(tree_depths(draft.parents), default=0)
    T = costs.upto(len(draft.token_ids) + 1)  # a tree may hold more nodes than kmax
    draft = plan_tree(draft, source.tree_calibration, T, 0.0, drafted_s, keep_first_path=source.bands is not None)
    return draft, levels, len(draft.chain().token_ids)
