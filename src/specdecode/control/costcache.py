"""The per-machine cache of the target's measured T(n) (:mod:`.measure`): where it lives, what
its key depends on, when it is measured again (another key, other sizes, age, implausible, or
a check at load that contradicts a curve that may describe a busy machine or was marked
stale), and its rewrite from live step times. Reading the cache (:func:`read_cached`) is apart
from measuring, so that a server can answer with the cached curve while the check or the
measurement runs between its requests (:mod:`.calibration`).

Units: seconds.
"""

from __future__ import annotations

import hashlib
import platform
import time
from pathlib import Path
from typing import Callable, Generator, Sequence

from ..backends.base import Backend
from ..files import read_cache_json, write_cache_json
from ..limits import MAX_NUM_SPECULATIVE_TOKENS
from .costmodel import CostCurve
from .measure import Measurement, drive, measure_forward_curve, repair, unconfirmed_points


def machine_key(backend: Backend) -> str:
    """What a measured curve depends on: model file, backend (with its ``cost_key``: dtype and
    weights for torch), threads, device, CPU, library version."""
    after = [str(backend.n_threads or ""), str(backend.device), backend.cost_key]
    if backend.n_seq > 1:  # a cache of several sequences (llama.cpp's unified KV) times differently
        after.append(f"n_seq={backend.n_seq}")
    return key_of(backend, [type(backend).__name__, backend.name, platform.machine(), platform.processor()], after)


def key_of(backend: Backend, before: list[str], after: list[str]) -> str:
    """A cache key: before, the model file (path, size, time), after, the CPU's name and
    llama.cpp's version, hashed (24 hex digits)."""
    parts = list(before)
    path = backend.path
    if path is not None and Path(path).exists():
        st = Path(path).stat()
        parts += [str(Path(path).resolve()), str(st.st_size), str(st.st_mtime_ns)]
    parts += after
    try:
        with open("/proc/cpuinfo") as f:
            parts.append(next((ln for ln in f if ln.startswith("model name")), ""))
    except OSError:
        pass
    try:
        import llama_cpp

        parts.append(llama_cpp.__version__)
    except ImportError:
        pass
    return hashlib.sha256("|".join(parts).encode()).hexdigest()[:24]


# A cached curve older than this is measured again (seconds): a machine's load, its
# library builds and its thermal state change over weeks.
COST_CACHE_MAX_AGE_S = 14 * 24 * 3600
# A cached curve that may describe a busy machine is checked at load (check_curve): sizes timed
# again in this many rounds must lie within these ratios of the cached curve, or the curve is
# measured again. Seen here (AMD EPYC Zen 4, default target): a cache rewritten from live steps
# while the test suite ran beside a server held T(16) = 696 ms and T(33) = 1398 ms (T(n) = n T(1)
# from n = 8 on), where the idle machine measures 446 ms and 760 ms; every later start planned
# with it, K stayed at 5 and aider's whole-file edits decoded at 1.25x plain (1.42x once measured
# again: benchmarks/results/aider/zen4_six_edits.txt).
CHECK_ROUNDS = 3
CHECK_BOUNDS = (0.75, 1.33)


def cost_cache_path(backend: Backend, cache_dir: Path) -> Path:
    """Where the measured curve of this backend on this machine is cached."""
    return cache_dir / "costs" / f"{machine_key(backend)}.json"


# What measures a curve as steps (:func:`.measure.drive`): called as measure(backend, ns) for a
# curve, measure(backend, sizes, rounds=r) for a check.
MeasureSteps = Callable[..., Generator[None, "bool | None", Measurement]]


def _at_once(backend: Backend, ns: Sequence[int], **kw) -> Generator[None, "bool | None", Measurement]:
    """:func:`measure_forward_curve` as one step (looked up when called, so a test can script it)."""
    return measure_forward_curve(backend, ns, **kw)
    yield  # noqa: unreachable: it makes this a generator


def cached_measurement(backend: Backend, ns: Sequence[int], cache_dir: Path, refresh: bool = False,
                       max_age_s: float = COST_CACHE_MAX_AGE_S,
                       on_measure: Callable[[Sequence[int]], None] | None = None) -> Measurement:
    """:func:`measure_forward_curve` once per (model, machine) key; later calls read the JSON
    cache. The curve is measured again when the cache was written under another key (a
    different model file, library build, thread count or CPU), for other ns, more than
    ``max_age_s`` seconds ago, or is implausible (a curve cached by an older version, or
    edited by hand).

    A cached curve that may describe a busy machine (:func:`_suspect`: measured while other
    processes used the CPUs, or rewritten from live step times, which a busy machine sets), or
    that was marked stale by :func:`mark_stale` (live steps, perhaps slowed by load, disagreed
    with it), is checked first (:func:`check_curve`): when an idle check contradicts it, it is
    measured again; when the check agrees it is marked checked (no longer stale) and trusted
    from then on; when the machine is busy during the check, it is kept as it is (one slow run
    does not cost a whole measurement on a busy machine). on_measure(ns): called just before a
    measurement (to tell a user why the start takes longer)."""
    return drive(cached_measurement_steps(backend, ns, cache_dir, refresh, max_age_s, on_measure))


def read_cached(backend: Backend, ns: Sequence[int], cache_dir: Path, max_age_s: float = COST_CACHE_MAX_AGE_S,
                refresh: bool = False) -> tuple[Measurement | None, str]:
    """What the cache holds for this backend at ns and what it needs, without timing anything:
    (measurement, "use"); (measurement, "check"): suspect or stale (:func:`cached_measurement`);
    (measurement or None, "measure"): None when nothing usable is cached (no file, another key,
    other sizes, implausible, unreadable), the curve when it is only too old."""
    data = None if refresh else read_cache_json(cost_cache_path(backend, cache_dir))
    if data is None:
        return None, "measure"
    try:
        m = Measurement.from_dict(data)
        if (tuple(m.curve.ns) != tuple(ns) or data.get("key") != machine_key(backend)
                or unconfirmed_points(m.curve.ns, m.curve.seconds, m.confirmed)):
            return None, "measure"
        if time.time() - float(data.get("measured_at", 0)) > max_age_s:
            return m, "measure"
    except (ValueError, KeyError, TypeError, AttributeError, OverflowError):  # edited, or another version's
        return None, "measure"
    return m, "check" if data.get("stale") or _suspect(data, m.busy) else "use"


def cached_measurement_steps(backend: Backend, ns: Sequence[int], cache_dir: Path, refresh: bool = False,
                             max_age_s: float = COST_CACHE_MAX_AGE_S,
                             on_measure: Callable[[Sequence[int]], None] | None = None,
                             measure: MeasureSteps = _at_once) -> Generator[None, "bool | None", Measurement]:
    """:func:`cached_measurement` made of steps (:func:`.measure.drive`), its checks and
    measurements timed by ``measure`` (:func:`.measure.curve_steps` for one forward a step)."""
    path = cost_cache_path(backend, cache_dir)
    m, need = read_cached(backend, ns, cache_dir, max_age_s, refresh)
    if m is not None and need == "use":
        return m
    if m is not None and need == "check":
        verdict = yield from check_curve_steps(backend, m.curve, measure=measure)
        data = read_cache_json(path)
        if verdict == "agrees" and data is not None:
            write_cache_json(path, {**{k: v for k, v in data.items() if k != "stale"}, "checked_at": time.time()})
        if verdict != "contradicts":  # agrees, or the machine is busy now: no better curve to get
            return m
    if on_measure is not None:
        on_measure(ns)
    m = yield from measure(backend, ns)
    if tuple(m.curve.ns) == tuple(ns):  # a context too small for every size measures fewer: not kept
        write_cache_json(path, {**m.to_dict(), "model": backend.name, "key": machine_key(backend),
                                "measured_at": time.time(), "source": "measured"})
    return m


def _suspect(data: dict, busy: bool) -> bool:
    """Whether a cached curve (its JSON; ``busy``: the machine looked busy while it was
    measured) may describe a busy machine and has not been checked since it was written:
    measured busy, or rewritten from live step times (:func:`rewrite_from_live`)."""
    unchecked = float(data.get("checked_at", 0)) < float(data.get("measured_at", 0))
    return unchecked and (busy or data.get("source") == "live")


def check_curve(backend: Backend, curve: CostCurve, rounds: int = CHECK_ROUNDS) -> str:
    """Time T(n) again at three of the curve's sizes (the smallest, 16 or the nearest, and
    the largest one sequence verifies) in ``rounds`` interleaved rounds, about a tenth of a
    full measurement, and compare. Returns "agrees" (every size within CHECK_BOUNDS of the
    curve), "contradicts" (one is not) or "busy" (the machine looked busy during the check:
    it cannot judge the curve)."""
    return drive(check_curve_steps(backend, curve, rounds))


def check_curve_steps(backend: Backend, curve: CostCurve, rounds: int = CHECK_ROUNDS,
                      measure: MeasureSteps = _at_once) -> Generator[None, "bool | None", str]:
    """:func:`check_curve` made of steps (:func:`.measure.drive`), timed by ``measure``."""
    top = max([n for n in curve.ns if n <= MAX_NUM_SPECULATIVE_TOKENS + 1] or [curve.ns[0]])
    mid = min(curve.ns, key=lambda n: abs(n - 16))
    sizes = sorted({curve.ns[0], min(mid, top), top})
    m = yield from measure(backend, sizes, rounds=rounds)
    if m.busy:
        return "busy"
    lo, hi = CHECK_BOUNDS
    ok = all(lo <= s / curve(n) <= hi for n, s in zip(m.curve.ns, m.curve.seconds))
    return "agrees" if ok else "contradicts"


def cached_forward_curve(backend: Backend, ns: Sequence[int], cache_dir: Path, refresh: bool = False,
                         max_age_s: float = COST_CACHE_MAX_AGE_S) -> CostCurve:
    """The curve of :func:`cached_measurement`."""
    return cached_measurement(backend, ns, cache_dir, refresh, max_age_s).curve


def mark_stale(backend: Backend, cache_dir: Path, why: str) -> None:
    """Flag the cached curve of this backend so that the next :func:`cached_forward_curve`
    checks it (:func:`check_curve`) and measures it again where an idle check contradicts it
    (``why`` is kept in the file for whoever reads it)."""
    path = cost_cache_path(backend, cache_dir)
    data = read_cache_json(path)
    if data is not None:
        write_cache_json(path, {**data, "stale": why})


def rewrite_from_live(backend: Backend, cache_dir: Path, curve: CostCurve | None, why: str) -> None:
    """Replace the cached curve of this backend by ``curve`` (the live step times, folded into
    the measured points; repaired where implausible); mark the cache stale instead when it
    cannot be made plausible, or when curve is None (the live steps observed too few sizes:
    :meth:`ObservedCurve.grounded`), so the next start checks it (:func:`cached_measurement`). ``why`` is kept
    in the file."""
    path = cost_cache_path(backend, cache_dir)
    data = read_cache_json(path)
    if data is None:
        return
    if curve is None:
        write_cache_json(path, {**data, "stale": f"{why}; too few sizes observed to rewrite the curve from them"})
        return
    confirmed = tuple(data.get("confirmed", ()))  # a kernel's cheap sizes, measured twice alike
    bad = unconfirmed_points(curve.ns, curve.seconds, confirmed)
    if bad:
        curve = CostCurve(curve.ns, tuple(repair(curve.ns, curve.seconds, bad, confirmed)))
    if tuple(data.get("ns", ())) != tuple(curve.ns) or unconfirmed_points(curve.ns, curve.seconds, confirmed):
        write_cache_json(path, {**data, "stale": why})
        return
    write_cache_json(path, {**data, **curve.to_dict(), "measured_at": time.time(), "source": "live", "rewritten": why})
