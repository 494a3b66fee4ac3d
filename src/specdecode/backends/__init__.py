"""Model backends: one loaded model behind the :class:`Backend` protocol.

``llama_cpp.LlamaCppBackend``: GGUF files through llama-cpp-python's low-level API (CPU).
``torch_backend.TorchBackend``: Hugging Face causal LMs through transformers and PyTorch
(CPU or CUDA); imported on demand, so that torch is needed only when it is used.
"""

from .base import Backend, BackendBase, common_prefix_len

__all__ = ["Backend", "BackendBase", "common_prefix_len"]
