"""Costs as a function of context: what a forward of n tokens costs more after c cached tokens
than after the few dozen the cost curve is measured after, T(n, c) - T(n, c0).

A verification's attention reads every cached token, so its cost grows with the context, and
more for a block than for one token. Measured on an AMD EPYC with AVX2 only (2 vCPU, default
target, flash attention on): T(1) 53 ms after 64 tokens, 79 ms after 4,096; T(33) 828 ms and
1,653 ms (docs/measured.md). A controller planning a long prompt's steps with the short
context's curve drafts more than pays.

- :class:`ContextCosts`: the extra seconds at a few contexts and sizes, interpolated linearly
  in both (attention's work is linear in the context and in the block), extrapolated beyond
  the largest measured context along its last segment;
- :func:`context_cost_steps`: the measurement, made of steps as :func:`.measure.curve_steps`
  is (one forward each: a chunk of the context's prefill, or a timed block), so that a server
  measures it between requests. The contexts are measured largest first on one sequence,
  rolled back to the next (no second prefill), and the base context last, in the same
  measurement: the extra is the difference of medians timed minutes apart at most;
- :func:`cached_context_costs` / :func:`read_cached_context_costs`: once per model and
  machine, cached beside the curve (:func:`.costcache.cost_cache_path`).

Live step times correct the sum T(n, c0) + extra(n, c) through the same ratio per size as the
curve (:class:`.costmodel.ObservedCurve`).

Units: seconds, tokens.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Generator, Sequence

import numpy as np

from ..backends.base import Backend, SeqForward
from ..files import read_cache_json, write_cache_json
from ..limits import MAX_NUM_SPECULATIVE_TOKENS, is_int
from .costcache import cost_cache_path, machine_key
from .costmodel import MAX_FORWARD_S
from .measure import drive, interleaved

# Where the curve itself is measured (tokens of context before the timed block): curve_steps' default.
BASE_CONTEXT = 64
# The contexts measured, those that fit the window with the largest block after them.
CONTEXTS = (1024, 4096)
# The block sizes timed at each context: the ends and the middle of what one sequence verifies.
SIZES = (1, 4, 16, MAX_NUM_SPECULATIVE_TOKENS + 1)
ROUNDS = 3
# Tokens of the context prefilled per step: llama.cpp's default n_batch, a bounded pause for a
# server measuring between requests.
PREFILL_CHUNK = 512
MAX_AGE_S = 14 * 24 * 3600


@dataclass(frozen=True)
class ContextCosts:
    """extra(n, c) = T(n, c) - T(n, base_context) in seconds, measured at ``contexts`` x ``ns``.

    extra: [len(contexts)][len(ns)], non-decreasing along both. base: [len(ns)] T(n) after
    base_context tokens in the same measurement (seconds; () where not kept). Below base_context the extra is 0;
    between measured contexts it is linear in c, from 0 at base_context; beyond the largest, it
    grows along the last segment. In n: linear between measured sizes, beyond the largest along
    the last segment (a batched step of several sequences)."""

    base_context: int
    contexts: tuple[int, ...]
    ns: tuple[int, ...]
    extra: tuple[tuple[float, ...], ...]
    base: tuple[float, ...] = ()  # T(n, base_context) at ns, measured with them (what the attention paths compare)

    def __post_init__(self) -> None:
        if len(self.extra) != len(self.contexts) or any(len(row) != len(self.ns) for row in self.extra):
            raise ValueError("ContextCosts needs one row of len(ns) seconds per context")
        if list(self.contexts) != sorted(set(self.contexts)) or (self.contexts and self.contexts[0] <= self.base_context):
            raise ValueError(f"contexts {self.contexts} must ascend, above the base context {self.base_context}")
        if not self.ns or list(self.ns) != sorted(set(self.ns)) or self.ns[0] < 1:
            raise ValueError(f"ns {self.ns} must be ascending sizes >= 1")
        if self.base and len(self.base) != len(self.ns):
            raise ValueError("ContextCosts base needs one T(n) per size")

    def total(self, n: int, c: float) -> float:
        """T(n, c) = base(n) + extra(n, c) in seconds, n one of ns (needs ``base``)."""
        return self.base[self.ns.index(n)] + self(n, c)

    @property
    def measured(self) -> bool:
        """Whether any context was measured (a window too short for the smallest measures none)."""
        return bool(self.contexts)

    def _per_context(self, c: float) -> np.ndarray:
        """[len(ns)] extra at context c."""
        if not self.contexts or c <= self.base_context:
            return np.zeros(len(self.ns))
        cs = np.array((self.base_context,) + self.contexts, dtype=np.float64)
        rows = np.vstack([np.zeros(len(self.ns)), np.asarray(self.extra, dtype=np.float64)])
        if c <= cs[-1]:
            j = int(np.searchsorted(cs, c))  # cs[j-1] < c <= cs[j]
            w = (c - cs[j - 1]) / (cs[j] - cs[j - 1])
            return rows[j - 1] + w * (rows[j] - rows[j - 1])
        slope = (rows[-1] - rows[-2]) / (cs[-1] - cs[-2])
        return rows[-1] + slope * (c - cs[-1])

    def row(self, n_max: int, c: float) -> np.ndarray:
        """[n_max + 1] extra(n, c) for n = 0..n_max (n = 0 as n = 1)."""
        at = self._per_context(c)
        n = np.maximum(np.arange(n_max + 1, dtype=np.float64), 1.0)
        out = np.interp(n, self.ns, at)
        if len(self.ns) > 1 and n_max > self.ns[-1]:
            slope = (at[-1] - at[-2]) / (self.ns[-1] - self.ns[-2])
            beyond = n > self.ns[-1]
            out[beyond] = at[-1] + np.maximum(slope, 0.0) * (n[beyond] - self.ns[-1])
        return out

    def __call__(self, n: int, c: float) -> float:
        """extra(n, c) in seconds."""
        return float(self.row(max(n, 1), c)[max(n, 1)])

    def note(self) -> str:
        """One line for the statistics: what the longest measured context adds to the largest block."""
        if not self.contexts:
            return ""
        return (f"T({self.ns[-1]}) costs {self.extra[-1][-1] * 1000:.0f} ms more after {self.contexts[-1]} tokens "
                f"of context than after {self.base_context} (planned at each request's context)")

    def to_dict(self) -> dict:
        return {"base_context": self.base_context, "contexts": list(self.contexts), "ns": list(self.ns),
                "extra": [list(r) for r in self.extra], "base": list(self.base)}

    @classmethod
    def from_dict(cls, d: dict) -> "ContextCosts":
        """Read back :meth:`to_dict`'s JSON. Raises ValueError for anything else (a file edited by
        hand): sizes and contexts integers, extras finite seconds in [0, MAX_FORWARD_S]."""
        base, contexts, ns, extra = d["base_context"], d["contexts"], d["ns"], d["extra"]
        ints = lambda v: isinstance(v, list) and all(is_int(x) and x >= 0 for x in v)  # noqa: E731
        if not is_int(base) or not ints(contexts) or not ints(ns):
            raise ValueError(f"contexts and sizes must be integers, got {contexts!r:.60} {ns!r:.60}")
        ok = lambda s: isinstance(s, (int, float)) and not isinstance(s, bool) and 0 <= s <= MAX_FORWARD_S  # noqa: E731
        if not isinstance(extra, list) or not all(isinstance(r, list) and all(ok(s) for s in r) for r in extra):
            raise ValueError(f"every extra must be 0..{MAX_FORWARD_S:g} s, got {extra!r:.60}")
        at_base = d.get("base", [])
        if not isinstance(at_base, list) or not all(ok(s) and s > 0 for s in at_base):
            raise ValueError(f"every T(n) at the base context must be 0..{MAX_FORWARD_S:g} s, got {at_base!r:.60}")
        return cls(int(base), tuple(contexts), tuple(ns), tuple(tuple(float(s) for s in r) for r in extra),
                   tuple(float(s) for s in at_base))


def fitting(backend: Backend, contexts: Sequence[int] = CONTEXTS, ns: Sequence[int] = SIZES,
            base_context: int = BASE_CONTEXT) -> tuple[list[int], list[int]]:
    """The contexts and sizes measurable on this backend: sizes of one sequence's block at most
    and within the window, contexts above the base that leave room for the largest size."""
    sizes = sorted({n for n in ns if n <= min(MAX_NUM_SPECULATIVE_TOKENS + 1, backend.n_ctx - 1 - base_context)})
    top = max(sizes, default=1)
    return sorted({c for c in contexts if base_context < c <= backend.n_ctx - 1 - top}), sizes


def context_cost_steps(backend: Backend, contexts: Sequence[int] = CONTEXTS, ns: Sequence[int] = SIZES,
                       base_context: int = BASE_CONTEXT, rounds: int = ROUNDS, chunk: int = PREFILL_CHUNK,
                       timer: Callable[[], float] = time.perf_counter) -> Generator[None, "bool | None", ContextCosts]:
    """Measure :class:`ContextCosts` on sequence 0, one forward a step (:func:`.measure.drive`):
    it yields before each forward and, sent True (other work used the backend's sequences),
    prefills its context again, ``chunk`` tokens a step. Each context that :func:`fitting`
    keeps, largest first, then the base: one untimed forward of each size, then ``rounds``
    interleaved rounds; the extra is the difference of medians, made non-decreasing in c and in
    n (load only slows a forward). Sequence 0 is left empty. timer: seconds (a test's clock)."""
    contexts, ns = fitting(backend, contexts, ns, base_context)
    if not contexts or not ns:
        return ContextCosts(base_context, (), tuple(ns or [1]), ())
    vocab = backend.n_vocab
    rng = np.random.default_rng(1)
    context_toks = [int(t) for t in rng.integers(min(100, vocab - 1), min(vocab, 30000), size=max(contexts))]
    blocks = {n: [int(t) for t in rng.integers(min(100, vocab - 1), min(vocab, 30000), size=n)] for n in ns}
    have = 0  # context tokens sequence 0 holds

    def time_one(n: int, c: int) -> Generator[None, "bool | None", float]:
        nonlocal have
        while True:
            if (yield):
                have = 0
                backend.rollback(0, seq=0)
            if have > c:
                backend.rollback(c, seq=0)
                have = c
            if have == c:
                break
            m = min(chunk, c - have)
            backend.forward(context_toks[have:have + m], logits_for=[], seq=0)
            have += m
        t0 = timer()
        backend.forward_batch([SeqForward(0, blocks[n], range(n))])
        dt = timer() - t0
        backend.rollback(c, seq=0)
        return dt

    medians = {}
    for i, c in enumerate(sorted(contexts, reverse=True) + [base_context]):
        samples: dict[int, list[float]] = {n: [] for n in ns}
        if i == 0:
            for n in ns:  # warm-up of each shape
                yield from time_one(n, c)
        for r in range(rounds):
            for n in interleaved(ns, r):
                samples[n].append((yield from time_one(n, c)))
        medians[c] = np.array([np.median(samples[n]) for n in ns])
    backend.rollback(0, seq=0)
    base = medians[base_context]
    extra = np.vstack([np.maximum(medians[c] - base, 0.0) for c in contexts])
    extra = np.maximum.accumulate(np.maximum.accumulate(extra, axis=0), axis=1)
    return ContextCosts(base_context, tuple(contexts), tuple(ns), tuple(tuple(float(s) for s in r) for r in extra),
                        tuple(float(s) for s in base))


def context_cache_path(backend: Backend, cache_dir: Path) -> Path:
    """Where this backend's context costs are cached: beside its curve."""
    p = cost_cache_path(backend, cache_dir)
    return p.with_name(p.stem + "-context.json")


def read_cached_context_costs(backend: Backend, cache_dir: Path, max_age_s: float = MAX_AGE_S) -> ContextCosts | None:
    """The cached context costs of this backend on this machine, or None where none usable are
    (no file, another key, contexts or sizes that no longer fit, too old, edited)."""
    data = read_cache_json(context_cache_path(backend, cache_dir))
    if data is None or data.get("key") != machine_key(backend):
        return None
    try:
        cc = ContextCosts.from_dict(data)
        if time.time() - float(data.get("measured_at", 0)) > max_age_s:
            return None
    except (ValueError, KeyError, TypeError, OverflowError):
        return None
    contexts, ns = fitting(backend)
    return cc if (list(cc.contexts), list(cc.ns)) == (contexts, ns) and (cc.base or not contexts) else None


def cached_context_costs_steps(backend: Backend, cache_dir: Path, on_measure: Callable[[], None] | None = None,
                               measure: Callable[..., Generator[None, "bool | None", ContextCosts]] = context_cost_steps,
                               ) -> Generator[None, "bool | None", ContextCosts]:
    """:func:`cached_context_costs` made of steps (:func:`.measure.drive`). A window too short
    for any context measures nothing and keeps nothing."""
    contexts, ns = fitting(backend)
    if not contexts:
        return ContextCosts(BASE_CONTEXT, (), tuple(ns or [1]), ())
    cached = read_cached_context_costs(backend, cache_dir)
    if cached is not None:
        return cached
    if on_measure is not None:
        on_measure()
    cc = yield from measure(backend)
    write_cache_json(context_cache_path(backend, cache_dir), {**cc.to_dict(), "model": backend.name,
                                                              "key": machine_key(backend), "measured_at": time.time()})
    return cc


def cached_context_costs(backend: Backend, cache_dir: Path, on_measure: Callable[[], None] | None = None,
                         measure: Callable[..., Generator[None, "bool | None", ContextCosts]] = context_cost_steps,
                         ) -> ContextCosts:
    """:func:`context_cost_steps` (or ``measure``) once per model and machine; later calls read
    the cache. on_measure(): called just before a measurement (to tell a user why the start
    takes longer)."""
    return drive(cached_context_costs_steps(backend, cache_dir, on_measure, measure))
