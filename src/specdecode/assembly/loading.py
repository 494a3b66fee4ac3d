"""Loading models and assembling drafters: what ``Decoder``, the benchmark and the server
build a generation from.

Backends: llama.cpp for .gguf files and registry names, torch for Hugging Face folders
(``backend="auto"``). Drafters: a row of the kinds table
(:data:`specdecode.drafters.kinds.KINDS`), or the cost-aware controller over several of
them (``-k auto``).
"""

from __future__ import annotations

import sys
from dataclasses import replace
from pathlib import Path

from . import registry
from ..backends.base import Backend
from ..backends.sharing import release_backends
from ..backends.llama_cpp import LlamaCppBackend
from ..backends.llama_cpp.tree import TREE_BRANCHES
from ..control.attention import resolve_attention
from ..control.calibration import Calibration
from ..control.controller import SpeculationController, Source
from ..control.invariance import cached_invariant_block
from ..control.context_costs import cached_context_costs
from ..control.costcache import cached_forward_curve, cached_measurement, read_cached, rewrite_from_live
from ..control.costmodel import ObservedCurve
from ..control.sources import SharedCosts
from ..drafters import Drafter, NoDrafter
from ..drafters.kinds import MODEL, Choice, DraftRequest, check_draft_options, kind_of, resolve
from ..drafters.tree import set_tree_options
from ..engine import SpeculativeEngine
from ..errors import SpecDecodeError
from ..limits import (AUTO_KMAX, BACKENDS, BATCH_COST_CURVE_NS, COST_CURVE_NS, DEFAULT_DEVICE, DEFAULT_DTYPE,
                      DEFAULT_GPU_LAYERS,
                      DEFAULT_TREE_WIDTH, check_choice)
from ..backends.vocab import fingerprint_serves


def backend_kind(name_or_path: str, backend: str = "auto") -> str:
    """'llama.cpp' or 'torch'. auto: llama.cpp for .gguf files and registry names, torch for
    Hugging Face folders. Raises SpecDecodeError for an unknown backend."""
    check_choice(backend, BACKENDS, "backend")
    if backend != "auto":
        return backend
    return "torch" if Path(name_or_path).expanduser().is_dir() else "llama.cpp"


def load_backend(name_or_path: str, backend: str = "auto", n_ctx: int | None = None, n_threads: int | None = None,
                 dtype: str = DEFAULT_DTYPE, device: str = DEFAULT_DEVICE, progress: bool = True,
                 n_seq: int = 1, trees: bool = False, kv_per_sequence: bool = False,
                 kv_reserve: float = 1.0, measure_attention: bool = True,
                 gpu_layers: int | str = DEFAULT_GPU_LAYERS) -> Backend:
    """Load a model on the chosen backend.

    n_ctx: tokens a sequence holds; None: what the model was trained for, within the memory
    available (:mod:`specdecode.backends.context`; kv_reserve: the KV caches to fit, in units of
    this model's, 2.0 leaving room for a draft model's; the backend's ``context`` says why).

    n_seq: sequences for concurrent generations (llama.cpp; the torch backend holds one
    and raises SpecDecodeError for more). trees: able to verify trees of drafts (llama.cpp:
    with TREE_BRANCHES branch sequences; torch always is). kv_per_sequence: llama.cpp keeps
    a KV buffer for each sequence (:class:`LlamaCppBackend`; the torch backend holds one).
    gpu_layers: llama.cpp's layers on its build's GPU (a number, "all", "auto":
    :mod:`specdecode.backends.llama_cpp.offload`); the torch backend places the whole model with
    ``device`` and refuses any other value than "auto".

    llama.cpp: a registry name (pulled on first use) or a .gguf path; its attention path as
    :func:`specdecode.control.attention.resolve_attention` chooses it (measure_attention False:
    from the cache only, as a server that answers at once).
    torch: a Hugging Face folder, a .gguf path (dequantized by transformers), or a registry
    name (its cached conversion from ``specdecode models convert`` if present, else the GGUF).
    Raises SpecDecodeError / ModelFileError naming the model.
    """
    kind = backend_kind(name_or_path, backend)
    if kind == "llama.cpp":
        path = registry.resolve(name_or_path, progress=progress)
        b = LlamaCppBackend(path, n_ctx=n_ctx, n_threads=n_threads, name=name_or_path, n_seq=n_seq,
                            tree_branches=TREE_BRANCHES if trees else 0, kv_per_sequence=kv_per_sequence,
                            kv_reserve=kv_reserve, gpu_layers=gpu_layers)
        try:
            resolve_attention(b, registry.cache_dir(), say=None if progress else lambda line: None,
                              measure=measure_attention)
        except BaseException:
            b.close()
            raise
        return _known(b)
    if gpu_layers != DEFAULT_GPU_LAYERS:
        raise SpecDecodeError(f"gpu_layers = {gpu_layers!r} places the layers of a GGUF model on llama.cpp; {name_or_path} "
                              f"loads on the torch backend, whose device is chosen with device (--device cuda)",
                              param="gpu_layers")
    if n_seq != 1:
        raise SpecDecodeError(f"the torch backend serves one sequence at a time: {n_seq} parallel sequences "
                              f"(--parallel {n_seq}) need the llama.cpp backend (a GGUF model)", param="parallel")
    from ..backends.torch import TorchBackend

    path = Path(name_or_path).expanduser()
    if name_or_path in registry.REGISTRY:
        folder = registry.hf_folder(name_or_path, dtype)
        path = folder if (folder / "config.json").exists() else registry.resolve(name_or_path, progress=progress)
    elif not path.is_dir():
        registry.check_gguf_file(path)
    return _known(TorchBackend.load(path, dtype=dtype, device=device, n_ctx=n_ctx, name=name_or_path))


def load_target(target: "str | Backend", choice: Choice, given: list, **load_opts) -> Backend:
    """A Decoder's target: the backend the caller gave (it must hold load_opts["n_seq"]
    sequences: else ``given`` is released and SpecDecodeError raised, param parallel), or the
    model loaded by :func:`load_backend` with room in memory for a draft model's caches as large
    as its own where the choice may load one."""
    if isinstance(target, Backend):
        if load_opts["n_seq"] > target.n_seq:
            release_backends(given)
            raise SpecDecodeError(f"target {target.name} holds {target.n_seq} sequence(s): parallel = "
                                  f"{load_opts['n_seq']} needs as many", param="parallel")
        return target
    reserve = 2.0 if choice.default_model or any(isinstance(n, str) and kind_of(n)[0] is MODEL
                                                   for n in choice.names) else 1.0
    return load_backend(target, kv_reserve=reserve, **load_opts)


def _known(backend: Backend) -> Backend:
    """Record the registry's SHA-256 of a registry model's file on its backend (the identity
    draft heads are tied to, on either backend)."""
    if backend.name in registry.REGISTRY:
        backend.known_sha256 = registry.get_spec(backend.name).sha256
    return backend


def make_drafter(draft: "str | Backend", target: Backend, n_ctx: int | None = None, n_threads: int | None = None,
                 progress: bool = True, backend: str = "auto", dtype: str = DEFAULT_DTYPE,
                 device: str = DEFAULT_DEVICE, draft_vocab: int | str = 0, n_seq: int = 1,
                 gpu_layers: int | str = DEFAULT_GPU_LAYERS) -> Drafter:
    """The drafter that ``draft`` names (a row of :data:`specdecode.drafters.kinds.KINDS`:
    'none', 'ngram', 'suffix', 'heads:FILE', or a draft model: registry name, .gguf path or
    HF folder on any backend, or a loaded Backend, checked against the target's vocabulary). draft_vocab: see
    ModelDrafter's vocab_subset (torch drafts; 0 = the full vocabulary). n_seq: KV sequences
    of a draft model, one per concurrent generation (its forks draft on them).

    Raises IncompatibleVocabularyError when the draft model's tokenizer differs (the
    loaded draft is closed again), SpecDecodeError for an option the kind does not use.
    """
    check_draft_options(draft, n_seq, draft_vocab=draft_vocab, draft_backend=backend)
    return _build(draft, target, dict(n_ctx=n_ctx, n_threads=n_threads, progress=progress, backend=backend,
                                      dtype=dtype, device=device, n_seq=n_seq, gpu_layers=gpu_layers), draft_vocab)


def _build(draft: "str | Backend", target: Backend, load_opts: dict, draft_vocab: int | str) -> Drafter:
    """The drafter of ``draft``'s kind; load_opts: :func:`load_backend`'s keywords for a draft model
    (n_ctx None: the target's context, so that drafts reach as far as the target does)."""
    def load(name: "str | Backend") -> Backend:
        if isinstance(name, Backend):
            return name
        opts = load_opts if load_opts["n_ctx"] is not None else {**load_opts, "n_ctx": target.n_ctx}
        return load_backend(name, **opts)

    kind, arg = kind_of(draft)
    return kind.build(DraftRequest(target, arg, load, draft_vocab))


def default_draft_serves(target: Backend) -> bool:
    """Whether the registry's default draft model shares the target's tokenizer, by
    comparing the target's vocabulary fingerprint with the one the registry records; a
    target that is that vocabulary plus padding (Qwen2.5 7B and up) is recognised too
    (:func:`specdecode.backends.vocab.fingerprint_serves`)."""
    return fingerprint_serves(target, registry.get_spec(registry.DEFAULT_DRAFT).vocab_fingerprint)


def is_default_draft(target: Backend) -> bool:
    """Whether the target is the registry's default draft model itself (by its known SHA-256,
    or its file being the registry's cached copy): ``auto`` then does not draft with it, since
    a draft as costly as the target saves nothing."""
    spec = registry.get_spec(registry.DEFAULT_DRAFT)
    if target.known_sha256 == spec.sha256:
        return True
    path = target.path
    return path is not None and Path(path).resolve() == registry.cached_path(spec).resolve()


def make_controller(draft: "str | Backend", target: Backend, kmax: int = AUTO_KMAX, n_ctx: int | None = None,
                    n_threads: int | None = None, progress: bool = True, backend: str = "auto",
                    dtype: str = DEFAULT_DTYPE, device: str = DEFAULT_DEVICE, draft_vocab: int | str = 0,
                    n_seq: int = 1, gpu_layers: int | str = DEFAULT_GPU_LAYERS) -> Drafter:
    """The cost-aware controller over the drafters that ``draft`` names, with K <= kmax.

    draft: "auto" (the free lookups of the kinds table, plus the default draft model when it
    shares the target's tokenizer), "none" (plain), or one kind (:func:`make_drafter`).
    See :func:`make_speculation` for what is measured. Raises SpecDecodeError for an option
    the drafters do not use.
    """
    check_draft_options(draft, n_seq, draft_vocab=draft_vocab, draft_backend=backend)
    choice = replace(resolve(draft, "auto"), k=kmax)
    return _controller(choice, target, dict(n_ctx=n_ctx, n_threads=n_threads, progress=progress, backend=backend,
                                            dtype=dtype, device=device, n_seq=n_seq, gpu_layers=gpu_layers),
                       draft_vocab)


def make_speculation(choice: Choice, target: Backend, n_ctx: int | None = None, n_threads: int | None = None,
                     progress: bool = True, backend: str = "auto", dtype: str = DEFAULT_DTYPE,
                     device: str = DEFAULT_DEVICE, draft_vocab: int | str = 0, n_slots: int = 1,
                     max_tree_nodes: int | None = None, tree_width: int = DEFAULT_TREE_WIDTH,
                     calibration: Calibration | None = None,
                     gpu_layers: int | str = DEFAULT_GPU_LAYERS) -> SpeculativeEngine:
    """The one recipe of speculation, for the Decoder, the bench and so the server alike: the
    drafter of a resolved :class:`specdecode.drafters.kinds.Choice` (none, one kind at a fixed
    K, or the cost-aware controller over its names) and the engine around it, with n_slots
    slots (draft models load n_slots KV sequences), trees of at most max_tree_nodes nodes of
    tree_width candidates. The options are checked by the caller
    (:func:`specdecode.drafters.kinds.check_draft_options`), once.

    The controller measures the target's verification curve T(n) at COST_CURVE_NS up to
    k + 1 (and the sizes of a batched step, BATCH_COST_CURVE_NS, for several slots), and a
    draft model's cost per token, once per model and machine (cached under the model cache);
    it then follows the observed step times, and rewrites the cached curve with them when
    they contradict it. With a ``calibration`` (a server's) nothing is measured here that the
    cache lacks: the target's curve and invariant block are measured later, between requests
    (:class:`specdecode.control.calibration.Calibration`), and planned meanwhile with the cached
    curve or a conservative one. gpu_layers: a draft model's layers on llama.cpp's GPU
    (:func:`load_backend`). Raises SpecDecodeError / IncompatibleVocabularyError; a
    drafter loaded here is closed again when a later part fails.
    """
    load_opts = dict(n_ctx=n_ctx, n_threads=n_threads, progress=progress, backend=backend, dtype=dtype,
                     device=device, n_seq=n_slots, gpu_layers=gpu_layers)
    if not choice.names:
        drafter: Drafter = NoDrafter()
    elif choice.planned:
        drafter = _controller(choice, target, load_opts, draft_vocab, calibration)
    else:
        drafter = _build(choice.names[0], target, load_opts, draft_vocab)
    try:
        set_tree_options(drafter, 0, tree_width)  # the node budget is set per generation
        engine = SpeculativeEngine(target, drafter, choice.k, n_slots=n_slots, max_tree_nodes=max_tree_nodes,
                                   invariance=cached_invariance if calibration is None else calibration.invariance)
        if calibration is not None:
            calibration.attach(engine)
        return engine
    except BaseException:
        drafter.close()
        raise


def _controller(choice: Choice, target: Backend, load_opts: dict, draft_vocab: int | str,
                calibration: Calibration | None = None) -> Drafter:
    """The controller over a planned choice's drafters (none: plain), K <= choice.k; its target
    curve from the cache or measured now, or with a calibration, measured later."""
    if not choice.names:
        return NoDrafter()
    kmax, n_seq = choice.k, load_opts["n_seq"]
    cache = registry.cache_dir()
    ns = sorted({n for n in COST_CURVE_NS if n <= kmax + 1} | {kmax + 1})
    if n_seq > 1:
        ns += [n for n in BATCH_COST_CURVE_NS if ns[-1] < n <= n_seq * (kmax + 1)]
    on_drift = lambda why, live: rewrite_from_live(target, cache, live, why)  # noqa: E731
    if calibration is None:  # (the bench's engines) a cached curve at once, stale or not: checked by generate or serve
        cached, _ = read_cached(target, ns, cache)
        measured = cached if cached is not None else \
            cached_measurement(target, ns, cache, on_measure=_say_measuring if load_opts["progress"] else None)
        shared = SharedCosts(ObservedCurve(measured.curve), kmax + 1, on_drift)
        shared.set_context_costs(cached_context_costs(target, cache, _say_measuring_context if load_opts["progress"]
                                                      else None))
    else:
        shared = calibration.costs(ns, kmax + 1, on_drift)
    names = list(choice.names)
    if choice.default_model and default_draft_serves(target) and not is_default_draft(target):
        names.append(registry.DEFAULT_DRAFT)
    sources = []
    try:
        for name in names:
            sources.append(_source(_build(name, target, load_opts, draft_vocab), kind_of(name)[0].cost_s))
    except BaseException:
        for s in sources:
            s.drafter.close()
        raise
    controller = SpeculationController(sources, shared.curve.base, kmax=kmax, learn_costs=True, shared=shared)
    if calibration is None:
        controller.measurement_note = "; ".join(x for x in (measured.note(), shared.context_note()) if x)
    else:
        calibration.report_to(controller)
    return controller


def _say_measuring(ns) -> None:
    print(f"specdecode: measuring the target's forward time T(n) at {len(ns)} sizes, once per model and machine "
          "(cached: later starts skip it)...", file=sys.stderr, flush=True)


def _say_measuring_context() -> None:
    print("specdecode: measuring what a long context adds to the target's forward time, once per model and machine "
          "(cached: later starts skip it)...", file=sys.stderr, flush=True)


def cached_invariance(target: Backend, seq: int) -> int:
    """The target's invariant block (:func:`specdecode.control.invariance.measure_invariant_block`),
    measured once per model and machine and cached beside its cost curve."""
    return cached_invariant_block(target, seq, registry.cache_dir())


def _source(drafter: Drafter, cost_s: float | None) -> Source:
    """A drafter with its starting cost per drafted token: the kind's prior, or for a draft
    model its measured one-token forward (and per-token catch-up from a 64-token forward)."""
    if cost_s is not None:
        return Source(drafter, cost_s)
    (model,) = drafter.draft_backends()
    n = max(1, min(64, model.n_ctx - 1))  # a model over a few dozen codes has a short context
    draft_curve = cached_forward_curve(model, sorted({1, n}), registry.cache_dir())
    return Source(drafter, draft_curve(1), prefill_cost=draft_curve(n) / n)
