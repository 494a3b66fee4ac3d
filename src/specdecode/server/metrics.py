"""Prometheus metrics of one server: counters and histograms in their own registry."""

from __future__ import annotations

from typing import Any, Callable, Sequence

# Histogram buckets, in seconds.
TTFT_BUCKETS = (0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0)
TPOT_BUCKETS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5)
LATENCY_BUCKETS = (0.01, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0, 160.0, 320.0)


class Metrics:
    """Prometheus counters and histograms of one server, in their own registry.

    Names follow vLLM's and llama.cpp server's style (``specdecode:...``). Counts cover
    requests that finished; a cancelled request (client gone, or a stream its client left
    more than max_unread_bytes unread) counts only in request_aborted_total.
    request_rejected_total counts requests refused before any generation, by reason:
    forbidden (a Host or Origin refused), unauthorized (missing or wrong API key),
    unsupported_media_type (a body not sent as JSON), too_large (body over the limit),
    body_timeout (a body that did not arrive in time), invalid_request, model_not_found,
    queue_full. queue_len, running: read at every scrape for the num_requests_waiting /
    num_requests_running gauges.
    """

    def __init__(self, queue_len: Callable[[], int], running: Callable[[], int]) -> None:
        # Imported here, like FastAPI, so that other CLI commands start without it.
        from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

        r = self.registry = CollectorRegistry(auto_describe=True)
        p = "specdecode:"
        self.num_drafts = Counter(p + "num_drafts", "Decode steps that drafted at least one token.", registry=r)
        self.num_draft_tokens = Counter(p + "num_draft_tokens", "Drafted tokens sent to verification.", registry=r)
        self.num_accepted_tokens = Counter(p + "num_accepted_tokens", "Drafted tokens accepted and kept.", registry=r)
        self.accepted_per_pos = Counter(p + "num_accepted_tokens_per_pos", "Accepted drafts by draft position (0-based).",
                                        ["position"], registry=r)
        self.drafted_per_pos = Counter(p + "num_draft_tokens_per_pos", "Drafted tokens by draft position (0-based).",
                                       ["position"], registry=r)
        self.target_passes = Counter(p + "num_target_forward_passes", "Target forward passes in decode.", registry=r)
        self.success = Counter(p + "request_success", "Finished requests by finish reason (a request with n choices "
                               "counts once per choice).", ["finished_reason"], registry=r)
        self.aborted = Counter(p + "request_aborted", "Requests cancelled because the client disconnected.", registry=r)
        self.rejected = Counter(p + "request_rejected", "Requests refused before generation, by reason.", ["reason"],
                                registry=r)
        self.prompt_tokens = Counter(p + "prompt_tokens", "Prompt tokens of finished requests.", registry=r)
        self.prompt_tokens_cached = Counter(p + "prompt_tokens_cached", "Prompt tokens of finished requests that a "
                                            "slot's cache held (not evaluated again).", registry=r)
        self.generation_tokens = Counter(p + "generation_tokens", "Generated tokens of finished requests.", registry=r)
        self.ttft = Histogram(p + "time_to_first_token_seconds", "Arrival to first text delta, queueing included.",
                              buckets=TTFT_BUCKETS, registry=r)
        self.tpot = Histogram(p + "time_per_output_token_seconds",
                              "Per request: (last - first token time) / (completion tokens - 1).",
                              buckets=TPOT_BUCKETS, registry=r)
        self.e2e = Histogram(p + "e2e_request_latency_seconds", "Arrival to the last token.",
                             buckets=LATENCY_BUCKETS, registry=r)
        self.queue_time = Histogram(p + "request_queue_time_seconds", "Arrival to the start of generation.",
                                    buckets=LATENCY_BUCKETS, registry=r)
        Gauge(p + "num_requests_waiting", "Requests waiting in the queue.", registry=r).set_function(queue_len)
        Gauge(p + "num_requests_running", "Requests being generated (0..slots).", registry=r).set_function(running)

    def record(self, results: Sequence[Any], arrival: float, first: float, end: float) -> None:
        """Count one finished request: its choices' GenerationResults (n of them, generated
        one after another).

        Per choice: the drafting counters, request_success (by the choice's finish reason:
        a request with n choices counts n) and generation_tokens. Per request: prompt_tokens
        (once, as the usage does) and prompt_tokens_cached (the first choice's cached prefix), the time to first token, the time per output token over
        all choices, and the end-to-end latency. arrival, first, end: time.perf_counter()
        seconds at the request's arrival, its first token and its last token.
        """
        for result in results:
            s = result.stats
            self.num_drafts.inc(sum(v for k, v in s.k_histogram.items() if int(k) > 0))
            self.num_draft_tokens.inc(s.drafted)
            self.num_accepted_tokens.inc(s.accepted)
            for i, n in enumerate(s.accepted_per_position):
                self.accepted_per_pos.labels(position=str(i)).inc(n)
            for i, n in enumerate(s.drafted_per_position):
                self.drafted_per_pos.labels(position=str(i)).inc(n)
            self.target_passes.inc(s.target_forward_passes)
            self.success.labels(finished_reason=result.finish_reason).inc()
            self.generation_tokens.inc(s.completion_tokens)
        self.prompt_tokens.inc(results[0].stats.prompt_tokens)
        self.prompt_tokens_cached.inc(results[0].stats.prompt_cached or 0)
        completion = sum(r.stats.completion_tokens for r in results)
        self.ttft.observe(first - arrival)
        if completion > 1:
            self.tpot.observe((end - first) / (completion - 1))
        self.e2e.observe(end - arrival)

    def render(self) -> bytes:
        """The Prometheus text exposition (format 0.0.4)."""
        from prometheus_client import generate_latest

        return generate_latest(self.registry)
