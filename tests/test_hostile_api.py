"""What a hostile or careless user of the Python API and the command line meets: a closed
decoder, one decoder in two threads, mistyped options, bytes that are not UTF-8, a context
smaller than the prompt, a flood of stop strings. Each is one clear SpecDecodeError (or one
line and exit status 1 on the command line), never an aborted process.

Cases that could abort the process (llama.cpp asserts) run in a subprocess, so an abort
fails the test, not the run."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

from specdecode.errors import SpecDecodeError
from specdecode.limits import MAX_STOP_CHARS, MAX_STOP_STRINGS, MIN_N_CTX
from specdecode.request import GenerationOptions

from conftest import SMOLLM

PY = [sys.executable, "-c"]


def run_python(code: str, timeout: float = 300) -> subprocess.CompletedProcess:
    return subprocess.run(PY + [textwrap.dedent(code)], capture_output=True, text=True, timeout=timeout)


def run_cli(*args: str, stdin: bytes | None = None, timeout: float = 300) -> subprocess.CompletedProcess:
    env = {**os.environ, "LC_ALL": "C"}  # a user whose terminal is not UTF-8
    return subprocess.run([sys.executable, "-m", "specdecode", *args], input=stdin, capture_output=True,
                          timeout=timeout, env=env)


def test_a_closed_decoder_raises_instead_of_aborting():
    p = run_python(f"""
        import specdecode
        from specdecode.errors import SpecDecodeError
        d = specdecode.Decoder(target={SMOLLM!r}, draft="ngram", progress=False)
        d.close()
        for call in (lambda: d.generate("Hello", max_tokens=2), lambda: d.begin("Hello"), lambda: d.prompt_ids("Hi")):
            try:
                call()
                print("no error")
            except SpecDecodeError as e:
                print("error:", e)
        d.close()  # idempotent
        with specdecode.Decoder(target={SMOLLM!r}, draft="none", progress=False) as d2:
            pass
        try:
            d2.generate("Hello")
        except SpecDecodeError as e:
            print("error:", e)
    """)
    assert p.returncode == 0, p.stderr[-2000:]
    lines = p.stdout.splitlines()
    assert len(lines) == 4 and all(line.startswith("error: this Decoder is closed") for line in lines), p.stdout


@pytest.mark.parametrize("parallel", [1, 2])
def test_one_decoder_in_two_threads(parallel):
    """Both threads get their whole greedy answer, equal to the same prompt run alone."""
    p = run_python(f"""
        import threading, specdecode
        d = specdecode.Decoder(target={SMOLLM!r}, draft="ngram", num_speculative_tokens=3, parallel={parallel},
                               progress=False)
        prompts = ["The capital of France is", "def fibonacci(n):"]
        out = {{}}
        def work(p):
            out[p] = d.generate(p, max_tokens=24).token_ids
        threads = [threading.Thread(target=work, args=(p,)) for p in prompts]
        for t in threads: t.start()
        for t in threads: t.join()
        solo = {{p: d.generate(p, max_tokens=24).token_ids for p in prompts}}
        print("same" if out == solo else f"differ {{out}} {{solo}}")
        d.close()
    """)
    assert p.returncode == 0, p.stderr[-2000:]
    assert p.stdout.strip() == "same"


def test_an_open_stream_holds_its_slot_and_says_so():
    import specdecode

    with specdecode.Decoder(target=SMOLLM, draft="none", progress=False) as d:
        stream = d.generate("Hello", max_tokens=8, stream=True)
        next(stream)
        with pytest.raises(SpecDecodeError, match="a stream holds its slot until it is exhausted or closed"):
            d.generate("Hi", max_tokens=2)
        stream.close()  # frees the slot
        assert d.generate("Hi", max_tokens=2).stats.completion_tokens == 2


@pytest.mark.parametrize("kwargs, param", [
    (dict(stop=123), "stop"), (dict(max_tokens=1.5), "max_tokens"), (dict(max_tokens="4"), "max_tokens"),
    (dict(temperature="0.5"), "temperature"), (dict(top_k=1.5), "top_k"), (dict(seed=1.5), "seed"),
    (dict(grammar="json"), "grammar"), (dict(logprobs="3"), "logprobs"), (dict(plain="yes"), "plain"),
    (dict(stop=["x"] * (MAX_STOP_STRINGS + 1)), "stop"), (dict(stop=["x" * (MAX_STOP_CHARS + 1)]), "stop"),
    (dict(stop=["\ud800"]), "stop[0]"), (dict(temprature=0.5), "temprature"),
])
def test_mistyped_generation_options_name_the_parameter(kwargs, param):
    with pytest.raises(SpecDecodeError) as e:
        GenerationOptions.from_kwargs(**kwargs)
    assert e.value.param == param, str(e.value)


def test_mistyped_inputs_to_a_loaded_decoder(smollm_decoder):
    d = smollm_decoder
    for kwargs, param in ((dict(messages="hi"), "messages"), (dict(prompt="a\ud800b"), "prompt"),
                          (dict(messages=[{"role": "user", "content": "\udcff"}]), "messages[0].content"),
                          (dict(prompt="Hi", max_tokens=1.5), "max_tokens"), (dict(prompt="Hi", stop=123), "stop")):
        with pytest.raises(SpecDecodeError) as e:
            d.generate(**kwargs)
        assert e.value.param == param, str(e.value)
    assert d.generate("Hi", max_tokens=2).stats.completion_tokens == 2  # still serving


def test_an_empty_prompt_is_named_as_it_was_given(smollm_decoder):
    """Issue 43: smollm2 adds no start token, so an empty prompt gives no token; the error said
    "prompt_ids is empty" to a caller who gave a prompt (or --prompt on the command line)."""
    d = smollm_decoder
    for call in (lambda: d.generate(""), lambda: d.generate(prompt="", stream=True), lambda: d.begin(prompt=""),
                 lambda: d.prompt_ids("")):
        with pytest.raises(SpecDecodeError) as e:
            call()
        assert e.value.param == "prompt" and str(e.value).startswith("prompt is empty"), str(e.value)
        assert "prompt_ids" not in str(e.value)
    with pytest.raises(SpecDecodeError) as e:
        d.generate(prompt_ids=[])
    assert e.value.param == "prompt_ids" and str(e.value).startswith("prompt_ids is empty")  # as it was given
    assert d.generate("Hi", max_tokens=2).stats.completion_tokens == 2  # still serving
    for args, stdin, option in ((["--prompt", ""], None, b"--prompt is empty"),
                                (["--prompt-file", "-"], b"", b"--prompt-file standard input is empty")):
        p = run_cli("generate", "--target", SMOLLM, "--draft", "none", *args, "--max-tokens", "2", stdin=stdin)
        assert p.returncode == 1 and option in p.stderr and b"prompt_ids" not in p.stderr, p.stderr
        said = [line for line in p.stderr.splitlines() if not line.startswith(b"specdecode: context ")]  # the load's
        assert b"Traceback" not in p.stderr and len(said) == 1, p.stderr


@pytest.fixture(scope="module")
def smollm_decoder():
    import specdecode

    with specdecode.Decoder(target=SMOLLM, draft="ngram", num_speculative_tokens=3, progress=False) as d:
        yield d


def test_bytes_that_are_not_utf8_on_the_command_line_and_standard_input():
    p = run_cli("generate", "--target", SMOLLM, "--prompt", os.fsdecode(b"\xff\xfeabc"), "--max-tokens", "2")
    assert p.returncode == 1 and b"--prompt is not valid text: byte 0xff is not UTF-8" in p.stderr, p.stderr
    p = run_cli("generate", "--target", SMOLLM, "--prompt-file", "-", "--max-tokens", "2", stdin=b"\xff\xfe")
    assert p.returncode == 1 and b"--prompt-file standard input: not UTF-8 text" in p.stderr, p.stderr
    p = run_cli("generate", "--target", SMOLLM, "--chat", "hi", "--stop", os.fsdecode(b"\xe9"), "--max-tokens", "2")
    assert p.returncode == 1 and b"--stop (1) is not valid text" in p.stderr, p.stderr
    for p_ in (p,):
        assert b"Traceback" not in p_.stderr and p_.stderr.count(b"\n") == 1


def test_the_context_a_user_asks_for_is_the_context_enforced():
    prompt = "word " * 200
    p = run_cli("generate", "--target", SMOLLM, "--prompt", prompt, "--ctx-size", "64", "--max-tokens", "4", "--quiet")
    assert p.returncode == 1, p.stdout
    assert b"the context holds 64" in p.stderr and b"Traceback" not in p.stderr, p.stderr
    p = run_cli("generate", "--target", SMOLLM, "--prompt", "Hi", "--ctx-size", "2")
    assert p.returncode == 1 and f"--ctx-size 2 is out of range: expected >= {MIN_N_CTX}".encode() in p.stderr


def test_the_loaded_context_is_the_one_asked_for(smollm_path):
    from specdecode.backends.llama_cpp import LlamaCppBackend

    b = LlamaCppBackend(smollm_path, n_ctx=100, name=SMOLLM)  # llama.cpp allocates 256
    try:
        assert b.n_ctx == 100
    finally:
        b.close()
    with pytest.raises(SpecDecodeError, match="closed"):
        b.tokenize("Hello")


def test_a_flood_of_stop_strings_is_a_400_naming_the_limit():
    from specdecode.server import APIError, parse_request

    body = {"model": SMOLLM, "prompt": "Hi", "stop": ["x" * 40] * 60_000}
    with pytest.raises(APIError) as e:
        parse_request(body, "completion", SMOLLM, 512)
    assert e.value.status == 400 and e.value.body()["error"]["param"] == "stop"
    assert f"at most {MAX_STOP_STRINGS}" in e.value.body()["error"]["message"]
    ok = parse_request({**body, "stop": ["x" * MAX_STOP_CHARS] * MAX_STOP_STRINGS}, "completion", SMOLLM, 512)
    assert len(ok.options.stop) == MAX_STOP_STRINGS
