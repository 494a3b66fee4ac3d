"""Token trees: the acceptance rules over a tree of drafts (greedy, seeded Gumbel and
SpecInfer's multi-draft sampling), on crafted cases, against the chain rules, and by
chi-square with fixed seeds and a negative control."""

from __future__ import annotations

import numpy as np
import pytest

from conftest import step_outcome
from test_verify import _chi2_pvalue
from specdecode.verify import (tree_children, tree_path_tokens, verify_greedy, verify_tree_greedy, verify_tree_keyed,
                               verify_tree_sampling)

# root -> 5 (node 0) -> 7 (node 2) ; root -> 6 (node 1) -> 8 (node 3), 9 (node 4)
TOKENS = [5, 6, 7, 8, 9]
PARENTS = [-1, -1, 0, 1, 1]


def test_children_and_bad_parents():
    assert tree_children(PARENTS) == [[0, 1], [2], [3, 4], [], [], []]
    with pytest.raises(ValueError, match="parents\\[1\\]"):
        tree_children([-1, 1])


@pytest.mark.parametrize("argmax, path, nxt, bonus", [
    ([6, 0, 9, 0, 0, 3], (1, 4), 3, True),     # the second sibling, then its second child: a leaf, bonus
    ([5, 7, 0, 1, 0, 0], (0, 2), 1, True),     # the first branch to its leaf
    ([6, 0, 0, 0, 0, 0], (1,), 0, False),      # the sibling, then none of its children: recovered
    ([4, 7, 7, 7, 7, 7], (), 4, False),        # no child of the root
])
def test_greedy_takes_the_longest_path_of_argmaxes(argmax, path, nxt, bonus):
    r = verify_tree_greedy(TOKENS, PARENTS, argmax)
    assert (r.path, r.next_token, r.is_bonus) == (path, nxt, bonus)
    assert tree_path_tokens(TOKENS, r) == [TOKENS[i] for i in path] + [nxt]
    assert verify_tree_keyed(TOKENS, PARENTS, lambda row: argmax[row]) == r


@pytest.mark.parametrize("argmax", [[3, 4, 5, 6], [3, 4, 9, 6], [1, 4, 5, 6], [3, 4, 5, 2]])
def test_a_chain_is_the_tree_of_width_one(argmax):
    draft = [3, 4, 5]
    chain = verify_greedy(draft, argmax)
    tree = verify_tree_greedy(draft, [-1, 0, 1], argmax)
    assert tree.num_accepted == chain.num_accepted and tree.next_token == chain.next_token
    assert tree.is_bonus == chain.is_bonus


def test_shapes_and_repeated_siblings_are_refused():
    with pytest.raises(ValueError):
        verify_tree_greedy(TOKENS, PARENTS, [0] * 5)
    with pytest.raises(ValueError, match="siblings"):
        verify_tree_sampling([3, 3], [-1, -1], np.full((3, 4), 0.25), np.random.default_rng(0))


V = 6
ROWS = np.array([[0.30, 0.25, 0.05, 0.15, 0.10, 0.15],   # root
                 [0.10, 0.40, 0.20, 0.10, 0.10, 0.10],   # after node 0 (token 0)
                 [0.05, 0.05, 0.50, 0.20, 0.10, 0.10],   # after node 1 (token 1)
                 [0.20, 0.20, 0.20, 0.20, 0.10, 0.10],   # after node 2
                 [0.25, 0.25, 0.10, 0.10, 0.15, 0.15]])  # after node 3
# Root children: tokens 0 and 1 (nodes 0, 1); node 0 has children 1, 2 (nodes 2, 3).
T_TOKENS, T_PARENTS = [0, 1, 1, 2], [-1, -1, 0, 0]


def _wrong_rule(tokens, parents, probs, rng):
    """Negative control: accept each drafted sibling with its own probability p(c), in
    order, without taking the rejected siblings' mass out (over-weights later siblings'
    rejections: not the target's distribution)."""
    kids = tree_children(parents)[0]
    for c in kids:
        if rng.random() < probs[0][tokens[c]]:
            return tokens[c]
    r = probs[0].copy()
    r[[tokens[c] for c in kids]] = 0
    return int(rng.choice(V, p=r / r.sum()))


@pytest.mark.parametrize("rule", ["tree", "wrong"])
def test_tree_sampling_keeps_the_targets_distribution(rule):
    rng = np.random.default_rng(1234)
    n = 20000
    first = np.zeros(V)
    second = np.zeros(V)  # the token after a first token 0 (the root's first child)
    for _ in range(n):
        if rule == "tree":
            r = verify_tree_sampling(T_TOKENS, T_PARENTS, ROWS, rng)
            toks = tree_path_tokens(T_TOKENS, r)
        else:
            toks = [_wrong_rule(T_TOKENS, T_PARENTS, ROWS, rng)]
        first[toks[0]] += 1
        if rule == "tree" and toks[0] == 0:
            second[toks[1]] += 1
    p = _chi2_pvalue(first, ROWS[0])
    if rule == "wrong":
        assert p < 1e-6  # the test can tell a wrong rule
        return
    assert p > 1e-3
    assert _chi2_pvalue(second, ROWS[1]) > 1e-3  # after node 0, the target's row for it


# --- tree attention on the torch backend --------------------------------------------------

from test_torch_backend import backend, models_, tokenizer  # noqa: E402, F401 (fixtures)

TREE_TOKENS = [11, 12, 13, 14, 15, 16]
TREE_PARENTS = [-1, -1, 0, 0, 1, 3]  # root -> 11 -> {13, 14 -> 16}; root -> 12 -> 15


def _path_rows(parents, node):
    rows = [node + 1]
    while parents[rows[-1] - 1] != -1:
        rows.append(parents[rows[-1] - 1] + 1)
    return [0] + rows[::-1]


@pytest.mark.parametrize("kind", ["llama", "qwen2"])
def test_torch_tree_rows_equal_each_path_run_alone(models_, tokenizer, kind):  # noqa: F811
    """Every row of a tree forward has the logits of its path run alone as a chain (float32,
    tiny models); after keeping the root and one path, the cache continues as that chain's."""
    b = backend(models_[kind], tokenizer, kind)
    prompt = tokenizer("def add(a, b):")["input_ids"]
    b.forward(prompt[:-1], [])
    block = [prompt[-1]] + TREE_TOKENS
    tree, _ = b.forward_tree(block, TREE_PARENTS)
    assert tree.shape == (len(block), b.n_vocab) and b.seq_len(0) == len(prompt) - 1 + len(block)
    base = len(prompt) - 1
    for node in range(len(TREE_TOKENS)):
        rows = _path_rows(TREE_PARENTS, node)
        b2 = backend(models_[kind], tokenizer, kind)
        alone = b2.forward(prompt[:-1] + [block[r] for r in rows], list(range(base, base + len(rows))))
        np.testing.assert_allclose(tree[rows], alone, atol=1e-4, rtol=1e-4)
    rows = _path_rows(TREE_PARENTS, 5)  # root, 11, 14, 16
    b.keep_tree_rows(rows, len(block))
    assert b.seq_len(0) == base + len(rows)
    nxt = b.forward([7], [0])
    b2 = backend(models_[kind], tokenizer, kind)
    chain = b2.forward(prompt[:-1] + [block[r] for r in rows] + [7], [base + len(rows)])
    np.testing.assert_allclose(nxt, chain, atol=1e-4, rtol=1e-4)
    with pytest.raises(ValueError):
        b.keep_tree_rows([2, 1], 3)


# --- the engine's tree step ---------------------------------------------------------------

from specdecode.drafters import Draft, DrafterBase  # noqa: E402
from specdecode.drafters.heads import medusa_tree  # noqa: E402
from specdecode.engine import SpeculativeEngine  # noqa: E402


class TreeOracle(DrafterBase):
    """Trees around a known output: the root's first child is always wrong, the second
    starts the known continuation (depth up to ``depth``), with a wrong sibling under it."""

    name = "tree-oracle"

    def __init__(self, prompt_len, output, depth=4, wrong=3):
        self.prompt_len, self.output, self.depth, self.wrong = prompt_len, list(output), depth, wrong

    def propose(self, context, k):
        i = len(context) - self.prompt_len
        truth = self.output[i:i + self.depth]
        if not truth:
            return Draft([])
        bad = lambda t: (t + self.wrong) % 50 + 1  # noqa: E731
        tokens, parents = [bad(truth[0]), truth[0]], [-1, -1]
        for t in truth[1:]:
            tokens += [bad(t), t]
            parents += [len(tokens) - 3, len(tokens) - 3]  # both children of the last true node
        return Draft(tokens[:k], None, parents[:k])


def _tiny(models_, tokenizer, kind="llama"):  # noqa: F811
    return backend(models_[kind], tokenizer, kind)


@pytest.mark.parametrize("max_tokens", [5, 23, 40])
def test_greedy_with_trees_equals_plain_decoding(models_, tokenizer, max_tokens):  # noqa: F811
    b = _tiny(models_, tokenizer)
    prompt = tokenizer("def add(a, b):")["input_ids"]
    plain = SpeculativeEngine(b, TreeOracle(0, []), 0).generate(prompt, max_tokens=max_tokens, plain=True)
    eng = SpeculativeEngine(b, TreeOracle(len(prompt), plain.token_ids), 12, max_tree_nodes=12)
    res = eng.generate(prompt, max_tokens=max_tokens)
    assert res.token_ids == plain.token_ids and res.finish_reason == plain.finish_reason
    st = res.stats
    assert st.tree_steps > 0 and st.accepted_per_rank[1] > 0  # the second sibling was the right one
    assert st.target_forward_passes < len(plain.token_ids)
    assert b.seq_len(0) <= len(prompt) + len(res.token_ids)  # nothing of the other branches stays cached
    assert st.drafted > st.accepted  # every verified node counts as drafted


def test_a_stop_string_inside_the_accepted_path(models_, tokenizer):  # noqa: F811
    b = _tiny(models_, tokenizer)
    prompt = tokenizer("def add(a, b):")["input_ids"]
    plain = SpeculativeEngine(b, TreeOracle(0, []), 0).generate(prompt, max_tokens=30, plain=True)
    text = plain.text
    j = next(j for j in range(len(text) // 3, len(text) - 1) if text[j:j + 2].isascii() and text[j:j + 2].isalnum())
    stop = text[j:j + 2]  # whole characters of the output, past its first third
    want = SpeculativeEngine(b, TreeOracle(0, []), 0).generate(prompt, max_tokens=30, plain=True, stop=[stop])
    assert want.finish_reason == "stop"
    res = SpeculativeEngine(b, TreeOracle(len(prompt), plain.token_ids, depth=8), 16, max_tree_nodes=16).generate(
        prompt, max_tokens=30, stop=[stop])
    assert res.text == want.text and res.finish_reason == "stop" and res.stats.tree_steps > 0


def test_seeded_sampling_with_trees_is_plain_decodings_text(models_, tokenizer):  # noqa: F811
    b = _tiny(models_, tokenizer)
    prompt = tokenizer("def add(a, b):")["input_ids"]
    kw = dict(max_tokens=30, temperature=1.0, seed=5, sampling_rule="gumbel", batch_invariant="off")
    plain = SpeculativeEngine(b, TreeOracle(0, []), 0).generate(prompt, plain=True, **kw)
    res = SpeculativeEngine(b, TreeOracle(len(prompt), plain.token_ids), 12, max_tree_nodes=12).generate(prompt, **kw)
    assert res.token_ids == plain.token_ids and res.stats.tree_steps > 0


def test_trees_fall_back_to_their_first_path_where_they_cannot_be_verified():
    d = Draft([5, 6, 7, 8], None, [-1, -1, 0, 2])
    assert d.chain().token_ids == [5, 7, 8]
    assert Draft([1, 2]).chain().token_ids == [1, 2]


def test_medusa_tree_expands_the_likeliest_paths_first():
    logits = np.log(np.array([[0.6, 0.3, 0.1, 1e-9], [0.1, 0.8, 0.1, 1e-9], [0.5, 0.2, 0.3, 1e-9]]))
    d = medusa_tree(logits, width=2, budget=5)
    # Paths by probability: 0 (.6), 0>1 (.48), 1 (.3), then 1>1 and 0>1>0 (.24 each; the shallower first)
    assert d.token_ids == [0, 1, 1, 1, 0] and d.parents == [-1, 0, -1, 2, 1]
    d = medusa_tree(logits, width=2, budget=3, eog_ids={0})  # an end-of-generation node gets no children
    assert d.token_ids == [0, 1, 1] and d.parents == [-1, -1, 1]


# --- trees on llama.cpp (sequence ids) ---------------------------------------------------

@pytest.fixture(scope="module")
def smollm_trees(smollm_path):
    """smollm2 on llama.cpp with branch sequences for trees (as Decoder(max_tree_nodes > 0) loads it)."""
    from specdecode.backends.llama_cpp import LlamaCppBackend
    from specdecode.backends.llama_cpp.tree import TREE_BRANCHES

    b = LlamaCppBackend(smollm_path, n_ctx=2048, name="smollm2-135m-instruct", tree_branches=TREE_BRANCHES)
    yield b
    b.close()


def test_llama_without_branches_verifies_no_trees(smollm):
    assert not smollm.supports_tree  # the default context: its sequences are the slots'


def test_llama_tree_rows_match_each_path_and_keep_one(smollm_trees):
    """Each row of a tree decoded through branch sequence ids has its path's logits run
    alone (within batched numerics, and the same argmax); keeping a path leaves the cache
    as that chain's, and the branch sequences empty."""
    from specdecode.backends.llama_cpp.tree import TREE_BRANCHES

    smollm = smollm_trees
    prompt = smollm.tokenize("def add(a, b):\n    return", add_special=True)
    smollm.rollback(0)
    smollm.forward(prompt[:-1], [])
    base = len(prompt) - 1
    block = [prompt[-1]] + [smollm.tokenize(w, add_special=False)[0] for w in (" a", " b", " +", " -", " b", " (")]
    tree, _ = smollm.forward_tree(block, TREE_PARENTS)
    for node in range(len(TREE_PARENTS)):
        rows = _path_rows(TREE_PARENTS, node)
        smollm.rollback(base)
        alone = smollm.forward([block[r] for r in rows], list(range(len(rows))))
        np.testing.assert_allclose(tree[rows], alone, atol=1.0)
        assert (tree[rows].argmax(axis=1) == alone.argmax(axis=1)).all()
    smollm.rollback(base)
    smollm.forward_tree(block, TREE_PARENTS)
    rows = _path_rows(TREE_PARENTS, 5)
    smollm.keep_tree_rows(rows, len(block))
    assert smollm.seq_len(0) == base + len(rows)
    after = smollm.forward([block[1]], [0])
    smollm.rollback(base)
    chain = smollm.forward([block[r] for r in rows] + [block[1]], [len(rows)])
    np.testing.assert_allclose(after, chain, atol=1.0)
    assert after.argmax() == chain.argmax()
    for j in range(TREE_BRANCHES):  # nothing left in the branch sequences
        assert smollm._lib.llama_memory_seq_pos_max(smollm._mem, smollm.n_seq + j) == -1
    smollm.rollback(0)


def test_greedy_with_trees_on_llama_cpp_equals_plain(smollm_trees):
    smollm = smollm_trees
    prompt = smollm.tokenize("def fibonacci(n):", add_special=True)
    plain = SpeculativeEngine(smollm, TreeOracle(0, []), 0).generate(prompt, max_tokens=40, plain=True,
                                                                      record_top2_gaps=True)
    res = SpeculativeEngine(smollm, TreeOracle(len(prompt), plain.token_ids), 12, max_tree_nodes=12).generate(prompt, max_tokens=40)
    from specdecode.parity import parity_report
    assert parity_report(res, plain)["status"] in ("exact", "near-tie")
    assert res.stats.tree_steps > 0 and res.stats.accepted_per_rank[1] > 0


# --- the tree's shape from the cost -------------------------------------------------------

from specdecode.control.controller import Source, SpeculationController  # noqa: E402
from specdecode.control.costmodel import CostCurve  # noqa: E402
from specdecode.control.tree_plan import TreeCalibration, plan_tree  # noqa: E402

TREE = Draft([5, 6, 7, 8, 9, 10], None, [-1, -1, 0, 0, 2, 1], [0.6, 0.3, 0.4, 0.15, 0.2, 0.1])
FLAT_T = np.array([0.0] + [0.05] * 40)                               # verification nearly free
STEEP_T = np.array([0.0] + [0.05 * n for n in range(1, 41)])          # every row costs a step


def test_the_tree_keeps_the_prefix_that_pays():
    cal = TreeCalibration(prior=1.0)
    assert plan_tree(TREE, cal, FLAT_T, 0.0).token_ids == TREE.token_ids  # free rows: all of it
    assert plan_tree(TREE, cal, STEEP_T, 0.0).token_ids == []  # each node costs a plain step: none pays
    mid = np.array([0.0, 0.05, 0.055, 0.06, 0.065, 0.12, 0.15, 0.18] + [0.2] * 33)  # a bend after 4 rows
    cut = plan_tree(TREE, cal, mid, 0.0)
    assert cut.token_ids == [5, 6, 7] and cut.parents == [-1, -1, 0]  # the bend: three nodes
    assert plan_tree(Draft([1, 2]), cal, FLAT_T, 0.0).token_ids == [1, 2]  # a chain is left alone


def test_the_calibration_learns_how_far_the_drafters_probabilities_are_from_the_target():
    cal = TreeCalibration(prior=1.0)
    for _ in range(40):
        cal.update(expected=2.0, accepted=0)  # confident trees that never hold
    assert cal.factor < 0.1
    mid = np.array([0.0, 0.05, 0.055, 0.06, 0.065, 0.12, 0.15, 0.18] + [0.2] * 33)
    assert plan_tree(TREE, cal, mid, 0.0).token_ids == []  # and the tree is no longer drafted
    good = TreeCalibration(prior=0.2)
    for _ in range(40):
        good.update(expected=1.0, accepted=1)
    assert good.factor > 0.9


class TreeHeads(DrafterBase):
    """A drafter of fixed probability-ordered trees (tree_nodes > 0, as heads with trees)."""

    name = "tree-heads"
    tree_nodes = 8

    def propose(self, context, k):
        return Draft(TREE.token_ids[:k], None, TREE.parents[:k], TREE.node_probs[:k])


def test_the_controller_drafts_trees_where_the_cost_is_flat_and_chains_where_it_is_not():
    flat = CostCurve(tuple(range(1, 34)), (0.05,) * 33)
    c = SpeculationController([Source(TreeHeads(), 0.0)], flat, kmax=8)
    c.start([1, 2], None)
    d = c.propose([1, 2], 8)
    assert d.parents is not None and len(d.token_ids) == 6
    c.observe(step_outcome(2, drafted=6))
    steep = CostCurve(tuple(range(1, 34)), tuple(0.05 * n for n in range(1, 34)))
    c = SpeculationController([Source(TreeHeads(), 0.0)], steep, kmax=8)
    c.start([1, 2], None)
    assert c.propose([1, 2], 8).token_ids == []


def test_the_statistics_block_reports_tree_steps_and_ranks(models_, tokenizer):  # noqa: F811
    from specdecode.cli import _stats_block

    b = _tiny(models_, tokenizer)
    prompt = tokenizer("def add(a, b):")["input_ids"]
    plain = SpeculativeEngine(b, TreeOracle(0, []), 0).generate(prompt, max_tokens=20, plain=True)
    res = SpeculativeEngine(b, TreeOracle(len(prompt), plain.token_ids), 12, max_tree_nodes=12).generate(prompt, max_tokens=20)
    d = res.stats.to_dict()
    assert d["tree_steps"] == res.stats.tree_steps > 0 and sum(d["accepted_per_rank"]) == d["accepted"]
    block = _stats_block("x", d)
    assert f"trees: {d['tree_steps']} tree steps" in block and "rank 1:" in block


def test_trees_in_a_batch_keep_every_sequence_to_its_committed_tokens(smollm_path):
    """Two generations on llama.cpp with branch sequences: while both run, each drafts its
    tree's first path (a batched step verifies chains); once one has ended the other's trees
    are verified as trees. After every step each sequence holds exactly its committed tokens
    but the last, the branch sequences hold nothing, and both outputs are plain decoding's."""
    from specdecode.backends.llama_cpp import LlamaCppBackend
    from specdecode.backends.llama_cpp.tree import TREE_BRANCHES
    from specdecode.parity import parity_report

    b = LlamaCppBackend(smollm_path, n_ctx=1024, name="smollm2-135m-instruct", n_seq=2, tree_branches=TREE_BRANCHES)
    try:
        prompts = [b.tokenize(t, add_special=True) for t in ("def fibonacci(n):", "def add(a, b):")]
        plains = [SpeculativeEngine(b, TreeOracle(0, []), 0, n_slots=1).generate(
            p, max_tokens=m, plain=True, record_top2_gaps=True) for p, m in zip(prompts, (30, 10))]
        eng = SpeculativeEngine(b, TreeOracle(0, []), 8, n_slots=2, max_tree_nodes=8)
        gens = [eng.begin(p, drafter=TreeOracle(len(p), pl.token_ids), max_tokens=m)
                for p, pl, m in zip(prompts, plains, (30, 10))]
        results, batched_trees = {}, None
        while any(not g.done for g in gens):
            running = [g for g in gens if not g.done]
            eng.step(running)
            for g in running:
                assert b.seq_len(g.slot.seq) == len(g.committed) - 1
            for j in range(TREE_BRANCHES):
                assert b._lib.llama_memory_seq_pos_max(b._mem, b.n_seq + j) == -1
            if len(running) == 2:
                batched_trees = sum(g.out.stats.tree_steps for g in gens)
            for g in gens:
                if g.done and id(g) not in results:
                    results[id(g)] = [x for x in eng.end(g) if hasattr(x, "token_ids")][0]
        assert batched_trees == 0  # two in the step: chains
        assert results[id(gens[0])].stats.tree_steps > 0  # alone: trees
        for g, pl in zip(gens, plains):
            assert parity_report(results[id(g)], pl)["status"] in ("exact", "near-tie")
    finally:
        b.close()


class EosSiblings(TreeOracle):
    """TreeOracle whose wrong sibling at every node is the end-of-generation token."""

    def __init__(self, prompt_len, output, eos):
        super().__init__(prompt_len, output)
        self.eos = eos

    def propose(self, context, k):
        d = super().propose(context, k)
        tokens = [self.eos if i % 2 == 0 else t for i, t in enumerate(d.token_ids)]  # the even nodes are the wrong ones
        return Draft(tokens, None, d.parents)


def test_an_end_of_generation_token_in_a_rejected_branch_ends_nothing(models_, tokenizer):  # noqa: F811
    b = _tiny(models_, tokenizer)
    prompt = tokenizer("def add(a, b):")["input_ids"]
    eos = tokenizer.eos_token_id
    plain = SpeculativeEngine(b, TreeOracle(0, []), 0).generate(prompt, max_tokens=30, plain=True)
    assert eos not in plain.token_ids
    res = SpeculativeEngine(b, EosSiblings(len(prompt), plain.token_ids, eos), 12, max_tree_nodes=12).generate(
        prompt, max_tokens=30)
    assert res.token_ids == plain.token_ids and res.finish_reason == plain.finish_reason == "length"
    assert res.stats.tree_steps > 0 and res.stats.accepted_per_rank[1] > 0


def test_an_end_of_generation_token_inside_the_accepted_path(smollm_trees):
    """The known answer's end-of-generation token drafted inside the tree's true branch: the
    output ends there, as plain decoding's does."""
    smollm = smollm_trees
    text = smollm.apply_chat_template([{"role": "user", "content": "What is 2 + 2? Answer with the number only."}])
    prompt = smollm.tokenize(text, add_special=False)
    plain = SpeculativeEngine(smollm, TreeOracle(0, []), 0).generate(prompt, max_tokens=120, plain=True,
                                                                      record_top2_gaps=True)
    assert plain.finish_reason == "stop"  # the model ended its answer itself
    smollm.rollback(0)
    seq = prompt + plain.token_ids
    eos = int(smollm.forward(seq, [len(seq) - 1])[0].argmax())  # the end-of-generation token it chose
    smollm.rollback(0)
    assert eos in smollm.eog_ids
    truth = plain.token_ids + [eos]
    res = SpeculativeEngine(smollm, TreeOracle(len(prompt), truth, depth=6), 12, max_tree_nodes=12).generate(
        prompt, max_tokens=120)
    from specdecode.parity import parity_report
    assert parity_report(res, plain)["status"] in ("exact", "near-tie")
    assert res.finish_reason == "stop" and res.stats.tree_steps > 0 and res.stats.eog_committed == 1
    assert smollm.seq_len(0) <= len(prompt) + len(res.token_ids)
