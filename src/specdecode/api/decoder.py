"""The :class:`Decoder`: a target and a drafter loaded once for many generations, and :func:`generate`.

The package docstring (:mod:`specdecode.api`) has an example.
"""

from __future__ import annotations

import contextlib
import inspect
import sys
import threading
import time
from typing import Any, Callable, Iterator, Sequence


from ..assembly import registry
from ..backends.base import Backend
from ..backends.sharing import claim_backends, release_backends
from ..backends.fim import FimBudget
from ..control.calibration import Calibration
from ..drafters.kinds import check_draft_options, resolve
from ..engine import Generation, drive
from ..errors import SpecDecodeError
from ..limits import DEFAULT_DEVICE, DEFAULT_DTYPE, DEFAULT_GPU_LAYERS, DEFAULT_TREE_WIDTH, check_draft_vocab, \
    check_gpu_layers, check_max_tree_nodes, check_parallel, check_text, check_token_ids, \
    check_tree_width
from ..assembly.loading import load_target, make_speculation
from ..messages import text_parts
from ..output import GenerationResult, TextDelta
from ..request import GenerationOptions
from .compare import compare
from .prompts import check_codes, fim_ids, text_prompt_ids


class Decoder:
    """A target and a drafter loaded once, for many generations.

    target: registry name or .gguf path (default qwen2.5-coder-1.5b-instruct), or a loaded
        Backend: e.g. your own PyTorch model over codes, :class:`specdecode.ModuleBackend`
        (then backend, dtype, device and n_ctx, which load models by name, do not apply;
        generate with :meth:`generate_ids`).
    draft: "auto" (default: lookups in the text when they match, and the registry's default
        draft model when it shares the target's tokenizer and pays, else plain decoding),
        "ngram" (prompt lookup), "suffix" (lookup in this and earlier requests), "none"
        (plain decoding), or a draft model (registry name, .gguf path, Hugging Face folder,
        or a loaded Backend such as a ModuleBackend over the target's codebook).
    num_speculative_tokens: K, drafted tokens per step (0..MAX_NUM_SPECULATIVE_TOKENS), or
        "auto" (default): the cost-aware controller chooses K in 0..AUTO_KMAX each step
        (:mod:`specdecode.control.controller`; both limits in :mod:`specdecode.limits`). With
        draft "auto" and an integer K, the controller chooses the drafter and K <= that K.
    n_ctx: context window in tokens of each slot. None (default): what the target was trained
        for, capped so that the KV caches (every slot's, and a draft model's) fit in half the
        memory available (:mod:`specdecode.backends.context`); an n_ctx past the trained context
        is capped there. ``context`` says what was chosen and why (printed with progress).
    n_threads: CPU threads (default: all cores).
    backend, draft_backend: "auto", "llama.cpp" or "torch" (see :func:`backend_kind`).
    dtype, device: for the torch backend (float32/bfloat16/float16; cpu/cuda/auto).
    gpu_layers, draft_gpu_layers: the target's and a draft model's layers on the GPU of
        llama.cpp's build (GGUF models): a number (more than the model has: all), "all", or
        "auto" (default: all where the weights and the context's KV cache fit the device's free
        memory, else as many as fit, said in one line; the CPU on a CPU-only build). The
        backends' ``placement`` says where they went
        (:mod:`specdecode.backends.llama_cpp.offload`).
    draft_vocab: an integer: a torch draft model computes logits only for ids below this, the
        prompt's tokens and end-of-generation ids (0 = all; see ModelDrafter's vocab_subset);
        "slem" or "tli": how a draft model with another tokenizer than the target's drafts
        (:mod:`specdecode.drafters.cross_vocab`; by default, with another tokenizer, SLEM for
        greedy generations and TLI for sampled ones).
    parallel: slots for concurrent generations (continuous batching, llama.cpp backend):
        :meth:`begin` / :meth:`step` / :meth:`end` run several at once in shared forwards;
        :meth:`stream` runs one (1..MAX_PARALLEL; the torch backend serves 1).
    max_tree_nodes: nodes a tree of drafts may hold (SpecInfer, Medusa, EAGLE-2: candidates
        verified in one forward with a tree mask; 0..MAX_TREE_NODES, 0 = chains only). None
        (default) and 0 draft chains (on the development CPUs trees measured no faster); with
        N > 0, under the cost-aware controller each tree is cut to the prefix that pays under
        the measured T(n); llama.cpp's trees need branch sequences, loaded only for N > 0.
        A request's own max_tree_nodes overrides it. tree_width: candidates per tree node.
    kv_per_sequence: with parallel > 1 on llama.cpp, a KV cache of its own for each slot
        instead of one shared buffer (``serve --strict``). Batch-invariant generations
        (``batch_invariant="on"``, strict mode) need it there: in a shared buffer what runs
        beside a generation changes its arithmetic (they are refused; a seed's "auto" verifies
        as usual). llama.cpp splits a forward of unequal blocks into several.
    background_costs: measure nothing up front that the cache lacks (``serve`` does): the
        target's cost curve (its check, where the cache holds one that is marked stale or may
        describe a busy machine) and its invariant block are measured later, a part at a time,
        by whoever calls ``decoder.calibration.run_one()`` while no generation runs (the
        server's worker, between requests); until then the controller plans with the cached
        curve or a conservative one (plain decoding), and strict and seeded generations run
        plain one-token steps (:class:`specdecode.control.calibration.Calibration`). Without
        it (the default) what the cache lacks is measured before the first generation that
        needs it, and a cached curve to be checked is planned with at once and checked between
        the steps of this Decoder's streams (on a scratch twin, within MEASURE_SHARE).

    Threads: a Decoder may be shared between threads. Its calls are serialised (one lock
    around each begin, step and end, and each tokenization unless the target's tokenizer is
    thread-safe, ``thread_safe_tokenizer``), so generations from several threads
    proceed step by step in turn, each in its own slot. A thread that needs a slot while
    every slot is held by another thread's generation waits for one to end; a thread whose
    own unfinished generations hold every slot (e.g. a stream it has not exhausted or
    closed: a stream holds its slot until then) gets a SpecDecodeError instead, since waiting
    would never end. After :meth:`close` every call raises SpecDecodeError.

    Raises SpecDecodeError (and subclasses: ModelFileError, IncompatibleVocabularyError)
    with a message naming the values.
    """

    def __init__(
        self,
        target: str | Backend = registry.DEFAULT_TARGET,
        draft: str | Backend = "auto",
        num_speculative_tokens: int | str = "auto",
        n_ctx: int | None = None,
        n_threads: int | None = None,
        progress: bool = True,
        backend: str = "auto",
        draft_backend: str = "auto",
        dtype: str = DEFAULT_DTYPE,
        device: str = DEFAULT_DEVICE,
        draft_vocab: int | str = 0,
        parallel: int = 1,
        max_tree_nodes: int | None = None,
        tree_width: int = DEFAULT_TREE_WIDTH,
        kv_per_sequence: bool = False,
        background_costs: bool = False,
        gpu_layers: int | str = DEFAULT_GPU_LAYERS,
        draft_gpu_layers: int | str = DEFAULT_GPU_LAYERS,
    ) -> None:
        # Names (a loaded backend's own), as the server and the statistics report them.
        self.target_name = target.name if isinstance(target, Backend) else target
        self.draft_name = draft.name if isinstance(draft, Backend) else draft
        choice = resolve(draft, num_speculative_tokens)
        draft_vocab = check_draft_vocab(draft_vocab)
        parallel = check_parallel(parallel)
        gpu_layers = check_gpu_layers(gpu_layers)
        draft_gpu_layers = check_gpu_layers(draft_gpu_layers, "draft_gpu_layers")
        check_draft_options(draft, parallel, draft_vocab=draft_vocab, draft_backend=draft_backend,
                            draft_gpu_layers=draft_gpu_layers)
        check_tree_width(tree_width)  # before anything loads
        check_max_tree_nodes(max_tree_nodes)
        given = claim_backends(target, draft)
        self.target = load_target(target, choice, given, backend=backend, n_ctx=n_ctx, n_threads=n_threads,
                                  dtype=dtype, device=device, progress=progress, n_seq=parallel,
                                  trees=bool(max_tree_nodes), kv_per_sequence=kv_per_sequence,
                                  measure_attention=not background_costs, gpu_layers=gpu_layers)
        # What context the target holds and why (None for a loaded backend that does not say).
        self.context = self.target.context
        if progress and self.context is not None and not isinstance(target, Backend):
            _say(("specdecode: warning: " if self.context.warning else "specdecode: ") + self.context.note)
        if progress and not isinstance(target, Backend):
            _say_placement(self.target, gpu_layers)
        # What is measured between requests or steps: with background_costs, all of it; else what
        # the cache holds but must check (a stale or suspect curve), while what it lacks is measured now.
        self.calibration = Calibration(self.target, registry.cache_dir(), say=_say if progress else None,
                                       up_front=not background_costs)
        self.clock: Callable[[], float] = time.perf_counter  # what steps and parts are timed with (a test's own)
        try:
            self.engine = make_speculation(choice, self.target, n_ctx=n_ctx, n_threads=n_threads, progress=progress,
                                           backend=draft_backend, dtype=dtype, device=device, draft_vocab=draft_vocab,
                                           n_slots=parallel, max_tree_nodes=max_tree_nodes, tree_width=tree_width,
                                           calibration=self.calibration, gpu_layers=draft_gpu_layers)
            self.drafter = self.engine.drafter
            self.engine.draft_name = self.draft_name
            for model in self.drafter.draft_backends() if progress and not isinstance(draft, Backend) else ():
                _say_placement(model, draft_gpu_layers)
        except BaseException:
            release_backends(given)
            if self.target not in given:  # a backend the caller gave stays theirs, as it was
                self.target.close()
            raise
        self._given = given
        self._lock = threading.Condition(threading.RLock())
        self._closed = False
        self._owners: dict[Generation, int] = {}  # running generation -> the thread that began it

    def close(self) -> None:
        """Free the draft models and the target (waits for a step running in another thread;
        idempotent). Later calls raise SpecDecodeError."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            self._lock.notify_all()
        self.calibration.close()  # its scratch twin before the target it was made from
        self.drafter.close()
        self.target.close()
        release_backends(self._given)

    def check_open(self) -> None:
        if self._closed:
            raise SpecDecodeError("this Decoder is closed: make a new Decoder to generate again")

    def __enter__(self) -> "Decoder":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def prompt_ids(self, prompt: str | None = None, messages: Sequence[dict] | None = None,
                   tools: Sequence[dict] | None = None, *, suffix: str | None = None,
                   extra: Sequence | None = None, fim_budget: FimBudget | None = None,
                   fim_prompt: str = "") -> list[int]:
        """Tokenize a raw prompt (BOS added if the model wants it) or chat messages (the
        model's own chat template). Exactly one of the two must be given. tools: OpenAI tool
        objects the chat template presents to the model (messages only; checked by the caller,
        as the server's :mod:`specdecode.server.tools` does). suffix / extra: a
        fill-in-the-middle prompt (:func:`specdecode.backends.fim.fim_prompt_ids`): the prompt is
        the code before the cursor, suffix the code after it, extra other files as (filename,
        text) pairs; the output is the middle; fim_budget trims them to fit as llama.cpp's /infill
        does (:class:`specdecode.backends.fim.FimBudget`); fim_prompt: /infill's ``prompt``, text
        after the prefix tokenized on its own (:class:`specdecode.backends.fim.FimInput`).
        Raises SpecDecodeError naming the field at fault (see :func:`check_messages`; an empty
        prompt where the model adds no start token: param prompt; suffix where the model has no
        fill-in-the-middle tokens; extra[i] for a malformed file)."""
        if (prompt is None) == (messages is None):
            raise SpecDecodeError("give exactly one of prompt or messages")
        if tools and messages is None:
            raise SpecDecodeError("tools are presented by the chat template: give messages, not a prompt",
                                  param="tools")
        with self._tokenizer_lock():
            self.check_open()
            if suffix is not None or extra is not None:
                return fim_ids(self.target, prompt, messages, suffix, extra, fim_budget, fim_prompt)
            return text_prompt_ids(self.target, prompt, messages, tools)

    def tokenize(self, text: str, add_special: bool = False, parse_special: bool = True) -> list[int]:
        """The target's token ids [N] of text (llama.cpp's /tokenize: no BOS unless
        add_special, special tokens' texts read as those tokens unless parse_special is False)."""
        with self._tokenizer_lock():
            self.check_open()
            return self.target.tokenize(text, add_special=add_special, parse_special=parse_special)

    def _tokenizer_lock(self) -> Any:
        """What a tokenization holds: nothing where the target's tokenizer is thread-safe (a
        server prepares requests on another thread while generations step), else the lock."""
        return contextlib.nullcontext() if self.target.thread_safe_tokenizer else self._lock

    def generate(self, prompt: str | None = None, *, stream: bool = False, **options) -> GenerationResult | Iterator[str]:
        """Generate from a prompt or chat messages (``messages=``); options as :meth:`stream`.

        Returns a GenerationResult (text, token_ids, finish_reason, logprobs, stats), or
        with stream=True an iterator of text deltas (whole UTF-8 characters) that
        concatenate to the final text (use :meth:`stream` to also get the result).
        """
        gen = self.stream(prompt, **options)
        if stream:
            return (item for item in gen if isinstance(item, str))
        result = None
        for item in gen:
            if isinstance(item, GenerationResult):
                result = item
        assert result is not None
        return result

    def stream(self, prompt: str | None = None, *, messages: Sequence[dict] | None = None,
               prompt_ids: Sequence[int] | None = None, options: GenerationOptions | None = None,
               **fields) -> Iterator[str | GenerationResult]:
        """Yield text deltas as tokens are committed and, last, the GenerationResult.

        prompt / messages / prompt_ids: a raw prompt, OpenAI-style chat messages, or the
        prompt already tokenized (:meth:`prompt_ids`): exactly one.
        options: a :class:`specdecode.request.GenerationOptions`, or its fields as keywords:
        max_tokens (exact cap, >= 1), stop (string(s) that end the output, excluded from it),
        logprobs (N most likely tokens per emitted token), plain (decode without the drafter:
        the baseline), num_speculative_tokens (K for this call), prediction (the output
        expected, as text: drafts follow it, see :mod:`specdecode.drafters.prediction`; the
        output stays the target's), inputs ({field: text or token ids}: what a drafter kind fed
        by another request field drafts from, its row's ``request_field``), draft (which loaded drafter this call may use: "auto",
        "none", "ngram", "suffix", "prediction" or the draft model's name), record_top2_gaps (the
        target's top-2 logit gap per token, for parity reports), grammar (structured output,
        e.g. ``specdecode.grammar.Grammar.json_schema({...})``, ``Grammar("regex", "[0-9]+")``, ``Grammar("lark",
        ...)``, ``Grammar("json_object")``: the output matches it, as plain constrained
        decoding), and the fields of :class:`SamplingParams` (temperature, top_p, top_k,
        min_p, repetition_penalty, frequency_penalty, presence_penalty, seed; temperature 0,
        the default, is greedy; they shape target and draft distributions alike).
        Raises SpecDecodeError (with the values) for bad options or prompts that do not fit.
        """
        ids, options = self._request(prompt, messages, prompt_ids, options, fields)
        return self._stream(ids, options)

    def _stream(self, ids: list[int], options: GenerationOptions) -> Iterator[str | GenerationResult]:
        # A stream abandoned after close() has nothing left to free.
        yield from drive(self.begin(prompt_ids=ids, options=options), self._step_and_measure,
                         lambda gen: [] if self._closed else self.end(gen))

    def _step_and_measure(self, gens: Sequence[Generation]) -> list[TextDelta]:
        """:meth:`step`, then a part of a pending check of the cost curve within its share of the
        time (:meth:`.Calibration.between_steps`), so that a curve to be checked never delays the
        first token (issue 61: a busy machine re-measured a cached curve for 7 minutes first)."""
        started = self.clock()
        deltas = self.step(gens)
        with self._lock:
            if not self._closed:
                self.calibration.between_steps(self.clock() - started, self.clock)
        return deltas

    def begin(self, prompt: str | None = None, *, messages: Sequence[dict] | None = None,
              prompt_ids: Sequence[int] | None = None, options: GenerationOptions | None = None,
              accepted: Callable[[], None] | None = None, chunked: bool = False, **fields) -> Generation:
        """Start a generation in a free slot (arguments as :meth:`stream`) for batched
        stepping: ``deltas = decoder.step([g1, g2, ...])`` advances every running
        generation by one shared forward; when ``g.done``, ``decoder.end(g)`` returns its
        last delta (if any) and its GenerationResult and frees the slot. accepted: called
        once the options are accepted, right before the prompt is read (the engine's begin).
        chunked: the prompt is read later, a piece per :meth:`prefill`, while ``g.prefilling``.
        Raises SpecDecodeError for bad options, a prompt that does not fit, or no free slot.
        """
        ids, options = self._request(prompt, messages, prompt_ids, options, fields)
        me = threading.get_ident()
        with self._lock:
            self.check_open()
            while not self.engine.free_slots():
                mine = sum(1 for owner in self._owners.values() if owner == me)
                if mine:
                    raise SpecDecodeError(
                        f"no free slot among {len(self.engine.slots)}: {mine} unfinished generation(s) of this "
                        f"thread hold them (a stream holds its slot until it is exhausted or closed; end "
                        f"generations begun with begin() with end(), or use a Decoder with parallel > 1)",
                        param="parallel")
                self._lock.wait()
                self.check_open()
            if self.calibration is not None:
                options = self.calibration.before_generation(options)
            gen = self.engine.begin(ids, options, accepted=accepted, chunked=chunked)
            self._owners[gen] = me
            return gen

    def prefill(self, gen: Generation, max_tokens: int | None = None) -> int:
        """Read up to max_tokens more of a chunked generation's prompt (None: the rest): :meth:`SpeculativeEngine.prefill`."""
        with self._lock:
            self.check_open()
            return self.engine.prefill(gen, max_tokens)

    def step(self, gens: Sequence[Generation]) -> list[TextDelta]:
        """One batched step of the running generations (see :meth:`begin`); their deltas."""
        with self._lock:
            self.check_open()
            return self.engine.step(gens)

    def end(self, gen: Generation) -> list[TextDelta | GenerationResult]:
        """Finish a generation (done or abandoned) and free its slot: [last delta,] result."""
        with self._lock:
            self.check_open()
            try:
                return self.engine.end(gen)
            finally:
                if gen.slot.gen is None:
                    self._owners.pop(gen, None)
                    self._lock.notify_all()

    def prediction_ids(self, prediction: str | Sequence[dict]) -> list[int]:
        """A predicted output as target token ids: :meth:`input_ids` of the field prediction."""
        return self.input_ids(prediction, "prediction")

    def input_ids(self, text: str | Sequence[dict], field: str = "prediction") -> list[int]:
        """A request-fed input (text, or OpenAI's list of text parts) as target token ids,
        tokenized once with the target's tokenizer (no BOS, special tokens as text); safe
        beside a running step where the tokenizer is (``thread_safe_tokenizer``). field: the
        input's name, for errors. Raises SpecDecodeError (param: the field) for anything else."""
        text = text_parts(text, field)
        with self._tokenizer_lock():
            self.check_open()
            return self.target.tokenize(check_text(text, field), add_special=False, parse_special=False)

    def generate_ids(self, prompt_ids: Sequence[int], **options) -> GenerationResult:
        """Token ids in, token ids out: generate from prompt_ids [L >= 1] (for a model over
        codes, :class:`specdecode.ModuleBackend`, the codes it starts from, e.g. a class
        code); options as :meth:`stream` (max_tokens, sampling fields and seed, logprobs,
        num_speculative_tokens, draft, prediction as ids, ...). Returns the GenerationResult:
        ``token_ids`` the generated ids (end id excluded), ``stats`` the speculation's
        statistics. For a target without text, text-only options (stop strings, a grammar, a
        prediction as text) raise SpecDecodeError naming the option."""
        if prompt_ids is None:
            raise SpecDecodeError("generate_ids needs prompt_ids: the ids to start from", param="prompt_ids")
        return self.generate(prompt_ids=prompt_ids, **options)

    def _request(self, prompt, messages, prompt_ids, options, fields) -> tuple[list[int], GenerationOptions]:
        check_codes(self.target, prompt, messages, {**fields, "options": options})
        fields = dict(fields)
        suffix, extra = fields.pop("suffix", None), fields.pop("extra", None)  # the prompt's, not options
        if (suffix is not None or extra is not None) and prompt_ids is not None:
            raise SpecDecodeError("suffix and extra make a fill-in-the-middle prompt from a prompt: give prompt, "
                                  "not prompt_ids", param="suffix")
        if self.target.has_text:  # request-fed inputs given as text: tokenized here
            def as_ids(name: str, v):
                text = isinstance(v, str) or isinstance(v, list) and not all(isinstance(t, int) for t in v)
                return tuple(self.input_ids(v, name)) if text else v
            if fields.get("prediction") is not None:
                fields = {**fields, "prediction": as_ids("prediction", fields["prediction"]) or None}
            if isinstance(fields.get("inputs"), dict):
                fields = {**fields, "inputs": {n: as_ids(n, v) for n, v in fields["inputs"].items()}}
        if options is not None and not isinstance(options, GenerationOptions):
            raise SpecDecodeError(f"options must be a GenerationOptions, got {type(options).__name__}", param="options")
        options = GenerationOptions.from_kwargs(options, **fields)
        V = self.target.n_vocab
        for name, ids in options.request_inputs().items():
            if bad := [t for t in ids if not 0 <= t < V]:
                raise SpecDecodeError(f"{name} id {bad[0]} is outside the vocabulary of {self.target.name} "
                                      f"(0..{V - 1})", param=name)
        if prompt_ids is not None:
            if prompt is not None or messages is not None:
                raise SpecDecodeError("give exactly one of prompt, messages or prompt_ids")
            return check_token_ids(prompt_ids, V, self.target.name), options
        if prompt is None and messages is None and not self.target.has_text:
            raise SpecDecodeError(f"give prompt_ids: target {self.target.name} is a model over codes",
                                  param="prompt_ids")
        return self.prompt_ids(prompt, messages, suffix=suffix, extra=extra), options

    def compare(self, prompt: str | None = None, **kwargs) -> tuple[GenerationResult, GenerationResult, dict]:
        """Run speculatively and plainly on the same input; returns (speculative, plain,
        report): :func:`specdecode.api.compare.compare`."""
        return compare(self, prompt, **kwargs)


def _say(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


def generate(prompt: str | None = None, **options) -> GenerationResult | Iterator[str]:
    """One-shot generation: loads the models, generates, and frees them.

    options: the keyword arguments of :class:`Decoder` (target, draft, ...) and of
    :meth:`Decoder.generate` (messages, max_tokens, stream, sampling fields, ...).
    With stream=True the models stay loaded until the iterator is exhausted.
    """
    model_keys = set(inspect.signature(Decoder).parameters)
    dec = Decoder(**{k: v for k, v in options.items() if k in model_keys})
    kwargs = {k: v for k, v in options.items() if k not in model_keys}
    if kwargs.get("stream"):
        def gen() -> Iterator[str]:
            with dec:
                yield from dec.generate(prompt, **kwargs)
        return gen()
    with dec:
        return dec.generate(prompt, **kwargs)


def _say_placement(model: Backend, asked: int | str) -> None:
    """The line on where a model's layers went (:attr:`Backend.placement`), where any is on a GPU
    or layers were asked for (a CPU-only build then says it runs them on the CPU)."""
    if model.placement.note and (not model.placement.on_cpu or asked != DEFAULT_GPU_LAYERS):
        _say("specdecode: " + model.placement.note)
