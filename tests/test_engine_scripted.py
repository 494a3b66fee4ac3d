"""Engine mechanics on a scripted fake target: stopping, max_tokens, streaming, caches."""

from __future__ import annotations

import numpy as np
import pytest

from specdecode.drafters import NoDrafter
from specdecode.engine import GenerationResult, SpeculativeEngine
from specdecode.errors import ContextOverflowError, ModelFileError, SpecDecodeError
from specdecode.sampling import SamplingParams

from conftest import OracleDrafter, ScriptedBackend

K = 4
# id 0 = eos, id 1 = filler used for drafts past the script; ids 2.. are letters.
LETTERS = [chr(ord("a") + i).encode() for i in range(20)]
PIECES = [b"", b"?"] + LETTERS
PROMPT = [5, 6, 7]


def run(script, max_tokens=100, stop=(), k=K, drafter="oracle", **kw):
    target = ScriptedBackend(PIECES, script, n_prompt=len(PROMPT))
    d = OracleDrafter(target) if drafter == "oracle" else NoDrafter()
    eng = SpeculativeEngine(target, d, num_speculative_tokens=k)
    deltas, result = [], None
    for item in eng.stream(PROMPT, max_tokens=max_tokens, stop=stop, **kw):
        if isinstance(item, GenerationResult):
            result = item
        else:
            deltas.append(item)
    return target, result, deltas


def letters(ids):
    return "".join(PIECES[i].decode() for i in ids)


def test_oracle_drafter_accepts_everything_and_matches_plain():
    script = list(range(2, 16))
    t, res, deltas = run(script)
    _, plain, _ = run(script, drafter="none")
    assert res.token_ids == script == plain.token_ids
    assert res.finish_reason == "stop"
    assert "".join(deltas) == res.text == letters(script)
    # 14 tokens + eos, 5 per pass (K=4 accepted + bonus): 3 passes; in the third all 4
    # drafts are accepted and the bonus token is eos, which is not emitted.
    assert res.stats.target_forward_passes == 3
    assert res.stats.accepted == res.stats.drafted == 12
    assert plain.stats.target_forward_passes == len(script) + 1


@pytest.mark.parametrize("eos_at", range(K + 1))
@pytest.mark.parametrize("block", [0, 1])
def test_eos_at_each_position_of_a_block(eos_at, block):
    n = block * (K + 1) + eos_at  # number of tokens before eos
    script = [2 + (i % 18) for i in range(n)] + [0] + [3, 4, 5, 6, 7, 8]
    t, res, deltas = run(script)
    assert res.token_ids == script[:n]
    assert res.finish_reason == "stop"
    assert res.stats.completion_tokens == n
    # The oracle's drafts up to and including eos are all accepted (eos too, though it is not
    # emitted); drafts after eos are not counted: a model drafting for itself reads 1.0.
    assert res.stats.accepted == res.stats.drafted and res.stats.acceptance_rate in (0.0, 1.0)
    assert res.stats.accepted <= n + 1
    # Each pass commits its accepted drafts and the target's own token (eos included).
    assert res.stats.committed_tokens == n + 1
    assert "".join(deltas) == res.text == letters(script[:n])
    # Nothing after eos stays in the cache: the target holds prompt + emitted minus the last.
    assert t.cache == (PROMPT + script[:n])[: len(PROMPT) + n - 1] or (n == 0 and t.cache == PROMPT[:-1])


@pytest.mark.parametrize("max_tokens", [1, K - 1, K, K + 1, 2 * K + 3])
def test_max_tokens_exact(max_tokens):
    script = list(range(2, 22))
    t, res, deltas = run(script, max_tokens=max_tokens)
    assert res.token_ids == script[:max_tokens]
    assert res.finish_reason == "length"
    assert res.stats.completion_tokens == max_tokens
    assert "".join(deltas) == res.text
    # No forward verifies more than the tokens still allowed (k <= remaining - 1).
    assert sum(t.forward_calls[1:]) <= max_tokens + (len(t.forward_calls) - 1)


def test_stop_beats_the_cap_when_inside_the_budget():
    script = list(range(2, 22))  # "abcdefghij..."
    _, res, _ = run(script, max_tokens=5, stop=["e"])  # "e" is the 5th token
    assert res.finish_reason == "stop" and res.text == "abcd" and res.token_ids == script[:4]


@pytest.mark.parametrize(
    "stop, expect_text",
    [
        ("a", ""),  # start of the first block
        ("c", "ab"),  # middle of the first block
        ("e", "abcd"),  # end of the first block (K+1 = 5th token)
        ("ef", "abcd"),  # straddles the first and second step
        ("defg", "abc"),  # starts in step 1, ends in step 2
        ("hij", "abcdefg"),  # middle of the second block
    ],
)
def test_stop_strings(stop, expect_text):
    script = list(range(2, 22))
    t, res, deltas = run(script, stop=[stop, "zzz"])
    assert res.text == expect_text
    assert res.finish_reason == "stop"
    assert "".join(deltas) == expect_text
    assert letters(res.token_ids) == expect_text
    assert res.stats.completion_tokens == len(expect_text)
    assert res.stats.accepted == sum(res.from_draft) == sum(res.stats.accepted_per_position)
    # The cache holds nothing past the cut.
    assert t.cache == (PROMPT + res.token_ids)[:-1]


def test_stop_string_cut_inside_a_token():
    pieces = [b"", b"?", b"hello", b" wor", b"ld.\n\nBye", b"!"]
    target = ScriptedBackend(pieces, [2, 3, 4, 5], n_prompt=1)
    eng = SpeculativeEngine(target, OracleDrafter(target), 4)
    res = eng.generate([2], stop=["\n\n"])
    assert res.text == "hello world."
    # The token that straddles the stop string contributes bytes before it, so it is kept.
    assert res.token_ids == [2, 3, 4]
    assert res.finish_reason == "stop"


def test_utf8_deltas_are_whole_characters():
    # "你好" = e4 bd a0 e5 a5 bd, split across tokens and steps.
    text = "你好, 世界"
    raw = text.encode()
    cuts = [0, 1, 2, 4, 5, 7, 8, 10, 11, 13, len(raw)]
    pieces = [b"", b"?"] + [raw[a:b] for a, b in zip(cuts, cuts[1:])]
    script = list(range(2, len(pieces)))
    for k in (0, 1, 2, 3):
        target = ScriptedBackend(pieces, script, n_prompt=1)
        eng = SpeculativeEngine(target, OracleDrafter(target), k)
        deltas = [d for d in eng.stream([2]) if isinstance(d, str)]
        assert "".join(deltas) == text
        for d in deltas:
            assert "\ufffd" not in d
            d.encode("utf-8")


def test_prompt_that_does_not_fit():
    target = ScriptedBackend(PIECES, [2, 3], n_prompt=600, n_ctx=512)
    eng = SpeculativeEngine(target, NoDrafter(), 0)
    with pytest.raises(ContextOverflowError, match="600 tokens.*512"):
        eng.generate([3] * 600)


class CorruptAfter(ScriptedBackend):
    """Logits turn NaN from position ``bad`` on (weights cut or overwritten in a file that still loads)."""

    def __init__(self, *args, bad: int, **kw):
        super().__init__(*args, **kw)
        self.bad = bad

    def _forward(self, seq, token_ids, logits_for):
        start = len(self.caches[seq])
        rows = super()._forward(seq, token_ids, logits_for)
        for r, i in enumerate(logits_for):
            if start + i >= self.bad:
                rows[r] = np.nan
        return rows


@pytest.mark.parametrize("drafter, sampling", [("none", None), ("oracle", None),
                                               ("none", SamplingParams(temperature=0.8, seed=1))])
def test_non_finite_logits_name_the_model_instead_of_being_sampled(drafter, sampling):
    """Greedy decoding took a NaN row's argmax (token 0: an empty answer, finish_reason stop);
    sampling failed with 'zero mass'. Both now say the weights are corrupt."""
    target = CorruptAfter(PIECES, [2, 3, 4, 5, 6, 7], n_prompt=len(PROMPT), bad=len(PROMPT) + 1)
    d = OracleDrafter(target) if drafter == "oracle" else NoDrafter()
    eng = SpeculativeEngine(target, d, num_speculative_tokens=K)
    kw = {"sampling": sampling} if sampling else {}
    with pytest.raises(ModelFileError, match="model scripted gave non-finite logits .NaN or infinity.: its weights"):
        eng.generate(PROMPT, max_tokens=20, **kw)
    ok = CorruptAfter(PIECES, [2, 3, 4], n_prompt=len(PROMPT), bad=10 ** 6)  # control: finite logits pass
    assert SpeculativeEngine(ok, NoDrafter(), 0).generate(PROMPT, max_tokens=20).token_ids == [2, 3, 4]


def test_near_the_end_of_the_context_drafts_fewer():
    n_ctx = 20
    script = list(range(2, 22)) * 2
    target = ScriptedBackend(PIECES, script, n_prompt=len(PROMPT), n_ctx=n_ctx)
    eng = SpeculativeEngine(target, OracleDrafter(target), 8)
    res = eng.generate(PROMPT, max_tokens=100)
    assert res.finish_reason == "length"
    assert len(PROMPT) + len(res.token_ids) == n_ctx
    assert res.token_ids == script[: n_ctx - len(PROMPT)]


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"max_tokens": 0}, "max_tokens = 0"),
        ({"logprobs": 99}, "logprobs = 99"),
        ({"stop": [""]}, "stop strings"),
        ({"num_speculative_tokens": 33}, "num_speculative_tokens = 33"),
    ],
)
def test_bad_options(kwargs, match):
    target = ScriptedBackend(PIECES, [2], n_prompt=1)
    eng = SpeculativeEngine(target, NoDrafter(), 0)
    with pytest.raises(SpecDecodeError, match=match):
        eng.generate([2], **kwargs)


def test_penalties_see_drafts_before_each_position():
    # The script repeats token 2; with a strong presence penalty the target's argmax moves
    # away from 2 once 2 is in the history, including when that 2 is an earlier draft in the
    # same block. Plain decoding is the reference.
    script = [2, 2, 2, 2, 2, 2]
    params = SamplingParams(presence_penalty=2.0, frequency_penalty=2.0, penalty_last_n=-1)
    for margin in (1.0, 9.0):
        t1 = ScriptedBackend(PIECES, script, n_prompt=len(PROMPT), margin=margin)
        spec = SpeculativeEngine(t1, OracleDrafter(t1), 4).generate(PROMPT, sampling=params, max_tokens=6)
        t2 = ScriptedBackend(PIECES, script, n_prompt=len(PROMPT), margin=margin)
        plain = SpeculativeEngine(t2, NoDrafter(), 0).generate(PROMPT, sampling=params, max_tokens=6)
        assert spec.token_ids == plain.token_ids
    # margin 9 - 2*count - 2 stays above the other tokens' 0 for counts 0..3; then eos (id 0) wins.
    assert spec.token_ids == [2, 2, 2, 2] and spec.finish_reason == "stop"


@pytest.mark.parametrize("drafter", ["none", "oracle"])
def test_a_stop_string_does_not_lower_mean_accepted_length(drafter):
    """Plain decoding commits one token per forward, whatever a stop string later cuts
    (the README: plain decoding reads 1.0); speculation's figure counts what was committed."""
    script = list(range(2, 16))
    _, res, _ = run(script, stop=("ghi",), drafter=drafter)
    assert res.text == letters(script).split("ghi")[0] and res.finish_reason == "stop"
    if drafter == "none":
        assert res.stats.mean_accepted_length == 1.0
    else:
        assert res.stats.mean_accepted_length == res.stats.committed_tokens / res.stats.target_forward_passes > 1.0
