"""Tree verification on the torch backend: a tree of candidates in one forward, with a tree
attention mask and tree position ids, and the accepted path's KV compacted in place.

The block is the root (the last committed token) and the tree's nodes, flattened in
topological order: row 0 the root, row i + 1 node i (``verify.py`` names the layout).
Row r attends to the whole cached prefix and to its ancestors and itself (SpecInfer, Miao
et al. 2024, Sec. 4.2, tree attention; Medusa's tree mask); its position id is the cached
length plus its depth, so each row sees exactly what a chain along its path would.
The rows' keys and values land in the static cache in row order; :func:`keep_rows` then
moves the kept rows (the root and the accepted path) to the front of the block and drops
the rest, so that the cache holds exactly the committed tokens, as after a chain.

Dimension letters: N = rows (1 + nodes), V = vocabulary, C = cached tokens before the block.
"""

from __future__ import annotations

from typing import Sequence

import numpy as np

from ..tree_shape import tree_depths


def tree_layout(parents: Sequence[int]) -> tuple[np.ndarray, np.ndarray]:
    """(depth [N], ancestor-or-self matrix [N, N] bool) of the rows of a tree whose nodes
    have ``parents`` (-1: the root's child). Raises ValueError for a parent after its child."""
    depth = np.array(tree_depths(parents), dtype=np.int64)
    n = len(depth)
    anc = np.eye(n, dtype=bool)
    for r in range(1, n):
        anc[r] |= anc[int(parents[r - 1]) + 1]
    return depth, anc


def forward_tree(backend, token_ids: Sequence[int], parents: Sequence[int], hidden: bool = False):
    """Append the block token_ids [N] (root, then the nodes) to the torch backend's cache and
    return the logits [N, V] (float32, host) of every row under the tree mask, and with
    hidden the final hidden states [N, H] (a device tensor; else None)."""
    depth, anc = tree_layout(parents)
    n, start = len(token_ids), backend._kv_len
    if len(parents) + 1 != n:
        raise ValueError(f"a block of {n} tokens is a root and {n - 1} nodes, got {len(parents)} parents")
    visible = np.ones((n, start + n), dtype=bool)
    visible[:, start:] = anc
    return forward_rows(backend, token_ids, depth + start, visible, hidden)


def forward_rows(backend, token_ids: Sequence[int], positions: Sequence[int], visible: np.ndarray,
                 hidden: bool = False):
    """Append token_ids [n] to the cache at position ids ``positions`` [n], row r attending
    to the cache cells where ``visible[r]`` (bool [n, C + n]: the C cached cells, then the
    block's own); returns (logits [n, V] float32 on the host, hidden [n, H] on the device or
    None). A tree drafter grows its tree with it a depth at a time (each row sees the prefix,
    its ancestors' cells and itself). Raises ValueError for a mask of the wrong shape."""
    torch = backend._torch
    n, start = len(token_ids), backend._kv_len
    if visible.shape != (n, start + n):
        raise ValueError(f"a mask of shape {visible.shape} for {n} rows after {start} cached cells")
    backend._check_forward([int(t) for t in token_ids], list(range(n)), 0)
    dev = backend.device
    dtype = next(backend.model.parameters()).dtype
    mask = torch.zeros(1, 1, n, start + n, dtype=dtype, device=dev)
    mask.masked_fill_(~torch.from_numpy(np.ascontiguousarray(visible)).to(dev)[None, None], torch.finfo(dtype).min)
    pos = torch.tensor([list(map(int, positions))], dtype=torch.long, device=dev)
    kwargs = dict(input_ids=torch.tensor([list(map(int, token_ids))], dtype=torch.long, device=dev),
                  position_ids=pos, cache_position=torch.arange(start, start + n, device=dev),
                  attention_mask=mask, cache=backend._cache, use_cache=True)
    with torch.inference_mode():
        if hidden:  # as the model's own forward: the decoder, then the output projection
            h = backend.model.get_decoder()(**kwargs).last_hidden_state[0]
            logits = backend.model.get_output_embeddings()(h)
        else:
            h, logits = None, backend.model(**kwargs).logits[0]
    backend._kv_len += n
    return logits.float().cpu().numpy(), h


def keep_rows(backend, rows: Sequence[int], n_rows: int) -> None:
    """After :func:`forward_tree` of n_rows rows: keep ``rows`` (ascending block indices, the
    root first) at the front of the block, in that order, and drop the other rows' KV."""
    torch = backend._torch
    start = backend._kv_len - n_rows
    if not 0 <= start or any(not 0 <= r < n_rows for r in rows) or list(rows) != sorted(set(rows)):
        raise ValueError(f"rows {list(rows)} are not ascending rows of the last block of {n_rows}")
    src = torch.tensor([start + r for r in rows], dtype=torch.long, device=backend.device)
    dst = torch.arange(start, start + len(rows), device=backend.device)
    with torch.inference_mode():
        for layer in backend._cache.layers:
            if getattr(layer, "is_initialized", False):
                layer.keys.index_copy_(2, dst, layer.keys.index_select(2, src))
                layer.values.index_copy_(2, dst, layer.values.index_select(2, src))
    backend.rollback(start + len(rows))
