"""Model backends: llama.cpp (GGUF) and, later, PyTorch."""

from .base import Backend

__all__ = ["Backend"]
