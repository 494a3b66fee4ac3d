"""Predicted outputs: the prediction drafter on crafted outputs (follow, change a line,
insert and delete a block, ignore it), the controller with a wrong prediction, the usage
counts, and greedy parity with and without a prediction on a scripted target and smollm2."""

from __future__ import annotations

import pytest

from specdecode.control.controller import Source, SpeculationController
from specdecode.control.costmodel import CostCurve
from specdecode.control.guard import SpeedGuard
from specdecode.drafters import PredictionDrafter
from specdecode.drafters.kinds import kind_of
from specdecode.engine import SpeculativeEngine
from specdecode.errors import SpecDecodeError
from specdecode.drafters import NgramDrafter, NoDrafter

from conftest import ScriptedBackend, step_outcome

NL = 1  # the newline token
PROMPT = [90, 91, 92]


def token_bytes(t: int) -> bytes:
    return b"\n" if t == NL else bytes([97 + t % 26])


def lines(*rows):
    """Token ids of lines (each a list of ids) joined by newline tokens."""
    out = []
    for r in rows:
        out += list(r) + [NL]
    return out


def file_of(n_lines=12, width=6, base=2):
    return lines(*[[base + (i * width + j) % 80 for j in range(width)] for i in range(n_lines)])


def simulate(pred, output, k=8):
    """Greedy verification of the drafter's proposals against a known output: each step
    accepts the proposal's agreeing prefix and commits one more token of the output.
    Returns the drafter and the steps as (drafted, accepted)."""
    d = PredictionDrafter()
    d.start(PROMPT, None)
    d.set_prediction(pred, token_bytes)
    ctx, steps, i = list(PROMPT), [], 0
    while i < len(output):
        draft = d.propose(ctx, k).token_ids
        n = 0
        while n < len(draft) and i + n < len(output) and draft[n] == output[i + n]:
            n += 1
        d.observe(step_outcome(n))
        steps.append((len(draft), n))
        ctx += output[i:i + n + 1]
        i += n + 1
    return d, steps


def test_follows_a_prediction_that_is_right():
    pred = file_of()
    d, steps = simulate(pred, pred, k=8)
    assert all(a == k for k, a in steps[:-1]) and steps[0] == (8, 8)
    assert d.rejected == 0
    assert d.accepted == sum(a for _, a in steps) >= len(pred) - len(steps)
    assert d.confirmed


def test_a_changed_line_realigns_on_the_next_one():
    pred = file_of()
    rows = [pred[i * 7:(i + 1) * 7 - 1] for i in range(12)]
    changed = [list(r) for r in rows]
    changed[4] = [85, 86, 87, 88]  # line 5 rewritten, shorter
    output = lines(*changed)
    d, steps = simulate(pred, output, k=8)
    # The drafts after the change are the original text again: all but the rewritten line
    # and a few tokens to re-align come from the prediction.
    assert d.accepted >= len(output) - len(steps) - len(changed[4]) - 4
    assert d.rejected <= 8
    drafted_after = sum(k for k, _ in steps[-4:])
    assert drafted_after > 0  # re-aligned, not given up


@pytest.mark.parametrize("edit", ["insert", "delete"])
def test_an_inserted_or_deleted_block_realigns(edit):
    pred = file_of(n_lines=16)
    a, b = 7 * 5, 7 * 9  # lines 6..9
    block = lines([83, 84, 85, 86, 87], [88, 89, 83, 84])
    output = pred[:a] + block + pred[a:] if edit == "insert" else pred[:a] + pred[b:]
    d, steps = simulate(pred, output, k=8)
    tail = len(output) - (a + len(block) if edit == "insert" else a)
    # After the edit the rest of the output is copied from the prediction again.
    assert d.accepted >= a + tail - len(steps) - 4
    assert d.rejected <= 2 * 8


def test_a_prediction_ignored_entirely_stops_being_drafted():
    pred = file_of()
    output = [84 + (i * 7) % 13 for i in range(60)]  # no token of it is in pred
    d, steps = simulate(pred, output, k=8)
    assert d.accepted == 0
    assert d.rejected <= 8  # one failed block, then no alignment: nothing more drafted
    assert sum(k for k, _ in steps[1:]) == 0


def test_realignment_prefers_the_place_nearest_the_expected_position():
    # The same line occurs twice; after a change in line 2 the output goes on with line 3,
    # which must align on its first occurrence after the change, not the later repeat.
    row = [10, 11, 12, 13]
    pred = lines([2, 3, 4], [5, 6, 7], row, [20, 21, 22], row, [30, 31, 32])
    d = PredictionDrafter()
    d.start(PROMPT, None)
    d.set_prediction(pred, token_bytes)
    out = [2, 3, 4, NL, 60, 61, NL] + row[:3]
    ctx = PROMPT + out
    assert d.propose(ctx, 4).token_ids == [13, NL, 20, 21]


def test_start_clears_the_prediction_and_the_counts():
    d, _ = simulate(file_of(), file_of())
    assert d.has_prediction and d.accepted > 0
    d.start(PROMPT, None)
    assert not d.has_prediction and d.accepted == d.rejected == 0
    assert d.propose(PROMPT, 8).token_ids == []
    assert kind_of("prediction")[0].build(None).name == "prediction"


# --- in the engine -----------------------------------------------------------------------

PIECES = [b"", b"\n"] + [bytes([97 + i % 26]) for i in range(2, 100)]
CPU = CostCurve(tuple(range(1, 34)), tuple(0.03 + 0.012 * (n - 1) for n in range(1, 34)))


def NO_GUARD() -> SpeedGuard:
    """A guard that never stops drafting: these tests judge the controller's choices on the
    modelled costs, not on the wall-clock times of a fake target (noisy on a shared machine)."""
    return SpeedGuard(margin=1e9)


def engine_run(script, prediction=None, drafter=None, k=32, **kw):
    target = ScriptedBackend(PIECES, script, n_prompt=len(PROMPT))
    d = drafter or SpeculationController([Source(NgramDrafter(), 1e-5), Source(PredictionDrafter(), 1e-5)], CPU,
                                         kmax=k, guard=NO_GUARD())
    eng = SpeculativeEngine(target, d, num_speculative_tokens=k)
    return eng.generate(PROMPT, max_tokens=200, prediction=prediction, **kw), target


def test_engine_parity_and_counts_with_a_right_an_edited_and_a_wrong_prediction():
    script = file_of(n_lines=20)
    plain, _ = engine_run(script, drafter=PredictionDrafter(), k=0)
    assert plain.token_ids == script
    right, t = engine_run(script, prediction=script)
    assert right.token_ids == script
    st = right.stats
    assert st.accepted_prediction_tokens == st.accepted and st.rejected_prediction_tokens == 0
    assert st.target_forward_passes <= len(script) // 8  # long blocks from the first step
    assert max(t.forward_calls) > 9  # more than CONFIRM_BLOCK + 1: no confirmation in small blocks
    edited = script[:50] + [85, 86, 87] + script[60:]
    res, _ = engine_run(script, prediction=edited)
    assert res.token_ids == script
    assert res.stats.accepted_prediction_tokens > len(script) // 2
    wrong = [50 + (i * 7) % 23 for i in range(140)]
    res, _ = engine_run(script, prediction=wrong)
    assert res.token_ids == script
    assert res.stats.rejected_prediction_tokens <= 16  # the controller stops trusting it at once
    none, _ = engine_run(script)
    assert none.stats.accepted_prediction_tokens is None


def test_a_prediction_its_drafter_cannot_follow_is_ignored():
    """A client sends ``prediction`` whatever the server drafts with (OpenAI's clients do):
    an engine whose drafters do not follow one ignores it, as plain decoding does (issue 61:
    ``serve --draft none`` answered 400 naming ``prediction``)."""
    script = file_of()
    res, _ = engine_run(script, prediction=script, drafter=NgramDrafter(), k=4)
    assert res.token_ids == script and res.stats.accepted_prediction_tokens is None
    res, _ = engine_run(script, prediction=script, drafter=NoDrafter(), k=0)
    assert res.token_ids == script and res.stats.drafted == 0


def test_per_request_drafter_choice():
    script = file_of(n_lines=10)
    res, t = engine_run(script, prediction=script, draft="none")
    assert res.token_ids == script and res.stats.drafted == 0
    res, t = engine_run(script, draft="ngram")
    assert res.token_ids == script and res.stats.accepted_prediction_tokens is None
    assert "prediction" not in res.stats.controller_note
    with pytest.raises(SpecDecodeError) as e:  # a prediction the chosen drafter would not follow
        engine_run(script, prediction=script, draft="ngram")
    assert e.value.param == "prediction" and "'ngram'" in str(e.value)
    with pytest.raises(SpecDecodeError) as e:  # the prediction drafter with nothing to follow
        engine_run(script, draft="prediction")
    assert e.value.param == "prediction"
    res, t = engine_run(script, prediction=script, draft="prediction", num_speculative_tokens=5)
    assert res.token_ids == script and max(res.stats.k_histogram) == 5
    assert res.stats.k_histogram[5] >= len(script) // 6 - 1  # K = 5 every step, but where the output ends sooner
    with pytest.raises(SpecDecodeError) as e:
        engine_run(script, draft="qwen-9b")
    assert e.value.param == "draft" and "qwen-9b" in str(e.value)


def test_smollm_greedy_parity_with_a_prediction(smollm):
    msgs = [{"role": "user", "content": "Write a Python function that adds two numbers, with a docstring."}]
    ids = smollm.tokenize(smollm.apply_chat_template(msgs), add_special=False, parse_special=True)
    controller = SpeculationController([Source(NgramDrafter(), 1e-5), Source(PredictionDrafter(), 1e-5)], CPU,
                                       kmax=32, guard=NO_GUARD())
    eng = SpeculativeEngine(smollm, controller, num_speculative_tokens=32)
    plain = eng.generate(ids, max_tokens=80, plain=True, record_top2_gaps=True)
    pred = list(plain.token_ids)
    edited = pred[:20] + smollm.tokenize("    # a comment\n", add_special=False) + pred[20:]
    for p in (pred, edited, smollm.tokenize("Nothing like the answer at all. " * 6, add_special=False)):
        res = eng.generate(ids, max_tokens=80, prediction=p)
        from specdecode.parity import parity_report
        assert parity_report(res, plain)["status"] in ("exact", "near-tie")
    res = eng.generate(ids, max_tokens=80, prediction=pred)
    assert res.stats.accepted_prediction_tokens >= len(pred) // 2


def test_a_refused_request_leaves_its_slot_free():
    script = file_of(n_lines=4)
    target = ScriptedBackend(PIECES, script, n_prompt=len(PROMPT))
    eng = SpeculativeEngine(target, SpeculationController([Source(PredictionDrafter(), 1e-5)], CPU, kmax=8,
                                                          guard=NO_GUARD()), 8)
    for bad in (dict(draft="ngram"), dict(draft="qwen-9b")):
        with pytest.raises(SpecDecodeError):
            eng.generate(PROMPT, max_tokens=20, **bad)
        assert eng.free_slots() == 1
    assert eng.generate(PROMPT, max_tokens=40, prediction=script).token_ids == script


def test_seeded_sampling_gives_the_same_text_with_any_prediction():
    """Under the seeded Gumbel rule a prediction cannot change the text: the same seed gives
    plain decoding's tokens, whether the prediction is right, edited or wrong (negative
    control: another seed gives another text)."""
    script = file_of(n_lines=10)
    target = ScriptedBackend(PIECES, script, n_prompt=len(PROMPT), margin=1.0)  # flat enough to sample
    eng = SpeculativeEngine(target, SpeculationController([Source(PredictionDrafter(), 1e-5)], CPU, kmax=16,
                                                          guard=NO_GUARD()), 16)
    kw = dict(max_tokens=60, temperature=1.0, seed=11, sampling_rule="gumbel", batch_invariant="off")
    plain = eng.generate(PROMPT, plain=True, **kw).token_ids
    assert plain != script[:60]  # it samples
    for pred in (plain, plain[:20] + [85, 86] + plain[25:], [50 + i % 7 for i in range(60)]):
        res = eng.generate(PROMPT, prediction=pred, **kw)
        assert res.token_ids == plain
    assert eng.generate(PROMPT, prediction=plain, **{**kw, "seed": 12}).token_ids != plain
    res = eng.generate(PROMPT, prediction=plain, **kw)
    assert res.stats.accepted_prediction_tokens >= 40  # and the right prediction is accepted
