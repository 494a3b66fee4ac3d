"""What the PyTorch backend needs before a model runs: torch and transformers imported on first
use (:func:`import_torch`), the device resolved (:func:`resolve_device`), a GGUF file
dequantized by transformers (:func:`gguf_dequantize_config`), and a KV cache of n_ctx
positions that rolls back by moving its length (:func:`prefix_static_cache`)."""

from __future__ import annotations

from pathlib import Path

from ...errors import SpecDecodeError
from ...limits import DEVICES

def import_torch():
    try:
        import torch
        import transformers
    except ImportError as e:
        raise SpecDecodeError(
            f"the torch backend needs PyTorch and transformers ({e.name} is not installed): "
            f"pip install 'specdecode[torch]'"
        ) from None
    return torch, transformers


def resolve_device(device: str) -> str:
    """'cpu', 'cuda' or 'auto' (cuda when available). Raises SpecDecodeError if cuda is absent."""
    torch, _ = import_torch()
    if device not in DEVICES:
        raise SpecDecodeError(f"device {device!r} is not one of {', '.join(DEVICES)}")
    if device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cuda" and not torch.cuda.is_available():
        raise SpecDecodeError("device 'cuda' was asked for but PyTorch sees no CUDA GPU")
    return device


def gguf_dequantize_config(path: Path):
    """transformers config that unpacks every GGUF weight into a dense tensor at load time
    (newer transformers otherwise keep GGUF blocks packed behind custom kernels)."""
    _, transformers = import_torch()
    cfg = getattr(transformers, "GgufConfig", None)
    return cfg(gguf_file=str(path), dequantize=True) if cfg is not None else None


def prefix_static_cache(transformers, config, n_ctx: int):
    """A StaticCache whose full-attention layers attend only to the filled prefix.

    transformers' StaticLayer returns (and masks) all n_ctx slots every step, so attention
    costs O(n_ctx) however short the text. Here each layer keeps a Python-int length (no
    device sync), returns views of the first length slots, and sizes the mask to match.
    Storage stays preallocated; rollback still only moves the length (crop).
    """
    from transformers.cache_utils import StaticLayer

    class PrefixStaticLayer(StaticLayer):
        def __init__(self, max_cache_len: int) -> None:
            super().__init__(max_cache_len=max_cache_len)
            self.length = 0

        def get_mask_sizes(self, query_length, *args, **kwargs) -> tuple[int, int]:
            n = query_length if isinstance(query_length, int) else int(query_length.shape[-1])
            return self.length + n, 0

        def update(self, key_states, value_states, *args, **kwargs):
            keys, values = super().update(key_states, value_states, *args, **kwargs)
            self.length += key_states.shape[-2]
            return keys[:, :, : self.length], values[:, :, : self.length]

        def crop(self, tokens_to_remove: int) -> None:
            super().crop(tokens_to_remove)
            self.length -= abs(tokens_to_remove)

    cache = transformers.StaticCache(config=config, max_cache_len=n_ctx)
    cache.layers = [PrefixStaticLayer(n_ctx) if type(layer) is StaticLayer else layer for layer in cache.layers]
    return cache
