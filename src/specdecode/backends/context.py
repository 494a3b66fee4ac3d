"""The context window a model is loaded with: by default what the model was trained for,
capped so that the KV caches fit in the memory the machine has.

An agent's first prompt (a system prompt, tool definitions, a repository's files) is several
thousand tokens, so a fixed default such as 4096 refuses it though the model was trained for
32768. llama.cpp and the torch backend allocate the whole KV cache at load (llama.cpp clears
its buffer, so every page is touched: 32768 tokens x 4 slots of Qwen2.5-Coder-1.5B raised the
resident memory by 3.5 GiB, as estimated below), so the default must also fit the machine.

The KV cache of one token is layers x KV heads x (key + value head dimension) x bytes per
element (llama.cpp keeps it in f16 by default: 2 bytes; the torch backend in the model's
dtype). A llama.cpp model with ``--parallel N`` holds N sequences of n_ctx cells each (one
buffer of n_ctx * N cells), and a draft model as many again of its own.

The default takes the trained context unless the caches would need more than
KV_MEMORY_FRACTION of the memory available at load; then it is the largest multiple of 256
tokens (llama.cpp pads its context to 256) that fits. An explicit context wins, but never
beyond the trained one (positions past it were never seen in training, and this package
configures no RoPE scaling): it is capped there, with a warning, as it is when its caches
need more memory than is available (then it is kept, and the warning says so).

Units: tokens for contexts, bytes for memory.
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..limits import DEFAULT_N_CTX, MIN_N_CTX

# The share of the available memory the default context's KV caches may take. MemAvailable
# counts the page cache, and the weights of the models just loaded sit in it (llama.cpp maps the
# GGUF; each forward reads those pages again), as do the compute buffers' later growth, the
# Python process and whatever else runs on the machine: half leaves room for all of them.
KV_MEMORY_FRACTION = 0.5
CONTEXT_PAD = 256  # llama.cpp rounds a context up to a multiple of this many tokens
LLAMA_KV_BYTES = 2  # llama.cpp's default KV type, f16
_MEMINFO = Path("/proc/meminfo")
_CGROUP = Path("/sys/fs/cgroup")


@dataclass(frozen=True)
class ContextChoice:
    """The context a model was loaded with (n_ctx, tokens per sequence) and why, as one line
    (``note``); ``warning``: the note is a warning (a context asked beyond what the model was
    trained for, or whose caches need more memory than is available)."""

    n_ctx: int
    note: str
    warning: bool = False


def _size(n: float) -> str:
    for unit, scale in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= scale:
            return f"{n / scale:.1f} {unit}"
    return f"{int(n)} bytes"


def choose_context(asked: int | None, trained: int, kv_bytes: int, slots: int, name: str,
                   available: int | None, reserve: float = 1.0,
                   fraction: float = KV_MEMORY_FRACTION, memory_label: str = "available") -> ContextChoice:
    """The context of a model ``name`` trained for ``trained`` tokens (0: unknown) whose KV cache
    takes kv_bytes a token, for ``slots`` sequences; ``asked``: the caller's context (None: the
    default). available: bytes of memory free now (None: unknown, no cap): the machine's, or a
    GPU's where the cache is there (memory_label then says so: "free on CUDA0"). reserve: the
    caches to fit, in units of this model's (2.0: room for a draft model's as large again)."""
    per_token = max(1, kv_bytes) * slots * reserve
    share = f"{_size(kv_bytes)} a token x {slots} slot{'s' if slots > 1 else ''}"
    if reserve > 1:
        share += f" x {reserve:g} for a draft model's"
    free = (f"{_size(available)} {memory_label}" if available is not None else
            "available memory unknown" if memory_label == "available" else f"memory {memory_label} unknown")
    if asked is not None:
        if trained > 0 and asked > trained:
            return ContextChoice(trained, f"context {trained} tokens: {asked} were asked, but {name} was trained "
                                          f"for {trained} (positions past it were never trained: capped)", True)
        if available is not None and asked * per_token > available:
            return ContextChoice(asked, f"context {asked} tokens as asked, but its KV caches ({share}) need "
                                        f"{_size(asked * per_token)}, more than the {free}", True)
        return ContextChoice(asked, f"context {asked} tokens: as asked")
    if trained <= 0:
        return ContextChoice(DEFAULT_N_CTX, f"context {DEFAULT_N_CTX} tokens: {name} does not say what context it "
                                            "was trained for")
    if available is None or trained * per_token <= available * fraction:
        return ContextChoice(trained, f"context {trained} tokens: what {name} was trained for (KV cache {share}: "
                                      f"{_size(trained * per_token)}; {free})")
    cap = int(available * fraction / per_token) // CONTEXT_PAD * CONTEXT_PAD
    n = min(trained, max(cap, MIN_N_CTX))
    return ContextChoice(n, f"context {n} tokens, capped by memory: {name} was trained for {trained}, but the KV "
                            f"cache ({share}) may take {fraction:.0%} of the {free}")


def _read_int(path: Path) -> int | None:
    try:
        return int(path.read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return None


def available_memory(meminfo: Path = _MEMINFO, cgroup: Path = _CGROUP) -> int | None:
    """Bytes this process may still allocate: MemAvailable of /proc/meminfo, lowered to the room
    left under a cgroup v2 memory limit (a container's: memory.max - memory.current); None where
    neither can be read (not Linux)."""
    free = None
    try:
        for line in meminfo.read_text().splitlines():
            if line.startswith("MemAvailable:"):
                free = int(line.split()[1]) * 1024  # kB
    except (OSError, ValueError, IndexError):
        pass
    limit, used = _read_int(cgroup / "memory.max"), _read_int(cgroup / "memory.current")  # "max": no limit
    if limit is not None and used is not None:
        free = max(0, limit - used) if free is None else min(free, max(0, limit - used))
    return free


def llama_kv_bytes(lib: Any, model: Any) -> int:
    """The f16 KV cache of one token of a loaded llama.cpp model, in bytes: layers x KV heads x
    (key + value head dimension) x 2. The head dimensions are the GGUF's
    ``<arch>.attention.key_length`` / ``value_length`` where given, else n_embd / n_head."""
    def meta(key: str) -> str | None:
        buf = ctypes.create_string_buffer(256)
        n = lib.llama_model_meta_val_str(model, key.encode(), buf, len(buf))
        return buf.value.decode("utf-8", "replace") if n >= 0 else None

    n_head = max(1, int(lib.llama_model_n_head(model)))
    fallback = int(lib.llama_model_n_embd(model)) // n_head
    arch = meta("general.architecture") or ""
    dims = []
    for key in ("key_length", "value_length"):
        value = meta(f"{arch}.attention.{key}")
        dims.append(int(value) if value and value.isdigit() else fallback)
    return int(lib.llama_model_n_layer(model)) * int(lib.llama_model_n_head_kv(model)) * sum(dims) * LLAMA_KV_BYTES


def torch_context(asked: int | None, config: Any, itemsize: int, name: str) -> ContextChoice:
    """:func:`choose_context` for a transformers model (one sequence) of ``config`` whose cache holds
    ``itemsize`` bytes an element: trained for max_position_embeddings (else unknown), a token's
    cache num_hidden_layers x num_key_value_heads x 2 head_dim."""
    n_head = int(getattr(config, "num_attention_heads", 0) or 1)
    kv_heads = int(getattr(config, "num_key_value_heads", None) or n_head)
    head_dim = int(getattr(config, "head_dim", None) or int(getattr(config, "hidden_size", 0)) // n_head)
    kv_bytes = int(getattr(config, "num_hidden_layers", 0)) * kv_heads * 2 * head_dim * itemsize
    trained = int(getattr(config, "max_position_embeddings", 0) or 0)
    return choose_context(asked, trained, kv_bytes, 1, name, available_memory())
