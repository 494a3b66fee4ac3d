"""Model backends: one loaded model behind the :class:`Backend` protocol (``base.py``, the
contract alone).

``llama_cpp/``: GGUF files through llama-cpp-python (CPU, and the GPU its build has).
``torch/``: Hugging Face causal LMs through transformers and PyTorch (CPU, CUDA, MPS);
torch is imported on demand, so that it is needed only when it is used. ``module.py``: a
user's own ``torch.nn.Module`` over codes. Beside them, what every engine shares: the
vocabulary checks, chat prompts, fill-in-the-middle, the context size, tree shapes, the
sharing of a loaded backend.
"""

from .base import Backend, BackendBase
from .sharing import common_prefix_len

__all__ = ["Backend", "BackendBase", "common_prefix_len"]
