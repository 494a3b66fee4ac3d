"""The llama.cpp library as a process sees it, apart from any one model: loading it once with
its log routed (:func:`init_llama`, :func:`last_error`), the buffer types it reports holding
a model's weights as it loads (:func:`weight_buffer_log`; which to use: :mod:`.buffers`),
whether attention runs as flash attention
(:func:`flash_attention`), and how many threads a forward should use (:func:`default_threads`)."""

from __future__ import annotations

import collections
import contextlib
import ctypes
import os
import re
import sys
import threading
from pathlib import Path
from typing import Iterator

_BACKEND_READY = False
_LOG_CALLBACK = None  # kept alive: llama.cpp holds a raw pointer to it
_RECENT_ERRORS: "collections.deque[str]" = collections.deque(maxlen=8)
_WEIGHT_BUFFERS: dict[str, float] | None = None  # filled while weight_buffer_log is active
_LOAD_LOCK = threading.Lock()
_MODEL_BUFFER = re.compile(r"(\S+) model buffer size =\s*([0-9.]+) MiB")
GGML_LOG_LEVEL_WARN = 3  # ggml's enum: NONE 0, DEBUG 1, INFO 2, WARN 3, ERROR 4, CONT 5


def init_llama() -> None:
    """Load llama.cpp once and route its log: silent unless SPECDECODE_VERBOSE=1, keeping
    recent error lines so that a failed load can say why in one line."""
    global _BACKEND_READY, _LOG_CALLBACK
    if _BACKEND_READY:
        return
    import llama_cpp

    verbose = os.environ.get("SPECDECODE_VERBOSE") == "1"

    @llama_cpp.llama_log_callback
    def _log(level: int, text: bytes, user_data: ctypes.c_void_p) -> None:
        msg = text.decode("utf-8", errors="replace")
        if verbose:
            print(msg, end="", file=sys.stderr, flush=True)
        seen = _WEIGHT_BUFFERS
        if seen is not None and (m := _MODEL_BUFFER.search(msg)):
            seen[m.group(1)] = seen.get(m.group(1), 0.0) + float(m.group(2))
        if level in (GGML_LOG_LEVEL_WARN, GGML_LOG_LEVEL_WARN + 1) and "error" in msg.lower():
            _RECENT_ERRORS.append(msg.strip())

    _LOG_CALLBACK = _log
    llama_cpp.llama_log_set(_log, ctypes.c_void_p(0))
    llama_cpp.llama_backend_init()
    _BACKEND_READY = True


def last_error() -> str:
    msg = _RECENT_ERRORS[0] if _RECENT_ERRORS else ""
    _RECENT_ERRORS.clear()
    return f" ({msg})" if msg else ""


@contextlib.contextmanager
def weight_buffer_log() -> Iterator[dict[str, float]]:
    """While active, the buffer types llama.cpp reports holding a model's weights as it loads
    ({"CPU_REPACK": 596.5, "CPU_Mapped": 1059.9}, MiB, from its "model buffer size" log lines).
    One load at a time (a lock)."""
    global _WEIGHT_BUFFERS
    with _LOAD_LOCK:
        seen: dict[str, float] = {}
        _WEIGHT_BUFFERS = seen
        try:
            yield seen
        finally:
            _WEIGHT_BUFFERS = None


FLASH_ATTENTION_ENV = "SPECDECODE_LLAMA_FLASH_ATTN"
FLASH_ATTENTION_MODES = {"auto": -1, "on": 1, "off": 0}  # llama.cpp's llama_flash_attn_type


def flash_attention() -> str:
    """How llama.cpp computes attention: "auto" (the default: llama.cpp's own choice, flash
    attention on the CPU), "on" or "off", from SPECDECODE_LLAMA_FLASH_ATTN.

    "off" makes verification much cheaper at long contexts: llama.cpp's CPU flash-attention
    kernel goes through the KV cache once per query row, while the plain path multiplies a
    block's rows by the cache together. Measured on an AMD EPYC Zen 4 (2 vCPU, default target
    Q4_K_M; ``python benchmarks/cost_curves.py --vary flash_attn=auto,off --contexts
    64,1000,2500``): T(33) after 2,500 tokens 0.62-0.63 s without it against 0.92-1.04 s with
    it, T(1) 43-44 ms against 47-48 ms; after 64 tokens within noise. But without it no block of two or more rows has bitwise the logits of
    one-token steps (the measured invariant block falls from 3 to 1 on the default target, from
    33 to 1 on smollm2), so strict mode verifies one token a forward and seeded sampling under
    speculation no longer gives plain decoding's text. Unset, the path is chosen by measurement
    where the model loads (:mod:`specdecode.control.attention`); this returns "auto" then, what the backend
    starts with.

    Raises SpecDecodeError for any other value, naming it.
    """
    value = os.environ.get(FLASH_ATTENTION_ENV, "").strip().lower() or "auto"  # set but empty: unset, as the others
    if value not in FLASH_ATTENTION_MODES:
        from ...errors import SpecDecodeError

        raise SpecDecodeError(f"{FLASH_ATTENTION_ENV}={os.environ[FLASH_ATTENTION_ENV]!r} is not a choice: expected "
                              f"{', '.join(FLASH_ATTENTION_MODES)}")
    return value


def context_params(lib, n_ctx: int, n_seq: int, n_batch: int, rows_max: int, tree_branches: int,
                   kv_per_sequence: bool, n_threads: int, flash: str):
    """llama.cpp's context parameters: n_seq sequences of n_ctx cells (one unified buffer unless
    kv_per_sequence), tree branch sequences, n_batch tokens a call, rows_max logit rows, threads
    and the attention kernel (``flash``: a key of FLASH_ATTENTION_MODES)."""
    cparams = lib.llama_context_default_params()
    cparams.n_ctx = n_ctx * n_seq
    cparams.n_batch = n_batch
    cparams.n_ubatch = n_batch
    cparams.n_seq_max = n_seq + tree_branches
    cparams.kv_unified = not kv_per_sequence
    # Logit rows per ubatch: verification needs K+1 <= 33 rows a sequence, never n_batch of them.
    cparams.n_outputs_max = rows_max
    cparams.n_threads = n_threads
    cparams.n_threads_batch = n_threads
    cparams.no_perf = True
    cparams.flash_attn_type = FLASH_ATTENTION_MODES[flash]
    return cparams


def attention_requested() -> bool:
    """Whether SPECDECODE_LLAMA_FLASH_ATTN names the attention path (else it is measured:
    :mod:`specdecode.control.attention`)."""
    return bool(os.environ.get(FLASH_ATTENTION_ENV, "").strip())


def default_threads() -> int:
    """Physical cores this process may run on, as llama.cpp recommends (its
    ``cpu_get_num_math``): a second hardware thread of a core shares its vector units and
    slows a compute-bound forward. Logical CPUs where the topology cannot be read."""
    try:
        cpus = sorted(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        return os.cpu_count() or 1
    cores = set()
    for c in cpus:
        topo = Path(f"/sys/devices/system/cpu/cpu{c}/topology")
        try:
            cores.add((topo.joinpath("physical_package_id").read_text().strip(),
                       topo.joinpath("core_id").read_text().strip()))
        except OSError:
            return len(cpus)
    return max(1, len(cores))
