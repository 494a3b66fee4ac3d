"""The formula of Medusa-1 residual draft heads, shared by the backends' ``make_heads`` and by
training (:mod:`specdecode.heads.train`)."""

from __future__ import annotations

from typing import Callable


def residual_heads(h, weight, bias, w_out, b_out, einsum: Callable, silu: Callable):
    """Medusa-1 residual heads (:mod:`specdecode.drafters.heads`), the one formula of every
    place that runs them (the backends' :meth:`Backend.make_heads`, training), on numpy
    arrays or torch tensors alike (einsum and silu of that library)::

        z_k = h + SiLU(W_k h + b_k),    logits_k = W_out[S] z_k + b_out[S]

    h [..., H]; weight [K, H, H]; bias [K, H]; w_out [S, H] (the output projection's rows
    of the vocabulary subset S); b_out [S] or None (its bias, where the model has one).
    Returns the subset's logits [..., K, S].
    """
    z = h[..., None, :] + silu(einsum("kij,...j->...ki", weight, h) + bias)  # [..., K, H]
    logits = z @ w_out.T
    return logits if b_out is None else logits + b_out
