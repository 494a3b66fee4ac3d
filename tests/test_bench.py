"""specdecode bench runs end to end on the small model and writes well-formed output.
(A smoke test of the harness; speed claims live in the README, measured by the bench.)"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from specdecode.bench import CATEGORIES, load_prompts, parse_config
from specdecode.errors import SpecDecodeError


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
    from specdecode.bench import PromptLookupPeer

    monkeypatch.setenv("SPECDECODE_LLAMA_REPACK", "0")
    peer = PromptLookupPeer(smollm_path, n_ctx=512, n_threads=2)
    assert peer.llm.model_params.use_extra_bufts is False
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
