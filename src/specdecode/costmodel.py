"""Cost model: measured latencies and the expected gain of speculating K tokens.

Sources: Leviathan, Kalman, Matias (ICML 2023): Eq. 1 gives the expected number of
tokens committed per target pass with per-token acceptance alpha and K drafts,
E(alpha, K) = (1 - alpha^(K+1)) / (1 - alpha); Section 3.4 (Theorem 3.8) gives the
expected walltime improvement E / (K c + T(K+1)/T(1)) with c the draft's relative cost.
Here T(n) is not assumed constant: it is measured (a small CPU is compute-bound, so
verifying K+1 tokens may cost several times one token).

Units: seconds.
"""

from __future__ import annotations

import hashlib
import json
import os
import platform
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

import numpy as np

from .backends.base import Backend


def expected_tokens(alpha: float, k: int) -> float:
    """E(alpha, K) = (1 - alpha^(K+1)) / (1 - alpha): tokens per target pass (Leviathan et al., Eq. 1).

    alpha in [0, 1]; k >= 0. For alpha == 1 the limit K + 1.
    """
    if not (0.0 <= alpha <= 1.0):
        raise ValueError(f"alpha = {alpha} outside [0, 1]")
    if k < 0:
        raise ValueError(f"k = {k} < 0")
    if alpha >= 1.0:
        return float(k + 1)
    return (1.0 - alpha ** (k + 1)) / (1.0 - alpha)


def expected_tokens_positional(acceptance: Sequence[float]) -> float:
    """Tokens per pass with conditional acceptance a_i at draft position i (0-based):
    1 + sum_i prod_{j<=i} a_j. Equals expected_tokens(alpha, K) when every a_i = alpha."""
    total, run = 1.0, 1.0
    for a in acceptance:
        run *= a
        total += run
    return total


@dataclass(frozen=True)
class CostCurve:
    """T(n): seconds for one target forward of n tokens, measured at n = ns.

    Between measured points it interpolates linearly; beyond the last it extrapolates
    with the least-squares line through all points.
    """

    ns: tuple[int, ...]
    seconds: tuple[float, ...]

    def __post_init__(self) -> None:
        if len(self.ns) != len(self.seconds) or not self.ns:
            raise ValueError("CostCurve needs as many seconds as ns, at least one")
        if list(self.ns) != sorted(self.ns):
            raise ValueError("CostCurve ns must be ascending")

    def __call__(self, n: int) -> float:
        if n <= self.ns[-1]:
            return float(np.interp(n, self.ns, self.seconds))
        a, b = fit_linear(self.ns, self.seconds)
        return max(a + b * n, self.seconds[-1])

    def to_dict(self) -> dict:
        return {"ns": list(self.ns), "seconds": list(self.seconds)}

    @classmethod
    def from_dict(cls, d: dict) -> "CostCurve":
        return cls(tuple(int(n) for n in d["ns"]), tuple(float(s) for s in d["seconds"]))


def fit_linear(ns: Sequence[float], ts: Sequence[float]) -> tuple[float, float]:
    """Least-squares line t = a + b n through the points; returns (a, b). One point: (t, 0)."""
    x = np.asarray(ns, dtype=np.float64)
    y = np.asarray(ts, dtype=np.float64)
    if len(x) == 1:
        return float(y[0]), 0.0
    b, a = np.polyfit(x, y, 1)
    return float(a), float(b)


def step_rate(alpha: float, k: int, target: CostCurve, draft_cost: float) -> float:
    """Expected committed tokens per second of a step drafting k tokens:
    E(alpha, k) / (k * draft_cost + T(k + 1)). k = 0 is a plain step: 1 / T(1)."""
    return expected_tokens(alpha, k) / (k * draft_cost + target(k + 1))


def best_k(alpha: float, kmax: int, target: CostCurve, draft_cost: float) -> int:
    """argmax over k in 0..kmax of :func:`step_rate` (ties go to the smaller k)."""
    rates = [step_rate(alpha, k, target, draft_cost) for k in range(kmax + 1)]
    return int(np.argmax(rates))


def measure_forward_curve(backend: Backend, ns: Sequence[int], context: int = 64, reps: int = 5) -> CostCurve:
    """Time forward(n tokens) after a context of ``context`` tokens, median of reps.

    The backend's cache is restored to empty afterwards.
    """
    vocab = backend.n_vocab
    rng = np.random.default_rng(0)
    base = [int(t) for t in rng.integers(100, min(vocab, 30000), size=context)]
    backend.rollback(0)
    backend.forward(base, logits_for=[])
    secs = []
    for n in ns:
        toks = [int(t) for t in rng.integers(100, min(vocab, 30000), size=n)]
        backend.forward(toks, logits_for=range(n))  # warm-up of this shape
        backend.rollback(context)
        times = []
        for _ in range(reps):
            t0 = time.perf_counter()
            backend.forward(toks, logits_for=range(n))
            times.append(time.perf_counter() - t0)
            backend.rollback(context)
        secs.append(float(np.median(times)))
    backend.rollback(0)
    return CostCurve(tuple(ns), tuple(secs))


def machine_key(backend: Backend) -> str:
    """What a measured curve depends on: model file, backend (with its ``cost_key``: dtype and
    weights for torch), threads, device, CPU, library version."""
    parts = [type(backend).__name__, backend.name, platform.machine(), platform.processor()]
    path = backend.path
    if path is not None and Path(path).exists():
        st = Path(path).stat()
        parts += [str(Path(path).resolve()), str(st.st_size), str(st.st_mtime_ns)]
    parts += [str(backend.n_threads or ""), str(backend.device), backend.cost_key]
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


def cached_forward_curve(backend: Backend, ns: Sequence[int], cache_dir: Path, refresh: bool = False) -> CostCurve:
    """:func:`measure_forward_curve` once per (model, machine) key; later calls read the JSON cache."""
    path = cache_dir / "costs" / f"{machine_key(backend)}.json"
    if not refresh and path.exists():
        try:
            curve = CostCurve.from_dict(json.loads(path.read_text()))
            if tuple(curve.ns) == tuple(ns):
                return curve
        except (ValueError, KeyError):
            pass
    curve = measure_forward_curve(backend, ns)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(f".{os.getpid()}.tmp")
    tmp.write_text(json.dumps({**curve.to_dict(), "model": backend.name}))
    os.replace(tmp, path)
    return curve
