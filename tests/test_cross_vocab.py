"""Drafting across vocabularies (drafters/cross_vocab.py): tiny GGUF pairs written with gguf-py
and run on llama.cpp. A draft that is the target itself with its ids shuffled (another
tokenizer's ids, the same texts: its drafts are the target's own tokens, so nearly all are
accepted), and a draft of another tokenizer altogether (fewer merges, its own random weights).
Greedy output equals plain decoding with both methods; sampled tokens follow the target's
exact distribution (chi-square, fixed seeds) and a drafter whose ids and probabilities
disagree is caught by the same test."""

from __future__ import annotations

import numpy as np
import pytest

from specdecode.backends.base import BackendBase
from specdecode.backends.llama_cpp import LlamaCppBackend
from specdecode.backends.vocab_map import build_vocab_map, render
from specdecode.drafters import ModelDrafter, NoDrafter
from specdecode.drafters.base import Draft
from specdecode.drafters.cross_vocab import MARGIN, CrossVocabDrafter, TextMirror, _complete_utf8
from specdecode.engine import SpeculativeEngine
from specdecode.errors import IncompatibleVocabularyError, SpecDecodeError
from specdecode.sampling import Sampler, SamplingParams

from chi_square import pooled_p
from tiny_gguf import CORPUS, TinyVocab, TinyWeights, base_vocab, write_gguf

PROMPT = "the quick brown fox"


def shuffled(vocab: TinyVocab, weights: TinyWeights, seed: int) -> tuple[TinyVocab, TinyWeights, np.ndarray]:
    """The same tokenizer and model with its ids shuffled: draft id i is target id perm[i]."""
    perm = np.random.default_rng(seed).permutation(vocab.n)
    v = TinyVocab([vocab.tokens[p] for p in perm], [vocab.types[p] for p in perm], vocab.merges,
                  int(np.nonzero(perm == vocab.eos)[0][0]))
    w = weights.copy()
    for name in ("token_embd.weight", "output.weight"):
        w.tensors[name] = weights.tensors[name][perm].copy()
    return v, w, perm


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    d = tmp_path_factory.mktemp("cross")
    v = base_vocab()
    w = TinyWeights.random(v.n, seed=0)
    sv, sw, perm = shuffled(v, w, seed=7)
    few = base_vocab(n_merges=20)
    paths = {"target": write_gguf(d / "target.gguf", v, w),
             "shuffled": write_gguf(d / "shuffled.gguf", sv, sw),
             "few": write_gguf(d / "few.gguf", few, TinyWeights.random(few.n, seed=3))}
    opened = {k: LlamaCppBackend(p, n_ctx=256, n_threads=1, name=k) for k, p in paths.items()}
    yield opened, perm
    for b in opened.values():
        b.close()


def test_the_vocabularies_are_matched_by_text(pair):
    models, perm = pair
    target, shuffled_, few = models["target"], models["shuffled"], models["few"]
    with pytest.raises(IncompatibleVocabularyError):
        ModelDrafter(shuffled_, target=target)  # the same texts under other ids: not the target's tokenizer
    m = build_vocab_map(shuffled_, target)
    assert np.array_equal(m.d2t, perm) and m.shared == target.n_vocab
    assert all(m.t2d[perm[i]] == i for i in range(len(perm)))
    (eos,) = shuffled_.eog_ids
    assert m.draft_eog_to_target == {eos: next(iter(target.eog_ids))}  # <|endoftext|>, by its marker
    m = build_vocab_map(few, target)
    assert m.shared == few.n_vocab  # 256 bytes, the first 20 merges (learnt the same), the end marker
    assert all(render(few, i) == render(target, int(m.d2t[i])) for i in range(few.n_vocab))
    assert (m.t2d >= 0).sum() == few.n_vocab and "277 token texts shared (100% of draft few's 277 ids" in m.overlap_note()


def test_utf8_ends_are_found():
    text = "aé€😀".encode()
    assert _complete_utf8(text, len(text)) == len(text)
    for cut, whole in ((len(text) - 1, len(text) - 4), (len(text) - 3, len(text) - 4), (4, 3), (3, 3), (2, 1)):
        assert _complete_utf8(text[:cut], cut) == whole


def test_the_mirror_spells_the_text_and_reads_only_the_tail(pair):
    models, _ = pair
    target, few = models["target"], models["few"]
    read = []
    tokenize = few.tokenize

    def recording(text, *a, **k):
        read.append(len(text))
        return tokenize(text, *a, **k)

    few.tokenize = recording
    try:
        mirror = TextMirror(few, target)
        ids = target.tokenize(CORPUS, add_special=False)
        rng = np.random.default_rng(0)
        n = 40
        for step in range(60):
            if rng.random() < 0.25 and n > 10:
                n -= int(rng.integers(1, 6))  # a rollback (rejected drafts, another request's prefix)
            else:
                n += int(rng.integers(1, 6))
            read.clear()
            dids = mirror.update(ids[:n])
            text = b"".join(render(target, t) for t in ids[:n])
            assert b"".join(render(few, d) for d in dids) == text == bytes(mirror.text)
            if step:
                # a tail: the changed tokens and MARGIN draft tokens before them (each at most 8 bytes here)
                assert sum(read) <= 8 * (MARGIN + 10), read
            # the tail's tokens are the ones the whole text gives (the cache keeps them)
            assert dids == tokenize(text.decode(), add_special=False, parse_special=True)
    finally:
        few.tokenize = tokenize


@pytest.mark.parametrize("method", ["slem", "tli"])
@pytest.mark.parametrize("draft", ["shuffled", "few"])
def test_greedy_output_equals_plain_decoding(pair, method, draft):
    models, _ = pair
    target = models["target"]
    drafter = CrossVocabDrafter(models[draft], target, method=method)
    engine = SpeculativeEngine(target, drafter, 4)
    prompt = target.tokenize(PROMPT, add_special=False)
    spec = engine.generate(prompt, max_tokens=48)
    plain = engine.generate(prompt, max_tokens=48, drafter=NoDrafter())
    assert spec.token_ids == plain.token_ids and len(plain.token_ids) > 10
    assert drafter.ran == method and spec.stats.drafted > 0
    assert f"{method.upper()} across tokenizers" in drafter.explain()


def test_auto_runs_slem_for_greedy_and_tli_for_sampling(pair):
    models, _ = pair
    drafter = CrossVocabDrafter(models["few"], models["target"])
    drafter.start([1], Sampler(SamplingParams()))
    assert drafter.ran == "slem"
    drafter.start([1], Sampler(SamplingParams(temperature=0.8, seed=1)))
    assert drafter.ran == "tli"
    with pytest.raises(SpecDecodeError, match="'lem' is unknown"):
        CrossVocabDrafter(models["few"], models["target"], method="lem")


def test_sampled_tli_drafts_carry_their_distribution_over_the_targets_ids(pair):
    models, _ = pair
    target, few = models["target"], models["few"]
    drafter = CrossVocabDrafter(few, target, method="tli")
    drafter.start([], Sampler(SamplingParams(temperature=1.0, seed=3)))
    draft = drafter.propose(target.tokenize(PROMPT, add_special=False), 4)
    assert len(draft.token_ids) == 4 and draft.probs.shape == (4, target.n_vocab)
    np.testing.assert_allclose(draft.probs.sum(axis=1), 1.0, rtol=1e-6)
    outside = np.ones(target.n_vocab, bool)
    outside[drafter.vmap.d2t[drafter.vmap.d2t >= 0]] = False
    assert outside.sum() == target.n_vocab - few.n_vocab and np.all(draft.probs[:, outside] == 0)
    assert all(draft.probs[i, t] > 0 for i, t in enumerate(draft.token_ids))


class MismappedDrafter(CrossVocabDrafter):
    """The negative control: drafted ids mapped to the target through a wrong table while the
    probabilities stay the right ones."""

    def __init__(self, *a, wrong: np.ndarray, **k):
        super().__init__(*a, **k)
        self.wrong = wrong

    def _tli(self, context, logits, k, sampler):
        d = super()._tli(context, logits, k, sampler)
        return Draft([int(self.wrong[t]) for t in d.token_ids], d.probs)


def pair_counts(engine: SpeculativeEngine, prompt: list[int], n: int, temperature: float = 1.5) -> dict:
    counts: dict = {}
    for i in range(n):
        r = engine.generate(prompt, max_tokens=2,
                            sampling=SamplingParams(temperature=temperature, seed=2000 + i, sampling_rule="rejection"))
        counts[tuple(r.token_ids)] = counts.get(tuple(r.token_ids), 0) + 1
    return counts


def exact_pairs(target: LlamaCppBackend, prompt: list[int], temperature: float) -> dict:
    """P(x1, x2) = p(x1 | prompt) p(x2 | prompt, x1) under the target at ``temperature``, keyed
    by the tokens a generation emits (an end-of-generation token ends it, unemitted)."""
    def probs(ids):
        target.rollback(0)
        z = target.forward(ids, logits_for=[len(ids) - 1])[0].astype(np.float64) / temperature
        p = np.exp(z - z.max())
        return p / p.sum()

    p1 = probs(prompt)
    out: dict = {}
    for a in np.nonzero(p1 > 1e-4)[0]:
        if a in target.eog_ids:
            out[()] = out.get((), 0.0) + p1[a]
            continue
        p2 = probs(prompt + [int(a)])
        for b in np.nonzero(p2 > 1e-4)[0]:
            key = (int(a),) if b in target.eog_ids else (int(a), int(b))
            out[key] = out.get(key, 0.0) + p1[a] * p2[b]
    target.rollback(0)
    return out


def test_sampled_tokens_follow_the_target_and_a_wrong_mapping_is_caught(pair):
    models, _ = pair
    target, few = models["target"], models["few"]
    prompt = target.tokenize(PROMPT, add_special=False)
    expected = exact_pairs(target, prompt, 1.5)
    n = 1500
    drafter = CrossVocabDrafter(few, target, method="tli")
    counts = pair_counts(SpeculativeEngine(target, drafter, 3), prompt, n)
    assert pooled_p(counts, expected, n) > 1e-3
    r = SpeculativeEngine(target, drafter, 3).generate(prompt, max_tokens=40,
                                                        sampling=SamplingParams(temperature=1.5, seed=1))
    drafted, accepted = r.stats.drafted, r.stats.accepted
    assert drafted > 0 and 0 <= accepted < drafted  # the draft is another model: some drafts fail
    shared = np.nonzero(drafter.vmap.t2d >= 0)[0]
    wrong = np.arange(target.n_vocab)
    wrong[shared] = np.random.default_rng(1).permutation(shared)
    bad = MismappedDrafter(few, target, method="tli", wrong=wrong)
    assert pooled_p(pair_counts(SpeculativeEngine(target, bad, 3), prompt, n), expected, n) < 1e-6


# --- two models that know one text, each in its own tokens ---------------------------------

KNOWN = b"def add(a, b):\n    return a + b\n\ndef sub(a, b):\n    return a - b\n"
END_MARK = b"<|end|>"


class TextModel(BackendBase):
    """A fake model over its own pieces that knows KNOWN: after a context spelling a prefix of
    KNOWN it puts a margin of 6 on the piece that continues KNOWN (the longest that matches)
    and 3 on the one-byte piece, the end marker at KNOWN's end; after anything else, on piece
    0. So two TextModels with different pieces continue the same text in different tokens, as
    two real models that have learnt one text would."""

    def __init__(self, pieces: list[bytes], name: str):
        self.name = name
        self.pieces = list(pieces) + [END_MARK]
        self.eos = len(self.pieces) - 1
        self.cache: list[int] = []

    n_vocab = property(lambda self: len(self.pieces))
    n_ctx = property(lambda self: 512)
    n_seq = 1
    kv_len = property(lambda self: len(self.cache))
    eog_ids = property(lambda self: frozenset({self.eos}))
    special_texts = frozenset({END_MARK.decode()})

    def seq_len(self, seq: int) -> int:
        return len(self.cache)

    def token_bytes(self, i: int) -> bytes:
        return b"" if i == self.eos else self.pieces[i]

    def token_text(self, i: int) -> bytes:
        return self.pieces[i]

    def _longest(self, data: bytes, at: int) -> int:
        best = max((i for i, p in enumerate(self.pieces[:-1]) if data.startswith(p, at)), key=lambda i: len(self.pieces[i]))
        return best

    def tokenize(self, text: str, add_special: bool = True, parse_special: bool = False) -> list[int]:
        data, out, at = text.encode(), [], 0
        while at < len(data):
            if parse_special and data.startswith(END_MARK, at):
                out.append(self.eos)
                at += len(END_MARK)
                continue
            out.append(self._longest(data, at))
            at += len(self.pieces[out[-1]])
        return out

    def _row(self, upto: int) -> np.ndarray:
        row = np.zeros(self.n_vocab, dtype=np.float32)
        said = b"".join(self.pieces[t] for t in self.cache[:upto])
        if not KNOWN.startswith(said):
            row[0] = 6.0
        elif len(said) == len(KNOWN):
            row[self.eos] = 6.0
        else:
            row[self.pieces.index(KNOWN[len(said):len(said) + 1])] = 3.0
            row[self._longest(KNOWN, len(said))] = 6.0
        return row

    def forward(self, token_ids, logits_for, seq=0):
        start = len(self.cache)
        self.cache.extend(int(t) for t in token_ids)
        return np.stack([self._row(start + i + 1) for i in logits_for]) if logits_for else np.zeros((0, self.n_vocab))

    def forward_batch(self, items):
        return [self.forward(ids, rows, seq) for seq, ids, rows in items]

    def set_batch_invariant(self, on: bool) -> None:
        pass

    def rollback(self, n: int, seq: int = 0) -> None:
        del self.cache[n:]

    def close(self) -> None:
        pass


BYTES = sorted({KNOWN[i:i + 1] for i in range(len(KNOWN))})
TARGET_PIECES = BYTES + [b"def", b" add", b" sub", b"(a", b", b", b"):\n", b"    ", b"return", b" a", b" +", b" b", b"\n\n"]
DRAFT_PIECES = BYTES + [b"de", b"f ", b"ad", b"d(", b"a,", b" b)", b":\n    ", b"ret", b"urn a", b" + b", b" - b\n"]


@pytest.mark.parametrize("method", ["slem", "tli"])
def test_a_draft_that_knows_the_text_in_other_tokens_is_accepted(method):
    target, draft = TextModel(TARGET_PIECES, "target"), TextModel(DRAFT_PIECES, "draft")
    drafter = CrossVocabDrafter(draft, target, method=method)
    engine = SpeculativeEngine(target, drafter, 6)
    prompt = target.tokenize("def")
    spec = engine.generate(prompt, max_tokens=60)
    plain = engine.generate(prompt, max_tokens=60, drafter=NoDrafter())
    assert spec.token_ids == plain.token_ids and spec.text == plain.text == KNOWN[3:].decode()
    s = spec.stats
    if method == "slem":  # the draft's text, in the target's tokens: all but the last token of each draft are right
        assert s.accepted >= 0.9 * s.drafted > 0
        assert s.target_forward_passes <= plain.stats.target_forward_passes / 3
    else:  # only shared pieces: the one-byte ones, where the target wants a longer piece, and "def"-like misses
        assert s.drafted > 0 and s.accepted < s.drafted
    # the draft model read the prompt once and then only what changed
    assert drafter.pending(spec.prompt_ids + spec.token_ids) <= MARGIN + 2


def test_slem_drafts_whole_target_tokens_and_the_end():
    target, draft = TextModel(TARGET_PIECES, "target"), TextModel(DRAFT_PIECES, "draft")
    drafter = CrossVocabDrafter(draft, target, method="slem")
    drafter.start([], Sampler(SamplingParams()))
    # After "):\n" the draft continues in its own pieces (" ", " ", " ", " ", "ret", "urn a", " + b", ...)
    # until its text holds 3 whole target tokens: "    ", "return", " a" (" +" is left out: it may go on)
    got = drafter.propose(target.tokenize("def add(a, b):\n"), 3)
    assert got.probs is None and got.token_ids == target.tokenize("    return a")
    # A word the draft may not have finished is left out, with the white space before it.
    assert drafter._target_ids(b"(a, ret", False) == target.tokenize("(a,") and drafter._target_ids(b"    ret", False) == []
    assert drafter._target_ids(b"ret", True) == target.tokenize("ret")
    assert drafter._target_ids(b"a + b\xe2\x82", False) == target.tokenize("a +")  # a character cut short, a word
    # The end marker maps to the target's: a draft that reaches KNOWN's end proposes the target's end.
    tail = drafter.propose(target.tokenize(KNOWN.decode()[:-2]), 8)
    assert tail.token_ids == target.tokenize("b\n") + [target.eos]


def test_slem_asks_the_continuation_rule_in_whole_target_tokens():
    """The controller's rule ("draft token i+1?") counts target tokens: SLEM asks it only once its
    text holds one, so a rule that stops at the first chance still drafts a whole token (before,
    it stopped after "ret", a word not safe to hand over, and the draft model's forward drafted
    nothing)."""
    target, draft = TextModel(TARGET_PIECES, "target"), TextModel(DRAFT_PIECES, "draft")
    drafter = CrossVocabDrafter(draft, target, method="slem")
    asked = []
    drafter.set_continuation_rule(lambda i, p: asked.append(i) or False)
    drafter.start([], Sampler(SamplingParams()))
    got = drafter.propose(target.tokenize("def add(a, b):\n"), 3)
    assert got.token_ids and got.token_ids == target.tokenize("    return a")[:len(got.token_ids)]
    assert asked and asked[0] >= 1 and len(asked) == 1


# --- the torch backend, and a pair across the two backends ----------------------------------


def tiny_torch(vocab_size: int, seed: int, corpus: str):
    """A tiny transformers llama with its own byte-level BPE tokenizer of about vocab_size ids."""
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    from tokenizers import Tokenizer, decoders, models as tok_models, pre_tokenizers, trainers

    from specdecode.backends.torch import TorchBackend

    tok = Tokenizer(tok_models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator([corpus] * 10, trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=["<|endoftext|>"], initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    tokenizer = transformers.PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|endoftext|>")
    torch.manual_seed(seed)
    cfg = transformers.LlamaConfig(vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128,
                                   num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                   max_position_embeddings=256, eos_token_id=0)
    model = transformers.LlamaForCausalLM(cfg).float().eval()
    with torch.no_grad():
        model.lm_head.weight.mul_(8.0)
    return TorchBackend(model, tokenizer, n_ctx=256, name=f"torch-{vocab_size}")


@pytest.fixture(scope="module")
def torch_pair():
    target = tiny_torch(300, 0, CORPUS)
    draft = tiny_torch(290, 1, CORPUS[::-1])  # other merges: another tokenizer
    return target, draft


@pytest.mark.parametrize("method", ["slem", "tli"])
@pytest.mark.parametrize("side", ["torch", "torch draft, llama.cpp target", "llama.cpp draft, torch target"])
def test_greedy_output_equals_plain_decoding_on_torch_and_across_backends(torch_pair, pair, method, side):
    models, _ = pair
    target, draft = {"torch": torch_pair, "torch draft, llama.cpp target": (models["target"], torch_pair[1]),
                     "llama.cpp draft, torch target": (torch_pair[0], models["few"])}[side]
    with pytest.raises(IncompatibleVocabularyError):
        ModelDrafter(draft, target=target)
    drafter = CrossVocabDrafter(draft, target, method=method)
    engine = SpeculativeEngine(target, drafter, 4)
    prompt = target.tokenize(PROMPT, add_special=False)
    for sampling in (SamplingParams(), SamplingParams(temperature=0.8, seed=4)):
        spec = engine.generate(prompt, max_tokens=32, sampling=sampling)
        plain = engine.generate(prompt, max_tokens=32, drafter=NoDrafter(), sampling=sampling)
        assert spec.token_ids == plain.token_ids and len(plain.token_ids) > 8  # seeded: Gumbel, the same text
        assert spec.stats.drafted > 0


def test_sampled_tokens_follow_a_torch_target(torch_pair):
    target, draft = torch_pair
    prompt = target.tokenize(PROMPT, add_special=False)
    expected = exact_pairs(target, prompt, 0.3)
    n = 1200
    drafter = CrossVocabDrafter(draft, target, method="tli")
    assert pooled_p(pair_counts(SpeculativeEngine(target, drafter, 3), prompt, n, 0.3), expected, n) > 1e-3
    assert drafter.drafted["tli"] > 0


def test_bad_draft_vocab_values_are_refused_by_name():
    from specdecode.limits import check_draft_vocab

    for bad in ("lem", -1, 1.5, True, None):
        with pytest.raises(SpecDecodeError, match=r"draft_vocab = .* is out of range: expected an integer >= 0 "
                                                  r"\(0 = all\) or one of slem, tli") as e:
            check_draft_vocab(bad)
        assert e.value.param == "draft_vocab"
    assert check_draft_vocab("tli") == "tli" and check_draft_vocab(0) == 0


def test_a_pair_with_too_few_shared_texts_is_refused_with_the_overlap():
    target = TextModel(TARGET_PIECES, "target")
    other = TextModel([bytes([0xC0 + i % 32, 0x80 + i // 32]) for i in range(200)], "other")  # two-byte characters only
    with pytest.raises(IncompatibleVocabularyError, match=r"draft other cannot draft for target target across "
                                                          r"tokenizers: 1 token texts shared \(0% of draft other's 201 ids"):
        CrossVocabDrafter(other, target)


def test_a_fork_drafts_on_its_own_sequence_with_a_mirror_of_its_own(pair):
    models, _ = pair
    drafter = CrossVocabDrafter(models["few"], models["target"], method="slem")
    with pytest.raises(SpecDecodeError, match="holds 1 sequence"):
        drafter.fork(1)
    twin = drafter.fork(0)
    assert twin.backend is drafter.backend and twin._mirror is not drafter._mirror and not twin._owner
    twin.close()
    assert models["few"].tokenize("a", add_special=False)  # the twin did not close the model it shares


def test_an_output_subset_across_tokenizers_is_refused_naming_draft_vocab():
    """--draft-vocab N (an output subset of the draft's ids) needs the target's tokenizer: a draft
    of another is refused saying so, before any backend's subset support is asked about."""
    from specdecode.drafters.kinds import MODEL, DraftRequest

    target, draft = TextModel(TARGET_PIECES, "target"), TextModel(DRAFT_PIECES, "draft")
    with pytest.raises(IncompatibleVocabularyError, match=r"draft_vocab = 8 \(an output subset\) needs a draft model "
                                                          r"of the target's tokenizer: .*drafts across tokenizers") as e:
        MODEL.build(DraftRequest(target, "draft", lambda name: draft, 8))
    assert e.value.param == "draft_vocab"
    assert isinstance(MODEL.build(DraftRequest(target, "draft", lambda name: draft, 0)), CrossVocabDrafter)
