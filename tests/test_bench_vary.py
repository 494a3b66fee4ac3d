"""``specdecode bench --vary SETTING=V1,V2``: one setting at several values, side by side.

Judged on a scripted target (tests/conftest.py's ScriptedBackend behind a stand-in Decoder)
by counts and order: which values' models load with which environment, which runs go in
which order prompt by prompt, which options each run gets, and what the result and its table
say; never by how fast anything ran. One test loads smollm2 twice to see the llama.cpp
backend take the variable.
"""

from __future__ import annotations

import argparse
import io
import json
import os

import pytest

from conftest import ScriptedBackend
from specdecode.backends import BackendBase
from specdecode.bench import (BenchConfig, add_bench_parser, config_from_args, parse_vary, print_table, run_bench,
                              runner, vary_table)
from specdecode.bench.vary import SETTINGS, check_loaded, loading_with
from specdecode.control.costmodel import CostCurve
from specdecode.drafters import NoDrafter
from specdecode.engine import SpeculativeEngine
from specdecode.errors import SpecDecodeError

FLASH = "SPECDECODE_LLAMA_FLASH_ATTN"
PIECES = [b"<eos>", b"a", b"b", b"c"]
PROMPT = [1, 2, 3, 1, 2]
SCRIPT = [3, 1, 2, 3, 1, 2, 3, 1, 2, 3]  # a repeating text: prompt lookup drafts it right


class VaryTarget(ScriptedBackend):
    """A scripted target that, like the llama.cpp backend, reads its flash attention setting
    from the environment when it loads, and reports it."""

    cost_key = ""
    weights_note = ""

    def __init__(self) -> None:
        super().__init__(PIECES, SCRIPT, n_prompt=len(PROMPT))
        self.flash_attention = os.environ.get(FLASH, "auto")
        self.n_threads = 1
        self.invariant_block = 4  # as measured: strict generations verify blocks of up to 4


class FakeDecoder:
    """Stands in for the Decoder the bench opens per value: the scripted target and a plain engine."""

    loads: list[str] = []

    def __init__(self, config: BenchConfig) -> None:
        self.target = VaryTarget()
        self.engine = SpeculativeEngine(self.target, NoDrafter(), 0)
        FakeDecoder.loads.append(self.target.flash_attention)

    def prompt_ids(self, prompt, messages=None, tools=None) -> list[int]:
        return list(PROMPT)

    def close(self) -> None:
        pass


def _parse(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_bench_parser(parser.add_subparsers())
    return parser.parse_args(["bench", *argv])


@pytest.fixture
def scripted_bench(monkeypatch, tmp_path):
    """run_bench on the scripted target; returns (prompts file, the runs' log): per engine
    generation (the target's flash attention, plain or not, the batch_invariant it was given,
    its drafter's id)."""
    FakeDecoder.loads = []
    monkeypatch.setattr(runner, "open_decoder", FakeDecoder)
    # The oracle's T(n), scripted: no timing of the fake target, no cache file written.
    monkeypatch.setattr(runner, "cached_forward_curve", lambda *a: CostCurve((1, 33), (0.01, 0.05)))
    log = []
    generate = SpeculativeEngine.generate

    def recording(self, ids, options=None, **kw):
        log.append((self.target.flash_attention, isinstance(self.drafter, NoDrafter), kw.get("batch_invariant"),
                    id(self.drafter)))
        return generate(self, ids, options, **kw)

    monkeypatch.setattr(SpeculativeEngine, "generate", recording)
    prompts = tmp_path / "p.jsonl"
    prompts.write_text("".join(json.dumps({"id": f"p{i}", "category": "chat", "prompt": "x", "max_tokens": 8}) + "\n"
                               for i in range(4)))
    return prompts, log


def test_vary_parses_one_setting_and_its_values():
    v = parse_vary("flash_attn=auto, OFF")
    assert (v.setting.name, v.setting.kind, v.values) == ("flash_attn", "load", ("auto", "off"))
    assert v.label("off") == "flash_attn=off"
    assert parse_vary("strict=off,on").setting.field == "batch_invariant"
    assert set(SETTINGS) == {"flash_attn", "buffers", "strict", "sampling_rule", "draft_vocab"}
    assert parse_vary("draft_vocab=slem,tli").setting.kind == "drafter"
    for bad, msg in (("threads=1,2", "SETTING one of flash_attn, buffers"), ("flash_attn", "expected SETTING=V1,V2"),
                     ("flash_attn=off", "two or more different values"), ("strict=on,on", "two or more different"),
                     ("buffers=repack,fast", "'fast' is not a value of buffers: expected auto, amx, repack, none")):
        with pytest.raises(SpecDecodeError, match=msg) as e:
            parse_vary(bad)
        assert e.value.param == "--vary"
    # Checked with the rest of the config, before anything loads.
    with pytest.raises(SpecDecodeError, match="give a --temperature above 0"):
        BenchConfig(target="/nonexistent.gguf", vary="sampling_rule=gumbel,rejection")
    with pytest.raises(SpecDecodeError, match="'maybe' is not a value of strict"):
        config_from_args(_parse(["--vary", "strict=on,maybe"]))
    assert config_from_args(_parse(["--vary", "flash_attn=auto,off"])) == BenchConfig(vary="flash_attn=auto,off")


def test_a_load_setting_is_set_for_its_load_only_and_checked(monkeypatch):
    flash = SETTINGS["flash_attn"]
    monkeypatch.delenv(FLASH, raising=False)
    with loading_with(flash, "off"):
        assert os.environ[FLASH] == "off"
    assert FLASH not in os.environ
    buffers = SETTINGS["buffers"]
    monkeypatch.setenv("SPECDECODE_LLAMA_BUFFERS", "none")
    monkeypatch.setenv("SPECDECODE_LLAMA_REPACK", "0")
    with loading_with(buffers, "auto"):  # the machine's own choice: neither spelling set
        assert "SPECDECODE_LLAMA_BUFFERS" not in os.environ and "SPECDECODE_LLAMA_REPACK" not in os.environ
    with loading_with(buffers, "repack"):  # the older spelling would disagree: unset meanwhile
        assert os.environ["SPECDECODE_LLAMA_BUFFERS"] == "repack" and "SPECDECODE_LLAMA_REPACK" not in os.environ
    assert (os.environ["SPECDECODE_LLAMA_BUFFERS"], os.environ["SPECDECODE_LLAMA_REPACK"]) == ("none", "0")

    class Torchlike(BackendBase):
        name = "a torch model"

    with pytest.raises(SpecDecodeError, match="a setting of the llama.cpp backend: target a torch model has none"):
        check_loaded(flash, "off", Torchlike())
    t = Torchlike()
    t.flash_attention = "auto"
    with pytest.raises(SpecDecodeError, match="flash_attn=off: the target loaded with flash_attn auto"):
        check_loaded(flash, "off", t)
    assert check_loaded(flash, "auto", t) == "flash attention auto"
    # "measured": the variable unset for the load (what a user gets), whichever path the
    # measurement chose is what ran, and the header says why.
    monkeypatch.setenv(FLASH, "on")
    with loading_with(flash, "measured"):
        assert FLASH not in os.environ
    assert os.environ[FLASH] == "on"
    t.flash_attention, t.attention_note = "off", "chosen by measurement: T(33) after 4096 tokens 782 ms without it"
    assert check_loaded(flash, "measured", t) == ("flash attention off (chosen by measurement: T(33) after 4096 "
                                                  "tokens 782 ms without it)")
    assert parse_vary("flash_attn=measured,off").values == ("measured", "off")


def test_each_value_loads_its_own_target_and_the_runs_interleave(scripted_bench, monkeypatch):
    prompts, log = scripted_bench
    monkeypatch.setenv(FLASH, "on")  # the caller's setting: put back after each load
    res = run_bench(BenchConfig(target="scripted", prompts=prompts, configs=("ngram:3",), vary="flash_attn=auto,off",
                                progress=False))
    assert FakeDecoder.loads == ["auto", "off"] and os.environ[FLASH] == "on"
    A, B = ("auto", True), ("off", True)  # (value, plain)
    a, b = ("auto", False), ("off", False)
    runs = [(flash, plain) for flash, plain, _, _ in log]
    assert runs[:4] == [A, a, B, b]  # each value's warm-up: plain, then its configuration
    # Per prompt, the units [plain auto, ngram auto, plain off, ngram off] rotated by one.
    assert runs[4:] == [A, a, B, b,  a, B, b, A,  B, b, A, a,  b, A, a, B]
    assert res["meta"]["configs"] == ["ngram:3 [flash_attn=auto]", "ngram:3 [flash_attn=off]"]
    assert [(r["id"], r["vary"]) for r in res["rows"]] == [(f"p{i}", f"flash_attn={v}") for i in range(4)
                                                            for v in ("auto", "off")]
    assert all(r["config"] == "ngram:3" and r["parity"] == "exact" and r["same_as_plain"] for r in res["rows"])
    for name in res["meta"]["configs"]:
        assert res["summary"][name]["overall"]["prompts"] == 4
        assert res["summary"][name]["overall"]["oracle_speedup"] is not None  # each value's own oracle
    vary = res["meta"]["vary"]
    assert vary["setting"] == "flash_attn" and vary["kind"] == "load" and vary["values"] == ["auto", "off"]
    assert vary["loaded"] == {"auto": "flash attention auto", "off": "flash attention off"}
    assert vary["plain_vs_first"] == {"off": {"exact": 4}} and set(vary["copy_limit"]) == {"auto", "off"}
    assert res["meta"]["peer"] == "peers not run with --vary (the runs compare the setting's values)"
    title, rows, notes = vary_table(res)
    assert rows[0] == ["run", "flash_attn=auto", "flash_attn=off", "off / auto"]
    assert [r[0] for r in rows[1:]] == ["plain tok/s", "ngram:3 tok/s", "ngram:3 speedup over its plain",
                                        "ngram:3 same tokens as its plain"]
    assert rows[-1][1:3] == ["4/4", "4/4"]
    assert "plain runs at flash_attn=off against auto: 4 exact" in notes
    out = io.StringIO()
    print_table(res, out)
    assert title in out.getvalue() and "ngram:3 [flash_attn=off]" in out.getvalue()


def test_a_generation_setting_shares_the_target_and_gives_each_run_its_value(scripted_bench):
    prompts, log = scripted_bench
    res = run_bench(BenchConfig(target="scripted", prompts=prompts, configs=("ngram:3",), vary="strict=off,on",
                                progress=False))
    assert FakeDecoder.loads == ["auto"]  # one target: the values differ per generation
    timed = [(plain, inv) for _, plain, inv, _ in log[4:]]
    off, on = (True, "off"), (True, "on")
    assert timed == [off, (False, "off"), on, (False, "on"),  (False, "off"), on, (False, "on"), off,
                     on, (False, "on"), off, (False, "off"),  (False, "on"), off, (False, "off"), on]
    assert {r["vary"] for r in res["rows"]} == {"strict=off", "strict=on"}
    # Each value's configuration has a drafter of its own (a history of its own).
    drafters = {inv: {d for _, plain, i, d in log if not plain and i == inv} for inv in ("off", "on")}
    assert len(drafters["off"]) == len(drafters["on"]) == 1 and not drafters["off"] & drafters["on"]
    assert all(r["same_as_plain"] and r["parity"] == "exact" for r in res["rows"])
    assert res["meta"]["vary"]["loaded"] == {} and res["meta"]["vary"]["plain_vs_first"] == {"on": {"exact": 4}}


def test_a_drafter_setting_shares_the_target_and_builds_each_values_drafters_with_it(scripted_bench, monkeypatch):
    prompts, log = scripted_bench
    built = []
    make = runner.make_speculation

    def recording(choice, target, **kw):
        built.append(kw["draft_vocab"])
        return make(choice, target, **{**kw, "draft_vocab": 0})

    monkeypatch.setattr(runner, "make_speculation", recording)
    config = BenchConfig(target="scripted", prompts=prompts, configs=("ngram:3",), vary="draft_vocab=slem,tli",
                         progress=False)
    run_bench(config)
    assert FakeDecoder.loads == ["auto"] and built == [0, 0]  # prompt lookup has no vocabulary to draft in
    built.clear()
    FakeDecoder.loads = []
    monkeypatch.setattr(runner, "uses_option", lambda draft, name: True)  # as a draft model does
    res = run_bench(config)
    assert FakeDecoder.loads == ["auto"] and built == ["slem", "tli"]  # one target, each value's own drafters
    assert {r["vary"] for r in res["rows"]} == {"draft_vocab=slem", "draft_vocab=tli"}
    assert all(r["parity"] == "exact" for r in res["rows"])


def test_vary_flash_attention_loads_smollm2_once_per_value(smollm_path, tmp_path):
    prompts = tmp_path / "p.jsonl"
    prompts.write_text(json.dumps({"id": "edit-1", "category": "code_editing", "max_tokens": 8,
                                   "prompt": "a = 1\nb = 2\na = 1\nb ="}) + "\n")
    res = run_bench(BenchConfig(target="smollm2-135m-instruct", prompts=prompts, configs=("ngram:3",), n_ctx=512,
                                progress=False, vary="flash_attn=auto,off"))
    assert res["meta"]["vary"]["loaded"] == {"auto": "flash attention auto", "off": "flash attention off"}
    assert [r["vary"] for r in res["rows"]] == ["flash_attn=auto", "flash_attn=off"]
    assert all(r["parity"] != "divergent" for r in res["rows"])
    assert sum(res["meta"]["vary"]["plain_vs_first"]["off"].values()) == 1
