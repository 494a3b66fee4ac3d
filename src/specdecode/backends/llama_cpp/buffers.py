"""Where llama.cpp keeps a GGUF model's weights on the CPU: which of its buffer types, chosen
per llama.cpp build and machine.

llama.cpp's CPU backend has extra buffer types besides plain memory. CPU_REPACK rearranges
quantized weights for its GEMM kernels (groups of 4 or 8 rows), which makes forwards of
several tokens (verification of K drafts) much cheaper. A build compiled with AMX
(``-march=native`` on a Sapphire Rapids or later Xeon, what ``pip install`` does there) also
has an AMX buffer type, which llama.cpp prefers whenever extra buffer types are on, and whose
matmul crashes with SIGSEGV on forwards of 2 or more tokens on the VMs measured (llama.cpp
#20824: the tile permission is requested on the main thread only). So the choices are:

- ``"repack"``: CPU_REPACK for every weight it supports, never AMX. On a build without AMX
  that is llama.cpp's own choice (``use_extra_bufts``). On an AMX build the extra buffer types
  are off and each supported weight is placed in CPU_REPACK by name (``tensor_buft_overrides``,
  :func:`repack_overrides`); whether CPU_REPACK supports a weight is asked of ggml itself, the
  way llama.cpp's loader asks (the matmul op's ``supports_op`` with the weight in that buffer).
- ``"amx"``: llama.cpp's own choice on an AMX build (AMX first, CPU_REPACK for the rest).
- ``"none"``: plain memory, no extra buffer types.

:func:`choose_buffers` is the decision as a pure function; :func:`probe_amx` decides by trying:
a child process loads the model in the AMX buffer and runs a 2-token forward (a crash kills
the child only) and times T(n), another does the same with CPU_REPACK, and AMX is used where
it survives and is faster. The probe is cached per llama.cpp build, CPU flags, threads and
model file. ``SPECDECODE_LLAMA_BUFFERS=amx|repack|none`` overrides it all
(``SPECDECODE_LLAMA_REPACK=0|1``, the older switch, means none|repack).
"""

from __future__ import annotations

import ctypes
import hashlib
import json
import math
import os
import re
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Sequence

from ...errors import SpecDecodeError
from ...files import cache_dir, read_cache_json, write_cache_json
from .ggml_ctypes import REPACK_NAME, _lib_dir, amx_compiled, gguf_tensors, repack_buffer_type, repack_supports

BUFFERS_ENV = "SPECDECODE_LLAMA_BUFFERS"
LEGACY_REPACK_ENV = "SPECDECODE_LLAMA_REPACK"
BUFFER_CHOICES = ("amx", "repack", "none")
PROBE_NS = (1, 2, 4, 8, 16, 32)  # the sizes a probe times: T(n), seconds
PROBE_TIMEOUT_S = 600.0
# The 2-D weights of a transformer layer that llama.cpp multiplies activations by (GGML_OP_MUL_MAT),
# by their GGUF names: only these may be placed in CPU_REPACK (token_embd is read by row, norms
# are added: CPU_REPACK supports neither, and a weight there that its kernels do not support
# aborts the load).
MATMUL_WEIGHT = re.compile(r"^(blk\.(\d+)\.(attn_(?:q|k|v|qkv|output)|ffn_(?:gate|up|down))|(output))\.weight$")


def requested_buffers() -> str | None:
    """The buffer choice the environment asks for: SPECDECODE_LLAMA_BUFFERS (amx, repack or
    none), else the older SPECDECODE_LLAMA_REPACK (0: none, 1: repack), else None (decide).
    Raises SpecDecodeError for any other value, and when the two are set and disagree, naming
    them."""
    value = os.environ.get(BUFFERS_ENV, "").strip().lower()
    if value and value not in BUFFER_CHOICES:
        raise SpecDecodeError(f"{BUFFERS_ENV}={os.environ[BUFFERS_ENV]!r} is not a choice: expected "
                              f"{', '.join(BUFFER_CHOICES)}")
    raw = os.environ.get(LEGACY_REPACK_ENV)
    legacy = None
    if raw is not None and raw.strip():
        if raw.strip() not in ("0", "1"):
            raise SpecDecodeError(f"{LEGACY_REPACK_ENV}={raw!r} is not a choice: expected 0 (none) or 1 (repack); "
                                  f"{BUFFERS_ENV}=amx|repack|none replaces it")
        legacy = "repack" if raw.strip() == "1" else "none"
    if value and legacy and value != legacy:
        raise SpecDecodeError(f"{BUFFERS_ENV}={value} and {LEGACY_REPACK_ENV}={raw.strip()} disagree: set one "
                              f"({LEGACY_REPACK_ENV}={raw.strip()} means {legacy})")
    return value or legacy


@dataclass(frozen=True)
class AmxProbe:
    """What trying the AMX buffer showed: whether a 2-token forward in it survived, why not
    (``detail``: "killed by SIGSEGV", a timeout, the child's last error line), and T(n) in
    seconds at PROBE_NS with AMX and with CPU_REPACK ({} where that child failed)."""

    survived: bool
    detail: str = ""
    amx: dict[int, float] = field(default_factory=dict)
    repack: dict[int, float] = field(default_factory=dict)
    # Whether the outcome is the AMX kernels' own (a run, or a crash signal) and so worth
    # caching; not a child killed from outside, timed out or unable to load (not serialized).
    definitive: bool = field(default=True, compare=False)

    def amx_beats_repack(self) -> bool:
        """Whether AMX's curve is faster: the geometric mean of T_amx(n) / T_repack(n) over the
        sizes both measured is below 1 (True when only AMX was measured)."""
        common = [n for n in self.amx if n in self.repack]
        if not self.survived or not self.amx:
            return False
        if not common:
            return not self.repack
        return sum(math.log(self.amx[n]) - math.log(self.repack[n]) for n in common) < 0.0

    def to_dict(self) -> dict:
        return {"survived": self.survived, "detail": self.detail, "amx": {str(n): s for n, s in self.amx.items()},
                "repack": {str(n): s for n, s in self.repack.items()}}

    @classmethod
    def from_dict(cls, d: dict) -> "AmxProbe":
        """Read back what :meth:`to_dict` wrote. Raises ValueError for anything else (a file
        edited by hand): survived must be a boolean, times finite and positive."""
        try:
            if not isinstance(d["survived"], bool) or not isinstance(d.get("detail", ""), str):
                raise ValueError("survived must be true or false")
            return cls(d["survived"], d.get("detail", ""), _times(d["amx"]), _times(d["repack"]))
        except (KeyError, TypeError, AttributeError) as e:
            raise ValueError(f"not a probe result: {e}") from None


def _times(d) -> dict[int, float]:
    """{n: seconds} from JSON ({"1": 0.05, ...}); ValueError unless every time is a finite
    positive number."""
    if not isinstance(d, dict):
        raise ValueError("times must be an object")
    out = {int(n): s for n, s in d.items()}
    if not all(isinstance(s, (int, float)) and not isinstance(s, bool) and math.isfinite(s) and s > 0
               for s in out.values()):
        raise ValueError("times must be finite and positive")
    return {n: float(s) for n, s in out.items()}


def choose_buffers(amx_compiled: bool, repack_found: bool, requested: str | None, probe: AmxProbe | None) -> str:
    """The buffer type for a model's weights: "amx", "repack" or "none".

    amx_compiled: the llama.cpp build has AMX kernels (:func:`amx_compiled`). repack_found: its
    CPU device lists the CPU_REPACK buffer type (:func:`repack_buffer_type`). requested: the
    user's choice (:func:`requested_buffers`), which wins. probe: the trial of AMX on this
    machine (:func:`probe_amx`; None when not run). Without a request: repack where AMX is not
    compiled in; on an AMX build AMX where the probe survived and AMX beat CPU_REPACK, else
    CPU_REPACK; plain memory where CPU_REPACK is missing.

    Raises SpecDecodeError when the request cannot be met by this build (amx without AMX
    kernels; repack without CPU_REPACK), naming both.
    """
    if requested is not None:
        if requested == "amx" and not amx_compiled:
            raise SpecDecodeError(f"{BUFFERS_ENV}=amx: this llama.cpp build has no AMX kernels (it was not compiled "
                                  "for an AMX CPU); expected repack or none")
        if requested == "repack" and amx_compiled and not repack_found:
            raise SpecDecodeError(f"{BUFFERS_ENV}=repack: this llama.cpp build lists no {REPACK_NAME} buffer type; "
                                  "expected amx or none")
        if requested not in BUFFER_CHOICES:
            raise SpecDecodeError(f"buffers {requested!r} is not a choice: expected {', '.join(BUFFER_CHOICES)}")
        return requested
    if not amx_compiled:
        return "repack"
    if probe is not None and probe.amx_beats_repack():
        return "amx"
    return "repack" if repack_found else "none"


def repack_overrides(tensors: Sequence[tuple[str, int, Sequence[int]]], supports: Callable[[int, int, int], bool],
                     cpu_blocks: int | None = None) -> list[str]:
    """Patterns (regular expressions over tensor names) of the matmul weights among ``tensors``
    ((name, ggml type, ne) as :func:`gguf_tensors` gives them) that CPU_REPACK supports: one
    pattern per kind of weight, naming its layers (``^blk\\.(0|1|5)\\.ffn_down\\.weight$``),
    and ``^output\\.weight$``. supports(ggml type, ne0, ne1): whether CPU_REPACK runs that
    weight (:func:`repack_supports`), asked once per type and shape. cpu_blocks: where some
    layers are on a GPU (:mod:`.offload`), the blocks that stay on the CPU (0 .. cpu_blocks - 1;
    the output layer is then on the GPU): only their weights are named (a pattern places a weight
    wherever its layer is)."""
    asked: dict[tuple[int, int, int], bool] = {}
    layers: dict[str, list[str]] = {}
    for name, ggml_type, ne in tensors:
        m = MATMUL_WEIGHT.match(name)
        if m is None or any(d != 1 for d in ne[2:]):
            continue
        if cpu_blocks is not None and (m.group(4) or int(m.group(2)) >= cpu_blocks):
            continue
        key = (ggml_type, int(ne[0]), int(ne[1]))
        if key not in asked:
            asked[key] = supports(*key)
        if asked[key]:
            layers.setdefault(m.group(3) or m.group(4), []).append(m.group(2) or "")
    out = []
    for kind, ids in layers.items():
        out.append(f"^{kind}\\.weight$" if ids == [""] else f"^blk\\.({'|'.join(ids)})\\.{kind}\\.weight$")
    return out


class _BuftOverride(ctypes.Structure):
    _fields_ = [("pattern", ctypes.c_char_p), ("buft", ctypes.c_void_p)]


@dataclass
class ModelBuffers:
    """How a model's weights are placed, for ``llama_model_params``: ``use_extra_bufts`` and the
    NULL-terminated ``tensor_buft_overrides`` array (kept alive here while the model loads)."""

    choice: str
    use_extra_bufts: bool
    patterns: list[str] = field(default_factory=list)
    _array: object = None

    def apply(self, mparams) -> None:
        """Set these on llama.cpp's model parameters (a ``llama_model_params``)."""
        mparams.use_extra_bufts = self.use_extra_bufts
        if not self.patterns:
            mparams.tensor_buft_overrides = None
            return
        buft = repack_buffer_type()
        arr = (_BuftOverride * (len(self.patterns) + 1))()
        for i, p in enumerate(self.patterns):
            arr[i].pattern, arr[i].buft = p.encode(), buft
        self._array = arr
        mparams.tensor_buft_overrides = ctypes.cast(arr, ctypes.c_void_p)


def model_buffers(choice: str, amx: bool, path: str | Path, cpu_blocks: int | None = None) -> ModelBuffers:
    """The parameters that give ``choice`` on a build with (``amx``) or without AMX kernels: repack
    is llama.cpp's own choice without AMX, weight by weight with it (:func:`repack_overrides`, for
    the ``cpu_blocks`` that stay on the CPU where some layers are on a GPU)."""
    if choice == "none":
        return ModelBuffers(choice, False)
    if choice == "amx" or not amx:
        return ModelBuffers(choice, True)
    buft = repack_buffer_type()
    patterns = repack_overrides(gguf_tensors(path), lambda *k: repack_supports(buft, *k), cpu_blocks) if buft else []
    return ModelBuffers(choice, False, patterns)  # (no pattern: no weight CPU_REPACK supports, as without AMX)


# --- the probe -------------------------------------------------------------------------------
def _file_stamp(path: Path) -> str:
    try:
        st = path.stat()
    except OSError:
        return path.name
    return f"{path.name}:{st.st_size}:{int(st.st_mtime)}"


def probe_key(path: str | Path, n_threads: int) -> str:
    """What a probe's answer depends on: the llama.cpp build (its CPU library file), the CPU's
    flags, the thread count and the model file."""
    flags = ""
    try:
        with open("/proc/cpuinfo") as f:
            flags = next((line for line in f if line.startswith("flags")), "")
    except OSError:
        pass
    lib = next((p for p in _lib_dir().glob("*ggml-cpu*") if p.is_file()), None)
    parts = [_file_stamp(lib) if lib else "", hashlib.sha256(flags.encode()).hexdigest()[:16], str(n_threads),
             _file_stamp(Path(path))]
    return hashlib.sha256("|".join(parts).encode()).hexdigest()[:20]


def _run_child(command: Sequence[str], timeout_s: float) -> tuple[dict | None, str]:
    """Run one probe child: (its last JSON line, or None, and why it failed: "" when it did not)."""
    try:
        done = subprocess.run(list(command), capture_output=True, text=True, timeout=timeout_s)
    except subprocess.TimeoutExpired:
        return None, f"timed out after {timeout_s:.0f} s"
    except OSError as e:
        return None, f"could not start ({e})"
    lines = [ln for ln in done.stdout.splitlines() if ln.startswith("{")]
    result = None
    if lines:
        try:
            result = json.loads(lines[-1])
        except ValueError:
            result = None
    if done.returncode < 0:
        import signal

        try:
            name = signal.Signals(-done.returncode).name
        except ValueError:
            name = f"signal {-done.returncode}"
        return result, f"killed by {name}"
    if done.returncode != 0:
        tail = (done.stderr.strip().splitlines() or [f"exit status {done.returncode}"])[-1]
        return result, tail[:300]
    return result, ""


# The ways a kernel fault ends a process: a probe that ended so is the AMX kernels' own answer.
CRASH_SIGNALS = ("SIGSEGV", "SIGILL", "SIGBUS", "SIGABRT", "SIGFPE")
AMX_BUFFER_NAME = "AMX"  # ggml's name for its AMX buffer type, as llama.cpp reports the weights' buffers


def probe_amx(path: str | Path, n_threads: int, command: Sequence[str] | None = None,
              timeout_s: float = PROBE_TIMEOUT_S) -> AmxProbe:
    """Try the AMX buffer in a child process: it loads ``path`` with AMX, runs a 2-token forward
    (printing ``{"survived": true}``), then times T(n) at PROBE_NS and prints
    ``{"survived": true, "seconds": {n: s}, "weights": {buffer: MiB}}``; a second child does
    the same with CPU_REPACK. command: the child's argv before its arguments (model, buffers,
    threads); by default ``python -P -m specdecode.backends.llama_cpp.probe`` (-P: the working
    folder cannot shadow specdecode).

    AMX counts as surviving only where the child returned and llama.cpp put weights in its AMX
    buffer (a build with AMX kernels on a CPU without AMX has no such buffer: the "amx" child
    then ran CPU_REPACK). A child killed by a signal, timing out or failing counts as not
    surviving, with the reason in ``detail``; only a crash signal (CRASH_SIGNALS) or a run is
    ``definitive``, worth caching."""
    command = list(command or [sys.executable, "-P", "-m", "specdecode.backends.llama_cpp.probe"])

    def run(buffers: str) -> tuple[dict | None, dict[int, float] | None, str]:
        result, why = _run_child(command + [str(path), buffers, str(n_threads)], timeout_s)
        try:
            seconds = _times(result.get("seconds")) if isinstance(result, dict) else None
        except ValueError:
            seconds = None
        if not why and (seconds is None or not result.get("survived")):
            why = "the child printed no result"
        return result, seconds, why

    amx, amx_s, why = run("amx")
    if why:
        crash = why.startswith("killed by ") and why.removeprefix("killed by ") in CRASH_SIGNALS
        return AmxProbe(False, why, {}, {}, definitive=crash)
    held = amx.get("weights") if isinstance(amx.get("weights"), dict) else {}
    if AMX_BUFFER_NAME not in held:
        return AmxProbe(False, f"llama.cpp put no weights in its {AMX_BUFFER_NAME} buffer on this CPU "
                               f"(it held them in {', '.join(map(str, held)) or 'nothing reported'})", {}, {})
    _, repack_s, _ = run("repack")
    return AmxProbe(True, "", amx_s, repack_s or {})


def cached_probe(path: str | Path, n_threads: int, folder: Path | None = None,
                 probe: Callable[[str | Path, int], AmxProbe] = probe_amx) -> AmxProbe:
    """:func:`probe_amx` once per :func:`probe_key`, cached as JSON under ``<cache>/costs`` when
    its outcome is definitive (a file that cannot be read back is probed again and replaced)."""
    file = (folder or cache_dir()) / "costs" / f"buffers-{probe_key(path, n_threads)}.json"
    data = read_cache_json(file)
    if data is not None:
        try:
            return AmxProbe.from_dict(data)
        except (ValueError, OverflowError):  # a file edited by hand: probed again and replaced
            pass
    print("specdecode: trying llama.cpp's AMX kernels in a child process (once per build, machine and model)...",
          file=sys.stderr, flush=True)
    result = probe(path, n_threads)
    if result.definitive:
        write_cache_json(file, result.to_dict())
    return result


OFFLOADED = "offloaded"  # the choice where every layer is on a GPU: llama.cpp's own buffers, nothing to probe


def resolve_buffers(path: str | Path, n_threads: int, cpu_blocks: int | None = None) -> ModelBuffers:
    """The weights' placement for this model on this build and machine: the request
    (SPECDECODE_LLAMA_BUFFERS), else :func:`choose_buffers` with the cached probe on an AMX
    build. cpu_blocks: where some layers are on a GPU, the blocks left on the CPU (0: none, every
    layer offloaded: llama.cpp's own buffers, no probe). Raises SpecDecodeError on a request this
    build cannot meet, ModelFileError (on an AMX build) for a file whose tensor list cannot be read."""
    if cpu_blocks == 0:
        return ModelBuffers(OFFLOADED, True)
    requested = requested_buffers()
    amx = amx_compiled()
    repack_found = repack_buffer_type() is not None if amx else True
    if amx and requested is None:
        gguf_tensors(path)  # a corrupt file is named now, not tried in a child and cached
    probe = cached_probe(path, n_threads) if amx and requested is None else None
    return model_buffers(choose_buffers(amx, repack_found, requested, probe), amx, path, cpu_blocks)


def load_model(path: str | Path, n_threads: int, gpu_layers: int = 0,
               cpu_blocks: int | None = None) -> tuple[int | None, str, dict[str, float]]:
    """llama.cpp's model of a GGUF file (a ``llama_model`` pointer; None when llama.cpp cannot
    load it), ``gpu_layers`` of its layers on the build's GPU (llama.cpp's n_gpu_layers:
    :mod:`.offload`) and the rest's weights in the buffer type chosen for this build and machine
    (:func:`resolve_buffers`; cpu_blocks: the blocks left on the CPU, None: all):
    (model, the choice, the buffer types llama.cpp reported holding the weights, {name: MiB}).
    Weights placed in CPU_REPACK by name that fail to load are loaded again in plain memory."""
    import llama_cpp

    from .lib import weight_buffer_log

    placement = resolve_buffers(path, n_threads, cpu_blocks)
    for attempt in (placement, ModelBuffers("none", False) if placement.patterns else None):
        if attempt is None:
            break
        mparams = llama_cpp.llama_model_default_params()
        mparams.n_gpu_layers = gpu_layers
        attempt.apply(mparams)
        with weight_buffer_log() as seen:
            model = llama_cpp.llama_model_load_from_file(str(path).encode("utf-8"), mparams)
        if model:
            return model, attempt.choice, dict(seen)
    return None, "none", {}
