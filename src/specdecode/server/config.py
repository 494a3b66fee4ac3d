"""The server's options as one object, :class:`ServerOptions`, for ``specdecode serve``
(:mod:`.cli`), :func:`specdecode.server.create_app`, the worker (:mod:`.worker`) and the
Ray Serve deployment (``specdecode serve --replicas``, ``serve run
specdecode.server.ray_serve:app_builder``, :mod:`.ray_serve`).

The options are checked once, when the object is made; an error names the option and its
value: as the command-line flag (``--max-queue 0``) when the object comes from the
command line (:meth:`ServerOptions.from_args`), else as the field (``max_queue = 0``).
"""

from __future__ import annotations

import argparse
import json
import re
import types
import typing
from dataclasses import dataclass, fields
from typing import Any, Callable

from ..errors import SpecDecodeError
from ..limits import DEFAULT_CACHE_REUSE, MAX_CACHE_REUSE, is_int
from .access import normalize_origin

# Requests that may wait for a slot (the --parallel slots run requests at once, in shared
# batched steps); more get 429.
DEFAULT_MAX_QUEUE = 16
# The largest request body read, in bytes (--max-body-bytes); a larger one gets 413. 4 MiB
# holds any prompt that fits a context of tens of thousands of tokens, JSON included.
DEFAULT_MAX_BODY_BYTES = 4 * 1024 * 1024
DEFAULT_HOST = "127.0.0.1"
# The most bytes of prediction text per allowed token (checked before tokenizing: code runs
# at 3-5 bytes a token, a long run of spaces at a few dozen).
PREDICTION_BYTES_PER_TOKEN = 16
# A prompt with more bytes of text per token of the context than this cannot fit it (text runs
# at 3-5 bytes a token): refused before it is tokenized.
PROMPT_BYTES_PER_TOKEN = 32
DEFAULT_PORT = 8000
# The most bytes of output one stream may hold unread in the server (--max-unread-bytes), besides
# what the sockets' buffers hold: past it the client is not reading, and its generation ends.
DEFAULT_MAX_UNREAD_BYTES = 1024 * 1024
# Seconds a connection may take to send a request's head (--header-timeout), from its opening or
# its next request's first byte, and a request's whole body, from its head (--body-timeout).
DEFAULT_HEADER_TIMEOUT = 30.0
DEFAULT_BODY_TIMEOUT = 60.0


SENDABLE_KEY = re.compile(r"[\x21-\x7e]+")


def _check_autoscaling(config: dict) -> None:
    """Ray Serve's own check of an autoscaling_config (its pydantic AutoscalingConfig), done
    before Ray starts, with unknown fields refused too. Raises _OptionError naming the field.
    Without Ray nothing is checked here (serve_replicas says Ray is missing)."""
    try:
        from pydantic import ValidationError
        from ray.serve.config import AutoscalingConfig
    except ImportError:
        return
    fields = getattr(AutoscalingConfig, "model_fields", None) or getattr(AutoscalingConfig, "__fields__", {})
    unknown = sorted(set(config) - set(fields))
    if unknown:
        raise _OptionError("autoscaling", config, f"Ray Serve's autoscaling_config fields ({', '.join(sorted(fields))}); "
                           f"unknown: {', '.join(map(str, unknown))}", problem="is not valid")
    try:
        AutoscalingConfig(**config)
    except (ValidationError, ValueError, TypeError) as e:
        errors = e.errors() if isinstance(e, ValidationError) else []
        why = "; ".join(f"{'.'.join(map(str, err.get('loc', ()))) or 'config'}: {err.get('msg')}" for err in errors[:3])
        raise _OptionError("autoscaling", config, f"a valid autoscaling_config for Ray Serve ({why or e})",
                           problem="is not valid") from None


class _OptionError(SpecDecodeError):
    """A bad option value: ``name`` (a field), ``value`` and what is ``expected``. Shown as
    "max_queue = 0 is out of range: expected ..." and, for a command-line flag, as
    "--max-queue 0 is out of range: expected ..." (:meth:`as_flag`)."""

    def __init__(self, name: str, value: Any, expected: str, problem: str = "is out of range",
                 show_value: bool = True) -> None:
        self.value, self.expected, self.problem, self.show_value = value, expected, problem, show_value
        super().__init__(self._render(name), param=name)

    def _render(self, name: str) -> str:
        if not self.show_value:
            shown = name
        elif name.startswith("--"):
            shown = f"{name} {self.value}"
        else:
            shown = f"{name} = {self.value!r}"
        return f"{shown} {self.problem}: expected {self.expected}"

    def as_flag(self) -> SpecDecodeError:
        flag = "--" + self.param.replace("_", "-")
        return SpecDecodeError(self._render(flag), param=flag)


def _check_seconds(name: str, value: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value < float("inf"):
        raise _OptionError(name, value, "a number of seconds > 0")


def _check_int(name: str, value: Any, lo: int, hi: int | None = None, optional: bool = False) -> None:
    if value is None and optional:
        return
    if not is_int(value) or value < lo or (hi is not None and value > hi):
        rng = f"{lo}..{hi}" if hi is not None else f">= {lo}"
        raise _OptionError(name, value, f"an integer {rng}")


@dataclass(frozen=True)
class ServerOptions:
    """Everything a server is asked for, besides the loaded model pair (whose options,
    ``--parallel`` slots included, are the :class:`specdecode.api.Decoder`'s).

    model_name: the id clients must send as ``model`` (None: the decoder's target name).
    served_model_names: more ids a client may send as ``model`` for the same model (aliases,
        ``serve --served-model-name``, vLLM's option; ``model_name`` is then the first).
    host, port: where ``specdecode serve`` (or Ray Serve's proxy) listens.
    max_queue: requests that may wait for a free slot (>= 1); more get 429.
    max_body_bytes: the largest request body read (>= 1); a larger one gets 413.
    api_key: when set, every request but /health and /metrics must send
        ``Authorization: Bearer <api_key>`` (else 401); None: no authentication.
    warmup: run one tiny generation on the worker thread at start-up, so that the first
        client does not pay llama.cpp's first-evaluation cost (seconds).
    replicas: Ray Serve replicas (None: a single server, no Ray).
    autoscaling: Ray Serve's autoscaling_config (implies Ray; replaces replicas).
    num_cpus: CPUs each Ray replica reserves (None: its llama.cpp threads).
    metrics_port: with Ray, each replica also serves its /metrics on metrics_port + rank.
    ui: serve the page at ``/`` (:mod:`specdecode.server.ui`); ``serve --no-ui`` turns it off.
    allowed_hosts: Host names served besides localhost, loopback addresses and ``host``
        (``"*"``: any; see :mod:`.access`); a request naming another gets 403.
    cors_origins: origins (``scheme://host[:port]``, ``"*"``, ``"null"``) whose web pages may
        call the server, with CORS headers; a request from another site's page gets 403.
    max_prediction_tokens: the longest ``prediction`` a request may send, in tokens (None:
        the target's context size; its text may hold PREDICTION_BYTES_PER_TOKEN bytes per
        token); a longer one gets 400 naming ``prediction``.
    strict: every request verifies batch-invariantly unless it says ``"speculative":
        {"strict": false}`` (``serve --strict``): each greedy answer is then bit for bit the
        one plain decoding gives it alone, whatever the batch and the drafter.
    max_unread_bytes: the most bytes of output a stream may hold unread in the server (each
        delta counts its text, its logprobs and trace as JSON, and 256 bytes for the event
        itself); a stream over it is ended with an error event and its slot freed.
    header_timeout: seconds a connection may take to send a request's head, from its
        opening (or its next request's first byte); past them it gets 408 and is closed.
        ``specdecode serve`` only: Ray Serve's proxy reads the heads there.
    body_timeout: seconds a request's whole body may take to arrive after its head; past
        them it gets 408 (code body_timeout) and the connection is closed.
    cache_reuse: fill-in-the-middle requests (``/infill``, ``suffix``) shift cached chunks of
        at least this many tokens into place rather than evaluate them again (``serve
        --cache-reuse N``, llama.cpp's option and meaning: :mod:`specdecode.engine.reuse`;
        default 256, its FIM presets'); 0: off. Other requests never shift (their answers stay
        plain decoding's, bit for bit).

    Raises SpecDecodeError (``param`` = the option) for a value of the wrong type or range.
    """

    model_name: str | None = None
    served_model_names: tuple[str, ...] = ()
    host: str = DEFAULT_HOST
    port: int = DEFAULT_PORT
    max_queue: int = DEFAULT_MAX_QUEUE
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES
    api_key: str | None = None
    warmup: bool = False
    replicas: int | None = None
    autoscaling: dict | None = None
    num_cpus: float | None = None
    metrics_port: int | None = None
    ui: bool = True
    allowed_hosts: tuple[str, ...] = ()
    cors_origins: tuple[str, ...] = ()
    max_prediction_tokens: int | None = None
    strict: bool = False
    max_unread_bytes: int = DEFAULT_MAX_UNREAD_BYTES
    header_timeout: float = DEFAULT_HEADER_TIMEOUT
    body_timeout: float = DEFAULT_BODY_TIMEOUT
    cache_reuse: int = DEFAULT_CACHE_REUSE

    def __post_init__(self) -> None:
        for name in ("model_name", "host"):
            value = getattr(self, name)
            if (value is not None or name == "host") and (not isinstance(value, str) or not value):
                raise _OptionError(name, value, "a non-empty string", problem="is not valid")
        key = self.api_key
        if key is not None and (not isinstance(key, str) or not SENDABLE_KEY.fullmatch(key)):
            # The value is never shown: it may be a key. A space, a control character or a non-ASCII
            # one cannot travel in "Authorization: Bearer <key>": every request would get a 401.
            raise _OptionError("api_key", self.api_key, "a non-empty string of printable ASCII without spaces, as "
                               "clients send it in 'Authorization: Bearer <key>' (or None for no authentication)",
                               problem="is not valid", show_value=False)
        names = (self.served_model_names,) if isinstance(self.served_model_names, str) else self.served_model_names
        if not isinstance(names, (list, tuple)) or not all(isinstance(n, str) and n.strip() for n in names):
            raise _OptionError("served_model_names", self.served_model_names, "model ids (non-empty strings)",
                               problem="is not valid")
        object.__setattr__(self, "served_model_names", tuple(names))
        _check_int("port", self.port, 0, 65535)
        _check_int("max_queue", self.max_queue, 1)
        _check_int("max_body_bytes", self.max_body_bytes, 1)
        _check_int("replicas", self.replicas, 1, optional=True)
        _check_int("metrics_port", self.metrics_port, 1, 65535, optional=True)
        _check_int("max_prediction_tokens", self.max_prediction_tokens, 1, optional=True)
        _check_int("max_unread_bytes", self.max_unread_bytes, 1)
        _check_int("cache_reuse", self.cache_reuse, 0, MAX_CACHE_REUSE)
        _check_seconds("header_timeout", self.header_timeout)
        _check_seconds("body_timeout", self.body_timeout)
        self._check_names()
        for name in ("warmup", "ui", "strict"):
            if not isinstance(getattr(self, name), bool):
                raise _OptionError(name, getattr(self, name), "True or False", problem="is not valid")
        if self.autoscaling is not None and not isinstance(self.autoscaling, dict):
            raise _OptionError("autoscaling", self.autoscaling, "a JSON object (Ray Serve's autoscaling_config)",
                               problem="is not valid")
        if self.autoscaling is not None:
            _check_autoscaling(self.autoscaling)
        if self.num_cpus is not None and (not isinstance(self.num_cpus, (int, float)) or
                                          isinstance(self.num_cpus, bool) or not self.num_cpus > 0):
            raise _OptionError("num_cpus", self.num_cpus, "a number > 0")

    def _check_names(self) -> None:
        """allowed_hosts and cors_origins: tuples (a list or one string is taken) of host
        names and of origins."""
        for name, ok, expected in (
                ("allowed_hosts", lambda h: h == "*" or (h and not any(c in h for c in " /@,")),
                 "host names such as my-box.local (or *: any)"),
                ("cors_origins", lambda o: o == "*" or normalize_origin(o) is not None,
                 "origins such as http://localhost:3000 (scheme://host[:port], or *: any, null: sandboxed pages)")):
            value = getattr(self, name)
            items = (value,) if isinstance(value, str) else value
            if not isinstance(items, (list, tuple)) or not all(isinstance(i, str) and ok(i) for i in items):
                raise _OptionError(name, value, expected, problem="is not valid")
            object.__setattr__(self, name, tuple(items))

    @property
    def on_ray(self) -> bool:
        """Whether these options ask for Ray Serve replicas (replicas or autoscaling given)."""
        return self.replicas is not None or self.autoscaling is not None

    @classmethod
    def from_args(cls, args: argparse.Namespace, api_key: str | None) -> "ServerOptions":
        """The options of ``specdecode serve`` (api_key: as :func:`.cli.api_key_from` found
        it); an error names the flag (e.g. ``--max-queue``). The server warms up."""
        autoscaling = args.autoscaling
        if autoscaling is not None:
            autoscaling = _json_object(autoscaling, "--autoscaling")
        try:
            names = _listed(getattr(args, "served_model_name", None))
            return cls(model_name=names[0] if names else args.target, served_model_names=names, host=args.host, port=args.port, max_queue=args.max_queue,
                       max_body_bytes=args.max_body_bytes, api_key=api_key, warmup=True, replicas=args.replicas,
                       autoscaling=autoscaling, metrics_port=args.metrics_port, ui=args.ui,
                       allowed_hosts=_listed(args.allowed_hosts), cors_origins=_listed(args.cors_origins),
                       max_prediction_tokens=args.max_prediction_tokens, strict=args.strict,
                       max_unread_bytes=args.max_unread_bytes, header_timeout=args.header_timeout,
                       body_timeout=args.body_timeout, cache_reuse=args.cache_reuse)
        except _OptionError as e:
            raise e.as_flag() from None

    @classmethod
    def from_strings(cls, values: dict[str, Any]) -> "ServerOptions":
        """The options from ``key=value`` strings (``serve run ... max_queue=4``), each
        converted to its field's type (an integer, a number, true/false, JSON for
        autoscaling); values that are not strings are taken as they are. Raises
        SpecDecodeError naming a key that is no field or a value that does not convert."""
        known = cls.field_names()
        unknown = sorted(set(values) - known)
        if unknown:
            raise SpecDecodeError(f"unknown server option(s) {', '.join(unknown)}: the server options are "
                                  f"{', '.join(sorted(known))}", param=unknown[0])
        return cls(**convert_strings(values, typing.get_type_hints(cls)))

    @classmethod
    def field_names(cls) -> frozenset[str]:
        """The names of the options (the dataclass's fields)."""
        return frozenset(f.name for f in fields(cls))


def _listed(values: list[str] | None) -> tuple[str, ...]:
    """A repeatable option's values, each possibly a comma-separated list, as one tuple."""
    return tuple(v.strip() for value in values or () for v in value.split(",") if v.strip())


def _json_object(text: str, name: str) -> dict:
    try:
        value = json.loads(text)
    except ValueError as e:
        raise SpecDecodeError(f"{name} is not valid JSON: {e}", param=name) from None
    if not isinstance(value, dict):
        raise SpecDecodeError(f"{name} must be a JSON object (Ray Serve's autoscaling_config)", param=name)
    return value


def _bool(text: str) -> bool:
    if text.lower() in ("true", "1", "yes"):
        return True
    if text.lower() in ("false", "0", "no"):
        return False
    raise ValueError(text)


_CONVERTERS: dict[type, Callable[[str], Any]] = {int: int, float: float, bool: _bool, str: str,
                                                  dict: lambda text: _json_object(text, ""),
                                                  tuple: lambda text: _listed([text])}


def convert_strings(values: dict[str, Any], hints: dict[str, Any]) -> dict[str, Any]:
    """Each string of values converted to the type its name has in hints (type hints, e.g.
    of a dataclass or a function): for ``int | str`` an integer when it reads as one, else
    the string. Names without a hint and values that are not strings stay as they are.
    Raises SpecDecodeError (param = the name) for a string that converts to none of its types."""
    out = dict(values)
    for name, value in values.items():
        if not isinstance(value, str) or name not in hints:
            continue
        hint = hints[name]
        kinds = typing.get_args(hint) if isinstance(hint, types.UnionType) or typing.get_origin(hint) is \
            typing.Union else (typing.get_origin(hint) or hint,)
        kinds = [k for k in kinds if k is not type(None)]
        for kind in kinds:
            try:
                out[name] = _CONVERTERS[kind](value)
                break
            except (KeyError, ValueError, SpecDecodeError):
                continue
        else:
            raise SpecDecodeError(f"{name} = {value!r} is not {' or '.join(k.__name__ for k in kinds)}", param=name)
    return out
