"""Conformance checks every backend must pass (llama.cpp and torch run the same ones)."""

from __future__ import annotations

import numpy as np


def check_forward_rollback_forward(backend, ids, atol: float) -> None:
    """forward, roll back, forward again equals a fresh forward (logits and argmax)."""
    assert len(ids) >= 8
    backend.rollback(0)
    fresh = backend.forward(ids, logits_for=range(len(ids)))  # [N, V]
    assert fresh.shape == (len(ids), backend.n_vocab)
    backend.rollback(0)
    cut = len(ids) // 2
    backend.forward(ids[:cut], logits_for=[])
    wrong = [(t + 7) % backend.n_vocab for t in ids[cut : cut + 4]]
    backend.forward(wrong, logits_for=[0, len(wrong) - 1])
    assert backend.kv_len == cut + len(wrong)
    backend.rollback(cut)
    assert backend.kv_len == cut
    again = backend.forward(ids[cut:], logits_for=range(len(ids) - cut))
    np.testing.assert_allclose(again, fresh[cut:], atol=atol, rtol=0)
    assert (again.argmax(-1) == fresh[cut:].argmax(-1)).all()
    # One token at a time after a rollback reproduces the batched logits too.
    backend.rollback(cut)
    rows = np.stack([backend.forward([t], logits_for=[0])[0] for t in ids[cut:]])
    np.testing.assert_allclose(rows, fresh[cut:], atol=max(atol, 1e-4) * 50, rtol=0)
    backend.rollback(0)


def check_logits_only_where_asked(backend, ids) -> None:
    backend.rollback(0)
    out = backend.forward(ids, logits_for=[1, len(ids) - 1])
    assert out.shape == (2, backend.n_vocab)
    backend.rollback(0)
    assert backend.forward(ids, logits_for=[]).shape == (0, backend.n_vocab)
    assert backend.kv_len == len(ids)
    backend.rollback(0)
