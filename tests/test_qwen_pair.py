"""Integration on the default pair (qwen2.5-coder-1.5b target, 0.5b draft): pulls ~1.6 GB once."""

from __future__ import annotations

import pytest

import specdecode
from specdecode.limits import AUTO_KMAX

pytestmark = pytest.mark.qwen


@pytest.fixture(scope="module")
def decoder():
    with specdecode.Decoder(draft=specdecode.assembly.registry.DEFAULT_DRAFT, num_speculative_tokens=4, progress=False) as dec:
        yield dec


def test_default_pair_short_generation(decoder):
    messages = [{"role": "user", "content": "Write a Python function that adds two numbers."}]
    spec, plain, report = decoder.compare(messages=messages, max_tokens=32)
    s = spec.stats
    assert s.completion_tokens == len(spec.token_ids) > 0
    assert 0.0 < s.acceptance_rate <= 1.0
    assert 1.0 <= s.mean_accepted_length <= 5.0
    assert s.drafted == sum(s.drafted_per_position) and s.accepted == sum(s.accepted_per_position)
    assert s.target_forward_passes < plain.stats.target_forward_passes
    assert s.decode_tokens_per_s > 0 and s.prefill_s > 0
    assert report["parity"]["status"] in ("exact", "near-tie"), report
    assert "def" in spec.text


def test_auto_controller_is_lossless_and_reports_its_choices():
    with specdecode.Decoder(draft="auto", num_speculative_tokens="auto", progress=False) as dec:
        text = "Return this code unchanged:\ndef add(a, b):\n    return a + b\n"
        spec, plain, report = dec.compare(messages=[{"role": "user", "content": text}], max_tokens=32)
        assert report["parity"]["status"] in ("exact", "near-tie"), report
        s = spec.stats
        assert sum(s.k_histogram.values()) == s.target_forward_passes
        assert all(0 <= int(k) <= AUTO_KMAX for k in s.k_histogram)
        assert sum(dec.drafter.choices.values()) >= s.target_forward_passes - 1


def test_registry_fingerprints_match_the_models(decoder):
    """The tokenizer fingerprints the registry records (what --draft auto decides by) are the
    loaded models' own; the default draft therefore serves the default target."""
    from specdecode.assembly import registry
    from specdecode.assembly.loading import default_draft_serves
    from specdecode.backends.vocab import vocab_fingerprint

    assert vocab_fingerprint(decoder.target) == registry.get_spec(registry.DEFAULT_TARGET).vocab_fingerprint
    assert vocab_fingerprint(decoder.drafter.draft_backends()[0]) == registry.get_spec(registry.DEFAULT_DRAFT).vocab_fingerprint
    assert default_draft_serves(decoder.target)


def test_a_seed_fixes_the_text_under_k_auto_on_the_default_pair():
    """Seeded sampling verifies batch-invariantly: the text equals plain decoding's for the
    seed token for token (parity exact, no near-tie allowance), whatever K the controller took."""
    with specdecode.Decoder(draft="auto", num_speculative_tokens="auto", progress=False) as dec:
        text = open("examples/edit_function.txt").read()
        spec, plain, report = dec.compare(messages=[{"role": "user", "content": text}], max_tokens=64,
                                          temperature=0.8, seed=3)
        assert report["parity"]["status"] == "exact", report
        assert spec.stats.invariant_block == plain.stats.invariant_block == dec.target.invariant_block >= 1
        assert spec.stats.target_forward_passes <= plain.stats.target_forward_passes


def test_smollm2_drafts_for_qwen_across_tokenizers():
    """smollm2 (49,152 ids) for the Qwen target (151,936): SLEM under greedy decoding, TLI
    under seeded sampling, the target's own output either way."""
    with specdecode.Decoder(draft="smollm2-135m-instruct", num_speculative_tokens=4, progress=False) as dec:
        assert dec.engine.drafter.vmap.shared > 30000
        messages = [{"role": "user", "content": "Write a Python function that reverses a string, with a docstring."}]
        spec, plain, report = dec.compare(messages=messages, max_tokens=48)
        assert report["parity"]["status"] in ("exact", "near-tie"), report
        s = spec.stats
        assert dec.engine.drafter.ran == "slem" and s.drafted > 0 and s.accepted > 0
        assert "SLEM across tokenizers" in s.controller_note
        seeded = dict(messages=messages, max_tokens=32, temperature=0.8, seed=3)
        spec = dec.generate(**seeded)
        assert dec.engine.drafter.ran == "tli" and spec.stats.drafted > 0
        assert spec.token_ids == dec.generate(**seeded, plain=True).token_ids  # a seed fixes the text
