"""Where verification is flat (a GPU: a step is bound by reading the weights), the controller
drafts long blocks with a draft model and beats plain decoding by far; on the CPU's shape (these
2-core machines: T(n) nearly n T(1)) the same draft model is declined. Scripted costs and
acceptance: the drafting and verification times are a script's (an injected clock), never the
machine's (issue 58, item 3)."""

from __future__ import annotations

import time

import numpy as np

from specdecode.control.controller import Source, SpeculationController
from specdecode.control.costmodel import CostCurve
from specdecode.drafters import Draft
from specdecode.drafters.base import IncrementalDrafter
from specdecode.sampling import Sampler, SamplingParams

from conftest import ScriptedClock, step_outcome

T1 = 0.020  # seconds: one target step
NS = tuple(range(1, 34))
# A GPU: T(1..16) within 10% of T(1) (0.4% a token), then the cost of the extra tokens shows.
GPU = CostCurve(NS, tuple(T1 * (1 + 0.004 * (n - 1)) if n <= 16 else T1 * (1.06 + 0.03 * (n - 16)) for n in NS))
# These CPUs (Zen 4, llama.cpp): T(2) 1.7, T(4) 3.1, T(16) 8.5 times T(1) (DESIGN.md), interpolated.
_CPU_X = {1: 1.0, 2: 1.7, 4: 3.1, 8: 5.0, 16: 8.5, 33: 14.0}
CPU = CostCurve(NS, tuple(T1 * float(np.interp(n, list(_CPU_X), list(_CPU_X.values()))) for n in NS))
DRAFT_FORWARD = 0.15 * T1  # one forward of the draft model
# Each drafted token accepted with this probability once the one before was: the acceptance rate
# (accepted / drafted, DESIGN.md's term) of the drafts the controller then plans is 0.7 (checked
# below). Read as Leviathan et al.'s per-token alpha instead, 0.7 bounds any K at 1.73x on this
# curve (Eq. 1, at K = 3): the last test holds the controller near that bound.
P_NEXT = 0.91


class TimedDraftModel(IncrementalDrafter):
    """A draft model that drafts k tokens in k forwards of DRAFT_FORWARD on the scripted clock."""

    name = "model"

    def __init__(self, clock: ScriptedClock) -> None:
        self.clock = clock

    def propose(self, context, k):
        self.clock.advance(DRAFT_FORWARD * k)
        return Draft([7] * k)

    def pending(self, context):
        return 0

    def set_continuation_rule(self, rule):
        pass


def run(monkeypatch, curve: CostCurve, steps: int = 200, seed: int = 0, p_next: float = P_NEXT):
    """(tokens per second, the Ks drafted, accepted, drafted) over the scripted steps."""
    clock = ScriptedClock()
    monkeypatch.setattr(time, "perf_counter", clock)
    c = SpeculationController([Source(TimedDraftModel(clock), DRAFT_FORWARD)], curve, kmax=16)
    c.start([1, 2, 3], Sampler(SamplingParams()))
    rng = np.random.default_rng(seed)
    tokens, ks, accepted = 0, [], 0
    for _ in range(steps):
        k = len(c.propose([1, 2, 3], 16).token_ids)
        n = 0
        while n < k and rng.random() < p_next:
            n += 1
        clock.advance(curve(k + 1))
        c.observe(step_outcome(n, verified=k + 1, seconds=curve(k + 1), drafted=k))
        tokens, accepted = tokens + n + 1, accepted + n
        ks.append(k)
    return tokens / clock.now, ks, accepted, sum(ks)


def test_the_gpu_curve_is_flat_within_ten_percent_to_sixteen_tokens():
    assert all(GPU(n) <= 1.1 * GPU(1) for n in range(1, 17)) and CPU(16) > 8 * CPU(1)


def test_on_a_flat_curve_the_draft_model_drafts_long_blocks_and_beats_plain_by_far(monkeypatch):
    rate, ks, accepted, drafted = run(monkeypatch, GPU)
    plain = 1.0 / GPU(1)
    assert np.mean(ks[-100:]) >= 4
    assert 0.65 <= accepted / drafted <= 0.75  # the acceptance rate the plan is judged at
    assert rate > 1.8 * plain


def test_on_the_cpus_shape_the_same_draft_model_is_declined(monkeypatch):
    """The negative control: the same drafter, acceptance and costs but T(n) nearly n T(1)."""
    rate, ks, _, _ = run(monkeypatch, CPU)
    assert np.mean(ks[-100:]) < 1 and rate >= 0.95 / CPU(1)


def expected_speedup(alpha: float, k: int, curve: CostCurve) -> float:
    """Leviathan et al. Eq. 1: tokens a step, (1 - alpha^(K+1)) / (1 - alpha), per step time
    (K draft forwards and T(K+1)) against plain decoding's T(1)."""
    return (1 - alpha ** (k + 1)) / (1 - alpha) * curve(1) / (k * DRAFT_FORWARD + curve(k + 1))


def test_at_a_per_token_acceptance_of_0_7_the_controller_comes_near_the_best_fixed_k(monkeypatch):
    best = max(expected_speedup(0.7, k, GPU) for k in range(1, 17))
    rate, ks, _, _ = run(monkeypatch, GPU, p_next=0.7)
    assert 1.7 < best < 1.75 and rate * GPU(1) > 0.85 * best and np.mean(ks[-100:]) >= 2
