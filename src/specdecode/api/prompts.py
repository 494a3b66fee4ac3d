"""What a :class:`~specdecode.api.Decoder` makes of the prompt it is given, as the target's
token ids: a raw prompt, chat messages through the model's template, or a fill-in-the-middle
prompt (:mod:`specdecode.backends.fim`); and the refusal of text options for a model over codes.
The callers hold the tokenizer's lock and check that the decoder is open."""

from __future__ import annotations

from typing import Sequence

from ..backends.base import Backend
from ..backends.chat_prompt import chat_prompt_ids
from ..backends.fim import FimBudget, FimInput, check_extra, fim_prompt_ids
from ..errors import SpecDecodeError
from ..limits import check_text
from ..messages import check_messages, template_messages
from ..request import GenerationOptions


def text_prompt_ids(target: Backend, prompt: str | None, messages: Sequence[dict] | None,
                    tools: Sequence[dict] | None = None) -> list[int]:
    """A raw prompt (special tokens parsed, BOS where the model adds one) or chat messages (the
    template's markers the only special tokens) as token ids [L >= 1]. Raises SpecDecodeError
    naming the field (an empty prompt where the model adds no start token: param prompt)."""
    if messages is not None:
        checked = template_messages(check_messages(list(messages) if isinstance(messages, tuple) else messages))
        return chat_prompt_ids(target, checked, tools)  # the request's texts as text
    if not isinstance(prompt, str):
        raise SpecDecodeError(f"prompt must be a string, got {type(prompt).__name__}", param="prompt")
    ids = target.tokenize(check_text(prompt, "prompt"), add_special=True, parse_special=True)
    if not ids:  # "" where the model adds no start token: named as the caller gave it, not as prompt_ids
        raise SpecDecodeError(f"prompt is empty: the target {target.name} adds no start token, so it gives "
                              "no token to continue from; give some text", param="prompt")
    return ids


def fim_ids(target: Backend, prompt: str | None, messages: Sequence[dict] | None, suffix: str | None,
            extra: Sequence | None, budget: FimBudget | None = None, typed: str = "") -> list[int]:
    """A fill-in-the-middle prompt's token ids: prompt the code before the cursor, suffix after
    it, extra other files ((filename, text) pairs or ``[{"filename", "text"}]``). Raises
    SpecDecodeError: param suffix for chat messages or a model without FIM tokens, extra[i] for a
    malformed file. budget: trim to fit as llama.cpp's /infill does (None: keep all); typed:
    /infill's ``prompt`` field, after the prefix (:class:`FimInput`)."""
    if messages is not None:
        raise SpecDecodeError("suffix and extra make a fill-in-the-middle prompt from a prompt (the code before "
                              "the cursor), not from chat messages", param="suffix")
    fim = FimInput(check_text(prompt, "prompt"), check_text(suffix or "", "suffix"), check_extra(extra),
                   prompt=check_text(typed, "prompt"))
    return fim_prompt_ids(target, fim, budget=budget)


def check_codes(target: Backend, prompt, messages, fields: dict) -> None:
    """A target without text takes ids only: refuse each text-only option by name."""
    if target.has_text:
        return
    given = {"prompt": prompt is not None, "messages": messages is not None,
             "stop": bool(fields.get("stop")), "grammar": fields.get("grammar") is not None,
             "suffix": fields.get("suffix") is not None or fields.get("extra") is not None,
             "prediction": isinstance(fields.get("prediction"), str) or isinstance(fields.get("prediction"), list)
             and any(isinstance(t, (str, dict)) for t in fields["prediction"])}
    opts = fields.get("options")
    if isinstance(opts, GenerationOptions):
        given["stop"] = given["stop"] or bool(opts.stop)
        given["grammar"] = given["grammar"] or opts.grammar is not None
    for name, is_given in given.items():
        if is_given:
            raise SpecDecodeError(f"{name} is a text option, and target {target.name} is a model over codes "
                                  f"(no tokenizer): give token ids (generate_ids, prompt_ids=) and leave {name} out",
                                  param=name)
