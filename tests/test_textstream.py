"""TextAssembler alone: whole UTF-8 characters, stop strings across tokens and steps, exact cuts."""

from __future__ import annotations

import pytest

from specdecode.textstream import TextAssembler


def feed(asm: TextAssembler, steps: list[list[bytes]]) -> tuple[list[str], bool]:
    deltas, stopped = [], False
    for pieces in steps:
        delta, stopped = asm.add(pieces)
        deltas.append(delta)
        if stopped:
            break
    if not stopped:
        deltas.append(asm.finish())
    return deltas, stopped


def test_multibyte_character_split_across_tokens_is_never_streamed_in_halves():
    euro = "€".encode()  # 3 bytes
    asm = TextAssembler()
    deltas, _ = feed(asm, [[b"a", euro[:1]], [euro[1:2]], [euro[2:], b"b"]])
    assert deltas == ["a", "", "€b", ""]
    assert asm.text == "a€b" and asm.num_tokens == 5


def test_four_byte_character_split_one_byte_per_step():
    smile = "😀".encode()
    asm = TextAssembler()
    deltas, _ = feed(asm, [[smile[i:i + 1]] for i in range(4)])
    assert "".join(deltas) == "😀"
    assert all(d in ("", "😀") for d in deltas)


def test_stop_string_across_tokens_and_steps_is_cut_and_never_streamed():
    asm = TextAssembler(stop=["END"])
    deltas, stopped = feed(asm, [[b"hello E"], [b"N"], [b"D tail"]])
    assert stopped
    assert "".join(deltas) == asm.text == "hello "
    assert "E" not in "".join(deltas)  # held back while it could still become the stop string
    assert asm.num_tokens == 1  # the tokens starting at or after the stop string are dropped


def test_held_back_prefix_is_released_when_it_does_not_complete_a_stop():
    asm = TextAssembler(stop=["END"])
    d1, s1 = asm.add([b"x EN"])
    assert (d1, s1) == ("x ", False)
    d2, s2 = asm.add([b"T"])
    assert (d2, s2) == ("ENT", False)
    assert asm.finish() == "" and asm.text == "x ENT"


def test_the_stop_that_completes_first_in_the_text_wins_whatever_its_place_in_the_list():
    asm = TextAssembler(stop=["zzz-long", "b"])
    deltas, stopped = feed(asm, [[b"a", b"b", b"c zzz-long"]])
    assert stopped and asm.text == "a" and asm.num_tokens == 1

    asm = TextAssembler(stop=["c z", "ab"])  # the later entry occurs earlier in the text
    deltas, stopped = feed(asm, [[b"x", b"a"], [b"b", b"c z"]])
    assert stopped and asm.text == "x" and asm.num_tokens == 1


def test_a_token_that_holds_the_stop_string_start_and_text_before_it_is_kept():
    asm = TextAssembler(stop=["\n\n"])
    deltas, stopped = feed(asm, [[b"def f():", b" pass\n"], [b"\nx"]])
    assert stopped and asm.text == "def f(): pass"
    # " pass\n" contributes bytes before the stop string; "\nx" starts inside it and is dropped.
    assert asm.num_tokens == 2


def test_deltas_concatenate_to_the_text_and_adding_after_a_stop_is_an_error():
    asm = TextAssembler(stop=["!"])
    deltas, stopped = feed(asm, [[b"hi"], [b" there!", b"more"]])
    assert "".join(deltas) == asm.text == "hi there"
    with pytest.raises(RuntimeError):
        asm.add([b"x"])


def test_stop_string_with_multibyte_characters():
    asm = TextAssembler(stop=["é!"])
    e = "é".encode()
    deltas, stopped = feed(asm, [[b"caf", e[:1]], [e[1:], b"!", b" ok"]])
    assert stopped and asm.text == "caf" and asm.num_tokens == 1  # the token starting "é" is dropped


class NaiveStops:
    """The reference: every stop string searched in the text after each chunk (the earliest
    start among matches that end in the new bytes), and the longest suffix that is a proper
    prefix of a stop string held back."""

    def __init__(self, stops):
        self.stops = [s.encode() for s in stops]
        self.buf = b""

    def feed(self, data):
        old = len(self.buf)
        self.buf += data
        starts = [i for s in self.stops for i in _all_starts(self.buf, s) if old < i + len(s) <= len(self.buf)]
        pending = max((n for s in self.stops for n in range(1, len(s)) if self.buf.endswith(s[:n])), default=0)
        return (min(starts) if starts else None), pending


def _all_starts(buf, s):
    i = buf.find(s)
    while i >= 0:
        yield i
        i = buf.find(s, i + 1)


def test_the_stop_automaton_agrees_with_a_naive_search():
    import random

    from specdecode.textstream import StopMatcher

    rng = random.Random(7)
    for _ in range(400):
        alphabet = "abc" if rng.random() < 0.7 else "ab\u00e9"
        stops = list({"".join(rng.choice(alphabet) for _ in range(rng.randint(1, 5))) for _ in range(rng.randint(1, 6))})
        m, ref = StopMatcher([s.encode() for s in stops]), NaiveStops(stops)
        for _ in range(rng.randint(1, 8)):
            chunk = "".join(rng.choice(alphabet) for _ in range(rng.randint(0, 6))).encode()
            hit, pending = ref.feed(chunk)
            assert m.feed(chunk) == hit, (stops, ref.buf)
            if hit is not None:
                break
            assert m.pending == pending, (stops, ref.buf)


def test_stop_strings_at_the_limits_hold_back_a_long_near_miss():
    """64 stop strings of 512 characters (the limits): a text that is all along a prefix of
    one of them is held back, then streamed whole when the generation ends without it."""
    from specdecode.limits import MAX_STOP_CHARS, MAX_STOP_STRINGS

    stops = [("x%03d" % i) * (MAX_STOP_CHARS // 4) for i in range(MAX_STOP_STRINGS)]
    a = TextAssembler(stops)
    text = ("x%03d" % 7) * 120  # 480 characters: a prefix of stop string 7 all along
    for i in range(0, len(text), 4):
        delta, stopped = a.add([text[i:i + 4].encode()])
        assert not stopped and delta == ""
    assert a.finish() == text and a.text == text
    b = TextAssembler(stops)
    assert b.add([stops[63].encode()]) == ("", True)
