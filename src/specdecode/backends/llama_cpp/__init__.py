"""llama.cpp: GGUF files through llama-cpp-python's low-level C API.

``backend.py`` the backend (:class:`LlamaCppBackend`); ``lib.py`` the library loaded once, its
log, flash attention, threads; ``devices.py`` the devices the build has (CPU, GPU) and
``offload.py`` how many layers go to a GPU (``--gpu-layers``); ``buffers.py`` where the weights
held on the CPU live (CPU_REPACK, AMX; ``probe.py`` the child process that tries AMX);
``ggml_ctypes.py`` what it asks of ggml through ctypes; ``vocab.py`` what the GGUF's vocabulary
says beyond its tokens; ``tree.py`` a tree of drafts verified in one forward; ``heads.py``
draft heads over the GGUF's output rows in numpy.
"""

from .backend import LlamaCppBackend

__all__ = ["LlamaCppBackend"]
