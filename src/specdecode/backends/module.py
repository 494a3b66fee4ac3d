"""Your own PyTorch model over discrete codes as a target or a draft model.

Speculative decoding needs nothing of text: any autoregressive model over a codebook
(pixel intensities, VQ-VAE / VQGAN latents, audio codec tokens) can be the target, and a
smaller one over the same codebook its draft model. :class:`ModuleBackend` wraps a
``torch.nn.Module`` in the backend contract (:mod:`.base`) in a few lines::

    target = ModuleBackend(model, n_vocab=28, eog_ids=[27], n_ctx=66, kv_cache=True)
    with Decoder(target=target, draft=ModuleBackend(small, n_vocab=28, eog_ids=[27], n_ctx=66)) as dec:
        result = dec.generate_ids([class_code], max_tokens=64, temperature=1.0, seed=0)
        result.token_ids        # the sampled codes; result.stats: acceptance, mean accepted length

The model is called in one of two ways (``kv_cache``):

- ``kv_cache=False`` (the slow path): ``model(ids) -> logits``, ids a LongTensor [1, L] of
  the whole sequence from position 0, logits [1, L, V]. Every forward recomputes the whole
  sequence, so a step costs O(L) tokens of compute: correct for any model, slow for long ones.
- ``kv_cache=True``: ``model(ids, past) -> (logits, past)``, ids [1, N] the new codes at
  positions P..P+N-1 where P is the length ``past`` holds (``past`` is None at position 0),
  logits [1, N, V], and the returned ``past`` holds P+N positions. ``past`` is whatever the
  model keeps: nested tuples or lists of tensors whose axis -2 is the position (the per-layer
  ``(key, value)`` form of GPT-2 and nanoGPT-style models), or an object with ``crop(n)``
  (transformers' ``DynamicCache``). Rejected drafts are dropped by cropping it to n positions.

A model may return an object with a ``logits`` attribute instead of the tensor (transformers'
outputs). Logits of any floating dtype come back as float32 numpy arrays.

The backend holds one sequence (n_seq = 1). It has no tokenizer, no text and no chat
template: :meth:`specdecode.api.Decoder.generate_ids` takes and gives code ids, and refuses
text-only options (stop strings, messages, grammars) by name. ``codebook`` names the code
vocabulary: a draft model must have the target's codebook name and size
(:func:`specdecode.backends.vocab.check_vocab_compatible`).

Dimension letters: L = positions in the sequence, N = new codes in one forward, M = logit
rows requested, V = codebook size.
"""

from __future__ import annotations

import hashlib
from typing import Any, Iterable, Sequence

import numpy as np

from ..errors import SpecDecodeError
from .base import BackendBase

# Elements of each parameter hashed into the cost key (strided over the tensor): enough to
# tell two trainings of one architecture apart without reading a large model's every weight.
FINGERPRINT_ELEMENTS = 4096


def _import_torch():
    try:
        import torch
    except ImportError:
        raise SpecDecodeError("ModuleBackend wraps a PyTorch model: pip install 'specdecode[torch]'") from None
    return torch


def crop_past(past: Any, n: int) -> Any:
    """The cache ``past`` cut to its first n positions: None for n = 0; ``past.crop(n)`` for a
    cache object that has it (transformers' DynamicCache, cropped in place); else nested
    tuples / lists of tensors sliced on axis -2 (per-layer ``(key, value)`` pairs [B, H, L, D])."""
    if n == 0 or past is None:
        return None
    if hasattr(past, "crop"):
        past.crop(n)
        return past
    if isinstance(past, (tuple, list)):
        return type(past)(crop_past(p, n) for p in past)
    if hasattr(past, "shape"):
        return past[..., :n, :]
    raise SpecDecodeError(f"the model's cache is a {type(past).__name__}: expected tensors [..., L, D] in tuples "
                          f"or lists, or an object with crop(n)")


def past_length(past: Any) -> int | None:
    """Positions a cache holds, where it says (its first tensor's axis -2, or get_seq_length())."""
    if past is None:
        return 0
    if hasattr(past, "get_seq_length"):
        return int(past.get_seq_length())
    while isinstance(past, (tuple, list)) and past:
        past = past[0]
    return int(past.shape[-2]) if hasattr(past, "shape") and len(past.shape) >= 2 else None


class ModuleBackend(BackendBase):
    """A ``torch.nn.Module`` over a codebook of ``n_vocab`` codes (see the module docstring
    for how it is called).

    model: the module (put in eval mode; its device is where its first parameter lives).
    n_vocab: V, the codebook size (the logits' last axis must be V). eog_ids: codes that end
    a generation (none: only max_tokens ends it). n_ctx: the most positions a sequence may
    hold (a model with learned positions has a maximum). kv_cache: the model keeps a cache
    (fast) or recomputes the sequence each forward (slow). codebook: the code vocabulary's
    name, which a draft model must share. name: for messages and statistics.
    n_threads: torch's CPU threads (None: torch's default).

    Raises SpecDecodeError naming the value for a model that is not a Module, V < 2, an end
    id outside 0..V-1 or n_ctx < 2; and at a forward for logits of the wrong shape or a cache
    that does not hold the positions fed.
    """

    has_text = False

    def __init__(self, model, n_vocab: int, eog_ids: Iterable[int] = (), n_ctx: int = 4096, kv_cache: bool = False,
                 codebook: str = "codes", name: str | None = None, n_threads: int | None = None) -> None:
        torch = _import_torch()
        self._torch = torch
        if not isinstance(model, torch.nn.Module):
            raise SpecDecodeError(f"model must be a torch.nn.Module, got {type(model).__name__}", param="model")
        for label, v, lo in (("n_vocab", n_vocab, 2), ("n_ctx", n_ctx, 2)):
            if not isinstance(v, int) or isinstance(v, bool) or v < lo:
                raise SpecDecodeError(f"{label} = {v!r} is out of range: expected an integer >= {lo}", param=label)
        eog = frozenset(int(i) for i in eog_ids)
        bad = sorted(i for i in eog if not 0 <= i < n_vocab)
        if bad:
            raise SpecDecodeError(f"eog_ids {bad} are outside the codebook 0..{n_vocab - 1}", param="eog_ids")
        if not isinstance(codebook, str) or not codebook:
            raise SpecDecodeError(f"codebook must be a non-empty name, got {codebook!r}", param="codebook")
        if n_threads is not None:
            torch.set_num_threads(int(n_threads))
        self.model = model.eval()
        self.name = name or type(model).__name__
        self.codebook = codebook
        self.kv_cache = bool(kv_cache)
        self.n_threads = n_threads
        param = next(iter(model.parameters()), None)
        self.device = str(param.device) if param is not None else "cpu"
        self._n_vocab, self._n_ctx, self._eog = n_vocab, n_ctx, eog
        self._tokens: list[int] = []  # the sequence (kv_cache=False) or what the cache holds
        self._past: Any = None
        self._kv_len = 0

    # --- vocabulary: codes, not text ---------------------------------------------------
    def tokenize(self, text: str, add_special: bool = True, parse_special: bool = False) -> list[int]:
        raise SpecDecodeError(f"{self.name} is a model over codes: it has no tokenizer; give code ids "
                              f"(Decoder.generate_ids(prompt_ids))", param="prompt")

    def token_bytes(self, token_id: int) -> bytes:
        """b"": a code contributes no text (a generation's text is empty; its ids are the output)."""
        return b""

    def token_text(self, token_id: int) -> bytes:
        """``codebook:id``, which a draft model must match (the vocabulary check)."""
        return f"{self.codebook}:{int(token_id)}".encode()

    def apply_chat_template(self, messages: Sequence[dict], tools: Sequence[dict] | None = None) -> str:
        raise SpecDecodeError(f"{self.name} is a model over codes: it has no chat template; give code ids",
                              param="messages")

    @property
    def cost_key(self) -> str:
        """What a measured latency depends on: the module's class, its parameters' shapes and
        dtypes, and a strided sample of their values (two trainings differ), and the cache mode."""
        h = hashlib.sha256(f"{type(self.model).__module__}.{type(self.model).__qualname__}|{self.kv_cache}".encode())
        with self._torch.no_grad():
            for key, t in list(self.model.state_dict().items()):
                flat = t.detach().reshape(-1)
                step = max(1, flat.numel() // FINGERPRINT_ELEMENTS)
                h.update(f"{key}|{tuple(t.shape)}|{t.dtype}".encode())
                h.update(flat[::step].float().cpu().numpy().tobytes())
        return h.hexdigest()[:24]

    # --- evaluation ----------------------------------------------------------------------
    def forward(self, token_ids: Sequence[int], logits_for: Sequence[int], seq: int = 0) -> np.ndarray:
        """Append token_ids [N] and return logits [M, V] float32 of the rows logits_for [M].

        Raises ContextOverflowError when they do not fit n_ctx, SpecDecodeError for ids
        outside the codebook, logits of the wrong shape, or a cache of the wrong length."""
        self._check_seq(seq)
        tokens = [int(t) for t in token_ids]
        rows = self._check_forward(tokens, logits_for, seq)
        if not tokens:
            return np.zeros((0, self._n_vocab), dtype=np.float32)
        torch = self._torch
        start = self._kv_len
        with torch.inference_mode():
            if self.kv_cache:
                ids = torch.tensor([tokens], dtype=torch.long, device=self.device)
                out = self.model(ids, self._past)
                if not (isinstance(out, (tuple, list)) and len(out) == 2):
                    raise SpecDecodeError(f"{self.name} (kv_cache=True) must return (logits, past), got "
                                          f"{type(out).__name__}")
                logits, past = out
                have = past_length(past)
                if have is not None and have != start + len(tokens):
                    raise SpecDecodeError(f"{self.name} returned a cache of {have} positions after "
                                          f"{start} + {len(tokens)} codes")
                offset = 0
            else:
                ids = torch.tensor([self._tokens + tokens], dtype=torch.long, device=self.device)
                logits, past, offset = self.model(ids), None, start
            logits = self._checked(getattr(logits, "logits", logits), offset + len(tokens))
            picked = logits[0, [offset + r for r in rows]].float().cpu().numpy() if rows else \
                np.zeros((0, self._n_vocab), dtype=np.float32)
        self._past = past
        self._tokens += tokens
        self._kv_len = start + len(tokens)
        return picked

    def _checked(self, logits, n: int):
        shape = tuple(getattr(logits, "shape", ()))
        if shape != (1, n, self._n_vocab):
            raise SpecDecodeError(f"{self.name} returned logits of shape {shape}: expected (1, {n}, {self._n_vocab}) "
                                  f"(batch 1, one row per code fed, V = n_vocab)")
        return logits

    def rollback(self, n: int, seq: int = 0) -> None:
        """Drop positions >= n: the code list is cut, and the model's cache cropped (:func:`crop_past`)."""
        self._check_seq(seq)
        if self._check_rollback(n, seq):
            if self.kv_cache:
                self._past = crop_past(self._past, n)
            del self._tokens[n:]
            self._kv_len = n

    def close(self) -> None:
        self._past = None
        self._tokens = []
        self._kv_len = 0
