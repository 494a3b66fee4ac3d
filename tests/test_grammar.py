"""Structured output under speculation: the grammar masks the target at every verified
position, cuts drafts that leave it, advances only by committed tokens, allows the end
only where it is complete; output equals plain constrained decoding (greedy) and is
distributed as the masked target (sampling, chi-square with negative controls)."""

from __future__ import annotations

import json
import re

import numpy as np
import pytest
from scipy.stats import chisquare

from conftest import ScriptedBackend
from specdecode.drafters import Draft, DrafterBase, ModelDrafter, NgramDrafter, NoDrafter
from specdecode.engine import SpeculativeEngine
from specdecode.errors import SpecDecodeError
from specdecode.grammar import Grammar, GrammarConstraint
from specdecode.sampling import SamplingParams

PIECES = [b"", b"a", b"b", b"c", b"d", b"e", b"{", b"}", b"1", b"2"]  # id 0: end of generation
ID = {p.decode(): i for i, p in enumerate(PIECES) if p}


class CharBackend(ScriptedBackend):
    """ScriptedBackend whose one-character tokens can also be produced from text."""

    def tokenize(self, text, add_special=True, parse_special=False):
        return [ID[ch] for ch in text]


def scripted(script: str, margin: float = 5.0) -> CharBackend:
    return CharBackend(PIECES, [ID[c] if c != "$" else 0 for c in script], n_prompt=1, eos=0, margin=margin)


class ListDrafter(DrafterBase):
    """Proposes a fixed continuation of the text (a lookup that is sometimes wrong)."""

    name = "list"

    def __init__(self, text: str):
        self.ids = [ID[c] for c in text]

    def propose(self, context, k):
        done = len(context) - 1  # the prompt is one token
        return Draft(self.ids[done: done + k])


def test_drafts_that_leave_the_grammar_are_cut_before_verification():
    """The target wants "abd"; the grammar allows only a[bc]c; a draft "abd..." is cut at
    "d", never verified, and the grammar's state follows the committed tokens only."""
    grammar = Grammar("regex", "a[bc]c")
    target = scripted("abddd$")
    engine = SpeculativeEngine(target, ListDrafter("abdde"), 4)
    out = engine.generate([ID["a"]], max_tokens=8, grammar=grammar)
    assert out.text == "abc" and out.finish_reason == "stop"
    # One forward: [a] + drafts "ab" (cut before "d"), then the masked target picks c at
    # position 3; the end follows once the grammar is complete.
    assert target.forward_calls[0] == 3
    plain = SpeculativeEngine(scripted("abddd$"), NoDrafter(), 0).generate([ID["a"]], max_tokens=8, grammar=grammar)
    assert plain.token_ids == out.token_ids


def test_grammar_state_equals_plain_decoding_after_every_step():
    grammar = Grammar("regex", r"\{(1|2)+\}")
    seen: list[list[int]] = []

    class Spy(GrammarConstraint):
        def commit(self, tokens):
            super().commit(tokens)
            seen.append(list(tokens))

    import specdecode.engine.core as eng

    original = eng.GrammarConstraint
    eng.GrammarConstraint = Spy
    try:
        spec = SpeculativeEngine(scripted("{1212}$"), ListDrafter("{1221}"), 3).generate([ID["a"]], max_tokens=10,
                                                                                        grammar=grammar)
        spec_commits = [t for step in seen for t in step]
        seen.clear()
        plain = SpeculativeEngine(scripted("{1212}$"), NoDrafter(), 0).generate([ID["a"]], max_tokens=10,
                                                                              grammar=grammar)
        plain_commits = [t for step in seen for t in step]
    finally:
        eng.GrammarConstraint = original
    assert spec.text == plain.text == "{1212}"
    assert spec_commits == plain_commits == spec.token_ids  # the matcher saw exactly the committed tokens


def test_end_of_generation_is_refused_until_the_grammar_is_complete():
    # The target wants to stop at once; the grammar needs "abc" first.
    out = SpeculativeEngine(scripted("$$$$$$"), NoDrafter(), 0).generate([ID["a"]], max_tokens=8,
                                                                        grammar=Grammar("regex", "abc"))
    assert out.text == "abc" and out.finish_reason == "stop"
    # Once complete, only the end is allowed, whatever the target prefers.
    out = SpeculativeEngine(scripted("abcddd"), NgramDrafter(), 4).generate([ID["a"]], max_tokens=8,
                                                                           grammar=Grammar("regex", "abc"))
    assert out.text == "abc" and out.finish_reason == "stop"


def test_a_grammar_that_does_not_compile_names_itself():
    with pytest.raises(SpecDecodeError, match="--regex: the grammar cannot be compiled") as e:
        SpeculativeEngine(scripted("a$"), NoDrafter(), 0).generate([1], max_tokens=2,
                                                                  grammar=Grammar("regex", "[a-", name="--regex"))
    assert e.value.param == "--regex" and "\n" not in str(e.value)
    with pytest.raises(SpecDecodeError, match="not valid JSON"):
        Grammar.json_schema("{nope")


# ------------------------------------------------------------------ sampling: chi-square

V = len(PIECES)
REGEX = "[abc][cde]"  # first token in {a, b, c}, second in {c, d, e}, then the end
TRIALS = 12_000


class TableTarget(CharBackend):
    """Fixed logits per output position (independent of the tokens), over the small vocabulary."""

    def __init__(self, table: np.ndarray):
        super().__init__(PIECES, [], n_prompt=1, eos=0)
        self.table = table

    def _forward(self, seq, token_ids, logits_for):
        cache = self.caches[seq]
        start = len(cache)
        cache.extend(int(t) for t in token_ids)
        pos = [min(start + i, len(self.table) - 1) for i in logits_for]
        return self.table[pos].astype(np.float32)


class TableDrafter(DrafterBase):
    """Draws each draft from its own logits table, masked by the grammar like the target
    (sampler.constrain). mislabel: report the unmasked distribution as the one drawn from."""

    name = "table"

    def __init__(self, table: np.ndarray, mislabel: bool = False):
        self.table = table
        self.mislabel = mislabel

    def start(self, prompt_ids, sampler):
        self.sampler = sampler

    def propose(self, context, k):
        drafts, rows = [], []
        for i in range(k):
            raw = self.table[min(len(context) - 1 + i, len(self.table) - 1)]
            q = self.sampler.probs(self.sampler.constrain(raw, drafts), ())
            tok = self.sampler.draw(q, len(context) + i)
            rows.append(self.sampler.probs(raw, ()) if self.mislabel else q)
            drafts.append(tok)
            if tok == 0:
                break
        return Draft(drafts, np.stack(rows))


def tables(seed: int):
    rng = np.random.default_rng(seed)
    target = rng.normal(0, 1.5, size=(4, V))
    draft = target + rng.normal(0, 1.0, size=(4, V))  # close to the target, not equal
    return target, draft


def masked_joint(target: np.ndarray) -> dict[tuple[int, int], float]:
    def dist(row, allowed):
        p = np.zeros(V)
        p[allowed] = np.exp(row[allowed] - row[allowed].max())
        return p / p.sum()

    first = dist(target[0], [ID["a"], ID["b"], ID["c"]])
    second = dist(target[1], [ID["c"], ID["d"], ID["e"]])
    return {(i, j): first[i] * second[j] for i in range(V) for j in range(V) if first[i] * second[j] > 0}


def sample_pairs(engine: SpeculativeEngine, n: int = TRIALS, rule: str = "gumbel") -> tuple[dict, int]:
    counts: dict[tuple[int, int], int] = {}
    invalid = 0
    grammar = Grammar("regex", REGEX)
    for seed in range(n):
        try:
            r = engine.generate([ID["a"]], sampling=SamplingParams(temperature=1.0, seed=seed, sampling_rule=rule),
                                          max_tokens=2, grammar=grammar)
        except SpecDecodeError:  # a committed token left the grammar
            invalid += 1
            continue
        key = tuple(r.token_ids[:2]) if len(r.token_ids) >= 2 else None
        if key is None or not re.fullmatch(REGEX, r.text):
            invalid += 1
            continue
        counts[key] = counts.get(key, 0) + 1
    return counts, invalid


def chi_square_p(counts: dict, expected: dict, n: int) -> float:
    keys = sorted(expected)
    obs = np.array([counts.get(k, 0) for k in keys], dtype=float)
    exp = np.array([expected[k] for k in keys]) * obs.sum()
    assert sum(counts.values()) == obs.sum(), "a pair outside the grammar's support"
    return float(chisquare(obs, exp).pvalue)


@pytest.fixture(scope="module")
def case():
    target, draft = tables(7)
    return target, draft, masked_joint(target)


@pytest.mark.parametrize("rule", ["gumbel", "rejection"])
def test_constrained_speculative_sampling_is_distributed_as_the_masked_target(case, rule):
    target, draft, expected = case
    counts, invalid = sample_pairs(SpeculativeEngine(TableTarget(target), TableDrafter(draft), 2), rule=rule)
    assert invalid == 0
    assert chi_square_p(counts, expected, TRIALS) > 1e-3


def test_negative_control_target_left_unmasked_fails(case, monkeypatch):
    """Only the draft constrained: the target's recovered and bonus tokens come from the
    unmasked distribution, so outputs leave the grammar or are mis-distributed."""
    target, draft, expected = case

    def verify_unmasked(gen, draft_ids, draft_probs, logits, hidden):
        from specdecode.engine.generation import Verified
        from specdecode.verify import verify_speculative_sampling

        probs = np.stack([gen.sampler.probs(logits[i], ()) for i in range(len(draft_ids) + 1)])
        result = verify_speculative_sampling(draft_ids, draft_probs, probs, gen.sampler.rng)
        return Verified(draft_ids, len(draft_ids), result, None, logits, hidden)

    monkeypatch.setattr(SpeculativeEngine, "_verify", staticmethod(verify_unmasked))
    counts, invalid = sample_pairs(SpeculativeEngine(TableTarget(target), TableDrafter(draft), 2), 3000)
    assert invalid > 0 or chi_square_p(counts, expected, 3000) < 1e-6


def test_negative_control_masked_draft_reporting_unmasked_probabilities_fails(case):
    target, draft, expected = case
    # The rejection rule reads the draft's probabilities (the "gumbel" rule does not: there
    # the target's token is a function of its own distribution and the noise alone).
    counts, invalid = sample_pairs(SpeculativeEngine(TableTarget(target), TableDrafter(draft, mislabel=True), 2),
                                   rule="rejection")
    assert invalid == 0  # every output is in the grammar: only its distribution is wrong
    assert chi_square_p(counts, expected, TRIALS) < 1e-6


# ------------------------------------------------------------------ real model (smollm2)

SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 12},
                                           "age": {"type": "integer"}},
          "required": ["name", "age"], "additionalProperties": False}


@pytest.mark.parametrize("k", [1, 4, 8])
@pytest.mark.parametrize("kind", ["ngram", "model"])
def test_json_schema_and_regex_on_smollm_equal_plain_constrained_decoding(smollm, smollm_draft, kind, k):
    messages = [{"role": "user", "content": "Give a person as JSON with a name and an age, and then "
                                            "the year 1999 written as digits."}]
    text = smollm.apply_chat_template(messages)
    ids = smollm.tokenize(text, add_special=False, parse_special=True)
    for grammar, check in [(Grammar.json_schema(SCHEMA), lambda t: set(json.loads(t)) == {"name", "age"}),
                           (Grammar("regex", r"[0-9]{4}( is a year\.)?"),
                            lambda t: re.fullmatch(r"[0-9]{4}( is a year\.)?", t))]:
        drafter = NgramDrafter() if kind == "ngram" else ModelDrafter(smollm_draft, target=smollm)
        spec = SpeculativeEngine(smollm, drafter, k).generate(ids, max_tokens=32, grammar=grammar)
        plain = SpeculativeEngine(smollm, NoDrafter(), 0).generate(ids, max_tokens=32, grammar=grammar,
                                                                 record_top2_gaps=True)
        assert check(spec.text), spec.text
        from specdecode.parity import parity_report

        assert spec.token_ids == plain.token_ids or parity_report(spec, plain)["status"] == "near-tie"
