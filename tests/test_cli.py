"""The command line as a user meets it: output, JSON, and one-line errors."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys

import pytest

SMOL = "smollm2-135m-instruct"


def cli(*args, env=None, timeout=300):
    e = dict(os.environ)
    e.update(env or {})
    return subprocess.run([sys.executable, "-m", "specdecode", *args], capture_output=True, text=True,
                          timeout=timeout, env=e)


def assert_one_line_error(proc, *needles):
    assert proc.returncode != 0
    assert "Traceback" not in proc.stderr
    err = [ln for ln in proc.stderr.strip().splitlines() if ln.strip()]
    assert len(err) >= 1
    last = err[-1]
    for n in needles:
        assert n in proc.stderr, (n, proc.stderr)
    return last


def test_generate_json_compare(smollm_path):
    p = cli("generate", "--target", SMOL, "--draft", SMOL, "--chat", "Name three colours.",
            "--max-tokens", "24", "--compare", "--json", "--logprobs", "2", "--quiet")
    assert p.returncode == 0, p.stderr
    obj = json.loads(p.stdout)
    assert obj["finish_reason"] in ("stop", "length")
    assert len(obj["token_ids"]) == obj["stats"]["completion_tokens"] <= 24
    assert len(obj["logprobs"]) == len(obj["token_ids"])
    for key in ("drafted", "accepted", "acceptance_rate", "mean_accepted_length", "accepted_per_position",
                "target_forward_passes", "prefill_s", "decode_s", "draft_s", "verify_s", "decode_tokens_per_s"):
        assert key in obj["stats"]
    # where each model ran: llama.cpp's device name ("CPU" where none) and its layers on a GPU, of its total
    assert (obj["stats"]["device"], obj["stats"]["gpu_layers"], obj["stats"]["n_layers"]) == ("CPU", 0, 31)
    assert obj["stats"]["draft_models"] == [{"name": SMOL, "device": "CPU", "gpu_layers": 0, "n_layers": 31}]
    base = obj["baseline"]
    assert base["stats"]["drafted"] == 0
    assert base["speedup"] > 0
    # Plain ran before and after the speculative run: a speedup against each, and whether
    # the machine's load moved between them.
    assert len(base["halves"]) == 2 and all(h > 0 for h in base["halves"])
    assert min(base["halves"]) <= base["speedup"] <= max(base["halves"])
    assert isinstance(base["load_changed"], bool) and ("note" in base) == base["load_changed"]
    assert base["parity"]["status"] in ("exact", "near-tie")
    assert base["text"] == obj["text"] or base["parity"]["status"] == "near-tie"


def test_generate_streams_text_and_prints_stats(smollm_path):
    p = cli("generate", "--target", SMOL, "--draft", "ngram", "--prompt", "def add(a, b):",
            "--max-tokens", "16", "--stop", "\n\n", "--quiet")
    assert p.returncode == 0, p.stderr
    assert "acceptance_rate" in p.stderr and "decode_tokens_per_s" in p.stderr
    # where llama.cpp keeps the weights, as it reported them (smollm2's Q4_1 has no CPU_REPACK kernel)
    assert re.search(r"^weights: (repack|amx|none) \(CPU_Mapped \d+ MiB", p.stderr, re.M), p.stderr
    assert re.search(r"^device: target on the CPU$", p.stderr, re.M), p.stderr  # where it ran, in words
    assert "\n\n" not in p.stdout.rstrip("\n")


@pytest.mark.parametrize(
    "args, needles",
    [
        (["--temperature", "-1"], ["temperature = -1.0"]),
        (["--top-p", "0"], ["top_p = 0.0"]),
        (["--max-tokens", "0"], ["--max-tokens 0"]),
        (["--num-speculative-tokens", "99"], ["--num-speculative-tokens 99"]),
        (["--logprobs", "50"], ["--logprobs 50"]),
        (["--threads", "100000"], ["--threads 100000 is out of range: expected 1..512"]),  # llama.cpp: SIGSEGV
        (["--threads", "4294967297"], ["--threads 4294967297 is out of range"]),  # would wrap to 1 in C
        (["--draft-vocab", "-5"], ["--draft-vocab", "-5 is out of range"]),
        (["--draft-vocab", "100"], ["draft_vocab = 100 applies to a draft model; draft 'none'"]),
        (["--draft", SMOL, "--draft-vocab", "100"], ["--draft-backend torch", "LlamaCppBackend"]),
        (["--draft-vocab", "lem"], ["--draft-vocab", "expected an integer >= 0, got 'lem', or one of slem, tli"]),
        (["--draft-vocab", "tli"], ["draft_vocab = 'tli' applies to a draft model; draft 'none'"]),
        (["--gpu-layers", "most"], ["--gpu-layers most is not a choice", "'all' or 'auto'"]),
        (["--gpu-layers", "-3"], ["--gpu-layers -3 is not a choice"]),
        (["--draft-gpu-layers", "all"], ["draft_gpu_layers = 'all' applies to a draft model; draft 'none'"]),
    ],
)
def test_out_of_range_options(args, needles):
    p = cli("generate", "--target", SMOL, "--draft", "none", "--prompt", "hi", *args)
    assert_one_line_error(p, *needles)


def test_missing_and_corrupt_model_files(tmp_path):
    p = cli("generate", "--target", str(tmp_path / "nope.gguf"), "--draft", "none", "--prompt", "hi")
    assert_one_line_error(p, "nope.gguf", "does not exist")
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"GGUF" + b"\x01" * 64)
    p = cli("generate", "--target", str(bad), "--draft", "none", "--prompt", "hi")
    assert_one_line_error(p, "bad.gguf", "could not load")
    p = cli("generate", "--target", "no-such-model", "--draft", "none", "--prompt", "hi")
    assert_one_line_error(p, "unknown model 'no-such-model'")


def test_prompt_that_does_not_fit(smollm_path):
    p = cli("generate", "--target", SMOL, "--draft", "none", "--ctx-size", "256", "--prompt", "word " * 400)
    assert_one_line_error(p, "the prompt has", "context holds 256")


def test_a_draft_of_another_tokenizer_drafts_across_vocabularies(smollm_path):
    """smollm2 (49,152 ids) for a Qwen target (151,936): once refused, now SLEM under greedy
    decoding (docs/cross_vocab.md); a method name is taken, a wrong one refused by name."""
    p = cli("generate", "--target", "qwen2.5-coder-0.5b-instruct", "--draft", SMOL, "-k", "4", "--prompt",
            "def add(a, b):", "--max-tokens", "12")
    assert p.returncode == 0, p.stderr
    assert "SLEM across tokenizers" in p.stderr and "token texts shared" in p.stderr
    p = cli("generate", "--target", "qwen2.5-coder-0.5b-instruct", "--draft", SMOL, "--draft-vocab", "tli", "-k", "4",
            "--prompt", "def add(a, b):", "--max-tokens", "12")
    assert p.returncode == 0 and "TLI across tokenizers" in p.stderr, p.stderr


def test_models_list():
    p = cli("models", "list")
    assert p.returncode == 0
    for name in ("qwen2.5-coder-1.5b-instruct", "qwen2.5-coder-0.5b-instruct", SMOL):
        assert name in p.stdout


def test_version():
    from specdecode import __version__

    p = cli("--version")
    assert p.returncode == 0 and p.stdout.strip() == f"specdecode {__version__}"


def cli_input(*args, stdin: str | None = None):
    e = dict(os.environ)
    return subprocess.run([sys.executable, "-m", "specdecode", *args], capture_output=True, text=True, timeout=300,
                          env=e, input=stdin)


def _json_run(*args, stdin=None):
    p = cli_input("generate", "--target", SMOL, "--draft", "none", "--max-tokens", "6", "--json", "--quiet", *args,
                  stdin=stdin)
    assert p.returncode == 0, p.stderr
    return json.loads(p.stdout)


def test_chat_from_stdin_and_file_equal_chat_from_the_command_line(smollm_path, tmp_path):
    msg = "def area(w, h):\n    return w * h\n\nAdd a docstring."
    direct = _json_run("--chat", msg)
    piped = _json_run("--chat-file", "-", stdin=msg)
    f = tmp_path / "msg.txt"
    f.write_text(msg, encoding="utf-8")
    from_file = _json_run("--chat-file", str(f))
    assert direct["token_ids"] == piped["token_ids"] == from_file["token_ids"]
    assert direct["stats"]["prompt_tokens"] == piped["stats"]["prompt_tokens"]


def test_prompt_file_and_system_message_and_messages_file(smollm_path, tmp_path):
    f = tmp_path / "prompt.txt"
    f.write_text("def fib(n):", encoding="utf-8")
    assert _json_run("--prompt-file", str(f))["token_ids"] == _json_run("--prompt", "def fib(n):")["token_ids"]

    with_system = _json_run("--system", "Answer in French.", "--chat", "Name a colour.")
    without = _json_run("--chat", "Name a colour.")
    # SmolLM2's template adds its own system message when none is given: ours replaces it.
    assert with_system["stats"]["prompt_tokens"] != without["stats"]["prompt_tokens"]

    conv = [{"role": "system", "content": "Answer in French."}, {"role": "user", "content": "Name a colour."}]
    mf = tmp_path / "conv.json"
    mf.write_text(json.dumps(conv), encoding="utf-8")
    assert _json_run("--messages-file", str(mf))["token_ids"] == with_system["token_ids"]
    multi = conv + [{"role": "assistant", "content": "Rouge."}, {"role": "user", "content": "Another one."}]
    assert _json_run("--messages-file", "-", stdin=json.dumps(multi))["stats"]["prompt_tokens"] > \
        with_system["stats"]["prompt_tokens"]


DEEP = "[" * 100_000 + "]" * 100_000


@pytest.mark.parametrize(
    "args, stdin, needles",
    [
        (["--chat-file", "/no/such/file.txt"], None, ["--chat-file /no/such/file.txt: no such file"]),
        (["--prompt-file", "/"], None, ["--prompt-file /: is a folder"]),
        (["--messages-file", "-"], "{not json", ["--messages-file -: not valid JSON"]),
        (["--messages-file", "-"], '[{"role": "robot", "content": "hi"}]', ["messages[0].role = \"robot\""]),
        (["--messages-file", "-"], "[]", ["non-empty list"]),
        (["--messages-file", "-"], DEEP, ["--messages-file -: its arrays and objects nest"]),
        (["--prompt", "hi", "--json-schema", "-"], DEEP, ["--json-schema: the JSON schema's"]),
        (["--system", "x", "--prompt", "hi"], None, ["--system applies to chat input"]),
        ([], None, ["give the input"]),
    ],
    ids=lambda v: v[:12] if isinstance(v, str) else None,  # the test id travels in an environment variable
)
def test_bad_input_sources(args, stdin, needles):  # DEEP: JSON nested beyond the parser's recursion
    p = cli_input("generate", "--target", SMOL, "--draft", "none", *args, stdin=stdin)
    assert_one_line_error(p, *needles)
