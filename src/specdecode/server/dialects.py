"""Every API the server speaks, one :class:`.runner.Dialect` each: the app adds their routes
(:class:`.app._Routes`), and errors under a dialect's ``prefix`` are answered in its shape
(registered here with :func:`.access.register_error_shape`, for the middleware's answers too).
Adding an API is one module and one line here.
"""

from __future__ import annotations

from . import anthropic_events, infill_response, ollama, responses, responses_events
from .access import register_error_shape
from .runner import Dialect

DIALECTS: tuple[Dialect, ...] = (
    responses.CHAT,                  # POST /v1/chat/completions (OpenAI)
    responses.COMPLETIONS,           # POST /v1/completions (OpenAI, with suffix)
    responses_events.DIALECT,        # POST /v1/responses (OpenAI's Responses API)
    infill_response.DIALECT,         # POST /infill (llama.cpp)
    ollama.CHAT,                     # POST /api/chat and Ollama's other endpoints
    ollama.GENERATE,                 # POST /api/generate (Ollama)
    anthropic_events.DIALECT,               # POST /v1/messages (Anthropic's Messages API)
)


for _dialect in DIALECTS:
    if _dialect.prefix is not None:
        register_error_shape(_dialect.prefix, _dialect.error_body)
