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
from typing import Any, AsyncIterator, Callable

from .prepare import Prepared
from .protocol import GenRequest

# What one unread event holds besides its text, in bytes: the tuple, the queue's entry and the
# str object (about 250 bytes in CPython), so that a bound in bytes also bounds a stream of
# one-character deltas.
EVENT_OVERHEAD_BYTES = 256


class EventQueue(asyncio.Queue):
    """A job's events, in order, with what they hold unread counted: ``unread`` is the bytes
    of the events posted (:meth:`Job.post`, worker thread) and not yet taken by ``get``
    (event loop), so that the worker can end a stream whose client stopped reading. Its
    items are (kind, value, size in bytes); ``get`` returns (kind, value)."""

    def __init__(self) -> None:
        super().__init__()
        self._lock = threading.Lock()  # posted on the worker thread, taken on the event loop's
        self.unread = 0

    def count(self, size: int) -> None:
        """size bytes posted (on their way to the queue)."""
        with self._lock:
            self.unread += size

    def _get(self) -> tuple[str, Any]:  # asyncio.Queue's hook for what get() returns
        kind, value, size = super()._get()
        with self._lock:
            self.unread -= size
        return kind, value


def event_size(text: str, *extra: Any) -> int:
    """The bytes a delta event holds unread: EVENT_OVERHEAD_BYTES, its text's UTF-8 bytes and
    each extra object's (logprobs, trace) size as JSON."""
    text_bytes = len(text.encode("utf-8", "replace"))
    return EVENT_OVERHEAD_BYTES + text_bytes + sum(len(json.dumps(x)) for x in extra if x is not None)


@dataclass(eq=False)
class Job:
    """One request on its way through the worker.

    arrival: time.perf_counter() seconds when the request arrived. events: what the
    worker posts, as (kind, value), choice after choice (index 0..n-1): while streaming
    ("delta", (index, text, logprobs object of the tokens the text completes or None,
    speculation_trace or None));
    at the end of each choice ("choice", (index, GenerationResult, logprobs object or
    None: a stream has sent them all with its deltas)); or, at any point, ("error",
    APIError), after which nothing follows; ``events.unread`` counts the bytes of the deltas
    not yet read. cancelled: set when the client is gone or the server stops.
    """

    req: GenRequest
    loop: asyncio.AbstractEventLoop
    arrival: float
    prepared: Prepared | None = None  # None: prepared on the worker thread when admitted
    events: EventQueue = field(default_factory=EventQueue)
    cancelled: threading.Event = field(default_factory=threading.Event)

    def post(self, kind: str, value: Any, size: int = 0) -> None:
        """Hand an event to the asyncio side (called from the worker thread); size: the bytes
        it holds until read, counted in ``events.unread`` from now on."""
        self.events.count(size)
        try:
            self.loop.call_soon_threadsafe(self.events.put_nowait, (kind, value, size))
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
