"""benchmarks/controller_replay.py: its replay target answers with the recorded output at the
recorded confidence and prices each decoding forward on the cost curve, so the replayed
controller commits exactly the recording and its clock is what its choices cost."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import numpy as np

from specdecode.control.costmodel import CostCurve, ObservedCurve

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "controller_replay.py"
CURVE = CostCurve((1, 2, 8, 33), (0.030, 0.045, 0.080, 0.300))


def _script():
    spec = importlib.util.spec_from_file_location("benchmark_controller_replay", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


class Vocabulary:
    n_vocab, n_ctx, eog_ids = 64, 4096, frozenset({0})

    def token_bytes(self, token_id: int) -> bytes:
        return b"t%d " % token_id

    token_text = token_bytes


def _recording(output, prompt):
    return {"prompt": prompt, "output": output, "probs": [0.9] * len(output)}


def test_the_replay_target_answers_the_recording_at_its_confidence_and_prices_decoding():
    m = _script()
    t = m.ReplayTarget(Vocabulary(), [5, 6, 7], [8, 9, 10], [0.5, 0.25, 0.99], lambda n, c: n + c / 1000)
    rows = t.forward([5, 6, 7], [2])  # the prompt: free
    assert t.now == 0 and int(np.argmax(rows[0])) == 8
    z = rows[0] - rows[0].max()
    assert abs(1 / np.exp(z).sum() - 0.5) < 1e-4  # softmax top-1 = the recorded probability
    rows = t.forward([8, 4], [0, 1])  # a draft of one wrong token after 3 cached tokens
    assert t.now == 2 + 0.003 and [int(np.argmax(r)) for r in rows] == [9, 10]
    t.rollback(4)
    assert t.seq_len(0) == 4


def test_a_copied_answer_replays_exactly_and_faster_than_plain_an_unseen_one_at_plain_cost():
    m = _script()
    code = [int(x) for x in np.random.default_rng(0).integers(2, 60, 120)]
    prompt = code + [1]
    for output, faster in ((code[:100], True), ([int(x) for x in np.random.default_rng(1).integers(2, 60, 100)], False)):
        curve = ObservedCurve(CURVE)
        t, books = m.replay(Vocabulary(), _recording(output, prompt), curve, m.lookup_controller(curve, 32))
        plain = (len(output) - 1) * CURVE(1)  # the first token comes with the prompt's forward
        if faster:
            assert t < 0.5 * plain and books["accepted"] > 50
        else:
            assert t <= plain * 1.15  # a few probes on chance matches, no more
