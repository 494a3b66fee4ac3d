"""What a request brings, prepared before it is queued and off the worker's steps: its prompt
tokenized (chat template and tools included), each request-fed input (a prediction)
tokenized within its limits, its max_tokens settled and its grammar compiled
(:class:`Preparer`), on PREPARE_THREADS threads of their own, so that a long prompt or
prediction or a new schema costs its own request's time, not its neighbours' steps.
"""

from __future__ import annotations

import asyncio
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Callable

from jinja2 import TemplateError

from ..backends.fim import FimBudget, FimInput
from ..engine.plan import plan_generation
from ..errors import SpecDecodeError
from ..grammar import check_grammar
from .apierror import APIError, from_specdecode_error
from .config import PREDICTION_BYTES_PER_TOKEN, PROMPT_BYTES_PER_TOKEN, ServerOptions
from .extensions import FIELD_OF_OPTION
from .protocol import GenRequest, resolve_max_tokens

# Threads that prepare requests (tokenize, compile grammars) beside the worker's steps: a
# request with a long prompt or prediction does not hold up a short one's preparation, and
# preparations take at most this many cores from the steps.
PREPARE_THREADS = 2


@dataclass(frozen=True)
class Prepared:
    """What a request needs before its first step, made off the worker thread
    (:meth:`Worker.prepare`): the prompt's token ids [L], max_tokens per choice, and each
    request-fed input's token ids [P] by field (the prediction's, ...), and the cache reuse
    it runs with (tokens: the server's ``cache_reuse`` for a fill-in-the-middle request, else 0)."""

    ids: list
    max_tokens: int
    inputs: dict
    cache_reuse: int = 0


class Preparer:
    """Prepares requests for a decoder on its own threads (:meth:`prepare_async`) or, before
    :meth:`start` and after :meth:`stop`, on the caller's (:meth:`prepare`).

    options: the server's; the preparer reads max_prediction_tokens (None: n_ctx, the
    context size in tokens) and allows PREDICTION_BYTES_PER_TOKEN bytes of text per token, and
    cache_reuse (for fill-in-the-middle requests).
    """

    def __init__(self, decoder: Any, options: ServerOptions, n_ctx: int) -> None:
        self.decoder = decoder
        self.n_ctx = n_ctx
        # The longest prediction a request may send, in tokens and in bytes of text.
        self.max_prediction_tokens = options.max_prediction_tokens or n_ctx
        self.max_prediction_bytes = PREDICTION_BYTES_PER_TOKEN * self.max_prediction_tokens
        self.cache_reuse = options.cache_reuse
        self._preparer: ThreadPoolExecutor | None = None
        self._stopping = False

    def start(self) -> None:
        self._stopping = False
        self._preparer = ThreadPoolExecutor(PREPARE_THREADS, thread_name_prefix="specdecode-prepare")

    def stop(self, wait: bool = True) -> None:
        """Refuse what waits to be prepared (503) and end the threads (waiting for the
        preparations running, where ``wait``)."""
        self._stopping = True
        if self._preparer is not None:
            self._preparer.shutdown(wait=wait, cancel_futures=True)

    async def prepare_async(self, req: GenRequest) -> Prepared:
        """:meth:`prepare` on the preparation thread, so that neither the event loop nor the
        worker's steps wait for it (the worker itself prepares when that thread is gone)."""
        return await self.run_async(self.prepare, req)

    async def run_async(self, fn: Callable[..., Any], *args: Any) -> Any:
        """fn(*args) on the preparation thread (tokenizing a text, for /tokenize and
        count_tokens), or on the caller's where it is not started. Raises what fn raises, and
        APIError 503 once the server is shutting down."""
        if self._preparer is None:
            return fn(*args)
        try:
            return await asyncio.get_running_loop().run_in_executor(self._preparer, fn, *args)
        except (RuntimeError, asyncio.CancelledError):  # the preparer shut down (its queue cancelled)
            if not self._stopping:
                raise
            raise APIError(503, "the server is shutting down", type="server_error") from None

    def prepare(self, req: GenRequest) -> Prepared:
        """Tokenize a request's prompt (chat template and tools included) and each request-fed
        input (a prediction), settle its max_tokens and compile its grammar (kept in the
        grammar cache for the worker) and check that strict mode may run: the work a request brings, done before it is queued, so
        that a long prompt or prediction or a new schema costs its own request time, not its
        neighbours' steps. Raises APIError 400 for what the request got wrong: a prompt that
        does not fit, a template that refuses the messages, a grammar that does not compile,
        and an input over max_prediction_tokens tokens or max_prediction_bytes bytes (param:
        its field, checked in bytes before it is tokenized)."""
        size = _text_bytes(req)
        fit = req.fim is not None and req.fim.fit  # trimmed once tokenized (the body's bound still holds)
        if size > PROMPT_BYTES_PER_TOKEN * self.n_ctx and not fit:  # refused before the tokenizer spends seconds on it
            raise APIError(400, f"the prompt has {size} bytes of text, more than a context of {self.n_ctx} tokens "
                           f"could hold ({PROMPT_BYTES_PER_TOKEN * self.n_ctx} bytes: {PROMPT_BYTES_PER_TOKEN} per "
                           "token)", param="prompt" if req.kind == "completion" else "messages",
                           code="context_length_exceeded")
        try:
            ids = self.decoder.prompt_ids(**{"prompt": req.prompt, "messages": req.messages,
                                             "tools": req.tools.tools if req.tools else None,
                                             **fim_fields(req.fim, self.decoder.target)},
                                          fim_budget=FimBudget.for_context(self.n_ctx, req.max_tokens or 0) if fit
                                          else None)
            max_tokens = resolve_max_tokens(req, len(ids), self.n_ctx)
            inputs = {name: self._input_ids(name, text) for name, text in req.inputs.items()}
            if req.options.grammar is not None:
                try:
                    check_grammar(req.options.grammar, self.decoder.target)
                except SpecDecodeError:
                    if req.tools and req.options.grammar.name == "tools":
                        req.tools.check_schemas(self.decoder.target)  # names the tool whose schema fails
                    raise
            prepared = Prepared(ids, max_tokens, {name: ids for name, ids in inputs.items() if ids},
                                self.cache_reuse if req.fim is not None else 0)
            # The generation's plan, as the engine's begin decides it (strict mode where it may run,
            # the drafter and K, trees): a 400 here, not inside a stream already open.
            engine = self.decoder.engine
            plan_generation(req.choice_options(0, max_tokens, prepared.inputs, prepared.cache_reuse),
                            self.decoder.target, engine.num_speculative_tokens, engine.max_tree_nodes, 1,
                            self.decoder.target.token_bytes)
        except (SpecDecodeError, TemplateError) as e:
            raise request_error(e, req) from None
        return prepared

    def _input_ids(self, name: str, text: str) -> tuple[int, ...]:
        """A request-fed input's tokens, within the prediction limits (bytes, then tokens)."""
        size = len(text.encode())
        if size > self.max_prediction_bytes:
            raise APIError(400, f"{name} has {size} bytes, more than this server takes ({self.max_prediction_bytes} "
                           f"bytes: {PREDICTION_BYTES_PER_TOKEN} per token of --max-prediction-tokens "
                           f"{self.max_prediction_tokens})", param=name, code="prediction_too_large")
        ids = tuple(self.decoder.input_ids(text, name))
        if len(ids) > self.max_prediction_tokens:
            raise APIError(400, f"{name} has {len(ids)} tokens, more than this server takes "
                           f"({self.max_prediction_tokens}, --max-prediction-tokens; default the context size)",
                           param=name, code="prediction_too_large")
        return ids


def fim_fields(fim: FimInput | None, target: Any) -> dict:
    """:meth:`Decoder.prompt_ids`' prompt, suffix and extra for a request's fill-in-the-middle
    input: none for a plain prompt; the prefix alone for an empty suffix with no files on a
    model without FIM tokens (a cursor at the end of the file: a plain completion, which such a
    model can give)."""
    if fim is None:
        return {}
    if not fim.suffix and not fim.extra and target.fim_tokens is None:
        return {"prompt": fim.prefix + fim.prompt}
    return {"prompt": fim.prefix, "suffix": fim.suffix, "extra": fim.extra, "fim_prompt": fim.prompt}


def _text_bytes(req: GenRequest) -> int:
    """The UTF-8 bytes of a request's prompt (with a suffix and files where it has them), or of
    its messages' text."""
    if req.fim is not None:
        return sum(len(t.encode()) for t in (req.fim.prefix, req.fim.prompt, req.fim.suffix, *(t for f in req.fim.extra for t in f)))
    if req.prompt is not None:
        return len(req.prompt.encode())
    parts = [m.get("content") for m in req.messages or ()]
    return sum(len(c.encode()) if isinstance(c, str) else
               sum(len(p.get("text", "").encode()) for p in c if isinstance(p, dict)) if isinstance(c, list) else 0
               for c in parts)


def request_error(e: SpecDecodeError | TemplateError, req: GenRequest) -> APIError:
    """The 400 for what a request asked that the model or the loaded drafters refused (its
    fields were checked on arrival; what is left concerns the prompt itself, the chat
    template's own checks, or the speculation asked for: speculative, prediction)."""
    if isinstance(e, TemplateError):  # e.g. roles must alternate
        return APIError(400, f"the model's chat template rejected the messages: {e}", param="messages")
    field_ = FIELD_OF_OPTION.get(e.param) or ("prompt" if req.kind == "completion" else "messages")
    return APIError(400, str(e), param=field_) if e.param in FIELD_OF_OPTION else from_specdecode_error(e, field_)
