"""OpenAI-compatible HTTP server: ``specdecode serve``.

Endpoints: POST /v1/completions, POST /v1/chat/completions, GET /v1/models,
GET /health, GET /metrics (Prometheus text format).

One loaded model pair serves every request. The engine is not thread-safe, so a single
worker thread runs generations one at a time in arrival order; text deltas travel to the
asyncio side through a per-request queue. Requests wait in a bounded queue
(``max_queue`` waiting, besides the one running); a full queue answers 429. A client
that disconnects cancels its request: a waiting one leaves the queue at once, a running
one has its generator closed after the current step, which rolls the caches back.

Request fields honoured (a field whose value is null counts as absent):
    model (required; must be the served model's id), prompt (completions: one string) or
    messages (chat: role system/user/assistant, content a string or a list of text
    parts), max_tokens / max_completion_tokens, temperature (0..2), top_p, top_k, min_p,
    repetition_penalty, presence_penalty, frequency_penalty (engine semantics: over the
    last 64 tokens, prompt included, as llama.cpp's repeat_last_n), seed, stop (string
    or list), stream, stream_options.include_usage, logprobs (completions: integer
    0..20; chat: boolean with top_logprobs 0..20), n (only 1).
Accepted and ignored: user. Accepted only at their default (no effect): echo = false,
best_of = 1, logit_bias = {}, response_format = {"type": "text"}, tools = [].
Any other field answers 400 naming it.

Defaults: max_tokens 16 for completions (as OpenAI), the rest of the context for chat.
prompt tokens + max_tokens must fit in the context (400 otherwise, code
context_length_exceeded).

Every response carries ``speculation``: the generation's statistics
(:meth:`specdecode.stats.Stats.to_dict`: drafted, accepted, acceptance_rate,
mean_accepted_length, per-position counts, timings) plus the draft and K. In a stream it
rides on the chunk with the finish_reason (and on the usage chunk when
stream_options.include_usage is set); with logprobs, a stream sends all of them on that
final chunk, because the engine streams text, not tokens.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import math
import re
import threading
import time
import uuid
from collections import deque
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, AsyncIterator, Callable

from jinja2 import TemplateError

from .errors import ContextOverflowError, SpecDecodeError
from .sampling import SamplingParams

if TYPE_CHECKING:  # imported where used, so that other CLI commands start without FastAPI
    from fastapi import FastAPI, Request
    from fastapi.responses import JSONResponse, Response

DEFAULT_MAX_QUEUE = 16
DEFAULT_COMPLETION_MAX_TOKENS = 16
MAX_LOGPROBS = 20
MAX_TEMPERATURE = 2.0
CHAT_ROLES = ("system", "user", "assistant")

_COMMON_FIELDS = frozenset({
    "model", "max_tokens", "max_completion_tokens", "temperature", "top_p", "top_k", "min_p",
    "repetition_penalty", "presence_penalty", "frequency_penalty", "seed", "stop", "stream",
    "stream_options", "logprobs", "n", "user",
})
_COMPLETION_FIELDS = _COMMON_FIELDS | {"prompt"}
_CHAT_FIELDS = _COMMON_FIELDS | {"messages", "top_logprobs"}
# Standard fields accepted only at the value that asks for nothing beyond what is served.
_HARMLESS_DEFAULTS: dict[str, Any] = {
    "echo": False, "best_of": 1, "logit_bias": {}, "response_format": {"type": "text"}, "tools": [],
}

TTFT_BUCKETS = (0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0)
TPOT_BUCKETS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5)
LATENCY_BUCKETS = (0.01, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0, 160.0, 320.0)


class APIError(Exception):
    """An error answered to the client with an OpenAI-style body.

    status: HTTP status. type/param/code: the fields of ``{"error": {...}}``.
    """

    def __init__(self, status: int, message: str, type: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type
        self.param = param
        self.code = code

    def body(self) -> dict:
        """The OpenAI error object: {"error": {"message", "type", "param", "code"}}."""
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}

    def response(self) -> JSONResponse:
        """This error as a JSON response (429 also says when to retry)."""
        from fastapi.responses import JSONResponse

        headers = {"Retry-After": "1"} if self.status == 429 else None
        return JSONResponse(self.body(), status_code=self.status, headers=headers)


def _from_specdecode_error(e: SpecDecodeError, param: str | None = None) -> APIError:
    """A SpecDecodeError is the client's mistake here: 400 with its message; the field is
    read from messages of the form "name = value is out of range", else ``param``."""
    m = re.match(r"(\w+) = ", str(e))
    if isinstance(e, ContextOverflowError):
        return APIError(400, str(e), param=param, code="context_length_exceeded")
    return APIError(400, str(e), param=m.group(1) if m else param)


# ---------------------------------------------------------------- request parsing


@dataclass
class GenRequest:
    """A validated generation request.

    kind: "completion" or "chat". prompt / messages: exactly one is set.
    max_tokens: None means the endpoint's default. sampling: keyword arguments of
    :meth:`Decoder.stream` other than the prompt and max_tokens.
    logprobs: None, or N most likely tokens to report per emitted token.
    """

    kind: str
    prompt: str | None
    messages: list[dict] | None
    max_tokens: int | None
    sampling: dict
    stream: bool = False
    include_usage: bool = False
    logprobs: int | None = None


def _json_repr(value: Any) -> str:
    text = json.dumps(value)
    return text if len(text) <= 60 else text[:57] + "..."


class _Body:
    """Typed access to a request body's fields; every failure is a 400 naming the field."""

    def __init__(self, body: dict, prefix: str = "") -> None:
        self.body = body
        self.prefix = prefix

    def get(self, name: str) -> Any:
        return self.body.get(name)

    def _typed(self, name: str, ok, kind: str) -> Any:
        """The field's value (None when absent or null) after ``ok(value)`` holds; else a 400
        saying it must be ``kind``."""
        v = self.body.get(name)
        if v is not None and not ok(v):
            full = self.prefix + name
            raise APIError(400, f"{full} must be {kind}, got {_json_repr(v)}", param=full)
        return v

    def integer(self, name: str, lo: int | None = None, hi: int | None = None, why: str = "") -> int | None:
        v = self._typed(name, lambda x: isinstance(x, int) and not isinstance(x, bool), "an integer")
        if v is not None and ((lo is not None and v < lo) or (hi is not None and v > hi)):
            name = self.prefix + name
            lo_s = f"{lo} <= " if lo is not None else ""
            hi_s = f" <= {hi}" if hi is not None else ""
            raise APIError(400, f"{name} = {v} is out of range: expected {lo_s}{name}{hi_s}{why}", param=name)
        return v

    def number(self, name: str) -> float | None:
        v = self._typed(name, lambda x: isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x),
                        "a number")
        return None if v is None else float(v)

    def boolean(self, name: str) -> bool | None:
        return self._typed(name, lambda x: isinstance(x, bool), "a boolean")

    def string(self, name: str) -> str | None:
        return self._typed(name, lambda x: isinstance(x, str), "a string")


def _check_fields(body: dict, allowed: frozenset[str]) -> None:
    unknown = []
    for name, value in body.items():
        if name in allowed or value is None:
            continue
        default = _HARMLESS_DEFAULTS.get(name, ...)
        if type(value) is type(default) and value == default:
            continue
        unknown.append(name)
    if unknown:
        details = []
        for name in unknown:
            if name in _HARMLESS_DEFAULTS:
                details.append(f"{name} = {_json_repr(body[name])} (only {_json_repr(_HARMLESS_DEFAULTS[name])} is accepted)")
            else:
                details.append(name)
        raise APIError(400, "unsupported field(s): " + ", ".join(details) + ". This server honours: "
                       + ", ".join(sorted(allowed)), param=unknown[0])


def _parse_messages(value: Any) -> list[dict]:
    if not isinstance(value, list) or not value:
        raise APIError(400, f"messages must be a non-empty list of messages, got {_json_repr(value)}", param="messages")
    out = []
    for i, msg in enumerate(value):
        where = f"messages[{i}]"
        if not isinstance(msg, dict):
            raise APIError(400, f"{where} must be an object, got {_json_repr(msg)}", param=where)
        extra = sorted(k for k, v in msg.items() if k not in ("role", "content") and v is not None)
        if extra:
            raise APIError(400, f"{where}: unsupported field(s) {', '.join(extra)}; only role and content are honoured",
                           param=f"{where}.{extra[0]}")
        role = msg.get("role")
        if role not in CHAT_ROLES:
            raise APIError(400, f"{where}.role = {_json_repr(role)} is not supported: expected one of "
                           f"{', '.join(CHAT_ROLES)}", param=f"{where}.role")
        content = msg.get("content")
        if isinstance(content, list):
            parts = []
            for j, part in enumerate(content):
                if not (isinstance(part, dict) and part.get("type") == "text" and isinstance(part.get("text"), str)):
                    raise APIError(400, f"{where}.content[{j}] = {_json_repr(part)} is not supported: only "
                                   '{"type": "text", "text": ...} parts are', param=f"{where}.content")
                parts.append(part["text"])
            content = "".join(parts)
        if not isinstance(content, str):
            raise APIError(400, f"{where}.content must be a string or a list of text parts, got {_json_repr(content)}",
                           param=f"{where}.content")
        out.append({"role": role, "content": content})
    return out


def parse_request(body: Any, kind: str, model_name: str, n_ctx: int) -> GenRequest:
    """Validate a decoded JSON body for ``kind`` "completion" or "chat".

    Checks what can be checked without the model (types, ranges, unsupported fields,
    the model name); the prompt's length against the context is checked when it is
    tokenized. Raises APIError (400, or 404 for an unknown model).
    """
    if not isinstance(body, dict):
        raise APIError(400, f"the request body must be a JSON object, got {_json_repr(body)}")
    _check_fields(body, _COMPLETION_FIELDS if kind == "completion" else _CHAT_FIELDS)
    b = _Body(body)

    model = b.string("model")
    if model is None:
        raise APIError(400, "model is required: this server serves " + _json_repr(model_name), param="model")
    if model != model_name:
        raise APIError(404, f"the model {_json_repr(model)} does not exist: this server serves {_json_repr(model_name)}",
                       param="model", code="model_not_found")

    prompt = messages = None
    if kind == "completion":
        if body.get("prompt") is None:
            raise APIError(400, "prompt is required", param="prompt")
        if not isinstance(body["prompt"], str):
            raise APIError(400, f"prompt must be a string (lists of prompts and token-id arrays are not supported), "
                           f"got {_json_repr(body['prompt'])}", param="prompt")
        prompt = body["prompt"]
    else:
        if body.get("messages") is None:
            raise APIError(400, "messages is required", param="messages")
        messages = _parse_messages(body["messages"])

    n = b.integer("n")
    if n is not None and n != 1:
        raise APIError(400, f"n = {n} is not supported: this server generates one choice per request (n = 1)", param="n")

    why = " (the context size)"
    max_tokens = b.integer("max_tokens", 1, n_ctx, why)
    max_completion = b.integer("max_completion_tokens", 1, n_ctx, why)
    if max_tokens is not None and max_completion is not None and max_tokens != max_completion:
        raise APIError(400, f"max_tokens = {max_tokens} and max_completion_tokens = {max_completion} disagree: "
                       "give one of them", param="max_completion_tokens")
    if max_completion is not None:
        max_tokens = max_completion

    temperature = b.number("temperature")
    if temperature is not None and not (0.0 <= temperature <= MAX_TEMPERATURE):
        raise APIError(400, f"temperature = {body['temperature']} is out of range: expected 0 <= temperature <= "
                       f"{MAX_TEMPERATURE:g} (0 = greedy)", param="temperature")
    sampling: dict[str, Any] = {}
    for name in ("temperature", "top_p", "min_p", "repetition_penalty", "presence_penalty", "frequency_penalty"):
        v = b.number(name)
        if v is not None:
            sampling[name] = v
    for name in ("top_k", "seed"):
        v = b.integer(name)
        if v is not None:
            sampling[name] = v
    try:
        SamplingParams(**sampling)
    except SpecDecodeError as e:
        raise _from_specdecode_error(e) from None

    stop = body.get("stop")
    if stop is not None:
        stops = [stop] if isinstance(stop, str) else stop
        if not isinstance(stops, list) or any(not isinstance(s, str) or not s for s in stops):
            raise APIError(400, f"stop must be a non-empty string or a list of non-empty strings, got {_json_repr(stop)}",
                           param="stop")
        if stops:
            sampling["stop"] = stops

    stream = bool(b.boolean("stream"))
    include_usage = False
    options = body.get("stream_options")
    if options is not None:
        if not stream:
            raise APIError(400, "stream_options is only allowed when stream is true", param="stream_options")
        if not isinstance(options, dict) or any(k != "include_usage" for k in options):
            raise APIError(400, f"stream_options = {_json_repr(options)} is not supported: only "
                           '{"include_usage": true|false} is', param="stream_options")
        include_usage = bool(_Body(options, "stream_options.").boolean("include_usage"))

    logprobs = None
    if kind == "completion":
        logprobs = b.integer("logprobs", 0, MAX_LOGPROBS)
    else:
        want = b.boolean("logprobs")
        top = b.integer("top_logprobs", 0, MAX_LOGPROBS)
        if top is not None and not want:
            raise APIError(400, f"top_logprobs = {top} needs logprobs = true", param="top_logprobs")
        if want:
            logprobs = top or 0
    if logprobs is not None:
        sampling["logprobs"] = logprobs

    b.string("user")
    return GenRequest(kind=kind, prompt=prompt, messages=messages, max_tokens=max_tokens, sampling=sampling,
                      stream=stream, include_usage=include_usage, logprobs=logprobs)


# ---------------------------------------------------------------- metrics


class Metrics:
    """Prometheus counters and histograms of one server, in their own registry.

    Names follow vLLM's and llama.cpp server's style (``specdecode:...``). Counts cover
    requests that finished; a cancelled (client gone) request counts only in
    request_aborted_total.
    """

    def __init__(self, queue_len: Callable[[], int], running: Callable[[], int]) -> None:
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
        self.success = Counter(p + "request_success", "Finished requests by finish reason.", ["finished_reason"],
                               registry=r)
        self.aborted = Counter(p + "request_aborted", "Requests cancelled because the client disconnected.", registry=r)
        self.rejected = Counter(p + "request_rejected", "Requests refused before generation, by reason.", ["reason"],
                                registry=r)
        self.prompt_tokens = Counter(p + "prompt_tokens", "Prompt tokens of finished requests.", registry=r)
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
        Gauge(p + "num_requests_running", "Requests being generated (0 or 1).", registry=r).set_function(running)

    def record(self, result: Any, arrival: float, first: float, end: float) -> None:
        """Count one finished generation (a GenerationResult); times from time.perf_counter()."""
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
        self.prompt_tokens.inc(s.prompt_tokens)
        self.generation_tokens.inc(s.completion_tokens)
        self.ttft.observe(first - arrival)
        if s.completion_tokens > 1:
            self.tpot.observe((end - first) / (s.completion_tokens - 1))
        self.e2e.observe(end - arrival)

    def render(self) -> bytes:
        """The Prometheus text exposition (format 0.0.4)."""
        from prometheus_client import generate_latest

        return generate_latest(self.registry)


# ---------------------------------------------------------------- worker


@dataclass(eq=False)
class _Job:
    req: GenRequest
    loop: asyncio.AbstractEventLoop
    arrival: float
    events: asyncio.Queue = field(default_factory=asyncio.Queue)
    cancelled: threading.Event = field(default_factory=threading.Event)

    def post(self, kind: str, value: Any) -> None:
        """Hand an event to the asyncio side (called from the worker thread)."""
        try:
            self.loop.call_soon_threadsafe(self.events.put_nowait, (kind, value))
        except RuntimeError:  # the loop is closed: nobody is listening any more
            pass


class Worker:
    """Runs generations one at a time, in arrival order, in a dedicated thread.

    decoder: a :class:`specdecode.api.Decoder` (used from this thread only).
    max_queue: how many requests may wait besides the running one (>= 1).
    warmup: run one tiny generation when the thread starts.
    """

    def __init__(self, decoder: Any, max_queue: int, metrics_factory: Callable[["Worker"], Metrics],
                 warmup: bool = False) -> None:
        self.decoder = decoder
        self.max_queue = max_queue
        self.warmup = warmup
        self.n_ctx = int(decoder.target.n_ctx)
        self._cond = threading.Condition()
        self._waiting: deque[_Job] = deque()
        self._running: _Job | None = None
        self._stop = False
        self._thread: threading.Thread | None = None
        self.metrics = metrics_factory(self)

    def queue_len(self) -> int:
        """Requests waiting (the running one excluded)."""
        return len(self._waiting)

    def running(self) -> int:
        """1 while a generation runs, else 0."""
        return 1 if self._running is not None else 0

    def start(self) -> None:
        """Start the worker thread."""
        with self._cond:
            self._stop = False
        self._thread = threading.Thread(target=self._loop, name="specdecode-worker", daemon=True)
        self._thread.start()

    def stop(self, timeout: float = 30.0) -> None:
        """Cancel everything and stop the thread (waits up to timeout seconds for the current step)."""
        with self._cond:
            self._stop = True
            for job in self._waiting:
                job.cancelled.set()
                job.post("error", APIError(503, "the server is shutting down", type="server_error"))
            self._waiting.clear()
            if self._running is not None:
                self._running.cancelled.set()
            self._cond.notify_all()
        if self._thread is not None:
            self._thread.join(timeout)

    def submit(self, job: _Job) -> bool:
        """Queue a job; False when the queue is full (or the worker stopped)."""
        with self._cond:
            if self._stop or len(self._waiting) >= self.max_queue:
                return False
            self._waiting.append(job)
            self._cond.notify()
            return True

    def cancel(self, job: _Job) -> None:
        """The client is gone: drop the job if it waits, stop it after this step if it runs."""
        with self._cond:
            if job.cancelled.is_set():
                return
            job.cancelled.set()
            if job in self._waiting:
                self._waiting.remove(job)
                self.metrics.aborted.inc()

    def _loop(self) -> None:
        if self.warmup:
            # llama.cpp's first evaluation costs seconds (buffers, weight repacking): pay it
            # here rather than in the first client's time to first token. Requests queue
            # meanwhile. It runs on this thread, like every later generation, because an
            # OpenMP build of llama.cpp keeps a thread team per calling thread and teams
            # on different threads spin against each other.
            with contextlib.suppress(Exception):
                self.decoder.generate("Hello", max_tokens=2)
        while True:
            with self._cond:
                while not self._waiting and not self._stop:
                    self._cond.wait()
                if self._stop:
                    return
                job = self._waiting.popleft()
                self._running = job
            try:
                self._run(job)
            except BaseException as e:  # never let the worker die: the next request must be served
                job.post("error", APIError(500, f"internal error: {type(e).__name__}: {e}", type="server_error"))
            finally:
                with self._cond:
                    self._running = None

    def _max_tokens(self, req: GenRequest, prompt_len: int) -> int:
        room = self.n_ctx - prompt_len
        if room < 1:
            raise APIError(400, f"the prompt has {prompt_len} tokens but the context holds {self.n_ctx}: it must be "
                           "shorter than the context to leave room for at least one new token",
                           param="prompt" if req.kind == "completion" else "messages", code="context_length_exceeded")
        if req.max_tokens is None:
            return min(DEFAULT_COMPLETION_MAX_TOKENS, room) if req.kind == "completion" else room
        if req.max_tokens > room:
            raise APIError(400, f"the context holds {self.n_ctx} tokens, but {prompt_len + req.max_tokens} were asked "
                           f"for ({prompt_len} in the prompt, max_tokens = {req.max_tokens}): lower max_tokens to at "
                           f"most {room}", param="max_tokens", code="context_length_exceeded")
        return req.max_tokens

    def _run(self, job: _Job) -> None:
        req, dec = job.req, self.decoder
        start = time.perf_counter()
        self.metrics.queue_time.observe(start - job.arrival)
        gen = None
        result = None
        first = None
        try:
            ids = dec.prompt_ids(req.prompt, req.messages)
            max_tokens = self._max_tokens(req, len(ids))
            gen = dec.stream(req.prompt, messages=req.messages, max_tokens=max_tokens, **req.sampling)
            for item in gen:
                if first is None:
                    first = time.perf_counter()
                if job.cancelled.is_set():
                    break
                if isinstance(item, str):
                    if req.stream:
                        job.post("delta", item)
                else:
                    result = item
        except SpecDecodeError as e:
            self.metrics.rejected.labels(reason="invalid_request").inc()
            # The fields were checked on arrival; what is left concerns the prompt itself.
            job.post("error", _from_specdecode_error(e, "prompt" if req.kind == "completion" else "messages"))
            return
        except TemplateError as e:  # the chat template's own checks (e.g. roles must alternate)
            self.metrics.rejected.labels(reason="invalid_request").inc()
            job.post("error", APIError(400, f"the model's chat template rejected the messages: {e}", param="messages"))
            return
        except APIError as e:
            self.metrics.rejected.labels(reason="invalid_request").inc()
            job.post("error", e)
            return
        finally:
            if gen is not None:
                gen.close()  # rolls the caches back when stopped early
        end = time.perf_counter()
        if result is None:
            self.metrics.aborted.inc()
            # Read only when someone still listens: a client whose stream outlives a shutdown.
            job.post("error", APIError(503, "the request was cancelled (client gone or server shutting down)",
                                       type="server_error"))
            return
        logprobs = self._logprobs(req, result) if req.logprobs is not None else None
        self.metrics.record(result, job.arrival, first if first is not None else end, end)
        job.post("result", (result, logprobs))

    def _logprobs(self, req: GenRequest, result: Any) -> dict:
        """The choice's logprobs object, in the endpoint's OpenAI shape (built here: the
        backend is only touched from this thread)."""
        entries = result.logprobs or []
        if req.kind == "chat":
            tb = self.decoder.target.token_bytes
            return {"content": [
                {"token": lp.token, "logprob": lp.logprob, "bytes": list(tb(lp.token_id)),
                 "top_logprobs": [{"token": t, "logprob": v, "bytes": list(tb(i))} for i, t, v in lp.top_logprobs]}
                for lp in entries
            ], "refusal": None}
        offsets, pos = [], 0
        for lp in entries:
            offsets.append(pos)
            pos += len(lp.token)
        return {
            "tokens": [lp.token for lp in entries],
            "token_logprobs": [lp.logprob for lp in entries],
            "top_logprobs": [{t: v for _, t, v in lp.top_logprobs} for lp in entries],
            "text_offset": offsets,
        }


# ---------------------------------------------------------------- responses


class _Disconnected(Exception):
    pass


async def _wait_disconnect(request: Request) -> None:
    # The body has been read, so the next message the server delivers is the disconnect.
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


async def _next_event(job: _Job, disconnect: asyncio.Task) -> tuple[str, Any]:
    get = asyncio.ensure_future(job.events.get())
    done, _ = await asyncio.wait({get, disconnect}, return_when=asyncio.FIRST_COMPLETED)
    if get in done:
        return get.result()
    get.cancel()
    raise _Disconnected()


def _sse(obj: dict | str) -> str:
    data = obj if isinstance(obj, str) else json.dumps(obj, ensure_ascii=False)
    return f"data: {data}\n\n"


def _usage(result: Any) -> dict:
    s = result.stats
    return {"prompt_tokens": s.prompt_tokens, "completion_tokens": s.completion_tokens,
            "total_tokens": s.prompt_tokens + s.completion_tokens}


async def _read_json(request: Request) -> Any:
    raw = await request.body()

    def reject_constant(name: str) -> Any:
        raise ValueError(f"{name} is not valid JSON")

    try:
        return json.loads(raw, parse_constant=reject_constant)
    except (ValueError, UnicodeDecodeError) as e:
        raise APIError(400, f"the request body is not valid JSON: {e}") from None


def create_app(decoder: Any, model_name: str | None = None, max_queue: int = DEFAULT_MAX_QUEUE,
               warmup: bool = False) -> FastAPI:
    """Build the OpenAI-compatible app around a loaded :class:`specdecode.api.Decoder`.

    model_name: the id clients must send as ``model`` (default: decoder.target_name).
    max_queue: requests that may wait besides the running one (>= 1); more get 429.
    warmup: run one tiny generation on the worker thread at start-up, so that the first
        client does not pay llama.cpp's first-evaluation cost (seconds).
    The app owns a worker thread (started and stopped with the app's lifespan) and its
    own Prometheus registry (``app.state.metrics.registry``); the decoder stays the
    caller's to close. Raises SpecDecodeError for max_queue < 1.
    """
    from fastapi import FastAPI
    from fastapi.exceptions import RequestValidationError
    from fastapi.responses import JSONResponse, Response, StreamingResponse
    from prometheus_client.exposition import CONTENT_TYPE_PLAIN_0_0_4
    from starlette.exceptions import HTTPException as StarletteHTTPException

    class _SSEResponse(StreamingResponse):
        """A server-sent-event stream that runs ``on_close`` however it ends (finished,
        client gone, or cancelled), so that a dropped client frees the worker."""

        def __init__(self, content: AsyncIterator[str], on_close: Callable[[], None]) -> None:
            super().__init__(content, media_type="text/event-stream",
                             headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
            self._on_close = on_close

        async def __call__(self, scope, receive, send) -> None:
            try:
                await super().__call__(scope, receive, send)
            finally:
                self._on_close()

    if isinstance(max_queue, bool) or not isinstance(max_queue, int) or max_queue < 1:
        raise SpecDecodeError(f"max_queue = {max_queue!r} is out of range: expected an integer >= 1")
    model_name = model_name or decoder.target_name
    worker = Worker(decoder, max_queue, lambda w: Metrics(w.queue_len, w.running), warmup=warmup)
    metrics = worker.metrics
    created = int(time.time())
    draft_info = {"draft": getattr(decoder, "draft_name", None),
                  "num_speculative_tokens": getattr(getattr(decoder, "engine", None), "num_speculative_tokens", None)}

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI):
        worker.start()
        try:
            yield
        finally:
            worker.stop()

    app = FastAPI(title="specdecode", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)
    app.state.worker = worker
    app.state.metrics = metrics
    app.state.model_name = model_name

    @app.exception_handler(APIError)
    async def _api_error(request: Request, exc: APIError) -> JSONResponse:
        return exc.response()

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        kind = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
        detail = f"{request.method} {request.url.path}: {exc.detail}"
        return APIError(exc.status_code, detail, type=kind).response()

    @app.exception_handler(RequestValidationError)
    async def _validation_error(request: Request, exc: RequestValidationError) -> JSONResponse:
        return APIError(400, f"invalid request: {exc.errors()}").response()

    @app.exception_handler(Exception)
    async def _internal_error(request: Request, exc: Exception) -> JSONResponse:
        return APIError(500, f"internal error: {type(exc).__name__}: {exc}", type="server_error").response()

    def speculation(result: Any) -> dict:
        return {**result.stats.to_dict(), **draft_info}

    async def serve(request: Request, kind: str) -> Response:
        arrival = time.perf_counter()
        try:
            req = parse_request(await _read_json(request), kind, model_name, worker.n_ctx)
        except APIError as e:
            metrics.rejected.labels(reason="model_not_found" if e.status == 404 else "invalid_request").inc()
            raise
        job = _Job(req, asyncio.get_running_loop(), arrival)
        if not worker.submit(job):
            metrics.rejected.labels(reason="queue_full").inc()
            raise APIError(429, f"the server is busy: {worker.queue_len()} requests are waiting (max_queue = "
                           f"{max_queue}); retry later", type="rate_limit_error", code="queue_full")
        disconnect = asyncio.ensure_future(_wait_disconnect(request))
        try:
            # Streams wait for the first event too, so that errors found when the prompt
            # is tokenized still get a 4xx status rather than an error inside a 200 stream.
            kind_, value = await _next_event(job, disconnect)
        except _Disconnected:
            worker.cancel(job)
            return Response(status_code=499)  # nobody reads it; the status shows in the access log
        finally:
            # The stream's own disconnect watch (Starlette's) takes over from here.
            disconnect.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await disconnect
        if kind_ == "error":
            raise value
        if not req.stream:
            result, logprobs = value
            return JSONResponse(_full_response(kind, model_name, result, logprobs, speculation(result)))
        return _SSEResponse(_stream(kind, model_name, req, job, (kind_, value), speculation),
                            on_close=lambda: worker.cancel(job))

    # Plain Starlette routes: the endpoints take the Request itself and parse the body by
    # hand, so that every malformed or unsupported input gets an OpenAI-style 4xx.
    async def completions(request: Request) -> Response:
        return await serve(request, "completion")

    async def chat_completions(request: Request) -> Response:
        return await serve(request, "chat")

    async def list_models(request: Request) -> Response:
        return JSONResponse({"object": "list", "data": [_model_card(model_name, created, worker.n_ctx)]})

    async def get_model(request: Request) -> Response:
        model_id = request.path_params["model_id"]
        if model_id != model_name:
            raise APIError(404, f"the model {_json_repr(model_id)} does not exist: this server serves "
                           f"{_json_repr(model_name)}", param="model", code="model_not_found")
        return JSONResponse(_model_card(model_name, created, worker.n_ctx))

    async def health(request: Request) -> Response:
        return JSONResponse({"status": "ok", "model": model_name, "waiting": worker.queue_len(),
                             "running": worker.running(), "max_queue": max_queue})

    async def prometheus_metrics(request: Request) -> Response:
        return Response(metrics.render(), media_type=CONTENT_TYPE_PLAIN_0_0_4)

    app.add_route("/v1/completions", completions, methods=["POST"])
    app.add_route("/v1/chat/completions", chat_completions, methods=["POST"])
    app.add_route("/v1/models", list_models, methods=["GET"])
    app.add_route("/v1/models/{model_id:path}", get_model, methods=["GET"])
    app.add_route("/health", health, methods=["GET"])
    app.add_route("/metrics", prometheus_metrics, methods=["GET"])
    return app


def _model_card(model_name: str, created: int, n_ctx: int) -> dict:
    return {"id": model_name, "object": "model", "created": created, "owned_by": "specdecode", "max_model_len": n_ctx}


def _full_response(kind: str, model_name: str, result: Any, logprobs: dict | None, spec: dict) -> dict:
    if kind == "chat":
        choice = {"index": 0, "message": {"role": "assistant", "content": result.text}, "logprobs": logprobs,
                  "finish_reason": result.finish_reason}
        head = {"id": f"chatcmpl-{uuid.uuid4().hex}", "object": "chat.completion"}
    else:
        choice = {"index": 0, "text": result.text, "logprobs": logprobs, "finish_reason": result.finish_reason}
        head = {"id": f"cmpl-{uuid.uuid4().hex}", "object": "text_completion"}
    return {**head, "created": int(time.time()), "model": model_name, "system_fingerprint": None,
            "choices": [choice], "usage": _usage(result), "speculation": spec}


async def _stream(kind: str, model_name: str, req: GenRequest, job: _Job, first: tuple[str, Any],
                  speculation: Callable[[Any], dict]) -> AsyncIterator[str]:
    chat = kind == "chat"
    head = {"id": f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}",
            "object": "chat.completion.chunk" if chat else "text_completion",
            "created": int(time.time()), "model": model_name, "system_fingerprint": None}

    def chunk(text: str | None, finish: str | None = None, logprobs: dict | None = None, role: bool = False) -> dict:
        if chat:
            delta: dict = {}
            if role:
                delta["role"] = "assistant"
            if text is not None:
                delta["content"] = text
            choice = {"index": 0, "delta": delta, "logprobs": logprobs, "finish_reason": finish}
        else:
            choice = {"index": 0, "text": text or "", "logprobs": logprobs, "finish_reason": finish}
        return {**head, "choices": [choice]}

    if chat:
        yield _sse(chunk("", role=True))
    event = first
    while True:
        kind_, value = event
        if kind_ == "delta":
            yield _sse(chunk(value))
        elif kind_ == "error":
            yield _sse(value.body())
            break
        else:
            result, logprobs = value
            spec = speculation(result)
            final = chunk(None if chat else "", finish=result.finish_reason, logprobs=logprobs)
            final["usage"] = _usage(result)
            final["speculation"] = spec
            yield _sse(final)
            if req.include_usage:
                yield _sse({**head, "choices": [], "usage": _usage(result), "speculation": spec})
            break
        event = await job.events.get()
    yield _sse("[DONE]")


# ---------------------------------------------------------------- CLI


def cmd_serve(args: argparse.Namespace) -> int:
    """Handler of ``specdecode serve``: load the pair, then serve until interrupted."""
    import uvicorn

    from .api import Decoder

    k = args.num_speculative_tokens
    if k != "auto" and not (0 <= k <= 32):
        raise SpecDecodeError(f"--num-speculative-tokens {k} is out of range: expected 0..32 or auto")
    if not (0 <= args.port <= 65535):
        raise SpecDecodeError(f"--port {args.port} is out of range: expected 0..65535")
    if args.max_queue < 1:
        raise SpecDecodeError(f"--max-queue {args.max_queue} is out of range: expected >= 1")
    if args.host not in ("127.0.0.1", "localhost", "::1"):
        print(f"specdecode: warning: serving on {args.host}: the server has no authentication", flush=True)
    with Decoder(target=args.target, draft=args.draft, num_speculative_tokens=args.num_speculative_tokens,
                 n_ctx=args.ctx_size, n_threads=args.threads, progress=True, backend=args.backend,
                 draft_backend=args.draft_backend, dtype=args.dtype, device=args.device,
                 draft_vocab=args.draft_vocab) as dec:
        app = create_app(dec, model_name=args.target, max_queue=args.max_queue, warmup=True)
        print(f"specdecode: serving {args.target!r} (draft {args.draft!r}, K={args.num_speculative_tokens}) "
              f"on http://{args.host}:{args.port}/v1", flush=True)
        uvicorn.run(app, host=args.host, port=args.port, log_level="info")
    return 0


def add_serve_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    """Register the ``serve`` subcommand (options and handler) on the CLI's subparsers."""
    from . import models
    from .cli import add_backend_options, k_value

    s = subparsers.add_parser("serve", help="serve an OpenAI-compatible HTTP API")
    s.add_argument("--target", default=models.DEFAULT_TARGET,
                   help="registry name or .gguf path; also the model id clients send (default: %(default)s)")
    s.add_argument("--draft", default=models.DEFAULT_DRAFT,
                   help="registry name, .gguf path, 'ngram' (prompt lookup), 'none' or 'auto' (default: %(default)s)")
    s.add_argument("--num-speculative-tokens", "-k", type=k_value, default="auto",
                   help="K, drafted tokens per step (0..32), or 'auto' (default: %(default)s)")
    s.add_argument("--host", default="127.0.0.1", help="address to listen on (default: %(default)s, loopback only)")
    s.add_argument("--port", type=int, default=8000, help="port (default: %(default)s)")
    s.add_argument("--max-queue", type=int, default=DEFAULT_MAX_QUEUE,
                   help="requests that may wait besides the running one; more get 429 (default: %(default)s)")
    s.add_argument("--ctx-size", type=int, default=4096, help="context window in tokens")
    s.add_argument("--threads", type=int, default=None, help="CPU threads (default: all cores)")
    add_backend_options(s)
    s.set_defaults(func=cmd_serve)
    return s
