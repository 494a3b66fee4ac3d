"""OpenAI-compatible HTTP server: ``specdecode serve``.

Endpoints: POST /v1/completions, POST /v1/chat/completions, GET /v1/models,
GET /health, GET /metrics (Prometheus text format).

One loaded model pair serves every request. The engine is not thread-safe, so a single
worker thread runs generations one at a time in arrival order; text deltas travel to the
asyncio side through a per-request queue. Requests wait in a bounded queue
(``max_queue`` waiting, besides the one running); a full queue answers 429. A client
that disconnects cancels its request: a waiting one leaves the queue at once, a running
one has its generator closed after the current step, which rolls the caches back.

Request fields honoured (a field whose value is null counts as absent):
    model (required; must be the served model's id), prompt (completions: one string) or
    messages (chat: role system/user/assistant, content a string or a list of text
    parts), max_tokens / max_completion_tokens, temperature (0..MAX_TEMPERATURE = 2),
    top_p, top_k, min_p, repetition_penalty, presence_penalty, frequency_penalty (engine
    semantics: over the last 64 tokens, prompt included, as llama.cpp's repeat_last_n),
    seed, stop (string or list), stream, stream_options.include_usage, logprobs
    (completions: integer 0..MAX_LOGPROBS; chat: boolean with top_logprobs
    0..MAX_LOGPROBS; see :mod:`specdecode.limits`), n (only 1).
Accepted and ignored: user. Accepted only at their default (no effect): echo = false,
best_of = 1, logit_bias = {}, response_format = {"type": "text"}, tools = [].
Any other field answers 400 naming it.

Defaults: max_tokens 16 for completions (as OpenAI), the rest of the context for chat.
prompt tokens + max_tokens must fit in the context (400 otherwise, code
context_length_exceeded).

Every response carries ``speculation``: the generation's statistics
(:meth:`specdecode.stats.Stats.to_dict`: drafted, accepted, acceptance_rate,
mean_accepted_length, per-position counts, timings) plus the draft and K. In a stream it
rides on the chunk with the finish_reason (and on the usage chunk when
stream_options.include_usage is set); with logprobs, a stream sends all of them on that
final chunk, because the engine streams text, not tokens.

Modules, one job each: :mod:`.protocol` (request parsing and validation, pure),
:mod:`.metrics` (Prometheus), :mod:`.worker` (the generation thread), :mod:`.app` (the
FastAPI routes and responses), :mod:`.cli` (the ``serve`` subcommand). Importing this
package does not import FastAPI, uvicorn or prometheus_client.
"""

from .app import create_app
from .cli import add_serve_parser, cmd_serve
from .metrics import Metrics
from .protocol import APIError, GenRequest, from_specdecode_error, parse_request
from .worker import Job, Worker

__all__ = ["APIError", "GenRequest", "Job", "Metrics", "Worker", "add_serve_parser", "cmd_serve", "create_app",
           "from_specdecode_error", "parse_request"]
