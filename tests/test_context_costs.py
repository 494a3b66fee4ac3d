"""Verification priced at the context it runs at (issue 47, item 2): T(n, c) measured at a few
contexts, cached, corrected by live step times, and read by the controller at each step's context.

The fake target's forwards advance a scripted clock by a + b n + d n c (c: the tokens it already
caches), as attention makes a block dearer after a long context: the tests judge what was measured
and planned from that script, never the wall clock."""

from __future__ import annotations

import json

import numpy as np
import pytest

from specdecode.control.context_costs import (ContextCosts, cached_context_costs, context_cache_path,
                                              context_cost_steps, fitting, read_cached_context_costs)
from specdecode.control.controller import Source, SpeculationController
from specdecode.control.costmodel import CostCurve, ObservedCurve
from specdecode.control.estimators import AcceptanceEstimator
from specdecode.control.measure import drive
from specdecode.control.sources import SharedCosts

from conftest import ScriptedBackend, step_outcome
from test_costs import Fixed

A, B, D = 0.030, 0.010, 2e-6  # seconds: per forward, per token, per token and cached token


def t_script(n: int, c: int) -> float:
    return A + B * n + D * n * c


class ClockedTarget(ScriptedBackend):
    """A scripted target whose forward of n tokens after c cached ones advances ``now`` by t_script(n, c)."""

    def __init__(self, n_ctx: int = 8192) -> None:
        super().__init__([bytes([i]) for i in range(256)], [1], n_prompt=1, n_ctx=n_ctx)
        self.name = "clocked"
        self.path, self.n_threads, self.device = None, 2, "cpu"
        self.now = 0.0
        self.prefills: list[int] = []  # tokens of each untimed forward (no logits)

    def _forward(self, seq, token_ids, logits_for):
        self.now += t_script(len(token_ids), len(self.caches[seq]))
        if not len(logits_for):
            self.prefills.append(len(token_ids))
        return super()._forward(seq, token_ids, logits_for)


CURVE = CostCurve((1, 2, 4, 8, 16, 33), tuple(t_script(n, 64) for n in (1, 2, 4, 8, 16, 33)))


def test_the_extra_cost_is_measured_at_each_context_that_fits():
    t = ClockedTarget()
    cc = drive(context_cost_steps(t, timer=lambda: t.now))
    assert cc.contexts == (1024, 4096) and cc.ns == (1, 4, 16, 33)
    for c, row in zip(cc.contexts, cc.extra):
        for n, x in zip(cc.ns, row):
            assert x == pytest.approx(D * n * (c - 64), rel=1e-6)
    # The context is read in chunks of at most 512 tokens (a server measures between requests),
    # once for the largest context: the smaller ones and the base are rolled back to, not read again.
    assert max(t.prefills) <= 512 and sum(t.prefills) == 4096
    assert t.seq_len(0) == 0  # left empty


def test_a_window_too_short_measures_no_context():
    t = ClockedTarget(n_ctx=1024)
    assert fitting(t)[0] == []
    cc = drive(context_cost_steps(t, timer=lambda: t.now))
    assert not cc.measured and cc(33, 5000) == 0.0
    assert fitting(ClockedTarget(n_ctx=2048))[0] == [1024]


def test_other_work_between_steps_makes_it_read_its_context_again():
    t = ClockedTarget()
    steps = context_cost_steps(t, timer=lambda: t.now)
    steps.send(None)
    for i in range(3):
        steps.send(False)
    t.rollback(0, seq=0)  # a request used sequence 0 meanwhile
    t.forward([5, 6, 7], logits_for=[], seq=0)
    before = sum(t.prefills)
    cc = None
    try:
        steps.send(True)
        while True:
            steps.send(False)
    except StopIteration as stop:
        cc = stop.value
    assert sum(t.prefills) - before >= 4096  # read again from the start
    assert cc.extra[-1][-1] == pytest.approx(D * 33 * (4096 - 64), rel=1e-6)  # the request's tokens not counted


def test_extra_interpolates_in_context_and_size_and_extrapolates_beyond():
    cc = ContextCosts(64, (1024, 4096), (1, 33), ((0.001, 0.1), (0.004, 0.4)))
    assert cc(33, 64) == 0.0 and cc(33, 10) == 0.0
    assert cc(33, 544) == pytest.approx(0.05)
    assert cc(33, 2560) == pytest.approx(0.25)
    assert cc(33, 7168) == pytest.approx(0.7)  # along the last segment: 0.3 s per 3,072 tokens
    assert cc(17, 1024) == pytest.approx(0.0505)
    assert cc.row(65, 1024)[65] == pytest.approx(0.1 + 32 * (0.099 / 32))  # a batch of two blocks
    with pytest.raises(ValueError):
        ContextCosts(64, (4096, 1024), (1, 33), ((0, 0), (0, 0)))


@pytest.mark.parametrize("bad", [{"extra": [[-1.0, 0.1], [0.0, 0.2]]}, {"extra": [[float("nan"), 0], [0, 0]]},
                                 {"contexts": "1024"}, {"ns": [1, True]}, {"extra": [[0.1]]}])
def test_a_cache_edited_by_hand_is_measured_again(tmp_path, bad):
    t = ClockedTarget()
    runs = []

    def measure(backend):
        runs.append(1)
        return context_cost_steps(backend, timer=lambda: t.now)

    first = cached_context_costs(t, tmp_path, measure=measure)
    assert cached_context_costs(t, tmp_path, measure=measure) == first and len(runs) == 1
    path = context_cache_path(t, tmp_path)
    data = json.loads(path.read_text())
    assert read_cached_context_costs(t, tmp_path) == first  # kept: a second start measures nothing
    path.write_text(json.dumps({**data, **bad}))
    assert read_cached_context_costs(t, tmp_path) is None
    again = cached_context_costs(t, tmp_path, measure=measure)
    assert len(runs) == 2 and np.allclose(again.extra, first.extra)  # measured again, the same script
    assert read_cached_context_costs(t, tmp_path) == again


def controller(cc: ContextCosts | None) -> SpeculationController:
    shared = SharedCosts(ObservedCurve(CURVE), 34)
    shared.set_context_costs(cc)
    src = Source(Fixed(), 0.0, estimator=AcceptanceEstimator(prior_alpha=0.8, prior_weight=1e6))
    return SpeculationController([src], CURVE, kmax=32, learn_costs=True, shared=shared)


def best_k(c: SpeculationController, context_len: int) -> int:
    c.propose([1] * context_len, 32)
    return c._last_k


def test_the_controller_drafts_fewer_tokens_after_a_long_context():
    t = ClockedTarget()
    cc = drive(context_cost_steps(t, timer=lambda: t.now))
    measured = controller(cc)
    short, long = best_k(measured, 64), best_k(measured, 6000)
    assert 0 < long < short
    # What it plans with at 6,000 tokens is what the script costs there.
    table = measured._costs.table_at(6000)
    for n in (1, 4, 16, 33):
        assert table[n] == pytest.approx(t_script(n, 6000), rel=0.03)
    # Negative control: without context costs, the long context plans as the short one.
    blind = controller(None)
    assert best_k(blind, 6000) == best_k(blind, 64) == short


def test_live_steps_at_a_long_context_correct_the_sum():
    """Steps observed at 4,096 tokens that cost what the script says there leave the plan as it is;
    the same steps read against the short-context curve alone (no context costs) look dear."""
    t = ClockedTarget()
    cc = drive(context_cost_steps(t, timer=lambda: t.now))
    for costs, ratio in ((cc, 1.0), (None, t_script(33, 4096) / t_script(33, 64))):
        c = controller(costs)
        for _ in range(12):
            c.propose([1] * 4096, 32)
            c.observe(step_outcome(0, verified=33, seconds=t_script(33, 4096)))
            c.observe(step_outcome(0, verified=1, seconds=t_script(1, 4096)))
        obs = c.target_cost
        assert obs.ratios()[-1] == pytest.approx(ratio, rel=0.02)
    assert np.isclose(t_script(33, 4096) / t_script(33, 64), 1.0 + D * 33 * 4032 / t_script(33, 64))


def test_a_server_measures_context_costs_between_requests_and_caches_them(tmp_path):
    from specdecode.control.calibration import Calibration

    t = ClockedTarget()
    cal = Calibration(t, tmp_path, timer=lambda: t.now, cpu_times=lambda: None)
    shared = cal.costs(CURVE.ns, 34, None)
    assert "context costs" in cal.measuring() and shared.context_costs is None
    parts = 0
    while cal.pending:
        cal.run_one()
        parts += 1
    assert shared.context_costs is not None and shared.context_costs.contexts == (1024, 4096)
    assert read_cached_context_costs(t, tmp_path) == shared.context_costs
    assert parts > 8  # a part at a time: the context is read in chunks between requests
    # The next start reads it from the cache: nothing is measured for it.
    again = Calibration(t, tmp_path, timer=lambda: t.now, cpu_times=lambda: None)
    assert again.costs(CURVE.ns, 34, None).context_costs == shared.context_costs
    assert "context costs" not in again.measuring()


def test_the_copy_limit_at_a_long_context_is_the_scripts():
    from specdecode.bench import copy_limit

    t = ClockedTarget()
    cc = drive(context_cost_steps(t, timer=lambda: t.now))
    assert copy_limit(CURVE) == pytest.approx(33 * t_script(1, 64) / t_script(33, 64), abs=1e-3)
    at = copy_limit(CURVE, cc, 4096)
    assert at == pytest.approx(33 * t_script(1, 4096) / t_script(33, 4096), abs=1e-3) and at < copy_limit(CURVE)
    assert copy_limit(CURVE, None, 4096) == copy_limit(CURVE)  # negative control: no context costs
