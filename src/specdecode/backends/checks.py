"""Checks of what a backend gives back: a step's logits row that is not finite names the model."""

from __future__ import annotations

import numpy as np

from ..errors import ModelFileError
from .base import Backend


def check_finite_logits(target: Backend, row: np.ndarray) -> None:
    """One row of a step's logits [V] (one pass, ~20 us for 150k): a NaN, a +inf, or -inf
    for every token (-inf outside an output subset is fine) means corrupt weights, named
    here rather than sampled from (a NaN row's argmax is token 0; sampling it fails with a
    zero-mass distribution). The step's last row is the one to check: in a causal model a
    NaN at one position reaches every later one through attention. Raises ModelFileError
    naming the model."""
    if not np.isfinite(row.max()):
        raise ModelFileError(f"model {target.name} gave non-finite logits (NaN or infinity): its weights are corrupt, "
                             "or the file is not the model it claims to be")
