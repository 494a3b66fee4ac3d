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
    worker posts, as (kind, value): ("delta", text) while streaming, then either
    ("result", (GenerationResult, logprobs object or None)) or ("error", APIError).
    cancelled: set when the client is gone or the server stops.
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
        start = time.perf_counter()
        self.metrics.queue_time.observe(start - job.arrival)
        gen = None
        result = None
        first = None
        try:
            ids = dec.prompt_ids(req.prompt, req.messages)
            max_tokens = resolve_max_tokens(req, len(ids), self.n_ctx)
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
