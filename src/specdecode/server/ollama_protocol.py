"""Ollama's request bodies (``POST /api/chat``, ``POST /api/generate``) as the server's own
requests: each body is translated onto the OpenAI body it means and parsed by
:func:`.protocol.parse_request` like any other (so a request is one job, with the same checks,
limits and speculation), and errors found anywhere on the way name the Ollama fields
(``options.num_predict``, ``format``), not the OpenAI ones. The answers' shapes are
:mod:`.ollama`'s.

Fields (Ollama's API reference, docs/api.md in ollama/ollama):

- both: ``model`` (the served id, or it with Ollama's default tag ``:latest``; another is a
  404), ``stream`` (default true: NDJSON), ``format`` (``"json"``: any JSON object, or a JSON
  schema: the grammar mask, as ``response_format``), ``options`` (below), ``keep_alive``
  (accepted: the model stays loaded while the server runs), ``think`` (false accepted; true or
  a level is a 400, as Ollama answers a model that does not think), this server's
  ``speculative`` and the request fields of drafter kinds (``prediction``), ``logprobs`` false,
  ``top_logprobs`` 0, ``truncate`` and ``shift`` (accepted: a prompt that does not fit is a
  400 here, never cut).
- chat: ``messages`` (role system, user, assistant or tool; content; an assistant's
  ``tool_calls`` with ``arguments`` as an object; a tool message answers the earliest
  unanswered call of its ``tool_name``, or its ``tool_call_id``; ``thinking`` accepted and
  dropped; ``images`` a 400), ``tools`` (OpenAI's function tools). No messages: Ollama's
  "load the model" call, answered at once (done_reason "load").
- generate: ``prompt``, ``suffix`` (non-empty: a fill-in-the-middle prompt from the model's
  own FIM tokens, a 400 naming suffix on a model without them; also under ``raw``, where
  Ollama would drop it, and with an empty prompt, which Ollama takes for a load call),
  ``system`` (a system message before the prompt; not part of a fill-in-the-middle prompt,
  as in Ollama), ``raw`` (the prompt as it is, no chat template; with ``system`` a 400, as
  Ollama's), ``template`` (empty only: prompts are the model's own template's), ``context``
  (empty only), ``images`` (empty only). No prompt and no suffix: a load call.
- options: temperature (default 0.8, Ollama's), top_k (40), top_p (0.9), min_p, seed (negative:
  a random one), num_predict (tokens to generate: a bound, cut to the room the prompt leaves
  in the context; <= 0 or absent: to the context's end), stop, repeat_penalty, repeat_last_n
  (-1: the whole context), presence_penalty, frequency_penalty, num_ctx (a positive integer;
  the context stays the served one, which ``/api/show`` reports: Ollama too caps num_ctx at
  what its model holds). Accepted and without effect (settings a server fixes when it loads
  the model, or left to it): num_batch, num_gpu, main_gpu, use_mmap, use_mlock, num_thread,
  numa, low_vram, f16_kv, vocab_only, logits_all, embedding_only, num_keep,
  draft_num_predict, penalize_newline; at their neutral values only: typical_p 1, tfs_z 1,
  mirostat 0 (and then any mirostat_tau, mirostat_eta). Any other option is a 400 naming it.

Pure: no FastAPI, no model.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, replace
from typing import Any

from ..drafters.kinds import request_fields
from ..errors import SpecDecodeError
from ..messages import json_repr
from .apierror import APIError, from_specdecode_error
from .body import BodyFields
from .ollama_models import ModelCard
from .protocol import GenRequest, parse_request
from .toolcalls import ToolCallFormat

# Ollama's sampling defaults (api.DefaultOptions), where a request's options leave them out.
DEFAULTS = {"temperature": 0.8, "top_k": 40, "top_p": 0.9}
# option -> the OpenAI field it becomes, and how it is checked.
_NUMBER_OPTIONS = {"temperature": "temperature", "top_p": "top_p", "min_p": "min_p", "repeat_penalty":
                   "repetition_penalty", "presence_penalty": "presence_penalty",
                   "frequency_penalty": "frequency_penalty"}
_INTEGER_OPTIONS = ("top_k", "seed", "num_predict", "num_ctx", "repeat_last_n")
# Accepted and not applied, each of the type Ollama's api.Options gives it (issue 61: any type passed).
_IGNORED_OPTIONS = {**dict.fromkeys(("num_batch", "num_gpu", "main_gpu", "num_thread", "num_keep", "draft_num_predict"),
                                    "integer"),
                    **dict.fromkeys(("use_mmap", "use_mlock", "numa", "low_vram", "f16_kv", "vocab_only", "logits_all",
                                     "embedding_only", "penalize_newline"), "boolean"),
                    **dict.fromkeys(("mirostat_tau", "mirostat_eta"), "number")}
_NEUTRAL_OPTIONS = {"typical_p": 1.0, "tfs_z": 1.0, "mirostat": 0}
_COMMON = frozenset({"model", "stream", "format", "options", "keep_alive", "think", "speculative", "logprobs",
                     "top_logprobs", "truncate", "shift"})
_CHAT_FIELDS = _COMMON | {"messages", "tools"}
_GENERATE_FIELDS = _COMMON | {"prompt", "suffix", "system", "raw", "template", "context", "images"}
# Fields accepted only at the value that asks for nothing beyond what is served, and why.
_HARMLESS = {"logprobs": False, "top_logprobs": 0, "template": "", "context": [], "images": []}
_WHY = {"template": "this server builds prompts with the model's own chat template (or its FIM tokens): send "
                    "raw true with a prompt you formatted yourself",
        "context": "send the conversation as messages to /api/chat, or the whole text as the prompt",
        "images": "the model reads text only", "logprobs": "this server's Ollama API returns no logprobs (its "
                                                           "OpenAI API does: /v1/chat/completions)"}
_MESSAGE_KEYS = frozenset({"role", "content", "images", "tool_calls", "tool_name", "tool_call_id", "thinking"})
# OpenAI field (an error's param) -> the Ollama field it came from.
_RENAMES = {"max_tokens": "options.num_predict", "repetition_penalty": "options.repeat_penalty",
            "penalty_last_n": "options.repeat_last_n", "response_format": "format",
            "response_format.json_schema": "format",
            **{name: f"options.{name}" for name in ("temperature", "top_p", "top_k", "min_p", "seed", "stop",
                                                     "presence_penalty", "frequency_penalty")}}


@dataclass
class OllamaRequest:
    """A validated Ollama request. endpoint: "chat" or "generate". model: the name the request
    gave (echoed in every answer, as Ollama does). req: the request it runs as; None for a load
    call (no prompt, no messages), answered at once. system: whether a generate request's
    prompt follows a system message (for naming errors)."""

    endpoint: str
    model: str
    req: GenRequest | None
    system: bool = False


def _error(message: str, param: str, status: int = 400) -> APIError:
    return APIError(status, message, param=param)


def rename_error(e: APIError, endpoint: str, system: bool = False) -> APIError:
    """The error with the OpenAI field it names (param and message) renamed to the Ollama field
    it came from (``max_tokens`` -> ``options.num_predict``); for generate, the messages it was
    made into -> ``system`` / ``prompt``."""
    param, message = e.param, e.message
    if param in _RENAMES:
        message = re.sub(rf"\b{re.escape(param)}\b", _RENAMES[param], message)
        param = _RENAMES[param]
    if endpoint == "generate" and param is not None and param.startswith("messages"):
        def field(m: re.Match) -> str:
            return "system" if system and m.group(1) == "0" else "prompt"

        pattern = r"\bmessages(?:\[(\d+)\](?:\.content)?)?"
        param, message = re.sub(pattern, field, param), re.sub(pattern, field, message)
    return APIError(e.status, message, type=e.type, param=param, code=e.code)


def check_model(body: dict, card: ModelCard) -> str:
    """The model the body names (required: 400; not the served one: 404, as Ollama's
    "model 'x' not found")."""
    model = BodyFields(body).string("model")
    if not model:
        raise _error(f"model is required: this server serves {json_repr(card.name)}", "model")
    if model not in card.names():
        served = " or ".join(json_repr(n) for n in card.names())
        raise _error(f"model {json_repr(model)} not found: this server serves {served}", "model", 404)
    return model


def _check_fields(body: dict, allowed: frozenset[str]) -> None:
    allowed = allowed | set(request_fields())
    for name, value in body.items():
        default = _HARMLESS.get(name, value)
        if name in allowed and (value is None or (type(value) is type(default) and value == default)):
            continue
        if name in _HARMLESS:
            why = _WHY.get(name, _WHY["logprobs"])
            raise _error(f"{name} = {json_repr(value)} is not supported ({why}); only {json_repr(_HARMLESS[name])} "
                         "is accepted", name)
        raise _error(f"unsupported field {name}: this server honours " + ", ".join(sorted(allowed)), name)


def _parse_think(value: Any, model: str) -> None:
    if value is None or value is False:
        return
    if value is True or value in ("low", "medium", "high", "max"):
        raise _error(f"{json_repr(model)} does not support thinking (think = {json_repr(value)}): send false or "
                     "leave it out", "think")
    raise _error(f'think must be a boolean or "low", "medium", "high", "max"; got {json_repr(value)}', "think")


def _parse_format(value: Any) -> dict | None:
    """format as OpenAI's response_format: "" or null none, "json" any JSON object, an object
    a JSON schema."""
    if value is None or value == "":
        return None
    if value == "json":
        return {"type": "json_object"}
    if isinstance(value, dict):
        return {"type": "json_schema", "json_schema": {"name": "format", "schema": value}}
    raise _error(f'format must be "json" or a JSON schema (an object), got {json_repr(value)}', "format")


def _parse_options(value: Any, n_ctx: int) -> tuple[dict, int]:
    """options as the OpenAI fields they set (Ollama's sampling defaults where absent) and
    repeat_last_n (64, Ollama's default, where absent). Raises APIError naming options.<name>."""
    if value is None:
        value = {}
    if not isinstance(value, dict):
        raise _error(f"options must be an object, got {json_repr(value)}", "options")
    b = BodyFields(value, "options.")
    fields: dict[str, Any] = dict(DEFAULTS)
    for name, to in _NUMBER_OPTIONS.items():
        if (v := b.number(name)) is not None:
            fields[to] = v
    top_k, seed, num_predict, num_ctx, last_n = (b.integer(name) for name in _INTEGER_OPTIONS)
    if top_k is not None:
        fields["top_k"] = top_k
    if seed is not None and seed >= 0:  # Ollama's -1: a seed of its own choosing
        fields["seed"] = seed
    # A bound, not a demand: more than the context holds is the context (num_predict <= 0:
    # Ollama's "until the context is full").
    fields["max_tokens"] = min(num_predict, n_ctx) if num_predict is not None and num_predict > 0 else n_ctx
    if num_ctx is not None and num_ctx < 1:
        raise _error(f"options.num_ctx = {num_ctx} is out of range: expected a positive number of tokens (the "
                     f"context stays the served one, {n_ctx})", "options.num_ctx")
    stop = value.get("stop")
    if stop is not None and stop != []:
        fields["stop"] = stop
    for name, kind in _IGNORED_OPTIONS.items():
        getattr(b, kind)(name)  # its type checked, its value left to the server
    for name, neutral in _NEUTRAL_OPTIONS.items():
        v = value.get(name)
        if v is not None and v != neutral:
            raise _error(f"options.{name} = {json_repr(v)} is not supported: this server samples without it "
                         f"(only {json_repr(neutral)} is accepted)", f"options.{name}")
    known = {*_NUMBER_OPTIONS, *_INTEGER_OPTIONS, "stop", *_IGNORED_OPTIONS, *_NEUTRAL_OPTIONS}
    unknown = sorted(k for k, v in value.items() if k not in known and v is not None)  # null: absent
    if unknown:
        raise _error(f"unsupported option(s): {', '.join(unknown)}. See docs/server.md, \"Ollama's API\", for the "
                     "options this server honours and accepts", f"options.{unknown[0]}")
    return fields, 64 if last_n is None else last_n


def _tool_calls(calls: Any, i: int, pending: list[tuple[str, str]]) -> Any:
    """An assistant's Ollama tool calls (``arguments`` an object) as OpenAI's (a JSON string,
    an id each: its own, else made up) of message i; each is added to ``pending`` (id, name)."""
    where = f"messages[{i}].tool_calls"
    if not isinstance(calls, list):
        return calls  # the message check names the wrong type
    out = []
    for j, call in enumerate(calls):
        if not isinstance(call, dict) or not isinstance(call.get("function"), dict):
            raise _error(f'{where}[{j}] must be {{"function": {{"name": ..., "arguments": {{...}}}}}}, got '
                         f"{json_repr(call)}", f"{where}[{j}]")
        fn = {k: v for k, v in call["function"].items() if k != "index"}
        args = fn.get("arguments", {})
        if not isinstance(args, (dict, str)):
            raise _error(f"{where}[{j}].function.arguments must be an object, got {json_repr(args)}",
                         f"{where}[{j}].function.arguments")
        fn["arguments"] = args if isinstance(args, str) else json.dumps(args, ensure_ascii=False)
        call_id = call.get("id") or f"call_{i}_{j}"
        out.append({**call, "id": call_id, "type": "function", "function": fn})
        pending.append((call_id, fn.get("name")))
    return out


def chat_messages(value: Any) -> list[dict]:
    """Ollama's messages as OpenAI's (tool calls with ids and JSON-text arguments; each tool
    message bound to the call it answers). Raises APIError naming messages[i].<field>."""
    if not isinstance(value, list):
        raise _error(f"messages must be a list of messages, got {json_repr(value)}", "messages")
    out, pending = [], []  # pending: the (id, name) of calls not answered yet, in order
    for i, m in enumerate(value):
        where = f"messages[{i}]"
        if not isinstance(m, dict):
            raise _error(f"{where} must be an object, got {json_repr(m)}", where)
        extra = sorted(k for k, v in m.items() if k not in _MESSAGE_KEYS and v is not None)
        if extra:
            raise _error(f"{where}: unsupported field(s) {', '.join(extra)}; a message may carry "
                         f"{', '.join(sorted(_MESSAGE_KEYS))}", f"{where}.{extra[0]}")
        if m.get("images"):
            raise _error(f"{where}.images: the model reads text only (no images)", f"{where}.images")
        role = m["role"].lower() if isinstance(m.get("role"), str) else m.get("role")
        msg = {"role": role, "content": "" if m.get("content") is None else m["content"]}
        if m.get("tool_calls"):
            msg["tool_calls"] = _tool_calls(m["tool_calls"], i, pending)
        if role == "tool":
            msg["tool_call_id"] = _answered(m, pending, where)
        out.append(msg)
    return out


def _answered(m: dict, pending: list[tuple[str, str]], where: str) -> str:
    """The id of the call a tool message answers: its tool_call_id, else the earliest
    unanswered call of its tool_name (without one, the earliest unanswered call). A tool_name that
    no unanswered call has is a 400 naming it (issue 61: it answered the first pending call)."""
    if isinstance(m.get("tool_call_id"), str) and m["tool_call_id"]:
        pending[:] = [p for p in pending if p[0] != m["tool_call_id"]]
        return m["tool_call_id"]
    name = m.get("tool_name")
    if name is not None and not isinstance(name, str):
        raise _error(f"{where}.tool_name must be a string (the function the message answers), got {json_repr(name)}",
                     f"{where}.tool_name")
    if name is not None and pending and not any(p[1] == name for p in pending):
        raise _error(f"{where}.tool_name = {json_repr(name)} answers no unanswered call: the calls waiting for "
                     f"an answer are of {', '.join(sorted({json_repr(p[1]) for p in pending}))}", f"{where}.tool_name")
    match = next((p for p in pending if p[1] == name), pending[0] if pending else None)
    if match is None:
        raise _error(f"{where}: a tool message answers no earlier tool call (send the assistant message with its "
                     "tool_calls before it)", f"{where}.role")
    pending.remove(match)
    return match[0]


def _common(body: Any, allowed: frozenset[str], card: ModelCard, n_ctx: int) -> tuple[str, dict, int]:
    """(model, the OpenAI fields every request sets, repeat_last_n)."""
    if not isinstance(body, dict):
        raise _error(f"the request body must be a JSON object, got {json_repr(body)}", "body")
    model = check_model(body, card)
    _check_fields(body, allowed)
    b = BodyFields(body)
    stream = b.boolean("stream")
    for name in ("truncate", "shift"):
        b.boolean(name)
    _parse_think(body.get("think"), model)
    keep_alive = body.get("keep_alive")
    if isinstance(keep_alive, bool) or not isinstance(keep_alive, (int, float, str, type(None))):
        raise _error(f'keep_alive must be a duration ("5m", "1h") or a number of seconds, got '
                     f"{json_repr(keep_alive)}", "keep_alive")
    fields, last_n = _parse_options(body.get("options"), n_ctx)
    fields.update(model=card.name, stream=True if stream is None else stream,
                  response_format=_parse_format(body.get("format")))
    for name in ("speculative", *request_fields()):
        if body.get(name) is not None:
            fields[name] = body[name]
    return model, fields, last_n


def _finish(body: dict, kind: str, last_n: int, n_ctx: int, tool_format: ToolCallFormat | None,
            strict: bool) -> GenRequest:
    """The OpenAI body parsed, with what it cannot say: repeat_last_n, and max_tokens a bound."""
    req = parse_request(body, kind, body["model"], n_ctx, tool_format, strict)
    try:
        sampling = replace(req.options.sampling, penalty_last_n=last_n)
    except SpecDecodeError as e:
        raise from_specdecode_error(e) from None
    return replace(req, options=replace(req.options, sampling=sampling), fit_context=True)


def parse_chat(body: Any, card: ModelCard, n_ctx: int, tool_format: ToolCallFormat | None,
               strict: bool = False) -> OllamaRequest:
    """Validate an ``/api/chat`` body (see the module docstring). n_ctx: the context size in
    tokens. tool_format: the served model's tool-call format (None: tools are a 400). strict:
    the server's ``--strict``. Raises APIError with Ollama's field names: 404 for another
    model, 400 for anything else."""
    model, fields, last_n = _common(body, _CHAT_FIELDS, card, n_ctx)
    try:
        if not body.get("messages"):
            if body.get("messages") is not None and not isinstance(body["messages"], list):
                raise _error(f"messages must be a list of messages, got {json_repr(body['messages'])}", "messages")
            return OllamaRequest("chat", model, None)
        fields.update(messages=chat_messages(body["messages"]), tools=body.get("tools") or None)
        return OllamaRequest("chat", model, _finish(fields, "chat", last_n, n_ctx, tool_format, strict))
    except APIError as e:
        raise rename_error(e, "chat") from None


def parse_generate(body: Any, card: ModelCard, n_ctx: int, tool_format: ToolCallFormat | None,
                   strict: bool = False) -> OllamaRequest:
    """Validate an ``/api/generate`` body (see the module docstring): a fill-in-the-middle
    prompt for a non-empty suffix, the prompt as it is under raw, else a chat prompt of the
    system message and the prompt. Raises APIError as :func:`parse_chat`."""
    model, fields, last_n = _common(body, _GENERATE_FIELDS, card, n_ctx)
    b = BodyFields(body)
    prompt, suffix, system, raw = b.string("prompt"), b.string("suffix"), b.string("system"), b.boolean("raw")
    if raw and system:
        raise _error("raw mode does not take a system message: put it in the prompt yourself, or leave raw out",
                     "system")
    try:
        if suffix:
            fields.update(prompt=prompt or "", suffix=suffix)
            return OllamaRequest("generate", model, _finish(fields, "completion", last_n, n_ctx, None, strict))
        if not prompt:
            return OllamaRequest("generate", model, None)
        if raw:
            fields.update(prompt=prompt)
            return OllamaRequest("generate", model, _finish(fields, "completion", last_n, n_ctx, None, strict))
        fields["messages"] = ([{"role": "system", "content": system}] if system else []) + \
            [{"role": "user", "content": prompt}]
        return OllamaRequest("generate", model, _finish(fields, "chat", last_n, n_ctx, None, strict), bool(system))
    except APIError as e:
        raise rename_error(e, "generate", bool(system)) from None
