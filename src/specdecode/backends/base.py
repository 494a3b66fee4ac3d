"""The backend protocol: what the engine and drafters need from one loaded model.

Dimension letters: N = tokens in one forward call, M = positions whose logits are
requested, V = vocabulary size.

KV-cache discipline: a backend holds one sequence. ``forward`` appends tokens at
positions ``kv_len .. kv_len+N-1``; ``rollback(n)`` drops every cached position >= n so
that the next ``forward`` continues from position n. Rollback is the one named call
for rejecting drafted tokens (as llama.cpp's ``llama_memory_seq_rm``).
"""

from __future__ import annotations

from typing import Protocol, Sequence, runtime_checkable

import numpy as np


@runtime_checkable
class Backend(Protocol):
    """One loaded model with a single-sequence KV cache."""

    name: str  # human-readable model name (file or registry name)

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
