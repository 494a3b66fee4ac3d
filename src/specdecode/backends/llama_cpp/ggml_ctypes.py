"""ggml, llama.cpp's tensor library, through ctypes: what :mod:`.buffers` asks of the
installed build. Whether it has AMX kernels (:func:`amx_compiled`), its CPU_REPACK buffer type
(:func:`repack_buffer_type`), whether that runs a matmul by a given weight
(:func:`repack_supports`), a GGUF file's tensor list and metadata (:func:`gguf_header`), and the
devices the build has (:func:`ggml_devices`).

The libraries are the ones llama.cpp itself loaded (:func:`_lib`), so state such as log
routing is shared with it.
"""

from __future__ import annotations

import ctypes
import functools
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

from ...errors import ModelFileError, SpecDecodeError

REPACK_NAME = "CPU_REPACK"


def _lib_dir() -> Path:
    import llama_cpp

    return Path(llama_cpp.__file__).parent / "lib"


def _lib(stem: str) -> ctypes.CDLL | None:
    """The ggml library ``stem`` that llama.cpp itself loaded: by the name its library asks for
    (``libggml-base.so.0``, its SONAME), as pip installs the other names as copies of the file,
    and a copy would be loaded a second time, with its own state (log routing, backends)."""
    for name in (f"lib{stem}.so.0", f"lib{stem}.so", f"lib{stem}.0.dylib", f"lib{stem}.dylib", f"{stem}.dll"):
        if (_lib_dir() / name).exists():
            try:
                return ctypes.CDLL(str(_lib_dir() / name))
            except OSError:
                return None
    return None


def amx_compiled() -> bool:
    """Whether the installed llama.cpp was compiled with AMX kernels (``ggml_cpu_has_amx_int8``:
    a compile-time answer, true for a native build on an AMX CPU)."""
    cpu = _lib("ggml-cpu")
    fn = getattr(cpu, "ggml_cpu_has_amx_int8", None) if cpu is not None else None
    if fn is None:
        return False
    fn.restype = ctypes.c_int
    return fn() != 0


class _GgmlInitParams(ctypes.Structure):
    _fields_ = [("mem_size", ctypes.c_size_t), ("mem_buffer", ctypes.c_void_p), ("no_alloc", ctypes.c_bool)]


@functools.lru_cache(maxsize=None)  # the libraries and their signatures: set once
def _ggml() -> tuple[ctypes.CDLL, ctypes.CDLL] | None:
    """(libggml-base, libggml) with the signatures used here, or None where not found."""
    base, reg = _lib("ggml-base"), _lib("ggml")
    if base is None or reg is None:
        return None
    vp, sz = ctypes.c_void_p, ctypes.c_size_t
    for fn, args, res in ((base.ggml_init, [_GgmlInitParams], vp), (base.ggml_free, [vp], None),
                          (base.ggml_tensor_overhead, [], sz),
                          (base.ggml_new_tensor_2d, [vp, ctypes.c_int, ctypes.c_int64, ctypes.c_int64], vp),
                          (base.ggml_mul_mat, [vp, vp, vp], vp), (base.ggml_backend_buft_alloc_buffer, [vp, sz], vp),
                          (base.ggml_backend_buffer_free, [vp], None), (base.ggml_backend_dev_supports_op, [vp, vp], ctypes.c_bool),
                          (base.ggml_backend_buft_name, [vp], ctypes.c_char_p), (base.ggml_backend_dev_backend_reg, [vp], vp),
                          (base.ggml_backend_reg_get_proc_address, [vp, ctypes.c_char_p], vp),
                          (reg.ggml_backend_dev_by_type, [ctypes.c_int], vp)):
        fn.argtypes, fn.restype = args, res
    return base, reg


GGML_BACKEND_DEVICE_TYPE_CPU = 0
GGML_TYPE_F32 = 0
_TENSOR_BUFFER_OFFSET = 8  # struct ggml_tensor { enum ggml_type type; struct ggml_backend_buffer * buffer; ...}


@functools.lru_cache(maxsize=None)  # a process-wide constant of the loaded library
def repack_buffer_type() -> int | None:
    """The CPU_REPACK buffer type (a ``ggml_backend_buffer_type_t``, as an int) among the CPU
    device's extra buffer types, found by name; None where this build has none."""
    from .lib import init_llama

    init_llama()
    libs = _ggml()
    if libs is None:
        return None
    base, reg = libs
    dev = reg.ggml_backend_dev_by_type(GGML_BACKEND_DEVICE_TYPE_CPU)
    if not dev:
        return None
    proc = base.ggml_backend_reg_get_proc_address(base.ggml_backend_dev_backend_reg(dev), b"ggml_backend_dev_get_extra_bufts")
    if not proc:
        return None
    extra = ctypes.CFUNCTYPE(ctypes.POINTER(ctypes.c_void_p), ctypes.c_void_p)(proc)(dev)
    i = 0
    while extra and extra[i]:
        if base.ggml_backend_buft_name(extra[i]) == REPACK_NAME.encode():
            return int(extra[i])
        i += 1
    return None


def repack_supports(buft: int, ggml_type: int, ne0: int, ne1: int) -> bool:
    """Whether CPU_REPACK (``buft``) runs a matmul by a weight of this ggml type and shape
    [ne0 (row length), ne1 (rows)]: ggml's own answer (``ggml_backend_dev_supports_op`` with the
    weight in a buffer of that type, as llama.cpp's loader asks before placing a weight)."""
    libs = _ggml()
    if libs is None:
        return False
    base, reg = libs
    ctx = base.ggml_init(_GgmlInitParams(base.ggml_tensor_overhead() * 8, None, True))
    if not ctx:
        return False
    try:
        w = base.ggml_new_tensor_2d(ctx, ggml_type, ne0, ne1)
        x = base.ggml_new_tensor_2d(ctx, GGML_TYPE_F32, ne0, 512)
        op = base.ggml_mul_mat(ctx, w, x)
        buf = base.ggml_backend_buft_alloc_buffer(buft, 0)
        if not (w and op and buf):
            return False
        slot = ctypes.c_void_p.from_address(w + _TENSOR_BUFFER_OFFSET)
        slot.value = buf
        try:
            return bool(base.ggml_backend_dev_supports_op(reg.ggml_backend_dev_by_type(GGML_BACKEND_DEVICE_TYPE_CPU), op))
        finally:
            slot.value = None
            base.ggml_backend_buffer_free(buf)
    finally:
        base.ggml_free(ctx)


class _GgufInitParams(ctypes.Structure):
    _fields_ = [("no_alloc", ctypes.c_bool), ("ctx", ctypes.c_void_p)]


@dataclass(frozen=True)
class GgufTensor:
    """One tensor of a GGUF file: its name, ggml type, ne [4] and size in bytes."""

    name: str
    ggml_type: int
    ne: tuple[int, int, int, int]
    nbytes: int


# ggml's gguf_type values of the scalar keys read here (gguf.h)
_GGUF_INTS = {0: ("u8", ctypes.c_uint8), 1: ("i8", ctypes.c_int8), 2: ("u16", ctypes.c_uint16),
              3: ("i16", ctypes.c_int16), 4: ("u32", ctypes.c_uint32), 5: ("i32", ctypes.c_int32),
              10: ("u64", ctypes.c_uint64), 11: ("i64", ctypes.c_int64)}
_GGUF_STRING = 8


def gguf_header(path: str | Path, keys: Sequence[str] = ()) -> tuple[list[GgufTensor], dict[str, int | str]]:
    """The tensors of a GGUF file and the values of ``keys`` among its metadata (integers and
    strings; a key that is absent or of another type is left out; ``{arch}`` in a key stands for
    the file's ``general.architecture``: "{arch}.context_length"), read by ggml's own GGUF
    reader (``gguf_init_from_file``: the header only, in milliseconds). Raises ModelFileError when
    the file cannot be read as GGUF, has no tensors, or is shorter than its tensors' data."""
    from .lib import init_llama

    init_llama()  # ggml's messages go through specdecode's log routing
    base = _lib("ggml-base")
    if base is None:
        raise SpecDecodeError("llama.cpp's ggml-base library was not found beside llama_cpp")
    vp, i64 = ctypes.c_void_p, ctypes.c_int64
    for fn, args, res in ((base.gguf_init_from_file, [ctypes.c_char_p, _GgufInitParams], vp), (base.gguf_free, [vp], None),
                          (base.gguf_get_n_tensors, [vp], i64), (base.gguf_get_tensor_name, [vp, i64], ctypes.c_char_p),
                          (base.gguf_get_tensor_type, [vp, i64], ctypes.c_int),
                          (base.gguf_get_tensor_ne, [vp, i64], ctypes.POINTER(i64)),
                          (base.gguf_get_data_offset, [vp], ctypes.c_size_t),
                          (base.gguf_get_tensor_offset, [vp, i64], ctypes.c_size_t),
                          (base.gguf_get_tensor_size, [vp, i64], ctypes.c_size_t),
                          (base.gguf_find_key, [vp, ctypes.c_char_p], i64), (base.gguf_get_kv_type, [vp, i64], ctypes.c_int),
                          (base.gguf_get_val_str, [vp, i64], ctypes.c_char_p)):
        fn.argtypes, fn.restype = args, res
    ctx = base.gguf_init_from_file(str(path).encode(), _GgufInitParams(True, None))
    if not ctx:
        raise ModelFileError(f"llama.cpp could not load model file {path}: the file is corrupt, truncated or not a "
                             "supported GGUF model (its tensor list cannot be read)")
    try:
        out, end, meta = [], 0, {}
        for i in range(base.gguf_get_n_tensors(ctx)):
            ne = base.gguf_get_tensor_ne(ctx, i)
            size = int(base.gguf_get_tensor_size(ctx, i))
            out.append(GgufTensor(base.gguf_get_tensor_name(ctx, i).decode("utf-8", "replace"),
                                  int(base.gguf_get_tensor_type(ctx, i)), tuple(int(ne[d]) for d in range(4)), size))
            end = max(end, base.gguf_get_tensor_offset(ctx, i) + size)
        data = base.gguf_get_data_offset(ctx)
        arch_id = base.gguf_find_key(ctx, b"general.architecture")
        arch = (base.gguf_get_val_str(ctx, arch_id) or b"").decode("utf-8", "replace") if arch_id >= 0 else ""
        for key in keys:
            kid = base.gguf_find_key(ctx, key.format(arch=arch).encode())
            kind = base.gguf_get_kv_type(ctx, kid) if kid >= 0 else -1
            if kind in _GGUF_INTS:
                suffix, ctype = _GGUF_INTS[kind]
                getter = getattr(base, f"gguf_get_val_{suffix}")
                getter.argtypes, getter.restype = [vp, i64], ctype
                meta[key] = int(getter(ctx, kid))
            elif kind == _GGUF_STRING:
                meta[key] = (base.gguf_get_val_str(ctx, kid) or b"").decode("utf-8", "replace")
    finally:
        base.gguf_free(ctx)
    size = Path(path).stat().st_size
    if not out or data + end > size:
        why = "it has no tensors" if not out else f"its tensors end at byte {data + end}, the file has {size}"
        raise ModelFileError(f"llama.cpp could not load model file {path}: the file is truncated or not a model ({why})")
    return out, meta


def gguf_tensors(path: str | Path) -> list[tuple[str, int, tuple[int, int, int, int]]]:
    """The tensors of a GGUF file as (name, ggml type, ne [4]) (:func:`gguf_header`). Raises
    ModelFileError as it does."""
    return [(t.name, t.ggml_type, t.ne) for t in gguf_header(path)[0]]


# ggml's enum ggml_backend_dev_type (ggml-backend.h), by value
DEVICE_KINDS = ("cpu", "gpu", "igpu", "accel", "meta")


def ggml_devices() -> list[tuple[str, str, str, int, int]]:
    """The devices of the loaded llama.cpp build, in its registry's order, as (name,
    description, kind, free bytes, total bytes): ("Vulkan0", "llvmpipe (LLVM 15.0.7, 256 bits)",
    "gpu", ...), ("CPU", "AMD EPYC 9R14", "cpu", ...); kind is a name of DEVICE_KINDS. Empty
    where ggml's libraries are not found."""
    from .lib import init_llama

    init_llama()
    libs = _ggml()
    if libs is None:
        return []
    base, reg = libs
    vp, sz = ctypes.c_void_p, ctypes.c_size_t
    for fn, args, res in ((reg.ggml_backend_dev_count, [], sz), (reg.ggml_backend_dev_get, [sz], vp),
                          (base.ggml_backend_dev_name, [vp], ctypes.c_char_p),
                          (base.ggml_backend_dev_description, [vp], ctypes.c_char_p),
                          (base.ggml_backend_dev_type, [vp], ctypes.c_int),
                          (base.ggml_backend_dev_memory, [vp, ctypes.POINTER(sz), ctypes.POINTER(sz)], None)):
        fn.argtypes, fn.restype = args, res
    out = []
    for i in range(reg.ggml_backend_dev_count()):
        dev = reg.ggml_backend_dev_get(i)
        free, total = ctypes.c_size_t(0), ctypes.c_size_t(0)
        base.ggml_backend_dev_memory(dev, ctypes.byref(free), ctypes.byref(total))
        kind = base.ggml_backend_dev_type(dev)
        out.append(((base.ggml_backend_dev_name(dev) or b"").decode("utf-8", "replace"),
                    (base.ggml_backend_dev_description(dev) or b"").decode("utf-8", "replace"),
                    DEVICE_KINDS[kind] if 0 <= kind < len(DEVICE_KINDS) else f"type {kind}",
                    int(free.value), int(total.value)))
    return out
