"""The default context (issue 46, item 2): what the model was trained for, capped so that the
KV caches fit in the memory available (injected here, never this machine's), an asked
context capped at the trained one, and the line that says which and why."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from specdecode.backends import context as ctx
from specdecode.backends.context import KV_MEMORY_FRACTION, available_memory, choose_context, torch_context
from specdecode.errors import ContextOverflowError
from specdecode.limits import DEFAULT_N_CTX

SMOLLM = "smollm2-135m-instruct"
QWEN_KV = 28 * 2 * (128 + 128) * 2  # Qwen2.5-Coder-1.5B: layers x KV heads x (key + value dims) x f16
SMOLLM_KV = 30 * 3 * (64 + 64) * 2
GiB = 1 << 30


def test_the_trained_context_when_the_caches_fit():
    c = choose_context(None, 32768, QWEN_KV, 4, "qwen", available=20 * GiB)
    assert c.n_ctx == 32768 and not c.warning
    assert c.note.startswith("context 32768 tokens: what qwen was trained for") and "28.0 KiB a token x 4 slots" in c.note
    assert "3.5 GiB" in c.note and "20.0 GiB available" in c.note  # 32768 x 4 x 28 KiB
    assert choose_context(None, 32768, QWEN_KV, 4, "qwen", available=None).n_ctx == 32768  # memory unknown: no cap


def test_capped_by_memory_to_a_multiple_of_256_within_the_fraction():
    available = 2 * GiB
    c = choose_context(None, 32768, QWEN_KV, 4, "qwen", available=available)
    assert c.n_ctx % 256 == 0 and c.n_ctx * 4 * QWEN_KV <= available * KV_MEMORY_FRACTION
    assert (c.n_ctx + 256) * 4 * QWEN_KV > available * KV_MEMORY_FRACTION  # the largest that fits
    assert c.n_ctx == 9216 and "capped by memory" in c.note and "trained for 32768" in c.note and not c.warning
    # Room for a draft model's caches as large again halves it (to the multiple of 256 below).
    d = choose_context(None, 32768, QWEN_KV, 4, "qwen", available=available, reserve=2.0)
    assert d.n_ctx == 4608 and "x 2 for a draft model's" in d.note
    # Never below the smallest context a backend takes, and never past the trained one.
    assert choose_context(None, 32768, QWEN_KV, 4, "qwen", available=0).n_ctx == 16
    assert choose_context(None, 1024, QWEN_KV, 1, "small", available=available).n_ctx == 1024


def test_an_asked_context_wins_but_not_past_the_trained_one():
    c = choose_context(4096, 32768, QWEN_KV, 1, "qwen", available=20 * GiB)
    assert (c.n_ctx, c.warning) == (4096, False) and c.note == "context 4096 tokens: as asked"
    c = choose_context(65536, 32768, QWEN_KV, 1, "qwen", available=20 * GiB)
    assert (c.n_ctx, c.warning) == (32768, True) and "65536 were asked" in c.note and "capped" in c.note
    # Past the memory: kept (it was asked for), with a warning that says how much it needs.
    c = choose_context(32768, 32768, QWEN_KV, 4, "qwen", available=1 * GiB)
    assert (c.n_ctx, c.warning) == (32768, True) and "3.5 GiB, more than the 1.0 GiB available" in c.note


def test_a_model_that_does_not_say_what_it_was_trained_for_gets_the_fallback():
    c = choose_context(None, 0, QWEN_KV, 1, "m", available=20 * GiB)
    assert c.n_ctx == DEFAULT_N_CTX and "does not say" in c.note


def test_available_memory_reads_meminfo_and_a_cgroup_limit(tmp_path):
    meminfo = tmp_path / "meminfo"
    meminfo.write_text("MemTotal:       24000000 kB\nMemAvailable:   20000000 kB\n")
    assert available_memory(meminfo, tmp_path / "no-cgroup") == 20000000 * 1024
    cgroup = tmp_path / "cg"
    cgroup.mkdir()
    (cgroup / "memory.max").write_text("4294967296\n")
    (cgroup / "memory.current").write_text("1073741824\n")
    assert available_memory(meminfo, cgroup) == 3 * GiB  # the container's room is less
    (cgroup / "memory.max").write_text("max\n")  # no limit
    assert available_memory(meminfo, cgroup) == 20000000 * 1024
    assert available_memory(tmp_path / "none", tmp_path / "none") is None


def test_torch_context_from_the_config(monkeypatch):
    monkeypatch.setattr(ctx, "available_memory", lambda: 20 * GiB)
    config = SimpleNamespace(num_attention_heads=12, num_key_value_heads=2, hidden_size=1536, num_hidden_layers=28,
                             max_position_embeddings=32768)
    c = torch_context(None, config, 4, "qwen (torch)")
    assert c.n_ctx == 32768 and "56.0 KiB a token x 1 slot:" in c.note  # float32: twice f16
    assert torch_context(1024, config, 4, "q").n_ctx == 1024
    monkeypatch.setattr(ctx, "available_memory", lambda: 1 * GiB)
    assert torch_context(None, config, 4, "q").n_ctx == 1 * GiB // 2 // (2 * QWEN_KV) // 256 * 256


def test_llama_cpp_reads_the_model_and_caps_by_memory(smollm_path, monkeypatch):
    from specdecode.backends import llama_cpp

    b = llama_cpp.LlamaCppBackend(smollm_path, n_ctx=None, name=SMOLLM, n_seq=2)
    try:
        assert b.n_ctx == 8192 and b.context.n_ctx == 8192  # SmolLM2's training context
        assert ctx.llama_kv_bytes(b._lib, b._model) == SMOLLM_KV
        assert "22.5 KiB a token x 2 slots" in b.context.note
    finally:
        b.close()
    # As little memory as 2048 tokens x 2 slots need, twice over (the fraction is a half):
    monkeypatch.setattr(llama_cpp.backend, "available_memory", lambda: 2 * 2048 * 2 * SMOLLM_KV)
    b = llama_cpp.LlamaCppBackend(smollm_path, n_ctx=None, name=SMOLLM, n_seq=2)
    try:
        assert b.n_ctx == 2048 and "capped by memory" in b.context.note
    finally:
        b.close()


def test_the_decoder_says_what_it_chose_and_a_longer_prompt_is_refused(capsys):
    import specdecode

    with specdecode.Decoder(target=SMOLLM, draft="none", n_threads=1) as dec:
        assert dec.target.n_ctx == 8192 and dec.context.n_ctx == 8192
        err = capsys.readouterr().err
        assert f"specdecode: context 8192 tokens: what {SMOLLM} was trained for" in err
        with pytest.raises(ContextOverflowError, match="the context holds 8192"):
            dec.generate(" hello" * 8300, max_tokens=1)
    with specdecode.Decoder(target=SMOLLM, draft="none", n_ctx=20000, n_threads=1) as dec:
        assert dec.target.n_ctx == 8192
        assert "specdecode: warning: context 8192 tokens: 20000 were asked" in capsys.readouterr().err


def test_the_cli_default_is_the_models_own():
    from specdecode.cli import build_parser
    from specdecode.options import decoder_kwargs

    assert decoder_kwargs(build_parser().parse_args(["serve"]))["n_ctx"] is None
    assert decoder_kwargs(build_parser().parse_args(["generate", "--prompt", "x", "--ctx-size", "512"]))["n_ctx"] == 512
