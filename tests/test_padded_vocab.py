"""Draft and target vocabularies that differ by padding (Qwen2.5 7B and up: 152,064 ids over
the 0.5B draft's 151,936): tiny GGUF pairs written here with gguf-py and run on llama.cpp,
a tiny torch pair for the device's greedy draft, and fakes for the drafter's masking."""

from __future__ import annotations

import dataclasses
from typing import Sequence

import numpy as np
import pytest

from specdecode.assembly import registry
from specdecode.backends.base import BackendBase
from specdecode.backends.llama_cpp import LlamaCppBackend
from specdecode.drafters import ModelDrafter, NoDrafter
from specdecode.engine import SpeculativeEngine
from specdecode.errors import IncompatibleVocabularyError
from specdecode.assembly.loading import default_draft_serves
from specdecode.sampling import Sampler, SamplingParams
from specdecode.backends.vocab import MAX_VOCAB_SIZE_DIFFERENCE, check_vocab_compatible, fingerprint_serves, vocab_fingerprint

from tiny_gguf import TinyWeights, base_vocab, padded, write_gguf

PAD = 128  # Qwen2.5's padding: 152,064 - 151,936
PROMPT = "the quick brown fox"


class RecordingDrafter(ModelDrafter):
    """A ModelDrafter that keeps every draft it proposes."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.drafts = []

    def propose(self, context, k):
        d = super().propose(context, k)
        self.drafts.append(d)
        return d


@pytest.fixture(scope="module")
def ggufs(tmp_path_factory):
    """Paths of tiny GGUFs: a 300-id target and its 428-id padded twin (same weights; the
    padding's output rows are zero), drafts close to them (noise on the head; the padded
    draft's padding rows are loud, so that it would propose padding ids if not masked),
    a padded model whose shared ids differ, and one padded beyond the bound."""
    d = tmp_path_factory.mktemp("gguf")
    v = base_vocab()
    n = v.n
    w = TinyWeights.random(n, seed=0)
    near = w.noisy_head(seed=2, scale=0.15)
    other = padded(v, PAD)
    other.tokens[270], other.tokens[275] = other.tokens[275], other.tokens[270]
    return {
        "n": n,
        "target": write_gguf(d / "target.gguf", v, w),
        "target_padded": write_gguf(d / "target_padded.gguf", padded(v, PAD), w.resized(n + PAD, seed=1)),
        "draft": write_gguf(d / "draft.gguf", v, near),
        "draft_padded": write_gguf(d / "draft_padded.gguf", padded(v, PAD), near.resized(n + PAD, 1, "loud")),
        "other_padded": write_gguf(d / "other_padded.gguf", other, w.resized(n + PAD, seed=1)),
        "far": write_gguf(d / "far.gguf", padded(v, MAX_VOCAB_SIZE_DIFFERENCE + 1),
                          w.resized(n + MAX_VOCAB_SIZE_DIFFERENCE + 1, seed=1)),
    }


@pytest.fixture(scope="module")
def load(ggufs):
    opened = {}

    def get(key: str) -> LlamaCppBackend:
        if key not in opened:
            opened[key] = LlamaCppBackend(ggufs[key], n_ctx=256, n_threads=1, name=key)
        return opened[key]

    yield get
    for b in opened.values():
        b.close()


# (draft, target): draft smaller than the target, and draft larger.
DIRECTIONS = [("draft", "target_padded"), ("draft_padded", "target")]


def test_the_pair_loads_both_ways_round(load, ggufs):
    n = ggufs["n"]
    for d, t in DIRECTIONS:
        draft, target = load(d), load(t)
        assert {draft.n_vocab, target.n_vocab} == {n, n + PAD}
        check_vocab_compatible(draft, target)
        assert ModelDrafter(draft, target=target).target_vocab == target.n_vocab
    # The files are what a converter writes: [PAD<id>] tokens that render no text.
    padded_target = load("target_padded")
    assert padded_target.token_text(n) == f"[PAD{n}]".encode() and padded_target.token_bytes(n) == b""


@pytest.mark.parametrize("d,t", DIRECTIONS)
def test_greedy_output_equals_plain_decoding(load, d, t):
    draft, target = load(d), load(t)
    drafter = RecordingDrafter(draft, target=target)
    engine = SpeculativeEngine(target, drafter, 4)
    prompt = target.tokenize(PROMPT, add_special=False)
    spec = engine.generate(prompt, max_tokens=40)
    plain = engine.generate(prompt, max_tokens=40, drafter=NoDrafter())
    assert spec.token_ids == plain.token_ids and len(plain.token_ids) > 5
    drafted = [t for dr in drafter.drafts for t in dr.token_ids]
    assert drafted and max(drafted) < target.n_vocab
    # The drafts are the draft model's own over the target's ids, often accepted (the loud
    # padding rows of the larger draft would win every argmax if they were not masked, and
    # the target never accepts a padding id).
    assert spec.stats.accepted > spec.stats.drafted / 4


@pytest.mark.parametrize("d,t", DIRECTIONS)
def test_sampled_draft_probs_are_over_the_target_vocabulary(load, d, t):
    draft, target = load(d), load(t)
    n_shared = min(draft.n_vocab, target.n_vocab)
    drafter = RecordingDrafter(draft, target=target)
    engine = SpeculativeEngine(target, drafter, 4)
    prompt = target.tokenize(PROMPT, add_special=False)
    result = engine.generate(prompt, max_tokens=40, sampling=SamplingParams(temperature=1.0, seed=5))
    assert result.stats.drafted > 0
    for dr in drafter.drafts:
        if not dr.token_ids:
            continue
        k = len(dr.token_ids)
        assert dr.probs.shape == (k, target.n_vocab)
        np.testing.assert_allclose(dr.probs.sum(axis=1), 1.0, rtol=1e-9)
        assert np.all(dr.probs[:, n_shared:] == 0.0)  # ids one side lacks: never drawn
        assert max(dr.token_ids) < target.n_vocab
        assert all(dr.probs[i, x] > 0 for i, x in enumerate(dr.token_ids))


def test_a_sampled_larger_draft_is_the_masked_distribution(load):
    """The larger draft's probs are its distribution restricted to the target's ids and
    renormalised: softmax over the first V logits."""
    draft, target = load("draft_padded"), load("target")
    drafter = ModelDrafter(draft, target=target)
    drafter.start([1], Sampler(SamplingParams(temperature=1.0, seed=0)))
    ctx = target.tokenize(PROMPT, add_special=False)
    got = drafter.propose(ctx, 1)
    draft.rollback(0)
    logits = draft.forward(ctx, logits_for=[len(ctx) - 1])[0].astype(np.float64)
    assert logits[target.n_vocab:].max() > logits[: target.n_vocab].max()  # padding would win unmasked
    z = np.exp(logits[: target.n_vocab] - logits[: target.n_vocab].max())
    np.testing.assert_allclose(got.probs[0], z / z.sum(), rtol=1e-5, atol=1e-9)
    drafter.finish([])


def test_a_padding_id_in_the_context_stops_a_smaller_draft(load):
    """A target may read (or emit) a padding id the draft model does not have: the draft
    then drafts nothing, and the output is still the target's."""
    draft, target = load("draft"), load("target_padded")
    drafter = RecordingDrafter(draft, target=target)
    engine = SpeculativeEngine(target, drafter, 4)
    prompt = target.tokenize(PROMPT, add_special=False) + [draft.n_vocab + 7]
    spec = engine.generate(prompt, max_tokens=12)
    plain = engine.generate(prompt, max_tokens=12, drafter=NoDrafter())
    assert spec.token_ids == plain.token_ids
    assert spec.stats.drafted == 0 and all(not dr.token_ids for dr in drafter.drafts)


def test_shared_ids_that_differ_are_refused(load, ggufs):
    n = ggufs["n"]
    for d, t in (("other_padded", "target"), ("draft", "other_padded")):
        with pytest.raises(IncompatibleVocabularyError) as e:
            ModelDrafter(load(d), target=load(t))
        msg = str(e.value)
        assert f"draft vocabulary {load(d).n_vocab} != target vocabulary {load(t).n_vocab}" in msg
        assert f"ids both have (0..{n - 1}) differ: id 270: draft" in msg and "id 275: draft" in msg


def test_sizes_beyond_the_bound_are_refused(load, ggufs):
    n = ggufs["n"]
    n_far = n + MAX_VOCAB_SIZE_DIFFERENCE + 1
    with pytest.raises(IncompatibleVocabularyError, match=f"draft vocabulary {n_far} != target vocabulary {n} "):
        ModelDrafter(load("far"), target=load("target"))
    with pytest.raises(IncompatibleVocabularyError, match=f"draft vocabulary {n} != target vocabulary {n_far} "):
        ModelDrafter(load("draft"), target=load("far"))


def test_auto_recognises_the_padded_target(load, monkeypatch):
    fp = vocab_fingerprint(load("draft"))
    assert vocab_fingerprint(load("target")) == fp != vocab_fingerprint(load("target_padded"))
    assert fingerprint_serves(load("target_padded"), fp)
    assert not fingerprint_serves(load("other_padded"), fp) and not fingerprint_serves(load("far"), fp)
    spec = registry.get_spec(registry.DEFAULT_DRAFT)
    monkeypatch.setitem(registry.REGISTRY, spec.name, dataclasses.replace(spec, vocab_fingerprint=fp))
    assert default_draft_serves(load("target_padded"))


# --- the device's greedy draft (torch): a fake, then a tiny real pair ------------------------


class DeviceDraftBackend(BackendBase):
    """A draft model with a whole-draft greedy path on the "device" whose argmax, like a real
    one, is over its whole vocabulary: its largest logit is always its last (padding) id."""

    supports_greedy_draft = True

    def __init__(self, n_vocab: int, n_real: int):
        self.name = f"device-{n_vocab}"
        self._n = n_vocab
        self.n_real = n_real
        self.cache: list[int] = []
        self.device_calls = 0

    n_vocab = property(lambda self: self._n)
    n_ctx = property(lambda self: 256)
    n_seq = 1
    kv_len = property(lambda self: len(self.cache))
    eog_ids = property(lambda self: frozenset())

    def seq_len(self, seq: int) -> int:
        return len(self.cache)

    def token_text(self, i: int) -> bytes:
        return f"t{i}".encode() if i < self.n_real else f"[PAD{i}]".encode()

    def token_bytes(self, i: int) -> bytes:
        return self.token_text(i) if i < self.n_real else b""

    def supports_output_subset(self) -> bool:
        return False

    def _row(self, last: int) -> np.ndarray:
        row = np.zeros(self._n, dtype=np.float32)
        row[(last * 7 + 3) % self.n_real] = 5.0
        row[-1] = 9.0
        return row

    def forward(self, token_ids: Sequence[int], logits_for: Sequence[int], seq: int = 0) -> np.ndarray:
        start = len(self.cache)
        self.cache.extend(int(t) for t in token_ids)
        return np.stack([self._row(self.cache[start + i]) for i in logits_for]) if logits_for else np.zeros((0, self._n))

    def greedy_draft(self, token_ids: Sequence[int], k: int) -> list[int]:
        self.device_calls += 1
        self.cache.extend(int(t) for t in token_ids)
        out = [int(np.argmax(self._row(self.cache[-1])))]
        for _ in range(k - 1):
            self.cache.append(out[-1])
            out.append(int(np.argmax(self._row(out[-1]))))
        return out

    def rollback(self, n: int, seq: int = 0) -> None:
        del self.cache[n:]

    def close(self) -> None:
        pass


def test_device_greedy_draft_is_not_used_when_it_could_return_a_padding_id():
    n = 50
    big, small = DeviceDraftBackend(n + 8, n), DeviceDraftBackend(n, n)
    drafter = ModelDrafter(big, target=small)
    drafter.start([1, 2], Sampler(SamplingParams()))
    d = drafter.propose([1, 2, 3], 4)
    assert big.device_calls == 0 and len(d.token_ids) == 4 and max(d.token_ids) < n
    assert d.token_ids[0] == (3 * 7 + 3) % n  # the best id the target has
    # A draft no larger than the target keeps the one-sync device path.
    target = DeviceDraftBackend(n + 8, n)
    drafter = ModelDrafter(small, target=target)
    drafter.start([1, 2], Sampler(SamplingParams()))
    d = drafter.propose([1, 2, 3], 4)
    assert small.device_calls == 1 and max(d.token_ids) < n


def test_torch_pair_with_padded_vocabularies_is_lossless():
    """transformers' tiny llama pair (the torch backend's greedy draft on the device): a
    draft resized to more ids than the target (loud padding rows), and the reverse."""
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    from tokenizers import Tokenizer, decoders, models as tok_models, pre_tokenizers, trainers

    from specdecode.backends.torch import TorchBackend

    tok = Tokenizer(tok_models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator([PROMPT + " jumps over the lazy dog."] * 10, trainers.BpeTrainer(
        vocab_size=300, special_tokens=["<|endoftext|>"], initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    tokenizer = transformers.PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|endoftext|>")
    v = len(tokenizer)

    def tiny(vocab: int, seed: int, noise: float = 0.0, loud: bool = False):
        torch.manual_seed(0)
        cfg = transformers.LlamaConfig(vocab_size=v, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                       num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                                       eos_token_id=0)
        model = transformers.LlamaForCausalLM(cfg).float().eval()
        with torch.no_grad():
            model.lm_head.weight.mul_(8.0)
            torch.manual_seed(seed)
            model.lm_head.weight.add_(torch.randn_like(model.lm_head.weight) * model.lm_head.weight.std() * noise)
            if vocab > v:
                head = model.lm_head.weight.clone()
                model.resize_token_embeddings(vocab)
                rows = 3.0 * head[torch.randint(0, v, (vocab - v,))] if loud else torch.zeros(vocab - v, head.shape[1])
                model.lm_head.weight[v:] = rows  # loud: padding ids would win an unmasked argmax
        return TorchBackend(model, tokenizer, n_ctx=128, name=f"tiny-{vocab}")

    prompt = tokenizer(PROMPT)["input_ids"]
    for draft, target in ((tiny(v + PAD, 1, 0.3, loud=True), tiny(v, 0)), (tiny(v, 1, 0.3), tiny(v + PAD, 0))):
        larger = draft if draft.n_vocab > v else target
        assert larger.token_text(v + 1) == b"" and larger.token_bytes(v + 1) == b""  # past the tokenizer
        drafter = RecordingDrafter(draft, target=target)
        engine = SpeculativeEngine(target, drafter, 4)
        spec = engine.generate(prompt, max_tokens=24)
        plain = engine.generate(prompt, max_tokens=24, drafter=NoDrafter())
        assert spec.token_ids == plain.token_ids
        drafted = [t for dr in drafter.drafts for t in dr.token_ids]
        assert drafted and max(drafted) < target.n_vocab
        assert spec.stats.accepted > 0


# --- the registry's Qwen2.5 tokenizer under a padded (7B-style) target ------------------------


class PaddedView(BackendBase):
    """A backend's vocabulary with ``extra`` [PAD<id>] ids appended, as Qwen2.5 7B's GGUF
    has them (vocabulary only: no forward)."""

    def __init__(self, inner, extra: int):
        self.inner, self.extra = inner, extra
        self.name = f"{inner.name} + {extra} padding ids"

    eog_ids = property(lambda self: self.inner.eog_ids)

    @property
    def n_vocab(self) -> int:
        return self.inner.n_vocab + self.extra

    def token_text(self, i: int) -> bytes:
        return self.inner.token_text(i) if i < self.inner.n_vocab else f"[PAD{i}]".encode()

    def token_bytes(self, i: int) -> bytes:
        return self.inner.token_bytes(i) if i < self.inner.n_vocab else b""


@pytest.mark.qwen
def test_registry_qwen_fingerprint_serves_a_padded_qwen_target():
    """QWEN25_TOKENIZER (the 151,936-id vocabulary the registry records) is recognised in a
    152,064-id target, and the 0.5B draft passes the check against it both ways round."""
    draft = LlamaCppBackend(registry.resolve(registry.DEFAULT_DRAFT, progress=False), n_ctx=64, n_threads=1,
                            name=registry.DEFAULT_DRAFT)
    try:
        assert draft.n_vocab == 151_936
        target = PaddedView(draft, 152_064 - 151_936)
        assert fingerprint_serves(target, registry.QWEN25_TOKENIZER)
        check_vocab_compatible(draft, target)
        check_vocab_compatible(target, draft)
    finally:
        draft.close()
