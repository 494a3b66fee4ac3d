"""Request parsing and validation for the OpenAI-compatible endpoints of ``specdecode serve``.

Pure: no FastAPI, no model. :func:`parse_request` turns a decoded JSON body into a
:class:`GenRequest` (whose :class:`specdecode.request.GenerationOptions` carry what each
choice's generation asks for) or raises :class:`APIError`; :func:`resolve_max_tokens`
settles max_tokens once the prompt's length in tokens is known. Field semantics are listed
in the package docstring (:mod:`specdecode.server`).
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any

from ..backends.fim import FimInput
from ..errors import SpecDecodeError
from ..grammar import Grammar
from ..limits import MAX_N, check_logprobs
from ..messages import check_messages, json_repr
from ..request import GenerationOptions
from ..sampling import SamplingParams
from ..drafters.kinds import request_fields
from .extensions import parse_content, parse_speculative, wants_trace
from .apierror import APIError, from_specdecode_error
from .body import MAX_JSON_DEPTH, BodyFields, parse_json_body
from .toolcalls import MAX_NAME_LEN, NAME_CHARS, ToolCallFormat
from .tools import ToolRequest, parse_tools

__all__ = ["APIError", "GenRequest", "MAX_JSON_DEPTH", "from_specdecode_error", "json_repr", "parse_json_body",
           "parse_request", "resolve_max_tokens"]

# max_tokens of a completion that gives none (OpenAI's default); chat defaults to the
# rest of the context.
DEFAULT_COMPLETION_MAX_TOKENS = 16
# OpenAI's range for temperature; the engine itself accepts more (SamplingParams).
MAX_TEMPERATURE = 2.0
# temperature of a request that gives none: OpenAI's default. (The CLI and the Python API
# keep greedy, temperature 0, as their documented default.)
DEFAULT_TEMPERATURE = 1.0

_COMMON_FIELDS = frozenset({
    "model", "max_tokens", "max_completion_tokens", "temperature", "top_p", "top_k", "min_p",
    "repetition_penalty", "presence_penalty", "frequency_penalty", "seed", "stop", "stream",
    "stream_options", "logprobs", "n", "user", "response_format", "speculative",
})  # and the request fields that feed a drafter kind (kinds.request_fields(): prediction, ...)
_COMPLETION_FIELDS = _COMMON_FIELDS | {"prompt", "suffix"}
# prompt_cache_key and safety_identifier (OpenAI's, beside user): who a request is for, which is
# what keeps a slot's reuse of another client's prompt out of the usage (runner.owner_of).
_CHAT_FIELDS = _COMMON_FIELDS | {"messages", "top_logprobs", "tools", "tool_choice", "parallel_tool_calls",
                                 "prompt_cache_key", "safety_identifier"}
# Standard fields accepted only at the value that asks for nothing beyond what is served.
_HARMLESS_DEFAULTS: dict[str, Any] = {
    "echo": False, "best_of": 1, "logit_bias": {}, "tools": [],
}
_FLOAT_SAMPLING_FIELDS = ("temperature", "top_p", "min_p", "repetition_penalty", "presence_penalty",
                          "frequency_penalty")
_INT_SAMPLING_FIELDS = ("top_k", "seed")


@dataclass
class GenRequest:
    """A validated generation request.

    kind: "completion" or "chat". prompt / messages: exactly one is set.
    max_tokens: in tokens, per choice; None means the endpoint's default (see
    :func:`resolve_max_tokens`). options: what each generation asks for (sampling with
    temperature always set, stop, logprobs, grammar), all but max_tokens, which is settled
    once the prompt is tokenized; :meth:`choice_options` gives a choice's complete options.
    n: choices, 1..MAX_N, each its own sequence. tools: the tools the chat template
    presents and the output is read for (:mod:`.tools`), None without. inputs: the text of
    each request field that feeds a drafter kind (``prediction``, :mod:`.extensions`). fim:
    a fill-in-the-middle prompt (``suffix``, ``/infill``, Ollama's ``suffix``), whose prefix is
    ``prompt``; None for a plain one.
    """

    kind: str
    prompt: str | None
    messages: list[dict] | None
    max_tokens: int | None
    options: GenerationOptions = GenerationOptions()
    stream: bool = False
    include_usage: bool = False
    n: int = 1
    inputs: dict = field(default_factory=dict)
    fim: FimInput | None = None
    tools: ToolRequest | None = None
    trace: bool = False  # speculative.trace: streamed chunks carry speculation_trace (:func:`.extensions.trace_of`)
    fit_context: bool = False  # max_tokens is a bound, cut to the room the prompt leaves (Ollama's num_predict)

    @property
    def logprobs(self) -> int | None:
        """None, or how many most likely tokens to report per emitted token."""
        return self.options.logprobs

    def choice_options(self, i: int, max_tokens: int, inputs: tuple = (), cache_reuse: int = 0) -> GenerationOptions:
        """The options of choice i, generating max_tokens (as :func:`resolve_max_tokens`
        settled them), with the request-fed inputs as prepared (token ids by field) and its
        trace where it streams: with a seed, choice i draws from seed + i (modulo 2**64, the
        seed's range), so that a seeded request repeats choice by choice; without one, each
        choice draws its own seed from the OS. cache_reuse: as prepared (:class:`.prepare.Prepared`)."""
        seed, sampling = self.options.sampling.seed, self.options.sampling
        if seed is not None and i > 0:
            sampling = replace(sampling, seed=(seed + i) % 2**64)
        return replace(self.options, max_tokens=max_tokens, sampling=sampling, inputs=inputs or self.options.inputs,
                       trace=self.trace and self.stream, cache_reuse=cache_reuse)


def _check_fields(body: dict, allowed: frozenset[str]) -> None:
    """400 naming every field this server does not honour (null values and harmless
    defaults pass)."""
    unknown = []
    for name, value in body.items():
        if name in allowed or value is None:
            continue
        default = _HARMLESS_DEFAULTS.get(name, ...)
        if type(value) is type(default) and value == default:
            continue
        unknown.append(name)
    if unknown:
        details = []
        for name in unknown:
            if name in _HARMLESS_DEFAULTS:
                details.append(f"{name} = {json_repr(body[name])} (only {json_repr(_HARMLESS_DEFAULTS[name])} is "
                               "accepted)")
            else:
                details.append(name)
        raise APIError(400, "unsupported field(s): " + ", ".join(details) + ". This server honours: "
                       + ", ".join(sorted(allowed)), param=unknown[0])


def _parse_messages(value: Any) -> list[dict]:
    try:
        return check_messages(value)
    except SpecDecodeError as e:
        raise from_specdecode_error(e, "messages") from None


def _check_logprobs(value: int | None, name: str) -> int | None:
    try:
        return check_logprobs(value, name)
    except SpecDecodeError as e:
        raise from_specdecode_error(e, name) from None


def parse_response_format(value: Any) -> Grammar | None:
    """OpenAI's response_format as a Grammar: {"type": "text"} (or absent) is None;
    {"type": "json_object"} is any JSON object; {"type": "json_schema", "json_schema":
    {"name": ..., "schema": {...}, "strict": ...}} is that schema, always enforced (strict or
    not: the mask makes every output match). As OpenAI's, name is required and schema is not
    (none: any JSON value). A schema llguidance cannot compile is found
    when the request runs (400 naming response_format). Raises APIError (400)."""
    if value is None:
        return None
    kind = value.get("type") if isinstance(value, dict) else None
    if kind == "text" and set(value) == {"type"}:
        return None
    if kind == "json_object" and set(value) == {"type"}:
        return Grammar("json_object", name="response_format")
    if kind == "json_schema" and set(value) == {"type", "json_schema"}:
        spec = value["json_schema"]
        if not isinstance(spec, dict) or not isinstance(spec.get("schema", {}), dict) or \
                not set(spec) <= {"name", "schema", "strict", "description"} or \
                not isinstance(spec.get("strict", False), (bool, type(None))):
            raise APIError(400, "response_format.json_schema must be an object with name, schema (an object), "
                           f"optional strict (boolean) and description; got {json_repr(spec)}",
                           param="response_format.json_schema")
        name = spec.get("name")
        if not isinstance(name, str) or not name or len(name) > MAX_NAME_LEN or not set(name) <= NAME_CHARS:
            raise APIError(400, f"response_format.json_schema.name is required: the format's name, 1 to {MAX_NAME_LEN} "
                           f"letters, digits, underscores or dashes (as OpenAI); got {json_repr(name)}",
                           param="response_format.json_schema.name")
        return Grammar.json_schema(spec.get("schema", {}), name="response_format")
    raise APIError(400, f"response_format = {json_repr(value)} is not supported: expected {{\"type\": \"text\"}}, "
                   '{"type": "json_object"} or {"type": "json_schema", "json_schema": {"name": ..., "schema": '
                   "{...}}}", param="response_format")


def parse_request(body: Any, kind: str, model_name: str, n_ctx: int,
                  tool_format: ToolCallFormat | None = None, strict: bool = False) -> GenRequest:
    """Validate a decoded JSON body for ``kind`` "completion" or "chat".

    model_name: the id the client must send as ``model``. n_ctx: the context size in
    tokens, the upper bound of max_tokens. tool_format: the tool-call format of the served
    model's chat template (:func:`.toolcalls.tool_call_format`), None when it has none (a
    request with tools is then a 400). Checks what can be checked without the model
    (types, ranges, unsupported fields, the model name); strict: the server's default for
    ``speculative.strict`` (``serve --strict``). The prompt's length against the
    context is checked when it is tokenized (:func:`resolve_max_tokens`). Raises APIError:
    404 (code model_not_found) for another model, 400 for anything else, with ``param``
    naming the field at fault.
    """
    if not isinstance(body, dict):
        raise APIError(400, f"the request body must be a JSON object, got {json_repr(body)}")
    _check_fields(body, (_COMPLETION_FIELDS if kind == "completion" else _CHAT_FIELDS) | set(request_fields()))
    b = BodyFields(body)
    _check_model(b, model_name)
    prompt, messages = _parse_prompt(body, kind)
    for i, m in enumerate(messages or () if tool_format is None else ()):  # a template that cannot show tool use
        if m.get("tool_calls") or m["role"] == "tool":
            field = f"messages[{i}].tool_calls" if m.get("tool_calls") else f"messages[{i}].role"
            raise APIError(400, f"{field}: the model {json_repr(model_name)} has no known tool-call format in its chat "
                           "template, so its conversations cannot carry tool calls or tool messages", param=field)
    n = b.integer("n", 1, MAX_N, " (choices run one after another on this server)") or 1
    max_tokens = _parse_max_tokens(b, n, n_ctx)
    sampling = _parse_sampling(b, body)
    stop = _parse_stop(body)
    stream, include_usage = _parse_stream(b, body)
    logprobs = _parse_logprobs(b, kind)
    grammar = parse_response_format(body.get("response_format"))
    tools = parse_tools(body, tool_format) if kind == "chat" else None
    if tools is not None:
        grammar = tools.grammar()
    for name in ("user", "prompt_cache_key", "safety_identifier"):
        b.string(name)
    suffix = b.string("suffix")  # completions only (_check_fields): the code after the cursor
    fim = FimInput(prompt, suffix) if suffix is not None else None
    try:
        inputs = {f: text for f in request_fields() if (text := parse_content(body.get(f), f)) is not None}
        trace = wants_trace(body.get("speculative"))
        options = GenerationOptions(sampling=sampling, stop=stop, logprobs=logprobs, grammar=grammar,
                                    **parse_speculative(body.get("speculative"), strict))
    except SpecDecodeError as e:
        raise from_specdecode_error(e) from None
    return GenRequest(kind=kind, prompt=prompt, messages=messages, max_tokens=max_tokens, options=options,
                      stream=stream, include_usage=include_usage, n=n, tools=tools, inputs=inputs, trace=trace,
                      fim=fim)


def _check_model(b: BodyFields, model_name: str) -> None:
    """model is required and must be the served one (404, code model_not_found, otherwise)."""
    model = b.string("model")
    if model is None:
        raise APIError(400, "model is required: this server serves " + json_repr(model_name), param="model")
    if model != model_name:
        raise APIError(404, f"the model {json_repr(model)} does not exist: this server serves {json_repr(model_name)}",
                       param="model", code="model_not_found")


def _parse_prompt(body: dict, kind: str) -> tuple[str | None, list[dict] | None]:
    """(prompt, None) for a completion, (None, messages) for chat."""
    if kind == "completion":
        if body.get("prompt") is None:
            raise APIError(400, "prompt is required", param="prompt")
        if not isinstance(body["prompt"], str):
            raise APIError(400, f"prompt must be a string (lists of prompts and token-id arrays are not supported), "
                           f"got {json_repr(body['prompt'])}", param="prompt")
        return body["prompt"], None
    if body.get("messages") is None:
        raise APIError(400, "messages is required", param="messages")
    return None, _parse_messages(body["messages"])


def _parse_max_tokens(b: BodyFields, n: int, n_ctx: int) -> int | None:
    """max_tokens or max_completion_tokens (which must agree when both are given), within
    the context size and with n * max_tokens within it too; None when absent."""
    why = " (the context size)"
    max_tokens = b.integer("max_tokens", 1, n_ctx, why)
    max_completion = b.integer("max_completion_tokens", 1, n_ctx, why)
    if max_tokens is not None and max_completion is not None and max_tokens != max_completion:
        raise APIError(400, f"max_tokens = {max_tokens} and max_completion_tokens = {max_completion} disagree: "
                       "give one of them", param="max_completion_tokens")
    if max_completion is not None:
        max_tokens = max_completion
    if max_tokens is not None and n * max_tokens > n_ctx:
        raise APIError(400, f"n = {n} choices of max_tokens = {max_tokens} ask for {n * max_tokens} tokens, more than "
                       f"a request may (n * max_tokens <= {n_ctx}, the context size): lower n or max_tokens",
                       param="n")
    return max_tokens


def _parse_sampling(b: BodyFields, body: dict) -> SamplingParams:
    """The sampling fields (temperature OpenAI's default when absent); ranges beyond
    temperature's are SamplingParams' own."""
    temperature = b.number("temperature")
    if temperature is not None and not (0.0 <= temperature <= MAX_TEMPERATURE):
        raise APIError(400, f"temperature = {body['temperature']} is out of range: expected 0 <= temperature <= "
                       f"{MAX_TEMPERATURE:g} (0 = greedy)", param="temperature")
    sampling: dict[str, Any] = {"temperature": DEFAULT_TEMPERATURE}
    for name in _FLOAT_SAMPLING_FIELDS + _INT_SAMPLING_FIELDS:
        v = b.number(name) if name in _FLOAT_SAMPLING_FIELDS else b.integer(name)
        if v is not None:
            sampling[name] = v
    try:
        return SamplingParams(**sampling)
    except SpecDecodeError as e:
        raise from_specdecode_error(e) from None


def _parse_stop(body: dict) -> tuple[str, ...]:
    """stop: a non-empty string or a list of them (empty: none)."""
    stop = body.get("stop")
    if stop is None:
        return ()
    stops = [stop] if isinstance(stop, str) else stop
    if not isinstance(stops, list) or any(not isinstance(s, str) or not s for s in stops):
        raise APIError(400, f"stop must be a non-empty string or a list of non-empty strings, got {json_repr(stop)}",
                       param="stop")
    return tuple(stops)


def _parse_stream(b: BodyFields, body: dict) -> tuple[bool, bool]:
    """(stream, stream_options.include_usage); stream_options only with stream true."""
    stream = bool(b.boolean("stream"))
    options = body.get("stream_options")
    if options is None:
        return stream, False
    if not stream:
        raise APIError(400, "stream_options is only allowed when stream is true", param="stream_options")
    if not isinstance(options, dict) or any(k != "include_usage" for k in options):
        raise APIError(400, f"stream_options = {json_repr(options)} is not supported: only "
                       '{"include_usage": true|false} is', param="stream_options")
    return stream, bool(BodyFields(options, "stream_options.").boolean("include_usage"))


def _parse_logprobs(b: BodyFields, kind: str) -> int | None:
    """Completions: logprobs, an integer. Chat: logprobs, a boolean, with top_logprobs
    (which needs logprobs true). None when not asked for."""
    if kind == "completion":
        return _check_logprobs(b.integer("logprobs"), "logprobs")
    want = b.boolean("logprobs")
    top = _check_logprobs(b.integer("top_logprobs"), "top_logprobs")
    if top is not None and not want:
        raise APIError(400, f"top_logprobs = {top} needs logprobs = true", param="top_logprobs")
    return (top or 0) if want else None


def resolve_max_tokens(req: GenRequest, prompt_len: int, n_ctx: int) -> int:
    """The number of tokens to generate, once the prompt is tokenized.

    prompt_len, n_ctx: in tokens. Without max_tokens: DEFAULT_COMPLETION_MAX_TOKENS for a
    completion, the rest of the context for chat (either capped by the room left, and by
    n_ctx // n so that n * max_tokens stays within the context size).
    Raises APIError (400, code context_length_exceeded) when the prompt leaves no room,
    or when max_tokens does not fit after it (param "max_tokens"; with req.fit_context max_tokens
    is a bound, and the room left is generated).
    """
    room = n_ctx - prompt_len
    if room < 1:
        raise APIError(400, f"the prompt has {prompt_len} tokens but the context holds {n_ctx}: it must be "
                       "shorter than the context to leave room for at least one new token",
                       param="prompt" if req.kind == "completion" else "messages", code="context_length_exceeded")
    if req.max_tokens is None:
        default = min(DEFAULT_COMPLETION_MAX_TOKENS, room) if req.kind == "completion" else room
        return max(1, min(default, n_ctx // req.n))
    if req.max_tokens > room and req.fit_context:
        return room
    if req.max_tokens > room:
        raise APIError(400, f"the context holds {n_ctx} tokens, but {prompt_len + req.max_tokens} were asked "
                       f"for ({prompt_len} in the prompt, max_tokens = {req.max_tokens}): lower max_tokens to at "
                       f"most {room}", param="max_tokens", code="context_length_exceeded")
    return req.max_tokens
