"""Who may call the server, checked before a request reaches a route: the Host and Origin
headers (against DNS rebinding and cross-site requests), CORS for the origins the operator
allows, the API key, and the media type of a request body.

A server on 127.0.0.1 is reachable by every web page the user opens: the browser sends a
page's request to it, and a site that re-points its own name to 127.0.0.1 (DNS rebinding)
can read the answers too, as happened to local model servers before (Ollama's advisory,
fixed by checking Host and Origin). So, as local servers do:

- **Host** must name this server: ``localhost``, a loopback address (127.0.0.0/8, ``[::1]``),
  the address it listens on, or a name given with ``serve --allowed-hosts`` (``*``: any).
  On a wildcard address (0.0.0.0, ::) any IP literal is accepted too: a rebinding page
  always sends its own name. The port is not compared (a proxy may map it).
- **Origin**, when a browser sends one, must be the server's own (the origin whose
  authority is the Host header, whatever its scheme, for a TLS proxy in front: the page at
  ``/``), or listed in ``serve --cors-origins``;
  those get CORS headers, preflight included (Starlette's CORSMiddleware). ``null`` (a
  sandboxed frame, a file) counts as another site.
- **Only JSON is JSON**: a POST body must be sent as ``application/json`` (a charset
  parameter allowed); a form or ``text/plain`` body, which any page may send without a
  preflight, gets 415.

A refused request gets 403 with an OpenAI-style error naming the header (``param`` =
``Host`` or ``Origin``; under ``/api/``, Ollama's API, its ``{"error": message}``), before
its body is read.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import hashlib
import hmac
import ipaddress
from typing import TYPE_CHECKING, Any, Callable, Sequence
from urllib.parse import urlsplit

from .apierror import APIError

if TYPE_CHECKING:
    from fastapi.responses import JSONResponse

WILDCARD_HOSTS = ("0.0.0.0", "::", "")
# A refused request's body is read to its end, and discarded, up to this many bytes; past
# them the connection is closed unread (and the client may see a reset, not the answer).
MAX_DRAIN_BYTES = 1 << 30
LOOPBACK_NAMES = ("localhost",)
_DEFAULT_PORTS = {"http": "80", "https": "443"}
# The server's log of refused requests (uvicorn's access log says only "400 Bad Request").
LOG = logging.getLogger("specdecode.server")


def log_refusal(e: APIError, path: str) -> None:
    """One line in the server's log for a request refused with a 4xx, with what says why (the
    error's type, code and the field at fault) and never the body's contents or the message
    (which may quote them): ``400 /v1/responses: invalid_request_error, param reasoning``; for
    a model the server does not serve, the message (the name asked for and the name served), so
    that an operator sees what to map with ``--served-model-name``."""
    def short(v: Any) -> str:  # a field name may come from the body: one line, at most 80 characters
        return str(v)[:80].encode("unicode_escape").decode("ascii")

    reason = ", ".join([e.type] + [f"{k} {short(v)}" for k, v in (("code", e.code), ("param", e.param)) if v])
    if e.status == 404 and e.param == "model":  # the name asked for, to alias it (--served-model-name)
        reason += ": " + short(e.message)
    LOG.warning("%d %s: %s", e.status, short(path) or "?", reason)


# (path prefix, the error body of the API served there), registered by server/dialects.py.
ERROR_SHAPES: list[tuple[str, Callable[[APIError], dict]]] = []


def register_error_shape(prefix: str, body: Callable[[APIError], dict]) -> None:
    """Answer errors of requests under prefix with body(error) (an API's own shape)."""
    if (prefix, body) not in ERROR_SHAPES:
        ERROR_SHAPES.append((prefix, body))


def error_response(e: APIError, path: str = "") -> JSONResponse:
    """e as a JSON response with its status (a 429 also says when to retry, in seconds; a
    401 names the scheme expected): OpenAI's error body, or for a request to ``path`` under a
    prefix registered with :func:`register_error_shape` that API's (Ollama's ``{"error":
    message}`` under ``/api/``, Anthropic's under ``/v1/messages``: server/dialects.py)."""
    from fastapi.responses import JSONResponse

    shape = next((body for prefix, body in ERROR_SHAPES if path.startswith(prefix)), APIError.body)
    if 400 <= e.status < 500:
        log_refusal(e, path)
    headers = {"Retry-After": "1"} if e.status == 429 else {"WWW-Authenticate": "Bearer"} if e.status == 401 else None
    try:
        return JSONResponse(shape(e), status_code=e.status, headers=headers)
    except UnicodeEncodeError:  # a message quoting text that is no Unicode (a lone surrogate): escaped
        def escaped(v: Any) -> Any:
            return v.encode("utf-8", "backslashreplace").decode() if isinstance(v, str) else v

        clean = APIError(e.status, escaped(e.message), type=e.type, param=escaped(e.param), code=escaped(e.code))
        return JSONResponse(shape(clean), status_code=e.status, headers=headers)


async def drain(scope: dict, receive: Callable) -> None:
    """Read and discard what is left of a request's body before it is answered early (an
    error before or while the body is read): a server that closes a connection with unread
    data resets it, and the client loses the answer (urllib and every client that sends
    ``Connection: close``). At most MAX_DRAIN_BYTES are read; nothing is read from a client
    that waits for ``100 Continue`` (it sends no body after a final answer)."""
    if (b"expect", b"100-continue") in [(k.lower(), v.lower()) for k, v in scope.get("headers", ())]:
        return
    seen = 0
    while seen <= MAX_DRAIN_BYTES:
        message = await receive()
        if message["type"] != "http.request":
            return
        seen += len(message.get("body", b""))
        if not message.get("more_body", False):
            return


class BodyTimeout(APIError):
    """408: a request's body did not arrive within body_timeout seconds of its head."""

    def __init__(self, seconds: float) -> None:
        super().__init__(408, f"the request body did not arrive within {seconds:g} seconds of its head "
                         "(--body-timeout)", code="body_timeout")


class DrainUnread:
    """ASGI middleware, outermost: whatever answers a request before reading its whole body
    (a refused Host, Origin or key, a 413, 415, 404 or 405, a GET with a body), the rest of
    the body is read and discarded (:func:`drain`) before the answer starts, so that a client
    that closes after sending reads the answer instead of a reset connection.

    body_timeout: seconds (None: no bound) the whole body may take to arrive, from the head
    (when the app is called): a read of the body past them raises :class:`BodyTimeout`
    (answered 408 by the app's error handler), and the answer to such a request closes the
    connection (``Connection: close``) without draining, since a client trickling its body
    would hold the drain as long as it held the read."""

    def __init__(self, app: Any, body_timeout: float | None = None) -> None:
        self.app = app
        self.body_timeout = body_timeout

    async def __call__(self, scope: dict, receive: Callable, send: Callable) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        timeout = self.body_timeout
        deadline = None if timeout is None else asyncio.get_running_loop().time() + timeout
        body_done = expired = started = False

        async def tracked() -> dict:
            nonlocal body_done, expired
            if body_done or deadline is None:  # after the body: the disconnect, however late
                message = await receive()
            else:
                try:
                    async with asyncio.timeout_at(deadline):
                        message = await receive()
                except TimeoutError:
                    body_done = expired = True
                    raise BodyTimeout(timeout) from None
            if message["type"] != "http.request" or not message.get("more_body", False):
                body_done = True
            return message

        async def answer(message: dict) -> None:
            nonlocal started
            if message["type"] == "http.response.start" and not started:
                started = True
                if not body_done:
                    with contextlib.suppress(BodyTimeout):
                        await drain(scope, tracked)
                if expired:
                    message = {**message, "headers": [*message.get("headers", ()), (b"connection", b"close")]}
            await send(message)

        await self.app(scope, tracked, answer)


def _ip(name: str) -> ipaddress.IPv4Address | ipaddress.IPv6Address | None:
    try:
        return ipaddress.ip_address(name)
    except ValueError:
        return None


def split_host(value: str) -> tuple[str, str]:
    """A Host header (or an origin's authority) as (name, port): lower case, without the
    brackets of an IPv6 literal or a trailing dot; port "" when absent.
    ``split_host("[::1]:8000") == ("::1", "8000")``, ``split_host("LocalHost.") == ("localhost", "")``."""
    value = value.strip().lower()
    if value.startswith("["):
        name, _, rest = value[1:].partition("]")
        port = rest[1:] if rest.startswith(":") else rest
    elif value.count(":") == 1:
        name, _, port = value.partition(":")
    else:  # a bare name, or an unbracketed IPv6 literal
        name, port = value, ""
    if port and not port.isdigit():  # "localhost:evil", "[::1]evil": names no server
        return "", ""
    return name.rstrip("."), port


def normalize_origin(origin: str) -> str | None:
    """An origin as browsers send it, ``scheme://host[:port]`` in lower case, without the
    scheme's default port (and a trailing "/" dropped); None when it is no origin (a path,
    a query, no host). ``"null"`` stays ``"null"``."""
    origin = origin.strip()
    if origin.lower() == "null":
        return "null"
    parts = urlsplit(origin.rstrip("/") if origin.endswith("/") and origin.count("/") == 3 else origin)
    if parts.scheme not in ("http", "https") or not parts.netloc or parts.path or parts.query or parts.fragment:
        return None
    name, port = split_host(parts.netloc)
    if not name or "@" in parts.netloc:
        return None
    shown = f"[{name}]" if ":" in name else name
    return f"{parts.scheme}://{shown}" + (f":{port}" if port and port != _DEFAULT_PORTS[parts.scheme] else "")


class HostOriginPolicy:
    """The Host and Origin rules of the module docstring, as pure checks.

    bound_host: the address the server listens on (``--host``). allowed_hosts: further
    Host names (``--allowed-hosts``; ``"*"`` accepts any). cors_origins: origins whose pages
    may call the server (``--cors-origins``; ``"*"`` any, ``"null"`` sandboxed frames and files).
    """

    def __init__(self, bound_host: str, allowed_hosts: Sequence[str] = (), cors_origins: Sequence[str] = ()) -> None:
        bound = split_host(bound_host)[0] if bound_host.startswith("[") else bound_host.strip().lower().rstrip(".")
        self.any_host = "*" in allowed_hosts
        self.any_ip = bound in WILDCARD_HOSTS
        self.names = frozenset({*LOOPBACK_NAMES, bound, *(split_host(h)[0] for h in allowed_hosts if h != "*")})
        self.any_origin = "*" in cors_origins
        self.cors_origins = frozenset(o for o in (normalize_origin(c) for c in cors_origins if c != "*") if o)

    def host_allowed(self, host: str | None) -> bool:
        """Whether a Host header names this server (no header: not a browser, allowed)."""
        if host is None or self.any_host:
            return True
        name, _ = split_host(host)
        ip = _ip(name)
        mapped = getattr(ip, "ipv4_mapped", None)  # [::ffff:127.0.0.1]
        return bool(name) and (name in self.names or (ip is not None and (ip.is_loopback or self.any_ip or
                                                                        bool(mapped and mapped.is_loopback))))

    def cors_allowed(self, origin: str) -> bool:
        """Whether a page of this (other) origin may call the server (``--cors-origins``)."""
        return self.any_origin or normalize_origin(origin) in self.cors_origins

    def check(self, host: str | None, origin: str | None) -> APIError | None:
        """None when a request with these headers may proceed, else the 403 to answer."""
        if not self.host_allowed(host):
            return APIError(403, f"the Host header {host!r} does not name this server: only localhost, loopback "
                            "addresses, the address it listens on and the names given with --allowed-hosts are "
                            "served (a page of another site that re-points its name to this machine is refused)",
                            type="permission_error", param="Host", code="host_not_allowed")
        if origin is None or (host is not None and self._same_origin(origin, host)) or self.cors_allowed(origin):
            return None
        return APIError(403, f"the Origin header {origin!r} names another site: a web page there may not use this "
                        f"server; start it with --cors-origins {origin} to allow that page",
                        type="permission_error", param="Origin", code="origin_not_allowed")

    @staticmethod
    def _same_origin(origin: str, host: str) -> bool:
        norm = normalize_origin(origin)
        if norm is None or norm == "null":
            return False
        scheme, _, authority = norm.partition("://")
        name, port = split_host(host)
        shown = f"[{name}]" if ":" in name else name
        return authority == shown + (f":{port}" if port and port != _DEFAULT_PORTS[scheme] else "")


class AccessGuard:
    """ASGI middleware: every HTTP request passes :class:`HostOriginPolicy` or gets its 403
    (counted by ``on_reject``) before anything else runs, a CORS preflight included."""

    def __init__(self, app: Any, policy: HostOriginPolicy, on_reject: Callable[[], None]) -> None:
        self.app = app
        self.policy = policy
        self._on_reject = on_reject

    async def __call__(self, scope: dict, receive: Callable, send: Callable) -> None:
        if scope["type"] == "http":
            host = [v.decode("latin-1") for k, v in scope["headers"] if k == b"host"]
            origin = [v.decode("latin-1") for k, v in scope["headers"] if k == b"origin"]
            error = self.policy.check(host[0] if host else None, origin[0] if origin else None)
            for name, values in (("Host", host), ("Origin", origin)):
                if len(values) > 1:  # which one a proxy or a check reads would differ
                    error = APIError(403, f"the request has {len(values)} {name} headers: send one",
                                     type="permission_error", param=name, code=f"{name.lower()}_not_allowed")
            if error is not None:
                self._on_reject()
                await error_response(error, scope["path"])(scope, receive, send)
                return
        await self.app(scope, receive, send)


class APIKeyGuard:
    """ASGI middleware: every HTTP request but those for ``open_paths`` (so every /v1
    request, and any path that is no route) must carry ``Authorization: Bearer <key>`` or
    ``x-api-key: <key>`` (Anthropic's header, as Claude Code sends it);
    any other answers 401 (code invalid_api_key) before its body is read or anything
    reaches the worker (a CORS preflight, which browsers send without credentials, is
    answered by the CORS middleware outside this one). The keys are compared in
    constant time (hmac.compare_digest), as SHA-256 digests, so that neither their content
    nor their length shows in the timing."""

    def __init__(self, app: Any, api_key: str, open_paths: frozenset[str], on_reject: Callable[[], None]) -> None:
        self.app = app
        self._digest = hashlib.sha256(api_key.encode()).digest()
        self._open = open_paths
        self._on_reject = on_reject

    async def __call__(self, scope: dict, receive: Callable, send: Callable) -> None:
        if scope["type"] == "http" and scope["path"] not in self._open:
            error = self._check_headers(scope["headers"])
            if error is not None:
                self._on_reject()
                await error_response(error, scope["path"])(scope, receive, send)
                return
        await self.app(scope, receive, send)

    def _check_headers(self, headers: list[tuple[bytes, bytes]]) -> APIError | None:
        """None when a credential header carries the key (``Authorization: Bearer`` or
        ``x-api-key``; either one right is enough where a client sends both), else the 401 to
        answer, naming the header; a credential header sent twice is refused (which one
        counts would be a guess)."""
        sent: dict[bytes, list[bytes]] = {}
        for name, value in headers:
            if name.lower() in (b"authorization", b"x-api-key"):
                sent.setdefault(name.lower(), []).append(value)
        for name, values in sent.items():
            if len(values) > 1:
                return APIError(401, f"the {name.decode()} header was sent {len(values)} times: send the key once",
                                code="invalid_api_key")
        if b"x-api-key" not in sent:
            return self._check(sent.get(b"authorization", [None])[0])
        if hmac.compare_digest(hashlib.sha256(sent[b"x-api-key"][0].strip()).digest(), self._digest):
            return None
        if b"authorization" in sent and self._check(sent[b"authorization"][0]) is None:
            return None
        wrong = "the x-api-key header" + (" and the Authorization header" if b"authorization" in sent else "")
        return APIError(401, f"incorrect API key provided ({wrong})", code="invalid_api_key")

    def _check(self, header: bytes | None) -> APIError | None:
        """None when header is "Bearer <the key>", else the 401 to answer."""
        if header is None:
            return APIError(401, "no API key given: send it in an Authorization header (Authorization: Bearer "
                            "YOUR_KEY) or an x-api-key header", code="invalid_api_key")
        scheme, _, given = header.strip().partition(b" ")
        if scheme.lower() != b"bearer" or not given.strip():
            return APIError(401, "the Authorization header must be 'Bearer YOUR_KEY'", code="invalid_api_key")
        if not hmac.compare_digest(hashlib.sha256(given.strip()).digest(), self._digest):
            return APIError(401, "incorrect API key provided (the Authorization header)", code="invalid_api_key")
        return None


def require_json(content_type: str | None) -> None:
    """415 unless a request body is declared ``application/json`` (parameters such as
    ``charset=utf-8`` allowed): a form or ``text/plain`` body is what a page of any site may
    send without a CORS preflight."""
    media = (content_type or "").split(";")[0].strip().lower()
    if media != "application/json":
        shown = repr(content_type) if content_type else "none"
        raise APIError(415, f"the request body must be sent as Content-Type: application/json (got {shown}); with "
                       "curl: -H 'Content-Type: application/json', or --json", param="Content-Type",
                       code="unsupported_media_type")
