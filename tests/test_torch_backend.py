"""PyTorch backend: tiny random Hugging Face models built here (fixed seeds, float32, CPU)."""

from __future__ import annotations

from dataclasses import replace

import os

import numpy as np
import pytest
from scipy import stats as sstats

import torch  # a test dependency (pip install -e '.[test]')
import transformers

from specdecode.assembly import registry
from specdecode.backends.torch import TorchBackend
from specdecode.backends.vocab import vocab_fingerprint
from specdecode.drafters import Draft, DrafterBase, ModelDrafter, NgramDrafter, NoDrafter
from specdecode.engine import SpeculativeEngine
from specdecode.parity import parity_report
from specdecode.sampling import Sampler, SamplingParams

from backend_conformance import check_forward_rollback_forward, check_logits_only_where_asked

# benchmarks/gpu_check.sh sets this to "cuda" to run the same parity tests on a GPU.
DEVICE = os.environ.get("SPECDECODE_TEST_DEVICE", "cpu")

CORPUS = [
    "def add(a, b):\n    return a + b\n",
    "The quick brown fox jumps over the lazy dog.",
    "Speculative decoding drafts tokens and verifies them in one pass.",
    "中文文本也可以被分词。",
] * 20


@pytest.fixture(scope="module")
def tokenizer():
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=320, special_tokens=["<|endoftext|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(CORPUS, trainer)
    return transformers.PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|endoftext|>")


def tiny(kind: str, vocab: int, seed: int):
    torch.manual_seed(seed)
    common = dict(vocab_size=vocab, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512, eos_token_id=0)
    if kind == "llama":
        model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**common))
    else:
        model = transformers.Qwen2ForCausalLM(transformers.Qwen2Config(**common))
    # Random init gives nearly flat logits; scale the head so that argmaxes are clear
    # and distributions are peaked enough to be interesting.
    with torch.no_grad():
        model.lm_head.weight.mul_(8.0)
    return model.float().to(DEVICE).eval()


@pytest.fixture(scope="module")
def models_(tokenizer):
    import copy

    v = len(tokenizer)
    target = tiny("llama", v, 0)
    # A draft close to the target (overlapping support, different probabilities), as a
    # real draft model is: the target with noise on its output head.
    near = copy.deepcopy(target)
    torch.manual_seed(3)
    with torch.no_grad():
        near.lm_head.weight.add_(torch.randn_like(near.lm_head.weight) * near.lm_head.weight.std() * 0.7)
    return {"llama": target, "qwen2": tiny("qwen2", v, 1), "llama_near": near}


def backend(model, tokenizer, name):
    return TorchBackend(model, tokenizer, n_ctx=256, name=name)


def prompt_ids(tokenizer):
    return tokenizer("def add(a, b):")["input_ids"]


@pytest.mark.parametrize("kind", ["llama", "qwen2"])
def test_conformance(models_, tokenizer, kind):
    b = backend(models_[kind], tokenizer, kind)
    ids = tokenizer("The quick brown fox jumps over the lazy dog.")["input_ids"]
    check_forward_rollback_forward(b, ids, atol=1e-4)
    check_logits_only_where_asked(b, ids)


def test_rollback_moves_only_the_length(models_, tokenizer):
    b = backend(models_["llama"], tokenizer, "llama")
    b.forward(list(range(3, 20)), logits_for=[])
    layer = b._cache.layers[0]
    ptr = layer.keys.data_ptr()
    b.rollback(5)
    assert b.kv_len == 5 and layer.keys.data_ptr() == ptr  # no reallocation, no copy


def test_text_roundtrip(models_, tokenizer):
    b = backend(models_["llama"], tokenizer, "llama")
    text = "Speculative 中文 fox"
    ids = b.tokenize(text, add_special=False)
    assert b"".join(b.token_bytes(t) for t in ids).decode() == text
    assert 0 in b.eog_ids


def plain(target, ids, **kw):
    return SpeculativeEngine(target, NoDrafter(), 0).generate(ids, record_top2_gaps=True, **kw)


@pytest.mark.parametrize("k", [1, 2, 4, 8])
@pytest.mark.parametrize("draft", ["self", "other", "ngram"])
def test_greedy_parity(models_, tokenizer, draft, k):
    target = backend(models_["llama"], tokenizer, "target")
    if draft == "self":
        drafter = ModelDrafter(backend(models_["llama"], tokenizer, "self-draft"), target=target)
    elif draft == "other":
        drafter = ModelDrafter(backend(models_["qwen2"], tokenizer, "qwen2-draft"), target=target)
    else:
        drafter = NgramDrafter()
    ids = prompt_ids(tokenizer)
    spec = SpeculativeEngine(target, drafter, k).generate(ids, max_tokens=40)
    base = plain(target, ids, max_tokens=40)
    report = parity_report(spec, base)
    # float32 on the CPU: batched and one-token logits agree to ~1e-6, so exact parity.
    assert report["status"] == "exact", report
    if draft == "self":
        assert spec.stats.acceptance_rate == 1.0
        assert spec.stats.target_forward_passes <= -(-40 // (k + 1)) + 1


class MislabelledDrafter(DrafterBase):
    """A wrong rule: samples drafts from the draft model's distribution q but reports a
    sharpened q**2 (renormalised) as the distribution they were drawn from. (Reporting
    one-hot would not do: accept-with-p(x)-else-resample-without-x is exact for any x.)"""

    name = "mislabelled"

    def __init__(self, inner: ModelDrafter):
        self.inner = inner

    def start(self, prompt_ids, sampler):
        self.inner.start(prompt_ids, sampler)

    def propose(self, context, k):
        d = self.inner.propose(context, k)
        sharp = d.probs ** 2
        return Draft(d.token_ids, sharp / sharp.sum(axis=1, keepdims=True))

    def observe(self, outcome):
        pass

    def finish(self, committed):
        self.inner.finish(committed)


def two_token_distribution(target, ids, params):
    """Exact P(t1, t2) under the target's shaped distribution (top-k keeps it small)."""
    s = Sampler(params)
    target.rollback(0)
    row = target.forward(ids, logits_for=[len(ids) - 1])[0]
    p1 = s.probs(row, ids)
    out = {}
    for t1 in np.flatnonzero(p1):
        target.rollback(len(ids))
        row2 = target.forward([int(t1)], logits_for=[0])[0]
        p2 = s.probs(row2, list(ids) + [int(t1)])
        for t2 in np.flatnonzero(p2):
            out[(int(t1), int(t2))] = p1[t1] * p2[t2]
    target.rollback(0)
    return out


def chi_square_p(samples, expected, n):
    keys = sorted(expected, key=lambda k: -expected[k])
    obs, exp = [], []
    other_o = other_e = 0.0
    for key in keys:
        e = expected[key] * n
        if e >= 5:
            obs.append(samples.get(key, 0))
            exp.append(e)
        else:
            other_o += samples.get(key, 0)
            other_e += e
    unexpected = sum(v for k, v in samples.items() if k not in expected)
    obs.append(other_o + unexpected)
    exp.append(max(other_e, 1e-9))
    return sstats.chisquare(obs, np.array(exp) * (sum(obs) / sum(exp))).pvalue


def sample_pairs(engine, ids, params, n, drafter=None):
    counts: dict = {}
    for i in range(n):
        p = replace(params, seed=1000 + i)
        r = engine.generate(ids, sampling=p, max_tokens=2, drafter=drafter)
        assert len(r.token_ids) == 2  # eos has zero mass under this top-k at these positions
        key = tuple(r.token_ids)
        counts[key] = counts.get(key, 0) + 1
    return counts


def draft_rate(eng, ids, params):
    r = eng.generate(ids, sampling=replace(params, seed=5), max_tokens=60)
    return r.stats.acceptance_rate


def test_sampling_distribution_matches_the_target(models_, tokenizer):
    """Two-token continuations under speculation follow the target's shaped distribution;
    the same harness rejects a wrong acceptance rule."""
    target = backend(models_["llama"], tokenizer, "target")
    ids = prompt_ids(tokenizer)
    params = SamplingParams(temperature=1.0, top_k=4)
    expected = two_token_distribution(target, ids, params)
    assert 0 not in {t for pair in expected for t in pair}, "eos in the support would cut samples short"
    assert abs(sum(expected.values()) - 1.0) < 1e-6
    draft = ModelDrafter(backend(models_["llama_near"], tokenizer, "draft"), target=target)
    eng = SpeculativeEngine(target, draft, 2)
    n = 3000
    for rule in ("gumbel", "rejection"):
        good = sample_pairs(eng, ids, replace(params, sampling_rule=rule), n)
        p_good = chi_square_p(good, expected, n)
        assert p_good > 1e-3, (rule, p_good)
    # Mislabelled draft probabilities fool the rejection rule, which reads them (the "gumbel"
    # rule does not: the target's token there is a function of its own distribution).
    bad = sample_pairs(eng, ids, replace(params, sampling_rule="rejection"), n, drafter=MislabelledDrafter(draft))
    p_bad = chi_square_p(bad, expected, n)
    assert p_bad < 1e-6, p_bad
    # Drafts are often, not always, accepted (under the rejection rule; the "gumbel" rule's
    # coupling of the draft model's draws accepts fewer here).
    assert 0.2 < draft_rate(eng, ids, replace(params, sampling_rule="rejection")) < 0.95


def test_cross_backend_llama_cpp_draft_for_torch_target(smollm_path, smollm_draft):
    """smollm2: the GGUF dequantized by transformers as target on torch, the same GGUF on
    llama.cpp as draft. Same vocabulary, so the check passes; greedy output equals plain
    torch decoding."""
    target = TorchBackend.load(smollm_path, dtype="float32", device="cpu", n_ctx=1024, name="smollm2 (torch)")
    drafter = ModelDrafter(smollm_draft, target=target)  # vocabulary check across backends
    # The tokenizer fingerprint (what --draft auto decides by) is the same on both backends.
    assert vocab_fingerprint(target) == vocab_fingerprint(smollm_draft) == \
        registry.get_spec("smollm2-135m-instruct").vocab_fingerprint
    text = target.apply_chat_template([{"role": "user", "content": "List three fruits."}])
    ids = target.tokenize(text, add_special=False, parse_special=True)
    assert ids == smollm_draft.tokenize(text, add_special=False, parse_special=True)
    spec = SpeculativeEngine(target, drafter, 4).generate(ids, max_tokens=40)
    base = plain(target, ids, max_tokens=40)
    report = parity_report(spec, base)
    assert report["status"] in ("exact", "near-tie"), report
    # The quantized draft agrees with its dequantized target most of the time.
    assert spec.stats.acceptance_rate > 0.5, spec.stats.to_dict()


def test_output_subset_logits(models_, tokenizer):
    """With an output subset, the kept ids carry the full head's logits and the rest -inf;
    None restores the full vocabulary."""
    b = backend(models_["llama"], tokenizer, "llama")
    ids = tokenizer("The quick brown fox")["input_ids"]
    full = b.forward(ids, logits_for=list(range(len(ids))))
    keep = [0, 3, 17, 100, len(tokenizer) - 1]
    b.rollback(0)
    b.set_output_subset(keep)
    sub = b.forward(ids, logits_for=[1, len(ids) - 1])
    assert sub.shape == (2, b.n_vocab)
    np.testing.assert_allclose(sub[:, keep], full[[1, len(ids) - 1]][:, keep], atol=1e-4)
    rest = np.setdiff1d(np.arange(b.n_vocab), keep)
    assert np.all(np.isneginf(sub[:, rest]))
    b.set_output_subset(None)
    b.rollback(0)
    np.testing.assert_allclose(b.forward(ids, logits_for=[2])[0], full[2], atol=1e-4)
    from specdecode.errors import SpecDecodeError

    with pytest.raises(SpecDecodeError, match="0..319"):
        b.set_output_subset([len(tokenizer)])
    with pytest.raises(SpecDecodeError, match="out of range"):
        ModelDrafter(b, vocab_subset=-1)


@pytest.mark.parametrize("k", [2, 8])
def test_greedy_parity_with_a_draft_vocabulary_subset(models_, tokenizer, k):
    target = backend(models_["llama"], tokenizer, "target")
    draft_backend = backend(models_["llama"], tokenizer, "self-draft")
    drafter = ModelDrafter(draft_backend, target=target, vocab_subset=120)
    ids = prompt_ids(tokenizer)
    spec = SpeculativeEngine(target, drafter, k).generate(ids, max_tokens=40)
    base = plain(target, ids, max_tokens=40)
    assert parity_report(spec, base)["status"] == "exact"
    allowed = set(range(120)) | set(ids) | set(target.eog_ids)
    outside = [t for t in base.token_ids if t not in allowed]
    # The same model drafting for itself: its restricted argmax is the target's whenever the
    # target's token is inside the subset, so a step's first draft fails only where the
    # target's token lies outside it.
    st = spec.stats
    assert outside and st.accepted < st.drafted
    assert 0 < st.drafted_per_position[0] - st.accepted_per_position[0] <= len(outside)


def test_sampling_with_a_draft_vocabulary_subset_matches_the_target(models_, tokenizer):
    """A draft restricted to half the vocabulary (ids < 160 and the prompt's) samples from
    that restricted distribution; speculative sampling stays exact, and the
    mis-stated-probability control is still caught."""
    target = backend(models_["llama"], tokenizer, "target")
    ids = prompt_ids(tokenizer)
    params = SamplingParams(temperature=1.0, top_k=4)
    expected = two_token_distribution(target, ids, params)
    draft = ModelDrafter(backend(models_["llama_near"], tokenizer, "draft"), target=target, vocab_subset=160)
    eng = SpeculativeEngine(target, draft, 2)
    n = 3000
    p_good = chi_square_p(sample_pairs(eng, ids, params, n), expected, n)
    assert p_good > 1e-3, p_good
    rejection = replace(params, sampling_rule="rejection")  # the rule that reads the draft's probabilities
    p_bad = chi_square_p(sample_pairs(eng, ids, rejection, n, drafter=MislabelledDrafter(draft)), expected, n)
    assert p_bad < 1e-6, p_bad
    assert draft_rate(eng, ids, rejection) > 0.1
    # The restriction bites: the full draft puts mass outside the subset, the restricted none.
    full = ModelDrafter(backend(models_["llama_near"], tokenizer, "full"), target=target)
    outside = np.setdiff1d(np.arange(160, target.n_vocab), ids)
    for d, mass in ((full, lambda m: m > 0.05), (draft, lambda m: m == 0.0)):
        d.start(ids, Sampler(SamplingParams(temperature=1.0, top_k=4, seed=1)))
        q = d.propose(ids, 2).probs
        assert mass(q[:, outside].sum(axis=1).max()), q[:, outside].sum(axis=1)


def host_greedy(b, tokens, k):
    """k greedy tokens by forward + argmax on the host, the last one not fed."""
    row = b.forward(tokens, logits_for=[len(tokens) - 1])[0]
    out = [int(np.argmax(row))]
    for _ in range(k - 1):
        out.append(int(np.argmax(b.forward([out[-1]], logits_for=[0])[0])))
    return out


@pytest.mark.parametrize("subset", [None, 150])
def test_greedy_draft_on_the_device_equals_the_host_loop(models_, tokenizer, subset):
    """greedy_draft (argmax on the device, one transfer) gives the tokens and cache length
    of forward + host argmax per token, with and without an output subset, also after a
    rollback."""
    from specdecode.errors import ContextOverflowError

    ids = prompt_ids(tokenizer)
    a = backend(models_["qwen2"], tokenizer, "device")
    b = backend(models_["qwen2"], tokenizer, "host")
    if subset:
        for x in (a, b):
            x.set_output_subset(list(range(subset)) + ids)
    got = a.greedy_draft(ids, 6)
    assert got == host_greedy(b, ids, 6) and a.kv_len == b.kv_len == len(ids) + 5
    if subset:
        assert all(t < subset or t in ids for t in got)
    a.rollback(len(ids) + 2)  # continue after a partial rejection, as the drafter does
    b.rollback(len(ids) + 2)
    assert a.greedy_draft([got[2], got[3]], 3) == host_greedy(b, [got[2], got[3]], 3)
    assert a.kv_len == b.kv_len
    with pytest.raises(ContextOverflowError):
        a.greedy_draft([1], a.n_ctx)


def test_cost_cache_key_tells_dtypes_apart(models_, tokenizer):
    import copy

    from specdecode.control.costcache import machine_key

    f32 = backend(models_["llama"], tokenizer, "m")
    bf16 = backend(copy.deepcopy(models_["llama"]).to(torch.bfloat16), tokenizer, "m")
    assert machine_key(f32) == machine_key(backend(models_["llama"], tokenizer, "m"))
    assert machine_key(f32) != machine_key(bf16)


def test_hidden_rows_are_asked_for_per_call(models_, tokenizer):
    """forward_batch_hidden gives forward's logits and, only for the sequences named, the
    final hidden states of the logit rows (from which the output projection gives them)."""
    from specdecode.backends.base import SeqForward

    b = backend(models_["llama"], tokenizer, "llama")
    ids = prompt_ids(tokenizer)
    rows = [len(ids) - 2, len(ids) - 1]
    plain = b.forward(ids, logits_for=rows)
    b.rollback(0)
    (logits,), hidden = b.forward_batch_hidden([SeqForward(0, ids, rows)], {0})
    assert np.allclose(logits, plain, atol=1e-4)
    assert hidden[0].positions == rows and tuple(hidden[0].hidden.shape) == (2, b.hidden_size)
    with torch.no_grad():
        again = b.model.get_output_embeddings()(hidden[0].hidden).float().numpy()
    assert np.allclose(again, logits, atol=1e-5)
    b.rollback(0)
    (logits,), hidden = b.forward_batch_hidden([SeqForward(0, ids, rows)], ())
    assert hidden == {} and np.allclose(logits, plain, atol=1e-4)


def test_a_seed_gives_plain_decodings_tokens_with_any_drafter_and_k(models_, tokenizer):
    """float32 on the CPU: batched and one-token logits agree to ~1e-6, so under the "gumbel"
    rule a seeded sampled generation is exactly plain decoding's, whatever drafts it."""
    target = backend(models_["llama"], tokenizer, "target")
    ids = prompt_ids(tokenizer)
    params = [SamplingParams(temperature=1.0, top_p=0.9, seed=seed) for seed in range(4)]
    base = [plain(target, ids, sampling=p, max_tokens=32).token_ids for p in params]
    assert len({tuple(b) for b in base}) == 4
    for k in (1, 4, 8):
        for drafter in (ModelDrafter(backend(models_["llama_near"], tokenizer, "draft"), target=target), NgramDrafter()):
            eng = SpeculativeEngine(target, drafter, k)
            assert [eng.generate(ids, sampling=p, max_tokens=32).token_ids for p in params] == base, (k, drafter.name)
