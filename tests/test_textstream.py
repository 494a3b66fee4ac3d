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
