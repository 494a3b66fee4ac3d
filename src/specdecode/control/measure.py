"""Measuring T(n), the target's forward latency, so that a busy machine does not poison it
(its per-machine cache: :mod:`.costcache`).

A burst of load from another process (a browser, a compiler) lands on whatever is being
timed at that moment. Measuring each n several times in a row puts a whole burst on one or
two neighbouring points, and a curve such as T(1) 536 ms, T(2) 94 ms, T(6) 2388 ms follows
(seen on a user's first start). So:

- the sizes are timed in interleaved rounds (n = 1, 33, 2, 32, 3, 24, ... and again), a
  point's value is the median of its rounds;
- the result is checked against what any forward pass obeys (:func:`implausible_points`):
  T does not fall with n beyond the kernels' bends, T(n) <= n T(1), the cost per token of a
  block does not rise above that of a smaller block; points that break it are measured
  again, and those still implausible after that are repaired from their neighbours
  (isotonic regression, then the per-token bound);
- the CPU time that other processes used during the measurement is read from /proc/stat, so
  the statistics can say when the machine looked busy (:class:`Measurement`);
- the measurement is made of steps, one timed forward each (:func:`curve_steps`), so that a
  server can measure between its requests (:mod:`.calibration`); :func:`measure_forward_curve`
  runs them all at once.

Units: seconds.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass, field
from typing import Callable, Generator, Sequence, TypeVar

import numpy as np

from ..backends.base import Backend, SeqForward
from ..limits import MAX_NUM_SPECULATIVE_TOKENS, is_int
from .costmodel import CostCurve

T = TypeVar("T")

# Plausibility margins. A kernel that switches tiles at some size may make T(n) a little
# lower than T(n - 1) (on the AVX-512 machines T(16) is about T(9)); more than this fall is a
# measurement disturbed by load, unless measuring it again gives the same (CONFIRM_MARGIN):
# CPU_REPACK's kernels make T(4) 15% cheaper than T(3) on the Intel AMX machines and T(16) 18%
# cheaper than T(15) on Zen 4, near the margin. A block's
# cost per token may exceed a smaller block's by this factor (T(32)/32 is about 1.12 T(16)/16
# on the AVX2 machines).
FALL_MARGIN = 0.2
PER_TOKEN_MARGIN = 0.35
CONFIRM_MARGIN = 0.1  # a re-measured median within this of the first one: the point is real
# Other processes using at least this share of the machine's CPU time during a measurement
# make it "busy" in the statistics (and the cached curve says so).
BUSY_SHARE = 0.2


@dataclass(frozen=True)
class Measurement:
    """A measured curve and how far to trust it.

    curve: T(n) at the measured sizes. others_cpu: share (0..1) of the machine's CPU time that
    other processes used while it was measured (None where /proc/stat cannot be read).
    remeasured: sizes measured again because they looked implausible. repaired: sizes still
    implausible after that, set from their neighbours. confirmed: sizes cheaper than a smaller
    block beyond the plausibility margin that measured the same again (a kernel's cheap size),
    kept as measured. spread: median over sizes of the
    relative spread (interquartile range / median) of a size's rounds.
    """

    curve: CostCurve
    others_cpu: float | None = None
    remeasured: tuple[int, ...] = ()
    repaired: tuple[int, ...] = ()
    spread: float = 0.0
    confirmed: tuple[int, ...] = ()

    @property
    def busy(self) -> bool:
        """Whether the machine looked busy while this curve was measured."""
        return (self.others_cpu or 0.0) >= BUSY_SHARE or self.spread >= 0.3

    def note(self) -> str:
        """One line for the statistics block ("" for a clean measurement)."""
        parts = []
        if self.busy:
            share = f"other processes used {self.others_cpu:.0%} of the CPUs" if self.others_cpu is not None else \
                f"its rounds spread by {self.spread:.0%}"
            parts.append(f"the machine looked busy while the cost curve was measured ({share}); "
                         "live step times correct it")
        if self.repaired:
            parts.append(f"T(n) at n = {', '.join(map(str, self.repaired))} stayed implausible after re-measuring "
                         "and was set from its neighbours")
        return "; ".join(parts)

    def to_dict(self) -> dict:
        return {**self.curve.to_dict(), "others_cpu": self.others_cpu, "remeasured": list(self.remeasured),
                "repaired": list(self.repaired), "spread": self.spread, "confirmed": list(self.confirmed)}

    @classmethod
    def from_dict(cls, d: dict) -> "Measurement":
        """Read back :meth:`to_dict`'s JSON. Raises ValueError for anything else (a file edited by
        hand): the curve as :meth:`CostCurve.from_dict` reads it, shares and spreads finite
        numbers, the lists of sizes lists of integers."""
        def sizes(key: str) -> tuple[int, ...]:
            v = d.get(key, [])
            if not isinstance(v, list) or not all(is_int(n) for n in v):
                raise ValueError(f"{key} must be a list of sizes, got {v!r:.60}")
            return tuple(v)

        def share(key: str, default: float | None) -> float | None:
            v = d.get(key, default)
            if v is None:
                return None
            if not isinstance(v, (int, float)) or isinstance(v, bool) or not 0 <= v <= 1e6:
                raise ValueError(f"{key} must be a number >= 0, got {v!r:.60}")
            return float(v)

        return cls(CostCurve.from_dict(d), share("others_cpu", None), sizes("remeasured"), sizes("repaired"),
                   share("spread", 0.0), sizes("confirmed"))


def _breaks(n: np.ndarray, t: np.ndarray, i: int, j: int) -> bool:
    """Whether points i < j (by size) break a rule of :func:`implausible_points`."""
    return bool(t[j] < (1 - FALL_MARGIN) * t[i] or t[j] > (1 + PER_TOKEN_MARGIN) * (n[j] / n[i]) * t[i])


def implausible_points(ns: Sequence[int], seconds: Sequence[float]) -> list[int]:
    """Indices of the points of a measured curve that break what any forward obeys:

    - T(n) >= (1 - FALL_MARGIN) T(m) for m < n (a larger forward is not clearly cheaper);
    - T(n) <= (1 + PER_TOKEN_MARGIN) (n / m) T(m) for m < n (the cost per token does not rise
      clearly above a smaller block's; with m = 1: T(n) <= n T(1) within the margin).

    The points blamed are found greedily: the point in the most broken pairs is set aside
    (on a tie, the one farthest from the log-log line through the others), until the rest
    agree. So one disturbed point does not condemn its honest neighbours. ns ascending.
    """
    n = np.asarray(ns, dtype=np.float64)
    t = np.asarray(seconds, dtype=np.float64)
    keep = list(range(len(n)))
    blamed = []
    while True:
        count = {i: 0 for i in keep}
        for a, i in enumerate(keep):
            for j in keep[a + 1:]:
                if _breaks(n, t, i, j):
                    count[i] += 1
                    count[j] += 1
        worst = max(count.values(), default=0)
        if worst == 0:
            return sorted(blamed)
        tied = [i for i in keep if count[i] == worst]
        if len(tied) > 1:
            others = [i for i in keep if i not in tied] or keep
            if len(others) >= 2:
                b, a0 = np.polyfit(np.log(n[others]), np.log(t[others]), 1)
                tied.sort(key=lambda i: -abs(np.log(t[i]) - (a0 + b * np.log(n[i]))))
        blamed.append(tied[0])
        keep.remove(tied[0])


def unconfirmed_points(ns: Sequence[int], seconds: Sequence[float], confirmed: Sequence[int] = ()) -> list[int]:
    """:func:`implausible_points` less the sizes in ``confirmed`` (measured twice alike)."""
    return [i for i in implausible_points(ns, seconds) if ns[i] not in set(confirmed)]


def repair(ns: Sequence[int], seconds: Sequence[float], bad: Sequence[int], confirmed: Sequence[int] = ()) -> list[float]:
    """The curve with the ``bad`` points (indices) replaced from the trusted ones: interpolated
    between them (linear in n); where that still leaves implausible points other than the sizes
    ``confirmed`` (measured twice alike), made non-decreasing (pool-adjacent-violators isotonic
    regression); then capped by the per-token bound from T(1). The trusted points' own shape
    (a cheap block size) stays as measured."""
    n = np.asarray(ns, dtype=np.float64)
    t = np.asarray(seconds, dtype=np.float64).copy()
    good = [i for i in range(len(n)) if i not in set(bad)]
    if good and bad:
        t[list(bad)] = np.interp(n[list(bad)], n[good], t[good])
    if unconfirmed_points(ns, t, confirmed):
        t = _isotonic(t)
    return [float(v) for v in np.minimum(t, (1 + PER_TOKEN_MARGIN) * n / n[0] * t[0])]


def _isotonic(y: np.ndarray) -> np.ndarray:
    """Least-squares non-decreasing fit (pool adjacent violators)."""
    blocks: list[list[float]] = []  # [mean, weight]
    for v in y:
        blocks.append([float(v), 1.0])
        while len(blocks) > 1 and blocks[-2][0] > blocks[-1][0]:
            m2, w2 = blocks.pop()
            m1, w1 = blocks.pop()
            blocks.append([(m1 * w1 + m2 * w2) / (w1 + w2), w1 + w2])
    return np.concatenate([[m] * int(w) for m, w in blocks])


def interleaved(ns: Sequence[int], round_: int = 0) -> list[int]:
    """The order of one round: smallest, largest, next smallest, next largest, ... so that a
    burst of load lasting part of a round does not fall on neighbouring sizes; round r starts
    r * 3 places further on (so that load recurring with the round's period does not fall on
    the same sizes every round)."""
    s = sorted(ns)
    out = []
    while s:
        out.append(s.pop(0))
        if s:
            out.append(s.pop())
    shift = (3 * round_) % len(out) if out else 0
    return out[shift:] + out[:shift]


# (machine busy seconds, machine total seconds, this process's CPU seconds), or None where the
# machine's times cannot be read: what a measurement compares at its start and end.
CpuTimes = Callable[[], "tuple[float, float, float] | None"]


def read_cpu_times() -> tuple[float, float, float] | None:
    """The CPU time of the whole machine from /proc/stat (busy and total, idle and iowait
    counted as not busy) and of this process (os.times), in seconds; None where /proc/stat
    cannot be read (not Linux)."""
    try:
        with open("/proc/stat") as f:
            fields = [float(x) for x in f.readline().split()[1:]]
    except (OSError, ValueError):
        return None
    hz = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100
    idle = fields[3] + (fields[4] if len(fields) > 4 else 0.0)  # idle + iowait
    t = os.times()
    return (sum(fields) - idle) / hz, sum(fields) / hz, t.user + t.system


@dataclass
class _CpuClock:
    """How much of the machine other processes used between :meth:`start` and
    :meth:`others_share`, from ``read`` (:func:`read_cpu_times` unless given: a test scripts it)."""

    read: CpuTimes | None = None
    first: tuple[float, float, float] | None = field(default=None)

    def _now(self) -> tuple[float, float, float] | None:
        return (self.read or read_cpu_times)()

    def start(self) -> "_CpuClock":
        self.first = self._now()
        return self

    def others_share(self) -> float | None:
        end = self._now()
        if self.first is None or end is None:
            return None
        busy = end[0] - self.first[0] - (end[2] - self.first[2])
        total = end[1] - self.first[1]
        return float(min(1.0, max(0.0, busy / total))) if total > 0 else None


def _unread() -> None:
    """No reading of the machine's CPU times (a model whose layers run on a GPU)."""
    return None


def drive(steps: Generator[None, "bool | None", T]) -> T:
    """Run a measurement made of steps to its end, nothing else touching the backend meanwhile,
    and return its result. A measurement of steps (:func:`curve_steps`) is a generator that
    yields before each forward of the backend and is sent back whether other work used the
    backend's sequences since (here: never)."""
    try:
        steps.send(None)
        while True:
            steps.send(False)
    except StopIteration as stop:
        return stop.value


def _remeasure(ns: Sequence[int], samples: dict[int, list[float]],
               time_one: Callable[[int], Generator[None, "bool | None", float]], rounds: int,
               retries: int) -> Generator[None, "bool | None", tuple[set[int], set[int]]]:
    """Measure the implausible points of ``samples`` again (``rounds`` interleaved rounds of them
    and of the smallest size, up to ``retries`` times), adding to ``samples``; returns the sizes
    measured again and those confirmed: clearly cheaper than a smaller block and within
    CONFIRM_MARGIN of their first median again (load only slows a forward, so a point that
    looked slow is never confirmed). Made of steps (:func:`drive`), as time_one is."""
    medians = lambda: [float(np.median(samples[n])) for n in ns]  # noqa: E731
    remeasured: set[int] = set()
    confirmed: set[int] = set()
    for _ in range(retries):
        bad = unconfirmed_points(ns, medians(), confirmed)
        if not bad:
            break
        again = sorted({ns[i] for i in bad} | {ns[0]})
        remeasured.update(ns[i] for i in bad)
        first = {n: float(np.median(samples[n])) for n in again}
        fresh: dict[int, list[float]] = {n: [] for n in again}
        for r in range(rounds):
            for n in interleaved(again, r + 1):
                fresh[n].append((yield from time_one(n)))
        for n in again:
            samples[n].extend(fresh[n])
            now = float(np.median(fresh[n]))
            cheap = any(now < (1 - FALL_MARGIN) * first.get(m, float(np.median(samples[m]))) for m in ns if m < n)
            if cheap and abs(now / first[n] - 1.0) <= CONFIRM_MARGIN:
                confirmed.add(n)
    return remeasured, confirmed


def measure_forward_curve(backend: Backend, ns: Sequence[int], context: int = 64, rounds: int = 3,
                          retries: int = 2, timer: Callable[[], float] = time.perf_counter,
                          cpu_times: CpuTimes | None = None) -> Measurement:
    """Time forward(n tokens) after a context of ``context`` tokens, at each n in ns.

    The sizes are timed in ``rounds`` interleaved rounds (:func:`interleaved`, after one
    untimed warm-up of each shape) and each takes the median of its rounds. Points that
    :func:`implausible_points` rejects are measured again (``rounds`` more rounds of them
    and of n = 1, up to ``retries`` times). A point clearly cheaper than a smaller block whose
    new median is within CONFIRM_MARGIN of its first is confirmed: a real property of the
    kernels (a cheap block size; load only ever makes a forward slower), kept as measured; those still implausible and never confirmed are repaired (:func:`repair`) and
    named in the result.

    A size beyond one sequence's block (MAX_NUM_SPECULATIVE_TOKENS + 1 tokens) is what a
    batched step of several generations forwards: on a backend of several sequences it is
    measured as blocks of that size on as many sequences, each after the same context.
    The backend's caches are restored to empty afterwards. A small context window (a few
    dozen tokens) shortens the context and measures only the sizes that fit in it (a step
    can never verify more); the curve extrapolates beyond them. timer: seconds (a test's
    scripted clock); cpu_times: what tells a busy machine (:func:`read_cpu_times`; not read for
    a backend whose layers run on a GPU, ``placement``: the CPU's load says nothing of its forwards).
    """
    return drive(curve_steps(backend, ns, context, rounds, retries, timer, cpu_times))


def curve_steps(backend: Backend, ns: Sequence[int], context: int = 64, rounds: int = 3, retries: int = 2,
                timer: Callable[[], float] = time.perf_counter,
                cpu_times: CpuTimes | None = None) -> Generator[None, "bool | None", Measurement]:
    """:func:`measure_forward_curve` one timed forward at a time, so that a server can measure
    between requests: made of steps (:func:`drive`), it yields before each forward; sent True,
    other work used the backend's sequences meanwhile, and the context is prefilled again
    before the next forward (the caller must make sure that nothing reuses what the
    measurement left in sequences 0 .. used - 1: a server's engine forgets its slots' cached
    prefixes). Returns the :class:`Measurement`."""
    block = MAX_NUM_SPECULATIVE_TOKENS + 1
    # The tokens one sequence takes for size n: all of them on a backend of one sequence.
    rows = (lambda n: n) if backend.n_seq == 1 else (lambda n: min(n, block))  # noqa: E731
    context = max(0, min(context, backend.n_ctx - 1 - rows(max(ns))))
    ns = [n for n in ns if rows(n) <= backend.n_ctx - 1 - context] or [1]
    vocab = backend.n_vocab
    rng = np.random.default_rng(0)
    base = [int(t) for t in rng.integers(min(100, vocab - 1), min(vocab, 30000), size=context)]
    used = min(backend.n_seq, -(-max(ns) // block))
    # Other processes' CPU time says a CPU-bound forward was slowed; a model on a GPU is not judged by it.
    clock = _CpuClock(cpu_times if backend.placement.on_cpu else _unread).start()
    shapes = {}
    for n in ns:
        toks = [int(t) for t in rng.integers(min(100, vocab - 1), min(vocab, 30000), size=n)]
        if n <= block or used == 1:
            shapes[n] = [SeqForward(0, toks, range(n))]
        else:
            parts = [toks[i:i + block] for i in range(0, n, block)][:used]
            shapes[n] = [SeqForward(seq, part, range(len(part))) for seq, part in enumerate(parts)]

    samples: dict[int, list[float]] = {n: [] for n in ns}
    ready = False  # the context is in sequences 0 .. used - 1

    def time_one(n: int) -> Generator[None, "bool | None", float]:
        nonlocal ready
        touched = yield
        if touched or not ready:
            for seq in range(used):
                backend.rollback(0, seq=seq)
                if base:
                    backend.forward(base, logits_for=[], seq=seq)
            ready = True
        t0 = timer()
        backend.forward_batch(shapes[n])
        dt = timer() - t0
        for item in shapes[n]:
            backend.rollback(context, seq=item.seq)
        return dt

    for n in ns:  # warm-up of each shape
        yield from time_one(n)
    for r in range(rounds):
        for n in interleaved(ns, r):
            samples[n].append((yield from time_one(n)))
    medians = lambda: [float(np.median(samples[n])) for n in ns]  # noqa: E731
    remeasured, confirmed = yield from _remeasure(ns, samples, time_one, rounds, retries)
    for seq in range(used):
        backend.rollback(0, seq=seq)
    secs = medians()
    bad = unconfirmed_points(ns, secs, confirmed)
    if bad:
        secs = repair(ns, secs, bad, sorted(confirmed))
    spread = float(np.median([(np.percentile(samples[n], 75) - np.percentile(samples[n], 25)) / max(np.median(samples[n]), 1e-12)
                              for n in ns]))
    return Measurement(CostCurve(tuple(ns), tuple(secs)), clock.others_share(), tuple(sorted(remeasured)),
                       tuple(ns[i] for i in bad), round(spread, 4), tuple(sorted(confirmed)))
