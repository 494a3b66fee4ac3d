"""The attention path chosen by measurement (issue 47, item 3): where SPECDECODE_LLAMA_FLASH_ATTN is
unset, both of llama.cpp's paths' context costs are measured on the loaded model (each cached under
its own cost key) and the one that verifies cheaper after long contexts is used; the variable still
overrides.

The fake target's forwards advance a scripted clock by a cost that depends on the path and the
context: the tests judge the choice and the counts, never the wall clock."""

from __future__ import annotations

import pytest

from specdecode.cli import _stats_block
from specdecode.control.attention import choose_attention, resolve_attention
from specdecode.control.context_costs import ContextCosts, context_cache_path, read_cached_context_costs
from specdecode.drafters import NgramDrafter
from specdecode.engine import SpeculativeEngine

from conftest import ScriptedBackend

ENV = "SPECDECODE_LLAMA_FLASH_ATTN"


def costs(base_on, base_off, extra_on, extra_off) -> dict:
    """Both paths at sizes (1, 33) and contexts (1024, 4096), extras given at 4096 (half at 1024)."""
    make = lambda base, ex: ContextCosts(64, (1024, 4096), (1, 33), (tuple(x / 2 for x in ex), tuple(ex)),  # noqa: E731
                                        tuple(base))
    return {"auto": make(base_on, extra_on), "off": make(base_off, extra_off)}


# Measured on an AVX2 EPYC (2 vCPU, default target), seconds: with flash attention T(1), T(33) after 64
# tokens 0.053, 0.778 and 0.030, 0.743 more after 4,096; without it 0.0545, 0.960 and about 0.013, 0.33.
MEASURED = costs((0.053, 0.778), (0.0545, 0.960), (0.030, 0.743), (0.013, 0.33))


def test_the_path_that_verifies_cheaper_after_long_contexts_is_chosen():
    assert choose_attention(MEASURED) == "off"
    # Not 5% cheaper at one size after 4,096 tokens: llama.cpp's own.
    assert choose_attention(costs((0.053, 0.778), (0.0545, 0.960), (0.030, 0.743), (0.028, 0.33))) == "auto"
    # Its one-token step more than 15% dearer after 64 tokens (chats): llama.cpp's own.
    assert choose_attention(costs((0.053, 0.778), (0.062, 0.960), (0.030, 0.743), (0.013, 0.33))) == "auto"
    # 13% dearer there, within a median of three forwards' noise, and cheaper on average over the
    # contexts: off (measured on an AMD EPYC Zen 4: T(1) 32.0 / 35.6 ms after 64 tokens, 25.3 / 16.1 ms
    # more after 4,096; T(33) 452 / 474 ms, 702 / 308 ms more).
    zen4 = costs((0.0320, 0.452), (0.0356, 0.474), (0.0253, 0.702), (0.0161, 0.308))
    assert choose_attention(zen4) == "off"
    # The same, but its one-token step no cheaper after long contexts: dearer on average, llama.cpp's own.
    assert choose_attention(costs((0.0320, 0.452), (0.0356, 0.474), (0.0253, 0.702), (0.0253, 0.308))) == "auto"
    same = MEASURED["auto"]
    assert choose_attention({"auto": same, "off": same}) == "auto"
    empty = ContextCosts(64, (), (1,), ())
    assert choose_attention({"auto": empty, "off": empty}) == "auto"


class PathTarget(ScriptedBackend):
    """A scripted target whose forward of n tokens after c cached ones advances ``now`` by
    0.03 + 0.01 n + d n c, d four times larger with flash attention (``flash``: which is cheaper)."""

    def __init__(self, path, n_ctx: int = 8192, flash_cheaper: bool = False) -> None:
        super().__init__([bytes([i]) for i in range(256)], [1], n_prompt=1, n_ctx=n_ctx)
        self.name, self.path, self.n_threads, self.device = "paths", path, 2, "cpu"
        self.flash_attention, self.attention_note, self.flash_cheaper = "auto", "", flash_cheaper
        self.now, self.timed, self.switches = 0.0, 0, []

    cost_key = property(lambda self: f"flash_attn={self.flash_attention}")

    def use_attention(self, mode: str, note: str = "", chosen: bool = False) -> None:
        if mode != self.flash_attention:
            self.switches.append(mode)
            self.caches = [[] for _ in self.caches]
        self.flash_attention, self.attention_note, self.attention_chosen = mode, note, chosen

    def _forward(self, seq, token_ids, logits_for):
        dear = (self.flash_attention == "auto") != self.flash_cheaper
        self.now += 0.03 + 0.01 * len(token_ids) + (8e-6 if dear else 2e-6) * len(token_ids) * len(self.caches[seq])
        self.timed += bool(len(logits_for))
        return super()._forward(seq, token_ids, logits_for)


@pytest.fixture
def unset(monkeypatch, tmp_path):
    monkeypatch.delenv(ENV, raising=False)
    model = tmp_path / "m.gguf"
    model.write_bytes(b"GGUF fake")
    return model


def resolve(b, folder) -> None:
    resolve_attention(b, folder, timer=lambda: b.now, say=lambda line: None)


def test_an_unset_variable_measures_both_paths_once_and_keeps_the_cheaper(unset, tmp_path):
    b = PathTarget(unset)
    resolve(b, tmp_path)
    assert b.flash_attention == "off" and b.switches == ["off"] and b.attention_chosen
    assert "chosen by measurement" in b.attention_note and "without it" in b.attention_note
    assert b.timed > 40
    # Each path's context costs are cached under its own key: the controller reads the chosen one's.
    assert read_cached_context_costs(b, tmp_path) is not None
    b.use_attention("auto")
    assert read_cached_context_costs(b, tmp_path) is not None and context_cache_path(b, tmp_path).exists()
    again = PathTarget(unset)
    resolve(again, tmp_path)
    assert again.flash_attention == "off" and again.timed == 0  # from the caches


def test_a_machine_where_flash_attention_is_cheaper_keeps_it(unset, tmp_path):
    b = PathTarget(unset, flash_cheaper=True)
    resolve(b, tmp_path)
    assert b.flash_attention == "auto" and b.switches == ["off", "auto"] and not b.attention_chosen


def test_the_variable_overrides_and_nothing_is_timed(unset, tmp_path, monkeypatch):
    for value in ("auto", "on", "off"):
        monkeypatch.setenv(ENV, value)
        b = PathTarget(unset)
        resolve(b, tmp_path)
        assert b.timed == 0 and b.switches == [] and b.attention_note == ""


def test_a_window_too_short_for_a_long_context_keeps_llama_cpps_own(unset, tmp_path):
    b = PathTarget(unset, n_ctx=1024)
    resolve(b, tmp_path)
    assert b.timed == 0 and b.flash_attention == "auto"


def test_on_a_real_model_both_paths_run_and_speculation_keeps_plain_decodings_tokens(smollm_path, unset, tmp_path):
    """smollm2 measured on both paths (the choice is this machine's); then, on each path, greedy
    speculation gives that path's plain tokens, or differs first where plain decoding's two best
    logits nearly tie (parity.NEAR_TIE_GAP): without flash attention no verified block of two or
    more rows is bitwise the one-token steps (on an AMD EPYC Zen 4 this prompt flips at its 4th
    token there), and a divergence at a wide gap fails."""
    from specdecode.backends.llama_cpp import LlamaCppBackend
    from specdecode.parity import parity_report

    b = LlamaCppBackend(smollm_path, n_ctx=2048, name="smollm2 (attention)")
    try:
        resolve_attention(b, tmp_path, say=lambda line: None)
        assert b.flash_attention in ("auto", "off") and "chosen by measurement" in b.weights_note
        prompt = b.tokenize("def add(a, b):\n    return a + b\n\ndef add(a, b):\n")
        for path in ("off", "auto"):
            b.use_attention(path)
            eng = SpeculativeEngine(b, NgramDrafter(), 4)
            plain = eng.generate(prompt, drafter=None, num_speculative_tokens=0, max_tokens=24, record_top2_gaps=True)
            spec = eng.generate(prompt, max_tokens=24)
            report = parity_report(spec, plain)
            assert len(plain.token_ids) > 0 and report["status"] in ("exact", "near-tie"), (path, report)
    finally:
        b.close()


def test_a_server_reads_the_choice_from_the_cache_and_never_measures_at_start(unset, tmp_path):
    """``serve`` answers at once: before both paths are measured it runs llama.cpp's own path and
    says so; once a first measuring start (generate, bench) cached them, it runs the cheaper one."""
    b = PathTarget(unset)
    resolve_attention(b, tmp_path, timer=lambda: b.now, say=lambda line: None, measure=False)
    assert b.timed == 0 and b.flash_attention == "auto" and "not measured" in b.attention_note
    resolve(PathTarget(unset), tmp_path)  # a measuring start
    served = PathTarget(unset)
    resolve_attention(served, tmp_path, timer=lambda: served.now, say=lambda line: None, measure=False)
    assert served.timed == 0 and served.flash_attention == "off" and "chosen by measurement" in served.attention_note


def test_a_seed_stays_exact_where_specdecode_chose_flash_attention_off():
    """Without flash attention the invariant block is 1. A seeded request ("auto" batch invariance)
    then verifies as usual where the user set the path (their choice, documented), but decodes
    plainly where specdecode chose it: the seed's promise (its text at any K) is not broken by a
    choice the user did not make."""
    from conftest import OracleDrafter
    from specdecode.sampling import SamplingParams

    blocks = {}
    for chosen in (True, False):
        t = ScriptedBackend([bytes([i]) for i in range(16)], [3, 4, 5, 6, 7, 8, 9, 10], n_prompt=3, n_ctx=256)
        t.attention_chosen = chosen
        eng = SpeculativeEngine(t, OracleDrafter(t), 4, invariance=lambda target, seq: 1)
        r = eng.generate([1, 2, 3], sampling=SamplingParams(temperature=0.7, seed=5), max_tokens=8)
        blocks[chosen] = (r.stats.drafted, max(t.forward_calls[1:]), t.invariant_mode, r.stats.invariant_block)
        said = _stats_block("speculative", r.stats.to_dict())
        assert ("batch-invariant: decoded without drafts" in said) == chosen  # the statistics say why no drafts
    assert blocks[True] == (0, 1, False, 1)  # plain one-token steps, at every thread
    assert blocks[False][0] > 0 and blocks[False][1] > 1 and blocks[False][3] == 0  # verified as usual: blocks of drafts
