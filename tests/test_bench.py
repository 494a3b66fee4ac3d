"""specdecode bench runs end to end on the small model and writes well-formed output.
(A smoke test of the harness; speed claims live in the README, measured by the bench.)"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from types import SimpleNamespace

import pytest

from specdecode.bench import (CATEGORIES, BenchConfig, add_bench_parser, config_from_args, load_prompts,
                              parse_config, run_bench, select_prompts)
from specdecode.errors import SpecDecodeError
from specdecode.limits import MAX_NUM_SPECULATIVE_TOKENS
from specdecode.sampling import SamplingParams


def test_builtin_suite_has_eight_prompts_per_category():
    prompts = load_prompts(None)
    for cat in CATEGORIES:
        assert sum(p.category == cat for p in prompts) >= 8, cat
    assert len({p.id for p in prompts}) == len(prompts)


def test_bad_prompt_files(tmp_path):
    f = tmp_path / "p.jsonl"
    f.write_text('{"category": "chat", "prompt": "hi"}\n{not json}\n')
    with pytest.raises(SpecDecodeError, match=r"line 2: not valid JSON"):
        load_prompts(f)
    f.write_text('{"category": "chat", "prompt": "hi", "messages": []}\n')
    with pytest.raises(SpecDecodeError, match="exactly one of"):
        load_prompts(f)
    with pytest.raises(SpecDecodeError, match="does not exist"):
        load_prompts(tmp_path / "missing.jsonl")


def test_parse_config():
    assert parse_config("ngram:4") == ("ngram", 4)
    assert parse_config("auto") == ("auto", "auto")
    with pytest.raises(SpecDecodeError, match="K = 40"):
        parse_config("ngram:40")


def test_parse_config_takes_its_range_from_limits():
    assert parse_config(f"ngram:{MAX_NUM_SPECULATIVE_TOKENS}") == ("ngram", MAX_NUM_SPECULATIVE_TOKENS)
    assert parse_config("ngram:0") == ("ngram", 0)
    with pytest.raises(SpecDecodeError, match=f"K = {MAX_NUM_SPECULATIVE_TOKENS + 1}") as e:
        parse_config(f"ngram:{MAX_NUM_SPECULATIVE_TOKENS + 1}")
    assert e.value.param == "--config"
    with pytest.raises(SpecDecodeError, match=f"integer 0..{MAX_NUM_SPECULATIVE_TOKENS} or auto"):
        parse_config("ngram:x")
    with pytest.raises(SpecDecodeError, match="expected DRAFT"):
        parse_config(":3")


def test_select_prompts_by_category_and_count():
    prompts = load_prompts(None)
    some = select_prompts(prompts, ["chat", "math"], per_category=2)
    assert sorted(p.category for p in some) == ["chat", "chat", "math", "math"]
    for cat in ("chat", "math"):  # the first two of each, in file order
        assert [p for p in some if p.category == cat] == [p for p in prompts if p.category == cat][:2]
    assert some == [p for p in prompts if p in some]
    assert select_prompts(prompts) == prompts
    with pytest.raises(SpecDecodeError, match="no prompts left"):
        select_prompts(prompts, ["no-such-category"])


def test_bench_config_checks_values_before_loading_anything():
    with pytest.raises(SpecDecodeError, match="K = 99"):
        BenchConfig(target="/nonexistent.gguf", configs=("ngram:99",))
    with pytest.raises(SpecDecodeError, match="configs is empty"):
        BenchConfig(configs=())
    with pytest.raises(SpecDecodeError, match="max_tokens = 0"):
        BenchConfig(max_tokens=0)
    with pytest.raises(SpecDecodeError, match="per_category = 0"):
        BenchConfig(per_category=0)
    assert BenchConfig(configs=["ngram:3"], categories=["chat"]) == BenchConfig(configs=("ngram:3",),
                                                                                   categories=("chat",))


def _parse(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_bench_parser(parser.add_subparsers())
    return parser.parse_args(["bench", *argv])


def test_cli_builds_the_bench_config_from_its_options():
    args = _parse(["--target", "smollm2-135m-instruct", "--prompts", "p.jsonl", "--config", "ngram:3",
                   "--config", "auto", "--categories", "chat,math", "--per-category", "2", "--max-tokens", "16",
                   "--temperature", "0.7", "--top-p", "0.9", "--seed", "5", "--ctx-size", "1024", "--threads", "2",
                   "--backend", "torch", "--draft-backend", "llama.cpp", "--dtype", "bfloat16", "--device", "auto",
                   "--draft-vocab", "1000", "--no-peer", "--quiet"])
    assert config_from_args(args) == BenchConfig(
        target="smollm2-135m-instruct", prompts="p.jsonl", configs=("ngram:3", "auto"), categories=("chat", "math"),
        per_category=2, max_tokens=16, sampling=SamplingParams(temperature=0.7, top_p=0.9, seed=5), n_ctx=1024,
        n_threads=2, backend="torch", draft_backend="llama.cpp", dtype="bfloat16", device="auto", draft_vocab=1000,
        peer=False, progress=False)
    # The defaults are the library's defaults, the seed included (fixed at 0 for the bench).
    assert config_from_args(_parse([])) == BenchConfig()
    with pytest.raises(SpecDecodeError, match="--ctx-size"):
        config_from_args(_parse(["--ctx-size", "1"]))


def test_run_bench_is_a_library_call(smollm_path, tmp_path):
    prompts = tmp_path / "p.jsonl"
    prompts.write_text("\n".join(json.dumps(p) for p in (
        {"id": "raw-1", "category": "chat", "prompt": "The capital of France is", "max_tokens": 6},
        {"id": "edit-1", "category": "code_editing", "prompt": "def f(x):\n    return x\ndef f(x):\n"})) + "\n")
    res = run_bench(BenchConfig(target="smollm2-135m-instruct", prompts=prompts, configs=("ngram:3",),
                                max_tokens=8, n_ctx=512, peer=False, progress=False))
    assert set(res) == {"meta", "summary", "rows"}
    assert res["meta"]["configs"] == ["ngram:3"] and res["meta"]["prompts"] == 2 and res["meta"]["peer"] is None
    assert res["meta"]["prompts_file"] == str(prompts) and res["meta"]["temperature"] == 0.0
    assert [r["id"] for r in res["rows"]] == ["raw-1", "edit-1"]
    assert 0 < res["rows"][0]["completion_tokens"] <= 6 and 0 < res["rows"][1]["completion_tokens"] <= 8
    o = res["summary"]["ngram:3"]["overall"]
    assert o["prompts"] == 2 and o["parity"]["divergent"] == 0
    assert {"chat", "code_editing", "overall"} == set(res["summary"]["ngram:3"])


def test_the_torch_draft_is_found_through_draft_backends():
    """The assisted peer's draft comes from the drafters' declared draft_backends()."""
    from specdecode.backends.torch_backend import TorchBackend
    from specdecode.bench import torch_draft_model

    torch_draft = TorchBackend.__new__(TorchBackend)
    torch_draft.model = "the draft's module"
    other = SimpleNamespace(model="not torch")
    engines = {"ngram:3": SimpleNamespace(drafter=SimpleNamespace(draft_backends=lambda: [])),
               "auto:auto": SimpleNamespace(drafter=SimpleNamespace(draft_backends=lambda: [other, torch_draft]))}
    assert torch_draft_model(engines) == "the draft's module"
    assert torch_draft_model({"ngram:3": engines["ngram:3"]}) is None


def test_bench_json_and_outputs(smollm_path, tmp_path):
    out = tmp_path / "out"
    p = subprocess.run(
        [sys.executable, "-m", "specdecode", "bench", "--target", "smollm2-135m-instruct",
         "--prompts", "tests/data/tiny_suite.jsonl", "--config", "ngram:3", "--config", "auto:auto",
         "--out", str(out), "--json", "--quiet"],
        capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stderr
    res = json.loads(p.stdout)
    assert set(res["summary"]) == {"ngram:3", "auto:auto"}
    for cfg, per in res["summary"].items():
        assert {"code_editing", "chat", "overall"} <= set(per)
        o = per["overall"]
        assert o["prompts"] == 3
        assert o["plain_decode_tokens_per_s"] > 0 and o["speedup"] > 0
        assert 0.0 <= o["acceptance_rate"] <= 1.0 and o["mean_accepted_length"] > 0
        assert sum(o["parity"].values()) == 3 and o["parity"]["divergent"] == 0
    assert len(res["rows"]) == 6 and res["meta"]["peak_rss_mb"] > 0
    for name in ("results.json", "results.md", "speedup_by_category.png", "acceptance_by_position.png",
                 "tokens_per_s_vs_k.png"):
        assert (out / name).stat().st_size > 0
    assert (out / "speedup_by_category.png").read_bytes()[:4] == b"\x89PNG"


def test_peer_gets_our_weight_buffer_setting(smollm_path, monkeypatch):
    """llama.cpp's AMX buffer crashes on AMX CPUs; the peer must load with the same
    extra-buffer setting as our backend (forced off here)."""
    import llama_cpp.llama_cpp as lib

    from specdecode.bench import PromptLookupPeer

    original = lib.llama_model_default_params
    monkeypatch.setenv("SPECDECODE_LLAMA_REPACK", "0")
    peer = PromptLookupPeer(smollm_path, n_ctx=512, n_threads=2)
    assert peer.llm.model_params.use_extra_bufts is False
    # The workaround is scoped to the peer's own load: llama-cpp-python is left as it was.
    assert lib.llama_model_default_params is original
    n, rate = peer.run(peer.llm.tokenize(b"def add(a, b):"), 8)
    assert n == 8 and rate > 0


def test_bench_on_the_torch_backend_runs_transformers_peers(smollm_path, tmp_path):
    """A torch target (smollm2's GGUF dequantized by transformers) with a torch draft: both
    transformers peers (prompt lookup, assisted generation with that draft) are timed."""
    prompts = tmp_path / "p.jsonl"
    prompts.write_text(json.dumps({"id": "edit-1", "category": "code_editing", "messages": [
        {"role": "user", "content": "Return this code unchanged:\ndef area(w, h):\n    return w * h\n"}],
        "max_tokens": 16}) + "\n")
    p = subprocess.run(
        [sys.executable, "-m", "specdecode", "bench", "--target", str(smollm_path), "--backend", "torch",
         "--draft-backend", "torch", "--prompts", str(prompts), "--config", f"{smollm_path}:2",
         "--json", "--quiet"],
        capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stderr
    res = json.loads(p.stdout)
    assert "prompt_lookup_num_tokens" in res["meta"]["peer"] and "assistant_model" in res["meta"]["peer"]
    o = res["summary"][f"{smollm_path}:2"]["overall"]
    assert o["peer_prompt_lookup_tokens_per_s"] > 0 and o["peer_assisted_tokens_per_s"] > 0
    assert o["vs_peer_assisted"] > 0 and o["parity"]["divergent"] == 0


def test_the_peer_restores_llama_cpp_when_its_load_fails(tmp_path):
    import llama_cpp.llama_cpp as lib

    from specdecode.bench import PromptLookupPeer

    original = lib.llama_model_default_params
    with pytest.raises(ValueError):
        PromptLookupPeer(tmp_path / "missing.gguf", n_ctx=512, n_threads=1)
    assert lib.llama_model_default_params is original
