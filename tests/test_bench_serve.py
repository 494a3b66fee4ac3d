"""bench-serve's figures from what clients saw (scripted records, no server): time to first
token, time per output token and the inter-token gaps (issue 47, item 4), and the table."""

from __future__ import annotations

import io

import pytest

from specdecode.bench.serve import RequestRecord, summarize
from specdecode.bench.serve_report import markdown, print_table


def record(pid: str, sent: float, arrivals: list[float], tokens: int, error: str | None = None) -> RequestRecord:
    return RequestRecord(pid, sent, arrivals[0] if arrivals else None, (arrivals or [sent])[-1], tokens,
                         [], [], {"drafted": 4, "accepted": 3}, error, arrivals)


def test_inter_token_gaps_are_the_waits_between_text_chunks():
    steady = record("a", 0.0, [0.5 + 0.1 * i for i in range(11)], 11)  # ten gaps of 0.1 s
    stalled = record("b", 0.0, [0.4, 0.5, 3.5, 3.6], 4)  # one gap of 3 s: a neighbour's prefill
    assert stalled.gaps_s == pytest.approx([0.1, 3.0, 0.1])
    s = summarize([steady, stalled, record("c", 0.0, [], 0, error="HTTP 503")])
    assert s["errors"] == 1 and s["requests"] == 3
    assert s["itl_p50_s"] == pytest.approx(0.1) and s["itl_max_s"] == pytest.approx(3.0)
    assert 0.1 < s["itl_p99_s"] <= 3.0  # 13 gaps: the 3 s one weighs in the 99th percentile
    assert s["ttft_max_s"] == pytest.approx(0.5)
    one = summarize([record("d", 0.0, [0.2], 1)])  # a single chunk: no gap
    assert one["itl_p50_s"] is None and one["itl_max_s"] is None


def test_the_table_names_the_gaps():
    result = {"prompts": 2, "config": {"max_tokens": 8},
              "servers": {"1 slot": {1: summarize([record("a", 0.0, [0.5, 0.6, 0.9], 3)])}}}
    out = io.StringIO()
    print_table(result, out)
    assert "ITL p50" in out.getvalue() and "ITL max" in out.getvalue()
    assert "| ITL p99 |" in markdown(result) and "0.300" in markdown(result)


def test_long_prompts_are_long_and_share_no_prefix():
    from specdecode.bench.serve import long_prompts
    from specdecode.bench.suite import load_prompts

    gen = long_prompts(load_prompts(None)[:3], 3000)
    a, b = next(gen), next(gen)
    assert len(a.prompt) >= 4 * 3000 and a.prompt != b.prompt and a.prompt[:12] != b.prompt[:12]
    assert a.messages is None and a.max_tokens == 8 and a.category == "long"


def test_the_long_prompts_get_rows_of_their_own():
    short = summarize([record("a", 0.0, [0.5, 0.6, 0.9], 3)])
    result = {"prompts": 1, "config": {"max_tokens": 8}, "servers": {"8 slots": {1: short}},
              "long": {"8 slots": {1: summarize([record("long-3000", 0.0, [60.0, 60.1], 2)])}}}
    out = io.StringIO()
    print_table(result, out)
    assert "8 slots, long prompts" in out.getvalue() and "beside 1" in out.getvalue() and "60.000" in out.getvalue()
