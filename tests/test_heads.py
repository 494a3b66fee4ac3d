"""Draft heads on the target's own hidden states (blockwise parallel decoding; Medusa-1
residual heads): training lifts held-out accuracy, greedy output equals plain decoding,
sampling with the heads' distributions keeps the target's, and bad heads files fail
cleanly."""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch

from specdecode.backends.base import HiddenRows
from specdecode.backends.residual_heads import residual_heads
from specdecode.backends.llama_cpp import LlamaCppBackend
from specdecode.backends.llama_cpp.heads import output_rows
from specdecode.backends.torch import TorchBackend
from specdecode.cli import main
from specdecode.control.controller import HiddenStateController, SpeculationController, Source
from specdecode.control.costmodel import CostCurve
from specdecode.drafters import HiddenStateDrafter, NgramDrafter, NoDrafter
from specdecode.drafters.heads import DraftHeads, HeadsDrafter, HeadsMismatchError, heads_meta
from specdecode.engine import SpeculativeEngine
from specdecode.errors import ModelFileError
from specdecode.heads.train import TrainConfig, train_heads
from specdecode.parity import parity_report
from specdecode.sampling import SamplingParams

from test_batching import BigramLM
from test_torch_backend import MislabelledDrafter, backend, chi_square_p, models_, tokenizer  # noqa: F401 (fixtures)


@pytest.fixture(scope="module")
def smollm_torch(smollm_path):
    b = TorchBackend.load(smollm_path, dtype="float32", device="cpu", n_ctx=1024, name="smollm2 (torch)")
    yield b
    b.close()


@pytest.fixture(scope="module")
def trained(smollm_torch):
    """Heads trained for about a minute on the standard library's source."""
    torch.set_num_threads(2)
    cfg = TrainConfig(heads=3, tokens=12_288, window=128, vocab_subset=4096, epochs=3, batch=128, lr=3e-3, seed=0)
    return train_heads(smollm_torch, cfg, progress=False, log=lambda _: None)


def test_training_lifts_held_out_accuracy_far_above_untrained_heads(trained):
    heads, report = trained
    before, after = report["held_out_accuracy_untrained"], report["held_out_accuracy"]
    # Untrained heads (W = 0) repeat the target's next-token guess: head 1 is right only where
    # the target would emit the same token twice (about 6% here). A minute of training
    # triples that (Medusa reports 0.5-0.6 for head 1 after hours on a GPU).
    assert after[0] > 2.5 * before[0] and after[0] > before[0] + 0.1, (before, after)
    assert all(a > b for a, b in zip(after, before)), (before, after)
    assert after[0] >= after[-1]  # the nearer token is the easier guess
    assert heads.num_heads == 3 and heads.meta["labels"].startswith("self-distillation")


def test_training_is_deterministic_for_a_seed(smollm_torch, trained):
    cfg = TrainConfig(heads=3, tokens=12_288, window=128, vocab_subset=4096, epochs=3, batch=128, lr=3e-3, seed=0)
    again, _ = train_heads(smollm_torch, cfg, progress=False, log=lambda _: None)
    assert np.array_equal(again.weight, trained[0].weight) and np.array_equal(again.vocab_subset,
                                                                                trained[0].vocab_subset)


def test_greedy_with_heads_equals_plain_decoding(smollm_torch, trained, tmp_path):
    path = tmp_path / "h.safetensors"
    trained[0].save(path)
    heads = DraftHeads.load(path)
    target = smollm_torch
    ids = target.tokenize("import os\nimport sys\n\n\ndef main(argv):\n    ", add_special=False)
    plain = SpeculativeEngine(target, NoDrafter(), 0).generate(ids, max_tokens=48, record_top2_gaps=True)
    spec = SpeculativeEngine(target, HeadsDrafter(heads, target, path), 3).generate(ids, max_tokens=48)
    report = parity_report(spec, plain)
    assert report["status"] in ("exact", "near-tie"), report
    assert spec.stats.drafted > 0 and spec.stats.accepted > 0
    assert spec.stats.target_forward_passes < plain.stats.target_forward_passes


class HiddenBigram(BigramLM):
    """The bigram fake with "hidden states": h at a position is (previous token, token), and
    its heads guess from h alone: head i's logits are the target's average next-token logits
    over what could come between (plus a per-head tilt), so they overlap the target's
    distribution without equalling it, as trained heads do."""

    supports_hidden_states = True
    hidden_size = 2
    known_sha256 = None

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.hidden_calls: list[set] = []  # hidden_for of each forward_batch_hidden

    def parameters(self):
        return [("table", torch.tensor(self.table))]

    def forward_batch_hidden(self, items, hidden_for):
        self.hidden_calls.append(set(hidden_for))
        starts = {seq: len(self.caches[seq]) for seq, _, _ in items}
        logits = self.forward_batch(items)
        rows = {}
        for seq, _, want in items:
            if seq in hidden_for:
                cache, pos = self.caches[seq], [starts[seq] + j for j in want]
                rows[seq] = HiddenRows(pos, np.array([[cache[p - 1] if p else 0, cache[p]] for p in pos]))
        return logits, rows

    def make_heads(self, weight, bias, vocab_subset):
        tilt = weight[:, 0, 0]  # [K]

        def run(h, k):
            x = int(h[1])
            rows = [self.table[x].mean(axis=0) * (1.0 + tilt[i]) for i in range(k)]  # [V] each
            return np.stack(rows).astype(np.float32)

        return run


def three_token_distribution(target, ids):
    """Exact P(output) of plain sampling (temperature 1) of up to 3 tokens from the bigram
    fake; the end token stops the output and is not part of it."""
    def probs(x, y):
        z = np.exp(target.table[x, y] - target.table[x, y].max())
        return z / z.sum()

    out: dict = {}

    def walk(ctx, emitted, p):
        if len(emitted) == 3:
            out[tuple(emitted)] = out.get(tuple(emitted), 0.0) + p
            return
        q = probs(ctx[-2], ctx[-1])
        out[tuple(emitted)] = out.get(tuple(emitted), 0.0) + p * q[target.eos]
        for t in range(1, target.n_vocab):
            walk(ctx + [t], emitted + [t], p * q[t])

    walk(list(ids), [], 1.0)
    return out


class MislabelledHeads(MislabelledDrafter, HiddenStateDrafter):
    """MislabelledDrafter over heads: it hands the hidden states on to them."""

    def observe(self, outcome):
        self.inner.observe(outcome)


def test_sampling_with_head_distributions_keeps_the_target_distribution():
    """Three-token continuations: step 1 drafts with the heads on the prefill's last hidden
    state (their shaped distributions as draft probabilities) and verifies by speculative
    sampling. A drafter that misreports the distribution fails the same test."""
    target = HiddenBigram(n_seq=1, sharp=2.0)
    ids = [3, 4, 5]
    # The heads' draft decides the second token (the third is the target's own, or a
    # resample): compare the first two, which hold the test's power.
    expected: dict = {}
    for key, p in three_token_distribution(target, ids).items():
        expected[key[:2]] = expected.get(key[:2], 0.0) + p
    assert abs(sum(expected.values()) - 1.0) < 1e-6
    V = target.n_vocab
    heads = DraftHeads(np.full((2, 2, 2), 0.3, np.float32), np.zeros((2, 2), np.float32), np.arange(V),
                       heads_meta(target, 2, {}))
    drafter = HeadsDrafter(heads, target)
    eng = SpeculativeEngine(target, drafter, 2)
    n = 4000

    def sample(d, rule="gumbel"):
        counts: dict = {}
        for i in range(n):
            eng.forget_prefix()  # a prefill each time: its last hidden state drafts the first step
            r = eng.generate(ids, sampling=SamplingParams(temperature=1.0, seed=500 + i, sampling_rule=rule),
                             max_tokens=3, drafter=d)
            counts[tuple(r.token_ids[:2])] = counts.get(tuple(r.token_ids[:2]), 0) + 1
        return counts

    for rule in ("gumbel", "rejection"):
        assert chi_square_p(sample(drafter, rule), expected, n) > 1e-3, rule
        r = eng.generate(ids, sampling=SamplingParams(temperature=1.0, seed=1, sampling_rule=rule), max_tokens=60)
        assert 0.1 * r.stats.drafted < r.stats.accepted < r.stats.drafted, rule  # often, not always
    # Misreported probabilities fool the rule that reads them (the rejection rule).
    assert chi_square_p(sample(MislabelledHeads(drafter), "rejection"), expected, n) < 1e-6


def test_heads_for_another_target_are_refused(models_, tokenizer, trained, smollm_torch):  # noqa: F811
    other = backend(models_["llama"], tokenizer, "tiny")
    with pytest.raises(HeadsMismatchError, match="was trained for target smollm2"):
        HeadsDrafter(trained[0], other)
    rng = np.random.default_rng(0)
    H = other.hidden_size
    tiny_heads = DraftHeads(rng.normal(size=(1, H, H)).astype(np.float32), np.zeros((1, H), np.float32),
                            np.arange(other.n_vocab), heads_meta(other, 1, {}))
    with pytest.raises(HeadsMismatchError):
        HeadsDrafter(tiny_heads, smollm_torch)


def test_heads_trained_on_torch_draft_for_the_same_gguf_on_llama_cpp(smollm, trained):
    """The heads file names the model file's SHA-256, so heads trained on the torch backend
    serve the same GGUF on llama.cpp (hidden states from llama.cpp's embeddings output of
    the same llama_decode; heads in numpy over the dequantized output rows)."""
    # A prompt longer than the 64 output rows of one call: with embeddings on, llama.cpp
    # outputs every token, so the prefill must run without them (it asserted before).
    text = "import os\nimport sys\n\n\ndef main(argv):\n    " + "x = os.path.join(sys.argv[0], 'a')\n    " * 12
    ids = smollm.tokenize(text, add_special=False)
    assert len(ids) > 64
    plain = SpeculativeEngine(smollm, NoDrafter(), 0).generate(ids, max_tokens=40, record_top2_gaps=True)
    drafter = HeadsDrafter(trained[0], smollm)
    eng = SpeculativeEngine(smollm, drafter, 3)
    spec = eng.generate(ids, max_tokens=40)
    assert parity_report(spec, plain)["status"] in ("exact", "near-tie")
    assert spec.stats.accepted > 0
    # The first step drafts from the prefill's last hidden state where llama.cpp can give
    # it (a prefill of at most 64 tokens), and drafts nothing after a longer one.
    for prompt, drafts in ((ids, False), (ids[:20], True)):
        eng.forget_prefix()
        gen = eng.begin(prompt, max_tokens=8)
        eng.step([gen])
        assert (gen.out.stats.drafted > 0) == drafts
        eng.end(gen)


def test_a_corrupt_heads_file_fails_cleanly(tmp_path, capsys, trained):
    bad = tmp_path / "bad.safetensors"
    bad.write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{not json at all")
    with pytest.raises(ModelFileError, match="corrupt or not a safetensors file"):
        DraftHeads.load(bad)
    # Truncated: a valid file cut short.
    good = tmp_path / "good.safetensors"
    trained[0].save(good)
    cut = tmp_path / "cut.safetensors"
    cut.write_bytes(good.read_bytes()[: good.stat().st_size // 2])
    with pytest.raises(ModelFileError):
        DraftHeads.load(cut)
    # Through the CLI: one line, a non-zero exit, no traceback.
    rc = main(["generate", "--target", "smollm2-135m-instruct", "--backend", "torch", "--draft", f"heads:{cut}",
               "--prompt", "x", "--max-tokens", "2", "--quiet"])
    err = capsys.readouterr().err
    assert rc != 0 and "Traceback" not in err and str(cut) in err


def test_heads_train_cli_checks_options_and_writes_nothing_on_failure(tmp_path, capsys):
    out = tmp_path / "h.safetensors"
    rc = main(["heads", "train", "--target", "smollm2-135m-instruct", "--out", str(out), "--heads", "0"])
    assert rc != 0 and "--heads 0 is out of range" in capsys.readouterr().err
    rc = main(["heads", "train", "--target", "smollm2-135m-instruct", "--out", str(out),
               "--corpus", str(tmp_path / "missing")])
    assert rc != 0 and "does not exist" in capsys.readouterr().err
    assert not out.exists() and list(tmp_path.iterdir()) == []


def test_bench_configs_name_heads_files():
    from specdecode.bench.suite import parse_config

    assert parse_config("heads:/tmp/h.safetensors") == ("heads:/tmp/h.safetensors", "auto")
    assert parse_config("heads:/tmp/h.safetensors:3") == ("heads:/tmp/h.safetensors", 3)
    assert parse_config("ngram:4") == ("ngram", 4)


def test_malformed_heads_files_are_refused(tmp_path, models_, tokenizer):  # noqa: F811
    target = backend(models_["llama"], tokenizer, "tiny")
    H, V = target.hidden_size, target.n_vocab
    meta = heads_meta(target, 1, {})
    w, b = np.zeros((1, H, H), np.float32), np.zeros((1, H), np.float32)
    cases = {"empty": (w, b, np.zeros(0, np.int64), "malformed"),
             "nan": (w * np.nan, b, np.arange(V), "non-finite"),
             "no heads": (w[:0], b[:0], np.arange(V), "malformed")}
    umask = os.umask(0)
    os.umask(umask)
    for name, (ww, bb, ss, msg) in cases.items():
        path = tmp_path / f"{name}.safetensors"
        DraftHeads(ww, bb, ss, meta).save(path)
        assert path.stat().st_mode & 0o777 == 0o666 & ~umask  # as a file written in place
        with pytest.raises(ModelFileError, match=msg):
            DraftHeads.load(path)
    path = tmp_path / "far.safetensors"
    DraftHeads(w, b, np.array([0, 10**9]), meta).save(path)
    with pytest.raises(HeadsMismatchError, match="outside the vocabulary"):
        HeadsDrafter(DraftHeads.load(path), target)
    with pytest.raises(ModelFileError, match="is a folder"):
        DraftHeads.load(tmp_path)
    with pytest.raises(ModelFileError, match="no heads file given"):
        DraftHeads.load("")


def test_corpus_prompts_are_seeded_code_tasks_and_instructions():
    from specdecode.heads.corpus import make_prompts

    a, b = make_prompts(40, seed=1), make_prompts(40, seed=1)
    assert a == b and a != make_prompts(40, seed=2)
    kinds = [k for k, _ in a]
    assert kinds.count("code") == 20 and kinds.count("chat") == 20
    for kind, messages in a:
        assert messages[-1]["role"] == "user" and messages[-1]["content"]
        if kind == "code":  # a whole function, dedented, inside a fenced block
            code = messages[-1]["content"].split("```python\n", 1)[1]
            assert code.startswith("def ") and code.rstrip().endswith("```")


def test_corpus_of_the_targets_own_answers(smollm, tmp_path):
    """The target's greedy answers, written with its chat template and end-of-turn token;
    the same answers as a lone greedy generation; heads train reads the folder."""
    from specdecode.engine import SpeculativeEngine
    from specdecode.heads.corpus import answer_all, end_of_turn_text, make_prompts, write_corpus

    prompts = make_prompts(4, seed=0)

    class Dec:  # the Decoder's begin/step/end over an engine of one slot
        target = smollm

        def __init__(self):
            self.engine = SpeculativeEngine(smollm, NoDrafter(), 0, n_slots=1)

        def begin(self, prompt_ids, max_tokens, temperature, seed):
            return self.engine.begin(prompt_ids, sampling=SamplingParams(temperature=temperature, seed=seed),
                                     max_tokens=max_tokens)

        def step(self, gens):
            return self.engine.step(gens)

        def end(self, g):
            return self.engine.end(g)

    counts = write_corpus(tmp_path / "corpus", answer_all(Dec(), prompts, max_tokens=12))
    assert sum(counts.values()) == 4 and sorted(p.name for p in (tmp_path / "corpus").iterdir()) == \
        sorted(f"{k}.txt" for k in counts)
    umask = os.umask(0)
    os.umask(umask)
    assert (tmp_path / "corpus").stat().st_mode & 0o777 == 0o777 & ~umask  # an ordinary folder, not mkdtemp's 0700
    text = "".join(p.read_text() for p in (tmp_path / "corpus").iterdir())
    for kind, messages in prompts:
        rendered = smollm.apply_chat_template(messages)
        assert rendered in text
        eng = SpeculativeEngine(smollm, NoDrafter(), 0)
        ids = smollm.tokenize(rendered, add_special=False, parse_special=True)
        alone = eng.generate(ids, sampling=SamplingParams(temperature=0.0), max_tokens=12)
        assert rendered + alone.text in text
    assert end_of_turn_text(smollm, rendered) in rendered


def test_corpus_is_written_whole_or_not_at_all(tmp_path, capsys):
    from specdecode.errors import SpecDecodeError
    from specdecode.heads.corpus import make_prompts, write_corpus

    def failing():
        yield "chat", "one"
        raise RuntimeError("the target failed mid-way")

    with pytest.raises(RuntimeError):
        write_corpus(tmp_path / "c", failing())
    assert list(tmp_path.iterdir()) == []
    (tmp_path / "taken").mkdir()
    (tmp_path / "taken" / "x.txt").write_text("keep")
    with pytest.raises(SpecDecodeError, match="not an empty folder"):
        write_corpus(tmp_path / "taken", iter([("chat", "two")]))
    assert (tmp_path / "taken" / "x.txt").read_text() == "keep"
    with pytest.raises(SpecDecodeError, match="--prompts 0"):
        make_prompts(0)
    rc = main(["heads", "corpus", "--target", "smollm2-135m-instruct", "--out", str(tmp_path / "taken")])
    assert rc != 0
    rc = main(["heads", "corpus", "--target", "smollm2-135m-instruct", "--out", str(tmp_path / "new"),
               "--temperature", "3"])
    assert rc != 0 and not (tmp_path / "new").exists()
    rc = main(["heads", "corpus", "--target", "smollm2-135m-instruct", "--out", str(tmp_path / "new"),
               "--parallel", "0"])
    assert rc != 0 and "--parallel 0 is out of range" in capsys.readouterr().err and not (tmp_path / "new").exists()


def test_hidden_states_are_asked_only_for_forwards_whose_drafter_reads_them():
    target = HiddenBigram(n_seq=2, sharp=2.0)
    V = target.n_vocab
    heads = DraftHeads(np.full((2, 2, 2), 0.3, np.float32), np.zeros((2, 2), np.float32), np.arange(V),
                       heads_meta(target, 2, {}))
    eng = SpeculativeEngine(target, HeadsDrafter(heads, target), 2)
    r = eng.generate([3, 4, 5], max_tokens=12)
    assert r.stats.drafted > 0 and target.hidden_calls and all(c == {0} for c in target.hidden_calls)
    n = len(target.hidden_calls)
    eng.generate([3, 4, 5], max_tokens=12, plain=True)  # the same target, plain: no hidden states
    assert len(target.hidden_calls) == n
    # A batch of a heads generation (slot 0) and a plain one (slot 1): only slot 0's rows.
    a = eng.begin([3, 4, 5], max_tokens=6, slot=0)
    b = eng.begin([6, 7, 8], max_tokens=6, slot=1, drafter=NoDrafter())
    while not (a.done or b.done):
        eng.step([a, b])
    assert target.hidden_calls[n:] and all(c == {0} for c in target.hidden_calls[n:])
    eng.end(a), eng.end(b)


def test_a_controller_over_heads_reads_hidden_states_and_hands_them_on():
    target = HiddenBigram(n_seq=2, sharp=4.0)
    V = target.n_vocab
    heads = HeadsDrafter(DraftHeads(np.zeros((3, 2, 2), np.float32), np.zeros((3, 2), np.float32), np.arange(V),
                                    heads_meta(target, 3, {})), target)
    curve = CostCurve((1, 2, 4), (0.035, 0.036, 0.037))
    lookups = SpeculationController([Source(NgramDrafter(), 1e-5)], curve)
    assert not isinstance(lookups, HiddenStateDrafter)
    ctl = SpeculationController([Source(NgramDrafter(), 1e-5), Source(heads, 1e-5)], curve)
    assert isinstance(ctl, HiddenStateController) and isinstance(ctl.fork(1), HiddenStateController)
    eng = SpeculativeEngine(target, ctl, 3)
    spec = eng.generate([3, 4, 5], max_tokens=40)
    plain = eng.generate([3, 4, 5], max_tokens=40, plain=True)
    assert spec.token_ids == plain.token_ids
    assert ctl.choices["heads"] > 0 and spec.stats.accepted > 0


def test_one_head_formula_on_both_backends_output_bias_included(tmp_path, models_, tokenizer):  # noqa: F811
    """The llama.cpp backend's numpy heads (over the GGUF's output rows and bias) and the
    torch backend's give the same logits on the same weights, and both are the formula."""
    import copy

    import gguf

    model = copy.deepcopy(models_["llama"])
    H, V = model.config.hidden_size, model.config.vocab_size
    rng = np.random.default_rng(0)
    with torch.no_grad():
        head = torch.nn.Linear(H, V, bias=True)
        head.weight.copy_(model.lm_head.weight)
        head.bias.copy_(torch.tensor(rng.normal(0, 2.0, V), dtype=torch.float32))
    model.lm_head = head
    tb = backend(model, tokenizer, "biased")
    path = tmp_path / "head.gguf"
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_tensor("output.weight", head.weight.detach().numpy())
    w.add_tensor("output.bias", head.bias.detach().numpy())
    w.write_header_to_file(), w.write_kv_data_to_file(), w.write_tensors_to_file()
    w.close()
    lb = object.__new__(LlamaCppBackend)  # make_heads reads only the file and the vocabulary size
    lb.path, lb._n_vocab = path, V

    K = 3
    weight = rng.normal(0, 0.2, (K, H, H)).astype(np.float32)
    bias = rng.normal(0, 0.2, (K, H)).astype(np.float32)
    subset = np.sort(rng.choice(V, 40, replace=False))
    h = rng.normal(0, 1.0, H).astype(np.float32)
    on_llama = lb.make_heads(weight, bias, subset)(h, K)
    on_torch = tb.make_heads(weight, bias, subset)(torch.tensor(h), K)
    w_out, b_out = head.weight.detach().numpy()[subset], head.bias.detach().numpy()[subset]
    expected = np.stack([w_out @ (h + (x := weight[k] @ h + bias[k]) / (1 + np.exp(-x))) + b_out for k in range(K)])
    outside = np.setdiff1d(np.arange(V), subset)
    for got in (on_llama, on_torch):
        assert np.allclose(got[:, subset], expected, rtol=1e-4, atol=1e-4)
        assert np.isneginf(got[:, outside]).all()
    assert not np.allclose(expected - b_out, expected, atol=1e-2)  # the bias matters here
    np_w, np_b = output_rows(path, subset)
    assert np.array_equal(np_w, w_out) and np.array_equal(np_b, b_out)
    batch = rng.normal(0, 1.0, (5, H)).astype(np.float32)  # training's shape: [B, H] -> [B, K, S]
    assert np.allclose(residual_heads(batch, weight, bias, w_out, b_out, np.einsum, lambda x: x / (1 + np.exp(-x))),
                       residual_heads(*map(torch.tensor, (batch, weight, bias, w_out, b_out)), torch.einsum,
                                      torch.nn.functional.silu).numpy(), rtol=1e-4, atol=1e-4)


def test_self_corpus_is_built_once_and_reused(tmp_path, monkeypatch):
    """heads train's default corpus: the target's own answers, enough conversations for the
    token budget, written once under the cache and then reused as it is."""
    from specdecode.heads import corpus

    monkeypatch.setattr(corpus, "SELF_MAX_TOKENS", 12)
    out, report = corpus.self_corpus("smollm2-135m-instruct", 2400, seed=1, n_threads=1, progress=False, parallel=2,
                                     root=tmp_path)
    assert out.parent == tmp_path and out.name == "smollm2-135m-instruct-8-seed1"
    assert sum(report["conversations"].values()) == 8 and report["answer_tokens"] > 0
    text = "".join(p.read_text() for p in out.iterdir())
    again, cached = corpus.self_corpus("smollm2-135m-instruct", 2400, seed=1, progress=False, root=tmp_path)
    assert again == out and cached is None
    assert "".join(p.read_text() for p in out.iterdir()) == text
