"""Tree verification on llama.cpp: a tree of candidates in one ``llama_decode`` through
sequence ids, as llama.cpp's own ``examples/speculative`` does with ``n_seq_dft``.

Sequence ids: the backend's context holds ``n_seq`` generation sequences (slots 0..n_seq-1)
and, when loaded with ``tree_branches`` (TREE_BRANCHES where trees are asked for), that many
branch sequences after them (n_seq..n_seq+tree_branches-1), shared by
every slot: a tree step uses them only within its own call and clears them before it ends
(the engine verifies trees only for a generation alone in its step). For a tree of m leaves
the generation's cached prefix is shared into branch sequences n_seq..n_seq+m-1
(``llama_memory_seq_cp``: in the unified cache, the same cells gain the branch ids), and each
row of the block (row 0 the root, the last committed token; row i + 1 node i) goes in with
the ids of the branches through it, at position prefix + depth: llama.cpp's causal mask per
sequence then lets each row see exactly its ancestors. :func:`keep_rows` copies the root and
the accepted path from a branch that holds them into the generation's sequence and removes
every branch sequence, so that the cache holds exactly the committed tokens.

Dimension letters: N = rows (1 + nodes), V = vocabulary.
"""

from __future__ import annotations

from typing import Sequence

import numpy as np

from ...errors import SpecDecodeError
from ..tree_shape import tree_depths

TREE_BRANCHES = 8  # leaves a tree may have (branch sequences a context is given for trees)


def _leaves_under(parents: Sequence[int]) -> list[list[int]]:
    """[N] for each row (0 the root), the leaf indices (0..m-1, in node order) below or at it."""
    n = len(parents)
    has_child = [False] * n
    for p in parents:
        if p >= 0:
            has_child[p] = True
    leaves = [i for i in range(n) if not has_child[i]]
    under: list[list[int]] = [[] for _ in range(n + 1)]
    for j, leaf in enumerate(leaves):
        node = leaf
        while node >= 0:
            under[node + 1].append(j)
            node = parents[node]
        under[0].append(j)
    return under


def forward_tree(backend, token_ids: Sequence[int], parents: Sequence[int], seq: int, hidden: bool = False):
    """Append the block token_ids [N] (root, then nodes) for sequence seq into branch
    sequences and return the logits [N, V] (float32) of every row and, with hidden, their
    hidden states [N, H] (else None). Raises SpecDecodeError for more leaves than
    TREE_BRANCHES or a block over one batch."""
    lib, mem, b = backend._lib, backend._mem, backend._batch
    n = len(token_ids)
    if len(parents) + 1 != n:
        raise ValueError(f"a block of {n} tokens is a root and {n - 1} nodes, got {len(parents)} parents")
    under = _leaves_under(parents)
    m = len(under[0])
    if m > backend._tree_branches or n > min(backend._n_batch, backend._rows_max):
        raise SpecDecodeError(f"{backend.name}: a tree of {m} leaves and {n} rows does not fit (at most "
                              f"{backend._tree_branches} leaves and {min(backend._n_batch, backend._rows_max)} rows)")
    backend._check_forward([int(t) for t in token_ids], list(range(n)), seq)
    base = backend._seq_lens[seq]
    first = backend.n_seq  # the first branch sequence
    depth = tree_depths(parents)
    clear_branches(backend)  # a tree block that was rolled back rather than kept leaves its branches
    for j in range(m):
        lib.llama_memory_seq_cp(mem, seq, first + j, -1, -1)
    for r in range(n):
        b.token[r] = int(token_ids[r])
        b.pos[r] = base + depth[r]
        b.n_seq_id[r] = len(under[r])
        for k, leaf in enumerate(under[r]):
            b.seq_id[r][k] = first + leaf
        b.logits[r] = True
    b.n_tokens = n
    if backend._embeddings != hidden:
        lib.llama_set_embeddings(backend._ctx, hidden)
        backend._embeddings = hidden
    rc = lib.llama_decode(backend._ctx, b)
    if rc != 0:
        clear_branches(backend)
        raise SpecDecodeError(f"{backend.name}: llama_decode of a tree failed with code {rc}")
    out = np.empty((n, backend._n_vocab), dtype=np.float32)
    h = np.empty((n, backend._n_embd), dtype=np.float32) if hidden else None
    for r in range(n):
        out[r] = np.ctypeslib.as_array(lib.llama_get_logits_ith(backend._ctx, r), shape=(backend._n_vocab,))
        if hidden:
            h[r] = np.ctypeslib.as_array(lib.llama_get_embeddings_ith(backend._ctx, r), shape=(backend._n_embd,))
    backend._tree = (seq, base, list(parents), under)
    return out, h


def keep_rows(backend, rows: Sequence[int], n_rows: int, seq: int) -> None:
    """After :func:`forward_tree`: the root and the accepted path (rows, ascending, root
    first, a path of the tree) into sequence seq; every branch sequence removed."""
    tree = getattr(backend, "_tree", None)
    if tree is None or tree[0] != seq or len(tree[2]) + 1 != n_rows:
        raise ValueError(f"no tree block of {n_rows} rows on sequence {seq} to keep rows of")
    _, base, parents, under = tree
    if list(rows[:1]) != [0] or any(parents[rows[i + 1] - 1] + 1 != rows[i] for i in range(len(rows) - 1)):
        raise ValueError(f"rows {list(rows)} are not the root and a path of the tree")
    leaf = under[rows[-1]][0]  # a branch through the path's end holds every row of the path
    backend._lib.llama_memory_seq_cp(backend._mem, backend.n_seq + leaf, seq, base, base + len(rows))
    backend._seq_lens[seq] = base + len(rows)
    clear_branches(backend)


def clear_branches(backend) -> None:
    """Remove every branch sequence's cells (the generation sequences keep theirs)."""
    for j in range(backend._tree_branches):
        backend._lib.llama_memory_seq_rm(backend._mem, backend.n_seq + j, -1, -1)
    backend._tree = None
