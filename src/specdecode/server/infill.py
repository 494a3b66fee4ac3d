"""``POST /infill``: llama.cpp's fill-in-the-middle endpoint, as llama.vim and llama.vscode call it,
answered from the same worker, limits, access checks and speculation as the OpenAI endpoints.

The body is read as llama.cpp's server reads it (tools/server: ``handle_infill``,
``params_from_json_cmpl``, ``format_infill``; ggml-org/llama.cpp) into a :class:`GenRequest` of
kind "infill" (:class:`InfillGenRequest`) whose :class:`FimInput` is ``input_prefix``, ``prompt``
(tokenized on its own, its tokens right after the prefix's, as llama.cpp puts them),
``input_suffix`` and ``input_extra``'s files.
The generation stops as llama.cpp's ``process_token`` stops it (:class:`InfillWatch`): after
``t_max_predict_ms`` at a token holding a newline, and before a line indented less than
``n_indent``. The answer is llama.cpp's result object (:mod:`.infill_response`). Every field is
documented in docs/server.md ("Code completion: POST /infill").
"""

from __future__ import annotations

import re
import time
from dataclasses import dataclass, replace
from typing import Any, Callable

from ..backends.fim import DEFAULT_EXTRA_FILE, FimInput
from ..errors import SpecDecodeError
from ..limits import MAX_N
from ..messages import json_repr
from ..request import GenerationOptions
from ..sampling import SamplingParams
from .apierror import APIError, from_specdecode_error
from .body import BodyFields
from .extensions import parse_speculative, wants_trace
from .protocol import GenRequest

# Every field /infill takes (docs/server.md says which are honoured and which are accepted
# as harmless); anything else is a 400 naming it.
INFILL_FIELDS = frozenset({
    "input_prefix", "input_suffix", "input_extra", "prompt", "model", "n_predict", "t_max_predict_ms",
    "t_max_prompt_ms", "n_indent", "cache_prompt", "id_slot", "samplers", "temperature", "top_k", "top_p", "min_p",
    "repeat_penalty", "repeat_last_n", "presence_penalty", "frequency_penalty", "seed", "stop", "stream",
    "response_fields", "n_cmpl", "speculative",
})
# The keys of one input_extra chunk: llama.vim and llama.vscode also send the time it was taken.
CHUNK_FIELDS = ("text", "filename", "time")
# llama.cpp's sampler names (common_sampler_types_from_names, canonical names only, as its server
# reads them) and their one-letter forms (common_sampler_types_from_chars).
SAMPLER_NAMES = {"dry": "d", "top_k": "k", "top_p": "p", "top_n_sigma": "s", "typ_p": "y", "min_p": "m",
                 "temperature": "t", "xtc": "x", "infill": "i", "penalties": "e"}
# llama.cpp's defaults (common_params_sampling): the chain without samplers, and its values.
DEFAULT_SAMPLERS = ("penalties", "dry", "top_n_sigma", "top_k", "typ_p", "top_p", "min_p", "xtc", "temperature")
DEFAULTS = {"temperature": 0.8, "top_k": 40, "top_p": 0.95, "min_p": 0.05, "repeat_penalty": 1.0,
            "repeat_last_n": 64, "presence_penalty": 0.0, "frequency_penalty": 0.0}
_LLAMA_NAMES = {"repetition_penalty": "repeat_penalty", "penalty_last_n": "repeat_last_n"}
# Seeds llama.cpp reads as "draw one" (LLAMA_DEFAULT_SEED, and -1).
RANDOM_SEEDS = (-1, 0xFFFFFFFF)


@dataclass(frozen=True)
class InfillLimits:
    """What ends an /infill generation besides its own end, max tokens and stop strings.

    t_max_predict_ms: 0 (none), or the milliseconds of generation after which a token holding a
    newline ends it. n_indent: 0 (none), or the indentation (spaces and tabs) a line after the
    first must have: the output ends before the first character of a line indented less.
    no_output: n_predict 0: the prompt is read into a slot's cache and nothing is generated.
    clock: seconds, monotonic (time.perf_counter; tests script it).
    """

    t_max_predict_ms: float = 0.0
    n_indent: int = 0
    no_output: bool = False
    clock: Callable[[], float] = time.perf_counter

    def watch(self, token_bytes: Callable[[int], bytes]) -> "InfillWatch":
        """A choice's watch, started now (its generation has just been prefilled)."""
        return InfillWatch(self, token_bytes)


class InfillWatch:
    """One choice's llama.cpp stop rules, applied to its text as it is committed (the worker feeds
    it each delta: :class:`InfillGenRequest` ``watch``).

    llama.cpp's ``process_token`` (tools/server/server-context.cpp) runs once per token, in this
    order: with ``n_indent`` set, once a newline has been seen, the line starting after the
    newline it last found is measured and, when it holds a character after fewer than n_indent
    spaces or tabs, the output is cut before that character and ends; then, where the token's
    text holds a newline and more than ``t_max_predict_ms`` have passed since generation
    started, the output ends after that token. A speculative step commits several tokens at
    once: they are taken one by one, as llama.cpp's own speculative decoding does, so the text
    ends where it would have ended token by token (a delta whose text is not its tokens' pieces,
    e.g. a character split across tokens, is taken line by line).

    ``stopped``: end the choice now. ``feed(delta)`` returns the part of the delta's text kept;
    ``finish(result)`` gives the result with the kept text (finish_reason "length" where the
    watch ended it). Raises nothing.
    """

    def __init__(self, limits: InfillLimits, token_bytes: Callable[[int], bytes]) -> None:
        self.limits = limits
        self.token_bytes = token_bytes
        self.started = limits.clock()
        self.text = ""
        self.stopped = limits.no_output
        self.has_new_line = False
        self.last_nl_pos = 0

    def _pieces(self, delta: Any) -> list[str]:
        text = str(delta)
        pieces = [self.token_bytes(t).decode("utf-8", "replace") for t in getattr(delta, "token_ids", ())]
        return pieces if "".join(pieces) == text else re.split(r"(?<=\n)", text)

    def feed(self, delta: Any) -> str:
        if self.stopped or not str(delta):
            return ""
        elapsed_ms = (self.limits.clock() - self.started) * 1000.0
        before = len(self.text)
        for piece in self._pieces(delta):
            self.text += piece
            self._indent_rule()
            if not self.stopped and "\n" in piece:
                self.has_new_line = True
                if 0 < self.limits.t_max_predict_ms < elapsed_ms:
                    self.stopped = True
            if self.stopped:
                break
        return self.text[before:]

    def _indent_rule(self) -> None:
        if not (self.has_new_line and self.limits.n_indent > 0):
            return
        if self.last_nl_pos > 0:
            pos = self.last_nl_pos
            while pos < len(self.text) and self.text[pos] in " \t":
                pos += 1
            if pos < len(self.text) and pos - self.last_nl_pos < self.limits.n_indent:
                self.text, self.stopped = self.text[:pos], True
                return
        nl = self.text.find("\n", self.last_nl_pos)
        if nl >= 0:
            self.last_nl_pos = nl + 1

    def finish(self, result: Any) -> Any:
        return replace(result, text=self.text, finish_reason="length" if self.stopped else result.finish_reason)


@dataclass
class InfillGenRequest(GenRequest):
    """An /infill request as the worker runs it: a GenRequest (kind "infill", fim set) with its
    stop rule. watch: called with the target's token_bytes when a choice's generation has been
    prefilled, it gives the choice's :class:`InfillWatch` (``stopped``, ``feed(delta)``,
    ``finish(result)``), which the worker consults after every step; None: no rule."""

    watch: Callable[[Callable[[int], bytes]], InfillWatch] | None = None


@dataclass
class InfillRequest:
    """A parsed /infill body: the request the worker runs, and what its answer shows.

    req: the GenRequest (kind "infill", its fim set, n = n_cmpl; n_cmpl x n_predict at most the
    context, and with n_predict -1 and n_cmpl > 1 each completion at most n_ctx / n_cmpl tokens).
    n_predict: as given (-1: until the model ends the middle or the context is full). samplers:
    the llama.cpp sampler chain the sampling parameters came from. response_fields: llama.cpp's projection of the answer (paths
    such as "timings/prompt_n"), empty for the whole object.
    """

    req: GenRequest
    n_predict: int
    samplers: tuple[str, ...]
    response_fields: tuple[str, ...]
    limits: InfillLimits


def parse_infill(body: Any, model_name: str, n_ctx: int, fim_model: bool,
                 clock: Callable[[], float] = time.perf_counter, strict: bool = False) -> InfillRequest:
    """Validate an /infill body (module docstring; docs/server.md).

    model_name: the served model (``model`` may be absent, "" as llama.vim sends it, or this).
    n_ctx: the context size in tokens. fim_model: whether the target has FIM tokens (a 400
    naming the model and input_suffix otherwise). clock: the limits' clock (seconds). strict:
    the server's default for ``speculative.strict``. Raises APIError: 400 naming the field at
    fault (``input_extra[2].text``, ``samplers[0]``, an unknown field, ...), 404 for another model.
    """
    if not isinstance(body, dict):
        raise APIError(400, f"the request body must be a JSON object, got {json_repr(body)}")
    unknown = [name for name in body if name not in INFILL_FIELDS]
    if unknown:
        raise APIError(400, f"unsupported field(s) for /infill: {', '.join(unknown)}. /infill takes: "
                       + ", ".join(sorted(INFILL_FIELDS)), param=unknown[0])
    b = BodyFields(body)
    model = b.string("model")
    if model not in (None, "", model_name):
        raise APIError(404, f"the model {json_repr(model)} does not exist: this server serves {json_repr(model_name)}",
                       param="model", code="model_not_found")
    if not fim_model:
        raise APIError(400, f"the model {json_repr(model_name)} has no fill-in-the-middle tokens (a prefix, a suffix "
                       "and a middle token, such as Qwen2.5-Coder's <|fim_prefix|>, <|fim_suffix|>, <|fim_middle|>): "
                       "/infill cannot complete between input_prefix and input_suffix; serve a code model trained "
                       "for it", param="input_suffix")
    prefix, suffix = _required_text(b, "input_prefix"), _required_text(b, "input_suffix")
    fim = FimInput(prefix=prefix, suffix=suffix, extra=parse_extra(body.get("input_extra")), fit=True,
                   prompt=b.string("prompt") or "")
    n_predict = b.integer("n_predict", -1, n_ctx, " (-1: until the middle ends or the context is full; 0: read "
                          "the prompt into the cache only; at most the context size)")
    n_predict = -1 if n_predict is None else n_predict
    t_max = b.number("t_max_predict_ms")
    if t_max is not None and t_max < 0:
        raise APIError(400, f"t_max_predict_ms = {json_repr(body['t_max_predict_ms'])} is out of range: expected "
                       "t_max_predict_ms >= 0 (0: no limit)", param="t_max_predict_ms")
    b.number("t_max_prompt_ms")
    b.boolean("cache_prompt")
    b.integer("id_slot", -1)
    n = b.integer("n_cmpl", 1, MAX_N, " (completions run one after another in one slot on this server)") or 1
    if n > 1 and n * n_predict > n_ctx:  # at most one context's worth of tokens in all (issue 61: 169 s)
        raise APIError(400, f"n_cmpl = {n} completions of n_predict = {n_predict} tokens are {n * n_predict} tokens, "
                       f"more than the context ({n_ctx}) this server generates for one request: lower n_cmpl or "
                       "n_predict", param="n_cmpl")
    per_completion = n_predict if n_predict > 0 else (n_ctx // n if n > 1 and n_predict < 0 else None)
    samplers = parse_samplers(body.get("samplers"))
    limits = InfillLimits(t_max_predict_ms=t_max or 0.0, n_indent=b.integer("n_indent", 0) or 0,
                          no_output=n_predict == 0, clock=clock)
    try:
        options = GenerationOptions(sampling=_sampling(b, samplers), stop=_stop(body.get("stop")),
                                    **parse_speculative(body.get("speculative"), strict))
        trace = wants_trace(body.get("speculative"))
    except SpecDecodeError as e:
        raise from_specdecode_error(e) from None
    stream = bool(b.boolean("stream"))
    watch = limits.watch if (limits.t_max_predict_ms or limits.n_indent or limits.no_output) else None
    req = InfillGenRequest(kind="infill", prompt=fim.prefix, messages=None,
                           max_tokens=per_completion, options=options, stream=stream, n=n,
                           fim=fim, trace=trace, watch=watch, fit_context=True)  # n_predict a bound, as llama.cpp
    return InfillRequest(req, n_predict, samplers, _response_fields(body.get("response_fields")), limits)


def _required_text(b: BodyFields, name: str) -> str:
    value = b.string(name)
    if value is None:
        raise APIError(400, f"{name} is required: the code {'before' if name == 'input_prefix' else 'after'} the "
                       "cursor, a string (it may be empty)", param=name)
    return value


def parse_extra(value: Any) -> tuple[tuple[str, str], ...]:
    """input_extra, llama.cpp's ``[{"filename": str, "text": str}]`` (filename optional, "tmp" by
    default, as llama.cpp; ``time`` accepted, as llama.vim and llama.vscode send it), as (filename,
    text) pairs. Raises APIError (400) naming the chunk's field at fault (``input_extra[2].text``)."""
    if value is None:
        return ()
    if not isinstance(value, list):
        raise APIError(400, f'input_extra must be an array of {{"filename": string, "text": string}}, got '
                       f"{json_repr(value)}", param="input_extra")
    pairs = []
    for i, chunk in enumerate(value):
        where = f"input_extra[{i}]"
        if not isinstance(chunk, dict):
            raise APIError(400, f'{where} must be an object {{"filename": string, "text": string}}, got '
                           f"{json_repr(chunk)}", param=where)
        unknown = [k for k in chunk if k not in CHUNK_FIELDS]
        if unknown:
            raise APIError(400, f"{where}.{unknown[0]} is not a field of an input_extra chunk: a chunk has "
                           f"{', '.join(CHUNK_FIELDS)}", param=f"{where}.{unknown[0]}")
        chunk_fields = BodyFields(chunk, where + ".")
        text, filename = chunk_fields.string("text"), chunk_fields.string("filename")
        chunk_fields.number("time")
        if text is None:
            raise APIError(400, f"{where}.text is required: the chunk's text, a string", param=f"{where}.text")
        pairs.append((DEFAULT_EXTRA_FILE if filename is None else filename, text))
    return tuple(pairs)


def parse_samplers(value: Any) -> tuple[str, ...]:
    """samplers: llama.cpp's chain, a list of names (``["top_k", "top_p", "infill"]``) or a string
    of their letters ("kpi"); absent: llama.cpp's default chain. Raises APIError naming samplers[i]."""
    if value is None:
        return DEFAULT_SAMPLERS
    letters = {c: name for name, c in SAMPLER_NAMES.items()}
    items = list(value) if isinstance(value, (list, str)) else None
    if items is None:
        raise APIError(400, f"samplers must be a list of sampler names or a string of their letters, got "
                       f"{json_repr(value)}", param="samplers")
    names = []
    for i, item in enumerate(items):
        name = letters.get(item) if isinstance(value, str) else item
        if not isinstance(name, str) or name not in SAMPLER_NAMES:
            raise APIError(400, f"samplers[{i}] = {json_repr(item)} is not one of llama.cpp's samplers: "
                           f"{', '.join(SAMPLER_NAMES)} (or their letters {''.join(SAMPLER_NAMES.values())})",
                           param=f"samplers[{i}]")
        names.append(name)
    return tuple(names)


def _sampling(b: BodyFields, samplers: tuple[str, ...]) -> SamplingParams:
    """The sampling parameters, llama.cpp's defaults where absent; a parameter whose sampler is
    not in the chain does not apply (temperature 1, top_k 0, top_p 1, min_p 0, no penalties), as
    in llama.cpp, whose chain ends by drawing from what is left."""
    def value(name: str) -> Any:
        v = b.integer(name) if name in ("top_k", "repeat_last_n") else b.number(name)
        return DEFAULTS[name] if v is None else v

    on = set(samplers)
    seed = b.integer("seed")
    params: dict[str, Any] = {
        "temperature": value("temperature") if "temperature" in on else 1.0,
        "top_k": max(0, value("top_k")) if "top_k" in on else 0,  # llama.cpp: top_k <= 0 keeps all
        "top_p": min(1.0, value("top_p")) if "top_p" in on else 1.0,
        "min_p": value("min_p") if "min_p" in on else 0.0,
        "seed": None if seed is None or seed in RANDOM_SEEDS else seed,
    }
    if "penalties" in on:
        params.update(repetition_penalty=value("repeat_penalty"), penalty_last_n=value("repeat_last_n"),
                      presence_penalty=value("presence_penalty"), frequency_penalty=value("frequency_penalty"))
    try:
        return SamplingParams(**params)
    except SpecDecodeError as e:  # a range SamplingParams checks, in llama.cpp's names
        name = _LLAMA_NAMES.get(e.param, e.param)
        raise APIError(400, str(e).replace(e.param, name) if e.param else str(e), param=name) from None


def _stop(value: Any) -> tuple[str, ...]:
    """stop: a list of strings (empty ones skipped, as llama.cpp skips them)."""
    if value is None:
        return ()
    if not isinstance(value, list) or not all(isinstance(s, str) for s in value):
        raise APIError(400, f"stop must be an array of strings, got {json_repr(value)}", param="stop")
    return tuple(s for s in value if s)


def _response_fields(value: Any) -> tuple[str, ...]:
    if value is None:
        return ()
    if not isinstance(value, list) or not all(isinstance(s, str) for s in value):
        raise APIError(400, f"response_fields must be an array of strings (paths such as \"timings/prompt_n\"), got "
                       f"{json_repr(value)}", param="response_fields")
    return tuple(value)


# Fields an error found in preparation names (the completion's) -> /infill's: the prompt is
# input_prefix (with prompt, input_suffix and input_extra), max_tokens is n_predict.
_RENAMED = {"prompt": "input_prefix", "messages": "input_prefix", "suffix": "input_suffix", "max_tokens": "n_predict"}


def infill_error(e: APIError) -> APIError:
    """An error found when the request was prepared, in /infill's words (:data:`_RENAMED`)."""
    if e.param not in _RENAMED or e.param == "prompt" and e.code != "context_length_exceeded":
        return e  # (prompt is also /infill's own field: its own errors keep its name)
    message = e.message.replace("max_tokens", "n_predict") if e.param == "max_tokens" else e.message
    return APIError(e.status, message, e.type, _RENAMED[e.param], e.code)
