"""Token trees: the acceptance rules over a tree of drafts (greedy, seeded Gumbel and
SpecInfer's multi-draft sampling), on crafted cases, against the chain rules, and by
chi-square with fixed seeds and a negative control."""

from __future__ import annotations

import numpy as np
import pytest

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
    tree = b.forward_tree(block, TREE_PARENTS)
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
