"""A request on its way through the server's worker (:class:`Job`) and the stream of events
the worker posts to it for the HTTP side, counted while unread (:class:`EventQueue`), so that a
stream whose client stopped reading can be ended; and that stream as an HTTP response that frees
the worker however it ends (:func:`closing_stream`).
"""

from __future__ import annotations

import asyncio
import functools
import json
import threading
from dataclasses import dataclass, field
from typing import Any, AsyncIterator, Callable, Union

from .apierror import APIError
from .prepare import Prepared
from .protocol import GenRequest

# What one unread event holds besides its text, in bytes: the tuple, the queue's entry and the
# str object (about 250 bytes in CPython), so that a bound in bytes also bounds a stream of
# one-character deltas.
EVENT_OVERHEAD_BYTES = 256


@dataclass(frozen=True)
class Started:
    """A stream's generation had its options accepted and its prompt is about to be read:
    the stream may open (posted for choice 0 of a streamed request only)."""

    index: int


@dataclass(frozen=True)
class Delta:
    """New text of choice ``index`` (streamed requests only): ``logprobs``, the logprobs object
    of the tokens the text completes or None; ``trace``, its speculation_trace or None."""

    index: int
    text: str
    logprobs: dict | None = None
    trace: dict | None = None


@dataclass(frozen=True)
class ChoiceDone:
    """Choice ``index`` is finished: its GenerationResult, and its logprobs object (None for a
    stream, which has sent them with its deltas)."""

    index: int
    result: Any
    logprobs: dict | None = None


@dataclass(frozen=True)
class Failed:
    """The request ended with ``error``; nothing follows."""

    error: APIError


Event = Union[Started, Delta, ChoiceDone, Failed]


class EventQueue(asyncio.Queue):
    """A job's events, in order, with what they hold unread counted: ``unread`` is the bytes
    of the events posted (:meth:`Job.post`, worker thread) and not yet taken by ``get``
    (event loop), so that the worker can end a stream whose client stopped reading. Its
    items are (event, size in bytes); ``get`` returns the :data:`Event`."""

    def __init__(self) -> None:
        super().__init__()
        self._lock = threading.Lock()  # posted on the worker thread, taken on the event loop's
        self.unread = 0

    def count(self, size: int) -> None:
        """size bytes posted (on their way to the queue)."""
        with self._lock:
            self.unread += size

    def _get(self) -> Event:  # asyncio.Queue's hook for what get() returns
        event, size = super()._get()
        with self._lock:
            self.unread -= size
        return event


def event_size(text: str, *extra: Any) -> int:
    """The bytes a delta event holds unread: EVENT_OVERHEAD_BYTES, its text's UTF-8 bytes and
    each extra object's (logprobs, trace) size as JSON."""
    text_bytes = len(text.encode("utf-8", "replace"))
    return EVENT_OVERHEAD_BYTES + text_bytes + sum(len(json.dumps(x)) for x in extra if x is not None)


@dataclass(eq=False)
class Job:
    """One request on its way through the worker.

    arrival: time.perf_counter() seconds when the request arrived. events: what the
    worker posts (:data:`Event`), choice after choice (index 0..n-1): a stream's
    :class:`Started`, its :class:`Delta` s while streaming, a :class:`ChoiceDone` at the end
    of each choice; or, at any point, :class:`Failed`, after which nothing follows;
    ``events.unread`` counts the bytes of the deltas not yet read. cancelled: set when the
    client is gone or the server stops.
    """

    req: GenRequest
    loop: asyncio.AbstractEventLoop
    arrival: float
    prepared: Prepared | None = None  # None: prepared on the worker thread when admitted
    owner: Any = None  # who sent it (:func:`.runner.owner_of`): a slot's reuse is reported within one owner
    events: EventQueue = field(default_factory=EventQueue)
    cancelled: threading.Event = field(default_factory=threading.Event)

    def post(self, event: Event, size: int = 0) -> None:
        """Hand an event to the asyncio side (called from the worker thread); size: the bytes
        it holds until read, counted in ``events.unread`` from now on."""
        self.events.count(size)
        try:
            self.loop.call_soon_threadsafe(self.events.put_nowait, (event, size))
        except RuntimeError:  # the loop is closed: nobody is listening any more
            pass


SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


@functools.cache
def _closing_stream_class() -> type:
    from fastapi.responses import StreamingResponse

    class ClosingStream(StreamingResponse):
        def __init__(self, content: AsyncIterator[str], on_close: Callable[[], None], media_type: str,
                     headers: dict) -> None:
            super().__init__(content, media_type=media_type, headers=headers)
            self._on_close = on_close

        async def __call__(self, scope, receive, send) -> None:
            try:
                await super().__call__(scope, receive, send)
            finally:
                self._on_close()

    return ClosingStream


def closing_stream(content: AsyncIterator[str], on_close: Callable[[], None], media_type: str = "text/event-stream",
                   headers: dict | None = None) -> Any:
    """A job's stream as a StreamingResponse (imported on first use) that runs ``on_close``
    however it ends (finished, client gone, or cancelled), so that a dropped client frees the
    worker: server-sent events by default (SSE_HEADERS), or another media type (Ollama's NDJSON)."""
    return _closing_stream_class()(content, on_close, media_type, SSE_HEADERS if headers is None else headers)
