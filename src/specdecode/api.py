"""Python API: a reusable :class:`Decoder` that keeps models loaded, and :func:`generate`.

Example::

    import specdecode
    result = specdecode.generate("def quicksort(xs):", max_tokens=64)
    print(result.text, result.stats.acceptance_rate)

    dec = specdecode.Decoder(target="qwen2.5-coder-1.5b-instruct", draft="ngram")
    for delta in dec.generate(messages=[{"role": "user", "content": "Hi"}], stream=True):
        print(delta, end="")
"""

from __future__ import annotations

from pathlib import Path
from typing import Iterator, Sequence

from . import models
from .backends.base import Backend
from .backends.llama_cpp import LlamaCppBackend
from .drafters import Drafter, ModelDrafter, NgramDrafter, NoDrafter
from .engine import GenerationResult, SpeculativeEngine
from .errors import SpecDecodeError
from .parity import parity_report
from .sampling import SamplingParams


BACKENDS = ("auto", "llama.cpp", "torch")


def backend_kind(name_or_path: str, backend: str = "auto") -> str:
    """'llama.cpp' or 'torch'. auto: llama.cpp for .gguf files and registry names, torch for
    Hugging Face folders."""
    if backend not in BACKENDS:
        raise SpecDecodeError(f"backend {backend!r} is not one of {', '.join(BACKENDS)}")
    if backend != "auto":
        return backend
    return "torch" if Path(name_or_path).expanduser().is_dir() else "llama.cpp"


def load_backend(name_or_path: str, backend: str = "auto", n_ctx: int = 4096, n_threads: int | None = None,
                 dtype: str = "float32", device: str = "cpu", progress: bool = True) -> Backend:
    """Load a model on the chosen backend.

    llama.cpp: a registry name (pulled on first use) or a .gguf path.
    torch: a Hugging Face folder, a .gguf path (dequantized by transformers), or a registry
    name (its cached conversion from ``specdecode models convert`` if present, else the GGUF).
    """
    kind = backend_kind(name_or_path, backend)
    if kind == "llama.cpp":
        path = models.resolve(name_or_path, progress=progress)
        return LlamaCppBackend(path, n_ctx=n_ctx, n_threads=n_threads, name=name_or_path)
    from .backends.torch_backend import TorchBackend

    path = Path(name_or_path).expanduser()
    if name_or_path in models.REGISTRY:
        folder = models.hf_folder(name_or_path, dtype)
        path = folder if (folder / "config.json").exists() else models.resolve(name_or_path, progress=progress)
    elif not path.is_dir():
        models.check_gguf_file(path)
    return TorchBackend.load(path, dtype=dtype, device=device, n_ctx=n_ctx, name=name_or_path)


def make_drafter(draft: str, target: Backend, n_ctx: int = 4096, n_threads: int | None = None,
                 progress: bool = True, backend: str = "auto", dtype: str = "float32",
                 device: str = "cpu", draft_vocab: int = 0) -> Drafter:
    """'none', 'ngram', or a draft model (registry name, .gguf path or HF folder on any
    backend) checked against the target's vocabulary. draft_vocab: see ModelDrafter's
    vocab_subset (torch drafts; 0 = the full vocabulary)."""
    if draft == "none":
        return NoDrafter()
    if draft == "ngram":
        return NgramDrafter()
    d = load_backend(draft, backend=backend, n_ctx=n_ctx, n_threads=n_threads, dtype=dtype, device=device,
                     progress=progress)
    try:
        return ModelDrafter(d, target=target, vocab_subset=draft_vocab)
    except SpecDecodeError:
        d.close()
        raise


AUTO_KMAX = 8
QWEN_VOCAB = 151936
NGRAM_COST_S = 2e-4  # seconds per n-gram proposal: a numpy scan of the context, negligible next to a forward


def make_controller(draft: str, target: Backend, kmax: int = 8, n_ctx: int = 4096, n_threads: int | None = None,
                    progress: bool = True, backend: str = "auto", dtype: str = "float32",
                    device: str = "cpu", draft_vocab: int = 0) -> Drafter:
    """The cost-aware controller over the drafters that ``draft`` names.

    draft: "auto" (n-gram lookup and the default draft model), "ngram", "none" (plain), or
    a draft model. Measures the target's verification curve T(1..kmax+1) and the draft
    model's cost per token once per model and machine (cached under the model cache).
    """
    from .controller import SpeculationController, Source
    from .costmodel import cached_forward_curve

    if draft == "none":
        return NoDrafter()
    curve = cached_forward_curve(target, list(range(1, kmax + 2)), models.cache_dir())
    sources = []
    if draft in ("auto", "ngram"):
        sources.append(Source(NgramDrafter(), NGRAM_COST_S))
    # "auto" adds the default draft model only for targets that share its vocabulary
    # (the Qwen2.5 family); other targets get n-gram lookup alone.
    if draft == "auto" and target.n_vocab != QWEN_VOCAB:
        return SpeculationController(sources, curve, kmax=kmax)
    if draft != "ngram":
        model = make_drafter(models.DEFAULT_DRAFT if draft == "auto" else draft, target, n_ctx=n_ctx,
                             n_threads=n_threads, progress=progress, backend=backend, dtype=dtype, device=device,
                             draft_vocab=draft_vocab)
        draft_curve = cached_forward_curve(model.backend, [1, 64], models.cache_dir())
        sources.append(Source(model, draft_curve(1), prefill_cost=draft_curve(64) / 64))
    return SpeculationController(sources, curve, kmax=kmax)


class Decoder:
    """A target and a drafter loaded once, for many generations.

    target: registry name or .gguf path (default qwen2.5-coder-1.5b-instruct).
    draft: registry name or .gguf path of a draft model, "ngram" (prompt lookup), "none"
        (plain decoding) or "auto" (n-gram lookup when it matches, else the default draft
        model when it pays, else plain); default qwen2.5-coder-0.5b-instruct.
    num_speculative_tokens: K, drafted tokens per step (0..32), or "auto" (default): the
        cost-aware controller chooses K in 0..8 each step (:mod:`specdecode.controller`).
    n_ctx: context window in tokens. n_threads: CPU threads (default: all cores).
    backend, draft_backend: "auto", "llama.cpp" or "torch" (see :func:`backend_kind`).
    dtype, device: for the torch backend (float32/bfloat16/float16; cpu/cuda/auto).
    draft_vocab: a torch draft model computes logits only for ids below this, the prompt's
        tokens and end-of-generation ids (0 = all; see ModelDrafter's vocab_subset).

    Raises SpecDecodeError (and subclasses: ModelFileError, IncompatibleVocabularyError)
    with a message naming the values.
    """

    def __init__(
        self,
        target: str = models.DEFAULT_TARGET,
        draft: str = models.DEFAULT_DRAFT,
        num_speculative_tokens: int | str = "auto",
        n_ctx: int = 4096,
        n_threads: int | None = None,
        progress: bool = True,
        backend: str = "auto",
        draft_backend: str = "auto",
        dtype: str = "float32",
        device: str = "cpu",
        draft_vocab: int = 0,
    ) -> None:
        self.target_name = target
        self.draft_name = draft
        if not isinstance(draft_vocab, int) or isinstance(draft_vocab, bool) or draft_vocab < 0:
            raise SpecDecodeError(f"draft_vocab = {draft_vocab!r} is out of range: expected an integer >= 0 (0 = all)")
        if draft_vocab and draft in ("ngram", "none"):
            raise SpecDecodeError(f"draft_vocab = {draft_vocab} applies to a draft model; draft {draft!r} has none")
        self.target = load_backend(target, backend=backend, n_ctx=n_ctx, n_threads=n_threads, dtype=dtype,
                                   device=device, progress=progress)
        try:
            opts = dict(n_ctx=n_ctx, n_threads=n_threads, progress=progress, backend=draft_backend, dtype=dtype,
                        device=device, draft_vocab=draft_vocab)
            if num_speculative_tokens == "auto":
                self.drafter = make_controller(draft, self.target, kmax=AUTO_KMAX, **opts)
                k = AUTO_KMAX
            elif draft == "auto":
                raise SpecDecodeError("--draft auto needs --num-speculative-tokens auto")
            elif isinstance(num_speculative_tokens, int) and not isinstance(num_speculative_tokens, bool):
                self.drafter = make_drafter(draft, self.target, **opts)
                k = num_speculative_tokens
            else:
                raise SpecDecodeError(
                    f"num_speculative_tokens = {num_speculative_tokens!r}: expected an integer 0..32 or 'auto'"
                )
            self.engine = SpeculativeEngine(self.target, self.drafter, k)
        except BaseException:
            self.target.close()
            raise
        self._plain = NoDrafter()

    def close(self) -> None:
        drafters = [s.drafter for s in getattr(self.drafter, "sources", [])] or [self.drafter]
        for d in drafters:
            backend = getattr(d, "backend", None)
            if backend is not None:
                backend.close()
        self.target.close()

    def __enter__(self) -> "Decoder":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def prompt_ids(self, prompt: str | None = None, messages: Sequence[dict] | None = None) -> list[int]:
        """Tokenize a raw prompt (BOS added if the model wants it) or chat messages (the
        model's own chat template). Exactly one of the two must be given."""
        if (prompt is None) == (messages is None):
            raise SpecDecodeError("give exactly one of prompt or messages")
        if messages is not None:
            text = self.target.apply_chat_template(messages)
            return self.target.tokenize(text, add_special=False, parse_special=True)
        if not isinstance(prompt, str):
            raise SpecDecodeError(f"prompt must be a string, got {type(prompt).__name__}")
        return self.target.tokenize(prompt, add_special=True, parse_special=True)

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

    def stream(
        self,
        prompt: str | None = None,
        *,
        messages: Sequence[dict] | None = None,
        max_tokens: int = 256,
        temperature: float = 0.0,
        top_p: float = 1.0,
        top_k: int = 0,
        min_p: float = 0.0,
        repetition_penalty: float = 1.0,
        frequency_penalty: float = 0.0,
        presence_penalty: float = 0.0,
        seed: int | None = None,
        stop: str | Sequence[str] | None = None,
        logprobs: int | None = None,
        plain: bool = False,
        num_speculative_tokens: int | None = None,
        record_top2_gaps: bool = False,
    ) -> Iterator[str | GenerationResult]:
        """Yield text deltas as tokens are committed and, last, the GenerationResult.

        prompt / messages: a raw prompt or OpenAI-style chat messages (exactly one).
        max_tokens: exact cap (>= 1). temperature 0 is greedy; top_p, top_k, min_p and the
        penalties shape target and draft distributions alike (see SamplingParams). seed:
        same seed, same output. stop: string(s) that end the output (excluded from it).
        logprobs: N most likely tokens per emitted token. plain: decode without the
        drafter (the baseline). num_speculative_tokens: override K for this call.
        record_top2_gaps: record the target's top-2 logit gap per token (parity reports).
        Raises SpecDecodeError (with the values) for bad options or prompts that do not fit.
        """
        params = SamplingParams(
            temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p,
            repetition_penalty=repetition_penalty, frequency_penalty=frequency_penalty,
            presence_penalty=presence_penalty, seed=seed,
        )
        stops = [stop] if isinstance(stop, str) else list(stop or [])
        ids = self.prompt_ids(prompt, messages)
        return self.engine.stream(
            ids, sampling=params, max_tokens=max_tokens, stop=stops, logprobs=logprobs,
            record_top2_gaps=record_top2_gaps,
            drafter=self._plain if plain else None,
            num_speculative_tokens=0 if plain else num_speculative_tokens,
        )

    def compare(self, prompt: str | None = None, **kwargs) -> tuple[GenerationResult, GenerationResult, dict]:
        """Run speculatively and plainly on the same input; returns (speculative, plain, report).

        report: speedup (ratio of decode tokens/s), and for greedy runs the parity
        report of :func:`specdecode.parity.parity_report`.
        """
        kwargs.pop("plain", None)
        self.engine.forget_prefix()
        spec = self.generate(prompt, plain=False, record_top2_gaps=True, **kwargs)
        self.engine.forget_prefix()  # the baseline prefills too, as it would alone
        base = self.generate(prompt, plain=True, record_top2_gaps=True, **kwargs)
        report: dict = {
            "speedup": round(spec.stats.decode_tokens_per_s / base.stats.decode_tokens_per_s, 3)
            if base.stats.decode_tokens_per_s > 0 else None,
        }
        if kwargs.get("temperature", 0.0) == 0.0:
            report["parity"] = parity_report(spec, base)
        else:
            report["parity"] = {"status": "not applicable: sampling (temperature > 0) compares distributions, not tokens"}
        return spec, base, report


def generate(
    prompt: str | None = None,
    *,
    target: str = models.DEFAULT_TARGET,
    draft: str = models.DEFAULT_DRAFT,
    num_speculative_tokens: int | str = "auto",
    n_ctx: int = 4096,
    n_threads: int | None = None,
    backend: str = "auto",
    draft_backend: str = "auto",
    dtype: str = "float32",
    device: str = "cpu",
    **kwargs,
) -> GenerationResult | Iterator[str]:
    """One-shot generation: loads the models, generates, and frees them.

    See :class:`Decoder` for the model options and :meth:`Decoder.generate` for the rest.
    With stream=True the models stay loaded until the iterator is exhausted.
    """
    dec = Decoder(target=target, draft=draft, num_speculative_tokens=num_speculative_tokens,
                  n_ctx=n_ctx, n_threads=n_threads, backend=backend, draft_backend=draft_backend,
                  dtype=dtype, device=device)
    if kwargs.get("stream"):
        def gen() -> Iterator[str]:
            with dec:
                yield from dec.generate(prompt, **kwargs)
        return gen()
    with dec:
        return dec.generate(prompt, **kwargs)
