"""The generation worker: one thread runs every generation, one at a time, in arrival order.

The engine is not thread-safe, so the loaded decoder is used from this thread only; text
deltas travel to the asyncio side through each job's event queue.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Callable

from jinja2 import TemplateError

from ..errors import SpecDecodeError
from .metrics import Metrics
from .protocol import APIError, GenRequest, from_specdecode_error, resolve_max_tokens


@dataclass(eq=False)
class Job:
    """One request on its way through the worker.

    arrival: time.perf_counter() seconds when the request arrived. events: what the
    worker posts, as (kind, value), choice after choice (index 0..n-1): while streaming
    ("delta", (index, text, logprobs object of the tokens the text completes, or None));
    at the end of each choice ("choice", (index, GenerationResult, logprobs object or
    None: a stream has sent them all with its deltas)); or, at any point, ("error",
    APIError), after which nothing follows. cancelled: set when the client is gone or
    the server stops.
    """

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
    metrics_factory: builds the server's Metrics from this worker (whose queue length and
        running count its gauges read).
    warmup: run one tiny generation when the thread starts.
    """

    def __init__(self, decoder: Any, max_queue: int, metrics_factory: Callable[["Worker"], Metrics],
                 warmup: bool = False) -> None:
        self.decoder = decoder
        self.max_queue = max_queue
        self.warmup = warmup
        self.n_ctx = int(decoder.target.n_ctx)
        self._cond = threading.Condition()
        self._waiting: deque[Job] = deque()
        self._running: Job | None = None
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
        """Cancel everything and stop the thread.

        Waiting jobs get a 503 error event; the running one stops after its current step.
        timeout: seconds to wait for the thread to end.
        """
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

    def submit(self, job: Job) -> bool:
        """Queue a job; False when the queue is full (or the worker stopped)."""
        with self._cond:
            if self._stop or len(self._waiting) >= self.max_queue:
                return False
            self._waiting.append(job)
            self._cond.notify()
            return True

    def cancel(self, job: Job) -> None:
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

    def _run(self, job: Job) -> None:
        req, dec = job.req, self.decoder
        self.metrics.queue_time.observe(time.perf_counter() - job.arrival)
        first: list[float] = []  # when the first choice's first step came back
        results = []
        try:
            ids = dec.prompt_ids(req.prompt, req.messages)
            max_tokens = resolve_max_tokens(req, len(ids), self.n_ctx)
            for i in range(req.n):
                done = self._choice(job, i, max_tokens, first)
                if done is None:
                    break
                results.append(done)
                if i < req.n - 1:
                    job.post("choice", (i, *done))
        except SpecDecodeError as e:
            self.metrics.rejected.labels(reason="invalid_request").inc()
            # The fields were checked on arrival; what is left concerns the prompt itself.
            job.post("error", from_specdecode_error(e, "prompt" if req.kind == "completion" else "messages"))
            return
        except TemplateError as e:  # the chat template's own checks (e.g. roles must alternate)
            self.metrics.rejected.labels(reason="invalid_request").inc()
            job.post("error", APIError(400, f"the model's chat template rejected the messages: {e}", param="messages"))
            return
        except APIError as e:
            self.metrics.rejected.labels(reason="invalid_request").inc()
            job.post("error", e)
            return
        end = time.perf_counter()
        if len(results) < req.n:
            self.metrics.aborted.inc()
            # Read only when someone still listens: a client whose stream outlives a shutdown.
            job.post("error", APIError(503, "the request was cancelled (client gone or server shutting down)",
                                       type="server_error"))
            return
        # Counted before the last choice is posted: a client that reads the metrics once
        # answered sees its request in them.
        self.metrics.record([result for result, _ in results], job.arrival, first[0] if first else end, end)
        job.post("choice", (req.n - 1, *results[-1]))

    def _choice(self, job: Job, index: int, max_tokens: int, first: list[float]) -> tuple[Any, dict | None] | None:
        """Generate choice ``index`` of the job, posting its deltas (streams). Returns
        (GenerationResult, logprobs object or None: a stream has sent them with its
        deltas), or None when the job was cancelled. first: gets the time of the
        request's first step."""
        req = job.req
        if job.cancelled.is_set():  # gone between two choices: start no other
            return None
        logprobs = _LogprobsFormat(req.kind, self.decoder.target.token_bytes) if req.logprobs is not None else None
        gen = self.decoder.stream(req.prompt, messages=req.messages, max_tokens=max_tokens,
                                  **req.choice_sampling(index))
        result = None
        try:
            for item in gen:
                if not first:
                    first.append(time.perf_counter())
                if job.cancelled.is_set():
                    return None
                if isinstance(item, str):
                    if req.stream:
                        # The logprobs of the tokens this delta completes (a TextDelta's).
                        lp = logprobs.format(getattr(item, "logprobs", None) or []) if logprobs is not None else None
                        job.post("delta", (index, str(item), lp))
                else:
                    result = item
        finally:
            gen.close()  # rolls the caches back when stopped early
        if result is None:
            return None
        # A stream has sent every logprob with its delta; a full response carries them all.
        return result, None if logprobs is None or req.stream else logprobs.format(result.logprobs or [])


class _LogprobsFormat:
    """TokenLogprob entries in the endpoint's OpenAI shape (built on the worker thread: the
    backend is only touched from it). Completions' text_offset counts characters from the
    start of the choice's text and continues across the chunks of a stream."""

    def __init__(self, kind: str, token_bytes: Callable[[int], bytes]) -> None:
        self.kind = kind
        self.token_bytes = token_bytes
        self.offset = 0

    def format(self, entries: list) -> dict:
        """The logprobs object of these entries (the next ones of the choice)."""
        if self.kind == "chat":
            tb = self.token_bytes
            return {"content": [
                {"token": lp.token, "logprob": lp.logprob, "bytes": list(tb(lp.token_id)),
                 "top_logprobs": [{"token": t, "logprob": v, "bytes": list(tb(i))} for i, t, v in lp.top_logprobs]}
                for lp in entries
            ], "refusal": None}
        offsets = []
        for lp in entries:
            offsets.append(self.offset)
            self.offset += len(lp.token)
        return {
            "tokens": [lp.token for lp in entries],
            "token_logprobs": [lp.logprob for lp in entries],
            "top_logprobs": [{t: v for _, t, v in lp.top_logprobs} for lp in entries],
            "text_offset": offsets,
        }
