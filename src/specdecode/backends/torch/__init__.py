"""PyTorch: Hugging Face causal LMs through transformers (CPU, CUDA or MPS).

``backend.py`` the backend (:class:`TorchBackend`); ``runtime.py`` torch imported on first use,
the device, a GGUF dequantized, the KV cache; ``tree.py`` a tree of drafts verified in one
forward, and a draft model's tree grown a depth at a time. torch itself is imported only when a
model loads, so that it is needed only where it is used.
"""

from .backend import TorchBackend

__all__ = ["TorchBackend"]
