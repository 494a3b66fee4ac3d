"""Speculative and plain decoding of the same input, side by side in one process: the
speedup each way and the parity report (:meth:`specdecode.api.Decoder.compare`, ``generate
--compare``)."""

from __future__ import annotations

from typing import Any

from ..output import GenerationResult
from ..parity import NEAR_TIE_GAP, parity_report
from ..request import GenerationOptions


def compare(decoder: Any, prompt: str | None = None, **kwargs) -> tuple[GenerationResult, GenerationResult, dict]:
    """Run speculatively and plainly on the same input; returns (speculative, plain, report).

    Plain decoding runs before and after the speculative run (plain, speculative, plain),
    so that load that rises or falls over the comparison weighs on both sides alike. (One
    speculative run, not two: a drafter that learns across requests, suffix drafting,
    would have the answer the second time.) The plain result returned is the first.

    report: speedup (the speculative decode tokens/s over the two plain runs' tokens over
    their seconds), halves (against the plain run before and the one after: their spread
    says how much the machine's load moved the figure), load_changed (True when the halves differ by
    more than 10%, with a warning line in ``note``), and the parity report of
    :func:`specdecode.parity.parity_report` for greedy runs and seeded sampling under the
    gumbel rule (the default with a seed).
    """
    kwargs.pop("plain", None)
    decoder.check_open()
    runs: dict[bool, list[GenerationResult]] = {False: [], True: []}
    for plain in (True, False, True):
        decoder.engine.forget_prefix()  # each run prefills, as it would alone
        runs[plain].append(decoder.generate(prompt, plain=plain, record_top2_gaps=True, **kwargs))
    spec, base = runs[False][0], runs[True][0]
    report: dict = {"speedup": _speedup(runs[False], runs[True]),
                    "halves": [_speedup(runs[False], [runs[True][0]]), _speedup(runs[False], [runs[True][1]])]}
    h = report["halves"]
    report["load_changed"] = bool(h[0] and h[1] and abs(h[0] - h[1]) > 0.1 * max(h))
    if report["load_changed"]:
        report["note"] = (f"the machine's load changed during the comparison: the two halves gave {h[0]}x and "
                          f"{h[1]}x; run it again on a quieter machine for a firm figure")
    given = {k: v for k, v in kwargs.items()
             if k not in ("messages", "prompt_ids", "options", "prediction", "suffix", "extra")}
    sampling = GenerationOptions.from_kwargs(kwargs.get("options"), **given).sampling
    if not (sampling.greedy or sampling.keyed and sampling.seed is not None):
        report["parity"] = {"status": "not applicable: sampling without a seed, or under the rejection rule, "
                                      "compares distributions, not tokens"}
    elif spec.stats.invariant_block and base.stats.invariant_block:
        # Both batch-invariant: every row had a one-token step's logits, so any difference is a bug.
        report["parity"] = parity_report(spec, base, 0.0)
    elif sampling.greedy:
        report["parity"] = parity_report(spec, base)
    else:
        # The same seed gives the same tokens; gaps are of the noisy log-probabilities,
        # so the logit bound of batched numerics scales by 1 / temperature.
        report["parity"] = parity_report(spec, base, NEAR_TIE_GAP / sampling.temperature)
    return spec, base, report


def _speedup(spec: list[GenerationResult], plain: list[GenerationResult]) -> float | None:
    """Decode tokens/s of the speculative runs over the plain runs' (each side's tokens and
    seconds summed); None when a side decoded nothing."""
    def rate(rs: list[GenerationResult]) -> float:
        seconds = sum(r.stats.decode_s for r in rs)
        return sum(r.stats.completion_tokens for r in rs) / seconds if seconds > 0 else 0.0

    base = rate(plain)
    return round(rate(spec) / base, 3) if base > 0 else None
