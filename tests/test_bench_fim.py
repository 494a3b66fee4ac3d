"""The bench's ``fim`` category (issue 45, item 7): fill-in-the-middle completions cut from real
source files, read from the suite and run through ``specdecode bench`` as the model's own FIM
prompt, plain against speculative; a target without FIM tokens skips them with a note. Counts
and structure only (a fake code model over bytes: :class:`test_fim_cache.FimBytes`), no wall clock."""

from __future__ import annotations

import argparse
import io
import json

import pytest

from specdecode.backends.fim import FimInput, fim_prompt_ids
from specdecode.bench import BenchConfig, add_bench_parser, config_from_args, load_prompts, print_table, run_bench
from specdecode.errors import SpecDecodeError

from test_fim_cache import MIDDLE, FimBytes as CodeModel


class FimBytes(CodeModel):
    """The fake code model; named "no-fim", one without FIM tokens (smollm2's case)."""

    def __init__(self, *args, **kw):
        super().__init__(*args, **kw)
        if self.name == "no-fim":
            self.fim_tokens = None


def test_the_builtin_suite_has_fim_completions_cut_from_real_files():
    fim = [p for p in load_prompts(None) if p.category == "fim"]
    assert len(fim) >= 8 and all(p.fim and p.messages is None and p.tools is None for p in fim)
    raw = [json.loads(line) for line in
           (__import__("importlib").resources.files("specdecode") / "data/bench_suite.jsonl").read_text().splitlines()]
    lines = {e["id"]: e for e in raw if e["category"] == "fim"}
    kinds = {e["repeats"] for e in lines.values()}
    assert kinds == {"prefix", "suffix", "extra", "none"}  # some repeat nearby code, some do not
    for p in fim:
        e = lines[p.id]
        assert p.prompt == e["prefix"] and p.suffix == e["suffix"] and p.prompt and p.suffix
        assert e["source"].startswith(("CPython 3.11.7 Lib/", "matplotlib 3.11.2 ")) and "lines" in e["source"]
        assert 64 <= p.max_tokens <= 128 and e["middle"].strip()
        if e["repeats"] == "extra":  # the middle is in another open file, sent as repository context
            assert p.extra and e["middle"].strip().splitlines()[0].strip() in p.extra[0][1]
        else:
            assert not p.extra


@pytest.mark.parametrize("line,message", [
    ({"category": "fim", "prefix": "def f(", "prompt": "x"}, "exactly one of 'prompt', 'messages' or 'prefix'"),
    ({"category": "fim", "prefix": 3, "suffix": ""}, "'prefix' and 'suffix' must be strings"),
    ({"category": "fim", "prefix": "a", "suffix": ["b"]}, "'prefix' and 'suffix' must be strings"),
    ({"category": "fim", "prefix": "a", "suffix": "b", "extra": [{"filename": "x.py"}]}, "extra[0]"),
    ({"category": "fim", "prefix": "a", "suffix": "b", "extra": "x.py"}, "extra must be a list"),
    ({"category": "chat", "prompt": "a", "suffix": "b"}, "give them with 'prefix'"),
])
def test_a_malformed_fim_line_is_named_by_file_and_line(tmp_path, line, message):
    f = tmp_path / "p.jsonl"
    f.write_text(json.dumps({"category": "chat", "prompt": "hi"}) + "\n" + json.dumps(line) + "\n")
    with pytest.raises(SpecDecodeError) as e:
        load_prompts(f)
    assert f"{f}, line 2" in str(e.value) and message in str(e.value)


def test_a_fim_line_reads_prefix_suffix_and_files(tmp_path):
    f = tmp_path / "p.jsonl"
    f.write_text(json.dumps({"id": "f1", "category": "fim", "prefix": "a = 1\n", "suffix": "\nb = 2\n",
                             "extra": [{"filename": "u.py", "text": "c = 3\n"}, ["v.py", "d = 4\n"]]}) + "\n"
                 + json.dumps({"id": "f2", "category": "fim", "prefix": "x"}) + "\n")
    a, b = load_prompts(f)
    assert (a.prompt, a.suffix, a.extra) == ("a = 1\n", "\nb = 2\n", (("u.py", "c = 3\n"), ("v.py", "d = 4\n")))
    assert b.fim and b.suffix == "" and b.extra == ()  # the cursor at the end of the file


def test_category_is_an_alias_of_categories():
    p = argparse.ArgumentParser()
    add_bench_parser(p.add_subparsers())
    assert config_from_args(p.parse_args(["bench", "--category", "fim", "--per-category", "2"])).categories == ("fim",)


def _suite(tmp_path, with_chat: bool = True):
    """A prompt file: a middle that repeats the line above (prompt lookup drafts it), one whose
    code is in another file, and a raw prompt."""
    lines = [{"id": "fim-repeat", "category": "fim", "prefix": "total = price * count + tax\ntotal = price",
              "suffix": "\nprint(total)\n", "max_tokens": 40},
             {"id": "fim-extra", "category": "fim", "prefix": "def area(r):\n", "suffix": "\n",
              "extra": [{"filename": "geo.py", "text": "def area(r):\n    return 3.14159 * r * r\n"}], "max_tokens": 40}]
    if with_chat:
        lines.append({"id": "raw", "category": "chat", "prompt": "hello hello hello", "max_tokens": 6})
    f = tmp_path / "p.jsonl"
    f.write_text("\n".join(json.dumps(x) for x in lines) + "\n")
    return f


def test_the_bench_runs_fim_prompts_as_the_models_own_fim_prompt(tmp_path, monkeypatch):
    monkeypatch.setenv("SPECDECODE_CACHE", str(tmp_path / "cache"))  # the fake's measured T(n) stays here
    f = _suite(tmp_path)
    target = FimBytes()
    res = run_bench(BenchConfig(target=target, prompts=f, configs=("ngram:4",), peer=False, progress=False,
                                categories=("fim",)))
    rows = {r["id"]: r for r in res["rows"]}
    assert set(rows) == {"fim-repeat", "fim-extra"} and res["meta"]["skipped"] is None
    want = fim_prompt_ids(target, FimInput("total = price * count + tax\ntotal = price", "\nprint(total)\n"))
    assert rows["fim-repeat"]["prompt_tokens"] == len(want)
    for r in rows.values():
        # The middle ends where the model says (fim_pad, an end-of-generation id) before max_tokens.
        assert r["finish_reason"] == "stop" and r["completion_tokens"] == MIDDLE
        assert r["parity"] == "exact" and r["same_as_plain"]
        assert r["decode_s"] > 0 and r["plain_decode_s"] > 0
    # Prompt lookup drafts the repeated line, and the code of the other file.
    assert rows["fim-repeat"]["accepted"] > 0 and rows["fim-extra"]["accepted"] > 0
    entry = res["summary"]["ngram:4"]["fim"]
    assert entry["prompts"] == 2 and entry["parity"]["exact"] == 2
    assert entry["time_speedup"] is not None and entry["lowest_time_speedup"] <= entry["time_speedup"]
    out = io.StringIO()
    print_table(res, out)
    assert "per prompt (fim)" in out.getvalue() and "fim-extra" in out.getvalue()


def test_a_target_without_fim_tokens_skips_the_category_with_a_note(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("SPECDECODE_CACHE", str(tmp_path / "cache"))
    f = _suite(tmp_path)
    target = FimBytes(name="no-fim")
    res = run_bench(BenchConfig(target=target, prompts=f, configs=("ngram:4",), peer=False, progress=False))
    assert [r["id"] for r in res["rows"]] == ["raw"]
    assert "2 fill-in-the-middle prompt(s) (fim) skipped" in res["meta"]["skipped"] and "no-fim" in res["meta"]["skipped"]
    assert res["meta"]["skipped"] in capsys.readouterr().err
    # Only fim selected: one clear error naming the target, nothing run.
    with pytest.raises(SpecDecodeError) as e:
        run_bench(BenchConfig(target=FimBytes(name="no-fim"), prompts=f, configs=("ngram:4",), peer=False,
                              progress=False, categories=("fim",)))
    assert e.value.param == "categories" and "no-fim" in str(e.value) and "no prompts left" in str(e.value)
