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
from typing import Callable, Sequence

import numpy as np

from ..backends.base import Backend, SeqForward
from ..files import write_text_atomic
from ..limits import MAX_NUM_SPECULATIVE_TOKENS


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


def expected_tokens_upto(alpha: float, kmax: int) -> np.ndarray:
    """[kmax + 1] E(alpha, k) for k = 0..kmax (Eq. 1, vectorised)."""
    if not (0.0 <= alpha <= 1.0):
        raise ValueError(f"alpha = {alpha} outside [0, 1]")
    k = np.arange(kmax + 1, dtype=np.float64)
    if alpha >= 1.0:
        return k + 1.0
    return (1.0 - alpha ** (k + 1.0)) / (1.0 - alpha)


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

    A size beyond one sequence's block (MAX_NUM_SPECULATIVE_TOKENS + 1 tokens) is what a
    batched step of several generations forwards: on a backend of several sequences it is
    measured as blocks of that size on as many sequences, each after the same context.
    The backend's caches are restored to empty afterwards. A small context window (a few
    dozen tokens) shortens the context and measures only the sizes that fit in it (a step
    can never verify more); the curve extrapolates beyond them.
    """
    block = MAX_NUM_SPECULATIVE_TOKENS + 1
    context = max(0, min(context, backend.n_ctx - 1 - min(max(ns), block)))
    ns = [n for n in ns if min(n, block) <= backend.n_ctx - 1 - context] or [1]
    vocab = backend.n_vocab
    rng = np.random.default_rng(0)
    base = [int(t) for t in rng.integers(100, min(vocab, 30000), size=context)]
    used = min(backend.n_seq, -(-max(ns) // block))
    for seq in range(used):
        backend.rollback(0, seq=seq)
        backend.forward(base, logits_for=[], seq=seq)
    secs = []
    for n in ns:
        toks = [int(t) for t in rng.integers(100, min(vocab, 30000), size=n)]
        if n <= block or used == 1:
            items = [SeqForward(0, toks, range(n))]
        else:
            parts = [toks[i:i + block] for i in range(0, n, block)][:used]
            items = [SeqForward(seq, part, range(len(part))) for seq, part in enumerate(parts)]
        times = []
        for rep in range(reps + 1):  # the first is a warm-up of this shape
            t0 = time.perf_counter()
            backend.forward_batch(items)
            if rep:
                times.append(time.perf_counter() - t0)
            for item in items:
                backend.rollback(context, seq=item.seq)
        secs.append(float(np.median(times)))
    for seq in range(used):
        backend.rollback(0, seq=seq)
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
    if backend.n_seq > 1:  # a cache of several sequences (llama.cpp's unified KV) times differently
        parts.append(f"n_seq={backend.n_seq}")
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


def cost_cache_path(backend: Backend, cache_dir: Path) -> Path:
    """Where the measured curve of this backend on this machine is cached."""
    return cache_dir / "costs" / f"{machine_key(backend)}.json"


def cached_forward_curve(backend: Backend, ns: Sequence[int], cache_dir: Path, refresh: bool = False,
                         max_age_s: float = COST_CACHE_MAX_AGE_S) -> CostCurve:
    """:func:`measure_forward_curve` once per (model, machine) key; later calls read the JSON
    cache. The curve is measured again when the cache was written under another key (a
    different model file, library build, thread count or CPU), for other ns, more than
    ``max_age_s`` seconds ago, or was marked stale by :func:`mark_stale` (observed step
    times drifted far from it)."""
    key = machine_key(backend)
    path = cost_cache_path(backend, cache_dir)
    if not refresh and path.exists():
        try:
            data = json.loads(path.read_text())
            curve = CostCurve.from_dict(data)
            fresh = time.time() - float(data.get("measured_at", 0)) <= max_age_s
            if tuple(curve.ns) == tuple(ns) and data.get("key") == key and fresh and not data.get("stale"):
                return curve
        except (ValueError, KeyError, TypeError):
            pass
    curve = measure_forward_curve(backend, ns)
    if tuple(curve.ns) == tuple(ns):  # a context too small for every size measures fewer: not kept
        write_text_atomic(path, json.dumps({**curve.to_dict(), "model": backend.name, "key": key,
                                            "measured_at": time.time()}))
    return curve


def mark_stale(backend: Backend, cache_dir: Path, why: str) -> None:
    """Flag the cached curve of this backend so that the next :func:`cached_forward_curve`
    measures it again (``why`` is kept in the file for whoever reads it)."""
    path = cost_cache_path(backend, cache_dir)
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return
    write_text_atomic(path, json.dumps({**data, "stale": why}))


class ObservedCurve:
    """T(n) as the controller plans with it: the measured curve, corrected by the step
    times actually observed.

    Every verification step is a free sample of T(n) (its forward plus the acceptance
    rule). The ratio observed / measured is followed per measured point (an exponential
    average over the samples nearest to it) and overall; a point with fewer than
    ``min_samples`` samples uses the overall ratio, so that overheads seen at the sizes in
    use also raise the sizes not yet tried. ``drift`` is that overall ratio: far from 1,
    the measurement no longer describes the machine.

    base: the measured curve. weight: weight of the newest sample in the averages.
    """

    def __init__(self, base: CostCurve, weight: float = 0.1, min_samples: int = 3) -> None:
        self.base = base
        self.weight = weight
        self.min_samples = min_samples
        self.drift = 1.0
        self.samples = 0
        self._ratio = [1.0] * len(base.ns)
        self._count = [0] * len(base.ns)
        self._base_table = np.array([base(1)])  # base(n) for n = 0..len-1, grown on demand

    def observe(self, n: int, seconds: float) -> None:
        """One step verified n tokens in ``seconds``."""
        r = seconds / self.base(n)
        j = int(np.argmin([abs(m - n) for m in self.base.ns]))
        w = max(self.weight, 1.0 / (self._count[j] + 1))  # the first samples count fully
        self._ratio[j] += w * (r - self._ratio[j])
        self._count[j] += 1
        self.samples += 1
        self.drift += max(self.weight, 1.0 / self.samples) * (r - self.drift)

    def _ratios(self) -> list[float]:
        return [r if c >= self.min_samples else self.drift for r, c in zip(self._ratio, self._count)]

    def __call__(self, n: int) -> float:
        return self.base(n) * float(np.interp(n, self.base.ns, self._ratios()))

    def table(self, n_max: int) -> np.ndarray:
        """[n_max + 1] T(n) for n = 0..n_max (T(0) := T(1)), in one vectorised pass."""
        if len(self._base_table) <= n_max:
            self._base_table = curve_table(self.base, n_max)
        n = np.arange(n_max + 1)
        return self._base_table[: n_max + 1] * np.interp(np.maximum(n, 1), self.base.ns, self._ratios())


def curve_table(curve: CostCurve, n_max: int) -> np.ndarray:
    """[n_max + 1] curve(n) for n = 0..n_max, with curve(0) := curve(1)."""
    return np.array([curve(max(n, 1)) for n in range(n_max + 1)])


def allocate_drafts(gains: Sequence[Sequence[float]], costs: Sequence[float], base_tokens: int,
                    base_expected: float, table: Callable[[int], np.ndarray]) -> list[int]:
    """K for each generation of a batched step, chosen together (continuous batching).

    gains[i]: [cap_i] marginal expected committed tokens of generation i's 1st, 2nd, ...
    drafted token (E_i(j) - E_i(j-1); non-increasing, as under Eq. 1). costs[i]: its seconds
    per drafted token. base_tokens: tokens the forward holds without these drafts (each
    generation's last committed token, plus drafts fixed elsewhere); base_expected: the
    tokens they commit. table(n): T[0..>=n], the target's forward seconds.

    Drafts are taken in order of marginal gain across all generations (optimal for each
    total when the gains are non-increasing), and the total n maximizes
    (base_expected + gains of the first n) / (T(base_tokens + n) + their drafting costs):
    a non-convex T(n) (a batch that fills a kernel tile) is handled exactly. Returns
    [len(gains)] K_i.
    """
    items = [(float(g), float(c), i) for i, (gs, c) in enumerate(zip(gains, costs)) for g in gs]
    order = sorted(range(len(items)), key=lambda j: -items[j][0])  # stable: a generation's drafts stay in order
    n = len(order)
    if n == 0:
        return [0] * len(gains)
    g = np.array([items[j][0] for j in order])
    c = np.array([items[j][1] for j in order])
    T = table(base_tokens + n)
    expected = base_expected + np.concatenate([[0.0], np.cumsum(g)])
    seconds = T[base_tokens + np.arange(n + 1)] + np.concatenate([[0.0], np.cumsum(c)])
    best = int(np.argmax(expected / seconds))  # ties go to fewer drafts
    quotas = [0] * len(gains)
    for j in order[:best]:
        quotas[items[j][2]] += 1
    return quotas
