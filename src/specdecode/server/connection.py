"""The header timeout of ``specdecode serve``'s connections: uvicorn's HTTP protocol, which
waits for a request's head as long as the client likes (its keep-alive timeout covers only the
silence between requests, and any byte resets it), with a deadline on the head.

A connection must complete each request's head (request line and headers) within
``header_timeout`` seconds, counted from its opening for the first request and from the first
byte of each later one (the silence between requests stays uvicorn's keep-alive timeout's);
past the deadline it is answered 408 and closed. A slow client sending its head byte by byte
(Slowloris) or a connection that sends nothing then holds no socket for longer than that. The
body's own deadline is the app's (:class:`.access.DrainUnread`), which can still answer with
an OpenAI error once the head is read.

uvicorn is imported on first use, as by the rest of the server.
"""

from __future__ import annotations

import functools
import json
from typing import Any


def timeout_answer(seconds: float) -> bytes:
    """The 408 sent to a connection whose request head did not arrive in time: OpenAI's
    error body, and ``Connection: close``."""
    body = json.dumps({"error": {"message": f"the request's head (request line and headers) did not arrive within "
                                            f"{seconds:g} seconds (--header-timeout)",
                                 "type": "invalid_request_error", "param": None, "code": "header_timeout"}}).encode()
    return (b"HTTP/1.1 408 Request Timeout\r\ncontent-type: application/json\r\ncontent-length: "
            + str(len(body)).encode() + b"\r\nconnection: close\r\n\r\n" + body)


@functools.cache
def http_protocol(header_timeout: float) -> type:
    """uvicorn's HTTP protocol class (httptools where installed, else h11: uvicorn's own
    choice) with a deadline of ``header_timeout`` seconds (> 0) on each request's head, for
    ``uvicorn.Config(app, http=http_protocol(seconds))``."""
    from uvicorn.protocols.http.auto import AutoHTTPProtocol

    class HeadDeadline(AutoHTTPProtocol):  # type: ignore[misc, valid-type]
        """Both of uvicorn's protocols start a new ``cycle`` when a request's head is complete,
        and mark the cycle ``response_complete`` when its answer is sent: the deadline runs
        while no cycle runs and ends when a new one starts."""

        def __init__(self, *args: Any, **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)
            self._head_timer: Any = None
            self._head_cycle: Any = None  # the cycle when the deadline began: a new one is the head's

        def connection_made(self, transport: Any) -> None:
            super().connection_made(transport)
            self._start_deadline()

        def data_received(self, data: bytes) -> None:
            if self._head_timer is None and (self.cycle is None or self.cycle.response_complete):
                self._start_deadline()  # a later request's first byte
            super().data_received(data)
            if self._head_timer is not None and self.cycle is not self._head_cycle:
                self._stop_deadline()  # the head is complete: its request runs

        def connection_lost(self, exc: Exception | None) -> None:
            self._stop_deadline()
            super().connection_lost(exc)

        def _start_deadline(self) -> None:
            self._head_cycle = self.cycle
            self._head_timer = self.loop.call_later(header_timeout, self._head_timed_out)

        def _stop_deadline(self) -> None:
            if self._head_timer is not None:
                self._head_timer.cancel()
                self._head_timer = None

        def _head_timed_out(self) -> None:
            self._head_timer = None
            if self.transport.is_closing():
                return
            self.logger.info("%s: the request head did not arrive within %g s: answered 408, closed",
                             "%s:%d" % tuple(self.client[:2]) if self.client else "a client", header_timeout)
            self.transport.write(timeout_answer(header_timeout))
            self.transport.close()

    return HeadDeadline
