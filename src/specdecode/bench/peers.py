"""Other implementations of speculative decoding, timed on the same prompts as ours.

For a llama.cpp target: llama-cpp-python's own prompt-lookup decoding
(``LlamaPromptLookupDecoding``) on the same GGUF. For a torch target: transformers'
``generate(prompt_lookup_num_tokens=10)`` and, when a configuration drafts with a model on
the torch backend, ``generate(assistant_model=...)`` with that draft. All greedy.
"""

from __future__ import annotations

import time
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator, Mapping, Protocol, Sequence

from ..assembly import registry
from ..backends.base import Backend, Placement
from ..backends.llama_cpp import LlamaCppBackend
from ..backends.llama_cpp.buffers import ModelBuffers, resolve_buffers
from ..engine import SpeculativeEngine

# Tokens each peer drafts per step: LlamaPromptLookupDecoding's default, and the value of
# transformers' prompt-lookup example, so each peer runs as its authors suggest.
PEER_NUM_PRED_TOKENS = 10
# The llama-cpp-python peer keeps an n_ctx x vocabulary score buffer; 2048 positions (tokens)
# hold every built-in prompt with its answer.
PEER_MAX_N_CTX = 2048


def decode_rate(n_tokens: int, first_s: float, last_s: float, first_count: int = 1) -> float:
    """Decode tokens/s: the tokens after the first chunk (``first_count`` tokens, 1 unless a
    first step committed several) over the seconds between the first and the last token.
    0.0 when there is no such span. Prefill never enters it, for every runner alike."""
    span = last_s - first_s
    return (n_tokens - first_count) / span if n_tokens > first_count and span > 0 else 0.0


class Peer(Protocol):
    def run(self, ids: list[int], max_tokens: int, assisted: bool = False) -> tuple[int, float]: ...


@contextmanager
def _llama_model_params(placement: ModelBuffers) -> Iterator[None]:
    """While active, llama-cpp-python's ``Llama()`` loads with the weights placed as
    ``placement`` says (``use_extra_bufts`` and ``tensor_buft_overrides``), as specdecode's own
    backend places them.

    Why a patch: llama-cpp-python 0.3.36's ``Llama.__init__`` builds its model params from
    ``llama_cpp.llama_cpp.llama_model_default_params()`` and hands them straight to the
    model loader; it has no argument for either and no way to pass model params (``**kwargs``
    is ignored). Without it the peer would put weights in the AMX buffer that crashes
    (:mod:`specdecode.backends.llama_cpp.buffers`). So the default-params function is wrapped for
    the peer's own load only and restored however the load ends.
    """
    import llama_cpp.llama_cpp as lib  # the module Llama.__init__ calls into

    original = lib.llama_model_default_params

    def params():
        mp = original()
        placement.apply(mp)
        return mp

    lib.llama_model_default_params = params
    try:
        yield
    finally:
        lib.llama_model_default_params = original


class PromptLookupPeer:
    """llama-cpp-python's own prompt-lookup decoding on the same GGUF (greedy).

    path: the GGUF file. n_ctx: context window in tokens. n_threads: CPU threads. placement:
    where the target's layers run (the peer's go where they do: as many on the GPU).
    Raises whatever llama-cpp-python raises when the model cannot load (ValueError).
    """

    def __init__(self, path: Path, n_ctx: int, n_threads: int, num_pred_tokens: int = PEER_NUM_PRED_TOKENS,
                 placement: Placement = Placement()):
        from llama_cpp import Llama
        from llama_cpp.llama_speculative import LlamaPromptLookupDecoding

        on_gpu = placement.gpu_layers
        with _llama_model_params(resolve_buffers(path, n_threads, placement.n_layers - on_gpu if on_gpu else None)):
            # logits_all=True: with a draft model Llama evaluates many positions per call, but
            # sizes its score buffer from this argument (n_batch rows otherwise, which
            # overflows on prompts longer than n_batch).
            self.llm = Llama(str(path), n_ctx=n_ctx, n_threads=n_threads, n_threads_batch=n_threads,
                             logits_all=True, n_gpu_layers=on_gpu,
                             draft_model=LlamaPromptLookupDecoding(num_pred_tokens=num_pred_tokens), verbose=False)

    def run(self, ids: list[int], max_tokens: int, assisted: bool = False) -> tuple[int, float]:
        """Generate greedily; returns (tokens, decode tokens/s as :func:`decode_rate`).
        ``assisted`` is not offered (ValueError)."""
        if assisted:
            raise ValueError("the llama-cpp-python peer has no assisted mode")
        t0 = time.perf_counter()
        first = last = 0.0
        n = 0
        self.llm.reset()
        for chunk in self.llm.create_completion(ids, max_tokens=max_tokens, temperature=0.0, stream=True):
            if chunk["choices"][0]["finish_reason"] is not None:
                continue  # the closing chunk carries no token
            n += 1
            last = time.perf_counter() - t0
            if n == 1:
                first = last
        return n, decode_rate(n, first, last)


class TransformersPeer:
    """transformers' own speculative decoding on the torch target (greedy): prompt lookup
    (``prompt_lookup_num_tokens``) and, given a draft model, assisted generation
    (``assistant_model``, transformers' default schedule). Times tokens as they stream."""

    def __init__(self, model, eos_ids, assistant=None, num_pred_tokens: int = PEER_NUM_PRED_TOKENS):
        self.model = model
        self.eos = sorted(eos_ids)
        self.assistant = assistant
        self.num_pred_tokens = num_pred_tokens

    def run(self, ids: list[int], max_tokens: int, assisted: bool = False) -> tuple[int, float]:
        """Generate greedily; returns (tokens, decode tokens/s as :func:`decode_rate`).
        assisted: with the assistant model instead of prompt lookup."""
        import torch
        from transformers.generation.streamers import BaseStreamer

        marks: list[float] = []
        counts: list[int] = []
        t0 = time.perf_counter()

        class Clock(BaseStreamer):
            prompt_seen = False

            def put(self, value):
                if not self.prompt_seen:  # the first call carries the prompt
                    self.prompt_seen = True
                    return
                marks.append(time.perf_counter() - t0)
                counts.append(int(value.numel()))

            def end(self):
                pass

        device = next(self.model.parameters()).device
        inp = torch.tensor([ids], device=device)
        kw = {"assistant_model": self.assistant} if assisted else {"prompt_lookup_num_tokens": self.num_pred_tokens}
        with torch.inference_mode():
            out = self.model.generate(inp, attention_mask=torch.ones_like(inp), max_new_tokens=max_tokens,
                                      do_sample=False, eos_token_id=self.eos or None,
                                      pad_token_id=self.eos[0] if self.eos else None, streamer=Clock(), **kw)
        n = int(out.shape[1]) - len(ids)
        if not marks:
            return n, 0.0
        # A first assisted step may commit several tokens at once.
        return n, decode_rate(n, marks[0], marks[-1], first_count=counts[0])


def torch_draft_model(engines: Mapping[str, SpeculativeEngine]):
    """The torch module of the first draft model on the torch backend among the engines'
    drafters (as their ``draft_backends()`` declare them), or None."""
    from ..backends.torch import TorchBackend

    for eng in engines.values():
        for backend in eng.drafter.draft_backends():
            if isinstance(backend, TorchBackend):
                return backend.model
    return None


def start_peer(target: Backend, target_name: str, engines: Mapping[str, SpeculativeEngine], n_ctx: int,
               warm_ids: Sequence[int]) -> tuple[Peer | None, str | None, bool]:
    """Load and warm up the peers that fit the target: (peer, note for the report, whether
    the assisted peer runs too). A peer that cannot run is reported in the note, not raised.

    n_ctx: the bench's context window in tokens (the llama.cpp peer caps it at PEER_MAX_N_CTX).
    """
    warm = list(warm_ids)
    if isinstance(target, LlamaCppBackend):
        try:
            peer = PromptLookupPeer(registry.resolve(target_name), min(n_ctx, PEER_MAX_N_CTX), target.n_threads,
                                    placement=target.placement)
            peer.run(warm, 8)
            return (peer, f"llama-cpp-python LlamaPromptLookupDecoding(num_pred_tokens={PEER_NUM_PRED_TOKENS}), "
                          "temperature 0", False)
        except Exception as e:  # a peer that cannot run is reported, not fatal
            return None, f"llama-cpp-python prompt lookup not run: {type(e).__name__}: {e}", False
    if not hasattr(target, "model"):
        return None, None, False
    try:
        assistant = torch_draft_model(engines)
        tpeer = TransformersPeer(target.model, target.eog_ids, assistant)
        tpeer.run(warm, 8)
        note = f"transformers generate(prompt_lookup_num_tokens={PEER_NUM_PRED_TOKENS}), greedy"
        if assistant is not None:
            tpeer.run(warm, 8, assisted=True)
            note += "; transformers generate(assistant_model=<the torch draft>), greedy"
        return tpeer, note, assistant is not None
    except Exception as e:  # a peer that cannot run is reported, not fatal
        return None, f"transformers peers not run: {type(e).__name__}: {e}", False
