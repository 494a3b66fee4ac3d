"""Request fields beyond the core OpenAI ones: predicted outputs (OpenAI's ``prediction``) and
speculation per request (``speculative``, this server's extension), parsed and checked
without the model; and what the response reports of them (``usage.completion_tokens_details``).

``prediction``: ``{"type": "content", "content": str | [{"type": "text", "text": str}, ...]}``.
The text is tokenized once with the target's tokenizer when the request runs; drafts follow it
(:mod:`specdecode.drafters.prediction`), and the output stays the target's.

``speculative``: ``{"draft": "auto" | "none" | "ngram" | "suffix" | "prediction" | <a loaded
draft model's name>, "num_speculative_tokens": int 0..32 | "auto", "max_tree_nodes": int 0..64,
"trace": bool, "strict": bool}``, each optional (``max_tree_nodes``: the nodes a tree of drafts may hold, 0 =
chains; trees on a target loaded for chains only are a 400 naming ``speculative.max_tree_nodes``;
``trace``: each streamed chunk also carries ``speculation_trace``, see :func:`trace_of`). It may
only choose among what the server loaded: a drafter that is not loaded is a 400 naming
``speculative.draft`` when the request runs. ``"auto"`` (or absent) lets the cost-aware
controller plan; an integer K with one drafter named drafts K tokens every step; with
``"auto"`` as draft an integer K is the cap. ``strict`` (default: the server's ``--strict``):
verify only in blocks whose logits equal one-token steps (``batch_invariant`` "on"), so that a
greedy answer is bit for bit what plain decoding gives it alone, in any batch, with any drafter.

Pure: no FastAPI, no model.
"""

from __future__ import annotations

from typing import Any

from ..errors import SpecDecodeError
from ..limits import MAX_NUM_SPECULATIVE_TOKENS, MAX_TREE_NODES, is_int
from ..messages import json_repr, text_parts

# An option the engine names (SpecDecodeError.param) -> the request field that set it.
FIELD_OF_OPTION = {"draft": "speculative.draft", "num_speculative_tokens": "speculative.num_speculative_tokens",
                   "prediction": "prediction", "max_tree_nodes": "speculative.max_tree_nodes",
                   "batch_invariant": "speculative.strict"}
SPECULATIVE_FIELDS = ("draft", "num_speculative_tokens", "max_tree_nodes", "trace", "strict")


def _error(message: str, param: str) -> SpecDecodeError:
    return SpecDecodeError(message, param=param)  # the request's parser answers it as a 400


def parse_content(value: Any, field: str = "prediction") -> str | None:
    """The text of a request field in OpenAI's predicted-output shape (``prediction``, and
    any field a drafter kind reads: ``{"type": "content", "content": str | [text parts]}``),
    or None (absent, null or empty). Raises SpecDecodeError (param: the field) for any other shape."""
    if value is None:
        return None
    if not isinstance(value, dict) or value.get("type") != "content" or set(value) != {"type", "content"}:
        raise _error(f'{field} must be {{"type": "content", "content": ...}}, got {json_repr(value)}', field)
    return text_parts(value["content"], f"{field}.content", exact=True) or None


def parse_speculative(value: Any, strict: bool = False) -> dict:
    """The GenerationOptions fields a ``speculative`` object sets (draft,
    num_speculative_tokens, max_tree_nodes; batch_invariant "on" when ``strict``, its own or,
    when it gives none, the server's default ``strict``). Raises SpecDecodeError (param: the
    field) for a wrong shape, an unknown key or an out-of-range K or node budget."""
    if value is None:
        return {"batch_invariant": "on"} if strict else {}
    if not isinstance(value, dict):
        raise _error(f"speculative must be an object, got {json_repr(value)}", "speculative")
    unknown = sorted(set(value) - set(SPECULATIVE_FIELDS))
    if unknown:
        raise _error(f"speculative.{unknown[0]} is not a field: speculative takes {', '.join(SPECULATIVE_FIELDS)}",
                     f"speculative.{unknown[0]}")
    out: dict = {}
    draft = value.get("draft")
    if draft is not None:
        if not isinstance(draft, str) or not draft:
            raise _error(f"speculative.draft must be a non-empty string, got {json_repr(draft)}", "speculative.draft")
        out["draft"] = draft
    k = value.get("num_speculative_tokens")
    if k is not None and k != "auto":
        if not is_int(k) or not 0 <= k <= MAX_NUM_SPECULATIVE_TOKENS:
            raise _error(f"speculative.num_speculative_tokens = {json_repr(k)} is out of range: expected an integer "
                         f"0..{MAX_NUM_SPECULATIVE_TOKENS} or \"auto\"", "speculative.num_speculative_tokens")
        out["num_speculative_tokens"] = k
        if k == 0 and "draft" not in out:  # a named draft is still checked against what is loaded
            out["draft"] = "none"
    nodes = value.get("max_tree_nodes")
    if nodes is not None:
        if not is_int(nodes) or not 0 <= nodes <= MAX_TREE_NODES:
            raise _error(f"speculative.max_tree_nodes = {json_repr(nodes)} is out of range: expected an integer "
                         f"0..{MAX_TREE_NODES} (0: chains only)", "speculative.max_tree_nodes")
        out["max_tree_nodes"] = nodes
    own = value.get("strict")
    if own is not None and not isinstance(own, bool):
        raise _error(f"speculative.strict must be true or false, got {json_repr(own)}", "speculative.strict")
    if (strict if own is None else own):
        out["batch_invariant"] = "on"
    return out


def wants_trace(value: Any) -> bool:
    """Whether a ``speculative`` object asks for ``speculation_trace`` in the stream's chunks.
    Raises SpecDecodeError (param speculative.trace) for a value that is not a boolean."""
    trace = value.get("trace", False) if isinstance(value, dict) else False
    if not isinstance(trace, bool):
        raise _error(f"speculative.trace must be true or false, got {json_repr(trace)}", "speculative.trace")
    return trace


def trace_of(delta: Any, note: str | None) -> dict:
    """A streamed chunk's ``speculation_trace`` (requests with ``speculative.trace``): its text
    as ``runs`` [{"text", "by"}] (by: the drafter whose accepted draft gave those characters,
    null for the target's own tokens; the texts concatenate to the chunk's content), the
    ``step`` it came from ({"k": drafted, "accepted", "committed", "by"}, null for the text
    held back until the end) and the controller's ``note`` on the generation so far."""
    return {"runs": delta.runs or ([{"text": str(delta), "by": None}] if str(delta) else []), "step": delta.step,
            "note": note}


def completion_details(results: list) -> dict | None:
    """usage.completion_tokens_details of a request with a prediction: accepted_prediction_tokens
    (drafted from the prediction and accepted by the target) and rejected_prediction_tokens
    (drafted from it, verified and discarded), summed over the choices; None without one."""
    stats = [r.stats for r in results if getattr(r.stats, "accepted_prediction_tokens", None) is not None]
    if not stats:
        return None
    return {"accepted_prediction_tokens": sum(s.accepted_prediction_tokens for s in stats),
            "rejected_prediction_tokens": sum(s.rejected_prediction_tokens for s in stats)}
