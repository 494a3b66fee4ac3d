"""PyTorch backend: any Hugging Face causal LM (transformers' AutoModelForCausalLM), CPU or CUDA.

KV cache: a transformers StaticCache preallocated for n_ctx positions. Forward passes
give explicit ``cache_position``s and a mask of the kv_len + N valid positions, so the
causal mask hides every slot beyond the query's own position; rolling back is O(1):
only the cache's length moves (no tensor is copied) and stale slots are overwritten by
the next forward.

Dimension letters: N = tokens in one forward, M = requested logit rows, V = vocabulary.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Collection, Sequence

import numpy as np

from ...errors import ModelFileError, SpecDecodeError
from ...limits import DTYPES
from ..base import BackendBase, HiddenRows, Placement, SeqForward
from ..residual_heads import residual_heads
from ..context import torch_context
from ..fim import FimTokens
from .runtime import gguf_dequantize_config, import_torch, prefix_static_cache, resolve_device

_BYTE_TOKEN = re.compile(r"^<0x([0-9A-Fa-f]{2})>$")


class TorchBackend(BackendBase):
    """A Hugging Face causal LM with a preallocated single-sequence KV cache (n_seq = 1: one
    generation at a time; concurrent generations need the llama.cpp backend).

    Build with :meth:`load` (a Hugging Face folder or a GGUF file, dequantized by
    transformers) or directly from a model and tokenizer already in memory.
    model: a transformers causal LM. tokenizer: its tokenizer (needed for text; without
    one, token i renders as "<i>"). n_ctx: positions preallocated in the cache (None: what the
    model was trained for within the memory available, :func:`.context.torch_context`).
    """

    supports_greedy_draft = True
    supports_hidden_states = True

    def __init__(self, model, tokenizer=None, n_ctx: int | None = None, name: str = "torch-model") -> None:
        torch, transformers = import_torch()
        self._torch = torch
        self.model = model.eval()
        self.tokenizer = tokenizer
        # A fast (Rust) tokenizer encodes from any thread (encode borrows it immutably).
        self.thread_safe_tokenizer = bool(getattr(tokenizer, "is_fast", False))
        self.name = name
        self.context = torch_context(n_ctx, model.config, getattr(model.dtype, "itemsize", 4), name)  # why this n_ctx
        n_ctx = self.context.n_ctx
        if n_ctx < 2:
            raise SpecDecodeError(f"n_ctx = {n_ctx} is out of range: expected n_ctx >= 2")
        self._n_ctx = n_ctx
        self.device = next(model.parameters()).device
        self._cache = prefix_static_cache(transformers, model.config, n_ctx)
        self._kv_len = 0
        self._ones = torch.ones(1, n_ctx, dtype=torch.long, device=self.device)
        self._n_vocab = int(model.get_output_embeddings().weight.shape[0])
        self.fim_tokens = FimTokens.from_texts(self._token_id) if tokenizer is not None else None
        self._eog = self._find_eog() | (self.fim_tokens.end_ids if self.fim_tokens else frozenset())
        self._byte_decoder = self._make_byte_decoder()
        self._special_ids = self._find_special_ids()
        self._piece_cache: dict[int, bytes] = {}
        self._subset: tuple | None = None  # (ids [S] long, weight rows [S, H], bias [S] or None)

    @classmethod
    def load(cls, path: str | Path, dtype: str = "float32", device: str = "cpu", n_ctx: int | None = None,
             name: str | None = None) -> "TorchBackend":
        """Load a Hugging Face folder, or a .gguf file through transformers' GGUF support.

        dtype: float32, bfloat16 or float16. device: cpu, cuda or auto.
        Raises ModelFileError when the files are missing or unreadable, SpecDecodeError
        on bad options.
        """
        torch, transformers = import_torch()
        if dtype not in DTYPES:
            raise SpecDecodeError(f"dtype {dtype!r} is not one of {', '.join(DTYPES)}", param="dtype")
        dev = resolve_device(device)
        path = Path(path).expanduser()
        if not path.exists():
            raise ModelFileError(f"model path {path} does not exist")
        kwargs: dict = {}
        folder = path
        if path.is_file():
            if path.suffix.lower() != ".gguf":
                raise ModelFileError(f"model file {path} is neither a Hugging Face folder nor a .gguf file")
            folder, kwargs["gguf_file"] = path.parent, path.name
            kwargs["quantization_config"] = gguf_dequantize_config(path)
        elif not (path / "config.json").exists():
            raise ModelFileError(f"model folder {path} has no config.json: not a Hugging Face model folder")
        try:
            tok = transformers.AutoTokenizer.from_pretrained(folder, gguf_file=kwargs.get("gguf_file"))
            model = transformers.AutoModelForCausalLM.from_pretrained(
                folder, dtype=getattr(torch, dtype), **kwargs
            )
        except (OSError, ValueError, KeyError, RuntimeError) as e:
            raise ModelFileError(f"transformers could not load {path}: {str(e).splitlines()[0]}") from None
        model.to(dev)
        backend = cls(model, tok, n_ctx=n_ctx, name=name or path.name)
        backend.path = path  # the GGUF file or the folder (the model's identity, e.g. for draft heads)
        return backend

    # --- vocabulary ---------------------------------------------------------------
    def _find_eog(self) -> frozenset[int]:
        ids: set[int] = set()
        gen = getattr(self.model, "generation_config", None)
        for src in (getattr(gen, "eos_token_id", None), getattr(self.model.config, "eos_token_id", None)):
            if isinstance(src, int):
                ids.add(src)
            elif src:
                ids.update(int(t) for t in src)
        tok = self.tokenizer
        if tok is not None:
            if tok.eos_token_id is not None:
                ids.add(int(tok.eos_token_id))
            ids.update(t for text in ("<|im_end|>", "<|endoftext|>", "<|eot_id|>", "<|end|>", "<end_of_turn>")
                       if (t := self._token_id(text)) is not None)
        return frozenset(i for i in ids if 0 <= i < self._n_vocab)

    def _token_id(self, text: str) -> int | None:
        """The id of the vocabulary entry whose text is exactly ``text``, None without one."""
        tid = self.tokenizer.convert_tokens_to_ids(text)
        ok = isinstance(tid, int) and 0 <= tid < self._n_vocab and self.tokenizer.convert_ids_to_tokens(tid) == text
        return tid if ok else None

    def _find_special_ids(self) -> frozenset[int]:
        """Control tokens, which render as no text (as llama.cpp renders them)."""
        tok = self.tokenizer
        if tok is None:
            return frozenset()
        ids = set(tok.all_special_ids)
        for tid, added in getattr(tok, "added_tokens_decoder", {}).items():
            if getattr(added, "special", False):
                ids.add(int(tid))
        return frozenset(ids)

    def _make_byte_decoder(self) -> dict[str, int] | None:
        tok = self.tokenizer
        backend = getattr(tok, "backend_tokenizer", None) or getattr(tok, "_tokenizer", None)
        decoder = getattr(backend, "decoder", None)
        if decoder is not None and "ByteLevel" in repr(decoder):
            from transformers.convert_slow_tokenizer import bytes_to_unicode

            return {c: b for b, c in bytes_to_unicode().items()}
        return None

    def tokenize(self, text: str, add_special: bool = True, parse_special: bool = False) -> list[int]:
        if self.tokenizer is None:
            raise SpecDecodeError(f"{self.name} has no tokenizer: pass token ids")
        # split_special_tokens: without special parsing a special token's text is text, as on llama.cpp
        return list(self.tokenizer(text, add_special_tokens=add_special,
                                   split_special_tokens=not parse_special)["input_ids"])

    @property
    def special_texts(self) -> frozenset[str]:
        """The texts of the tokenizer's special added tokens (those ``split_special_tokens``
        reads as text)."""
        if self.tokenizer is None:
            return frozenset()
        return frozenset(t.content for t in self.tokenizer.added_tokens_decoder.values() if t.special and t.content)

    def token_text(self, token_id: int) -> bytes:
        """The vocabulary entry as stored (byte-level form for BPE), b"" past the tokenizer."""
        if self.tokenizer is None:
            return f"<{token_id}>".encode()
        t = self.tokenizer.convert_ids_to_tokens(int(token_id))
        return t.encode("utf-8") if t is not None else b""

    def token_bytes(self, token_id: int) -> bytes:
        piece = self._piece_cache.get(token_id)
        if piece is not None:
            return piece
        tok = self.tokenizer
        if tok is None:
            piece = f"<{token_id}>".encode()
        else:
            t = tok.convert_ids_to_tokens(int(token_id))
            if t is None or int(token_id) in self._special_ids:
                piece = b""
            elif self._byte_decoder is not None and all(c in self._byte_decoder for c in t):
                piece = bytes(self._byte_decoder[c] for c in t)
            elif m := _BYTE_TOKEN.match(t):
                piece = bytes([int(m.group(1), 16)])
            else:
                piece = t.replace("\u2581", " ").encode("utf-8")
        self._piece_cache[token_id] = piece
        return piece

    @property
    def chat_template(self) -> str | None:
        """The tokenizer's chat template; several named ones (a dict) joined, so that what
        reads it (the server's choice of tool-call format) sees them all."""
        t = getattr(self.tokenizer, "chat_template", None)
        return "\n".join(str(v) for v in t.values()) if isinstance(t, dict) else t or None

    @property
    def eos_id(self) -> int | None:
        """The tokenizer's end-of-sequence token, None without one."""
        return getattr(self.tokenizer, "eos_token_id", None)

    def apply_chat_template(self, messages: Sequence[dict], tools: Sequence[dict] | None = None) -> str:
        tok = self.tokenizer
        if tok is None or not self.chat_template:
            raise SpecDecodeError(f"model {self.name} has no chat template; use a plain prompt instead")
        return tok.apply_chat_template(list(messages), tools=list(tools) if tools else None, tokenize=False,
                                       add_generation_prompt=True)

    @property
    def cost_key(self) -> str:
        """What besides name and device a measured latency depends on: weights and dtype."""
        p = next(self.model.parameters())
        return f"{getattr(self.model.config, '_name_or_path', '')}|{p.dtype}|{self.model.num_parameters()}"

    @property
    def placement(self) -> Placement:
        """The whole model on its torch device: "CPU", or "cuda:0" with the card's name."""
        layers = int(getattr(self.model.config, "num_hidden_layers", 0) or 0)
        if self.device.type == "cpu":
            return Placement(n_layers=layers)
        torch, _ = import_torch()
        name = torch.cuda.get_device_name(self.device) if self.device.type == "cuda" else ""
        return Placement(str(self.device), layers, layers, name, f"{self.name}: on {self.device} (--device)")

    # --- evaluation -------------------------------------------------------------------
    def supports_output_subset(self) -> bool:
        """Whether :meth:`set_output_subset` can apply: a decoder whose logits are exactly the
        output projection of its last hidden state (no logit scaling or soft-capping)."""
        cfg = self.model.config
        plain_head = all(not getattr(cfg, a, None) for a in ("final_logit_softcapping", "logit_scale",
                                                                 "output_multiplier_scale", "logits_scaling"))
        return plain_head and hasattr(self.model, "get_decoder") and self.model.get_output_embeddings() is not None

    def set_output_subset(self, ids: Sequence[int] | None) -> None:
        """Compute logits only for the token ids ``ids`` [S]; the others come back as -inf.

        A drafting technique (FR-Spec, Zhao et al. 2025: a draft model's output projection
        over a large vocabulary is a large part of its cost, and most drafts fall in a
        small set of tokens). The target never uses it: verification needs the full
        distribution. None restores the full vocabulary. Raises SpecDecodeError when the
        model's head does not allow it (see :meth:`supports_output_subset`) or for ids
        outside the vocabulary.
        """
        torch = self._torch
        if ids is None:
            self._subset = None
            return
        if not self.supports_output_subset():
            raise SpecDecodeError(f"{self.name}: this model's output head cannot be restricted to a subset")
        idx = sorted(set(int(i) for i in ids))
        if not idx or idx[0] < 0 or idx[-1] >= self._n_vocab:
            raise SpecDecodeError(f"output subset must be non-empty ids in 0..{self._n_vocab - 1}")
        head = self.model.get_output_embeddings()
        with torch.inference_mode():
            t = torch.tensor(idx, dtype=torch.long, device=self.device)
            w = head.weight.index_select(0, t).contiguous()
            b = head.bias.index_select(0, t) if getattr(head, "bias", None) is not None else None
        self._subset = (t, w, b)

    def forward(self, token_ids: Sequence[int], logits_for: Sequence[int], seq: int = 0) -> np.ndarray:
        """Append token_ids [N] at positions kv_len.. and return logits [M, V] float32 on the host.

        seq: 0, the one sequence this backend holds (n_seq is 1: it serves one generation
        at a time; :meth:`forward_batch` of more than one sequence raises SpecDecodeError).
        Raises ContextOverflowError when the tokens do not fit in n_ctx.
        """
        return self._forward(token_ids, logits_for, seq, hidden=False)[0]

    def forward_batch_hidden(self, items: Sequence[SeqForward],
                             hidden_for: Collection[int]) -> tuple[list[np.ndarray], dict[int, HiddenRows]]:
        """:meth:`forward_batch` (one sequence), also returning the hidden states [M, H] (a
        device tensor in the model's dtype) of its logit rows when its seq is in hidden_for:
        the logits are then computed from those rows as the model's own forward does
        (decoder, then the output projection)."""
        return self._one_sequence_hidden(items, hidden_for)

    def _forward(self, token_ids: Sequence[int], logits_for: Sequence[int], seq: int,
                 hidden: bool) -> tuple[np.ndarray, HiddenRows | None]:
        """:meth:`forward`, and with hidden the hidden rows of the logit rows."""
        torch = self._torch
        tokens = [int(t) for t in token_ids]
        n = len(tokens)
        want = self._check_forward(tokens, logits_for, seq)
        empty = np.zeros((0, self._n_vocab), dtype=np.float32)
        if n == 0:
            return empty, HiddenRows([], None) if hidden else None
        dev, start = self.device, self._kv_len
        with torch.inference_mode():
            logits, h = self._logits(torch.tensor([tokens], dtype=torch.long, device=dev),
                                     torch.tensor(want if want else [n - 1], dtype=torch.long, device=dev), hidden)
            rows = HiddenRows([start + j for j in want], h[: len(want)]) if hidden else None
            return (logits.float().cpu().numpy() if want else empty), rows

    def _logits(self, ids, keep, hidden: bool = False):
        """One forward of ids [1, N] (a device tensor) at positions kv_len..; returns the
        logits rows ``keep`` [M] as a device tensor [M, V] (-inf outside an output subset)
        and, with hidden, the final hidden states of those rows [M, H] (else None)."""
        torch = self._torch
        n = int(ids.shape[1])
        pos = torch.arange(self._kv_len, self._kv_len + n, device=self.device)
        kwargs = dict(
            input_ids=ids,
            position_ids=pos[None],
            cache_position=pos,
            # Without an explicit mask, transformers skips masking for one-token queries
            # and would attend to stale or empty slots of the static cache.
            attention_mask=self._ones[:, : self._kv_len + n],
            cache=self._cache,
            use_cache=True,
        )
        h = None
        if self._subset is None and not hidden:
            logits = self.model(**kwargs, logits_to_keep=keep).logits[0]
        else:  # the same computation as the model's own forward, keeping the hidden rows
            h = self.model.get_decoder()(**kwargs).last_hidden_state[0, keep]  # [M, H]
            if self._subset is None:
                logits = self.model.get_output_embeddings()(h)
            else:
                sub_ids, w, b = self._subset
                logits = torch.full((len(keep), self._n_vocab), float("-inf"), device=self.device)
                logits[:, sub_ids] = torch.nn.functional.linear(h, w, b).float()
        self._kv_len += n
        return logits, (h if hidden else None)

    # --- hidden states, for draft heads --------------------------------------------------
    @property
    def hidden_size(self) -> int:
        return int(self.model.get_output_embeddings().weight.shape[1])

    def parameters(self):
        """(name, tensor) of every weight (the identity of a model built in memory)."""
        return self.model.named_parameters()

    def make_heads(self, weight: np.ndarray, bias: np.ndarray, vocab_subset: np.ndarray):
        """Residual heads (:func:`residual_heads`) on the device in the model's dtype:
        f(h [H], k) -> logits [k, V] float32 on the host, -inf outside vocab_subset."""
        torch = self._torch
        head = self.model.get_output_embeddings()
        dtype = head.weight.dtype
        W = torch.tensor(weight, dtype=dtype, device=self.device)  # [K, H, H]
        b = torch.tensor(bias, dtype=dtype, device=self.device)  # [K, H]
        ids = torch.tensor(vocab_subset, dtype=torch.long, device=self.device)
        w_out = head.weight.index_select(0, ids)  # [S, H]
        b_out = head.bias.index_select(0, ids) if getattr(head, "bias", None) is not None else None
        V = self._n_vocab

        def run(h, k: int) -> np.ndarray:
            with torch.inference_mode():
                logits = torch.full((k, V), float("-inf"), dtype=torch.float32, device=self.device)
                logits[:, ids] = residual_heads(h, W[:k], b[:k], w_out, b_out, torch.einsum,
                                                torch.nn.functional.silu).float()
                return logits.cpu().numpy()

        return run

    def greedy_draft(self, token_ids: Sequence[int], k: int) -> list[int]:
        """Append token_ids [N >= 1], then draft k >= 1 tokens greedily on the device.

        Same result as forward(token_ids) followed by k - 1 one-token forwards of each argmax
        (the last drafted token is not fed: kv_len grows by N + k - 1), but the drafted ids
        stay on the device until the end: one host synchronization for the whole draft
        instead of one per token (on CUDA), and no V-sized rows copied to the host.
        Raises ContextOverflowError when N + k - 1 tokens do not fit.
        """
        torch = self._torch
        tokens = [int(t) for t in token_ids]
        if not tokens or k < 1:
            raise ValueError(f"greedy_draft needs at least one token and k >= 1 (got {len(tokens)}, {k})")
        self._check_forward(tokens + [0] * (k - 1), [])
        last = torch.tensor([0], dtype=torch.long, device=self.device)
        with torch.inference_mode():
            nxt = self._logits(torch.tensor([tokens], dtype=torch.long, device=self.device),
                               last + len(tokens) - 1)[0][0].argmax()
            drafted = [nxt]
            for _ in range(k - 1):
                nxt = self._logits(nxt.view(1, 1), last)[0][0].argmax()
                drafted.append(nxt)
            return [int(t) for t in torch.stack(drafted).tolist()]

    supports_tree = supports_tree_draft = True

    def forward_tree(self, token_ids: Sequence[int], parents: Sequence[int], seq: int = 0, hidden: bool = False):
        """A tree block (:mod:`specdecode.trees.torch_forward`): root and nodes [N] appended; (logits [N, V] of
        every row, their hidden states [N, H] with hidden, else None)."""
        from .tree import forward_tree
        self._check_seq(seq)
        if self._subset is not None:
            raise SpecDecodeError(f"{self.name}: tree verification needs the whole vocabulary (no output subset)")
        return forward_tree(self, token_ids, parents, hidden)

    def keep_tree_rows(self, rows: Sequence[int], n_rows: int, seq: int = 0) -> None:
        """Keep rows (ascending, root first) of the last tree block of n_rows; drop the others."""
        from .tree import keep_rows
        self._check_seq(seq)
        keep_rows(self, rows, n_rows)

    def forward_rows(self, token_ids: Sequence[int], positions: Sequence[int], visible, seq: int = 0):
        """Rows under an explicit mask (:func:`specdecode.trees.torch_forward.forward_rows`): logits [n, V]."""
        from .tree import forward_rows
        self._check_seq(seq)
        return forward_rows(self, token_ids, positions, visible)[0]  # the whole vocabulary

    def rollback(self, n: int, seq: int = 0) -> None:
        """Drop cached positions >= n: O(1), only the cache length moves (StaticCache.crop with a
        negative count), and the stale slots are masked and later overwritten. seq: 0."""
        if self._check_rollback(n, seq):
            self._cache.crop(n - self._kv_len)
            self._kv_len = n

    def close(self) -> None:
        self._cache = None
        self.model = None
