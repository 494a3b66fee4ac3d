"""Measuring while serving: a server answers at once and measures what the controller and strict
mode need (the target's T(n), its invariant block) a part at a time between requests.

Measured on a busy 2-core machine (issue 43): a start whose cached curve was marked stale by one
slow run measured T(n) at 33 sizes in 3 rounds before it answered ``/health``, and was still
measuring after 10 minutes; the first strict request on a new configuration measured the
invariant block inline (about 30 s). So ``specdecode serve`` (:class:`Calibration`):

- plans at once with what it has: the cached curve, even one to be checked, marked stale or too
  old; where none is cached, a conservative one, T(n) = n T(1) with T(1) timed from a few
  one-token forwards, under which no draft pays (plain decoding, bar the controller's rare
  exploring probes), so that a guess never makes it slower than plain decoding;
- checks or measures the curve (:func:`.costcache.cached_measurement_steps`: a stale or suspect
  curve is checked at three sizes, and kept when the machine is busy during the check) one
  forward at a time, and the invariant block (:func:`.invariance.invariant_steps`) a part at a
  time, whenever the server's worker has nothing to run (:meth:`Calibration.run_one`): llama.cpp's
  context is not thread-safe, so the measuring runs on the worker's thread, between its steps,
  never beside them;
- switches the controller to the measured curve (:meth:`.sources.SharedCosts.install`) and
  strict mode to the measured block once they are known; until the block is known, a strict or
  seeded request runs plain one-token steps in batch-invariant mode, which are exactly strict
  (a block of one token is invariant by definition).

Units: seconds.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Generator, Sequence

from ..backends.base import Backend
from ..errors import SpecDecodeError
from ..limits import MAX_NUM_SPECULATIVE_TOKENS
from .context_costs import (BASE_CONTEXT, CONTEXTS, ContextCosts, cached_context_costs, cached_context_costs_steps,
                            context_cost_steps, fitting, read_cached_context_costs)
from .costcache import cached_measurement_steps, read_cached
from .costmodel import CostCurve, ObservedCurve
from .invariance import cached_invariant_block, invariant_steps, read_invariant_block, write_invariant_block
from . import measure
from .measure import CpuTimes, Measurement, curve_steps, drive, measure_forward_curve
from .sources import SharedCosts

# The one-token forwards timed for a conservative curve's T(1) (after one untimed), after this
# many cached tokens: a fraction of a second on the slowest machine measured.
CONSERVATIVE_ROUNDS = 3
CONSERVATIVE_CONTEXT = 8
# While generations run, a measurement on a scratch twin (no slot's cache is touched) takes a part
# between two steps whenever its parts so far have used less than this share of the time stepped
# (the server's worker, a Decoder's own streams): steady traffic never keeps it from measuring
# (issue 61: with a request every 3 s the context costs were still pending after 425 s, and
# nothing drafted meanwhile).
MEASURE_SHARE = 0.1
# The scratch twin's cells: the longest context costs measure, the largest block after it, slack.
SCRATCH_N_CTX = BASE_CONTEXT + max(CONTEXTS) + MAX_NUM_SPECULATIVE_TOKENS + 1 + 64


@dataclass
class _Job:
    """One measurement in parts: its steps, what to do with its result, and what /health calls it."""

    name: str
    steps: Generator[None, "bool | None", Any]
    done: Callable[[Any], None]
    started: bool = False


class Calibration:
    """What a server measures between its requests instead of before it answers.

    target: the backend measured. cache_dir: the cache the curve and the block are kept in
    (:func:`specdecode.files.cache_dir`). say: where the line at the start and the line at the
    end of each measurement go (None: nowhere). timer: seconds, for timing forwards;
    cpu_times: what tells a busy machine (:func:`.measure.read_cpu_times`); both replaceable (a
    test's scripted clock and load), read when a forward is timed.

    The caller runs :meth:`run_one` whenever the target is free (the server's worker: when no
    generation runs), tells :meth:`before_generation` of each generation it begins, and hands
    the engine over (:meth:`attach`): each part makes the engine forget its slots' cached
    prefixes (the measurement writes the target's sequences) and leaves batch-invariant mode off.
    """

    def __init__(self, target: Backend, cache_dir: Path, say: Callable[[str], None] | None = None,
                 timer: Callable[[], float] | None = None, cpu_times: CpuTimes | None = None,
                 up_front: bool = False) -> None:
        self.target = target
        self.up_front = up_front
        self.cache_dir = Path(cache_dir)
        self.say = say
        self.timer = timer or time.perf_counter
        self.cpu_times = cpu_times
        self.parts = 0  # parts run so far, of every job
        self.error: str | None = None  # why measuring stopped, if it failed
        self._jobs: list[_Job] = []
        self._touched = True  # a generation may have used the target's sequences since the last part
        self._engine: Any = None
        self._scratch: Any = None  # the target's scratch twin while measuring (:meth:`_measured`)
        self._report: Callable[[str], None] = lambda note: None
        self._note = ""
        self._budget = 0.0  # seconds of measuring owed to the steps run (between_steps)
        self.invariant_block = read_invariant_block(target, self.cache_dir)  # None: not known yet

    # -- what the controller and the engine plan with meanwhile --------------------------------

    def costs(self, ns: Sequence[int], n_max: int, on_drift: Callable[[str, CostCurve | None], None] | None,
              ) -> SharedCosts:
        """The costs a controller plans with from now on: the cached curve when it needs nothing
        more; else the cached curve or, where none is usable, a conservative one (T(n) = n T(1)),
        while the cache's check or measurement runs between requests and its result replaces it.
        on_drift: what live step times that contradict the curve report to, from the measured
        curve on (not while planning with a curve that is about to be replaced)."""
        cached, need = read_cached(self.target, ns, self.cache_dir)
        if cached is None and self.up_front:  # nothing to plan with: measured now, once per model and machine
            cached, need = drive(cached_measurement_steps(self.target, ns, self.cache_dir, on_measure=self._on_measure)), "use"
        if cached is not None and need == "use":
            self._note = cached.note()
            shared = SharedCosts(ObservedCurve(cached.curve), n_max, on_drift)
            self._context_costs(shared)
            return shared
        base = cached.curve if cached is not None else self._conservative(ns)
        shared = SharedCosts(ObservedCurve(base), n_max, None)
        what = "checked (T(n) at 3 sizes)" if need == "check" else f"measured (T(n) at {len(ns)} sizes)"
        meanwhile = "the cached curve" if cached is not None else \
            "a conservative curve, T(n) = n T(1), under which no draft pays (plain decoding)"
        when = "between steps" if self.up_front else "between requests"
        self._note = f"the cost curve is being {what} {when}; planned meanwhile with {meanwhile}"
        self._tell(f"specdecode: answering at once: the target's cost curve is {what} {when}, a forward at a "
                   f"time; until then the controller plans with {meanwhile}")

        def done(m: Measurement) -> None:
            kept = m.curve == base
            shared.install(shared.curve if kept else ObservedCurve(m.curve), on_drift)
            self._note = "; ".join(x for x in (m.note(), shared.context_note()) if x)
            self._report(self._note)
            self._tell("specdecode: the cached cost curve is kept (the check agreed, or the machine was too busy "
                       "to judge it)" if kept else "specdecode: the cost curve is measured: the controller plans "
                       "with it from now on")

        steps = cached_measurement_steps(self._measured(), ns, self.cache_dir, measure=self._measure_steps)
        self._jobs.append(_Job("cost curve", steps, done))
        self._context_costs(shared)
        return shared

    def _context_costs(self, shared: SharedCosts) -> None:
        """Plan at each request's context: with the cached context costs, or once they are
        measured (a job after the curve's; nothing where the window is too short for them)."""
        cached = read_cached_context_costs(self.target, self.cache_dir)
        if cached is None and self.up_front:
            cached = cached_context_costs(self.target, self.cache_dir, self._on_measure_context)
        if cached is not None or not fitting(self._measured())[0]:
            self._release_if_idle()
            shared.set_context_costs(cached)
            self._note = "; ".join(x for x in (self._note, shared.context_note()) if x)
            return

        def done(cc: ContextCosts) -> None:
            shared.set_context_costs(cc)
            self._note = "; ".join(x for x in (self._note, shared.context_note()) if x)
            self._report(self._note)
            self._tell("specdecode: what a long context adds to a forward is measured: steps are planned at their "
                       "request's context from now on")

        # Its context read MAX_NUM_SPECULATIVE_TOKENS + 1 tokens a part, so that no part (they run
        # between a stream's steps too) costs more than the largest verification block.
        steps = cached_context_costs_steps(self._measured(), self.cache_dir, measure=lambda b: context_cost_steps(
            b, chunk=MAX_NUM_SPECULATIVE_TOKENS + 1, timer=lambda: self.timer()))
        self._jobs.append(_Job("context costs", steps, done))

    def report_to(self, controller: Any) -> None:
        """Keep ``controller.measurement_note`` (the statistics' ``controller:`` line) saying how
        its curve was got, now and once it is measured."""
        self._report = lambda note: setattr(controller, "measurement_note", note)
        self._report(self._note)

    def invariance(self, target: Backend, seq: int) -> int | None:
        """The engine's ``invariance``: the cached invariant block where known (up front: measured
        now where not cached); else None while it is measured between requests, under which a
        generation's plan runs plain one-token steps, exactly strict, so that a seed's text is
        the one it will be once the block is known (:func:`specdecode.engine.plan.plan_generation`)."""
        if self.invariant_block is None and self.up_front:
            self.invariant_block = cached_invariant_block(target, seq, self.cache_dir)
        if self.invariant_block is not None:
            return self.invariant_block
        self._want_invariance()
        return None

    def before_generation(self, options: Any) -> Any:
        """Told before each generation begins (it may use any of the target's sequences): the
        next part knows the slots were used. Returns the options, unchanged."""
        self._touched = True
        return options

    def attach(self, engine: Any) -> None:
        """The engine whose slots a part's forwards overwrite (see the class)."""
        self._engine = engine

    # -- the measuring -------------------------------------------------------------------------

    @property
    def pending(self) -> bool:
        """Whether anything is left to measure (a failed measurement leaves nothing)."""
        return bool(self._jobs)

    @property
    def private(self) -> bool:
        """Whether the parts run on a scratch twin of the target (a KV cache of its own): they
        then leave every slot's cached prompt alone, and may run between a generation's steps."""
        return self._scratch is not None

    def measuring(self) -> list[str]:
        """What is being measured, for /health: "cost curve", "context costs", "invariant block"
        (empty when done)."""
        return [job.name for job in self._jobs]

    def run_one(self) -> None:
        """One part of the first pending measurement: one timed forward of the curve, or one part
        of the invariant block; call it only while nothing else uses the target. A measurement
        that fails stops every pending one (said once); the server keeps what it planned with."""
        if not self._jobs:
            return
        job = self._jobs[0]
        private = self._scratch is not None  # a context of its own: the slots' caches are not touched
        try:
            if self._engine is not None and not private:
                self._engine.forget_prefix()  # the parts overwrite what the slots cached
                self._engine.forwards.set_invariant(False)  # and time the fast mode; invariance sets its own
            try:
                job.steps.send((self._touched and not private) if job.started else None)
                job.started = True
            except StopIteration as stop:
                job.done(stop.value)
                self._jobs.pop(0)  # after its result is in use: /health's "measuring" never runs ahead of it
        except Exception as e:  # a measurement must never take the server down
            self.error = f"{type(e).__name__}: {e}"
            self._jobs.clear()
            self._tell(f"specdecode: warning: measuring the {job.name} failed ({self.error}); the server goes on "
                       "with what it planned with so far")
        finally:
            self._touched = False
            self.parts += 1
            self._release_if_idle()

    def between_steps(self, step_s: float, clock: Callable[[], float]) -> None:
        """Told after each step of running generations (step_s: its seconds on ``clock``): one
        part of a pending measurement on the scratch twin whenever the parts so far used less
        than MEASURE_SHARE of the time stepped; nothing for one on the target itself, which
        would overwrite the running generations' caches."""
        if not self.pending or not self.private:
            return
        self._budget = min(self._budget + MEASURE_SHARE * step_s, MEASURE_SHARE)
        if self._budget > 0:
            started = clock()
            self.run_one()
            self._budget -= clock() - started

    def close(self) -> None:
        """Stop measuring and free the scratch twin (before the target it was made from)."""
        self._jobs.clear()
        self._release_if_idle()

    def _on_measure(self, ns: Sequence[int]) -> None:
        self._tell(f"specdecode: measuring the target's forward time T(n) at {len(ns)} sizes, once per model and "
                   "machine (cached: later starts skip it)...")

    def _on_measure_context(self) -> None:
        self._tell("specdecode: measuring what a long context adds to the target's forward time, once per model and "
                   "machine (cached: later starts skip it)...")

    def _release_if_idle(self) -> None:
        """With nothing left to measure, the scratch twin's memory back."""
        if not self._jobs and self._scratch is not None:
            self._scratch.close()
            self._scratch = None

    def _measured(self) -> Backend:
        """What the parts measure: a scratch twin of the target (a KV cache of its own, so that an
        editor's cached prompt survives a fresh server's measuring; ``scratch_twin``) where the
        backend makes one, else the target itself (each part then makes the engine forget its
        slots' caches)."""
        if self._scratch is None and not self._jobs:
            try:
                self._scratch = self.target.scratch_twin(SCRATCH_N_CTX)
            except SpecDecodeError:  # no memory for it: measure on the target, as before
                self._scratch = None
        return self._scratch if self._scratch is not None else self.target

    def _measure_steps(self, backend: Backend, ns: Sequence[int], **kw) -> Generator[None, "bool | None", Measurement]:
        return curve_steps(backend, ns, timer=lambda: self.timer(), cpu_times=lambda: self._cpu(), **kw)

    def _cpu(self) -> "tuple[float, float, float] | None":
        return (self.cpu_times or measure.read_cpu_times)()  # looked up when read: a test may script either

    def _conservative(self, ns: Sequence[int]) -> CostCurve:
        """T(n) = n T(1), T(1) timed from a few one-token forwards: no draft pays under it."""
        t1 = measure_forward_curve(self.target, [1], context=CONSERVATIVE_CONTEXT, rounds=CONSERVATIVE_ROUNDS,
                                   retries=0, timer=lambda: self.timer(), cpu_times=lambda: self._cpu()).curve(1)
        t1 = max(t1, 1e-6)  # a fake backend's forward may take no measurable time
        return CostCurve(tuple(ns), tuple(n * t1 for n in ns))

    def _want_invariance(self) -> None:
        """Schedule the invariant block's measurement, once (not after a failure)."""
        if self.error is not None or any(job.name == "invariant block" for job in self._jobs):
            return

        def done(block: int) -> None:
            write_invariant_block(self.target, self.cache_dir, block)
            self.invariant_block = self.target.invariant_block = block
            self._tell(f"specdecode: the invariant block is measured ({block} token{'s' if block > 1 else ''}): "
                       "strict requests verify in blocks of that size from now on")

        self._jobs.append(_Job("invariant block", invariant_steps(self._measured(), 0), done))
        self._tell("specdecode: the invariant block is measured between requests; strict and seeded requests run "
                   "plain one-token steps until then (exactly strict)")

    def _tell(self, line: str) -> None:
        if self.say is not None:
            self.say(line)
