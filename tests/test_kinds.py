"""The table of drafter kinds: a new drafter is one class and one row, and everything that
names drafters (the --draft help, validation, loading, the controller, the bench, --parallel)
takes it from there. The drafter added here proposes a fixed string, as a user who knows
what the answer will contain could."""

from __future__ import annotations

import argparse
from typing import Sequence

import pytest

import specdecode
from specdecode.bench.suite import parse_config
from specdecode.drafters import Draft, DrafterBase
from specdecode.drafters import kinds
from specdecode.drafters.kinds import MODEL, DrafterKind, check_draft_options, kind_of
from specdecode.errors import SpecDecodeError
from specdecode.options import add_model_options

from conftest import SMOLLM

TEXT = " the quick brown fox jumps over the lazy dog"


class FixedStringDrafter(DrafterBase):
    """Proposes the tokens of a fixed text: after the last committed token where it occurs
    in the text, what follows it there; else the text from its start."""

    name = "fixed"

    def __init__(self, token_ids: Sequence[int]) -> None:
        self.token_ids = list(token_ids)

    def propose(self, context: Sequence[int], k: int) -> Draft:
        t = self.token_ids
        for j in range(len(t) - 1, -1, -1):
            if t[j] == context[-1]:
                return Draft(t[j + 1: j + 1 + k])
        return Draft(t[:k])


def fixed_row(parallel: bool = True) -> DrafterKind:
    return DrafterKind("fixed", "fixed:TEXT", "propose a fixed text",
                       lambda req: FixedStringDrafter(req.target.tokenize(req.arg, add_special=False)),
                       arg="TEXT", parallel=parallel)


@pytest.fixture
def with_fixed(monkeypatch):
    """The table with one more row, as a new drafter's file would add it."""
    original = kinds.KINDS

    def add(parallel: bool = True) -> None:
        monkeypatch.setattr(kinds, "KINDS", original[:-1] + (fixed_row(parallel), MODEL))
    add()
    return add


def test_the_new_kind_is_named_helped_and_validated(with_fixed):
    kind, arg = kind_of("fixed:" + TEXT)
    assert kind.name == "fixed" and arg == TEXT
    assert kind_of("fixed")[0] is MODEL  # a kind with an argument needs it: "fixed" alone is a model name
    p = argparse.ArgumentParser()
    add_model_options(p)
    assert "'fixed:TEXT' (propose a fixed text)" in " ".join(p.format_help().split())
    with pytest.raises(SpecDecodeError, match="draft_vocab") as e:
        check_draft_options("fixed:x", draft_vocab=1000)
    assert e.value.param == "draft_vocab"
    assert parse_config("fixed:a b:4") == ("fixed:a b", 4)
    assert parse_config("fixed:a b") == ("fixed:a b", "auto")


def test_the_new_kind_drafts_in_the_decoder_with_plain_output(with_fixed):
    prompt = "Repeat exactly:" + TEXT + "\nAgain:"
    with specdecode.Decoder(target=SMOLLM, draft="fixed:" + TEXT, num_speculative_tokens=4, progress=False) as dec:
        spec = dec.generate(prompt, max_tokens=24)
        plain = dec.generate(prompt, max_tokens=24, plain=True)
    assert spec.stats.drafted > 0 and spec.stats.accepted > 0
    assert spec.token_ids == plain.token_ids


def test_the_new_kind_serves_the_controller_and_parallel_slots(with_fixed):
    prompt = "Repeat exactly:" + TEXT + "\nAgain:"
    with specdecode.Decoder(target=SMOLLM, draft="fixed:" + TEXT, num_speculative_tokens="auto", parallel=2,
                            progress=False) as dec:
        gens = [dec.begin(prompt, max_tokens=16), dec.begin(prompt + " and", max_tokens=16)]
        while not all(g.done for g in gens):
            dec.step([g for g in gens if not g.done])
        results = [dec.end(g)[-1] for g in gens]
        solo = dec.generate(prompt, max_tokens=16, plain=True)
    assert results[0].token_ids == solo.token_ids
    assert type(dec.drafter).__name__ == "SpeculationController"
    assert [s.name for s in dec.drafter.sources] == ["fixed"]


def test_a_kind_that_serves_one_generation_is_refused_for_parallel_slots(with_fixed):
    with_fixed(parallel=False)
    with pytest.raises(SpecDecodeError, match="one generation at a time") as e:
        specdecode.Decoder(target=SMOLLM, draft="fixed:x", parallel=2, progress=False)
    assert e.value.param == "parallel"
    check_draft_options("fixed:x", parallel=1)  # one slot is fine
