"""Parity report: compare a speculative greedy run with plain decoding of the same target.

Batched verification and one-token decoding use different kernels, so their logits
differ slightly and the argmax can flip where the two best tokens are nearly tied. Measured
on llama.cpp (benchmarks/results/batched_numerics/, ``python benchmarks/batched_numerics.py``):
beside other sequences or in a block of k tokens, a row's logits differ from the lone
one-token row by up to 2.84 (smollm2) and 1.55 (Qwen2.5-Coder 1.5B), and its top-2 gap by up
to 1.36 and 0.70; a flip was reported at a gap of 1.537 (smollm2, four sequences). A divergence is therefore reported with the plain
run's gap between its two largest logits at the first differing position: a tiny gap
means numerics, a large one means a bug.
"""

from __future__ import annotations

from .output import GenerationResult

# Logits: the measured bound on how far batched numerics move a top-2 gap (1.36, and the
# flip reported at 1.537), rounded up. A difference at a larger gap is a bug, not numerics.
NEAR_TIE_GAP = 1.6


def parity_report(speculative: GenerationResult, plain: GenerationResult, near_tie_gap: float = NEAR_TIE_GAP) -> dict:
    """Compare token ids; classify as "exact", "near-tie" or "divergent".

    plain must have been generated with record_top2_gaps=True. Returns a dict with
    match (bool), status, compared_tokens, and for a difference: first_difference
    (0-based position among generated tokens), plain_token, speculative_token and
    plain_top2_gap (logits; None when the plain run had already ended there).
    """
    a, b = speculative.token_ids, plain.token_ids
    n = min(len(a), len(b))
    j = next((i for i in range(n) if a[i] != b[i]), None)
    if j is None and len(a) == len(b):
        return {"match": True, "status": "exact", "compared_tokens": n}
    if j is None:
        j = n  # one run is a strict prefix of the other (e.g. an end-of-generation token flipped)
    gaps = plain.top2_gaps or []
    gap = gaps[j] if j < len(gaps) else None
    if gap is None and j < len(b):
        raise ValueError("the plain run needs record_top2_gaps=True for a parity report")
    if gap is None:
        # The plain run stopped at j (end-of-generation or cap) where the speculative one went on.
        status = "divergent" if plain.finish_reason == speculative.finish_reason else "near-tie"
    else:
        status = "near-tie" if gap <= near_tie_gap else "divergent"
    return {
        "match": False,
        "status": status,
        "compared_tokens": n,
        "first_difference": j,
        "plain_token": b[j] if j < len(b) else None,
        "speculative_token": a[j] if j < len(a) else None,
        "plain_top2_gap": None if gap is None else round(gap, 4),
    }
