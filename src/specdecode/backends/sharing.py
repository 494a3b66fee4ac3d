"""How a loaded backend and its cache are shared: a backend claimed by one Decoder at a time
(:func:`claim_backends`), and the cached prefix a new generation keeps
(:func:`common_prefix_len`, then ``rollback``)."""

from __future__ import annotations

import weakref
from typing import Sequence

from ..errors import SpecDecodeError
from .base import Backend


def common_prefix_len(cached: Sequence[int], tokens: Sequence[int], limit: int | None = None) -> int:
    """Length of the longest common prefix of two token lists, at most ``limit``: how much of
    a KV cache holding ``cached`` can be kept (``rollback(n)``) for ``tokens``."""
    n, end = 0, min(len(cached), len(tokens), len(tokens) if limit is None else limit)
    while n < end and cached[n] == tokens[n]:
        n += 1
    return n


# Loaded backends a Decoder was given and holds: each holds one sequence's cache of its own.
_IN_USE: "weakref.WeakSet[Backend]" = weakref.WeakSet()


def claim_backends(target, draft) -> list[Backend]:
    """The loaded backends given (target, draft), claimed for this Decoder: one holds one
    sequence's cache, so it serves one Decoder, as target or draft model, not both.
    Raises SpecDecodeError naming the backend otherwise."""
    given = [b for b in (target, draft) if isinstance(b, Backend)]
    if len(given) == 2 and given[0] is given[1]:
        raise SpecDecodeError(f"draft and target are the same backend {target.name}: each holds its own cache, "
                              f"so the draft model needs a backend of its own (wrap the module again)",
                              param="draft")
    for b, param in zip(given, ["target", "draft"] if isinstance(target, Backend) else ["draft"]):
        if b in _IN_USE:
            raise SpecDecodeError(f"{param} {b.name} is in use by another Decoder (a backend holds one "
                                  f"sequence's cache): close that Decoder first, or give this one a backend of "
                                  f"its own (ModuleBackend over the same module)", param=param)
    _IN_USE.update(given)
    return given


def release_backends(backends) -> None:
    """Free backends claimed by :func:`claim_backends` (a Decoder closed or failed to start)."""
    _IN_USE.difference_update(backends)
