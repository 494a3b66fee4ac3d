"""One route runner for every API the server speaks (issue 59): an API is a :class:`Dialect`
(how its body becomes the one request model, how its errors and answers look), and
:class:`RouteRunner` does the rest once for all of them: read the body within the limits,
prepare and queue the job (429 when full), wait for its first events (499 when the client
leaves first), then answer whole or as a stream that frees the worker however it ends.

The dialects are listed in :mod:`.dialects`; adding an API is one module with one
:class:`Dialect` and one line there. The job's events are :mod:`.jobs`' typed ones
(:class:`.jobs.Started`, :class:`.jobs.Delta`, :class:`.jobs.ChoiceDone`, :class:`.jobs.Failed`).
"""

from __future__ import annotations

import asyncio
import hashlib
import contextlib
import time
from abc import ABC, abstractmethod
from typing import TYPE_CHECKING, Any, AsyncIterator, Callable, Iterable

from .apierror import APIError
from .body import parse_json_body, read_body
from .jobs import ChoiceDone, Delta, Failed, Job, closing_stream

if TYPE_CHECKING:
    from fastapi import Request
    from fastapi.responses import Response


class StreamWriter:
    """The chunks of one streamed answer, as text to send (server-sent events, NDJSON lines).

    The runner calls :meth:`open` before the prompt is read, then :meth:`delta` and
    :meth:`choice` as the job's events come, and :meth:`close` after the last choice, or
    :meth:`failed` (the stream's last chunks) after an error. Each returns the chunks to send.
    keepalive_s: where set, :meth:`keepalive` is sent after that many seconds without an event
    (a long prompt being read), so that a client's idle timeout does not end the stream.
    """

    keepalive_s: float | None = None

    def keepalive(self) -> str:
        return ""

    def open(self) -> list[str]:
        return []

    def delta(self, event: Delta) -> list[str]:
        return []

    def choice(self, event: ChoiceDone, last: bool) -> list[str]:
        return []

    def failed(self, error: APIError) -> list[str]:
        return []

    def close(self) -> list[str]:
        return []


class Dialect(ABC):
    """One API's shapes around the one request model (:class:`.protocol.GenRequest`).

    path: the route of its generation requests (POST). prefix: the paths whose errors are in
    this dialect's shape (:meth:`error_body`), the server's own 404s and 401s included; None:
    OpenAI's. media_type / stream_headers: its stream's (None: server-sent events' own).

    A subclass gives :meth:`parse` (the body into an object whose ``req`` is the GenRequest, or
    None for a request answered without a job by :meth:`no_job`), :meth:`whole` and
    :meth:`writer`; and, where they differ from OpenAI's, :meth:`rename` (an error's fields in
    the API's names) and :meth:`error_body`. :meth:`routes` lists its other endpoints.
    """

    path: str = ""
    prefix: str | None = None
    media_type: str = "text/event-stream"
    stream_headers: dict | None = None

    def routes(self, server: Any) -> list[tuple[str, Callable, list[str]]]:
        """Other endpoints of this API: (path, handler(request), methods)."""
        return []

    @abstractmethod
    def parse(self, body: Any, server: Any) -> Any:
        """body (decoded JSON) as the API's parsed request, whose ``req`` is the GenRequest to
        run (None: answered by :meth:`no_job`). Raises APIError naming the field at fault."""

    def rename(self, error: APIError, parsed: Any) -> APIError:
        """error with the fields it names in this API's words; parsed: the request, or None when
        the error came before it was parsed."""
        return error

    def error_body(self, error: APIError) -> dict:
        return error.body()

    def no_job(self, parsed: Any, server: Any) -> dict:
        """The answer to a request with nothing to generate (Ollama's load call); only a
        dialect whose parse gives such requests answers one."""
        raise APIError(500, f"{type(self).__name__} parsed a request with nothing to run", type="server_error")

    @abstractmethod
    def whole(self, parsed: Any, choices: list[ChoiceDone], job: Any, server: Any) -> Any:
        """The whole answer (JSON-able) from the choices' ChoiceDone events, in order."""

    @abstractmethod
    def writer(self, parsed: Any, job: Job, server: Any) -> StreamWriter:
        """The writer of this request's stream."""


class Disconnected(Exception):
    pass


async def _wait_disconnect(request: Request) -> None:
    # The body has been read, so the next message the server delivers is the disconnect.
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


async def _next_event(job: Job, disconnect: asyncio.Task) -> Any:
    get = asyncio.ensure_future(job.events.get())
    done, _ = await asyncio.wait({get, disconnect}, return_when=asyncio.FIRST_COMPLETED)
    if get in done:
        return get.result()
    get.cancel()
    raise Disconnected()


async def write_stream(writer: StreamWriter, job: Job, n: int,
                       rename: Callable[[APIError], APIError] = lambda e: e) -> AsyncIterator[str]:
    """A job's stream: the writer's opening chunks, a chunk group per event until the n-th
    choice is done (then :meth:`StreamWriter.close`) or the job fails (then
    :meth:`StreamWriter.failed` with the error renamed); the writer's keepalive while no event
    comes for its keepalive_s."""
    for chunk in writer.open():
        yield chunk
    done = 0
    pending: asyncio.Future | None = None
    try:
        while done < n:
            if writer.keepalive_s is None:
                event = await job.events.get()
            else:
                pending = pending or asyncio.ensure_future(job.events.get())
                finished, _ = await asyncio.wait({pending}, timeout=writer.keepalive_s)
                if not finished:
                    yield writer.keepalive()
                    continue
                event, pending = pending.result(), None
            if isinstance(event, Failed):
                for chunk in writer.failed(rename(event.error)):
                    yield chunk
                return
            if isinstance(event, Delta):
                chunks: Iterable[str] = writer.delta(event)
            elif isinstance(event, ChoiceDone):
                done += 1
                chunks = writer.choice(event, last=done == n)
            else:  # Started: the stream is already open
                continue
            for chunk in chunks:
                yield chunk
    finally:
        if pending is not None:
            pending.cancel()
    for chunk in writer.close():
        yield chunk


class RouteRunner:
    """What every generation route does, once: ``server`` is the app's routes object (its
    worker, options, metrics; :class:`.app._Routes`)."""

    def __init__(self, server: Any) -> None:
        self.server = server

    def handler(self, dialect: Dialect) -> Callable[[Request], Any]:
        async def run(request: Request) -> Response:
            return await self.run(request, dialect)

        return run

    async def run(self, request: Request, dialect: Dialect) -> Response:
        """One generation request of ``dialect``: parsed, prepared, queued, answered whole or
        streamed; every APIError on the way renamed by the dialect and answered in its shape."""
        from fastapi.responses import JSONResponse

        from .access import error_response

        server = self.server
        parsed: list[Any] = []

        def parse(body: Any) -> Any:
            parsed.append(dialect.parse(server.resolve_model(body), server))
            return parsed[0].req

        try:
            job = await self.submit(request, parse)
            if job is None:
                return JSONResponse(dialect.no_job(parsed[0], server))
            first = await self.first_events(request, job)
            if not isinstance(first, list):
                return first  # the client left (499)
            if isinstance(first[-1], Failed):
                raise first[-1].error
            if job.req.stream:
                p = parsed[0]
                chunks = write_stream(dialect.writer(p, job, server), job, job.req.n, lambda e: dialect.rename(e, p))
                return closing_stream(chunks, on_close=lambda: server.worker.cancel(job),
                                      media_type=dialect.media_type, headers=dialect.stream_headers)
            return JSONResponse(dialect.whole(parsed[0], first, job, server))
        except APIError as e:
            return error_response(dialect.rename(e, parsed[0] if parsed else None), request.url.path)

    async def first_events(self, request: Request, job: Job) -> list | Response:
        """Every choice of a full response, in order, or a stream's first event (Started:
        its generation's options were accepted and its prompt is about to be read, so the
        stream opens before the prefill, and an error found when the generation begins still
        gets its 4xx status); a Failed event ends the list. A 499 Response when the client
        leaves first."""
        from fastapi.responses import Response

        req = job.req
        disconnect = asyncio.ensure_future(_wait_disconnect(request))
        try:
            events = [await _next_event(job, disconnect)]
            while not req.stream and isinstance(events[-1], ChoiceDone) and len(events) < req.n:
                events.append(await _next_event(job, disconnect))
        except Disconnected:
            self.server.worker.cancel(job)
            return Response(status_code=499)  # nobody reads it; the status shows in the access log
        finally:
            # The stream's own disconnect watch (Starlette's) takes over from here.
            disconnect.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await disconnect
        return events

    async def submit(self, request: Request, parse: Callable[[Any], Any]) -> Job | None:
        """The request's job, prepared (:meth:`Worker.prepare`, off the worker thread) and
        queued on the worker; None when parse gives no request (nothing to generate). Raises
        APIError (counted as rejected) for a body not sent as JSON (415), too large (413), not
        arrived within body_timeout (408), invalid, refused when prepared (400) or for another
        model (404), and 429 for a full queue."""
        server = self.server
        arrival = time.perf_counter()
        try:
            body = parse_json_body(await read_body(request, server.options.max_body_bytes))
            req = parse(body)
            if req is None:
                return None
            prepared = await server.worker.preparer.prepare_async(req)
        except APIError as e:
            reason = {404: "model_not_found", 408: "body_timeout", 413: "too_large",
                      415: "unsupported_media_type", 503: "shutting_down"}.get(e.status, "invalid_request")
            server.metrics.rejected.labels(reason=reason).inc()
            raise
        job = Job(req, asyncio.get_running_loop(), arrival, prepared, owner=owner_of(request, body))
        if not server.worker.submit(job):
            if server.worker.stopping:
                raise APIError(503, "the server is shutting down", type="server_error")
            server.metrics.rejected.labels(reason="queue_full").inc()
            slots, queue = server.worker.slots, server.options.max_queue
            raise APIError(429, f"the server is busy: {slots + queue} requests are running or waiting ({slots} "
                           f"slots, max_queue = {queue}); retry later", type="rate_limit_error", code="queue_full")
        return job


# What tells one client from another (besides its address): the credential it presents and the
# identity fields of the APIs (OpenAI's user, safety_identifier and prompt_cache_key; Anthropic's
# metadata.user_id). Ollama's API and llama.cpp's /infill have none: the address and key alone.
_CREDENTIAL_HEADERS = ("authorization", "x-api-key")
_IDENTITY_FIELDS = ("user", "safety_identifier", "prompt_cache_key")


def owner_of(request: Request, body: Any) -> str:
    """Who sent a request, as a digest: the client's address, the credential it presented and
    its body's identity fields. A slot's cached prefix written by another owner is reused but
    not reported (:meth:`.worker.Worker._hide_others_cache`)."""
    parts = [request.client.host if request.client else ""]
    parts += [request.headers.get(h, "") for h in _CREDENTIAL_HEADERS]
    if isinstance(body, dict):
        parts += [v if isinstance(v := body.get(k), str) else "" for k in _IDENTITY_FIELDS]
        meta = body.get("metadata")
        parts.append(meta["user_id"] if isinstance(meta, dict) and isinstance(meta.get("user_id"), str) else "")
    return hashlib.sha256("\0".join(parts).encode("utf-8", "surrogatepass")).hexdigest()
