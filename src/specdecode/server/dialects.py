"""Every API the server speaks, one :class:`.runner.Dialect` each: the app adds their routes
(:class:`.app._Routes`) and answers errors under a dialect's ``prefix`` in its shape
(:func:`.access.error_response`). Adding an API is one module and one line here.
"""

from __future__ import annotations

from . import anthropic_events, infill_response, ollama, responses, responses_events
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


def dialect_for(path: str) -> Dialect | None:
    """The dialect whose errors a request to ``path`` gets (its ``prefix``), or None (OpenAI's)."""
    for dialect in DIALECTS:
        if dialect.prefix is not None and path.startswith(dialect.prefix):
            return dialect
    return None
