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
from typing import Any, Collection, Iterable, Sequence

import numpy as np

from ..errors import SpecDecodeError
from ..limits import MAX_THREADS, is_index
from .base import BackendBase, HiddenRows, SeqForward
from .residual_heads import residual_heads

# Elements of each parameter hashed into the cost key (strided over the tensor): enough to
# tell two trainings of one architecture apart without reading a large model's every weight.
FINGERPRINT_ELEMENTS = 4096


def _code_set(ids, n_vocab: int, param: str = "eog_ids") -> frozenset[int]:
    """ids (integers in 0..n_vocab-1) as a set; SpecDecodeError naming param otherwise."""
    if isinstance(ids, (str, bytes)) or not isinstance(ids, Iterable):
        raise SpecDecodeError(f"{param} must be a list of code ids, got {ids!r:.60}", param=param)
    ids = list(ids)
    if not all(is_index(i) for i in ids):
        raise SpecDecodeError(f"{param} must hold integer code ids, got {ids!r:.60}", param=param)
    bad = sorted(int(i) for i in ids if not 0 <= i < n_vocab)
    if bad:
        raise SpecDecodeError(f"{param} {bad} are outside the codebook 0..{n_vocab - 1}", param=param)
    return frozenset(int(i) for i in ids)


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
    if hasattr(past, "crop"):
        return int(past.get_seq_length()) if hasattr(past, "get_seq_length") else None
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
    n_threads: torch's CPU threads (None: torch's default). output_head: the model's output
    layer (a ``torch.nn.Linear`` whose output is the logits, up to a constant mask), for draft
    heads (Medusa-1, :mod:`specdecode.drafters.heads`): the final hidden state of a row is the
    input that layer receives in the model's forward (read with a forward hook, so the model
    needs no change); trained with :func:`specdecode.heads.train.train_heads_on_ids`.

    Raises SpecDecodeError naming the value for a model that is not a Module, V < 2, an end
    id outside 0..V-1 or n_ctx < 2; and at a forward for logits of the wrong shape or a cache
    that does not hold the positions fed.
    """

    has_text = False

    def __init__(self, model, n_vocab: int, eog_ids: Iterable[int] = (), n_ctx: int = 4096, kv_cache: bool = False,
                 codebook: str = "codes", name: str | None = None, n_threads: int | None = None,
                 output_head=None) -> None:
        torch = _import_torch()
        self._torch = torch
        if not isinstance(model, torch.nn.Module):
            raise SpecDecodeError(f"model must be a torch.nn.Module, got {type(model).__name__}", param="model")
        for label, v, lo in (("n_vocab", n_vocab, 2), ("n_ctx", n_ctx, 2)):
            if not is_index(v) or v < lo:
                raise SpecDecodeError(f"{label} = {v!r} is out of range: expected an integer >= {lo}", param=label)
        n_vocab, n_ctx = int(n_vocab), int(n_ctx)
        eog = _code_set(eog_ids, n_vocab)
        if not isinstance(codebook, str) or not codebook:
            raise SpecDecodeError(f"codebook must be a non-empty name, got {codebook!r}", param="codebook")
        if not isinstance(kv_cache, bool):
            raise SpecDecodeError(f"kv_cache must be True or False, got {kv_cache!r}", param="kv_cache")
        if n_threads is not None and (not is_index(n_threads) or not 1 <= n_threads <= MAX_THREADS):
            raise SpecDecodeError(f"n_threads = {n_threads!r} is out of range: expected an integer 1..{MAX_THREADS} "
                                  "or None",
                                  param="n_threads")
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
        self.output_head, self._hook, self._seen = output_head, None, None
        if output_head is not None:
            if not isinstance(output_head, torch.nn.Linear) or output_head.out_features != n_vocab:
                raise SpecDecodeError(f"output_head must be the model's torch.nn.Linear output layer with n_vocab = "
                                      f"{n_vocab} outputs, got {output_head!r:.80}", param="output_head")
            self.supports_hidden_states = True

    def _watch(self) -> None:
        """The forward hook on output_head (registered while the backend is open; close removes it)."""
        if self.output_head is not None and self._hook is None:
            self._hook = self.output_head.register_forward_hook(self._see)

    def _see(self, module, inputs, output) -> None:
        self._seen = inputs[0]  # [1, N, H]: the final hidden states of the forward's rows

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
        return self._forward(token_ids, logits_for, seq, hidden=False)[0]

    def forward_batch_hidden(self, items: Sequence[SeqForward],
                             hidden_for: Collection[int]) -> tuple[list[np.ndarray], dict[int, HiddenRows]]:
        """:meth:`forward_batch` (one sequence), also returning the hidden states [M, H] (a
        tensor) of its logit rows when its seq is in hidden_for (needs output_head)."""
        if not self.supports_hidden_states:
            return super().forward_batch_hidden(items, hidden_for)  # raises, saying why
        return self._one_sequence_hidden(items, hidden_for)

    def _forward(self, token_ids: Sequence[int], logits_for: Sequence[int], seq: int,
                 hidden: bool) -> tuple[np.ndarray, HiddenRows | None]:
        self._check_seq(seq)
        tokens = [int(t) for t in token_ids]
        rows = self._check_forward(tokens, logits_for, seq)
        empty = np.zeros((0, self._n_vocab), dtype=np.float32)
        if not tokens:
            return empty, HiddenRows([], None) if hidden else None
        torch = self._torch
        start = self._kv_len
        self._seen = None
        if hidden:
            self._watch()
        with torch.inference_mode():
            if self.kv_cache:
                out = self._call(torch.tensor([tokens], dtype=torch.long, device=self.device), self._past)
                if not (isinstance(out, (tuple, list)) and len(out) == 2):
                    raise SpecDecodeError(f"{self.name} (kv_cache=True) must return (logits, past), got "
                                          f"{type(out).__name__}")
                logits, past = out
                have = past_length(past)
                if have is None:
                    raise SpecDecodeError(f"{self.name} returned a cache of type {type(past).__name__}: expected "
                                          f"tensors [..., L, D] in tuples or lists, or an object with crop(n) and "
                                          f"get_seq_length()")
                if have != start + len(tokens):
                    raise SpecDecodeError(f"{self.name} returned a cache of {have} positions after "
                                          f"{start} + {len(tokens)} codes")
                offset = 0
            else:
                ids = torch.tensor([self._tokens + tokens], dtype=torch.long, device=self.device)
                logits, past, offset = self.model(ids), None, start
            logits = self._checked(getattr(logits, "logits", logits), offset + len(tokens))
            at = [offset + r for r in rows]
            picked = self._finite(logits[0, at].float().cpu().numpy(), at) if rows else empty
            if hidden and (self._seen is None or tuple(self._seen.shape[:2]) != (1, offset + len(tokens))):
                raise SpecDecodeError(f"{self.name}: its output_head was not called once on the forward's "
                                      f"[1, {offset + len(tokens)}, H] hidden states")
            rows_h = HiddenRows([start + r for r in rows], self._seen[0, at]) if hidden else None
        self._past = past
        self._tokens += tokens
        self._kv_len = start + len(tokens)
        return picked, rows_h

    def _call(self, ids, past):
        """model(ids, past), saying so when the model takes no cache."""
        try:
            return self.model(ids, past)
        except TypeError as e:
            if "positional argument" not in str(e):
                raise
            raise SpecDecodeError(f"{self.name} was called as model(ids, past) because kv_cache=True, and refused: "
                                  f"{e} (a model called as model(ids) needs kv_cache=False)") from e

    def _checked(self, logits, n: int):
        if not isinstance(logits, self._torch.Tensor) or not logits.is_floating_point() or logits.is_meta:
            hint = " (a model that returns (logits, past) needs kv_cache=True)" if isinstance(logits, tuple) else ""
            raise SpecDecodeError(f"{self.name} returned {type(logits).__name__} "
                                  f"{getattr(logits, 'dtype', '')}: expected a floating-point torch tensor of logits"
                                  f"{hint}")
        shape = tuple(logits.shape)
        if shape != (1, n, self._n_vocab):
            raise SpecDecodeError(f"{self.name} returned logits of shape {shape}: expected (1, {n}, {self._n_vocab}) "
                                  f"(batch 1, one row per code fed, V = n_vocab)")
        return logits

    def _finite(self, rows: np.ndarray, at: Sequence[int]) -> np.ndarray:
        """rows [M, V], refused where a row has NaN or +inf, or no finite logit (-inf masks are fine)."""
        bad = ~np.isfinite(rows.max(axis=1))  # a NaN, a +inf, or -inf everywhere: one pass
        if bad.any():
            i = int(np.flatnonzero(bad)[0])
            raise SpecDecodeError(f"{self.name} returned non-finite logits at position {self._kv_len + at[i]} "
                                  f"(NaN, +inf, or -inf for every code): no distribution to decode from")
        return rows

    def rollback(self, n: int, seq: int = 0) -> None:
        """Drop positions >= n: the code list is cut, and the model's cache cropped (:func:`crop_past`)."""
        self._check_seq(seq)
        if self._check_rollback(n, seq):
            if self.kv_cache:
                self._past = crop_past(self._past, n)
            del self._tokens[n:]
            self._kv_len = n

    # --- draft heads (with output_head) ----------------------------------------------------
    @property
    def hidden_size(self) -> int:
        return int(self.output_head.in_features) if self.output_head is not None else 0

    def parameters(self):
        """(name, tensor) of every weight: the identity heads are tied to."""
        return self.model.named_parameters()

    def make_heads(self, weight: np.ndarray, bias: np.ndarray, vocab_subset: np.ndarray):
        """Residual heads (:func:`.base.residual_heads`) over the output head's rows of
        vocab_subset: f(h [H], k) -> logits [k, V] float32, -inf outside the subset."""
        if self.output_head is None:
            return super().make_heads(weight, bias, vocab_subset)  # raises
        torch, head = self._torch, self.output_head
        dtype, dev = head.weight.dtype, head.weight.device
        W, b = torch.tensor(weight, dtype=dtype, device=dev), torch.tensor(bias, dtype=dtype, device=dev)
        ids = torch.tensor(vocab_subset, dtype=torch.long, device=dev)
        w_out = head.weight.detach().index_select(0, ids)
        b_out = head.bias.detach().index_select(0, ids) if head.bias is not None else None

        def run(h, k: int) -> np.ndarray:
            with torch.inference_mode():
                logits = torch.full((k, self._n_vocab), float("-inf"), dtype=torch.float32, device=dev)
                logits[:, ids] = residual_heads(h.to(dtype), W[:k], b[:k], w_out, b_out, torch.einsum,
                                                torch.nn.functional.silu).float()
                return logits.cpu().numpy()

        return run

    def close(self) -> None:
        """Empty the cache and remove the hook on output_head; the backend may be used again."""
        if self._hook is not None:
            self._hook.remove()
            self._hook = None
        self._seen = None
        self._past = None
        self._tokens = []
        self._kv_len = 0
