"""What ``specdecode serve`` answers while its models load: the port is bound at once, and
every request gets a 503 that says the model is loading, rather than "connection refused".

:class:`LoadingApp` is the ASGI app uvicorn serves from the start. Its lifespan startup starts
``load`` on a thread of its own (loading the models and building the real app,
:func:`.app.create_app`); meanwhile every HTTP request is answered:

- ``/health``: 503, ``{"status": "loading", "model", "loading_s": seconds since the start,
  "error": {...}}`` (the error object below), so that a load balancer or a script polling for
  200 waits;
- any other path: 503 with OpenAI's error body, ``{"error": {"message": "the model M is
  loading ...", "type": "server_error", "param": null, "code": "model_loading"}}``; under
  ``/api/`` (Ollama's API) Ollama's, ``{"error": "the model M is loading ..."}``;
- each with ``Retry-After: RETRY_AFTER_S`` (the OpenAI SDKs wait that long before retrying a
  503), after the Host and Origin checks of :mod:`.access` (a refused one gets its 403, as it
  would once loaded) and with an unread body drained; no CORS headers (a page of another
  origin listed in ``--cors-origins`` sees a network error until the model is ready) and no
  API key check (the answer holds nothing but the model's name, which ``/health`` gives anyway).

Once ``load`` returns, the real app's own lifespan startup runs (its worker starts) and every
request from then on is handed to it; uvicorn's shutdown runs the real app's lifespan shutdown.
A load that fails calls ``on_failed`` (``serve`` then stops the server and reports the error);
a shutdown during the load (SIGINT, SIGTERM) ends the server at once, and ``serve`` waits for
the load to return (llama.cpp cannot be interrupted inside a load) before it frees the models.

The load may be held back for tests (:data:`LOAD_GATE_ENV`): with it set to a path, the load
starts once that file exists (or the server stops), so that a test observes the loading
answers for as long as it needs, whatever the speed of the machine.
"""

from __future__ import annotations

import asyncio
import os
import threading
import time
from pathlib import Path
from typing import Any, Callable

from . import dialects  # noqa: F401  (the APIs' error shapes, for the answers while loading)
from .access import AccessGuard, DrainUnread, HostOriginPolicy, error_response
from .apierror import APIError
from .config import ServerOptions

RETRY_AFTER_S = 2  # seconds a client is asked to wait before it retries (loading takes seconds)
# Tests only: a path; the load starts once a file is there (see the module docstring).
LOAD_GATE_ENV = "SPECDECODE_TEST_LOAD_GATE"
_GATE_POLL_S = 0.05


class _Lifespan:
    """Runs an ASGI app's lifespan protocol from inside another app's: startup, then shutdown."""

    def __init__(self, app: Any) -> None:
        self._to_app: asyncio.Queue = asyncio.Queue()
        self._from_app: asyncio.Queue = asyncio.Queue()
        scope = {"type": "lifespan", "asgi": {"version": "3.0", "spec_version": "2.0"}, "state": {}}
        self._task = asyncio.ensure_future(app(scope, self._to_app.get, self._from_app.put))

    async def _say(self, what: str) -> None:
        """Send lifespan.<what> and wait for the app's answer; raises RuntimeError when it fails."""
        await self._to_app.put({"type": f"lifespan.{what}"})
        reply = asyncio.ensure_future(self._from_app.get())
        await asyncio.wait({reply, self._task}, return_when=asyncio.FIRST_COMPLETED)
        if not reply.done():
            reply.cancel()
            self._task.result()  # the app's own exception, if it raised one
            raise RuntimeError(f"the app ended its lifespan without answering lifespan.{what}")
        message = reply.result()
        if message["type"] != f"lifespan.{what}.complete":
            raise RuntimeError(message.get("message") or f"lifespan.{what} failed")

    async def startup(self) -> None:
        await self._say("startup")

    async def shutdown(self) -> None:
        await self._say("shutdown")


class LoadingApp:
    """The ASGI app served from the start (see the module docstring).

    load: builds the real ASGI app (on the loader thread; its exceptions go to on_failed).
    model_name: what the loading answers name. options: the server's (Host and Origin policy,
    body timeout). on_ready(): called on the event loop once the real app has started.
    on_failed(error): called on the event loop when load or the real app's startup raised.
    stop(app): tells the real app to stop at once (called by :meth:`closing`). clock: seconds,
    for ``loading_s``.
    """

    def __init__(self, load: Callable[[], Any], model_name: str, options: ServerOptions,
                 on_ready: Callable[[], None], on_failed: Callable[[BaseException], None],
                 stop: Callable[[Any], None] = lambda app: None, clock: Callable[[], float] = time.monotonic) -> None:
        self._load, self._model_name = load, model_name
        self._on_ready, self._on_failed, self._stop, self._clock = on_ready, on_failed, stop, clock
        self._started_at = clock()
        self.app: Any = None  # the real app, once its startup has completed
        self.error: BaseException | None = None
        self._closing = False
        self._thread: threading.Thread | None = None
        self._lifespan: _Lifespan | None = None
        self._starting: asyncio.Future | None = None
        policy = HostOriginPolicy(options.host, options.allowed_hosts, options.cors_origins)
        self._answer = DrainUnread(AccessGuard(self._loading, policy, on_reject=lambda: None), options.body_timeout)

    async def __call__(self, scope: dict, receive: Callable, send: Callable) -> None:
        if scope["type"] == "lifespan":
            return await self._run_lifespan(receive, send)
        if self.app is not None:
            return await self.app(scope, receive, send)
        if scope["type"] == "http":
            return await self._answer(scope, receive, send)
        await send({"type": "websocket.close", "code": 1013})  # 1013: try again later

    async def _loading(self, scope: dict, receive: Callable, send: Callable) -> None:
        """The 503 of a request that arrives while the model loads."""
        from fastapi.responses import JSONResponse

        error = APIError(503, f"the model {self._model_name} is loading: try again in a few seconds",
                         type="server_error", code="model_loading")
        if scope["path"] == "/health":
            response = JSONResponse({"status": "loading", "model": self._model_name,
                                     "loading_s": round(self._clock() - self._started_at, 1),
                                     "error": error.body()["error"]}, status_code=503)
        else:
            response = error_response(error, scope["path"])
        response.headers["Retry-After"] = str(RETRY_AFTER_S)
        await response(scope, receive, send)

    # --- the lifespan: the load starts with it, the real app's runs inside it ---------------
    async def _run_lifespan(self, receive: Callable, send: Callable) -> None:
        while True:
            message = await receive()
            if message["type"] == "lifespan.startup":
                loop = asyncio.get_running_loop()
                self._thread = threading.Thread(target=self._run_load, args=(loop,), name="specdecode-load",
                                                daemon=True)
                self._thread.start()
                await send({"type": "lifespan.startup.complete"})
            elif message["type"] == "lifespan.shutdown":
                self._closing = True
                await self._shutdown_app()
                await send({"type": "lifespan.shutdown.complete"})
                return

    def _run_load(self, loop: asyncio.AbstractEventLoop) -> None:
        """The loader thread: wait for the test gate, load, and hand the result to the loop."""
        gate = os.environ.get(LOAD_GATE_ENV)
        while gate and not Path(gate).exists() and not self._closing:
            time.sleep(_GATE_POLL_S)
        if self._closing:
            return
        try:
            app, error = self._load(), None
        except BaseException as e:  # reported on the loop, and raised again by serve
            app, error = None, e
        try:
            loop.call_soon_threadsafe(self._loaded, app, error)
        except RuntimeError:  # the loop has closed: the server stopped while loading
            pass

    def _loaded(self, app: Any, error: BaseException | None) -> None:
        if error is not None:
            self.error = error
            self._on_failed(error)
        elif not self._closing:
            self._starting = asyncio.ensure_future(self._start_app(app))

    async def _start_app(self, app: Any) -> None:
        lifespan = _Lifespan(app)
        try:
            await lifespan.startup()
        except BaseException as e:
            self.error = e
            self._on_failed(e)
            return
        self._lifespan = lifespan
        if self._closing:
            return  # the shutdown, which waits for this, shuts it down
        self.app = app
        self._on_ready()

    async def _shutdown_app(self) -> None:
        if self._starting is not None:
            await asyncio.shield(self._starting)
        if self._lifespan is not None:
            await self._lifespan.shutdown()

    def closing(self) -> None:
        """The server was told to exit (on the event loop): no real app starts from now on, and
        one that runs is told to stop at once (``stop``)."""
        self._closing = True
        if self.app is not None:
            self._stop(self.app)

    def join(self) -> None:
        """Wait for a load still running (the server has stopped: it returns, or fails, soon)."""
        if self._thread is not None:
            self._thread.join()
