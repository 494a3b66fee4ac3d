"""The guard: no generation ends meaningfully slower than plain decoding, whatever the
costs, the load or the text.

The controller's choices are only as good as its cost curve and acceptance estimates. The
guard checks the outcome instead of the model: it keeps, per generation, what speculation
achieved over its last steps (committed tokens per second, drafting and verification
included) and what plain decoding achieves now (the median time of recent plain steps,
taken as the controller chooses K = 0, or forced as probes when speculation has run for a
while without one). When speculation falls behind plain by more than ``margin`` over a
window of steps, drafting stops for ``backoff`` steps, which doubles each time it happens
again (exponential back-off, up to ``max_backoff``) and resets once speculation is ahead
again. The same back-off idea is TCP's; the quantity guarded is Leviathan et al. (2023)'s
walltime improvement, measured rather than predicted.

Units: seconds.
"""

from __future__ import annotations

from collections import deque

import numpy as np


class SpeedGuard:
    """Speculation against plain decoding, measured live.

    window: speculative steps compared at once (the last ones); min_steps: the fewest judged.
    margin: how far behind plain (a fraction of
    its rate) speculation may fall before drafting stops. backoff, max_backoff: steps of plain
    decoding after the first and the latest fall behind. probe_every: speculative steps
    after which one plain step is forced to refresh the plain reference (doubling, up to
    max_probe, while speculation stays well ahead). plain_window: plain step times kept.
    """

    def __init__(self, window: int = 8, min_steps: int = 4, margin: float = 0.03, backoff: int = 16, max_backoff: int = 256,
                 probe_every: int = 32, max_probe: int = 128, plain_window: int = 9) -> None:
        self.window = window
        self.min_steps = min(min_steps, window)
        self.margin = margin
        self.first_backoff = backoff
        self.max_backoff = max_backoff
        self.first_probe = probe_every
        self.max_probe = max_probe
        self.plain_s: deque = deque(maxlen=plain_window)  # kept across generations: a machine's state
        self.reset()

    def reset(self) -> None:
        """A new generation: its own window, back-off and books."""
        self.spec: deque = deque(maxlen=self.window)  # (seconds, committed tokens)
        self.suspended = 0  # plain steps left before drafting again
        self.backoff = self.first_backoff
        self.probe_every = self.first_probe
        self.since_plain = 0  # speculative steps since the last plain step
        self.ahead = False  # speculation was well ahead (> 1.2x plain) over the last window
        self.stops = 0
        self.forced = 0
        self.last_rates: tuple[float, float] | None = None  # (speculative, plain) tokens/s at the last stop

    @property
    def plain_rate(self) -> float | None:
        """Plain decoding's tokens per second now (None before two plain steps were seen)."""
        return 1.0 / float(np.median(self.plain_s)) if len(self.plain_s) >= 2 else None

    def allows_drafting(self) -> bool:
        """Whether the next step may draft. False while suspended, and for a forced plain
        step: before any plain reference once speculation has run a few steps, and every
        ``probe_every`` speculative steps."""
        if self.suspended > 0:
            self.suspended -= 1
            return False
        need = 4 if len(self.plain_s) < 2 else self.probe_every
        if self.since_plain >= need:
            self.forced += 1
            if self.ahead:  # well ahead: the plain reference is needed less often
                self.probe_every = min(2 * self.probe_every, self.max_probe)
            return False
        return True

    def judge(self, drafted: int, draft_s: float, verify_s: float, committed: int, wasted: bool = False) -> None:
        """One step of this generation: speculative when it drafted ``drafted`` tokens, or when a
        draft model ran and drafted nothing (``wasted``: its ``draft_s`` spent for no draft);
        else plain (its forward of one token, ``verify_s``). committed: tokens the step kept."""
        if drafted or wasted:
            self.speculative_step(draft_s + verify_s, committed)
        else:
            self.plain_step(verify_s)

    def plain_step(self, seconds: float) -> None:
        """A step that drafted nothing took ``seconds`` (its forward of one token)."""
        self.plain_s.append(seconds)
        self.since_plain = 0

    def speculative_step(self, seconds: float, committed: int) -> None:
        """A step that drafted took ``seconds`` (drafting and verification) and committed
        ``committed`` tokens (accepted drafts plus the target's own)."""
        self.since_plain += 1
        self.spec.append((seconds, committed))
        plain = self.plain_rate
        if plain is None or len(self.spec) < self.min_steps:
            return
        spec = sum(c for _, c in self.spec) / max(sum(s for s, _ in self.spec), 1e-12)
        if spec < (1.0 - self.margin) * plain:
            self.last_rates = (spec, plain)
            self.stops += 1
            self.suspended = self.backoff
            self.backoff = min(2 * self.backoff, self.max_backoff)
            self.spec.clear()
            self.ahead = False
        else:
            if spec > (1.0 + self.margin) * plain:
                self.backoff = self.first_backoff
            self.ahead = spec > 1.2 * plain

    def explain(self) -> str:
        """One clause for the statistics ("" when the guard did nothing)."""
        parts = []
        if self.stops:
            s, p = self.last_rates
            parts.append(f"the guard stopped drafting {self.stops} time(s): speculation ran at {s:.1f} tok/s "
                         f"against plain {p:.1f} tok/s")
        if self.forced:
            parts.append(f"{self.forced} plain step(s) timed as the guard's reference")
        return "; ".join(parts)
