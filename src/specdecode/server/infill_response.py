"""The answers of ``POST /infill`` (:mod:`.infill`) in llama.cpp's shape
(``server_task_result_cmpl_final::to_json_non_oaicompat`` and ``..._partial`` in
tools/server/server-task.cpp, ggml-org/llama.cpp): the result object, its ``timings`` with the
draft counts, the ``response_fields`` projection, and the stream of ``data: {...}`` events.
"""

from __future__ import annotations

import json
import time
from typing import Any

from .apierror import APIError
from .infill import InfillRequest, infill_error, parse_infill
from .jobs import ChoiceDone, Delta
from .runner import Dialect, StreamWriter

# llama.cpp's stop_type names (stop_type_to_str).
STOP_EOS, STOP_WORD, STOP_LIMIT = "eos", "word", "limit"


def timings(stats: Any) -> dict:
    """llama.cpp's ``timings`` of a generation: ``prompt_n`` the prompt tokens evaluated (the
    cached prefix, ``cache_n``, excluded), ``predicted_n`` the tokens generated, their times in
    ms and rates; ``draft_n`` / ``draft_n_accepted`` the drafted tokens verified and accepted
    (llama.cpp shows them only where it drafted; here always, 0 without drafts)."""
    cached = getattr(stats, "prompt_cached", 0)
    prompt_n, predicted_n = stats.prompt_tokens - cached, stats.completion_tokens
    prompt_ms, predicted_ms = stats.prefill_s * 1000.0, stats.decode_s * 1000.0
    return {
        "cache_n": cached,
        "prompt_n": prompt_n,
        "prompt_ms": prompt_ms,
        "prompt_per_token_ms": prompt_ms / prompt_n if prompt_n else 0.0,
        "prompt_per_second": 1000.0 * prompt_n / prompt_ms if prompt_ms > 0 else 0.0,
        "predicted_n": predicted_n,
        "predicted_ms": predicted_ms,
        "predicted_per_token_ms": predicted_ms / predicted_n if predicted_n else 0.0,
        "predicted_per_second": 1000.0 * predicted_n / predicted_ms if predicted_ms > 0 else 0.0,
        "draft_n": stats.drafted,
        "draft_n_accepted": stats.accepted,
    }


def project(obj: dict, paths: tuple[str, ...]) -> dict:
    """llama.cpp's ``response_fields`` (json_get_nested_values): for each path ("content",
    "timings/prompt_n") found in obj, its value under the path itself as a flat key; the
    whole object when no path is given."""
    if not paths:
        return obj
    out = {}
    for path in paths:
        value: Any = obj
        for key in path.split("/"):
            if not isinstance(value, dict) or key not in value:
                break
            value = value[key]
        else:
            out[path] = value
    return out


def stop_type(result: Any) -> str:
    """What ended the output, in llama.cpp's words: "eos" (the model's end token), "word" (a stop
    string), "limit" (n_predict, the context, t_max_predict_ms or n_indent)."""
    if result.finish_reason != "stop":
        return STOP_LIMIT
    return STOP_EOS if result.stats.eog_committed else STOP_WORD


class InfillAnswer:
    """Builds one /infill request's result objects (:mod:`.infill`'s InfillRequest ``ir``)."""

    def __init__(self, ir: Any, model_name: str, n_ctx: int) -> None:
        self.ir = ir
        self.model_name = model_name
        self.n_ctx = n_ctx

    def settings(self) -> dict:
        """``generation_settings``: what the request ran with (llama.vscode reads n_ctx)."""
        req, sampling = self.ir.req, self.ir.req.options.sampling
        return {"n_ctx": self.n_ctx, "n_predict": self.ir.n_predict, "model": self.model_name,
                "seed": sampling.seed, "temperature": sampling.temperature, "top_k": sampling.top_k,
                "top_p": sampling.top_p, "min_p": sampling.min_p, "repeat_penalty": sampling.repetition_penalty,
                "repeat_last_n": sampling.penalty_last_n, "presence_penalty": sampling.presence_penalty,
                "frequency_penalty": sampling.frequency_penalty, "stop": list(req.options.stop),
                "stream": req.stream, "samplers": list(self.ir.samplers), "n_indent": self.ir.limits.n_indent,
                "t_max_predict_ms": self.ir.limits.t_max_predict_ms, "n_cmpl": req.n}

    def final(self, index: int, result: Any, stream: bool) -> dict:
        """The result object of one completion (a stream's last event: content "", as llama.cpp
        sends it, the text having come in the events before), projected by response_fields."""
        s = result.stats
        stops = self.ir.req.options.stop
        kind = stop_type(result)
        obj = {
            "index": index,
            "content": "" if stream else result.text,
            "tokens": [],
            "id_slot": -1,
            "stop": True,
            "model": self.model_name,
            "tokens_predicted": s.completion_tokens,
            "tokens_evaluated": s.prompt_tokens,
            "generation_settings": self.settings(),
            "has_new_line": "\n" in result.text,
            "truncated": kind == STOP_LIMIT and s.prompt_tokens + s.completion_tokens >= self.n_ctx,
            "stop_type": kind,
            # Which stop string matched is not kept: named where only one was given.
            "stopping_word": stops[0] if kind == STOP_WORD and len(stops) == 1 else "",
            "tokens_cached": s.prompt_tokens + s.completion_tokens,
            "timings": timings(s),
            "speculation": s.to_dict(),
        }
        return project(obj, self.ir.response_fields)

    def body(self, choices: list) -> dict | list:
        """A whole answer: the one result object, or with n_cmpl > 1 the list of them (as
        llama.cpp answers several completions). choices: each choice's ChoiceDone event."""
        objects = [self.final(c.index, c.result, stream=False) for c in choices]
        return objects[0] if len(objects) == 1 else objects

    def partial(self, index: int, text: str, n_prompt: int | None, trace: dict | None) -> dict:
        chunk = {"index": index, "content": text, "tokens": [], "stop": False, "id_slot": -1}
        if n_prompt is not None:
            chunk["tokens_evaluated"] = n_prompt
        if trace is not None:  # speculative.trace
            chunk["speculation_trace"] = trace
        return chunk


def _event(obj: dict, name: str = "data") -> str:
    return f"{name}: {json.dumps(obj, ensure_ascii=False)}\n\n"


class InfillStream(StreamWriter):
    """The stream as llama.cpp sends it: ``data: {...}`` events with each piece of ``content``
    and ``stop`` false, then per completion its result object with ``stop`` true, content ""
    and the timings; no ``[DONE]``. An error after the first event is an ``error: {...}``
    event, as llama.cpp's, and ends the stream. It opens at once, before the prompt is read,
    with an empty piece of content. n_prompt: the prompt's tokens (None: not known)."""

    def __init__(self, answer: InfillAnswer, n_prompt: int | None) -> None:
        self.answer = answer
        self.n_prompt = n_prompt

    def open(self) -> list[str]:
        return [_event(self.answer.partial(0, "", self.n_prompt, None))]

    def delta(self, event: Delta) -> list[str]:
        if not event.text and event.trace is None:
            return []
        return [_event(self.answer.partial(event.index, event.text, self.n_prompt, event.trace))]

    def choice(self, event: ChoiceDone, last: bool) -> list[str]:
        return [_event(self.answer.final(event.index, event.result, stream=True))]

    def failed(self, error: APIError) -> list[str]:
        return [_event(error.body(), "error")]


class InfillDialect(Dialect):
    """llama.cpp's ``POST /infill`` (:mod:`.infill`): parsed into a request of kind "infill",
    answered with llama.cpp's result objects. The limits' clock is ``app.state.infill_clock``
    where set (tests), else time.perf_counter."""

    path = "/infill"

    def parse(self, body: Any, server: Any) -> InfillRequest:
        clock = getattr(server.app.state, "infill_clock", None) or time.perf_counter
        fim_model = server.decoder.target.fim_tokens is not None
        return parse_infill(body, server.model_name, server.worker.n_ctx, fim_model, clock, server.options.strict)

    def rename(self, error: APIError, parsed: Any) -> APIError:
        return infill_error(error)

    def whole(self, parsed: InfillRequest, choices: list[ChoiceDone], job: Any, server: Any) -> dict | list:
        return InfillAnswer(parsed, server.model_name, server.worker.n_ctx).body(choices)

    def writer(self, parsed: InfillRequest, job: Any, server: Any) -> InfillStream:
        n_prompt = len(job.prepared.ids) if job.prepared is not None else None
        return InfillStream(InfillAnswer(parsed, server.model_name, server.worker.n_ctx), n_prompt)


DIALECT = InfillDialect()
