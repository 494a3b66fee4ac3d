"""llama.cpp's own llama-server as a bench peer (issue 60, item 1; :mod:`specdecode.bench.llama_server`):
started once per configuration with llama.cpp's arguments, sent every prompt between specdecode's
runs of it (token ids to /completion, fill-in-the-middle prompts as llama.vim sends them to
/infill), and set side by side in one table. The peer here is a fake executable that answers as
llama-server does (fixed tokens, scripted timings), so the counts and ratios are checked, never a
wall clock; tests/test_fim.py holds the prompt layout to llama.cpp's own."""

from __future__ import annotations

import io
import json
import stat
import sys
import textwrap

import pytest

from specdecode.bench import BenchConfig, print_table, run_bench
from specdecode.bench.llama_server import config_args, default_binary
from specdecode.bench.llama_server_report import fim_body, summarize_servers
from specdecode.bench.suite import BenchPrompt
from specdecode.errors import SpecDecodeError

from test_fim_cache import MIDDLE, FimBytes

FAKE = textwrap.dedent('''\
    import json, sys
    from http.server import BaseHTTPRequestHandler, HTTPServer
    args = sys.argv[1:]
    port = int(args[args.index("--port") + 1])
    with open(ARGS_LOG, "a") as f:
        f.write(json.dumps(args) + "\\n")
    spec = "--spec-default" in args or "--spec-type" in args
    class H(BaseHTTPRequestHandler):
        def log_message(self, *a):
            pass
        def _send(self, obj):
            data = json.dumps(obj).encode()
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)
        def do_GET(self):
            self._send({"status": "ok"})
        def do_POST(self):
            body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            with open(ARGS_LOG, "a") as f:
                f.write(json.dumps({"path": self.path, "body": body}) + "\\n")
            n = len(body["prompt"]) if self.path == "/completion" else len(body["input_prefix"]) + 3
            tokens = [120] * min(10, body["n_predict"])
            # 10 tokens in 1 s (9 tok/s after the first) plain, 0.5 s with speculation; 100 prompt tokens/s
            self._send({"tokens": tokens, "content": "x" * len(tokens),
                        "timings": {"prompt_n": n, "prompt_ms": 10.0 * n, "predicted_n": len(tokens),
                                    "predicted_ms": 500.0 if spec else 1000.0,
                                    "draft_n": 8 if spec else 0, "draft_n_accepted": 4 if spec else 0}})
    HTTPServer(("127.0.0.1", port), H).serve_forever()
    ''')


@pytest.fixture
def fake_server(tmp_path):
    log = tmp_path / "calls.jsonl"
    exe = tmp_path / "llama-server"
    exe.write_text(f"#!{sys.executable}\nARGS_LOG = {str(log)!r}\n" + FAKE)
    exe.chmod(exe.stat().st_mode | stat.S_IEXEC)
    return exe, log


def _suite(tmp_path):
    f = tmp_path / "suite.jsonl"
    f.write_text("\n".join(json.dumps(x) for x in [
        {"id": "raw", "category": "copy", "prompt": "abc abc abc abc", "max_tokens": 12},
        {"id": "fim-one", "category": "fim", "prefix": "total = price * count\ntotal = price",
         "suffix": "\nprint(total)\n", "extra": [{"filename": "a.py", "text": "price = 2\n"}], "max_tokens": 40},
    ]) + "\n")
    return f


def test_each_configuration_gets_llama_cpps_arguments():
    assert config_args("plain", None) == [] and config_args("spec-default", None) == ["--spec-default"]
    assert config_args("ngram-simple", None) == ["--spec-type", "ngram-simple"]
    assert config_args("draft", None) is None and config_args("draft", "d.gguf") == ["--model-draft", "d.gguf", "--spec-type", "draft-simple"]
    with pytest.raises(ValueError):
        config_args("eagle", None)
    with pytest.raises(SpecDecodeError) as e:
        BenchConfig(llama_server="", llama_server_configs=("plain", "eagle"))
    assert e.value.param == "llama_server_configs"


def test_a_fim_prompt_goes_to_infill_as_llama_vim_sends_it():
    p = BenchPrompt("f", "fim", "def f(", None, 8, suffix=")\n", extra=(("a.py", "x = 1\n"), ("", "y\n")))
    assert fim_body(p) == {"input_prefix": "def f(", "input_suffix": ")\n", "prompt": "",
                           "input_extra": [{"filename": "a.py", "text": "x = 1\n"}, {"filename": "tmp", "text": "y\n"}]}


def test_the_binary_is_found_where_the_build_script_puts_it_or_named(monkeypatch, tmp_path):
    monkeypatch.setenv("SPECDECODE_LLAMA_SERVER", str(tmp_path / "x"))
    assert default_binary() == tmp_path / "x"


def test_a_missing_binary_is_a_note_and_the_bench_runs(tmp_path, monkeypatch):
    monkeypatch.setenv("SPECDECODE_CACHE", str(tmp_path / "cache"))
    target = FimBytes()
    target.path = tmp_path / "m.gguf"
    res = run_bench(BenchConfig(target=target, prompts=_suite(tmp_path), configs=("ngram:4",), peer=False,
                                progress=False, llama_server=str(tmp_path / "nowhere")))
    assert "llama-server not run: no binary" in res["meta"]["llama_server"] and "llama_server" not in res
    assert len(res["rows"]) == 2


def test_the_peer_runs_every_prompt_and_sits_in_the_table(tmp_path, monkeypatch, fake_server):
    monkeypatch.setenv("SPECDECODE_CACHE", str(tmp_path / "cache"))
    exe, log = fake_server
    target = FimBytes()
    target.path = tmp_path / "m.gguf"
    target.path.write_bytes(b"GGUF")
    res = run_bench(BenchConfig(target=target, prompts=_suite(tmp_path), configs=("ngram:4",), peer=False,
                                progress=False, llama_server=str(exe), n_threads=2,
                                llama_server_configs=("plain", "spec-default", "ngram-simple", "draft")))
    calls = [json.loads(line) for line in log.read_text().splitlines()]
    starts = [c for c in calls if isinstance(c, list)]
    assert len(starts) == 3  # no draft model: that configuration is named in the note instead
    assert all(["-m", str(target.path)] == s[:2] and "-np" in s and s[s.index("-t") + 1].isdigit() for s in starts)
    assert any("--spec-default" in s for s in starts) and any("ngram-simple" in s for s in starts)
    assert "draft: no draft model" in res["meta"]["llama_server"]
    posts = [c for c in calls if isinstance(c, dict)]
    assert sorted(c["path"] for c in posts) == ["/completion"] * 3 + ["/infill"] * 3
    completion = next(c["body"] for c in posts if c["path"] == "/completion")
    raw = next(r for r in res["rows"] if r["id"] == "raw")
    assert len(completion["prompt"]) == raw["prompt_tokens"]  # the very ids specdecode ran
    assert completion["temperature"] == 0 and completion["cache_prompt"] is False
    infill = next(c["body"] for c in posts if c["path"] == "/infill")
    assert infill["input_extra"] == [{"filename": "a.py", "text": "price = 2\n"}] and infill["n_predict"] == 40
    assert all(r["prompt_cached"] == 0 for r in res["rows"])  # each run reads its whole prompt, as the peer does
    srows = res["llama_server_rows"]
    assert len(srows) == 6 and {r["config"] for r in srows} == {"plain", "spec-default", "ngram-simple"}
    plain = next(r for r in srows if r["config"] == "plain" and r["id"] == "raw")
    assert plain["prompt_match"] and plain["tokens_per_s"] == pytest.approx(9.0) and not plain["same_as_plain"]
    e = res["llama_server"]["copy"]
    assert e["llama_server"]["spec-default"]["decode_tokens_per_s"] == pytest.approx(18.0)
    assert e["llama_server"]["spec-default"]["acceptance_rate"] == 0.5
    assert e["best"]["ngram:4"] in ("spec-default", "ngram-simple")
    out = io.StringIO()
    print_table(res, out)
    assert "llama-server side by side" in out.getvalue() and "vs llama-server's best" in out.getvalue()


def test_the_ratios_are_the_summed_times_and_the_median_rates():
    rows = [{"id": "a", "category": "c", "config": "x", "plain_tokens_per_s": 20.0, "spec_tokens_per_s": 40.0,
             "prompt_tokens": 101, "plain_prefill_s": 1.0, "plain_decode_s": 2.0, "prefill_s": 1.0, "decode_s": 1.0,
             "plain_completion_tokens": 40, "completion_tokens": 40}]
    peers = [{"id": "a", "category": "c", "config": "plain", "prompt_n": 101, "prompt_match": True, "prompt_s": 0.5,
              "predicted_s": 4.0, "completion_tokens": 20, "tokens_per_s": 10.0, "draft_n": 0, "draft_accepted": 0,
              "same_as_plain": True}]
    e = summarize_servers(rows, peers, ["x"])["c"]
    assert e["plain_decode"] == 2.0 and e["plain_prompt"] == pytest.approx(100 / 202, abs=1e-3)  # (101 - 1) / 1 s vs 101 / 0.5 s
    # llama-server's 20 tokens in 4 s, scaled to 40: 0.5 + 8 = 8.5 s; specdecode plain 3 s, x 2 s
    assert e["vs_best"] == {"plain": pytest.approx(8.5 / 3, rel=1e-3), "x": 4.25} and e["best"]["x"] == "plain"
    assert e["vs_best_decode"] == {"plain": [4.0, "plain"], "x": [8.0, "plain"]}  # 8 s of generation against 2 and 1


def test_bench_serve_names_a_missing_llama_server(tmp_path):
    from specdecode.bench.cli import add_bench_serve_parser
    from specdecode.bench.serve import ServeBenchConfig, run_serve_bench
    import argparse

    parser = argparse.ArgumentParser()
    add_bench_serve_parser(parser.add_subparsers())
    args = parser.parse_args(["bench-serve", "--llama-server", str(tmp_path / "nowhere")])
    assert args.llama_server == str(tmp_path / "nowhere")
    assert parser.parse_args(["bench-serve", "--llama-server"]).llama_server == ""
    with pytest.raises(SpecDecodeError) as e:
        run_serve_bench(ServeBenchConfig(llama_server=str(tmp_path / "nowhere"), slots=(1,), progress=False,
                                         categories=("code_editing",), per_category=1))
    assert e.value.param == "--llama-server" and "nowhere" in str(e.value)
