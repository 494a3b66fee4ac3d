"""The backend protocol: what the engine and drafters need from one loaded model.

Dimension letters: N = tokens in one forward call, M = positions whose logits are
requested, V = vocabulary size.

KV-cache discipline: a backend holds one sequence. ``forward`` appends tokens at
positions ``kv_len .. kv_len+N-1``; ``rollback(n)`` drops every cached position >= n so
that the next ``forward`` continues from position n. Rollback is the one named call
for rejecting drafted tokens (as llama.cpp's ``llama_memory_seq_rm``), and for reusing a
cached prefix across generations (:func:`common_prefix_len`).

Optional abilities are declared, not probed: ``supports_greedy_draft`` (a whole greedy
draft on the device, :meth:`Backend.greedy_draft`) and ``supports_output_subset()``
(logits for a subset of the vocabulary, :meth:`Backend.set_output_subset`).
"""

from __future__ import annotations

from pathlib import Path
from typing import Protocol, Sequence, runtime_checkable

import numpy as np

from ..errors import ContextOverflowError, SpecDecodeError


def common_prefix_len(cached: Sequence[int], tokens: Sequence[int], limit: int | None = None) -> int:
    """Length of the longest common prefix of two token lists, at most ``limit``: how much of
    a KV cache holding ``cached`` can be kept (``rollback(n)``) for ``tokens``."""
    n, end = 0, min(len(cached), len(tokens), len(tokens) if limit is None else limit)
    while n < end and cached[n] == tokens[n]:
        n += 1
    return n


@runtime_checkable
class Backend(Protocol):
    """One loaded model with a single-sequence KV cache."""

    name: str  # human-readable model name (file or registry name)
    path: Path | None  # the model file or folder, when loaded from one
    n_threads: int | None  # CPU threads, where the backend has a setting
    device: str  # where the weights live ("cpu", "cuda")
    supports_greedy_draft: bool  # greedy_draft() runs a whole greedy draft on the device

    @property
    def cost_key(self) -> str:
        """What a measured latency depends on beyond the file (e.g. dtype); "" if nothing."""

    @property
    def n_vocab(self) -> int:
        """Vocabulary size V (rows of the output logits)."""

    @property
    def n_ctx(self) -> int:
        """Context window in tokens: kv_len can never exceed it."""

    @property
    def kv_len(self) -> int:
        """Number of positions currently held in the KV cache."""

    @property
    def eog_ids(self) -> frozenset[int]:
        """Token ids that end generation (end-of-sequence, end-of-turn)."""

    def tokenize(self, text: str, add_special: bool = True, parse_special: bool = False) -> list[int]:
        """Text -> token ids; add_special prepends BOS where the model wants it."""

    def token_bytes(self, token_id: int) -> bytes:
        """The UTF-8 bytes a token contributes to the output text (b"" for control tokens)."""

    def token_text(self, token_id: int) -> bytes:
        """The token's vocabulary entry as bytes, control tokens included (for compatibility checks)."""

    def apply_chat_template(self, messages: Sequence[dict]) -> str:
        """Render OpenAI-style messages with the model's own chat template, generation prompt added."""

    def forward(self, token_ids: Sequence[int], logits_for: Sequence[int]) -> np.ndarray:
        """Append token_ids [N] to the cache and return logits [M, V] (float32).

        logits_for: [M] indices into token_ids (0..N-1, ascending) whose next-token logits
        are wanted; M may be 0. Raises ContextOverflowError when kv_len + N > n_ctx.
        """

    def rollback(self, n: int) -> None:
        """Drop cached positions >= n (0 <= n <= kv_len)."""

    def close(self) -> None:
        """Free the model and its context."""

    def greedy_draft(self, token_ids: Sequence[int], k: int) -> list[int]:
        """Feed token_ids [N], then draft k tokens greedily; returns the k ids (only where
        supports_greedy_draft). The cache then holds token_ids and the first k-1 drafts."""

    def supports_output_subset(self) -> bool:
        """Whether set_output_subset can restrict the logits to some token ids."""

    def set_output_subset(self, ids: Sequence[int] | None) -> None:
        """Compute logits only for ids (others -inf); None restores the whole vocabulary."""


class BackendBase:
    """Shared state, argument checks and the default (absent) optional abilities of the
    concrete backends (subclasses set _n_vocab, _n_ctx, _kv_len, _eog and name)."""

    name: str
    path: Path | None = None
    n_threads: int | None = None
    device: str = "cpu"
    supports_greedy_draft = False
    _n_vocab: int
    _n_ctx: int
    _kv_len: int
    _eog: frozenset[int]

    @property
    def n_vocab(self) -> int:
        return self._n_vocab

    @property
    def n_ctx(self) -> int:
        return self._n_ctx

    @property
    def kv_len(self) -> int:
        return self._kv_len

    @property
    def eog_ids(self) -> frozenset[int]:
        return self._eog

    @property
    def cost_key(self) -> str:
        return ""

    def greedy_draft(self, token_ids: Sequence[int], k: int) -> list[int]:
        raise RuntimeError(f"{type(self).__name__} drafts token by token (supports_greedy_draft is False)")

    def supports_output_subset(self) -> bool:
        return False

    def set_output_subset(self, ids: Sequence[int] | None) -> None:
        raise SpecDecodeError(f"{self.name} on {type(self).__name__} cannot restrict its output to a vocabulary subset")

    def _check_forward(self, tokens: Sequence[int], logits_for: Sequence[int]) -> list[int]:
        """Validate a forward call; returns the requested rows, sorted and unique.

        Raises ValueError for rows outside the tokens, ContextOverflowError when the tokens
        do not fit, SpecDecodeError for ids outside the vocabulary.
        """
        n = len(tokens)
        want = sorted(set(int(i) for i in logits_for))
        if want and (want[0] < 0 or want[-1] >= n):
            raise ValueError(f"logits_for {want} out of range for {n} tokens")
        if self._kv_len + n > self._n_ctx:
            raise ContextOverflowError(
                f"{self.name}: {self._kv_len} cached + {n} new tokens exceed the context of {self._n_ctx} tokens"
            )
        bad = [t for t in tokens if not (0 <= t < self._n_vocab)]
        if bad:
            raise SpecDecodeError(f"token id {bad[0]} is outside the vocabulary of {self.name} ({self._n_vocab})")
        return want

    def _check_rollback(self, n: int) -> bool:
        """Validate a rollback to n; True when there is anything to drop."""
        if not (0 <= n <= self._kv_len):
            raise ValueError(f"rollback to {n} outside 0..{self._kv_len}")
        return n < self._kv_len
