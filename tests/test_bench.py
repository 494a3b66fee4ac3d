"""specdecode bench runs end to end on the small model and writes well-formed output.
(A smoke test of the harness; speed claims live in the README, measured by the bench.)"""

from __future__ import annotations

import argparse
import io
import json
import os
import time
import subprocess
import sys
from types import SimpleNamespace

import pytest

from specdecode.bench import (CATEGORIES, LONG_CONTEXT_CATEGORIES, BenchConfig, add_bench_parser, config_from_args,
                              load_prompts, markdown, parse_config, print_table, run_bench, select_prompts, summarize)
from specdecode.errors import SpecDecodeError
from specdecode.limits import MAX_NUM_SPECULATIVE_TOKENS
from specdecode.sampling import SamplingParams


def test_builtin_suite_has_eight_prompts_per_category():
    prompts = load_prompts(None)
    for cat in CATEGORIES:
        least = 6 if cat in ("predicted_edits", "agent") else 4 if cat in EDITOR_CATEGORIES else \
            1 if cat in LONG_CONTEXT_CATEGORIES else 8
        assert sum(p.category == cat for p in prompts) >= least, cat
    assert len({p.id for p in prompts}) == len(prompts)


def test_edits_and_agent_prompts_carry_their_prediction():
    """Code edits carry the original code as the prediction (which the answer copies with
    changes); the agent prompts the tool's result (which the answer quotes), each asked twice."""
    prompts = load_prompts(None)
    for p in prompts:
        if p.category in ("code_editing", "predicted_edits"):
            code = p.prediction.strip().strip("`").split("\n", 1)[1]  # without the fence's language line
            assert code.strip() and code[:200] in (p.prompt or p.messages[-1]["content"]), p.id
        elif p.category == "agent":
            assert p.prediction in p.messages[-1]["content"], p.id
        elif p.category in EDITOR_CATEGORIES:
            assert p.prediction and p.prediction in p.messages[-1]["content"] + p.messages[-3]["content"], p.id
        elif p.category in LONG_CONTEXT_CATEGORIES:
            tools = [m["content"] for m in p.messages if m["role"] == "tool"]
            sent = p.messages[-1]["content"] + p.messages[-3]["content"] if p.category.startswith("edit_large") \
                else "\n".join(tools)
            assert p.prediction and p.prediction in sent, p.id
        else:
            assert p.prediction is None, p.id
    agent = [p for p in prompts if p.category == "agent"]
    assert all(a.messages == b.messages for a, b in zip(agent[::2], agent[1::2]))


EDITOR_CATEGORIES = ("edit_whole", "edit_search_replace", "edit_udiff", "agent_tool_result")


def test_long_context_categories_send_thousands_of_tokens_and_run_only_when_named():
    """An edit in a large file (aider's whole format) and an agent's turn after long read_file results,
    at about 2k, 4k and 8k tokens (about 4 characters a token of this code); the whole suite's run
    leaves them out, naming them runs them."""
    prompts = load_prompts(None)
    chars = {p.category: sum(len(m["content"]) for m in p.messages) for p in prompts
             if p.category in LONG_CONTEXT_CATEGORIES}
    assert set(chars) == set(LONG_CONTEXT_CATEGORIES)
    for cat, n in chars.items():
        k = int(cat.rsplit("_", 1)[1].rstrip("k"))
        assert 0.8 * k * 4000 <= n <= 1.3 * k * 4400, (cat, n)
    for p in prompts:
        if p.category.startswith("edit_large"):
            assert "*file listing*" in p.messages[0]["content"] and p.tools is None
        elif p.category.startswith("agent_long"):
            assert p.messages[-1]["role"] == "tool" and p.tools[0]["function"]["name"] == "read_file"
    assert not {p.category for p in select_prompts(prompts)} & set(LONG_CONTEXT_CATEGORIES)
    named = select_prompts(prompts, ["edit_large_4k", "agent_long_2k"])
    assert [p.id for p in named] == ["edit_large_4k-01", "agent_long_2k-01"]


def test_editor_categories_send_what_editors_and_agents_send():
    """aider's three edit formats (its system prompt, examples, file message and reminder; the
    file in the message before last but one) and an agent's turn after an OpenAI tool call
    (tools presented by the template, the result in a tool message)."""
    prompts = {p.id: p for p in load_prompts(None)}
    marks = {"edit_whole": "*file listing*", "edit_search_replace": "<<<<<<< SEARCH", "edit_udiff": "diff -U0"}
    for cat, mark in marks.items():
        for i in range(1, 5):
            p = prompts[f"{cat}-{i:02d}"]
            assert mark in p.messages[0]["content"] and p.messages[-1]["role"] == "user" and p.tools is None
            assert "*added these files to the chat*" in p.messages[-3]["content"], p.id
            assert "{code}" not in p.messages[-3]["content"] and "{request}" not in p.messages[-1]["content"]
    for i in range(1, 5):
        p = prompts[f"agent_tool_result-{i:02d}"]
        call, result = p.messages[-2], p.messages[-1]
        assert call["tool_calls"][0]["function"]["name"] in {t["function"]["name"] for t in p.tools}
        assert result == {"role": "tool", "tool_call_id": call["tool_calls"][0]["id"], "content": p.prediction}


def test_a_prompt_file_with_bad_tools_is_refused(tmp_path):
    f = tmp_path / "p.jsonl"
    f.write_text(json.dumps({"category": "x", "prompt": "hi", "tools": [{"type": "function"}]}) + "\n")
    with pytest.raises(SpecDecodeError, match="line 1: 'tools' must be a list of tool objects, with 'messages'"):
        load_prompts(f)
    f.write_text(json.dumps({"category": "x", "messages": [{"role": "user", "content": "hi"}], "tools": "no"}) + "\n")
    with pytest.raises(SpecDecodeError, match="'tools' must be"):
        load_prompts(f)


def test_the_repeat_category_chains_requests():
    """"repeat" (after the free-text categories) opens each chain with a novel request, later
    ones asking for (nearly) the same output again in a new prompt; the first three are one chain."""
    assert CATEGORIES == ("code_editing", "extraction", "qa_passages", "translation", "math", "chat", "multi_turn",
                          "repeat", "json_schema", "predicted_edits", "agent") + EDITOR_CATEGORIES + ("fim",) \
        + LONG_CONTEXT_CATEGORIES
    rep = [p for p in load_prompts(None) if p.category == "repeat"]
    assert [p.id for p in rep] == [f"repeat-{i:02d}" for i in range(1, 9)]
    assert all(p.messages and 100 <= p.max_tokens <= 200 for p in rep)
    first3 = select_prompts(load_prompts(None), ["repeat"], per_category=3)
    user = [p.messages[-1]["content"] for p in first3]
    assert user[2] == user[0] and user[1].startswith(user[0]) and user[1] != user[0]


def _schema_cannot_loop(schema: dict, where: str) -> None:
    """Every object closed, every array capped, every free string capped: a small model
    under the grammar cannot write on forever."""
    t = schema.get("type")
    if t == "object":
        assert schema.get("additionalProperties") is False, where
        assert set(schema.get("required", ())) == set(schema["properties"]), where
        for k, sub in schema["properties"].items():
            _schema_cannot_loop(sub, f"{where}.{k}")
    elif t == "array":
        assert isinstance(schema.get("maxItems"), int), where
        _schema_cannot_loop(schema["items"], f"{where}[]")
    elif t == "string":
        assert {"maxLength", "enum", "pattern"} & set(schema), where


def test_the_json_schema_category_holds_closed_bounded_schemas():
    """Structured extraction as programs send it (response_format json_schema): chat
    prompts, each with a schema that llguidance accepts and that bounds the output."""
    import llguidance

    js = [p for p in load_prompts(None) if p.category == "json_schema"]
    assert [p.id for p in js] == [f"json_schema-{i:02d}" for i in range(1, 9)]
    for p in js:
        assert p.messages and p.grammar is not None and p.grammar.kind == "json_schema", p.id
        assert 60 <= p.max_tokens <= 160, p.id
        assert p.grammar.name.startswith("built-in suite, line ")
        assert llguidance.LLMatcher.validate_grammar(p.grammar.llguidance_grammar()) == "", p.id
        _schema_cannot_loop(json.loads(p.grammar.source), p.id)
    assert all(p.grammar is None for p in load_prompts(None) if p.category != "json_schema")


def _oracle_keys_are_sane(entry: dict, defined: bool) -> None:
    assert "oracle_speedup" in entry and "oracle_fraction" in entry
    if defined:
        assert entry["oracle_speedup"] >= 1.0 and entry["oracle_fraction"] > 0
    else:
        assert entry["oracle_speedup"] is None and entry["oracle_fraction"] is None


def test_summary_sums_oracle_times_and_reports_the_fraction():
    def row(cat, spec, plain, oracle_s=None, plain_s=None):
        return {"category": cat, "config": "ngram:3", "spec_tokens_per_s": spec, "plain_tokens_per_s": plain,
                "drafted": 0, "accepted": 0, "completion_tokens": 1, "target_forward_passes": 1,
                "accepted_per_position": [], "drafted_per_position": [], "parity": "exact",
                "oracle_time_s": oracle_s, "oracle_plain_time_s": plain_s}

    rows = [row("chat", 20.0, 10.0, 1.0, 2.0), row("chat", 20.0, 10.0, 3.0, 10.0), row("math", 10.0, 10.0, 4.0, 4.0)]
    s = summarize(rows, ["ngram:3"])["ngram:3"]
    assert s["chat"]["oracle_speedup"] == pytest.approx(12 / 4) and s["chat"]["speedup"] == 2.0
    assert s["chat"]["oracle_fraction"] == pytest.approx(2 / 3, abs=1e-3)
    assert s["math"]["oracle_speedup"] == 1.0 and s["math"]["oracle_fraction"] == 1.0
    assert s["overall"]["oracle_speedup"] == pytest.approx(16 / 8)
    # No oracle times (sampling, a draft model): None, and the reports say "-".
    none = summarize([row("chat", 20.0, 10.0)], ["ngram:3"])
    _oracle_keys_are_sane(none["ngram:3"]["overall"], defined=False)
    meta = {"target": "t", "prompts": 3, "temperature": 0.0, "threads": 2, "peak_rss_mb": 1.0,
            "rss_before_peer_mb": 1.0, "peer": None, "weights": "repack (CPU_REPACK 597 MiB)"}
    md = markdown({"ngram:3": s, "other": none["ngram:3"]}, meta)
    assert "2 threads, weights repack (CPU_REPACK 597 MiB), peak RSS" in md
    assert "| chat | 20.0 | 10.0 | 2.0x | 3.00x | 67% |" in md and "| 2.0x | - | - |" in md
    buf = io.StringIO()
    print_table({"meta": meta, "summary": {"ngram:3": s, "other": none["ngram:3"]}}, file=buf)
    assert "oracle" in buf.getvalue() and "3.00x" in buf.getvalue() and "67%" in buf.getvalue()


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


def test_prompt_files_may_carry_a_json_schema(tmp_path):
    schema = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 20}}, "required": ["name"],
              "additionalProperties": False}
    f = tmp_path / "p.jsonl"
    f.write_text(json.dumps({"category": "json_schema", "prompt": "Name:", "json_schema": schema}) + "\n"
                 + json.dumps({"category": "chat", "prompt": "hi"}) + "\n")
    with_schema, plain = load_prompts(f)
    assert with_schema.grammar.kind == "json_schema" and json.loads(with_schema.grammar.source) == schema
    assert with_schema.grammar.name == f"{f}, line 1" and plain.grammar is None
    for bad in ('"{}"', "[]", "true", "null"):  # a schema must be an object (not its JSON text)
        f.write_text('{"category": "chat", "prompt": "hi"}\n'
                     f'{{"category": "json_schema", "prompt": "x", "json_schema": {bad}}}\n')
        with pytest.raises(SpecDecodeError, match=r"p\.jsonl, line 2: 'json_schema' must be a JSON schema object"):
            load_prompts(f)


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
    assert select_prompts(prompts) == [p for p in prompts if p.category not in LONG_CONTEXT_CATEGORIES]
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
    for bad in (0.0, 1.5, float("nan")):
        with pytest.raises(SpecDecodeError, match=f"--background-load {bad} is out of range"):
            BenchConfig(background_load=bad)
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
                   "--draft-vocab", "1000", "--no-peer", "--quiet", "--background-load", "0.5"])
    assert config_from_args(args) == BenchConfig(
        target="smollm2-135m-instruct", prompts="p.jsonl", configs=("ngram:3", "auto"), categories=("chat", "math"),
        per_category=2, max_tokens=16, sampling=SamplingParams(temperature=0.7, top_p=0.9, seed=5), n_ctx=1024,
        n_threads=2, backend="torch", draft_backend="llama.cpp", dtype="bfloat16", device="auto", draft_vocab=1000,
        peer=False, progress=False, background_load=0.5)
    # The defaults are the library's defaults, the seed included (fixed at 0 for the bench).
    assert config_from_args(_parse([])) == BenchConfig()
    with pytest.raises(SpecDecodeError, match="--ctx-size"):
        config_from_args(_parse(["--ctx-size", "1"]))


def test_draft_options_reach_the_configurations_whose_drafter_uses_them():
    """--draft-backend torch beside prompt lookup applies to the draft model only; a draft option
    that no configuration uses is refused before anything loads, naming it."""
    cfg = BenchConfig(configs=("smollm2-135m-instruct:4", "ngram:auto"), draft_backend="torch", draft_vocab="slem",
                      draft_gpu_layers="12")
    assert cfg.draft_options("smollm2-135m-instruct") == {"draft_vocab": "slem", "draft_backend": "torch",
                                                          "draft_gpu_layers": 12}
    assert cfg.draft_options("ngram") == {"draft_vocab": 0, "draft_backend": "auto", "draft_gpu_layers": "auto"}
    with pytest.raises(SpecDecodeError, match="draft_gpu_layers = 'all' applies to a draft model; no configuration"):
        BenchConfig(configs=("ngram:auto",), draft_gpu_layers="all")
    with pytest.raises(SpecDecodeError, match="gpu_layers = 'most' is not a choice"):
        BenchConfig(gpu_layers="most")
    with pytest.raises(SpecDecodeError, match="draft_backend = 'torch' applies to a draft model; no configuration"):
        BenchConfig(configs=("ngram:auto", "suffix:4"), draft_backend="torch")
    with pytest.raises(SpecDecodeError, match="draft_vocab = 'tli'") as e:
        BenchConfig(configs=("ngram:auto",), draft_vocab="tli")
    assert e.value.param == "draft_vocab"


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
    # Greedy: the oracle replays the plain outputs over prompt lookup with the measured T(n).
    for per in res["summary"]["ngram:3"].values():
        _oracle_keys_are_sane(per, defined=True)
    for r in res["rows"]:
        assert r["oracle_plain_time_s"] > 0 and 0 < r["oracle_time_s"] <= r["oracle_plain_time_s"] * (1 + 1e-9)
    assert res["meta"]["oracle_drafters"] == {"ngram": ["ngram"]}
    assert res["meta"]["cost_curve"]["ns"][0] == 1 and len(res["meta"]["cost_curve"]["seconds"]) > 1
    curve = res["meta"]["cost_curve"]
    assert res["meta"]["copy_limit"] == pytest.approx(33 * curve["seconds"][0] / curve["seconds"][-1], rel=1e-2)


def test_background_load_takes_its_share_of_the_cpu(monkeypatch):
    """Each of the load's processes spins for its duty's share of every period and sleeps the
    rest (judged on a scripted clock: the share a child gets of a shared machine is the
    machine's business); the children burn CPU while inside the block and are gone after it."""
    from specdecode.bench import load as load_mod
    from specdecode.bench.load import PERIOD_S, BackgroundLoad, cpus

    load = BackgroundLoad(0.5)
    assert load.processes == max(1, -(-cpus() // 2)) and 0 < load.duty <= 1
    assert BackgroundLoad(0.25).duty * BackgroundLoad(0.25).processes == pytest.approx(0.25 * cpus())

    # The duty cycle, in-process on a scripted clock: every read of perf_counter advances it
    # by 1 ms; sleep advances it by what it is asked.
    class Clock:
        now, busy, slept, periods = 0.0, 0.0, 0.0, 0

        def perf_counter(self):
            self.now += 0.001
            self.busy += 0.001
            return self.now

        def sleep(self, s):
            self.now += s
            self.slept += s
            self.periods += 1

    class StopAfter:  # the stop event, set once the clock has passed `seconds`
        def __init__(self, clock, seconds):
            self.clock, self.seconds = clock, seconds

        def is_set(self):
            return self.clock.now >= self.seconds

    for duty in (0.3, 0.5, 1.0):
        clock = Clock()
        monkeypatch.setattr(load_mod, "time", clock)
        load_mod._spin(duty, StopAfter(clock, 20 * PERIOD_S))
        # Busy its share of every 50 ms period (to the clock's 1 ms step), asleep the rest.
        assert clock.busy / clock.now == pytest.approx(duty, abs=0.05), (duty, clock.busy, clock.now)
        assert clock.periods == (0 if duty == 1.0 else 20)
    monkeypatch.undo()

    # The real children: each accumulates CPU time while inside the block (waited for, not
    # judged against the clock), and none is left after it.
    def cpu_s(pid):
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # utime + stime

    with load:
        procs = list(load._procs)
        assert len(procs) == load.processes and all(p.is_alive() for p in procs)
        deadline = time.monotonic() + 120  # only a bound on a hang: nothing is judged by it
        while not all(cpu_s(p.pid) >= 0.05 for p in procs):
            assert time.monotonic() < deadline, [cpu_s(p.pid) for p in procs]
            time.sleep(0.05)
        assert all(p.is_alive() for p in procs)
    assert all(not p.is_alive() for p in procs)


def test_run_bench_constrains_json_schema_prompts(smollm_path, tmp_path, monkeypatch):
    """A json_schema prompt of the built-in suite: plain and speculative runs, warm-up
    included, all get its grammar; finished outputs parse as JSON with the schema's keys;
    parity holds; the peer runs the free prompt only."""
    from importlib import resources

    from specdecode.bench import runner
    from specdecode.engine import SpeculativeEngine

    suite = resources.files("specdecode").joinpath("data/bench_suite.jsonl").read_text(encoding="utf-8")
    # The product schema: smollm2 closes it in about 90 tokens.
    (entry,) = [json.loads(line) for line in suite.splitlines() if '"json_schema-02"' in line]
    entry["max_tokens"] = 96
    prompts = tmp_path / "p.jsonl"
    prompts.write_text(json.dumps(entry) + "\n" + json.dumps(
        {"id": "raw-1", "category": "chat", "prompt": "The capital of France is", "max_tokens": 6}) + "\n")
    seen = []  # (grammar, result) of every engine generation
    generate = SpeculativeEngine.generate
    def recording(self, ids, **kw):
        seen.append((kw.get("grammar"), generate(self, ids, **kw)))
        return seen[-1][1]

    monkeypatch.setattr(SpeculativeEngine, "generate", recording)
    peer_runs = []

    class FakePeer:  # stands in for llama-cpp-python: records which prompts it was given
        def run(self, ids, max_tokens, assisted=False):
            peer_runs.append(list(ids))
            return max_tokens, 42.0

    monkeypatch.setattr(runner, "start_peer", lambda *a: (FakePeer(), "fake peer", False))
    res = run_bench(BenchConfig(target="smollm2-135m-instruct", prompts=prompts, configs=("ngram:3",),
                                categories=("json_schema", "chat"), per_category=1, n_ctx=1024, progress=False))
    g, free = res["rows"]
    assert (g["id"], g["grammar"], free["grammar"]) == ("json_schema-02", True, False)
    # Warm-up (first prompt) and the timed runs of the schema prompt: plain and ngram:3, constrained.
    assert [x is not None for x, _ in seen] == [True, True, True, True, False, False]
    finished = [r for x, r in seen[2:4] if r.finish_reason == "stop"]
    assert finished, [r.text for _, r in seen[2:4]]
    for r in finished:
        assert set(json.loads(r.text)) == set(entry["json_schema"]["properties"])
    assert seen[2][1].text == seen[3][1].text and g["parity"] == "exact"
    assert res["summary"]["ngram:3"]["json_schema"]["parity"]["exact"] == 1
    # The peer skips the prompt with a grammar, and the report says so.
    assert len(peer_runs) == 1 and g["peer_tokens_per_s"] is None and free["peer_tokens_per_s"] == 42.0
    assert res["meta"]["peer"] == ("fake peer; skipped on 1 of 2 prompts, those with a grammar "
                                   "(peers cannot constrain output)")
    assert "peer_prompt_lookup_tokens_per_s" not in res["summary"]["ngram:3"]["json_schema"]


def test_the_torch_draft_is_found_through_draft_backends():
    """The assisted peer's draft comes from the drafters' declared draft_backends()."""
    from specdecode.backends.torch import TorchBackend
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
        for entry in per.values():
            _oracle_keys_are_sane(entry, defined=True)
    assert len(res["rows"]) == 6 and res["meta"]["peak_rss_mb"] > 0
    assert "| oracle speedup | of oracle |" in (out / "results.md").read_text()
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


def test_trees_run_beside_chains_as_config_plus_trees(smollm_path, tmp_path):
    """--max-tree-nodes N: every configuration runs with chains and again with trees, side by
    side, and both keep greedy parity."""
    with pytest.raises(SpecDecodeError, match="max_tree_nodes = 65 is out of range"):
        BenchConfig(max_tree_nodes=65)
    assert config_from_args(_parse(["--max-tree-nodes", "8", "--tree-width", "2"])) == BenchConfig(
        max_tree_nodes=8, tree_width=2)
    prompts = tmp_path / "p.jsonl"
    prompts.write_text(json.dumps({"id": "edit-1", "category": "code_editing", "max_tokens": 24,
                                   "prompt": "a = 1\nb = 2\na = 3\nb = 4\na = 1\nb = 2\na = 3\nb ="}) + "\n")
    res = run_bench(BenchConfig(target="smollm2-135m-instruct", prompts=prompts, configs=("ngram:3",),
                                n_ctx=512, peer=False, progress=False, max_tree_nodes=6))
    assert res["meta"]["configs"] == ["ngram:3", "ngram:3+trees"]
    chain, tree = res["rows"]
    assert chain["tree_steps"] == 0 and tree["config"] == "ngram:3+trees"
    assert chain["parity"] != "divergent" and tree["parity"] != "divergent"
    assert "mean_accepted_length" in res["summary"]["ngram:3+trees"]["overall"]


def test_time_to_the_whole_answer_compares_answers_of_one_length():
    """Where a near-tie made the plain answer end sooner (135 tokens against 256), its time is
    scaled to the speculative answer's length: a longer answer is not a slower one."""
    def row(n, n_plain, plain_s, spec_s):
        return {"category": "agent", "config": "auto:auto", "spec_tokens_per_s": 20.0, "plain_tokens_per_s": 11.5,
                "drafted": 0, "accepted": 0, "completion_tokens": n, "plain_completion_tokens": n_plain,
                "target_forward_passes": 1, "accepted_per_position": [], "drafted_per_position": [],
                "parity": "near-tie", "oracle_time_s": None, "oracle_plain_time_s": None,
                "decode_s": spec_s, "plain_decode_s": plain_s}

    s = summarize([row(256, 135, 11.7, 13.4)], ["auto:auto"])["auto:auto"]["agent"]
    assert s["time_speedup"] == pytest.approx(11.7 * 256 / 135 / 13.4, abs=1e-3)  # 1.66x, not 0.87x
    same = summarize([row(100, 100, 10.0, 5.0), row(50, 50, 4.0, 4.0)], ["auto:auto"])["auto:auto"]["agent"]
    assert same["time_speedup"] == pytest.approx(14 / 9, abs=1e-3) and same["lowest_time_speedup"] == 1.0
    old = row(256, 135, 11.7, 13.4)
    del old["plain_completion_tokens"]  # results of older versions: as they were
    assert summarize([old], ["auto:auto"])["auto:auto"]["agent"]["time_speedup"] == pytest.approx(11.7 / 13.4, abs=1e-3)
