"""Trees of drafts from a drafter's own candidates: a draft model's dynamic tree (EAGLE-2,
Li et al. 2024, Sec. 4.1-4.2: expand the most confident nodes of each depth, then rerank
every drafted node by its path probability and keep the best ``budget``), and the shared
settings of a tree-drafting drafter.

A tree is a :class:`Draft` with ``parents`` (nodes in topological order) and ``node_probs``
(each node's path probability under the drafter, non-increasing), so that every prefix of
its node list is a tree, and the likeliest one of that size: the controller cuts it to the
prefix that pays under the measured cost (:func:`specdecode.control.tree_plan.plan_tree`).

Dimension letters: V = vocabulary, W = width (candidates per expanded node), D = depth.
"""

from __future__ import annotations

from typing import Callable, Sequence

import numpy as np

from ..limits import DEFAULT_TREE_WIDTH
from ..sampling import log_softmax
from .base import Draft


class TreeDrafting:
    """Mixed into a drafter that can draft trees: ``tree_nodes`` (the node budget of a
    greedy generation's tree; 0: chains) and ``tree_width`` (candidates per node), set per
    generation by :func:`set_tree_options`."""

    tree_nodes = 0
    tree_width = DEFAULT_TREE_WIDTH

    def drafts_tree(self, sampler) -> bool:
        """Whether this generation's drafts are trees: a budget (set only where
        :func:`trees_allowed`) and greedy decoding (the drafters' trees are greedy)."""
        return self.tree_nodes > 0 and sampler.params.greedy


def trees_allowed(params, grammar, invariant: bool) -> bool:
    """The one rule of whether a generation may have trees of drafts at all (its plan reads it:
    :func:`specdecode.engine.plan.plan_generation`): no penalties (``params``, the sampling
    parameters) or ``grammar`` (each path would need its own history and grammar state) and not
    batch-invariant (a tree's forward is not the arithmetic of one-token steps). Where not, its
    budget is 0."""
    return not params.has_penalties and grammar is None and not invariant


def set_tree_options(drafter, nodes: int, width: int | None = None) -> None:
    """Set the tree budget (and width) of a drafter and of every source of a controller."""
    for d in [drafter, *drafter.members()]:
        if isinstance(d, TreeDrafting):
            d.tree_nodes = nodes
            if width is not None:
                d.tree_width = width


# A depth whose likeliest node the draft gives less than this chance is not expanded: its
# children could hardly be accepted, and each depth costs a forward of the draft model.
MIN_EXPAND_PROB = 0.02


def grow_tree(forward_rows: Callable, base: int, root_logits: np.ndarray, depth: int, budget: int, width: int,
              eog_ids: Sequence[int], over_target: Callable[[np.ndarray], np.ndarray],
              min_prob: float = MIN_EXPAND_PROB) -> Draft:
    """EAGLE-2's dynamic tree on a draft model whose cache holds ``base`` cells, the last one
    the root (the last committed token), whose next-token logits are ``root_logits`` [V].
    Each depth up to ``depth`` expands the ``width`` likeliest nodes of the depth before in one
    ``forward_rows(tokens [n], positions [n], visible [n, C + n])`` call (each row sees the
    prefix, its ancestors' cells and itself) and adds each one's top ``width`` tokens as
    children; an end-of-generation token is never expanded, nor a node no likelier than the
    budget-th likeliest drafted so far (none of its children could be kept), nor a depth
    whose likeliest node has a path probability under ``min_prob``. Returns the ``budget`` likeliest
    nodes as a tree (parents before children: a child is never likelier than its parent, and
    ties go by depth). The caller rolls the draft's cache back to ``base`` afterwards."""
    eog = set(int(t) for t in eog_ids)
    tokens: list[int] = []
    parents: list[int] = []
    logp: list[float] = []
    depths: list[int] = []
    row_of: dict[int, int] = {}  # expanded node -> its cell after base

    def add_children(logits: np.ndarray, parent: int, at_depth: int) -> None:
        lp = log_softmax(logits)
        start = logp[parent] if parent >= 0 else 0.0
        top = np.argpartition(-lp, width - 1)[:width] if width < len(lp) else np.arange(len(lp))
        for t in top[np.argsort(-lp[top], kind="stable")]:  # O(V), not a sort of the vocabulary
            if np.isfinite(lp[t]):
                tokens.append(int(t))
                parents.append(parent)
                logp.append(start + float(lp[t]))
                depths.append(at_depth)

    add_children(root_logits, -1, 1)
    cells = 0
    for d in range(1, depth):
        level = [i for i in range(len(tokens)) if depths[i] == d and tokens[i] not in eog]
        cut = sorted(logp, reverse=True)[budget - 1] if len(logp) >= budget else -np.inf
        # Only a node that beats the budget-th likeliest so far can have a child in the tree.
        level = [i for i in sorted(level, key=lambda i: -logp[i])[:width] if logp[i] > cut]
        if not level or np.exp(logp[level[0]]) < min_prob:
            break  # nothing at this depth is likely enough to be worth a forward of the draft
        n = len(level)
        visible = np.zeros((n, base + cells + n), dtype=bool)
        visible[:, :base] = True
        for r, i in enumerate(level):
            a = parents[i]
            while a >= 0:
                visible[r, base + row_of[a]] = True
                a = parents[a]
            visible[r, base + cells + r] = True
        logits = forward_rows([tokens[i] for i in level], [base + d - 1] * n, visible)
        for r, i in enumerate(level):
            row_of[i] = cells + r
            add_children(over_target(logits[r]), i, d + 1)
        cells += n
    keep = sorted(range(len(tokens)), key=lambda i: (-logp[i], depths[i], i))[:budget]
    index = {node: j for j, node in enumerate(keep)}
    return Draft([tokens[i] for i in keep], None, [index[parents[i]] if parents[i] >= 0 else -1 for i in keep],
                 [float(np.exp(logp[i])) for i in keep])
