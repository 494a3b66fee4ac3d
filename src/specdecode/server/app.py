"""The FastAPI app of ``specdecode serve``: its middleware, the routes of every API (:mod:`.dialects`, run by
:mod:`.runner`), model cards, health, metrics and the page.

FastAPI, Starlette and prometheus_client are imported inside the functions that use them
(:func:`create_app` and the routes), so that importing :mod:`specdecode.server` (as the CLI
does for every command) does not load them.
"""

from __future__ import annotations

import contextlib
import time
from dataclasses import replace
from typing import TYPE_CHECKING, Any

from ..control.invariance import check_strict_allowed
from .access import AccessGuard, APIKeyGuard, DrainUnread, HostOriginPolicy, error_response, normalize_origin
from .config import ServerOptions
from .dialects import DIALECTS
from .metrics import Metrics
from .page import UI_FILES, cost_view, info_view, placement_view, ui_file
from .protocol import APIError, json_repr
from .responses_api import ResponseStore
from .runner import RouteRunner
from .utility import UtilityRoutes
from .worker import Worker

if TYPE_CHECKING:
    from fastapi import FastAPI, Request
    from fastapi.responses import JSONResponse, Response


# Paths served without the API key: liveness and monitoring, and the page's files (the page
# asks for the key itself): no generated text.
OPEN_PATHS = frozenset({"/health", "/metrics", *UI_FILES})


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
                           allow_headers=["Authorization", "Content-Type", "x-api-key", "anthropic-version",
                                          "anthropic-beta", "anthropic-dangerous-direct-browser-access"],
                           max_age=600)
    app.add_middleware(AccessGuard, policy=HostOriginPolicy(options.host, options.allowed_hosts, options.cors_origins),
                       on_reject=lambda: worker.metrics.rejected.labels(reason="forbidden").inc())
    app.add_middleware(DrainUnread, body_timeout=options.body_timeout)
    _add_error_handlers(app)
    _Routes(app, decoder, options, worker).add_to(app)
    return app


def _add_error_handlers(app: FastAPI) -> None:
    """Every error in its API's shape (OpenAI's; Ollama's under /api/, Anthropic's under
    /v1/messages: :func:`.access.error_response`): APIError as it is,
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
        if exc.status_code == 404 and exc.detail == "Not Found":
            detail = _no_route(app, request.method, request.url.path)
        return error_response(APIError(exc.status_code, detail, type=kind), request.url.path)

    @app.exception_handler(RequestValidationError)
    async def _validation_error(request: Request, exc: RequestValidationError) -> JSONResponse:
        return error_response(APIError(400, f"invalid request: {exc.errors()}"), request.url.path)

    @app.exception_handler(Exception)
    async def _internal_error(request: Request, exc: Exception) -> JSONResponse:
        error = APIError(500, f"internal error: {type(exc).__name__}: {exc}", type="server_error")
        return error_response(error, request.url.path)


def _no_route(app: FastAPI, method: str, path: str) -> str:
    """A 404's message for a path no route serves: the routes under its first segment (Ollama's
    under /api/, OpenAI's under /v1/), else every route (issue 61: a bare "Not Found")."""
    paths = sorted({r.path for r in app.routes if hasattr(r, "methods") and "{" not in r.path and r.path != "/"})
    top = "/" + path.strip("/").split("/")[0] + "/"
    near = [p for p in paths if p.startswith(top)] if len(top) > 2 else []
    where = f"under {top} this server serves " if near else "this server serves "
    return f"{method} {path}: no such endpoint; {where}{', '.join(near or paths)}"


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
        self.store = ResponseStore()  # the Responses API's stored responses
        self.shared: dict[str, Any] = {}  # what a dialect keeps per server (Ollama's model card)
        # The names clients may send as model: the served one and its aliases (--served-model-name).
        self.aliases = frozenset({self.model_name, decoder.target_name, *options.served_model_names})
        self.runner = RouteRunner(self)

    def resolve_model(self, body: Any) -> Any:
        """body with an alias of the served model (``--served-model-name``) in ``model`` replaced
        by the served name, so that every dialect's model check accepts it."""
        if isinstance(body, dict) and isinstance(body.get("model"), str) and body["model"] in self.aliases \
                and body["model"] != self.model_name:
            return {**body, "model": self.model_name}
        return body

    def add_to(self, app: FastAPI) -> None:
        for dialect in DIALECTS:  # the generation routes, one runner (server/runner.py, server/dialects.py)
            app.add_route(dialect.path, self.runner.handler(dialect), methods=["POST"])
            for path, handler, methods in dialect.routes(self):
                app.add_route(path, handler, methods=methods)
        UtilityRoutes(self).add_to(app)  # llama.cpp's /tokenize, /detokenize, /props
        app.add_route("/v1/models", self.list_models, methods=["GET"])
        app.add_route("/v1/models/{model_id:path}", self.get_model, methods=["GET"])
        app.add_route("/health", self.health, methods=["GET"])
        app.add_route("/metrics", self.prometheus_metrics, methods=["GET"])
        app.add_route("/v1/specdecode/info", self.info, methods=["GET"])
        app.add_route("/v1/specdecode/costs", self.costs, methods=["GET"])
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

    async def list_models(self, request: Request) -> Response:
        from fastapi.responses import JSONResponse

        # The served name first, then its aliases (--served-model-name), each a card, as vLLM lists them.
        names = [self.model_name] + [n for n in self.options.served_model_names if n != self.model_name]
        return JSONResponse({"object": "list", "data": [_model_card(n, self.created, self.worker.n_ctx)
                                                        for n in names]})

    async def get_model(self, request: Request) -> Response:
        from fastapi.responses import JSONResponse

        model_id = request.path_params["model_id"]
        if model_id not in self.aliases:
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
