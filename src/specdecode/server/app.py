"""The FastAPI app of ``specdecode serve``: routes, streams as server-sent events, model cards (the bodies are :mod:`.responses`').

FastAPI, Starlette and prometheus_client are imported inside the functions that use them
(:func:`create_app` and the routes), so that importing :mod:`specdecode.server` (as the CLI
does for every command) does not load them.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from dataclasses import replace
from typing import TYPE_CHECKING, Any, Callable

from ..control.invariance import check_strict_allowed
from .access import AccessGuard, APIKeyGuard, DrainUnread, HostOriginPolicy, error_response, normalize_origin
from .body import read_body
from . import infill
from .config import ServerOptions
from .metrics import Metrics
from .ollama import OllamaRoutes
from .page import UI_FILES, cost_view, info_view, placement_view, ui_file
from .protocol import APIError, json_repr, parse_json_body, parse_request
from .responses import full_response, stream
from .responses_api import ResponseStore, ResponsesRequest, parse_responses, rename_error
from .responses_events import ResponseBuilder, stream_events
from .jobs import Job, closing_stream
from .worker import Worker

if TYPE_CHECKING:
    from fastapi import FastAPI, Request
    from fastapi.responses import JSONResponse, Response


# Paths served without the API key: liveness and monitoring, and the page's files (the page
# asks for the key itself): no generated text.
OPEN_PATHS = frozenset({"/health", "/metrics", *UI_FILES})


class _Disconnected(Exception):
    pass


async def _wait_disconnect(request: Request) -> None:
    # The body has been read, so the next message the server delivers is the disconnect.
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


async def _next_event(job: Job, disconnect: asyncio.Task) -> tuple[str, Any]:
    get = asyncio.ensure_future(job.events.get())
    done, _ = await asyncio.wait({get, disconnect}, return_when=asyncio.FIRST_COMPLETED)
    if get in done:
        return get.result()
    get.cancel()
    raise _Disconnected()


def _model_card(model_name: str, created: int, n_ctx: int) -> dict:
    """A model's card: its context size in tokens as vLLM names it (max_model_len) and as LM
    Studio and the clients reading it do (context_length)."""
    return {"id": model_name, "object": "model", "created": created, "owned_by": "specdecode", "max_model_len": n_ctx,
            "context_length": n_ctx}


def create_app(decoder: Any, options: ServerOptions | None = None, **fields: Any) -> FastAPI:
    """Build the OpenAI-compatible app around a loaded :class:`specdecode.api.Decoder`.

    options: the server's :class:`ServerOptions` (the app reads model_name, default the
    decoder's target_name; max_queue; max_body_bytes; api_key; warmup), or its fields as
    keywords (which also override those of ``options``), e.g. ``create_app(dec,
    max_queue=4, warmup=True)``. host, port and the Ray options are the caller's to apply.
    The app owns a worker thread (started and stopped with the app's lifespan) and its
    own Prometheus registry (``app.state.metrics.registry``); the decoder stays the
    caller's to close. Raises SpecDecodeError naming the option for a bad value (e.g.
    max_queue < 1, max_body_bytes < 1 or an empty api_key).
    """
    from fastapi import FastAPI

    options = replace(options or ServerOptions(), **fields)
    if options.model_name is None:
        options = replace(options, model_name=decoder.target_name)
    if options.strict:
        check_strict_allowed(decoder.target, param="strict")
    worker = Worker(decoder, options, lambda w: Metrics(w.queue_len, w.running))

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI):
        worker.start()
        try:
            yield
        finally:
            worker.stop()

    app = FastAPI(title="specdecode", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)
    app.state.worker = worker
    app.state.metrics = worker.metrics
    app.state.model_name = options.model_name
    app.state.options = options
    app.state.replica = None  # set by a Ray Serve replica (server.ray_serve)
    # Middleware added last runs first: the drain of unread bodies, Host and Origin, then CORS
    # (which answers a listed origin's preflight), then the API key.
    if options.api_key is not None:
        app.add_middleware(APIKeyGuard, api_key=options.api_key, open_paths=OPEN_PATHS,
                           on_reject=lambda: worker.metrics.rejected.labels(reason="unauthorized").inc())
    if options.cors_origins:
        from starlette.middleware.cors import CORSMiddleware

        app.add_middleware(CORSMiddleware, allow_origins=[normalize_origin(o) or o for o in options.cors_origins],
                           allow_methods=["GET", "POST"],
                           allow_headers=["Authorization", "Content-Type"], max_age=600)
    app.add_middleware(AccessGuard, policy=HostOriginPolicy(options.host, options.allowed_hosts, options.cors_origins),
                       on_reject=lambda: worker.metrics.rejected.labels(reason="forbidden").inc())
    app.add_middleware(DrainUnread, body_timeout=options.body_timeout)
    _add_error_handlers(app)
    _Routes(app, decoder, options, worker).add_to(app)
    return app


def _add_error_handlers(app: FastAPI) -> None:
    """Every error as an OpenAI-style error body (Ollama's under /api/): APIError as it is,
    Starlette's HTTP errors (404 for no route, 405, ...), validation errors as 400, anything else as 500."""
    from fastapi.exceptions import RequestValidationError
    from starlette.exceptions import HTTPException as StarletteHTTPException

    @app.exception_handler(APIError)
    async def _api_error(request: Request, exc: APIError) -> JSONResponse:
        return error_response(exc, request.url.path)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        kind = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
        detail = f"{request.method} {request.url.path}: {exc.detail}"
        return error_response(APIError(exc.status_code, detail, type=kind), request.url.path)

    @app.exception_handler(RequestValidationError)
    async def _validation_error(request: Request, exc: RequestValidationError) -> JSONResponse:
        return error_response(APIError(400, f"invalid request: {exc.errors()}"), request.url.path)

    @app.exception_handler(Exception)
    async def _internal_error(request: Request, exc: Exception) -> JSONResponse:
        error = APIError(500, f"internal error: {type(exc).__name__}: {exc}", type="server_error")
        return error_response(error, request.url.path)


class _Routes:
    """The app's endpoints, around its worker.

    Plain Starlette routes: the endpoints take the Request itself and parse the body by
    hand, so that every malformed or unsupported input gets an OpenAI-style 4xx.
    """

    def __init__(self, app: FastAPI, decoder: Any, options: ServerOptions, worker: Worker) -> None:
        self.app = app
        self.decoder = decoder
        self.options = options
        self.model_name: str = options.model_name
        self.worker = worker
        self.metrics = worker.metrics
        self.created = int(time.time())
        self.store = ResponseStore()

    def add_to(self, app: FastAPI) -> None:
        app.add_route("/v1/completions", self.completions, methods=["POST"])
        app.add_route("/v1/chat/completions", self.chat_completions, methods=["POST"])
        app.add_route("/v1/responses", self.responses, methods=["POST"])
        app.add_route("/v1/responses/{response_id}", self.stored_response, methods=["GET", "DELETE"])
        app.add_route("/infill", self.infill, methods=["POST"])
        app.add_route("/v1/models", self.list_models, methods=["GET"])
        app.add_route("/v1/models/{model_id:path}", self.get_model, methods=["GET"])
        app.add_route("/health", self.health, methods=["GET"])
        app.add_route("/metrics", self.prometheus_metrics, methods=["GET"])
        app.add_route("/v1/specdecode/info", self.info, methods=["GET"])
        app.add_route("/v1/specdecode/costs", self.costs, methods=["GET"])
        OllamaRoutes(self).add_to(app)  # /api/...: Ollama's API (server/ollama.py)
        if self.options.ui:
            for path in UI_FILES:
                app.add_route(path, self.page, methods=["GET"])

    async def page(self, request: Request) -> Response:
        """A file of the page (:mod:`.page`)."""
        from fastapi.responses import Response

        content, media = ui_file(request.url.path)
        # No other site may frame the page (a hidden frame could send its ?prompt= request).
        return Response(content, media_type=media, headers={"Cache-Control": "no-cache", "X-Frame-Options": "DENY",
                                                            "Content-Security-Policy": "frame-ancestors 'none'"})

    async def info(self, request: Request) -> Response:
        from fastapi.responses import JSONResponse

        return JSONResponse(info_view(self.decoder, self.model_name))

    async def costs(self, request: Request) -> Response:
        from fastapi.responses import JSONResponse

        return JSONResponse(cost_view(self.decoder, self.model_name))

    @staticmethod
    def speculation(result: Any) -> dict:
        """A choice's statistics, with the draft, K, tree budget and strict mode it ran with,
        as the engine recorded them (:class:`specdecode.stats.Stats`)."""
        return result.stats.to_dict()

    async def completions(self, request: Request) -> Response:
        return await self.serve(request, "completion")

    async def chat_completions(self, request: Request) -> Response:
        return await self.serve(request, "chat")

    async def serve(self, request: Request, kind: str) -> Response:
        """One generation request: read and parse it, queue it (429 when the queue is
        full), then answer its choices in full or as a stream."""
        from fastapi.responses import JSONResponse

        job = await self._submit(request, lambda body: parse_request(body, kind, self.model_name, self.worker.n_ctx,
                                                                     self.worker.tool_format, self.options.strict))
        req = job.req
        first = await self._first_events(request, job)
        if not isinstance(first, list):
            return first
        if first[-1][0] == "error":
            raise first[-1][1]
        if req.stream:
            return closing_stream(stream(kind, self.model_name, req, job, None, self.speculation),
                                  on_close=lambda: self.worker.cancel(job))
        return JSONResponse(full_response(kind, self.model_name, [e[1] for e in first], self.speculation, req.tools))

    async def infill(self, request: Request) -> Response:
        """llama.cpp's ``POST /infill`` (:mod:`.infill`)."""
        return await infill.serve(self, request, closing_stream)

    async def responses(self, request: Request) -> Response:
        """``POST /v1/responses`` (:mod:`.responses_api`): the request translated to chat, run
        like one, answered as a response object or its stream of events; stored (for
        ``previous_response_id`` and ``GET /v1/responses/{id}``) unless ``store`` is false."""
        from fastapi.responses import JSONResponse

        parsed: list[ResponsesRequest] = []

        def parse(body: Any) -> Any:
            parsed.append(parse_responses(body, self.model_name, self.worker.n_ctx, self.worker.tool_format,
                                          self.store, self.options.strict))
            return parsed[0].req

        try:
            job = await self._submit(request, parse)
        except APIError as e:
            raise rename_error(e) from None
        rr = parsed[0]
        builder = ResponseBuilder(rr, self.model_name, self.speculation)

        def keep(response: dict) -> None:
            # One response larger than the whole store is not kept: it says so (store false).
            if rr.store and not self.store.put(response, builder.history(response["output"])):
                response["store"] = False

        first = await self._first_events(request, job)
        if not isinstance(first, list):
            return first
        if first[-1][0] == "error":
            raise rename_error(first[-1][1])
        if rr.req.stream:
            return closing_stream(stream_events(builder, job, None, keep), on_close=lambda: self.worker.cancel(job))
        response = builder.full(first[-1][1][1])
        keep(response)
        return JSONResponse(response)

    async def stored_response(self, request: Request) -> Response:
        """``GET`` (the object) or ``DELETE`` a stored response; 404 naming the id when it is not stored."""
        from fastapi.responses import JSONResponse, Response

        response_id = request.path_params["response_id"]
        found = self.store.response_json(response_id)
        if found is None or (request.method == "DELETE" and not self.store.delete(response_id)):
            raise APIError(404, f"no stored response has the id {json_repr(response_id)}: this server keeps the last "
                           f"{self.store.max_responses} responses made with store true (at most "
                           f"{self.store.max_bytes // 2**20} MiB of their JSON), in memory",
                           type="not_found_error", param="response_id", code="response_not_found")
        if request.method == "DELETE":
            return JSONResponse({"id": response_id, "object": "response.deleted", "deleted": True})
        return Response(found, media_type="application/json")

    async def _first_events(self, request: Request, job: Job) -> list | Response:
        """Every choice of a full response, in order, or a stream's first event ("started":
        its generation's options were accepted and its prompt is about to be read, so the
        stream opens before the prefill, and an error found when the generation begins still
        gets its 4xx status); an error event ends the list. A 499 Response when the client
        leaves first."""
        from fastapi.responses import Response

        req = job.req
        disconnect = asyncio.ensure_future(_wait_disconnect(request))
        try:
            events = [await _next_event(job, disconnect)]
            while not req.stream and events[-1][0] == "choice" and len(events) < req.n:
                events.append(await _next_event(job, disconnect))
        except _Disconnected:
            self.worker.cancel(job)
            return Response(status_code=499)  # nobody reads it; the status shows in the access log
        finally:
            # The stream's own disconnect watch (Starlette's) takes over from here.
            disconnect.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await disconnect
        return events

    async def _submit(self, request: Request, parse: Callable[[Any], Any]) -> Job:
        """The request's job, prepared (:meth:`Worker.prepare`, off the worker thread) and
        queued on the worker. Raises APIError (counted as rejected) for a body not sent as
        JSON (415), too large (413), not arrived within body_timeout (408), invalid, refused
        when prepared (400) or for another model (404), and 429 for a full queue."""
        arrival = time.perf_counter()
        try:
            body = parse_json_body(await read_body(request, self.options.max_body_bytes))
            req = parse(body)
            prepared = await self.worker.preparer.prepare_async(req)
        except APIError as e:
            reason = {404: "model_not_found", 408: "body_timeout", 413: "too_large",
                      415: "unsupported_media_type", 503: "shutting_down"}.get(e.status, "invalid_request")
            self.metrics.rejected.labels(reason=reason).inc()
            raise
        job = Job(req, asyncio.get_running_loop(), arrival, prepared)
        if not self.worker.submit(job):
            if self.worker.stopping:
                raise APIError(503, "the server is shutting down", type="server_error")
            self.metrics.rejected.labels(reason="queue_full").inc()
            slots, queue = self.worker.slots, self.options.max_queue
            raise APIError(429, f"the server is busy: {slots + queue} requests are running or waiting ({slots} "
                           f"slots, max_queue = {queue}); retry later", type="rate_limit_error", code="queue_full")
        return job

    async def list_models(self, request: Request) -> Response:
        from fastapi.responses import JSONResponse

        return JSONResponse({"object": "list", "data": [_model_card(self.model_name, self.created,
                                                                    self.worker.n_ctx)]})

    async def get_model(self, request: Request) -> Response:
        from fastapi.responses import JSONResponse

        model_id = request.path_params["model_id"]
        if model_id != self.model_name:
            raise APIError(404, f"the model {json_repr(model_id)} does not exist: this server serves "
                           f"{json_repr(self.model_name)}", param="model", code="model_not_found")
        return JSONResponse(_model_card(self.model_name, self.created, self.worker.n_ctx))

    async def health(self, request: Request) -> Response:
        from fastapi.responses import JSONResponse

        w = self.worker
        calibration = getattr(self.decoder, "calibration", None)
        return JSONResponse({"status": "ok", "model": self.model_name, "waiting": w.queue_len(),
                             "running": w.running(), "slots": w.slots, "max_queue": self.options.max_queue,
                             "replica": self.app.state.replica,
                             "measuring": calibration.measuring() if calibration is not None else [],
                             "runs_on": placement_view(self.decoder)["runs_on"]})

    async def prometheus_metrics(self, request: Request) -> Response:
        from fastapi.responses import Response
        from prometheus_client.exposition import CONTENT_TYPE_PLAIN_0_0_4

        return Response(self.metrics.render(), media_type=CONTENT_TYPE_PLAIN_0_0_4)
