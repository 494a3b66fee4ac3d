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

from collections import deque
from dataclasses import dataclass
from typing import Callable, Sequence

import numpy as np

from ..limits import is_int


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
        """Read back :meth:`to_dict`'s JSON. Raises ValueError unless every n is an integer >= 1
        and every time a finite number of seconds in [MIN_FORWARD_S, MAX_FORWARD_S] (a cache
        file edited by hand, or cut off: zeros would divide by zero, NaN would never draft)."""
        ns, seconds = d["ns"], d["seconds"]
        if not isinstance(ns, list) or not isinstance(seconds, list):
            raise ValueError("ns and seconds must be lists")
        if not all(is_int(n) and n >= 1 for n in ns):
            raise ValueError(f"every n must be an integer >= 1, got {ns!r:.60}")
        if not all(isinstance(s, (int, float)) and not isinstance(s, bool) and MIN_FORWARD_S <= s <= MAX_FORWARD_S
                   for s in seconds):
            raise ValueError(f"every T(n) must be {MIN_FORWARD_S:g}..{MAX_FORWARD_S:g} s, got {seconds!r:.60}")
        return cls(tuple(ns), tuple(float(s) for s in seconds))


# What a forward's measured time may be (seconds): bounds for reading a curve back from a
# file, far outside anything measured (a tiny module's forward ~50 us; a 1.5B model's
# 128-token forward on 2 slow cores ~3 s).
MIN_FORWARD_S = 1e-7
MAX_FORWARD_S = 3600.0


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


def choose_k(expected: np.ndarray, draft_cost: float, T: np.ndarray, extra: float = 0.0) -> tuple[int, float]:
    """The one K chooser: the k in 0..K that maximises the expected committed tokens per
    second, expected[k] / (extra [k > 0] + k draft_cost + T(k + 1)) (Leviathan et al. 2023,
    Eq. 1 over the measured T(n)), and that rate. expected: [K+1] committed tokens of a step
    drafting k (expected[0] = 1); T: the T(n) table indexed by n (>= K+2 entries); extra:
    one-off seconds a drafting step costs on top (a draft model's catch-up). Ties go to the
    smaller k; k = 0 is a plain step."""
    K = len(expected) - 1
    k = np.arange(K + 1)
    rates = np.asarray(expected) / (extra * (k > 0) + k * draft_cost + np.asarray(T)[1:K + 2])
    best = int(np.argmax(rates))
    return best, float(rates[best])


class DraftStepCost:
    """What a draft model's drafting step of k tokens costs (seconds): ``step`` + k ``per_token``,
    fitted online to the observed proposals (least squares, older steps weighing ``keep`` times
    less each step), its slope held toward the prior ``per_token`` (the measured one-token
    forward) with ``prior_weight``, so that proposals all of one k still give a line: the
    slope stays near one forward per token and the rest is the step's fixed part.

    Why a line, not a cost per token: a draft model across tokenizers (SLEM) runs about k + 2
    forwards for k target tokens (the word it may not have finished, the held-back last token).
    Averaged per token at k = 2, that charged K = 6 half again what it costs (torch bf16, Zen 4:
    ~42 ms a forward, ~130 ms a 2-token draft), and the controller, planning with it, kept
    drafting 1-2 tokens where 4 paid 1.3x more.
    """

    def __init__(self, per_token: float, step: float = 0.0, keep: float = 0.8, prior_weight: float = 2.0) -> None:
        self.per_token, self.step, self.keep = float(per_token), float(step), keep
        self._prior, self._lam = float(per_token), prior_weight
        self._sums = np.zeros(5)  # weight, k, seconds, k^2, k * seconds

    def observe(self, k: int, seconds: float) -> None:
        """A proposal of k >= 1 tokens took ``seconds``."""
        self._sums = self.keep * self._sums + np.array([1.0, k, seconds, k * k, k * seconds])
        w, sk, ss, skk, sks = self._sums
        mk, ms = sk / w, ss / w
        b = ((sks - mk * ss) + self._lam * self._prior) / ((skk - mk * sk) + self._lam)
        a = ms - b * mk
        if a < 0.0 or b < 0.0:  # a line through 0: the mean cost per token
            a, b = 0.0, ms / mk
        self.step, self.per_token = float(a), float(b)

    def __call__(self, k: int) -> float:
        """Seconds a proposal of k tokens is expected to take (0 for k = 0)."""
        return self.step + k * self.per_token if k > 0 else 0.0


class ObservedCurve:
    """T(n) as the controller plans with it: the measured curve, corrected by the step
    times actually observed (live costs come first).

    Every verification step is a free sample of T(n) (its forward plus the acceptance
    rule), every plain step one of T(1). Per measured point, the ratio observed / measured
    is the median of the last ``window`` samples nearest to it, so a few outliers (a burst
    of load) do not swing it and a real change is followed within a few steps. A point with
    ``min_samples`` samples is *trusted*; an untrusted point takes the ratio of its trusted
    neighbours (interpolated in n; the overall ratio ``drift``, the median of the last
    2 ``window`` samples at any size, before any point is trusted) and is then kept within
    what the trusted points allow (:meth:`values`): no clear fall below a smaller
    trusted size (beyond the fall the measured curve itself shows between them: a kernel's
    cheap block size), no more than a larger one, and no higher cost per token than a
    smaller one. So a measured curve that was wrong in shape (T(1) measured during a burst) cannot
    make an unobserved size look cheap or dear beyond what the observed ones permit.

    With ``context`` costs (:class:`.context_costs.ContextCosts`, set once measured), a step
    after c cached tokens is expected to cost base(n) + extra(n, c): a sample's ratio is taken
    to that, and :meth:`table` plans at a given context with the same ratios.

    base: the measured curve. window: samples per point kept. min_samples: samples that make
    a point trusted.
    """

    FALL = 0.9  # an untrusted T(n) is at least this times a trusted T(m), m < n
    RISE = 1.1  # ... and at most this times a trusted T(m), m > n
    PER_TOKEN = 1.35  # ... and T(n)/n at most this times a trusted T(m)/m, m < n
    GROUNDED_N = 16  # a live curve replaces the measured one only when observed up to here (grounded)

    def __init__(self, base: CostCurve, window: int = 9, min_samples: int = 2) -> None:
        self.base = base
        self.window = window
        self.min_samples = min_samples
        self.samples = 0
        self._recent = [deque(maxlen=window) for _ in base.ns]
        self._all: deque = deque(maxlen=2 * window)
        self._ns = np.asarray(base.ns, dtype=np.float64)
        self._base_s = np.asarray(base.seconds, dtype=np.float64)
        self._values: np.ndarray | None = None
        self._base_table = np.array([base(1)])  # base(n) for n = 0..len-1, grown on demand
        self.context = None  # ContextCosts, once measured

    @property
    def drift(self) -> float:
        """The overall ratio observed / measured (1.0 before any sample): far from 1, the
        measurement no longer describes the machine."""
        return _median(self._all) if self._all else 1.0

    def observe(self, n: int, seconds: float, context: int = 0) -> None:
        """One step forwarded n tokens in ``seconds`` after ``context`` cached tokens."""
        r = seconds / (self.base(n) + (self.context(n, context) if self.context is not None else 0.0))
        j = int(np.argmin(np.abs(self._ns - n)))
        self._recent[j].append(r)
        self._all.append(r)
        self.samples += 1
        self._values = None

    def observed_points(self) -> list[tuple[int, float]]:
        """(n, seconds) at each measured size with live samples: the median of its recent
        step times (each kept as a ratio to the measured curve), for charts."""
        recent = [tuple(d) for d in self._recent]  # copied at once: the serving thread appends to them
        return [(int(n), float(s) * _median(d)) for n, s, d in zip(self.base.ns, self.base.seconds, recent) if d]

    def trusted(self) -> np.ndarray:
        """[len(base.ns)] bool: the points with enough live samples."""
        return np.array([len(d) >= self.min_samples for d in self._recent])

    def values(self) -> np.ndarray:
        """[len(base.ns)] T at the measured sizes as planned with (seconds)."""
        if self._values is not None:
            return self._values
        trusted = self.trusted()
        drift = self.drift  # every step plans with these: small medians in Python, not numpy (about 20x faster)
        ratio = np.array([_median(d) if ok else drift for d, ok in zip(self._recent, trusted)])
        n = self._ns
        if trusted.any() and not trusted.all():  # untrusted: the ratio of the trusted neighbours
            ratio[~trusted] = np.interp(n[~trusted], n[trusted], ratio[trusted])
        v = self._base_s * ratio
        if trusted.any() and not trusted.all():
            v = self._bounded(v, trusted)
        if self._ns[0] == 1:  # a forward of n tokens costs at most n one-token steps: slower samples are load
            v = np.minimum(v, self._ns * v[0])
        self._values = v
        return v

    def _bounded(self, v: np.ndarray, trusted: np.ndarray) -> np.ndarray:
        """[len(base.ns)] v with each untrusted point kept within what the trusted ones allow
        (:meth:`values`). The bounds from trusted points are computed at once (they do not change
        while untrusted points are clamped); only the per-token bound, which follows the points
        already clamped, runs in order: about 35 us for 33 sizes, every step (timeit, AMD EPYC
        Zen 4)."""
        bs, ns = self._base_s, self._ns
        t = np.flatnonzero(trusted)
        # below[j]: max over trusted i < j of v[i] min(1, bs[j] / bs[i]); a fall the measured curve
        # itself shows (a kernel's cheap size) is kept: load makes a measured point dear, never cheap
        scaled = v[t, None] * np.minimum(1.0, bs[None, :] / bs[t, None])
        scaled[t[:, None] >= np.arange(len(v))[None, :]] = -np.inf
        below = scaled.max(axis=0)
        lo = np.where(np.isfinite(below), self.FALL * below, 0.0)
        # above[j]: min over trusted i > j of v[i]
        dear = np.where(trusted, v, np.inf)
        above = np.append(np.minimum.accumulate(dear[::-1])[::-1][1:], np.inf)
        hi = self.RISE * above
        vs, ok, ns_l = v.tolist(), trusted.tolist(), ns.tolist()
        lo_l, hi_l = lo.tolist(), hi.tolist()
        per_token = float("inf")  # min over smaller sizes of T(i) / i, as kept
        for j in range(len(vs)):
            if not ok[j]:
                h = min(hi_l[j], self.PER_TOKEN * per_token * ns_l[j])
                vs[j] = min(max(vs[j], lo_l[j]), max(h, lo_l[j]))
            per_token = min(per_token, vs[j] / ns_l[j])
        return np.asarray(vs)

    def ratios(self) -> np.ndarray:
        """[len(base.ns)] planned / measured at the measured sizes."""
        return self.values() / self._base_s

    def __call__(self, n: int) -> float:
        return self.base(n) * float(np.interp(n, self._ns, self.ratios()))

    def table(self, n_max: int, context: int = 0) -> np.ndarray:
        """[n_max + 1] T(n) for n = 0..n_max (T(0) := T(1)) after ``context`` cached tokens, in
        one vectorised pass."""
        if len(self._base_table) <= n_max:
            self._base_table = curve_table(self.base, n_max)
        n = np.arange(n_max + 1)
        base = self._base_table[: n_max + 1]
        if self.context is not None and context > self.context.base_context:
            base = base + self.context.row(n_max, context)
        return base * np.interp(np.maximum(n, 1), self._ns, self.ratios())

    def grounded(self) -> bool:
        """Whether live samples pin the curve at both ends of what is planned with: trusted at
        its smallest size and at one of GROUNDED_N tokens or more (its largest, if smaller).
        Only then does :meth:`live_curve` say more than an extrapolation: with samples at 1-3
        tokens alone, every larger size takes their ratio, capped at n T(1), which made a
        cached curve exactly n T(1) (seen on a loaded machine), so long blocks never looked
        worth verifying and were never observed to correct it."""
        ok = self.trusted()
        top = min(self.GROUNDED_N, int(self._ns[-1]))
        return bool(ok[0]) and any(o and n >= top for o, n in zip(ok.tolist(), self._ns.tolist()))

    def live_curve(self) -> CostCurve:
        """The curve as now planned with, at the measured sizes (what a cache rewrite stores)."""
        return CostCurve(self.base.ns, tuple(float(x) for x in self.values()))


def _median(xs) -> float:
    """The median of a few floats (a deque of at most 2 windows)."""
    s = sorted(xs)
    m = len(s) // 2
    return float(s[m]) if len(s) % 2 else 0.5 * (s[m - 1] + s[m])


def curve_table(curve: CostCurve, n_max: int) -> np.ndarray:
    """[n_max + 1] curve(n) for n = 0..n_max, with curve(0) := curve(1)."""
    return np.array([curve(max(n, 1)) for n in range(n_max + 1)])


def allocate_drafts(gains: Sequence[Sequence[float]], costs: Sequence[float], base_tokens: int,
                    base_expected: float, table: Callable[[int], np.ndarray],
                    step_costs: Sequence[float] | None = None) -> list[int]:
    """K for each generation of a batched step, chosen together (continuous batching).

    gains[i]: [cap_i] marginal expected committed tokens of generation i's 1st, 2nd, ...
    drafted token (E_i(j) - E_i(j-1); non-increasing, as under Eq. 1). costs[i]: its seconds
    per drafted token. base_tokens: tokens the forward holds without these drafts (each
    generation's last committed token, plus drafts fixed elsewhere); base_expected: the
    tokens they commit. table(n): T[0..>=n], the target's forward seconds. step_costs[i]: the
    seconds generation i's drafting step costs besides its per-token cost (a draft model's
    fixed part, :class:`DraftStepCost`), charged to its first drafted token; default none.

    Drafts are taken in order of marginal gain across all generations (optimal for each
    total when the gains are non-increasing), and the total n maximizes
    (base_expected + gains of the first n) / (T(base_tokens + n) + their drafting costs):
    a non-convex T(n) (a batch that fills a kernel tile) is handled exactly. Returns
    [len(gains)] K_i.
    """
    steps = step_costs if step_costs is not None else [0.0] * len(gains)
    items = [(float(g), float(c) + (float(steps[i]) if j == 0 else 0.0), i)
             for i, (gs, c) in enumerate(zip(gains, costs)) for j, g in enumerate(gs)]
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
