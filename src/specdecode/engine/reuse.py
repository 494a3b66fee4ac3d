"""Cache reuse by shifting: llama.cpp's ``--cache-reuse N`` (``n_cache_reuse``), for editors.

A request that shares its prefix with the slot's last one reads only from the first changed
token (the engine's prefix reuse). What follows the change in the cache may still hold long runs
of the new prompt, further along: an editor's repository context with its oldest file dropped,
a prefix that lost its first lines as the cursor moved down. Such a run of at least N tokens is
moved into place in the KV cache (its positions shifted, the keys' RoPE rotated by the shift)
instead of being computed again, as llama.cpp's server does (tools/server/server-context.cpp,
"reuse chunks from the cached prompt by shifting their KV cache in the new position"):

    head_c = head_p = the common prefix's length
    while both heads are inside their lists:
        n = the tokens from cache[head_c:] that equal prompt[head_p:]
        n >= N: move cache positions [head_c, head_c + n) to head_p (dropping [head_p, head_c));
                both heads += n
        else:   head_c += 1

so chunks move left only (text deleted before them), in order. What comes after the last moved
chunk is evaluated. The moved keys and values were computed after other tokens than the ones now
before them: the answer is close to a fresh evaluation's, not bitwise it (as on llama-server),
which is why reuse is asked for per request (:attr:`specdecode.request.GenerationOptions.cache_reuse`;
the server turns it on for fill-in-the-middle only) and never used for a strict or seeded one.

Units: tokens (positions in one KV sequence).
"""

from __future__ import annotations

from typing import NamedTuple, Sequence


class Chunk(NamedTuple):
    """A run of ``length`` cached tokens at cache position ``cached`` that the prompt holds at
    ``prompt`` (<= cached): shifted by prompt - cached."""

    cached: int
    prompt: int
    length: int


def plan_reuse(cached: Sequence[int], prompt: Sequence[int], n_past: int, min_chunk: int) -> list[Chunk]:
    """llama.cpp's chunk search (module docstring) past the common prefix of n_past tokens.

    cached: the tokens the cache holds, in position order [C]; prompt: the tokens to cache [L];
    n_past: their common prefix's length (<= both); min_chunk: N >= 1, the shortest run worth a
    shift. Returns the chunks in order, each of at least min_chunk tokens."""
    head_c = head_p = n_past
    chunks = []
    while head_c < len(cached) and head_p < len(prompt):
        n = 0
        while head_c + n < len(cached) and head_p + n < len(prompt) and cached[head_c + n] == prompt[head_p + n]:
            n += 1
        if n >= min_chunk:
            chunks.append(Chunk(head_c, head_p, n))
            head_c += n
            head_p += n
        else:
            head_c += 1
    return chunks


def reuse_chunks(backend, seq: int, cached: Sequence[int], prompt: Sequence[int], n_past: int,
                 min_chunk: int) -> tuple[int, int]:
    """Shift the chunks :func:`plan_reuse` finds into place in ``backend``'s sequence seq
    (``backend.shift_cells``) and drop every cached position after them. Returns (tokens of
    prompt now cached: the prefix and the chunks, contiguous; tokens shifted). The caller's
    rollback to the first of them drops the rest. A backend that cannot shift
    (``can_shift`` False) or min_chunk <= 0: (n_past, 0), nothing moved."""
    if min_chunk <= 0 or not backend.can_shift:
        return n_past, 0
    chunks = plan_reuse(cached, prompt, n_past, min_chunk)
    for c in chunks:
        backend.shift_cells(seq, c.cached, c.cached + c.length, c.prompt - c.cached)
    end = chunks[-1].prompt + chunks[-1].length if chunks else n_past
    return end, sum(c.length for c in chunks)
