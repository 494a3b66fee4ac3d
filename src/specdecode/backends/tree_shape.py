"""The shape of a tree block of drafts, as every backend's tree forward reads it: each node's
depth (its position past the cached length) and the most leading nodes that fit a leaf budget.
Pure functions over parent lists; the forwards are :mod:`.llama_cpp.tree` and :mod:`.torch.tree`."""

from __future__ import annotations

from typing import Sequence


def tree_depths(parents: Sequence[int]) -> list[int]:
    """[N + 1] depths of a tree block's rows (row 0 the root, depth 0; row i + 1 node i, whose
    parent is parents[i]: -1 the root, else an earlier node). A row's position is the cached
    length plus its depth. Raises ValueError for a parent that is not an earlier node."""
    depth = [0]
    for i, p in enumerate(parents):
        if not -1 <= int(p) < i:
            raise ValueError(f"parents[{i}] = {p}: a parent must be -1 or an earlier node")
        depth.append(depth[int(p) + 1] + 1)
    return depth


def tree_prefix_within(parents: Sequence[int], max_leaves: int) -> int:
    """The most leading nodes of a tree (parents in topological order) that form a tree of at
    most max_leaves leaves (a prefix of such a list is always a tree)."""
    children = [0] * len(parents)
    leaves = 0
    for i, p in enumerate(parents):
        leaves += 1 if p < 0 or children[p] else 0  # a child of a leaf takes its place
        if p >= 0:
            children[p] += 1
        if leaves > max_leaves:
            return i
    return len(parents)
