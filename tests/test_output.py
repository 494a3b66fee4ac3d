"""OutputAccumulator's text deltas and the tokens each one completes (TextDelta), on fake
token bytes: no model."""

from __future__ import annotations

import numpy as np

from specdecode.output import OutputAccumulator, TextDelta

EOS = 0


def accumulator(pieces: list[bytes], stop=(), logprobs: int | None = 0, max_tokens: int = 100) -> OutputAccumulator:
    return OutputAccumulator([1], {EOS}, lambda t: pieces[t], max_tokens, stop, logprobs)


def feed(out: OutputAccumulator, steps: list[list[int]], n_vocab: int) -> list[TextDelta]:
    """Commit each step's tokens (as the target's own, nothing drafted); then end."""
    deltas = []
    for new in steps:
        new = out.cut(new)
        logits = np.zeros((len(new) + 1, n_vocab), dtype=np.float32)
        for j, t in enumerate(new):
            logits[j, t] = 1.0 + t  # a distinct logprob per token id
        deltas.append(out.add(new, 0, 0, logits))
        if out.finish_reason is not None:
            break
    deltas.append(out.end())
    return deltas


def check_consistent(out: OutputAccumulator, deltas: list[TextDelta]) -> None:
    """The deltas' texts, token ids and logprobs concatenate to the result's."""
    res = out.result()
    assert all(isinstance(d, TextDelta) and isinstance(d, str) for d in deltas)
    assert "".join(deltas) == res.text
    assert [t for d in deltas for t in d.token_ids] == res.token_ids
    assert [lp for d in deltas for lp in d.logprobs] == res.logprobs
    assert [lp.token_id for d in deltas for lp in d.logprobs] == [t for d in deltas for t in d.token_ids]


def test_whole_ascii_tokens_are_reported_with_their_text():
    pieces = [b"", b"<p>", b"ab", b"c", b"de"]
    out = accumulator(pieces)
    deltas = feed(out, [[2], [3, 4]], len(pieces))
    assert [(str(d), d.token_ids) for d in deltas] == [("ab", [2]), ("cde", [3, 4]), ("", [])]
    check_consistent(out, deltas)


def test_multibyte_character_split_across_tokens_waits_for_its_last_byte():
    # "é" = c3 a9 and "你" = e4 bd a0, each split across tokens and steps.
    pieces = [b"", b"<p>", b"x\xc3", b"\xa9", b"\xe4", b"\xbd", b"\xa0y"]
    out = accumulator(pieces)
    deltas = feed(out, [[2], [3], [4], [5], [6]], len(pieces))
    got = [(str(d), d.token_ids) for d in deltas]
    # "x" streams with token 2, but token 2's last byte (c3) is held back: it is reported
    # only once "é" is whole, with token 3. Tokens 4 and 5 wait for "你".
    assert got == [("x", []), ("é", [2, 3]), ("", []), ("", []), ("你y", [4, 5, 6]), ("", [])]
    check_consistent(out, deltas)


def test_stop_string_held_back_across_steps():
    pieces = [b"", b"<p>", b"ab", b"EN", b"x", b"END", b"zz"]
    # Step 2 ends with "EN", a prefix of the stop "END": held back, and token 3 with it;
    # step 3 shows it was not the stop, so "ENx" streams with tokens 3 and 4.
    out = accumulator(pieces, stop=["END"])
    deltas = feed(out, [[2], [3], [4], [5, 6]], len(pieces))
    assert [(str(d), d.token_ids) for d in deltas] == [("ab", [2]), ("", []), ("ENx", [3, 4]), ("", []), ("", [])]
    res = out.result()
    assert (res.text, res.token_ids, res.finish_reason) == ("abENx", [2, 3, 4], "stop")
    check_consistent(out, deltas)


def test_token_straddling_the_stop_is_reported_and_tokens_after_it_never_are():
    pieces = [b"", b"<p>", b"a", b"bc", b"de", b"f"]
    # Stop "cd": token 3 ("bc") contributes "b" before the stop and is kept; token 4
    # starts inside the stop and token 5 after it: both are cut and never reported.
    out = accumulator(pieces, stop=["cd"])
    deltas = feed(out, [[2, 3], [4, 5]], len(pieces))
    # Step 1 streams "ab" ("c" may start the stop): token 3 is not whole yet.
    assert [(str(d), d.token_ids) for d in deltas] == [("ab", [2]), ("", [3]), ("", [])]
    res = out.result()
    assert (res.text, res.token_ids) == ("ab", [2, 3])
    check_consistent(out, deltas)


def test_stop_inside_one_step_reports_the_kept_tokens_with_the_last_text():
    pieces = [b"", b"<p>", b"he", b"llo", b" wor", b"ld.\n\nBye", b"!"]
    out = accumulator(pieces, stop=["\n\n"])
    deltas = feed(out, [[2, 3, 4, 5, 6]], len(pieces))
    assert [(str(d), d.token_ids) for d in deltas] == [("hello world.", [2, 3, 4, 5]), ("", [])]
    check_consistent(out, deltas)


def test_held_back_tail_carries_the_rest_at_the_end():
    pieces = [b"", b"<p>", b"ab", b"\xc3", b"E"]
    out = accumulator(pieces, stop=["EN"], max_tokens=3)
    # max_tokens: an incomplete character and "E" (a stop's prefix) are held back to the end.
    deltas = feed(out, [[2, 3, 4]], len(pieces))
    assert out.finish_reason == "length"
    assert [(str(d), d.token_ids) for d in deltas] == [("ab", [2]), ("\ufffdE", [3, 4])]
    check_consistent(out, deltas)


def test_end_of_generation_token_is_not_reported():
    pieces = [b"", b"<p>", b"ab", b"c"]
    out = accumulator(pieces)
    deltas = feed(out, [[2], [3, EOS, 2]], len(pieces))
    assert [(str(d), d.token_ids) for d in deltas] == [("ab", [2]), ("c", [3]), ("", [])]
    assert out.result().finish_reason == "stop"
    check_consistent(out, deltas)


def test_token_without_bytes_waits_for_text_after_it():
    # A token of no bytes at the streamed end could still be dropped by a stop string
    # found there: it is reported once text after it streams (or at the end).
    pieces = [b"", b"<p>", b"ab", b"", b"c", b"S"]
    out = accumulator(pieces, stop=["S"])
    deltas = feed(out, [[2, 3], [4, 3], [5]], len(pieces))
    assert [(str(d), d.token_ids) for d in deltas] == [("ab", [2]), ("c", [3, 4]), ("", []), ("", [])]
    # The second empty token starts where the stop does: cut, never reported.
    assert out.result().token_ids == [2, 3, 4]
    check_consistent(out, deltas)


def test_without_logprobs_deltas_still_name_their_tokens():
    pieces = [b"", b"<p>", b"ab", b"c"]
    out = accumulator(pieces, logprobs=None)
    deltas = feed(out, [[2, 3]], len(pieces))
    assert deltas[0].token_ids == [2, 3] and deltas[0].logprobs is None
    assert out.result().logprobs is None


def test_text_delta_behaves_as_a_str():
    d = TextDelta("abc", [1, 2])
    assert d == "abc" and d + "d" == "abcd" and type(d + "d") is str and "".join([d, "x"]) == "abcx"
    assert d.token_ids == [1, 2] and d.logprobs is None
    assert TextDelta().token_ids == [] and not TextDelta()
    assert repr(d).startswith("TextDelta('abc'")
