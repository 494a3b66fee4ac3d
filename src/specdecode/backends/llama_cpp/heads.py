"""Draft heads on a llama.cpp target: the output projection's rows read from the GGUF and
dequantized with the gguf package, and the residual heads run over them in numpy (the target's
hidden states come from :meth:`specdecode.backends.llama_cpp.LlamaCppBackend.forward_batch_hidden`).

Dimension letters: S = tokens of the heads' vocabulary subset, H = hidden size, V = vocabulary.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from ...errors import SpecDecodeError
from ..residual_heads import residual_heads


def _silu(x: np.ndarray) -> np.ndarray:
    return x / (1.0 + np.exp(-x))


def output_rows(path: str | Path, ids: np.ndarray) -> tuple[np.ndarray, np.ndarray | None]:
    """The output projection's rows for the token ids [S] of a GGUF file, dequantized
    (output.weight, or the tied token_embd.weight): w_out [S, H] float32, and the output
    bias b_out [S] float32 where the file has one (output.bias), else None. Read with the
    gguf package. Raises SpecDecodeError when the file has no output projection."""
    from gguf import GGUFReader
    from gguf.quants import dequantize

    tensors = {t.name: t for t in GGUFReader(str(path)).tensors}
    t = tensors.get("output.weight") or tensors.get("token_embd.weight")
    if t is None:
        raise SpecDecodeError(f"{path} has no output.weight or token_embd.weight for draft heads")

    def rows(t) -> np.ndarray:
        return np.ascontiguousarray(dequantize(np.asarray(t.data)[ids], t.tensor_type).reshape(len(ids), -1),
                                    dtype=np.float32)

    bias = tensors.get("output.bias") if t.name == "output.weight" else None
    return rows(t), rows(bias).reshape(len(ids)) if bias is not None else None


def numpy_heads(path: str | Path, n_vocab: int, weight: np.ndarray, bias: np.ndarray, vocab_subset: np.ndarray):
    """Residual heads (:func:`residual_heads`) in numpy over the output projection's rows of a
    GGUF file for vocab_subset [S] (and its bias, where the model has one), dequantized once:
    f(h [H], k) -> logits [k, V] float32 (V = n_vocab), -inf outside the subset."""
    ids = np.asarray(vocab_subset, dtype=np.int64)
    w_out, b_out = output_rows(path, ids)
    W, b = weight.astype(np.float32), bias.astype(np.float32)

    def run(h: np.ndarray, k: int) -> np.ndarray:
        logits = np.full((k, n_vocab), -np.inf, dtype=np.float32)
        logits[:, ids] = residual_heads(h, W[:k], b[:k], w_out, b_out, np.einsum, _silu)
        return logits

    return run
