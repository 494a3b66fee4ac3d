"""``specdecode serve``: its options and its handler. The server options become one
:class:`.config.ServerOptions` (checked once, errors naming the flag) that goes to the app
or, with --replicas / --autoscaling, to the Ray Serve deployment."""

from __future__ import annotations

import argparse
import asyncio
import functools
import os
import signal
import socket
from types import FrameType
from typing import Any, Callable

from ..errors import SpecDecodeError
from ..options import add_model_options, add_parallel_option, check_model_args, decoder_from_args, decoder_kwargs
from .config import (DEFAULT_HOST, DEFAULT_MAX_BODY_BYTES, DEFAULT_MAX_QUEUE, DEFAULT_PORT, PREDICTION_BYTES_PER_TOKEN,
                     SENDABLE_KEY, ServerOptions)
from .config import DEFAULT_BODY_TIMEOUT, DEFAULT_HEADER_TIMEOUT, DEFAULT_MAX_UNREAD_BYTES
from ..limits import DEFAULT_CACHE_REUSE

LOOPBACK_HOSTS = ("127.0.0.1", "localhost", "::1")
# The environment variable that gives the API key when --api-key does not (so that the key
# need not appear in the process list).
API_KEY_ENV = "SPECDECODE_API_KEY"


def api_key_from(args: argparse.Namespace) -> str | None:
    """The API key: --api-key if given (it wins), else $SPECDECODE_API_KEY if set and not
    empty, else None (no authentication). Raises SpecDecodeError for an empty --api-key."""
    if args.api_key is not None:
        if not args.api_key:
            raise SpecDecodeError("--api-key is empty: give the key, or leave the option out for no authentication",
                                  param="--api-key")
        return args.api_key
    key = os.environ.get(API_KEY_ENV) or None
    if key is not None and not SENDABLE_KEY.fullmatch(key):  # the value is never shown: it is a key
        raise SpecDecodeError(f"${API_KEY_ENV} is not a key a client can send in 'Authorization: Bearer <key>': "
                              "expected printable ASCII without spaces or line breaks", param=API_KEY_ENV)
    return key


def check_listen_address(host: str, port: int) -> None:
    """That --host resolves and --port is free there, found before the models load (uvicorn
    says so only after: "[Errno -2] Name or service not known", naming neither). Raises
    SpecDecodeError naming the option. Port 0 (any free port) is not checked."""
    try:
        infos = socket.getaddrinfo(host, port or None, type=socket.SOCK_STREAM)
    except (socket.gaierror, UnicodeError) as e:
        raise SpecDecodeError(f"--host {host}: not an address of this machine to listen on "
                              f"({getattr(e, 'strerror', None) or e})", param="--host") from None
    if not port:
        return
    family, kind, proto, _, address = infos[0]
    with socket.socket(family, kind, proto) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as uvicorn binds
        try:
            probe.bind(address)
        except OSError as e:
            raise SpecDecodeError(f"--host {host} --port {port}: cannot listen there ({e.strerror or e}; another "
                                  "server may hold the port)", param="--port") from None


def cmd_serve(args: argparse.Namespace) -> int:
    """Handler of ``specdecode serve``: bind the port, answer 503 while the pair loads on a
    thread of its own (:mod:`.loading`), then serve until interrupted.

    Returns the exit status (0; also after SIGTERM, while loading too). Raises SpecDecodeError
    naming the option for an out-of-range --port, --max-queue, --max-body-bytes, --metrics-port
    or --replicas, an empty --api-key, or any model option (before binding the port), and for
    models that cannot be loaded (once the server has stopped again); KeyboardInterrupt for
    SIGINT.
    """
    import uvicorn

    from .app import create_app
    from .connection import http_protocol
    from .loading import LoadingApp

    options = ServerOptions.from_args(args, api_key_from(args))
    check_listen_address(options.host, options.port)
    if options.host not in LOOPBACK_HOSTS:
        if options.api_key is None:
            print(f"specdecode: warning: serving on {options.host}: the server has no authentication (set --api-key "
                  f"or {API_KEY_ENV})", flush=True)
        else:
            print(f"specdecode: serving on {options.host}: the API key protects /v1; /health and /metrics stay open",
                  flush=True)
        if not options.allowed_hosts:
            print("specdecode: clients must reach the server by IP address or localhost; for a host name, add "
                  "--allowed-hosts NAME (other Host headers get 403)", flush=True)
    if options.on_ray:
        return _serve_on_ray(args, options)
    if options.metrics_port is not None:
        raise SpecDecodeError("--metrics-port applies to Ray Serve replicas (--replicas or --autoscaling); a single "
                              "server serves its metrics at /metrics", param="--metrics-port")
    check_model_args(args)  # a bad model option is named before the port is bound
    where = f"http://{options.host}:{options.port}"
    loaded: dict = {}

    def load() -> Any:  # on the loader thread, while the port answers 503 (server.loading)
        loaded["decoder"] = decoder_from_args(args, progress=True)
        return create_app(loaded["decoder"], options)

    def ready() -> None:
        print(f"specdecode: serving {args.target!r} (draft {args.draft!r}, K={args.num_speculative_tokens}, "
              f"{args.parallel} slot{'s' if args.parallel > 1 else ''}) on {where}/v1", flush=True)
        if options.ui:
            print(f"specdecode: the page: {where}/", flush=True)

    loading = LoadingApp(load, options.model_name or args.target, options, on_ready=ready,
                         on_failed=lambda e: setattr(server, "should_exit", True),
                         stop=lambda app: app.state.worker.stop(timeout=0))
    config = uvicorn.Config(loading, host=options.host, port=options.port, log_level="info",
                            http=http_protocol(options.header_timeout))
    server = _server_class()(config, on_exit=loading.closing)
    print(f"specdecode: loading {args.target!r}; {where} answers 503 (model_loading) until it is ready", flush=True)
    try:
        server.run()
    finally:
        loading.join()  # a load still running when the server stopped (llama.cpp cannot be interrupted)
        if "decoder" in loaded:
            loaded["decoder"].close()
    if server.interrupted:
        raise KeyboardInterrupt  # SIGINT: exit status 130, once the server has stopped
    if loading.error is not None:
        raise loading.error  # one line from the CLI, as a load before the server started gave
    return 0


@functools.cache
def _server_class() -> type:
    """uvicorn.Server (imported on first use) that stops the generations when asked to exit.

    uvicorn, told to stop (SIGINT, SIGTERM), stops accepting connections and then waits for
    the open ones to close before it runs the app's shutdown, which stops the worker; a
    stream would hold it until its last token. This one first calls ``on_exit`` (which
    must not block: it tells the worker to stop), from the event loop rather than inside
    the signal handler, which may have interrupted the loop's own use of the worker's lock:
    waiting requests get 503, running ones end after the current step, a stream with an
    error chunk and ``data: [DONE]``; then the connections close and the process exits.
    SIGTERM, the ordinary way to stop a service, then exits with status 0, where uvicorn
    would raise the signal again once shut down (death by the signal). SIGINT sets
    ``interrupted``, and ``serve`` raises KeyboardInterrupt once the server has stopped (exit
    status 130): uvicorn would raise the signal again inside asyncio's runner, whose own SIGINT
    handler then cancels a main task that may finish first, and the process exited 0 (seen
    under load, a SIGINT during the load)."""
    import uvicorn

    class StoppingServer(uvicorn.Server):
        def __init__(self, config: uvicorn.Config, on_exit: Callable[[], None]) -> None:
            super().__init__(config)
            self._on_exit = on_exit
            self.interrupted = False

        def handle_exit(self, sig: int, frame: FrameType | None) -> None:
            if not self.should_exit:
                try:
                    asyncio.get_running_loop().call_soon_threadsafe(self._on_exit)
                except RuntimeError:  # no event loop runs (yet): nothing can hold the lock
                    self._on_exit()
            super().handle_exit(sig, frame)
            self.interrupted = self.interrupted or sig == signal.SIGINT
            if sig in (signal.SIGTERM, signal.SIGINT) and hasattr(self, "_captured_signals"):
                self._captured_signals = [s for s in self._captured_signals if s != sig]

    return StoppingServer


def _serve_on_ray(args: argparse.Namespace, options: ServerOptions) -> int:
    """--replicas / --autoscaling: the app as a Ray Serve deployment (server.ray_serve)."""
    from .ray_serve import serve_replicas

    from ..backends.llama_cpp.buffers import requested_buffers
    from ..backends.llama_cpp.lib import default_threads, flash_attention

    check_model_args(args)
    flash_attention(), requested_buffers()  # a bad llama.cpp setting is named here, not by a failed deployment
    kwargs = decoder_kwargs(args, progress=False)
    if kwargs["n_threads"] is None:  # share the cores among the replicas of this machine

        kwargs["n_threads"] = max(1, default_threads() // (options.replicas or 1))
    serve_replicas(kwargs, options)
    return 0


def add_serve_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    """Register the ``serve`` subcommand (options and handler) on the CLI's subparsers.

    The model options are the shared ones (:func:`specdecode.options.add_model_options`);
    serve adds --parallel, --host, --port, --max-queue, --api-key, --max-body-bytes and, for
    Ray Serve, --replicas, --autoscaling and --metrics-port (the fields of
    :class:`.config.ServerOptions`).
    """
    s = subparsers.add_parser("serve", help="serve an OpenAI-compatible HTTP API",
                              description="Serve an OpenAI-compatible HTTP API (/v1/completions, "
                                          "/v1/chat/completions, /v1/responses, /v1/models, /health, /metrics), Anthropic's "
                                          "/v1/messages, Ollama's /api/ and llama.cpp's /infill. "
                                          "Clients send "
                                          "--target as the model id.")
    add_model_options(s)
    add_parallel_option(s)
    s.add_argument("--host", default=DEFAULT_HOST, help="address to listen on (default: %(default)s, loopback only)")
    s.add_argument("--port", type=int, default=DEFAULT_PORT, help="port (default: %(default)s)")
    s.add_argument("--max-queue", type=int, default=DEFAULT_MAX_QUEUE,
                   help="requests that may wait for a free slot, besides the --parallel running ones; more get 429 "
                        "(default: %(default)s)")
    s.add_argument("--api-key", default=None, metavar="KEY",
                   help=f"require 'Authorization: Bearer KEY' on every /v1 request (401 otherwise; /health and "
                        f"/metrics stay open). Default: ${API_KEY_ENV} if set, else no authentication. The "
                        f"environment variable keeps the key out of the process list")
    s.add_argument("--served-model-name", action="append", default=None, metavar="NAME[,NAME...]",
                   help="the model ids clients may send (vLLM's option): the first is the one the server reports "
                        "(/v1/models, answers), the others aliases, e.g. the names an agent sends for its side "
                        "calls (claude-haiku-4-5). Default: --target's name")
    s.add_argument("--max-body-bytes", type=int, default=DEFAULT_MAX_BODY_BYTES, metavar="N",
                   help="largest request body read, in bytes; a larger one gets 413 (default: %(default)s = 4 MiB)")
    s.add_argument("--allowed-hosts", action="append", default=None, metavar="NAME[,NAME...]",
                   help="Host names to serve besides localhost, loopback addresses and --host (e.g. my-box.local, "
                        "the name a proxy forwards; * for any). Other Host headers get 403: a web page whose site "
                        "re-points its name to this machine (DNS rebinding) cannot use the server")
    s.add_argument("--cors-origins", action="append", default=None, metavar="ORIGIN[,ORIGIN...]",
                   help="origins whose web pages may call the server (e.g. http://localhost:3000), answered with "
                        "CORS headers; a request from any other site's page gets 403. Default: none but the "
                        "server's own page")
    s.add_argument("--max-prediction-tokens", type=int, default=None, metavar="N",
                   help=f"the longest prediction a request may send, in tokens (default: the context size; "
                        f"its text may hold {PREDICTION_BYTES_PER_TOKEN} bytes a token); longer ones get 400")
    s.add_argument("--strict", action="store_true",
                   help="strict mode for every request (a request may still send \"speculative\": {\"strict\": "
                        "false}): verify only in blocks whose logits equal one-token steps, so that each greedy "
                        "answer is bit for bit plain decoding's alone, in any batch, with any drafter (slower: "
                        "docs/server.md gives the cost)")
    s.add_argument("--no-ui", dest="ui", action="store_false",
                   help="do not serve the page at / (a chat that shows which tokens the drafts gave, the speed "
                        "against plain decoding and the cost curve)")
    s.add_argument("--max-unread-bytes", type=int, default=DEFAULT_MAX_UNREAD_BYTES, metavar="N",
                   help="the most bytes of output a stream may hold unread in the server; a stream whose client "
                        "falls further behind is ended with an error event and its slot freed (default: "
                        "%(default)s = 1 MiB)")
    s.add_argument("--header-timeout", type=float, default=DEFAULT_HEADER_TIMEOUT, metavar="SECONDS",
                   help="seconds a connection may take to send a request's head (request line and headers); "
                        "past them it gets 408 and is closed (default: %(default)g)")
    s.add_argument("--body-timeout", type=float, default=DEFAULT_BODY_TIMEOUT, metavar="SECONDS",
                   help="seconds a request's whole body may take to arrive after its head; past them it gets 408 "
                        "and the connection is closed (default: %(default)g)")
    s.add_argument("--cache-reuse", type=int, default=DEFAULT_CACHE_REUSE, metavar="N",
                   help="fill-in-the-middle requests (/infill, suffix): cached chunks of at least N tokens that the "
                        "prompt holds after its changed part are shifted into place instead of evaluated again "
                        "(llama.cpp's option; close to, not bit for bit, a fresh evaluation); 0: off "
                        "(default: %(default)s)")
    s.add_argument("--replicas", type=int, default=None, metavar="N",
                   help="run N replicas of this server as a Ray Serve deployment behind Ray's HTTP proxy on "
                        "--host/--port (needs pip install -e '.[ray]'; each replica loads the models and runs "
                        "--parallel slots; threads default to the cores / N)")
    s.add_argument("--autoscaling", default=None, metavar="JSON",
                   help="Ray Serve's autoscaling_config as JSON, e.g. '{\"min_replicas\": 1, \"max_replicas\": 4}' "
                        "(implies Ray Serve; replaces --replicas)")
    s.add_argument("--metrics-port", type=int, default=None, metavar="PORT",
                   help="with Ray Serve: each replica also serves its own /metrics on PORT + its rank")
    s.set_defaults(func=cmd_serve, background_costs=True)  # answer at once; measure between requests
    return s
