"""How many of a GGUF model's layers llama.cpp puts on a GPU (``--gpu-layers N|all|auto``,
llama.cpp's ``n_gpu_layers``), decided before the model loads.

llama.cpp counts a model's offloadable layers as its repeating blocks plus the output layer
(``offloaded 29/29 layers to GPU`` for a model of 28 blocks) and offloads from the end: N
layers are the output layer and the last N - 1 blocks; the input embedding always stays on the
CPU. Its devices for offloading are the build's discrete GPUs, or its integrated GPUs where it
has no discrete one (``llama_model_load``); a CPU-only build has none
(``llama_supports_gpu_offload`` false).

``auto`` (the default, as llama.cpp's own server, Ollama and LM Studio offload by default): every
layer where the weights of all layers, the KV cache of the context and a compute reserve fit the
offload devices' free memory; else as many layers as fit, said in one line; the CPU where the
build has no GPU. A number larger than the model's layers means all.

:func:`plan_offload` is the decision as a pure function over :class:`Device` lists and a
:class:`ModelLayout` (tested against fake device lists); :func:`list_devices` and
:func:`model_layout` read the real ones. Units: bytes, tokens, layers.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

from ...limits import DEFAULT_N_CTX
from .ggml_ctypes import GgufTensor, ggml_devices, gguf_header

# What llama.cpp's compute buffers and the runtime take on a device beside the weights and the KV
# cache (a 1.5B model's graph at 512 tokens a batch: ~300 MiB on CUDA; kept for larger ones too).
COMPUTE_RESERVE = 512 << 20
OFFLOAD_KINDS = ("gpu", "igpu")  # ggml device kinds llama.cpp offloads layers to
LLAMA_KV_BYTES = 2  # f16 keys and values, llama.cpp's default cache type
_BLOCK = re.compile(r"^blk\.(\d+)\.")


@dataclass(frozen=True)
class Device:
    """One llama.cpp device: name ("CUDA0", "Vulkan0", "Metal", "CPU"), description (the
    card: "NVIDIA H100 80GB HBM3"), kind ("cpu", "gpu", "igpu", "accel"), free and total bytes."""

    name: str
    description: str
    kind: str
    free: int
    total: int


def list_devices() -> list[Device]:
    """The loaded llama.cpp build's devices (:func:`.ggml_ctypes.ggml_devices`)."""
    return [Device(*d) for d in ggml_devices()]


def offload_devices(devices: Sequence[Device]) -> list[Device]:
    """The devices llama.cpp offloads layers to: the discrete GPUs, else the integrated ones."""
    gpus = [d for d in devices if d.kind == "gpu"]
    return gpus or [d for d in devices if d.kind == "igpu"]


@dataclass(frozen=True)
class ModelLayout:
    """What offloading a model needs, from its GGUF header: block_bytes [n_blocks] (the
    weights of each repeating block), output_bytes (the output layer: its norm and projection,
    or the token embedding it shares), kv_bytes_per_token (the f16 KV cache of one token in one
    block) and trained_ctx (the context it was trained for; 0: unknown)."""

    block_bytes: tuple[int, ...]
    output_bytes: int
    kv_bytes_per_token: int
    trained_ctx: int = 0

    @property
    def n_layers(self) -> int:
        """Offloadable layers as llama.cpp counts them: the blocks and the output layer."""
        return len(self.block_bytes) + 1

    def offloaded_bytes(self, layers: int, n_ctx: int, slots: float) -> int:
        """Device memory for the last ``layers`` layers (the output layer first, then blocks from
        the end) with their KV cache of n_ctx tokens x slots, and the compute reserve."""
        layers = max(0, min(layers, self.n_layers))
        blocks = self.block_bytes[len(self.block_bytes) - (layers - 1):] if layers > 1 else ()
        kv = int(len(blocks) * self.kv_bytes_per_token * n_ctx * slots)
        return (self.output_bytes if layers else 0) + sum(blocks) + kv + (COMPUTE_RESERVE if layers else 0)


def layout_from_tensors(tensors: Sequence[GgufTensor], meta: dict) -> ModelLayout:
    """A :class:`ModelLayout` from a GGUF file's tensors and its metadata (``{arch}.context_length``,
    the trained context; absent: unknown): a block's KV width is its key and value projections'
    output rows."""
    blocks: dict[int, int] = {}
    kv_width: dict[int, int] = {}
    output = embed = norm = 0
    for t in tensors:
        m = _BLOCK.match(t.name)
        if m:
            i = int(m.group(1))
            blocks[i] = blocks.get(i, 0) + t.nbytes
            if t.name.endswith((".attn_k.weight", ".attn_v.weight")):
                kv_width[i] = kv_width.get(i, 0) + t.ne[1]
        elif t.name == "output.weight":
            output = t.nbytes
        elif t.name == "token_embd.weight":
            embed = t.nbytes
        elif t.name.startswith("output_norm."):
            norm += t.nbytes
    n = max(blocks) + 1 if blocks else 0
    trained = meta.get("{arch}.context_length", 0)
    return ModelLayout(tuple(blocks.get(i, 0) for i in range(n)), (output or embed) + norm,
                       max(kv_width.values(), default=0) * LLAMA_KV_BYTES, int(trained) if isinstance(trained, int) else 0)


def model_layout(path: str | Path) -> ModelLayout:
    """The layout of a GGUF file, from its header (milliseconds). Raises ModelFileError for a
    file that cannot be read as GGUF."""
    tensors, meta = gguf_header(path, ["{arch}.context_length"])
    return layout_from_tensors(tensors, meta)


@dataclass(frozen=True)
class OffloadPlan:
    """What goes to a GPU: gpu_layers (llama.cpp's n_gpu_layers, 0..n_layers), n_layers (the
    model's offloadable layers), devices (the names of the offload devices used, "" on the
    CPU: "Vulkan0", "CUDA0+CUDA1"), description (the first device's), and note (one line: how
    many layers and why)."""

    gpu_layers: int
    n_layers: int
    devices: str
    description: str
    note: str

    @property
    def device(self) -> str:
        """Where the layers run, as llama.cpp names it: the offload devices, "CPU" where none."""
        return self.devices if self.gpu_layers else "CPU"


def _mib(n: int) -> str:
    return f"{n / (1 << 20):,.0f} MiB"


def plan_offload(asked: int | str, layout: ModelLayout, devices: Sequence[Device], n_ctx: int | None,
                 slots: float = 1.0, name: str = "the model") -> OffloadPlan:
    """The layers of a model of ``layout`` to put on the offload devices among ``devices``.

    asked: an int >= 0 (that many layers; more than the model has means all), "all" or "auto"
    (as checked by :func:`specdecode.limits.check_gpu_layers`). n_ctx: the context per slot the
    KV cache is planned for (None: the trained one, at most DEFAULT_N_CTX: a default context is
    then capped to the device's memory at load); slots: the caches to fit (slots x a draft
    model's reserve). A device reports its free memory (0 where it cannot say: planned as
    enough). Returns the plan; never raises.
    """
    total = layout.n_layers
    targets = offload_devices(devices)
    if not targets:
        why = "this llama.cpp build has no GPU device (a CPU-only build)"
        asked_some = asked not in ("auto", 0)
        return OffloadPlan(0, total, "", "", f"{name}: all {total} layers on the CPU: {why}"
                           + (f"; --gpu-layers {asked} cannot offload here" if asked_some else ""))
    names = "+".join(d.name for d in targets)
    where = f"{names} ({targets[0].description})" if targets[0].description else names
    if asked == 0:
        return OffloadPlan(0, total, names, targets[0].description, f"{name}: all {total} layers on the CPU, as asked "
                                                                    f"(--gpu-layers 0; {where} unused)")
    if asked != "auto":
        n = total if asked == "all" else min(int(asked), total)
        return OffloadPlan(n, total, names, targets[0].description,
                           f"{name}: {n} of {total} layers on {where}, as asked (--gpu-layers {asked})")
    free = sum(d.free for d in targets)
    ctx = n_ctx if n_ctx is not None else min(layout.trained_ctx or DEFAULT_N_CTX, DEFAULT_N_CTX)
    need_all = layout.offloaded_bytes(total, ctx, slots)
    if free <= 0 or need_all <= free:
        room = f"{_mib(need_all)} of {_mib(free)} free" if free > 0 else "the device does not report its free memory"
        return OffloadPlan(total, total, names, targets[0].description,
                           f"{name}: all {total} layers on {where} (weights, KV cache of {ctx} tokens and compute: {room})")
    n = max((k for k in range(total + 1) if layout.offloaded_bytes(k, ctx, slots) <= free), default=0)
    return OffloadPlan(n, total, names if n else "", targets[0].description,
                       f"{name}: {n} of {total} layers on {where}, the rest on the CPU: all of them with the KV cache "
                       f"of {ctx} tokens and compute need {_mib(need_all)}, the device has {_mib(free)} free "
                       f"(--gpu-layers N or --ctx-size to choose)")
