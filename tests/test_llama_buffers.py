"""Where llama.cpp keeps the weights (specdecode.backends.llama_cpp.buffers): the choice as a pure
function, the AMX probe against fake children (one that crashes, ones that succeed, one that
hangs), the placement of weights in CPU_REPACK by name on real models, and its parity with
llama.cpp's own placement."""

from __future__ import annotations

import json
import sys
import textwrap

import numpy as np
import pytest

from specdecode.assembly import registry
from specdecode.backends.llama_cpp import buffers as lb
from specdecode.backends.llama_cpp.buffers import AmxProbe, choose_buffers
from specdecode.errors import ModelFileError, SpecDecodeError

FAST = {1: 0.05, 2: 0.06, 4: 0.07, 8: 0.09, 16: 0.12, 32: 0.2}
SLOW = {n: 2 * s for n, s in FAST.items()}


# --- the choice ---------------------------------------------------------------------------------

@pytest.mark.parametrize("amx, repack_found, requested, probe, expected", [
    # a build without AMX: llama.cpp's extra buffers (CPU_REPACK), unless asked otherwise
    (False, True, None, None, "repack"),
    (False, True, "none", None, "none"),
    (False, True, "repack", None, "repack"),
    # an AMX build: AMX only where the trial survived and AMX was faster
    (True, True, None, None, "repack"),
    (True, True, None, AmxProbe(False, "killed by SIGSEGV"), "repack"),
    (True, True, None, AmxProbe(True, "", FAST, SLOW), "amx"),
    (True, True, None, AmxProbe(True, "", SLOW, FAST), "repack"),
    (True, True, None, AmxProbe(True, "", FAST, {}), "amx"),  # the CPU_REPACK child failed
    (True, False, None, AmxProbe(False, "killed by SIGSEGV"), "none"),
    (True, False, None, AmxProbe(True, "", FAST, {}), "amx"),
    # the request wins over the probe
    (True, True, "repack", AmxProbe(True, "", FAST, SLOW), "repack"),
    (True, True, "amx", AmxProbe(False, "killed by SIGSEGV"), "amx"),
    (True, True, "none", None, "none"),
])
def test_the_buffer_choice(amx, repack_found, requested, probe, expected):
    assert choose_buffers(amx, repack_found, requested, probe) == expected


def test_a_request_this_build_cannot_meet_is_refused_naming_it():
    with pytest.raises(SpecDecodeError, match="SPECDECODE_LLAMA_BUFFERS=amx: this llama.cpp build has no AMX"):
        choose_buffers(False, True, "amx", None)
    with pytest.raises(SpecDecodeError, match="SPECDECODE_LLAMA_BUFFERS=repack: .*no CPU_REPACK"):
        choose_buffers(True, False, "repack", None)


def test_the_request_is_read_from_the_environment(monkeypatch):
    monkeypatch.delenv("SPECDECODE_LLAMA_BUFFERS", raising=False)
    monkeypatch.delenv("SPECDECODE_LLAMA_REPACK", raising=False)
    assert lb.requested_buffers() is None
    for value, choice in (("amx", "amx"), (" Repack ", "repack"), ("none", "none")):
        monkeypatch.setenv("SPECDECODE_LLAMA_BUFFERS", value)
        assert lb.requested_buffers() == choice
    monkeypatch.delenv("SPECDECODE_LLAMA_BUFFERS")
    for value, choice in (("0", "none"), (" 1 ", "repack"), ("", None)):  # the older switch
        monkeypatch.setenv("SPECDECODE_LLAMA_REPACK", value)
        assert lb.requested_buffers() == choice
    monkeypatch.setenv("SPECDECODE_LLAMA_BUFFERS", "none")
    monkeypatch.setenv("SPECDECODE_LLAMA_REPACK", "0")
    assert lb.requested_buffers() == "none"  # the two agree
    monkeypatch.setenv("SPECDECODE_LLAMA_REPACK", "1")
    with pytest.raises(SpecDecodeError, match=r"SPECDECODE_LLAMA_BUFFERS=none and SPECDECODE_LLAMA_REPACK=1 disagree"):
        lb.requested_buffers()
    monkeypatch.delenv("SPECDECODE_LLAMA_BUFFERS")
    monkeypatch.setenv("SPECDECODE_LLAMA_REPACK", "yes")
    with pytest.raises(SpecDecodeError, match=r"SPECDECODE_LLAMA_REPACK='yes' is not a choice: expected 0 \(none\) or 1"):
        lb.requested_buffers()
    monkeypatch.delenv("SPECDECODE_LLAMA_REPACK")
    monkeypatch.setenv("SPECDECODE_LLAMA_BUFFERS", "tiles")
    with pytest.raises(SpecDecodeError, match=r"SPECDECODE_LLAMA_BUFFERS='tiles' is not a choice: expected amx, repack, none"):
        lb.requested_buffers()


def test_amx_beats_repack_by_the_geometric_mean_of_the_ratios():
    assert AmxProbe(True, "", {1: 1.0, 4: 1.0}, {1: 0.9, 4: 1.2}).amx_beats_repack()  # 0.9 * 1.2 > 1
    assert not AmxProbe(True, "", {1: 1.0, 4: 1.0}, {1: 0.8, 4: 1.2}).amx_beats_repack()  # 0.96 < 1
    assert not AmxProbe(False, "killed by SIGSEGV", FAST, SLOW).amx_beats_repack()
    assert not AmxProbe(True, "", {}, SLOW).amx_beats_repack()
    assert AmxProbe(True, "", {1: 1e-200}, {1: 1e200}).amx_beats_repack()  # no underflow to log(0)
    probe = AmxProbe(True, "", FAST, SLOW)
    assert AmxProbe.from_dict(json.loads(json.dumps(probe.to_dict()))) == probe


@pytest.fixture
def counting_probe(tmp_path):
    """(a model file, a probe that always finds AMX faster, the thread counts it was called with)."""
    model = tmp_path / "m.gguf"
    model.write_bytes(b"GGUF")
    calls = []

    def probe(path, threads):
        calls.append(threads)
        return AmxProbe(True, "", FAST, SLOW)

    return model, probe, calls


@pytest.mark.parametrize("text", [
    '{"survived": true, "detail": "", "amx": [], "repack": {}}', '{"survived": true, "amx": null, "repack": {}}',
    '{"survived": "false", "amx": {"1": 1.0}, "repack": {}}', '{"survived": 1, "amx": {"1": 1.0}, "repack": {}}',
    '{"survived": true, "amx": {"1": -1.0}, "repack": {}}', '{"survived": true, "amx": {"1": "x"}, "repack": {}}',
    '{"survived": true, "amx": {"x": 1.0}, "repack": {}}', '[]', '"string"', '{not json', '\xff\xfe',
    '{"survived": true, "amx": {"1": 1' + '0' * 400 + '}, "repack": {}}', '[' * 100_000,  # beyond float; too deep
])
def test_a_hand_edited_probe_file_is_probed_again_and_replaced(tmp_path, counting_probe, text):
    model, probe, calls = counting_probe
    lb.cached_probe(model, 2, tmp_path, probe)
    (file,) = (tmp_path / "costs").glob("buffers-*.json")
    file.write_bytes(text.encode("latin-1"))
    assert lb.cached_probe(model, 2, tmp_path, probe) == AmxProbe(True, "", FAST, SLOW) and calls == [2, 2]
    assert AmxProbe.from_dict(json.loads(file.read_text())) == AmxProbe(True, "", FAST, SLOW)


def test_only_a_definitive_outcome_is_cached(tmp_path):
    """A child killed from outside, timed out or unable to load says nothing about AMX: the next
    start tries again. A crash signal is the kernels' own answer: kept."""
    model = tmp_path / "m.gguf"
    model.write_bytes(b"GGUF")
    for outcome, kept in ((AmxProbe(False, "killed by SIGKILL", definitive=False), False),
                          (AmxProbe(False, "killed by SIGSEGV"), True)):
        folder = tmp_path / str(kept)
        lb.cached_probe(model, 2, folder, lambda p, t: outcome)
        assert bool(list((folder / "costs").glob("buffers-*.json"))) is kept


# --- the probe, against fake children -----------------------------------------------------------

def _child(tmp_path, body: str) -> list[str]:
    """A fake probe child: a Python script given (model, buffers, threads) like the real one."""
    script = tmp_path / "child.py"
    script.write_text("import json, os, signal, sys, time\nmodel, buffers, threads = sys.argv[1:]\n"
                      + textwrap.dedent(body))
    return [sys.executable, str(script)]


def test_a_child_killed_by_sigsegv_means_amx_is_not_used(tmp_path):
    cmd = _child(tmp_path, """
        if buffers == "amx":
            os.kill(os.getpid(), signal.SIGSEGV)
        print(json.dumps({"survived": True, "seconds": {"1": 0.1}}))
    """)
    probe = lb.probe_amx("model.gguf", 2, command=cmd)
    assert probe == AmxProbe(False, "killed by SIGSEGV", {}, {}) and probe.definitive
    assert choose_buffers(True, True, None, probe) == "repack"
    cmd = _child(tmp_path, "os.kill(os.getpid(), signal.SIGKILL)\n")  # killed from outside (an OOM kill)
    probe = lb.probe_amx("model.gguf", 2, command=cmd)
    assert probe == AmxProbe(False, "killed by SIGKILL") and not probe.definitive


def test_a_child_that_crashes_after_the_two_token_forward_still_counts_as_a_crash(tmp_path):
    cmd = _child(tmp_path, """
        print(json.dumps({"survived": True}), flush=True)
        os.kill(os.getpid(), signal.SIGSEGV)
    """)
    assert lb.probe_amx("model.gguf", 2, command=cmd).survived is False


def test_surviving_children_compare_their_curves(tmp_path):
    for amx, repack, expected in ((FAST, SLOW, "amx"), (SLOW, FAST, "repack")):
        table = json.dumps({"amx": {str(n): s for n, s in amx.items()}, "repack": {str(n): s for n, s in repack.items()}})
        cmd = _child(tmp_path, f"""
            print(json.dumps({{"survived": True}}), flush=True)
            held = {{"amx": {{"CPU_Mapped": 900.0, "AMX": 600.0}}, "repack": {{"CPU_Mapped": 900.0, "CPU_REPACK": 600.0}}}}
            print(json.dumps({{"survived": True, "seconds": {table}[buffers], "weights": held[buffers]}}))
        """)
        probe = lb.probe_amx("model.gguf", 2, command=cmd)
        assert probe == AmxProbe(True, "", amx, repack)
        assert choose_buffers(True, True, None, probe) == expected


def test_an_amx_child_with_no_weights_in_the_amx_buffer_does_not_count(tmp_path):
    """A build with AMX kernels on a CPU without AMX: llama.cpp has no AMX buffer there and the
    "amx" child ran CPU_REPACK; its timing must not label that choice "amx"."""
    cmd = _child(tmp_path, """
        print(json.dumps({"survived": True, "seconds": {"1": 0.01}, "weights": {"CPU_Mapped": 900.0, "CPU_REPACK": 600.0}}))
    """)
    probe = lb.probe_amx("model.gguf", 2, command=cmd)
    assert not probe.survived and "no weights in its AMX buffer" in probe.detail and probe.definitive
    assert choose_buffers(True, True, None, probe) == "repack"


def test_a_child_printing_nonsense_times_does_not_survive(tmp_path):
    cmd = _child(tmp_path, """
        print(json.dumps({"survived": True, "seconds": {"1": "x"}, "weights": {"AMX": 1.0}}))
    """)
    assert lb.probe_amx("model.gguf", 2, command=cmd) == AmxProbe(False, "the child printed no result")


def test_a_child_that_fails_or_hangs_says_why(tmp_path):
    cmd = _child(tmp_path, """
        sys.stderr.write("llama_probe: the model would not load\\n")
        sys.exit(2)
    """)
    assert lb.probe_amx("model.gguf", 2, command=cmd) == AmxProbe(False, "llama_probe: the model would not load")
    cmd = _child(tmp_path, "time.sleep(60)\n")
    assert lb.probe_amx("model.gguf", 2, command=cmd, timeout_s=1) == AmxProbe(False, "timed out after 1 s")


def test_the_probe_is_cached_per_build_machine_threads_and_model(tmp_path, counting_probe):
    model, probe, calls = counting_probe
    assert lb.cached_probe(model, 2, tmp_path, probe) == AmxProbe(True, "", FAST, SLOW)
    assert lb.cached_probe(model, 2, tmp_path, probe) == AmxProbe(True, "", FAST, SLOW)
    assert calls == [2]
    lb.cached_probe(model, 1, tmp_path, probe)
    assert calls == [2, 1]
    assert len(list((tmp_path / "costs").glob("buffers-*.json"))) == 2


def test_the_real_child_reports_a_forward_and_its_curve(tmp_path):
    """The probe child itself, on a build without AMX: CPU_REPACK survives and is timed; AMX is
    refused by the child with the request's error (exit 2), which counts as not surviving."""
    path = registry.resolve(registry.DEFAULT_DRAFT, progress=False)
    out = lb._run_child([sys.executable, "-m", "specdecode.backends.llama_cpp.probe", str(path), "repack", "1"], 300)
    result, why = out
    assert why == "" and result["survived"] is True
    assert sorted(int(n) for n in result["seconds"]) == list(lb.PROBE_NS)
    assert all(s > 0 for s in result["seconds"].values())
    assert result["weights"].get("CPU_REPACK", 0) > 0
    if not lb.amx_compiled():
        result, why = lb._run_child([sys.executable, "-m", "specdecode.backends.llama_cpp.probe", str(path), "amx", "1"], 300)
        assert "has no AMX kernels" in why
    for args, why in (([str(path), "", "1"], "BUFFERS '' is not a choice"), ([str(path), "none", "0"], "THREADS '0'"),
                      ([str(tmp_path / "missing.gguf"), "none", "1"], "missing.gguf does not exist")):
        result, said = lb._run_child([sys.executable, "-m", "specdecode.backends.llama_cpp.probe", *args], 60)
        assert result is None and why in said


# --- placing weights in CPU_REPACK by name -----------------------------------------------------

def test_overrides_name_the_supported_matmul_weights_by_kind():
    Q4K, Q6K, F32 = 12, 14, 0
    tensors = [("token_embd.weight", Q4K, (64, 100, 1, 1)), ("output_norm.weight", F32, (64, 1, 1, 1)),
               ("output.weight", Q4K, (64, 100, 1, 1))]
    for layer in range(3):
        tensors += [(f"blk.{layer}.attn_q.weight", Q4K, (64, 64, 1, 1)),
                    (f"blk.{layer}.ffn_down.weight", Q6K if layer == 1 else Q4K, (128, 64, 1, 1)),
                    (f"blk.{layer}.attn_norm.weight", F32, (64, 1, 1, 1)),
                    (f"blk.{layer}.ffn_up_exps.weight", Q4K, (64, 128, 4, 1))]
    asked = []

    def supports(t, ne0, ne1):
        asked.append((t, ne0, ne1))
        return t == Q4K

    patterns = lb.repack_overrides(tensors, supports)
    assert patterns == [r"^output\.weight$", r"^blk\.(0|1|2)\.attn_q\.weight$", r"^blk\.(0|2)\.ffn_down\.weight$"]
    assert sorted(asked) == sorted({(Q4K, 64, 100), (Q4K, 64, 64), (Q4K, 128, 64), (Q6K, 128, 64)})


def test_a_corrupt_file_gives_one_clear_error(tmp_path):
    bad = tmp_path / "broken.gguf"
    bad.write_bytes(b"GGUF" + b"\x00" * 100)
    with pytest.raises(ModelFileError, match="broken.gguf"):
        lb.gguf_tensors(bad)
    # a header intact, its tensors' data cut off
    half = tmp_path / "half.gguf"
    with open(registry.resolve(registry.DEFAULT_DRAFT, progress=False), "rb") as f:
        half.write_bytes(f.read(50_000_000))
    with pytest.raises(ModelFileError, match=r"half.gguf: the file is truncated .*the file has 50000000\)"):
        lb.gguf_tensors(half)


def test_weights_placed_in_cpu_repack_by_name_equal_llama_cpps_own_placement(monkeypatch):
    """On an AMX build the weights go to CPU_REPACK one by one (extra buffer types off, so AMX
    is skipped). Run here as if AMX were compiled in: the same weights land in CPU_REPACK as
    llama.cpp's own choice puts there (the same MiB), and the logits are bitwise the same; plain
    memory ("none") holds no CPU_REPACK buffer. (On a real AMX build llama.cpp's own choice
    would be its AMX buffer, which may crash: there the placement by name is checked alone.)"""
    from specdecode.backends.llama_cpp import LlamaCppBackend

    path = registry.resolve(registry.DEFAULT_DRAFT, progress=False)
    ids = list(range(200, 212))

    def load(requested: str | None, amx: bool):
        monkeypatch.setattr(lb, "amx_compiled", lambda: amx)
        if requested:
            monkeypatch.setenv("SPECDECODE_LLAMA_BUFFERS", requested)
        else:
            monkeypatch.delenv("SPECDECODE_LLAMA_BUFFERS", raising=False)
        monkeypatch.delenv("SPECDECODE_LLAMA_REPACK", raising=False)
        b = LlamaCppBackend(path, n_ctx=256, n_threads=1)
        try:
            return b.buffers, b.weight_buffers, b.cost_key, np.asarray(b.forward(ids, list(range(len(ids)))))
        finally:
            b.close()

    real_amx = lb.amx_compiled()  # on a real AMX build llama.cpp's own choice is its AMX buffer (#20824)
    by_name = load("repack", amx=True)
    plain = load("none", amx=False)
    assert by_name[0] == "repack" and plain[0] == "none" and by_name[2] != plain[2]  # the cost key names the buffers
    assert by_name[1].get("CPU_REPACK", 0) > 0 and "AMX" not in by_name[1] and "CPU_REPACK" not in plain[1]
    assert np.isfinite(by_name[3]).all()
    if not real_amx:
        own = load(None, amx=False)
        assert own[0] == "repack" and by_name[1]["CPU_REPACK"] == own[1]["CPU_REPACK"]
        assert np.array_equal(own[3], by_name[3]) and own[2] == by_name[2]



def test_the_default_targets_greedy_text_with_the_chosen_buffers_equals_plain_memorys(monkeypatch):
    """The default target's plain greedy decoding with the buffers this machine chooses (CPU_REPACK
    here; on an AMX build CPU_REPACK by name or AMX, whichever the trial chose, never none) gives
    the text it gives with the weights in plain memory: exactly, or differing first at a near-tie
    (the kernels round differently; parity_report names the gap)."""
    from specdecode.api import Decoder
    from specdecode.parity import parity_report

    monkeypatch.delenv("SPECDECODE_LLAMA_REPACK", raising=False)
    prompts = ["def fibonacci(n):\n", "Write one sentence about the sea."]
    runs = {}
    for requested in (None, "none"):
        if requested:
            monkeypatch.setenv("SPECDECODE_LLAMA_BUFFERS", requested)
        else:
            monkeypatch.delenv("SPECDECODE_LLAMA_BUFFERS", raising=False)
        dec = Decoder(target=registry.DEFAULT_TARGET, draft="none", n_ctx=512, progress=False)
        try:
            runs[requested] = (dec.target.buffers, [dec.generate(p, max_tokens=48, temperature=0, record_top2_gaps=True)
                                                    for p in prompts])
        finally:
            dec.close()
    chosen, with_chosen = runs[None]
    assert chosen != "none" and runs["none"][0] == "none"
    if lb.amx_compiled():
        assert chosen in ("repack", "amx")
    reports = [parity_report(a, b) for a, b in zip(with_chosen, runs["none"][1])]
    print("parity with the weights in plain memory:", reports)
    assert all(r["status"] in ("exact", "near-tie") for r in reports), reports
