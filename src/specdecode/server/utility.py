"""llama.cpp's utility endpoints, which editors and proxies call beside its completions
(tools/server: ``handle_tokenize``, ``handle_detokenize``, ``handle_props``; ggml-org/llama.cpp):

- ``POST /tokenize`` ``{"content": str, "add_special": false, "parse_special": true,
  "with_pieces": false}`` -> ``{"tokens": [id, ...]}``, or with ``with_pieces``
  ``{"tokens": [{"id": id, "piece": str}, ...]}`` (a piece that is no UTF-8 on its own: its
  bytes as a list of integers, as llama.cpp gives it; a control token such as ``<|im_end|>``
  as its text).
- ``POST /detokenize`` ``{"tokens": [id, ...]}`` -> ``{"content": str}`` (control tokens as
  their text, as llama.cpp renders them; ids outside the vocabulary: 400 naming the first).
- ``GET /props``: ``default_generation_settings`` (``n_ctx``, ``params`` with the defaults a
  request gets, ``speculative.n_max``), ``total_slots``, ``model_alias``, ``model_path``,
  ``chat_template``, ``modalities``, ``bos_token`` / ``eos_token``, ``build_info``, and this
  server's ``speculative`` (the drafters and K it was started with).

Errors are OpenAI-shaped 400s naming the field, as on every route of the server's own.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from ..messages import json_repr
from .apierror import APIError
from .body import BodyFields, parse_json_body, read_body
from .page import info_view

if TYPE_CHECKING:
    from fastapi import FastAPI, Request
    from fastapi.responses import Response

# The most ids one /detokenize may send (a whole context of the largest models is far less).
MAX_DETOKENIZE = 1 << 20


def piece_bytes(target: Any, token_id: int) -> bytes:
    """A token's piece as llama.cpp's server renders it (special tokens included: a control
    token such as ``<|im_end|>``, which has no text piece, shows its vocabulary text)."""
    return target.token_bytes(token_id) or target.token_text(token_id)


def piece_text(target: Any, token_id: int) -> str:
    return piece_bytes(target, token_id).decode("utf-8", "replace")


def _piece(data: bytes) -> str | list[int]:
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError:
        return list(data)


class UtilityRoutes:
    """/tokenize, /detokenize and /props around the app's routes object (its decoder, worker,
    options and model name; :class:`.app._Routes`)."""

    def __init__(self, server: Any) -> None:
        self.server = server

    def add_to(self, app: FastAPI) -> None:
        app.add_route("/tokenize", self.tokenize, methods=["POST"])
        app.add_route("/detokenize", self.detokenize, methods=["POST"])
        app.add_route("/props", self.props, methods=["GET"])

    async def _body(self, request: Request, fields: tuple[str, ...]) -> dict:
        body = parse_json_body(await read_body(request, self.server.options.max_body_bytes))
        if not isinstance(body, dict):
            raise APIError(400, f"the request body must be a JSON object, got {json_repr(body)}")
        unknown = [k for k in body if k not in fields]
        if unknown:
            raise APIError(400, f"{unknown[0]} is not a field of {request.url.path}: it takes {', '.join(fields)}",
                           param=unknown[0])
        return body

    async def tokenize(self, request: Request) -> Response:
        from fastapi.responses import JSONResponse

        body = await self._body(request, ("content", "add_special", "parse_special", "with_pieces"))
        b = BodyFields(body)
        content = b.string("content")
        if content is None:
            raise APIError(400, "content is required: the text to tokenize, a string", param="content")
        add_special, parse_special = bool(b.boolean("add_special")), b.boolean("parse_special") is not False
        decoder = self.server.decoder
        ids = await self.server.worker.preparer.run_async(decoder.tokenize, content, add_special, parse_special)
        if not b.boolean("with_pieces"):
            return JSONResponse({"tokens": ids})
        target = decoder.target
        return JSONResponse({"tokens": [{"id": i, "piece": _piece(piece_bytes(target, i))} for i in ids]})

    async def detokenize(self, request: Request) -> Response:
        from fastapi.responses import JSONResponse

        body = await self._body(request, ("tokens",))
        tokens = body.get("tokens", [])
        n_vocab = self.server.decoder.target.n_vocab
        if not isinstance(tokens, list) or len(tokens) > MAX_DETOKENIZE:
            raise APIError(400, f"tokens must be a list of at most {MAX_DETOKENIZE} token ids, got "
                           f"{json_repr(tokens)}", param="tokens")
        for i, t in enumerate(tokens):
            if isinstance(t, bool) or not isinstance(t, int) or not 0 <= t < n_vocab:
                raise APIError(400, f"tokens[{i}] = {json_repr(t)} is not a token id: expected an integer 0 <= id < "
                               f"{n_vocab} (the vocabulary size)", param=f"tokens[{i}]")
        target = self.server.decoder.target
        text = b"".join(piece_bytes(target, t) for t in tokens).decode("utf-8", "replace")
        return JSONResponse({"content": text})

    async def props(self, request: Request) -> Response:
        from fastapi.responses import JSONResponse

        return JSONResponse(props(self.server))


def props(server: Any) -> dict:
    """``GET /props`` as llama.cpp's server answers it (module docstring)."""
    decoder, target = server.decoder, server.decoder.target
    info = info_view(decoder, server.model_name)
    k = info["num_speculative_tokens"]

    def token(token_id: int | None) -> str:
        return piece_text(target, token_id) if token_id is not None else ""

    params = {"n_predict": -1, "temperature": 1.0, "top_k": 0, "top_p": 1.0, "min_p": 0.0, "seed": -1,
              "stream": False, "speculative.n_max": k, "speculative.n_min": 0}
    return {
        "default_generation_settings": {"id": 0, "id_task": -1, "n_ctx": server.worker.n_ctx, "speculative": k > 0,
                                        "is_processing": server.worker.running() > 0, "params": params},
        "total_slots": server.worker.slots,
        "model_alias": server.model_name,
        "model_path": str(target.path) if target.path is not None else target.name,
        "chat_template": target.chat_template or "",
        "modalities": {"vision": False, "audio": False},
        "bos_token": token(target.bos_id),
        "eos_token": token(target.eos_id),
        "build_info": "specdecode",
        "n_ctx": server.worker.n_ctx,
        "speculative": {"draft": info["draft"], "drafters": info["drafters"], "n_max": k,
                        "trees": info["trees"]},
    }
