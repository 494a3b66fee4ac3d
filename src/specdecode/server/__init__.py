"""OpenAI-compatible HTTP server: ``specdecode serve``.

Endpoints: POST /v1/completions, POST /v1/chat/completions, GET /v1/models,
GET /health, GET /metrics (Prometheus text format); POST /v1/responses (OpenAI's Responses
API: :mod:`.responses_api`); POST /v1/messages and /v1/messages/count_tokens (Anthropic's
Messages API: :mod:`.anthropic`); POST /infill, /tokenize, /detokenize and GET /props
(llama.cpp's: :mod:`.infill`, :mod:`.utility`); Ollama's API under /api/ (chat, generate,
tags, show, ps, version: :mod:`.ollama`). Every generation route runs through one
:class:`.runner.RouteRunner`; the APIs are listed in :mod:`.dialects`.

Who may call: with an API key (``--api-key KEY`` or the environment variable
SPECDECODE_API_KEY, which keeps the key out of the process list; the option wins), every
request under /v1 (indeed every path but /health and /metrics) must send
``Authorization: Bearer KEY`` or ``x-api-key: KEY``; any other gets 401 (OpenAI's error body, code
invalid_api_key, header WWW-Authenticate: Bearer) before its body is read, and nothing
of it reaches the worker (counted as request_rejected_total{reason="unauthorized"}). The
key is compared in constant time. /health and /metrics stay open, key or not: they tell
load balancers and monitoring whether the server is up and how it performs, and give
away no generated text. Without a key the server has no authentication (it warns when
listening beyond loopback).

Request bodies over ``max_body_bytes`` (default 4 MiB, ``--max-body-bytes``) get 413
(code request_too_large) before they are parsed: from their Content-Length, or, sent
chunked, as soon as what has arrived passes the limit.

Clients that hold the server without using it: a connection must send each request's head
within ``header_timeout`` seconds (default 30, ``--header-timeout``: from its opening, or from
a later request's first byte) and its whole body within ``body_timeout`` seconds of the head
(default 60, ``--body-timeout``); past either it gets 408 (code header_timeout /
body_timeout) and is closed. The head's deadline is uvicorn's protocol with
:func:`.connection.http_protocol` (``specdecode serve`` passes it; an app served by other
means, Ray Serve's proxy among them, keeps that server's own rules); the body's is the app's.
A stream may hold at most ``max_unread_bytes`` of output unread in the server (default 1 MiB, ``--max-unread-bytes``; each delta counts its text, its
logprobs and trace as JSON, and 256 bytes for the event): a client that falls further behind
has its generation ended and its slot freed, and its stream ends, after the deltas it left,
with an error (code stream_not_read) in its endpoint's format.

One loaded model pair serves every request. The engine is not thread-safe, so a single
worker thread runs every generation, up to ``--parallel N`` at once (N slots, each with
its own KV cache), advanced together in shared batched steps (continuous batching):
between two steps it admits waiting requests into free slots in arrival order and frees
the slots of finished and cancelled ones. Text deltas travel to the asyncio side through
a per-request queue. Requests that find every slot taken wait in a bounded queue
(``max_queue`` waiting, ``--max-queue``, besides the N running): a request is refused
with 429 only when N running and ``max_queue`` waiting requests are there already (one
that arrives while a slot is free is never refused, though it waits for the next step).
A client that disconnects cancels its request: a waiting one leaves the queue at once, a
running one is ended after the current step (its caches rolled back) and frees its slot.

Request fields honoured (a field whose value is null counts as absent):
    model (required; must be the served model's id), prompt (completions: one string) or
    messages (chat: role system/user/assistant/tool, content a string or a list of text
    parts; an assistant message may carry tool_calls, a tool message its tool_call_id:
    see Tool calls below), max_tokens / max_completion_tokens, temperature (0..MAX_TEMPERATURE = 2),
    top_p, top_k, min_p, repetition_penalty, presence_penalty, frequency_penalty (engine
    semantics: over the last 64 tokens, prompt included, as llama.cpp's repeat_last_n),
    seed, stop (string or list), stream, stream_options.include_usage, logprobs
    (completions: integer 0..MAX_LOGPROBS; chat: boolean with top_logprobs
    0..MAX_LOGPROBS; see :mod:`specdecode.limits`), n (1..MAX_N = 8), response_format
    ({"type": "text"}, {"type": "json_object"}, or {"type": "json_schema", "json_schema":
    {"name", "schema", "strict"}}: structured output, enforced by the grammar mask at every
    verified position, see :mod:`specdecode.grammar`; a schema that cannot be compiled
    answers 400 naming response_format), and for chat tools, tool_choice,
    parallel_tool_calls (see Tool calls below);
    prediction (OpenAI's predicted outputs: ``{"type": "content", "content": str | [text
    parts]}``, both endpoints; drafts follow it and re-align after each change, the output
    stays the target's; usage then carries ``completion_tokens_details`` with
    accepted_prediction_tokens, the prediction's tokens drafted and accepted, and
    rejected_prediction_tokens, those drafted, verified and discarded), speculative (this
    server's extension, which OpenAI clients send with ``extra_body``: ``{"draft": "auto" |
    "none" | "ngram" | "suffix" | "prediction" | <the loaded draft model's name>,
    "num_speculative_tokens": 0..32 | "auto"}``; only what the server loaded, else 400 naming
    speculative.draft; see :mod:`.extensions`).
Accepted and ignored: user. Accepted only at their default (no effect): echo = false,
best_of = 1, logit_bias = {}, and on completions tools = [].
Any other field answers 400 naming it.

Tool calls (chat; :mod:`.tools`, :mod:`.toolcalls`): ``tools`` is OpenAI's list of
``{"type": "function", "function": {"name", "description", "parameters": a JSON schema,
"strict"}}`` (names of 1..64 letters, digits, _ and -, unique); ``tool_choice`` is "auto"
(the default with tools), "none", "required" or ``{"type": "function", "function":
{"name": ...}}`` (one of the tools; 400 naming tool_choice.function.name otherwise);
``parallel_tool_calls`` a boolean (default true). A bad shape is a 400 naming the field
exactly (``tools[1].function.name``). The model's own chat template presents the tools
(Qwen2.5's in its system prompt) and renders the conversation's tool use: assistant
messages with ``tool_calls`` (``[{"id", "type": "function", "function": {"name",
"arguments": JSON text}}]``, content null or text; the template gets each call's arguments
decoded to an object, as templates expect) and ``tool`` messages (``tool_call_id`` and
content). Which format the model writes calls in comes from its chat template (a registry
of formats, :data:`.toolcalls.FORMATS`; today Hermes/Qwen2.5's ``<tool_call>\n{"name":
..., "arguments": {...}}\n</tool_call>``, possibly several); a request with tools for a
model whose template teaches no known format is a 400 (param tools) saying so.
- "auto": the model answers text or calls, unconstrained; its calls are read out of the
  text. "required": the output is forced (the grammar mask, as response_format, exact under
  speculation) to be one call of one of the tools, or one or more with
  parallel_tool_calls, each call's arguments valid for that tool's parameters schema
  (strict or not); a named function: exactly one call of it. "none": the tools are not
  shown to the model and its output is never read for calls, so the answer is text (no
  tool_calls ever), and then response_format may be given too; with any other
  tool_choice, tools and response_format together are a 400.
- The answer: ``message.tool_calls`` (``[{"id": "call_<24 hex>", "type": "function",
  "function": {"name", "arguments": the JSON text as generated}}]``), ``content`` the text
  outside the calls (null when there is none; the whitespace right before a call, and
  after the last one, dropped), ``finish_reason`` "tool_calls" when the choice made calls
  and ended by itself ("length" stays "length": its last call's arguments are then cut).
  Text that does not begin a call as the format has it (another key order, a name that is
  no tool's, arguments that are no object) stays content, tags and all, with
  finish_reason "stop". With parallel_tool_calls false or a named function the answer makes
  one call: the generation ends once its arguments are complete (:class:`.toolcalls.ToolCallWatch`).
- Streaming, as OpenAI does: content deltas hold back text that may begin a
  ``<tool_call>`` (and whitespace that may precede one); a call opens with a delta
  ``{"tool_calls": [{"index": i, "id": ..., "type": "function", "function": {"name": ...,
  "arguments": ""}}]}`` once its name is read, then ``{"tool_calls": [{"index": i,
  "function": {"arguments": <next piece>}}]}`` as its arguments arrive. One parser reads the
  stream delta by delta and the full response's text at once, so the stream's content and
  argument pieces join to the full response's (for the same text). A call whose
  arguments break after its name was read is still a call, with the arguments as generated
  (OpenAI's arguments may be no valid JSON either; under required or a named function they
  always are). With logprobs, a delta's logprobs ride on the first chunk its text gives, on
  an empty delta when the parser holds all of it back.

Defaults: temperature 1 (as OpenAI; the CLI and the Python API default to greedy, so
send temperature 0 for greedy output), max_tokens 16 for completions (as OpenAI), the
rest of the context for chat; with n > 1 the default max_tokens is also at most
context size // n. prompt tokens + max_tokens must fit in the context (400 otherwise,
code context_length_exceeded).

n choices: each is its own sequence, generated one after another in the request's slot
(other requests run in the other slots meanwhile), indexed 0..n-1. With a seed, choice i samples
with seed + i (so a seeded request repeats choice by choice, and choice 0 is what the
same request with n = 1 gives); without one, each choice draws its own seed. n *
max_tokens must be at most the context size (400 naming n): one request may not hold
its slot for more tokens than one full-context generation. usage counts the prompt
once and sums the choices' completion tokens. A stream sends the choices in turn, every
chunk naming its choice's ``index`` (chat: each choice opens with its role chunk); each
choice ends with its finish_reason chunk. As OpenAI's, a stream carries usage only with
``stream_options: {"include_usage": true}``: once, on an extra last chunk with empty
``choices`` (before ``data: [DONE]``), every other chunk having ``usage: null``.

Every response carries ``speculation``: the generation's statistics
(:meth:`specdecode.stats.Stats.to_dict`: drafted, accepted, acceptance_rate,
mean_accepted_length, per-position counts, timings) plus the draft and K. With n = 1 it
is a top-level object; in a stream it rides on the chunk with the finish_reason (and on
the usage chunk when stream_options.include_usage is set). With n > 1 there is no
top-level ``speculation``: each choice carries its own as ``choices[i].speculation``
(in a stream, on the choice's finish_reason chunk), since each choice is a separate
generation with its own statistics.

Logprobs in a stream ride on the chunk whose text completes their tokens (the engine's
deltas name the tokens they complete, :class:`specdecode.output.TextDelta`): chat
``{"content": [that chunk's tokens], "refusal": null}``; completions tokens,
token_logprobs, top_logprobs and text_offset for that chunk's tokens, text_offset
counting characters from the start of the choice's text across chunks. A chunk whose
text completes no token (it streams the first bytes of a token whose rest is held back:
part of a character, or text that could still begin a stop string) carries empty
lists; a token whose bytes straddle a stop string is reported on the choice's last text
chunk, which may then have empty text; tokens cut by a stop string are never reported. The finish_reason chunk carries
logprobs null. The chunks' logprobs concatenate to the logprobs of the same request
unstreamed. A token need not hold whole characters (byte-level vocabularies split
multi-byte ones): chat gives every token (and top_logprobs entry) its UTF-8 ``bytes``,
and writes an incomplete character's bytes in ``token`` escaped (``"\\xe6\\x97"``);
completions write such a token as ``"bytes:\\xe6\\x97"``, and its text_offset is that of
the character it belongs to (offsets count characters of the returned text and never
pass its end).

Client input that is no text is a 400, never a 500: a string or field name holding a
lone surrogate (a ``\\ud800`` escape without its pair: param names the field, e.g.
``messages[0].content``), or arrays and objects nested deeper than 64 levels.

Starting up (:mod:`.loading`): ``specdecode serve`` binds its port at once and loads the
models on a thread of its own; until they are loaded every request is answered 503 with
``Retry-After`` and a JSON body that says so (code model_loading; on /health, status
"loading"; under /api/ Ollama's shape), after the Host and Origin checks. SIGINT or SIGTERM
while loading stops the server (status 0 for SIGTERM), and a load that fails ends it with the
one error line, as before.

Shutdown (SIGINT, SIGTERM to ``specdecode serve``): the server stops taking connections
and at once stops every generation: waiting and running requests are answered 503 (a
stream ends with an error chunk and ``data: [DONE]``), and the process exits (status 0
for SIGTERM) without waiting for streams to run to their end.

Modules, one job each: :mod:`.config` (:class:`ServerOptions`, the server's options as
one checked object), :mod:`.apierror` (:class:`APIError`, the error answer), :mod:`.body`
(decoding a request body), :mod:`.protocol` (request parsing and validation, pure),
:mod:`.tools` (the tool fields of a request), :mod:`.extensions` (prediction and speculative,
and the usage details they add), :mod:`.toolcalls` (tool-call formats: their
parser and grammar), :mod:`.metrics` (Prometheus), :mod:`.worker` (the generation
thread), :mod:`.responses` (response bodies and stream chunks), :mod:`.responses_api` (OpenAI's
Responses API: :mod:`.responses_tools` its tools, :mod:`.responses_store` its stored responses,
:mod:`.responses_events` its answers), :mod:`.app` (the FastAPI routes), :mod:`.ollama` (Ollama's API: :mod:`.ollama_protocol` its requests,
:mod:`.ollama_models` what it says of the model), :mod:`.loading` (the answers while the
models load), :mod:`.cli` (the ``serve`` subcommand), :mod:`.ray_serve` (``specdecode serve --replicas``: replicas on Ray Serve). Importing this package does not
import FastAPI, uvicorn or prometheus_client.
"""

from .app import create_app
from .cli import add_serve_parser, cmd_serve
from .config import ServerOptions
from .metrics import Metrics
from .protocol import APIError, GenRequest, from_specdecode_error, parse_request
from .jobs import Job
from .worker import Worker

__all__ = ["APIError", "GenRequest", "Job", "Metrics", "ServerOptions", "Worker", "add_serve_parser", "cmd_serve",
           "create_app", "from_specdecode_error", "parse_request"]
