"""Loading models and assembling drafters: what ``Decoder``, the benchmark and the server
build a generation from.

Backends: llama.cpp for .gguf files and registry names, torch for Hugging Face folders
(``backend="auto"``). Drafters: "none", "ngram", a draft model, or the cost-aware
controller over several of them (``-k auto``).
"""

from __future__ import annotations

from pathlib import Path

from . import models
from .backends.base import Backend
from .backends.llama_cpp import LlamaCppBackend
from .controller import SpeculationController, Source
from .costmodel import cached_forward_curve, mark_stale
from .drafters import Drafter, ModelDrafter, NgramDrafter, NoDrafter, SuffixDrafter
from .drafters.heads import HEADS_PREFIX, load_heads_drafter
from .errors import SpecDecodeError
from .limits import AUTO_KMAX, BACKENDS, BATCH_COST_CURVE_NS, COST_CURVE_NS, DEFAULT_DEVICE, DEFAULT_DTYPE, DEFAULT_N_CTX, check_choice
from .vocab import fingerprint_serves

NGRAM_COST_S = 2e-4  # seconds per n-gram proposal: a numpy scan of the context, negligible next to a forward
HEADS_COST_S = 2e-3  # seconds per token drafted by heads, to start with (K (H^2 + S H) multiply-adds)


def backend_kind(name_or_path: str, backend: str = "auto") -> str:
    """'llama.cpp' or 'torch'. auto: llama.cpp for .gguf files and registry names, torch for
    Hugging Face folders. Raises SpecDecodeError for an unknown backend."""
    check_choice(backend, BACKENDS, "backend")
    if backend != "auto":
        return backend
    return "torch" if Path(name_or_path).expanduser().is_dir() else "llama.cpp"


def load_backend(name_or_path: str, backend: str = "auto", n_ctx: int = DEFAULT_N_CTX, n_threads: int | None = None,
                 dtype: str = DEFAULT_DTYPE, device: str = DEFAULT_DEVICE, progress: bool = True,
                 n_seq: int = 1) -> Backend:
    """Load a model on the chosen backend.

    n_seq: sequences for concurrent generations (llama.cpp; the torch backend holds one
    and raises SpecDecodeError for more).

    llama.cpp: a registry name (pulled on first use) or a .gguf path.
    torch: a Hugging Face folder, a .gguf path (dequantized by transformers), or a registry
    name (its cached conversion from ``specdecode models convert`` if present, else the GGUF).
    Raises SpecDecodeError / ModelFileError naming the model.
    """
    kind = backend_kind(name_or_path, backend)
    if kind == "llama.cpp":
        path = models.resolve(name_or_path, progress=progress)
        return LlamaCppBackend(path, n_ctx=n_ctx, n_threads=n_threads, name=name_or_path, n_seq=n_seq)
    if n_seq != 1:
        raise SpecDecodeError(f"the torch backend serves one sequence at a time: {n_seq} parallel sequences "
                              f"(--parallel {n_seq}) need the llama.cpp backend (a GGUF model)", param="parallel")
    from .backends.torch_backend import TorchBackend

    path = Path(name_or_path).expanduser()
    if name_or_path in models.REGISTRY:
        folder = models.hf_folder(name_or_path, dtype)
        path = folder if (folder / "config.json").exists() else models.resolve(name_or_path, progress=progress)
    elif not path.is_dir():
        models.check_gguf_file(path)
    return TorchBackend.load(path, dtype=dtype, device=device, n_ctx=n_ctx, name=name_or_path)


def make_drafter(draft: str, target: Backend, n_ctx: int = DEFAULT_N_CTX, n_threads: int | None = None,
                 progress: bool = True, backend: str = "auto", dtype: str = DEFAULT_DTYPE,
                 device: str = DEFAULT_DEVICE, draft_vocab: int = 0, n_seq: int = 1) -> Drafter:
    """'none', 'ngram', 'suffix', 'heads:FILE' (draft heads trained on the target), or a draft model (registry name, .gguf path or HF folder on
    any backend) checked against the target's vocabulary. draft_vocab: see ModelDrafter's
    vocab_subset (torch drafts; 0 = the full vocabulary). n_seq: KV sequences of the draft
    model, one per concurrent generation (its forks draft on them).

    Raises IncompatibleVocabularyError when the draft model's tokenizer differs (the
    loaded draft is closed again).
    """
    if draft == "none":
        return NoDrafter()
    if draft == "ngram":
        return NgramDrafter()
    if draft == "suffix":
        return SuffixDrafter()
    if draft.startswith(HEADS_PREFIX):
        return load_heads_drafter(draft[len(HEADS_PREFIX):], target)
    d = load_backend(draft, backend=backend, n_ctx=n_ctx, n_threads=n_threads, dtype=dtype, device=device,
                     progress=progress, n_seq=n_seq)
    try:
        return ModelDrafter(d, target=target, vocab_subset=draft_vocab)
    except SpecDecodeError:
        d.close()
        raise


def default_draft_serves(target: Backend) -> bool:
    """Whether the registry's default draft model shares the target's tokenizer, by
    comparing the target's vocabulary fingerprint with the one the registry records; a
    target that is that vocabulary plus padding (Qwen2.5 7B and up) is recognised too
    (:func:`specdecode.vocab.fingerprint_serves`)."""
    return fingerprint_serves(target, models.get_spec(models.DEFAULT_DRAFT).vocab_fingerprint)


def make_controller(draft: str, target: Backend, kmax: int = AUTO_KMAX, n_ctx: int = DEFAULT_N_CTX,
                    n_threads: int | None = None, progress: bool = True, backend: str = "auto",
                    dtype: str = DEFAULT_DTYPE, device: str = DEFAULT_DEVICE, draft_vocab: int = 0,
                    n_seq: int = 1) -> Drafter:
    """The cost-aware controller over the drafters that ``draft`` names.

    draft: "auto" (n-gram and suffix lookup, plus the default draft model when it shares the
    target's tokenizer), "ngram", "suffix", "none" (plain), or a draft model. Measures the target's
    verification curve T(n) at COST_CURVE_NS up to kmax + 1 and the draft model's cost per
    token once per model and machine (cached under the model cache); the controller then
    follows the observed verification times, and marks the cached curve stale when they
    drift far from it. n_seq: concurrent generations (the curve then also covers the sizes
    of a batched step, BATCH_COST_CURVE_NS; a draft model gets n_seq KV sequences).
    """
    if draft == "none":
        return NoDrafter()
    cache = models.cache_dir()
    ns = sorted({n for n in COST_CURVE_NS if n <= kmax + 1} | {kmax + 1})
    if n_seq > 1:
        ns += [n for n in BATCH_COST_CURVE_NS if ns[-1] < n <= n_seq * (kmax + 1)]
    curve = cached_forward_curve(target, ns, cache)

    def controller(sources: list[Source]) -> SpeculationController:
        return SpeculationController(sources, curve, kmax=kmax, learn_costs=True,
                                     on_drift=lambda why: mark_stale(target, cache, why))

    sources = []
    if draft in ("auto", "ngram"):
        sources.append(Source(NgramDrafter(), NGRAM_COST_S))
    if draft in ("auto", "suffix"):
        sources.append(Source(SuffixDrafter(), NGRAM_COST_S))
    if draft.startswith(HEADS_PREFIX):
        # The heads' cost per token starts from a prior (a few small matrix products) and
        # follows what proposals are observed to cost.
        return controller([Source(load_heads_drafter(draft[len(HEADS_PREFIX):], target), HEADS_COST_S)])
    if draft in ("ngram", "suffix") or (draft == "auto" and not default_draft_serves(target)):
        return controller(sources)
    model = make_drafter(models.DEFAULT_DRAFT if draft == "auto" else draft, target, n_ctx=n_ctx,
                         n_threads=n_threads, progress=progress, backend=backend, dtype=dtype, device=device,
                         draft_vocab=draft_vocab, n_seq=n_seq)
    draft_curve = cached_forward_curve(model.backend, [1, 64], models.cache_dir())
    sources.append(Source(model, draft_curve(1), prefill_cost=draft_curve(64) / 64))
    return controller(sources)
