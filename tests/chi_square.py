"""The pooled chi-square test the sampling tests share: observed outcomes against exact
probabilities, cells expected fewer than 5 times pooled with what the expectation leaves out."""

from __future__ import annotations

import numpy as np
from scipy import stats as sstats


def pooled_p(counts: dict, expected: dict, n: int) -> float:
    """p-value of ``counts`` (outcome -> times seen, n draws) against ``expected`` (outcome ->
    probability): cells with p * n >= 5 apart, the rest, outcomes not listed and the mass the
    listing misses pooled into one cell."""
    obs, exp, rest_o, rest_e = [], [], 0.0, 0.0
    for key, p in expected.items():
        if p * n >= 5:
            obs.append(counts.get(key, 0))
            exp.append(p * n)
        else:
            rest_o += counts.get(key, 0)
            rest_e += p * n
    obs.append(rest_o + sum(v for k, v in counts.items() if k not in expected))
    exp.append(max(rest_e, 1e-9) + max(0.0, n - sum(expected.values()) * n))
    return sstats.chisquare(obs, np.array(exp) * sum(obs) / sum(exp)).pvalue
