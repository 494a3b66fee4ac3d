"""Tiny llama-architecture GGUF models written with the ``gguf`` library (llama.cpp's gguf-py),
for tests that need real model files with a chosen vocabulary.

The tokenizer is GPT-2 style byte-level BPE (``tokenizer.ggml.model = "gpt2"``): ids 0..255
are the 256 bytes (in GPT-2's printable form), then merges learnt from a small corpus, then
``<|endoftext|>`` (CONTROL, the end-of-generation token). A padded vocabulary appends
``[PAD{i}]`` tokens of type UNUSED, as llama.cpp's convert_hf_to_gguf.py writes the padding
of Qwen2.5 7B and up (152,064 ids over a 151,936-id tokenizer).

Weights are random float32 (fixed seeds), shapes as gguf-py names them: token_embd.weight,
blk.N.{attn_norm, attn_q, attn_k, attn_v, attn_output, ffn_norm, ffn_gate, ffn_up,
ffn_down}.weight, output_norm.weight, output.weight.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

CORPUS = (
    "the quick brown fox jumps over the lazy dog. the dog sleeps and the fox runs. "
    "speculative decoding drafts tokens and the target verifies them in one pass. "
    "def add(a, b):\n    return a + b\n"
) * 4

N_EMBD, N_HEAD, N_HEAD_KV, N_FF, N_LAYER, N_CTX_TRAIN = 32, 4, 2, 64, 2, 512


def byte_chars() -> list[str]:
    """GPT-2's bytes_to_unicode: the printable character standing for each byte, in byte order."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    table = dict(zip(bs, cs))
    return [chr(table[b]) for b in range(256)]


def learn_bpe(n_merges: int) -> tuple[list[str], list[str]]:
    """(tokens, merges): the 256 byte tokens then n_merges merged tokens, learnt greedily on CORPUS."""
    chars = byte_chars()
    words = Counter()
    for i, w in enumerate(CORPUS.split(" ")):
        text = (" " if i else "") + w
        words[tuple(chars[b] for b in text.encode())] += 1
    tokens, merges = list(chars), []
    for _ in range(n_merges):
        pairs = Counter()
        for w, c in words.items():
            for a, b in zip(w, w[1:]):
                pairs[a, b] += c
        (a, b), _ = max(pairs.items(), key=lambda kv: (kv[1], kv[0]))
        merges.append(f"{a} {b}")
        tokens.append(a + b)
        new = Counter()
        for w, c in words.items():
            out, i = [], 0
            while i < len(w):
                if i + 1 < len(w) and (w[i], w[i + 1]) == (a, b):
                    out.append(a + b)
                    i += 2
                else:
                    out.append(w[i])
                    i += 1
            new[tuple(out)] += c
        words = new
    return tokens, merges


@dataclass
class TinyVocab:
    tokens: list[str]
    types: list[int]
    merges: list[str]
    eos: int

    @property
    def n(self) -> int:
        return len(self.tokens)


def base_vocab(n_merges: int = 43) -> TinyVocab:
    """256 bytes + n_merges merges + <|endoftext|> (300 ids by default)."""
    import gguf

    tokens, merges = learn_bpe(n_merges)
    types = [int(gguf.TokenType.NORMAL)] * len(tokens)
    tokens.append("<|endoftext|>")
    types.append(int(gguf.TokenType.CONTROL))
    return TinyVocab(tokens, types, merges, eos=len(tokens) - 1)


def padded(vocab: TinyVocab, extra: int) -> TinyVocab:
    """vocab with ``extra`` padding ids [PAD{i}] (UNUSED) appended."""
    import gguf

    n = vocab.n
    return TinyVocab(vocab.tokens + [f"[PAD{i}]" for i in range(n, n + extra)],
                     vocab.types + [int(gguf.TokenType.UNUSED)] * extra, vocab.merges, vocab.eos)


@dataclass
class TinyWeights:
    """Random weights for a vocabulary of ``n_vocab`` ids: name -> float32 array (numpy shape
    [rows, cols]; gguf stores the reverse order)."""

    tensors: dict[str, np.ndarray] = field(default_factory=dict)

    @classmethod
    def random(cls, n_vocab: int, seed: int, head_scale: float = 1.0) -> "TinyWeights":
        rng = np.random.default_rng(seed)
        kv = N_EMBD // N_HEAD * N_HEAD_KV

        def mat(rows: int, cols: int, scale: float = 1.0) -> np.ndarray:
            return (rng.standard_normal((rows, cols)) * scale / np.sqrt(cols)).astype(np.float32)

        t = {"token_embd.weight": (rng.standard_normal((n_vocab, N_EMBD))).astype(np.float32)}
        for i in range(N_LAYER):
            t[f"blk.{i}.attn_norm.weight"] = np.ones(N_EMBD, np.float32)
            t[f"blk.{i}.attn_q.weight"] = mat(N_EMBD, N_EMBD)
            t[f"blk.{i}.attn_k.weight"] = mat(kv, N_EMBD)
            t[f"blk.{i}.attn_v.weight"] = mat(kv, N_EMBD)
            t[f"blk.{i}.attn_output.weight"] = mat(N_EMBD, N_EMBD)
            t[f"blk.{i}.ffn_norm.weight"] = np.ones(N_EMBD, np.float32)
            t[f"blk.{i}.ffn_gate.weight"] = mat(N_FF, N_EMBD)
            t[f"blk.{i}.ffn_up.weight"] = mat(N_FF, N_EMBD)
            t[f"blk.{i}.ffn_down.weight"] = mat(N_EMBD, N_FF)
        t["output_norm.weight"] = np.ones(N_EMBD, np.float32)
        # Scaled so that logits are peaked: clear argmaxes, no near-ties for batched numerics to flip.
        t["output.weight"] = (rng.standard_normal((n_vocab, N_EMBD)) * head_scale).astype(np.float32)
        return cls(t)

    def copy(self) -> "TinyWeights":
        return TinyWeights({k: v.copy() for k, v in self.tensors.items()})

    def noisy_head(self, seed: int, scale: float) -> "TinyWeights":
        """A copy with noise on the output head: a draft that mostly agrees with this model."""
        out = self.copy()
        rng = np.random.default_rng(seed)
        w = out.tensors["output.weight"]
        w += (rng.standard_normal(w.shape) * scale * w.std()).astype(np.float32)
        return out

    def resized(self, n_vocab: int, seed: int, pad_head: str = "zero") -> "TinyWeights":
        """The same model over n_vocab ids: rows cut, or rows appended for padding ids.

        pad_head: what the appended output rows are: "zero" (logit 0, a real padded
        checkpoint's unused rows), or "loud" (3x copies of real rows: the padding ids would
        win the argmax, so a drafter that does not mask them would propose them).
        """
        out = self.copy()
        rng = np.random.default_rng(seed)
        for name in ("token_embd.weight", "output.weight"):
            w = out.tensors[name]
            if n_vocab <= w.shape[0]:
                out.tensors[name] = w[:n_vocab].copy()
                continue
            extra = n_vocab - w.shape[0]
            if name == "token_embd.weight":
                rows = rng.standard_normal((extra, w.shape[1])).astype(np.float32)
            elif pad_head == "zero":
                rows = np.zeros((extra, w.shape[1]), np.float32)
            else:
                rows = 3.0 * w[rng.integers(0, w.shape[0], size=extra)]
            out.tensors[name] = np.concatenate([w, rows])
        return out


def write_gguf(path: Path, vocab: TinyVocab, weights: TinyWeights, name: str = "tiny") -> Path:
    """Write a llama-architecture GGUF of this vocabulary and these weights; returns path."""
    import gguf

    assert weights.tensors["output.weight"].shape[0] == vocab.n, "weights and vocabulary sizes differ"
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_name(name)
    w.add_context_length(N_CTX_TRAIN)
    w.add_embedding_length(N_EMBD)
    w.add_block_count(N_LAYER)
    w.add_feed_forward_length(N_FF)
    w.add_head_count(N_HEAD)
    w.add_head_count_kv(N_HEAD_KV)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_rope_dimension_count(N_EMBD // N_HEAD)
    w.add_vocab_size(vocab.n)
    w.add_file_type(0)  # all float32
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("default")
    w.add_token_list(vocab.tokens)
    w.add_token_types(vocab.types)
    w.add_token_merges(vocab.merges)
    w.add_bos_token_id(vocab.eos)
    w.add_eos_token_id(vocab.eos)
    w.add_add_bos_token(False)
    for tname, arr in weights.tensors.items():
        w.add_tensor(tname, arr)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path
