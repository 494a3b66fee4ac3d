"""A user's own PyTorch model over discrete codes (ModuleBackend) through the token-id API:
a fixed Markov chain over 12 codes as the target, with and without a KV cache. Greedy
parity with plain decoding and with the chain's own argmax path; sampled codes against the
chain's exact distribution (chi-square, fixed seeds) with a negative control that the same
test rejects; seeded equality with and without speculation; text-only options refused."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import specdecode.engine.core
from specdecode import Decoder, IncompatibleVocabularyError, ModuleBackend, SpecDecodeError
from specdecode.grammar import Grammar
from specdecode.verify import VerifyResult

from chi_square import pooled_p
from backend_conformance import check_forward_rollback_forward, check_logits_only_where_asked

V = 12
END = 11  # the code that ends a generation in the chains with an end


def chain(seed: int, concentration: float = 0.4, end_mass: float = 0.0) -> np.ndarray:
    """A random transition matrix [V, V] (row: the current code), end code optional."""
    p = np.random.default_rng(seed).dirichlet(np.full(V, concentration), size=V)
    p[:, END] = end_mass
    return p / p.sum(axis=1, keepdims=True)


class Markov(torch.nn.Module):
    """ids [1, L] -> logits [1, L, V]: row t is log P[ids[t]] (the slow-path contract)."""

    def __init__(self, p: np.ndarray) -> None:
        super().__init__()
        self.register_buffer("logp", torch.tensor(np.log(np.maximum(p, 1e-30)), dtype=torch.float32))

    def forward(self, ids):
        return self.logp[ids]


class CachedMarkov(Markov):
    """(ids [1, N], past) -> (logits [1, N, V], past): past is ((keys [1, 1, L, 1],),) in the
    legacy per-layer form, here holding the codes seen (what a real cache would be derived
    from), so that cropping it to the wrong length would change nothing but its length check."""

    def forward(self, ids, past=None):
        seen = ids[..., None, :, None].float()
        keys = seen if past is None else torch.cat([past[0][0], seen], dim=-2)
        return self.logp[ids], ((keys,),)


def backend(p, cached: bool, name: str = "markov", **kw) -> ModuleBackend:
    return ModuleBackend(CachedMarkov(p) if cached else Markov(p), n_vocab=V, n_ctx=128, kv_cache=cached,
                         name=name, **kw)


TARGET = chain(0)
DRAFT = 0.7 * TARGET + 0.3 * chain(1)  # a near chain: agrees often, not always


def argmax_path(p: np.ndarray, start: int, n: int) -> list[int]:
    out, x = [], start
    for _ in range(n):
        x = int(np.argmax(p[x]))
        out.append(x)
    return out


@pytest.mark.parametrize("cached", [False, True])
def test_the_backend_keeps_the_contract(cached):
    b = backend(TARGET, cached)
    ids = [int(i) for i in np.random.default_rng(3).integers(0, V, 20)]
    check_forward_rollback_forward(b, ids, atol=0.0)
    check_logits_only_where_asked(b, ids)
    np.testing.assert_array_equal(b.forward(ids[:3], logits_for=[2]), np.log(np.maximum(TARGET[[ids[2]]], 1e-30)).astype(np.float32))


@pytest.mark.parametrize("cached", [False, True])
@pytest.mark.parametrize("draft", ["model", "ngram", "suffix", "auto"])
def test_greedy_equals_plain_decoding_and_the_chains_argmax(cached, draft):
    drafter = backend(DRAFT, cached, "draft") if draft == "model" else draft
    k = "auto" if draft == "auto" else 4
    with Decoder(target=backend(TARGET, cached), draft=drafter, num_speculative_tokens=k, progress=False) as dec:
        accepted = 0
        for start in range(V - 1):
            spec = dec.generate_ids([start], max_tokens=30)
            base = dec.generate_ids([start], max_tokens=30, plain=True)
            assert spec.token_ids == base.token_ids == argmax_path(TARGET, start, 30)
            assert spec.text == "" and spec.finish_reason == "length"
            accepted += spec.stats.accepted
        if draft != "auto":
            assert accepted > 100  # speculation ran: the parity is not plain decoding's twice


def two_code_counts(dec: Decoder, n: int, **options) -> dict:
    counts: dict = {}
    for i in range(n):
        r = dec.generate_ids([0], max_tokens=2, temperature=1.0, seed=1000 + i, **options)
        key = tuple(r.token_ids)
        counts[key] = counts.get(key, 0) + 1
    return counts


def chi_square_p(counts: dict, n: int) -> float:
    """Pairs (x1, x2) after code 0 against the chain's P[0, x1] P[x1, x2], rare cells pooled."""
    expected = {(a, b): TARGET[0, a] * TARGET[a, b] for a in range(V) for b in range(V)}
    return pooled_p(counts, expected, n)


def accept_everything(draft_ids, draft_probs, target_probs, rng):
    """A wrong rule (the negative control): every draft kept, as if draft = target."""
    k = len(draft_ids)
    return VerifyResult(num_accepted=k, next_token=int(rng.choice(V, p=target_probs[k])), is_bonus=True)


@pytest.mark.parametrize("cached", [False, True])
def test_sampled_codes_follow_the_chain_and_a_wrong_rule_is_caught(cached, monkeypatch):
    n = 3000
    with Decoder(target=backend(TARGET, cached), draft=backend(DRAFT, cached, "draft"), num_speculative_tokens=2,
                 progress=False) as dec:
        for rule in ("gumbel", "rejection"):
            p = chi_square_p(two_code_counts(dec, n, sampling_rule=rule), n)
            assert p > 1e-3, (rule, p)
        drafted = dec.generate_ids([0], max_tokens=60, temperature=1.0, seed=5, sampling_rule="rejection")
        assert 0.05 < drafted.stats.acceptance_rate < 0.95  # the draft is a different chain
        monkeypatch.setattr(specdecode.engine.core, "verify_speculative_sampling", accept_everything)
        p_bad = chi_square_p(two_code_counts(dec, n, sampling_rule="rejection"), n)
        assert p_bad < 1e-6, p_bad


@pytest.mark.parametrize("draft", ["model", "ngram"])
def test_a_seed_gives_the_same_codes_with_and_without_speculation(draft):
    target = backend(TARGET, True)
    drafter = backend(DRAFT, True, "draft") if draft == "model" else draft
    with Decoder(target=target, draft=drafter, num_speculative_tokens=4, progress=False) as dec:
        for seed in range(8):
            spec = dec.generate_ids([seed % (V - 1)], max_tokens=40, temperature=0.9, top_p=0.95, seed=seed)
            base = dec.generate_ids([seed % (V - 1)], max_tokens=40, temperature=0.9, top_p=0.95, seed=seed, plain=True)
            assert spec.token_ids == base.token_ids
            assert spec.stats.invariant_block >= 2  # the table's logits are batch-invariant: verified in blocks
        other = dec.generate_ids([0], max_tokens=40, temperature=0.9, top_p=0.95, seed=1)
        assert other.token_ids != dec.generate_ids([0], max_tokens=40, temperature=0.9, top_p=0.95, seed=2).token_ids


def test_a_stream_of_codes_reports_each_steps_codes_as_they_are_committed():
    from specdecode import GenerationResult

    with Decoder(target=backend(TARGET, True), draft=backend(DRAFT, True, "draft"), num_speculative_tokens=4,
                 progress=False) as dec:
        items = list(dec.stream(prompt_ids=[0], max_tokens=30))
    result, deltas = items[-1], items[:-1]
    assert isinstance(result, GenerationResult) and all(d == "" for d in deltas)
    assert [t for d in deltas for t in d.token_ids] == result.token_ids == argmax_path(TARGET, 0, 30)
    assert len(deltas) == result.stats.target_forward_passes  # one delta per step, none held back


def test_the_end_code_ends_a_generation():
    p = chain(2, end_mass=0.2)
    ends = ModuleBackend(Markov(p), n_vocab=V, eog_ids=[END], n_ctx=128, name="ending")
    with Decoder(target=ends, draft=ModuleBackend(Markov(chain(3, end_mass=0.2)), n_vocab=V, eog_ids=[END], n_ctx=128),
                 num_speculative_tokens=3, progress=False) as dec:
        results = [dec.generate_ids([0], max_tokens=100, temperature=1.0, seed=s) for s in range(20)]
    stopped = [r for r in results if r.finish_reason == "stop"]
    assert stopped and all(END not in r.token_ids for r in results)


def test_text_only_options_are_refused_by_name():
    with Decoder(target=backend(TARGET, False), draft="ngram", num_speculative_tokens=2, progress=False) as dec:
        cases = [(dict(prompt="a cat"), "prompt"), (dict(messages=[{"role": "user", "content": "hi"}]), "messages"),
                 (dict(prompt_ids=[0], stop=["\n"]), "stop"), (dict(prompt_ids=[0], grammar=Grammar("json_object")),
                                                                 "grammar"),
                 (dict(prompt_ids=[0], prediction="some text"), "prediction")]
        for kwargs, param in cases:
            with pytest.raises(SpecDecodeError, match=f"{param} is a text option") as e:
                dec.generate(**kwargs)
            assert e.value.param == param
        for bad, what in (([], "empty"), ("0 1", "integer"), ([0.5], "integer"), ([V], "outside the vocabulary")):
            with pytest.raises(SpecDecodeError, match=what):
                dec.generate_ids(bad)
    # A prediction over codes is a lookup over ids: allowed, and lossless.
    with Decoder(target=backend(TARGET, False), draft="prediction", num_speculative_tokens=8, progress=False) as dec:
        want = argmax_path(TARGET, 0, 20)
        wrong = want[:10] + [(t + 1) % V for t in want[10:]]
        for prediction in (want, wrong):
            r = dec.generate_ids([0], max_tokens=20, prediction=prediction)
            assert r.token_ids == want and r.stats.accepted >= 10


def test_bad_models_and_codebooks_are_refused_with_the_values():
    with pytest.raises(SpecDecodeError, match="torch.nn.Module"):
        ModuleBackend(lambda ids: ids, n_vocab=V)
    with pytest.raises(SpecDecodeError, match=r"eog_ids \[12\]"):
        ModuleBackend(Markov(TARGET), n_vocab=V, eog_ids=[12])
    with pytest.raises(SpecDecodeError, match="n_vocab = 1"):
        ModuleBackend(Markov(TARGET), n_vocab=1)
    wrong_v = ModuleBackend(Markov(TARGET), n_vocab=V + 1, n_ctx=64)
    with pytest.raises(SpecDecodeError, match=r"shape \(1, 1, 12\): expected \(1, 1, 13\)"):
        wrong_v.forward([0], logits_for=[0])
    assert wrong_v.kv_len == 0  # nothing appended
    with pytest.raises(IncompatibleVocabularyError, match="codebook 'pixels'.*codebook 'codes'"):
        Decoder(target=backend(TARGET, False), draft=backend(DRAFT, False, codebook="pixels"), num_speculative_tokens=2,
                progress=False)
    with pytest.raises(IncompatibleVocabularyError, match="13 codes"):
        Decoder(target=backend(TARGET, False), draft=wrong_v, num_speculative_tokens=2, progress=False)
    with pytest.raises(SpecDecodeError, match="parallel = 2"):
        Decoder(target=backend(TARGET, False), draft="ngram", parallel=2, progress=False)
    with Decoder(target=backend(TARGET, False), draft="ngram", num_speculative_tokens=2, progress=False) as dec:
        with pytest.raises(SpecDecodeError, match="context"):
            dec.generate_ids([0] * 128)


class Recurrent(torch.nn.Module):
    """A model with a hidden state: h_t = tanh(W [emb(x_t); h_{t-1}]); logits = head(h_t).
    Its greedy continuation depends on the whole prefix, so heads must read h."""

    def __init__(self, seed: int, d: int = 32) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.emb, self.mix, self.head = torch.nn.Embedding(V, d), torch.nn.Linear(2 * d, d), torch.nn.Linear(d, V)
        with torch.no_grad():
            self.mix.weight.mul_(2.0)

    def forward(self, ids):
        h = torch.zeros(ids.shape[0], self.mix.out_features)
        hs = []
        for t in range(ids.shape[1]):
            h = torch.tanh(self.mix(torch.cat([self.emb(ids[:, t]), h], dim=-1)))
            hs.append(h)
        return self.head(torch.stack(hs, dim=1))


def test_heads_trained_on_ids_draft_for_a_model_over_codes(tmp_path):
    from specdecode.drafters.heads import HeadsMismatchError
    from specdecode.heads.train import TrainConfig, train_heads_on_ids

    model = Recurrent(0)
    target = ModuleBackend(model, n_vocab=V, n_ctx=64, name="recurrent", output_head=model.head)
    # The target's own greedy continuations of random 3-code prefixes (a self-corpus, as
    # `specdecode heads corpus` makes for text: heads learn what the target would emit).
    with Decoder(target=target, draft="none", num_speculative_tokens=0, progress=False) as plain:
        prefixes = np.random.default_rng(0).integers(0, V, size=(300, 3)).tolist()
        seqs = np.array([p + plain.generate_ids(p, max_tokens=21).token_ids for p in prefixes])
    heads, report = train_heads_on_ids(target, seqs, TrainConfig(heads=3, epochs=10, batch=64, lr=1e-2),
                                       progress=False, log=lambda _: None)
    assert report["held_out_accuracy"][0] > report["held_out_accuracy_untrained"][0] + 0.2, report
    path = tmp_path / "heads.safetensors"
    heads.save(path)
    with Decoder(target=target, draft=f"heads:{path}", num_speculative_tokens=3, progress=False) as dec:
        accepted = 0
        for start in range(V):
            spec = dec.generate_ids([start, (start + 5) % V], max_tokens=30)
            base = dec.generate_ids([start, (start + 5) % V], max_tokens=30, plain=True)
            assert spec.token_ids == base.token_ids
            accepted += spec.stats.accepted
            a = dec.generate_ids([start], max_tokens=20, temperature=1.0, seed=start)
            assert a.token_ids == dec.generate_ids([start], max_tokens=20, temperature=1.0, seed=start,
                                                   plain=True).token_ids
        assert accepted > 60  # the heads draft, and what they draft is kept often
    other = Recurrent(1)
    with pytest.raises(HeadsMismatchError, match="trained for target another file named recurrent.*train_heads_on_ids"):
        Decoder(target=ModuleBackend(other, n_vocab=V, n_ctx=64, name="recurrent", output_head=other.head),
                draft=f"heads:{path}", num_speculative_tokens=3, progress=False)
    plain_target = ModuleBackend(Recurrent(0), n_vocab=V, n_ctx=64)
    with pytest.raises(SpecDecodeError, match="output_head"):
        train_heads_on_ids(plain_target, seqs)
    with pytest.raises(SpecDecodeError, match="hidden states"):
        Decoder(target=plain_target, draft=f"heads:{path}", num_speculative_tokens=3, progress=False)
    with pytest.raises(SpecDecodeError, match="output_head must be"):
        ModuleBackend(model, n_vocab=V, output_head=model.emb)
    with pytest.raises(SpecDecodeError, match=r"shape \(5, 3\)"):
        train_heads_on_ids(target, seqs[:5, :3], TrainConfig(heads=3))


def test_a_backend_serves_one_decoder_at_a_time_and_stays_usable_after_a_refusal():
    t = backend(TARGET, True)
    with pytest.raises(SpecDecodeError, match="same backend") as e:
        Decoder(target=t, draft=t, num_speculative_tokens=2, progress=False)
    assert e.value.param == "draft"
    first = Decoder(target=t, draft="ngram", num_speculative_tokens=2, progress=False)
    with pytest.raises(SpecDecodeError, match="in use by another Decoder") as e:
        Decoder(target=t, draft="none", num_speculative_tokens=0, progress=False)
    assert e.value.param == "target"
    with pytest.raises(SpecDecodeError, match="in use by another Decoder"):
        Decoder(target=backend(TARGET, True), draft=t, num_speculative_tokens=2, progress=False)
    assert first.generate_ids([3], max_tokens=10).token_ids == argmax_path(TARGET, 3, 10)
    first.close()
    # Closed: free for the next Decoder. A refused Decoder leaves the caller's backends as they were.
    with pytest.raises(IncompatibleVocabularyError):
        Decoder(target=t, draft=backend(DRAFT, True, codebook="other"), num_speculative_tokens=2, progress=False)
    with Decoder(target=t, draft=backend(DRAFT, True, "draft"), num_speculative_tokens=2, progress=False) as again:
        assert again.generate_ids([3], max_tokens=10).token_ids == argmax_path(TARGET, 3, 10)


class Broken(Markov):
    def __init__(self, p, post):
        super().__init__(p)
        self.post = post

    def forward(self, ids):
        return self.post(super().forward(ids))


@pytest.mark.parametrize("post, what", [(lambda l: l * float("nan"), "non-finite"),
                                        (lambda l: l * 0 - float("inf"), "non-finite"),
                                        (lambda l: l * 0 + float("inf"), "non-finite"),
                                        (lambda l: l.numpy(), "ndarray"), (lambda l: l.long(), "torch.int64")])
def test_logits_without_a_distribution_are_refused(post, what):
    with Decoder(target=ModuleBackend(Broken(TARGET, post), n_vocab=V, n_ctx=32), draft="none",
                 num_speculative_tokens=0, progress=False) as dec:
        for sampling in (dict(), dict(temperature=1.0, seed=1)):
            with pytest.raises(SpecDecodeError, match=what):
                dec.generate_ids([0], max_tokens=3, **sampling)


def test_bad_ids_options_and_caches_are_refused_by_name():
    with Decoder(target=backend(TARGET, False), draft=backend(DRAFT, False, "d"), num_speculative_tokens=2,
                 progress=False) as dec:
        for bad in (None, 5, np.array(3), (t for t in [1]), {1, 2}, {1: 2}, [1.9], [[1]], [True], [-1], [V]):
            with pytest.raises(SpecDecodeError) as e:
                dec.generate_ids(bad)
            assert e.value.param == "prompt_ids", bad
        assert dec.generate_ids(np.array([0, 1]), max_tokens=3).token_ids == argmax_path(TARGET, 1, 3)
        with pytest.raises(SpecDecodeError, match="prediction id 99") as e:
            dec.generate_ids([0], prediction=[3, 99])
        assert e.value.param == "prediction"
        assert len(dec.generate_ids([0], max_tokens=2, logprobs=20).logprobs[0].top_logprobs) == V  # all there are
        assert dec.generate_ids([0], max_tokens=3).token_ids == argmax_path(TARGET, 0, 3)  # still fine
    for kwargs, param in ((dict(kv_cache="no"), "kv_cache"), (dict(eog_ids="19"), "eog_ids"),
                          (dict(eog_ids=[8.9]), "eog_ids"), (dict(eog_ids=[True]), "eog_ids"),
                          (dict(n_threads=0), "n_threads"), (dict(n_threads=2.5), "n_threads")):
        with pytest.raises(SpecDecodeError) as e:
            ModuleBackend(Markov(TARGET), n_vocab=V, **kwargs)
        assert e.value.param == param

    class DictCache(Markov):
        def forward(self, ids, past=None):
            return super().forward(ids), {"layers": past}

    odd = ModuleBackend(DictCache(TARGET), n_vocab=V, n_ctx=32, kv_cache=True)
    with pytest.raises(SpecDecodeError, match="cache of type dict"):
        odd.forward([0, 1], logits_for=[1])
    assert odd.kv_len == 0


def test_a_call_names_the_loaded_draft_model_and_a_wrong_kv_cache_mode_is_explained():
    with Decoder(target=backend(TARGET, True), draft=backend(DRAFT, True, "near-chain"), num_speculative_tokens=3,
                 progress=False) as dec:
        for name in ("near-chain", "model"):
            assert dec.generate_ids([2], max_tokens=12, draft=name).token_ids == argmax_path(TARGET, 2, 12)
        with pytest.raises(SpecDecodeError, match="drafters its Decoder loaded"):
            dec.generate_ids([2], draft="ngram")
    with pytest.raises(SpecDecodeError, match="needs kv_cache=False"):
        ModuleBackend(Markov(TARGET), n_vocab=V, kv_cache=True).forward([0], [0])
    with pytest.raises(SpecDecodeError, match="needs kv_cache=True"):
        ModuleBackend(CachedMarkov(TARGET), n_vocab=V, kv_cache=False).forward([0], [0])
