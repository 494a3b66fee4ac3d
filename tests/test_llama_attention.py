"""The attention path chosen by measurement (issue 47, item 3): where SPECDECODE_LLAMA_FLASH_ATTN is
unset, both of llama.cpp's paths are timed on the loaded model and the one that verifies cheaper
at long contexts is used, cached per model and machine; the variable still overrides.

The fake backend's forwards advance a scripted clock by a cost that depends on the path and the
context: the tests judge the choice and the counts, never the wall clock."""

from __future__ import annotations

import json

import pytest

from specdecode.backends.llama_attention import AttentionProbe, choose_attention, resolve_attention
from specdecode.engine import SpeculativeEngine
from specdecode.drafters import NgramDrafter

ENV = "SPECDECODE_LLAMA_FLASH_ATTN"


def seconds(on: dict, off: dict) -> dict:
    return {"auto": {f"{n}@{c}": s for (n, c), s in on.items()}, "off": {f"{n}@{c}": s for (n, c), s in off.items()}}


ON = {(1, 64): 0.056, (33, 64): 0.762, (1, 1024): 0.058, (33, 1024): 1.025}
OFF = {(1, 64): 0.059, (33, 64): 0.838, (1, 1024): 0.0505, (33, 1024): 0.872}  # measured, AVX2 EPYC


def test_the_path_that_verifies_cheaper_at_long_contexts_is_chosen():
    assert choose_attention(seconds(ON, OFF), 1024) == "off"
    # Cheaper by less than the margin at one size: llama.cpp's own.
    assert choose_attention(seconds(ON, {**OFF, (1, 1024): 0.057}), 1024) == "auto"
    # Much dearer after a short context (chats): llama.cpp's own.
    assert choose_attention(seconds(ON, {**OFF, (33, 64): 0.95}), 1024) == "auto"
    assert choose_attention(seconds(ON, ON), 1024) == "auto"


class TimedFake:
    """What resolve_attention reads of a llama.cpp backend, its forwards timed by a script:
    T(n, c) = 0.03 + 0.01 n + d n c, with d four times larger under flash attention."""

    def __init__(self, path, n_ctx: int = 4096) -> None:
        self.path, self.n_threads, self.buffers, self.n_ctx, self.n_vocab = path, 2, "repack", n_ctx, 1000
        self.flash_attention, self.attention_note = "auto", ""
        self.now, self.len, self.switches, self.forwards = 0.0, 0, [], 0

    def use_attention(self, mode: str, note: str = "") -> None:
        if mode != self.flash_attention:
            self.switches.append(mode)
            self.len = 0
        self.flash_attention, self.attention_note = mode, note

    def forward(self, tokens, logits_for, seq=0):
        n, d = len(tokens), 8e-6 if self.flash_attention == "auto" else 2e-6
        self.now += 0.03 + 0.01 * n + d * n * self.len
        self.len += n
        self.forwards += 1

    def rollback(self, n: int, seq: int = 0) -> None:
        self.len = min(self.len, n)


@pytest.fixture
def unset(monkeypatch, tmp_path):
    monkeypatch.delenv(ENV, raising=False)
    model = tmp_path / "m.gguf"
    model.write_bytes(b"GGUF fake")
    return model


def test_an_unset_variable_times_both_paths_once_and_caches_the_choice(unset, tmp_path):
    b = TimedFake(unset)
    resolve_attention(b, tmp_path, timer=lambda: b.now, say=lambda line: None)
    assert b.flash_attention == "off" and "chosen by measurement" in b.attention_note
    assert "without it" in b.attention_note and b.switches == ["off"]
    timed = b.forwards
    assert timed > 20
    again = TimedFake(unset)
    resolve_attention(again, tmp_path, timer=lambda: again.now, say=lambda line: None)
    assert again.flash_attention == "off" and again.forwards == 0  # read from the cache
    files = list((tmp_path / "costs").glob("attention-*.json"))
    assert len(files) == 1 and json.loads(files[0].read_text())["choice"] == "off"


def test_a_machine_where_flash_attention_is_cheaper_keeps_it(unset, tmp_path, monkeypatch):
    class FlashCheaper(TimedFake):
        def forward(self, tokens, logits_for, seq=0):
            n = len(tokens)
            self.now += 0.03 + 0.01 * n + (2e-6 if self.flash_attention == "auto" else 8e-6) * n * self.len
            self.len += n
            self.forwards += 1

    b = FlashCheaper(unset)
    resolve_attention(b, tmp_path, timer=lambda: b.now, say=lambda line: None)
    assert b.flash_attention == "auto" and b.switches == ["off", "auto"]


def test_the_variable_overrides_and_nothing_is_timed(unset, tmp_path, monkeypatch):
    for value in ("auto", "on", "off"):
        monkeypatch.setenv(ENV, value)
        b = TimedFake(unset)
        resolve_attention(b, tmp_path, timer=lambda: b.now, say=lambda line: None)
        assert b.forwards == 0 and b.switches == [] and b.attention_note == ""


def test_a_short_window_keeps_llama_cpps_own(unset, tmp_path):
    b = TimedFake(unset, n_ctx=512)
    resolve_attention(b, tmp_path, timer=lambda: b.now, say=lambda line: None)
    assert b.forwards == 0 and b.flash_attention == "auto"


@pytest.mark.parametrize("edit", [{"choice": "sometimes"}, {"seconds": {}}, {"context": "1024"}])
def test_a_cache_edited_by_hand_is_timed_again(unset, tmp_path, edit):
    b = TimedFake(unset)
    resolve_attention(b, tmp_path, timer=lambda: b.now, say=lambda line: None)
    (f,) = (tmp_path / "costs").glob("attention-*.json")
    f.write_text(json.dumps({**json.loads(f.read_text()), **edit}))
    with pytest.raises(ValueError):
        AttentionProbe.from_dict(json.loads(f.read_text()))
    again = TimedFake(unset)
    resolve_attention(again, tmp_path, timer=lambda: again.now, say=lambda line: None)
    assert again.forwards > 20 and again.flash_attention == "off"


def test_on_a_real_model_both_paths_run_and_speculation_keeps_plain_decodings_tokens(smollm_path, unset, tmp_path):
    """smollm2 timed on both paths (the choice is this machine's); then, on each path, greedy
    speculation gives exactly that path's plain tokens."""
    from specdecode.backends.llama_cpp import LlamaCppBackend

    b = LlamaCppBackend(smollm_path, n_ctx=2048, name="smollm2 (attention)")
    try:
        resolve_attention(b, tmp_path, say=lambda line: None)
        assert b.flash_attention in ("auto", "off") and "chosen by measurement" in b.weights_note
        prompt = b.tokenize("def add(a, b):\n    return a + b\n\ndef add(a, b):\n")
        for path in ("off", "auto"):
            b.use_attention(path)
            eng = SpeculativeEngine(b, NgramDrafter(), 4)
            plain = eng.generate(prompt, drafter=None, num_speculative_tokens=0, max_tokens=24).token_ids
            spec = eng.generate(prompt, max_tokens=24).token_ids
            assert spec == plain and len(plain) > 0, path
    finally:
        b.close()
