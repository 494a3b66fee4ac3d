"""A bounded background CPU load, so that "never slower on a busy machine" is measured, not
assumed (``specdecode bench --background-load F``).

F is the fraction of the machine's CPU time the load takes: ceil(F * cpus) processes, each
busy for its share of every 50 ms period and asleep for the rest (a duty cycle, as a
browser tab or a compiler job that comes and goes). F = 0.5 on 2 cores keeps one core
busy the whole time.
"""

from __future__ import annotations

import math
import multiprocessing as mp
import os
import time

from ..errors import SpecDecodeError

PERIOD_S = 0.05


def _spin(duty: float, stop) -> None:  # pragma: no cover - runs in a child process
    x = 0
    while not stop.is_set():
        t0 = time.perf_counter()
        while time.perf_counter() - t0 < duty * PERIOD_S:
            x = (x * 1103515245 + 12345) & 0xFFFFFFFF
        rest = PERIOD_S * (1.0 - duty)
        if rest > 0:
            time.sleep(rest)


def cpus() -> int:
    """Cores this process may run on."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        return os.cpu_count() or 1


class BackgroundLoad:
    """Context manager: a CPU load of ``fraction`` (0 < F <= 1) of the machine while inside.

    Raises SpecDecodeError naming the value when fraction is out of range.
    """

    def __init__(self, fraction: float) -> None:
        if not 0.0 < fraction <= 1.0 or math.isnan(fraction):
            raise SpecDecodeError(f"--background-load {fraction} is out of range: expected 0 < F <= 1",
                                  param="background_load")
        self.fraction = fraction
        n = cpus()
        self.processes = max(1, math.ceil(fraction * n))
        self.duty = min(1.0, fraction * n / self.processes)
        self._procs: list = []
        self._stop = None

    def __enter__(self) -> "BackgroundLoad":
        ctx = mp.get_context("spawn")
        self._stop = ctx.Event()
        self._procs = [ctx.Process(target=_spin, args=(self.duty, self._stop), daemon=True)
                       for _ in range(self.processes)]
        for p in self._procs:
            p.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        for p in self._procs:
            p.join(timeout=2)
            if p.is_alive():
                p.terminate()
        self._procs = []

    def describe(self) -> str:
        return f"{self.processes} process(es) busy {self.duty:.0%} of the time ({self.fraction:.0%} of {cpus()} cores)"
