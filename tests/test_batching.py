"""Continuous batching: several generations in one engine, each in its own slot (KV
sequence), stepped together through one batched forward. Each must equal its solo run
whatever runs beside it; a finished or cancelled generation leaves nothing in its slot.

The fake target is a bigram language model over a small vocabulary: the logits at a
position depend only on the last two tokens in that sequence's cache, so a batching bug
(tokens crossing sequences, wrong positions, a rollback of the wrong sequence) changes
the outputs."""

from __future__ import annotations

import numpy as np
import pytest

from specdecode.control.controller import SharedCosts, Source, SpeculationController
from specdecode.control.costmodel import CostCurve, allocate_drafts, expected_tokens_upto
from specdecode.drafters import ModelDrafter, NgramDrafter, NoDrafter, SuffixDrafter
from specdecode.engine import GenerationResult, SpeculativeEngine
from specdecode.errors import SpecDecodeError
from specdecode.sampling import SamplingParams

from conftest import ScriptedBackend

V = 24
PIECES = [b"<eos>"] + [bytes([ord("a") + i]) for i in range(V - 1)]


class BigramLM(ScriptedBackend):
    """Logits [V] after (..., x, y) drawn once per (x, y) from a seeded normal; "sharp" scales
    them so that greedy runs are long and copy-like, and the end token is rare."""

    supports_greedy_draft = False
    path = None
    n_threads = None
    device = "cpu"

    def __init__(self, seed: int = 0, n_seq: int = 8, sharp: float = 3.0, noise: float = 0.0):
        super().__init__(PIECES, [], n_prompt=1, eos=0, n_ctx=256, n_seq=n_seq)
        rng = np.random.default_rng(seed)
        self.table = rng.normal(0, 1.0, size=(V, V, V)) * sharp
        self.table[:, :, 0] -= 4.0  # the end of generation is rare
        if noise:
            self.table += np.random.default_rng(seed + 1).normal(0, noise, size=self.table.shape)

    def _forward(self, seq, token_ids, logits_for):
        cache = self.caches[seq]
        start = len(cache)
        cache.extend(int(t) for t in token_ids)
        rows = [self.table[cache[start + i - 1] if start + i >= 1 else 0, cache[start + i]] for i in logits_for]
        return np.stack(rows).astype(np.float32) if rows else np.zeros((0, V), dtype=np.float32)


def requests(n: int = 8) -> list[dict]:
    """n requests of different prompts, lengths, stop conditions and sampling."""
    rng = np.random.default_rng(7)
    out = []
    for i in range(n):
        prompt = [int(t) for t in rng.integers(1, V, size=3 + 2 * i)]
        prompt += prompt[:4]  # something for prompt lookup to copy
        kw = dict(max_tokens=[1, 9, 40, 23, 60, 5, 33, 17][i % 8])
        if i % 2:
            kw["sampling"] = SamplingParams(temperature=0.9, top_k=8 if i % 3 else 0, seed=100 + i,
                                            repetition_penalty=1.1 if i == 3 else 1.0)
        if i == 4:
            kw["stop"] = ["q"]
        out.append(dict(prompt_ids=prompt, **kw))
    return out


def solo(make_engine, reqs: list[dict]) -> list[GenerationResult]:
    """Each request alone on a fresh engine (a suffix drafter's history starts empty, as in
    a fresh slot)."""
    return [make_engine().generate(r["prompt_ids"], **{k: v for k, v in r.items() if k != "prompt_ids"})
            for r in reqs]


def batched(engine: SpeculativeEngine, reqs: list[dict], join_every: int = 0) -> list[GenerationResult]:
    """Run reqs together: all at once (join_every 0), or one more joining every
    join_every steps; each ends as soon as it is done, freeing its slot."""
    pending = list(enumerate(reqs))
    running, results, steps = [], {}, 0
    while pending or running:
        while pending and engine.free_slots() and (join_every == 0 or steps % join_every == 0 or not running):
            i, r = pending.pop(0)
            running.append((i, engine.begin(r["prompt_ids"], **{k: v for k, v in r.items() if k != "prompt_ids"})))
            if join_every:
                break
        live = [(i, g) for i, g in running if not g.done]
        if live:
            engine.step([g for _, g in live])
        steps += 1
        for i, g in list(running):
            if g.done:
                results[i] = engine.end(g)[-1]
                running.remove((i, g))
    return [results[i] for i in range(len(reqs))]


def same(a: GenerationResult, b: GenerationResult) -> bool:
    return (a.token_ids, a.text, a.finish_reason) == (b.token_ids, b.text, b.finish_reason)


def draft_model(target: BigramLM) -> ModelDrafter:
    # A draft that agrees with the target often, not always: the same table plus noise.
    return ModelDrafter(BigramLM(seed=0, n_seq=target.n_seq, noise=1.5), target=target)


@pytest.mark.parametrize("make_drafter", [lambda t: NoDrafter(), lambda t: NgramDrafter(), lambda t: SuffixDrafter(),
                                          draft_model], ids=["plain", "ngram", "suffix", "draft-model"])
@pytest.mark.parametrize("join_every", [0, 3])
def test_each_batched_generation_equals_its_solo_run(make_drafter, join_every):
    reqs = requests(8)
    t_solo = BigramLM()
    alone = solo(lambda: SpeculativeEngine(t_solo, make_drafter(t_solo), 4, n_slots=1), reqs)
    t = BigramLM()
    engine = SpeculativeEngine(t, make_drafter(t), 4)
    together = batched(engine, reqs, join_every)
    for i, (a, b) in enumerate(zip(alone, together)):
        assert same(a, b), (i, a.token_ids, b.token_ids)
    assert max(t.batch_sizes) >= 4, "the generations did share forwards"
    # The outputs differ from each other (the test is not vacuous) and some stop early.
    assert len({tuple(r.token_ids) for r in together}) == 8
    assert {r.finish_reason for r in together} >= {"length"}
    assert min(len(r.token_ids) for r in together) == 1


CURVE = CostCurve((1, 2, 8, 16, 33, 64), (0.030, 0.050, 0.20, 0.22, 0.40, 0.70))


def controller(kmax: int = 8) -> SpeculationController:
    return SpeculationController([Source(NgramDrafter(), 1e-5), Source(SuffixDrafter(), 1e-5)], CURVE, kmax=kmax)


def test_a_controller_per_slot_keeps_greedy_outputs_equal_to_solo():
    # The batch-aware controller drafts differently beside others than alone: greedy
    # outputs stay identical; sampled ones keep their distribution (the chi-square test
    # below), not their exact draws, since the draws depend on what was drafted.
    reqs = [dict(r, sampling=SamplingParams()) for r in requests(8)]
    alone = solo(lambda: SpeculativeEngine(BigramLM(), controller(), 8, n_slots=1), reqs)
    t = BigramLM()
    together = batched(SpeculativeEngine(t, controller(), 8), reqs)
    assert all(same(a, b) for a, b in zip(alone, together))
    assert max(t.forward_calls) > 8  # some drafted beside the others


def test_sampling_in_a_batch_keeps_the_target_distribution():
    """Chi-square: the first two sampled tokens of a generation that runs beside three
    others (with the batch-aware controller and prompt lookup drafting) follow the
    target's exact joint distribution p(t1 | x, y) p(t2 | y, t1)."""
    from scipy.stats import chisquare

    t = BigramLM(n_seq=4, sharp=1.0)
    engine = SpeculativeEngine(t, controller(kmax=4), 4)
    prompt = [3, 4, 5, 3, 4]  # prompt lookup proposes 5 after (3, 4)

    def probs(x, y):
        z = t.table[x, y] - t.table[x, y].max()
        return np.exp(z) / np.exp(z).sum()

    p1 = probs(prompt[-2], prompt[-1])
    joint = {(a, b): p1[a] * probs(prompt[-1], a)[b] for a in range(1, V) for b in range(V)}
    joint.update({(0, None): p1[0]})
    trials, counts = 3000, {}
    others = [[1, 2, 1, 2, 1], [7, 8, 9, 7, 8], [11, 12, 11, 12, 11]]
    for seed in range(trials):
        gens = [engine.begin(prompt, sampling=SamplingParams(temperature=1.0, seed=seed), max_tokens=2)]
        gens += [engine.begin(o, sampling=SamplingParams(temperature=1.0, seed=10_000 + seed), max_tokens=6)
                 for o in others]
        while any(not g.done for g in gens):
            engine.step([g for g in gens if not g.done])
        ids = [engine.end(g)[-1].token_ids for g in gens][0]
        key = (ids[0], ids[1] if len(ids) > 1 else None) if ids else (0, None)  # [] : the end came first
        counts[key] = counts.get(key, 0) + 1
    keys = [k for k in joint if joint[k] * trials >= 5]
    rest = 1.0 - sum(joint[k] for k in keys)
    obs = [counts.get(k, 0) for k in keys] + [trials - sum(counts.get(k, 0) for k in keys)]
    exp = [joint[k] * trials for k in keys] + [rest * trials]
    assert sum(counts.values()) == trials
    assert chisquare(obs, exp).pvalue > 1e-3


def test_a_finished_or_cancelled_generation_leaves_its_slot_clean():
    t = BigramLM(n_seq=2)
    engine = SpeculativeEngine(t, NgramDrafter(), 4)
    a = engine.begin([1, 2, 3, 4, 1, 2], max_tokens=50)
    b = engine.begin([5, 6, 7, 8], max_tokens=3)
    assert engine.free_slots() == 0
    with pytest.raises(SpecDecodeError, match="no free slot"):
        engine.begin([1, 2], max_tokens=2)
    engine.step([a, b])
    engine.step([a, b])
    assert not a.done
    # a is cancelled mid-way: its sequence keeps exactly its prompt and emitted tokens (less the last).
    result_a = engine.end(a)[-1]
    assert t.caches[a.slot.seq] == [1, 2, 3, 4, 1, 2] + result_a.token_ids[:-1]
    while not b.done:
        engine.step([b])
    result_b = engine.end(b)[-1]
    assert len(result_b.token_ids) == 3
    assert t.caches[b.slot.seq] == [5, 6, 7, 8] + result_b.token_ids[:-1]
    # The next request sharing a's prompt goes to a's slot and prefills only what it lacks.
    calls = len(t.forward_calls)
    c = engine.begin([1, 2, 3, 4, 1, 2, 9, 9], max_tokens=2)
    assert c.slot is a.slot
    # It feeds prompt[keep:-1]: keep = 6 shared tokens (7 when a's first output token was 9).
    assert t.forward_calls[calls:] == ([] if result_a.token_ids[0] == 9 else [1])
    assert t.caches[c.slot.seq] == [1, 2, 3, 4, 1, 2, 9]
    engine.end(c)


def test_a_slot_is_chosen_by_the_longest_cached_prefix():
    t = BigramLM(n_seq=3)
    engine = SpeculativeEngine(t, NoDrafter(), 0)
    gens = [engine.begin(p, max_tokens=1) for p in ([1, 2, 3, 4], [5, 6, 7, 8], [9, 10, 11, 12])]
    slots = [g.slot.seq for g in gens]
    assert sorted(slots) == [0, 1, 2]
    for g in gens:
        engine.step([g])
        engine.end(g)
    assert engine.begin([5, 6, 7, 8, 1], max_tokens=1).slot.seq == slots[1]


def test_a_batched_step_is_one_forward():
    t = BigramLM(n_seq=4)
    engine = SpeculativeEngine(t, NgramDrafter(), 4)
    gens = [engine.begin([1 + i, 2, 3, 1 + i, 2], max_tokens=10) for i in range(4)]
    before = len(t.forward_calls)
    engine.step(gens)
    assert t.batch_sizes[before:] == [4] and len(t.forward_calls) == before + 1


def test_the_batch_planner_fills_the_forward_to_the_sizes_the_curve_rewards():
    # T(n): a forward of 8 tokens costs nearly as much as one of 16 (a kernel tile), and
    # 17+ is steep. Alone, one draft at acceptance 0.5 does not pay (T(2) is nearly 2 T(1));
    # beside 7 others, one draft each (16 tokens) is nearly free and pays.
    curve = CostCurve((1, 2, 8, 9, 16, 17, 24, 33, 64), (0.034, 0.065, 0.209, 0.224, 0.241, 0.30, 0.37, 0.45, 0.74))
    costs = SharedCosts(curve, 33)
    half = [np.diff(expected_tokens_upto(0.5, 4))]  # marginal gains 0.5, 0.25, 0.125, 0.0625
    assert allocate_drafts(half, [1e-5], 1, 1.0, costs.upto) == [0]
    assert allocate_drafts(half * 8, [1e-5] * 8, 8, 8.0, costs.upto) == [1] * 8
    # The likelier drafts get the room: a generation at 0.9 drafts more than one at 0.3.
    mixed = [np.diff(expected_tokens_upto(0.9, 8)), np.diff(expected_tokens_upto(0.3, 8))] * 4
    k = allocate_drafts(mixed, [1e-5] * 8, 8, 8.0, costs.upto)
    assert all(k[i] > k[i + 1] for i in range(0, 8, 2)) and sum(k) <= 8 + 1
    # Drafting cost counts: drafts that cost more than they save are not made.
    assert allocate_drafts(half * 8, [0.05] * 8, 8, 8.0, costs.upto) == [0] * 8
    # So does a draft model's fixed part per drafting step, charged once per generation that drafts.
    assert allocate_drafts(half * 8, [1e-5] * 8, 8, 8.0, costs.upto, [0.05] * 8) == [0] * 8
    assert allocate_drafts(half * 8, [1e-5] * 8, 8, 8.0, costs.upto, [1e-4] * 8) == [1] * 8


def test_the_engine_plans_the_batch_through_the_controllers_offers():
    curve = CostCurve((1, 2, 8, 9, 16, 17, 33, 64), (0.034, 0.065, 0.209, 0.224, 0.241, 0.30, 0.45, 0.74))
    c = SpeculationController([Source(NgramDrafter(), 1e-5)], curve, kmax=8)
    t = BigramLM(n_seq=8)
    engine = SpeculativeEngine(t, c, 8)
    prompts = [[1 + i, 2, 3, 4, 5, 1 + i, 2, 3] for i in range(8)]  # prompt lookup has a match in each
    gens = [engine.begin(p, max_tokens=20) for p in prompts]
    before = len(t.forward_calls)
    engine.step(gens)
    drafted = t.forward_calls[before] - 8
    assert 1 <= drafted <= 9  # filled towards 16 tokens, not past the steep part
    # A fork has its own acceptance estimates and the shared curve.
    f = c.fork(1)
    assert f.sources[0].bands is not c.sources[0].bands and f._costs is c._costs
    for g in gens:
        engine.end(g)


def test_forks_refuse_what_they_cannot_share():
    t = BigramLM(n_seq=2)
    d = ModelDrafter(BigramLM(n_seq=1), target=t)
    with pytest.raises(SpecDecodeError, match="holds 1 sequence"):
        SpeculativeEngine(t, d, 4)
    with pytest.raises(SpecDecodeError, match="n_slots = 3 is out of range"):
        SpeculativeEngine(t, NoDrafter(), 4, n_slots=3)


def test_batched_greedy_on_llama_cpp_equals_solo_or_a_near_tie(smollm_path):
    from specdecode.backends.llama_cpp import LlamaCppBackend
    from specdecode.parity import parity_report

    from test_engine_smollm import PROMPTS, chat_ids

    b = LlamaCppBackend(smollm_path, n_ctx=1024, n_seq=4, name="smollm (4 slots)")
    try:
        prompts = [chat_ids(b, p) for p in PROMPTS] + [chat_ids(b, "Count from 1 to 30."),
                                                       chat_ids(b, "Name three colours.")]
        reqs = [dict(prompt_ids=p, max_tokens=m, record_top2_gaps=True) for p, m in zip(prompts, (48, 64, 40, 1))]
        engine = SpeculativeEngine(b, NgramDrafter(), 4)
        plain = SpeculativeEngine(b, NoDrafter(), 0, n_slots=1)
        alone = solo(lambda: plain, reqs)
        engine.forget_prefix()
        together = batched(engine, reqs)
        for a, t in zip(alone, together):
            report = parity_report(t, a)
            assert report["status"] in ("exact", "near-tie"), report
        assert sum(parity_report(t, a)["status"] == "exact" for a, t in zip(alone, together)) >= 2
        # No sequence keeps more than its output.
        for seq in range(4):
            assert b.seq_len(seq) <= max(len(p) for p in prompts) + 64
    finally:
        b.close()


def test_the_torch_backend_says_it_serves_one_sequence():
    from specdecode.assembly.loading import load_backend

    with pytest.raises(SpecDecodeError, match="serves one sequence at a time"):
        load_backend("some/folder", backend="torch", n_seq=2)


def test_step_takes_running_generations_only():
    t = BigramLM(n_seq=2)
    engine = SpeculativeEngine(t, NoDrafter(), 0)
    assert engine.step([]) == []
    g = engine.begin([1, 2, 3], max_tokens=4)
    with pytest.raises(SpecDecodeError, match="each once"):
        engine.step([g, g])
    engine.end(g)
    with pytest.raises(SpecDecodeError, match="has ended"):
        engine.step([g])
    with pytest.raises(SpecDecodeError, match="already ended"):
        engine.end(g)
