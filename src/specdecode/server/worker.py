"""The generation worker of ``specdecode serve``: one thread runs every generation,
several at once in shared batched steps (continuous batching), admitting requests in
arrival order.

The engine is not thread-safe, so the loaded decoder is used from this thread only; text
deltas travel to the asyncio side through each job's event queue (:mod:`.jobs`).
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Callable

from jinja2 import TemplateError

from ..engine.chunking import PrefillChunker
from ..errors import SpecDecodeError
from .config import ServerOptions
from .prepare import Prepared, Preparer, request_error
from .extensions import trace_of
from .metrics import Metrics
from .jobs import ChoiceDone, Delta, Failed, Job, Started, event_size
from .logprobs_format import LogprobsFormat
from .protocol import APIError, GenRequest
from .toolcalls import tool_call_format

# Measuring between requests (control.calibration) overwrites what the slots cached: while a slot
# holds a prompt of this many tokens, the measurement waits KEEP_CACHE_S after the last request, so
# that an agent's next turn (it comes seconds later, its prompt the last one and more) reuses it.
KEEP_CACHE_TOKENS = 512
KEEP_CACHE_S = 30.0


@dataclass(eq=False)
class _Running:
    """A job holding a slot: its current choice's generation and what it has produced."""

    job: Job
    logprobs: "LogprobsFormat | None"
    index: int = 0  # the choice being generated
    prepared: Prepared | None = None  # the prompt's and inputs' tokens (once for all choices)
    gen: Any = None  # the engine's Generation of this choice
    results: list = field(default_factory=list)  # (GenerationResult, logprobs object or None) per finished choice
    first: float | None = None  # when the job's first step came back
    watch: Any = None  # the current choice's own stop rule (a request's ``watch``), or None

    @property
    def stopped(self) -> bool:
        """The choice's watch has ended it (before the engine would)."""
        return self.watch is not None and self.watch.stopped


class Worker:
    """Runs every generation on one thread, several at once (continuous batching).

    The engine has ``slots`` (the decoder's ``parallel``); each running request holds one.
    Between two batched steps the loop admits waiting requests into free slots (in
    arrival order; the engine puts each in the free slot whose cache shares the longest
    prefix with its prompt and prefills it), ends finished and cancelled generations
    (freeing their slots at once), and then runs one step for every running generation:
    one shared target forward. With one slot this is the one-at-a-time server. A request's
    n choices run one after another in its slot.

    decoder: a :class:`specdecode.api.Decoder` (used from this thread only).
    options: the server's options; the worker reads ``max_queue`` (how many requests may
        wait for a slot, besides the running ones), ``max_unread_bytes`` (a stream holding
        more unread is ended with an error event, its slot freed) and ``warmup`` (run one
        tiny generation when the thread starts).
    metrics_factory: builds the server's Metrics from this worker (whose queue length and
        running count its gauges read).
    """

    def __init__(self, decoder: Any, options: ServerOptions, metrics_factory: Callable[["Worker"], Metrics]) -> None:
        self.decoder = decoder
        self.options = options
        self.n_ctx = int(decoder.target.n_ctx)
        self.slots = len(decoder.engine.slots)
        # The tool-call format the target's chat template teaches (None: it cannot take tools).
        self.tool_format = tool_call_format(decoder.target.chat_template)
        self._cond = threading.Condition()
        self._waiting: deque[Job] = deque()
        self._active: list[_Running] = []
        self._stop = False
        self._thread: threading.Thread | None = None
        self.preparer = Preparer(decoder, options, self.n_ctx)  # what a request brings, off this thread
        # Chunked prefill: how much of a prompt to read between two steps.
        self.chunker = PrefillChunker(split=decoder.target.prefill_split)
        self.clock: Callable[[], float] = time.perf_counter  # what the chunker's costs are timed with
        self.keep_cache_s = KEEP_CACHE_S  # see _keep_cache_for
        self._idle_since = float("-inf")  # when the last request ended (time.monotonic)
        self._slot_owner: dict[int, Any] = {}  # slot (sequence) -> the owner of the job that used it last
        self.metrics = metrics_factory(self)

    def queue_len(self) -> int:
        """Requests waiting (the running ones excluded)."""
        return len(self._waiting)

    def running(self) -> int:
        """Requests holding a slot (0..slots)."""
        return len(self._active)

    def start(self) -> None:
        """Start the worker thread."""
        with self._cond:
            self._stop = False
        self.preparer.start()
        self._thread = threading.Thread(target=self._loop, name="specdecode-worker", daemon=True)
        self._thread.start()

    def stop(self, timeout: float = 30.0) -> None:
        """Cancel everything and stop the thread.

        Waiting jobs get a 503 error event; running ones stop after the current step (and
        get one too). Jobs submitted from now on are refused.
        timeout: seconds to wait for the thread to end (0: do not wait, e.g. from the
        event loop when the server is told to exit).
        """
        with self._cond:
            self._stop = True
            for job in self._waiting:
                job.cancelled.set()
                job.post(Failed(APIError(503, "the server is shutting down", type="server_error")))
            self._waiting.clear()
            for r in self._active:
                r.job.cancelled.set()
            self._cond.notify_all()
        self.preparer.stop(wait=timeout > 0)
        if self._thread is not None:
            self._thread.join(timeout)

    @property
    def stopping(self) -> bool:
        """Whether the worker has been told to stop (it takes no more jobs)."""
        return self._stop

    def submit(self, job: Job) -> bool:
        """Queue a job; False when slots and queue are full (or the worker stopped).

        A job is taken while the jobs waiting and running leave room for it in the slots
        plus ``max_queue``: a job that arrives while a slot is free is not counted against
        the queue, though it waits for the next admission (between two steps)."""
        with self._cond:
            if self._stop or len(self._waiting) + len(self._active) >= self.slots + self.options.max_queue:
                return False
            self._waiting.append(job)
            self._cond.notify()
            return True

    def cancel(self, job: Job) -> None:
        """The client is gone: drop the job if it waits, free its slot after this step if it runs."""
        with self._cond:
            if job.cancelled.is_set():
                return
            job.cancelled.set()
            if job in self._waiting:
                self._waiting.remove(job)
                self.metrics.aborted.inc()

    def _loop(self) -> None:
        if self.options.warmup:
            # llama.cpp's first evaluation costs seconds (buffers, weight repacking): pay it
            # here rather than in the first client's time to first token. Requests queue
            # meanwhile. It runs on this thread, like every later generation, because an
            # OpenMP build of llama.cpp keeps a thread team per calling thread and teams
            # on different threads spin against each other.
            with contextlib.suppress(Exception):
                self.decoder.generate("Hello", max_tokens=2)
        calibration = getattr(self.decoder, "calibration", None)  # measured between requests (control.calibration)
        while True:
            with self._cond:
                while not self._waiting and not self._active and not self._stop:
                    hold = self._keep_cache_for() if calibration is not None and calibration.pending else None
                    if hold is not None and hold <= 0:
                        break  # measure a part
                    self._cond.wait(hold)
                stopping = self._stop
                idle = not self._waiting and not self._active
                admitted = []
                while not stopping and self._waiting and len(self._active) < self.slots:
                    job = self._waiting.popleft()
                    r = _Running(job, self._logprobs_format(job.req))
                    self._active.append(r)
                    admitted.append(r)
            if stopping:
                for r in list(self._active):
                    self._guarded(r, lambda r: self._cancelled(r, shutdown=True))
                return
            if idle and calibration is not None:  # nothing to serve: one part of what is measured (a request
                calibration.run_one()                # waits for one part at most)
                continue
            try:
                for r in admitted:
                    self.metrics.queue_time.observe(time.perf_counter() - r.job.arrival)
                    self._guarded(r, self._start)
                for r in list(self._active):
                    if r.job.cancelled.is_set():
                        self._guarded(r, self._cancelled)
                    elif r.job.events.unread > self.options.max_unread_bytes:
                        self._unread_over(r)
                started = self.clock()
                self._step()
                if calibration is not None:
                    calibration.between_steps(self.clock() - started, self.clock)
            except BaseException as e:  # never let the worker die: the next request must be served
                for r in list(self._active):
                    self._fail(r, APIError(500, f"internal error: {type(e).__name__}: {e}", type="server_error"))

    def _keep_cache_for(self) -> float:
        """Seconds to wait before measuring between requests (a measurement overwrites what the
        slots cached): while a slot holds a prompt of KEEP_CACHE_TOKENS or more, until
        ``keep_cache_s`` after the last request ended, so that an agent's next turn, seconds
        later, still reuses it; else none."""
        calibration = getattr(self.decoder, "calibration", None)
        if calibration is not None and calibration.private:
            return 0.0  # it measures on a context of its own: nothing cached is lost (issue 61: 548 s idle first)
        if max((s.cached_len for s in self.decoder.engine.slots), default=0) < KEEP_CACHE_TOKENS:
            return 0.0
        return self.keep_cache_s - (time.monotonic() - self._idle_since)

    def _logprobs_format(self, req: GenRequest) -> "LogprobsFormat | None":
        """A fresh formatter for one choice's logprobs, when the request asks for them."""
        return LogprobsFormat(req.kind, self.decoder.target.token_bytes) if req.logprobs is not None else None

    def _guarded(self, r: _Running, action: Callable[[_Running], None]) -> None:
        """Run action(r); a failure ends this job alone with its error (400 for what the
        request itself got wrong, else 500)."""
        try:
            action(r)
        except (SpecDecodeError, TemplateError) as e:
            self.metrics.rejected.labels(reason="invalid_request").inc()
            self._fail(r, request_error(e, r.job.req))
        except APIError as e:
            self.metrics.rejected.labels(reason="invalid_request").inc()
            self._fail(r, e)
        except Exception as e:
            self._fail(r, APIError(500, f"internal error: {type(e).__name__}: {e}", type="server_error"))

    def _fail(self, r: _Running, error: APIError) -> None:
        """End the job with an error event and free its slot."""
        self._release(r)
        r.job.post(Failed(error))

    def _release(self, r: _Running) -> None:
        if r.gen is not None:
            gen, r.gen = r.gen, None
            with contextlib.suppress(Exception):
                self.decoder.end(gen)  # rolls the caches back
        with self._cond:
            if r in self._active:
                self._active.remove(r)
            if not self._active:
                self._idle_since = time.monotonic()

    def _start(self, r: _Running) -> None:
        """Tokenize the job's prompt and begin its first choice (prefilled in its slot)."""
        if r.job.cancelled.is_set():
            return self._cancelled(r)
        r.prepared = r.job.prepared or self.preparer.prepare(r.job.req)
        self._begin_choice(r)

    def _begin_choice(self, r: _Running) -> None:
        p = r.prepared
        # A stream opens once its first choice's options are accepted, before the prompt is read.
        opened = (lambda: r.job.post(Started(r.index))) if r.job.req.stream and r.index == 0 else None
        r.gen = self.decoder.begin(prompt_ids=p.ids, options=r.job.req.choice_options(r.index, p.max_tokens, p.inputs, p.cache_reuse),
                                   accepted=opened, chunked=True)  # read by _step, a chunk at a time
        self._hide_others_cache(r)
        # A request kind's own stop rule (an /infill request's, :class:`.infill.InfillGenRequest`),
        # started once the prompt is read: llama.cpp times generation from there.
        watch = getattr(r.job.req, "watch", None)
        if watch is None and r.job.req.tools is not None:  # a bound on the calls (:meth:`.tools.ToolRequest.watch`)
            watch = r.job.req.tools.watch
        r.watch = watch(self.decoder.target.token_bytes) if watch is not None else None

    def _hide_others_cache(self, r: _Running) -> None:
        """A prompt's reuse of a slot that another client wrote last is kept but not reported:
        ``cached_tokens`` (and every count made from it: Ollama's ``prompt_eval_count``,
        /infill's ``prompt_n``, the ``speculation`` object) says 0, so that a client cannot
        probe another's prompt token by token (issue 61: a guessed PIN in another client's
        system prompt showed as 50 of 51 cached tokens, a near miss as 16-18). A client is its
        :attr:`.jobs.Job.owner`. The /metrics counter counts what the usage reports (counted
        there, the reuse could be read off it by diffing it around one's own request)."""
        stats, seq = r.gen.out.stats, r.gen.slot.seq
        last, self._slot_owner[seq] = self._slot_owner.get(seq), r.job.owner
        if last is not None and last != r.job.owner:
            stats.prompt_cached = stats.prompt_shifted = 0

    def _cancelled(self, r: _Running, shutdown: bool = False) -> None:
        self._release(r)
        self.metrics.aborted.inc()
        # Read only when someone still listens: a stream or a request the shutdown stops.
        message = ("the server is shutting down: the request was stopped before its end" if shutdown else
                   "the request was cancelled (client gone or server shutting down)")
        r.job.post(Failed(APIError(503, message, type="server_error")))

    def _unread_over(self, r: _Running) -> None:
        """The job's client has left more than max_unread_bytes of its stream unread (it
        stopped reading, or reads slower than the steps come): end the generation, free the
        slot, and end the stream with an error event, which the client reads after the
        deltas it left, if it ever reads again."""
        self.metrics.aborted.inc()
        bound = self.options.max_unread_bytes
        self._fail(r, APIError(408, f"the stream was ended: its client left {r.job.events.unread} bytes of output "
                               f"unread, more than a stream may hold ({bound} bytes, --max-unread-bytes); read a "
                               "stream as it comes", code="stream_not_read"))

    def _step(self) -> None:
        """One batched step of every running generation (decode first); post their deltas;
        then one chunk of the prompt with the least left to read (chunked prefill, sized by
        :class:`specdecode.engine.chunking.PrefillChunker`); finish the choices that are done."""
        running = [r for r in self._active if r.gen is not None and not r.gen.prefilling and not r.gen.done
                   and not r.stopped]
        if running:
            started = self.clock()
            deltas = self.decoder.step([r.gen for r in running])
            now = self.clock()
            self.chunker.observe_step(now - started)
            for r, delta in zip(running, deltas):
                if r.first is None:
                    r.first = time.perf_counter()
                self._post_delta(r, delta)
        reading = [r for r in self._active if r.gen is not None and r.gen.prefilling]
        if reading:  # the prompt with the least left to read first: a short one never waits for a long one
            r = min(reading, key=lambda r: len(r.gen.committed) - 1 - r.gen.slot.cached_len)
            self._guarded(r, lambda r: self._read_chunk(r, decoding=bool(running)))
        for r in [r for r in self._active if r.gen is not None and not r.gen.prefilling and (r.gen.done or r.stopped)]:
            self._guarded(r, self._finish_choice)

    def _read_chunk(self, r: _Running, decoding: bool) -> None:
        started = self.clock()
        n = self.decoder.prefill(r.gen, self.chunker.size(decoding))
        self.chunker.observe_chunk(n, self.clock() - started)

    def _post_delta(self, r: _Running, delta: Any) -> None:
        text = str(delta) if r.watch is None else r.watch.feed(delta)  # a watch sees every delta, streamed or not
        if r.job.req.stream and (text or delta.token_ids):
            # The logprobs of the tokens this delta completes (a TextDelta's).
            lp = r.logprobs.format(delta.logprobs or []) if r.logprobs is not None else None
            trace = None
            if r.job.req.trace:
                trace = trace_of(delta, (r.gen.drafter.explain() or None) if r.gen is not None else None)
            r.job.post(Delta(r.index, text, lp, trace), event_size(text, lp, trace))

    def _finish_choice(self, r: _Running) -> None:
        """The current choice is done: post its tail and result, then begin the next choice
        or finish the job (metrics, last choice)."""
        gen, r.gen = r.gen, None
        *tail, result = self.decoder.end(gen)
        for delta in tail:
            self._post_delta(r, delta)
        if r.watch is not None:
            result = r.watch.finish(result)
        req = r.job.req
        # A stream has sent every logprob with its delta; a full response carries them all.
        lp = None if r.logprobs is None or req.stream else r.logprobs.format(result.logprobs or [])
        r.results.append((result, lp))
        if r.index < req.n - 1:
            r.job.post(ChoiceDone(r.index, result, lp))
            r.index += 1
            if r.job.cancelled.is_set():
                return self._cancelled(r)
            r.logprobs = self._logprobs_format(req)
            self._begin_choice(r)
            return
        end = time.perf_counter()
        self._release(r)
        # Counted before the last choice is posted: a client that reads the metrics once
        # answered sees its request in them.
        self.metrics.record([res for res, _ in r.results], r.job.arrival, r.first or end, end)
        r.job.post(ChoiceDone(r.index, result, lp))
