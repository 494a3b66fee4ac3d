"""Trees of drafts from a draft model (EAGLE-2's dynamic tree on the torch backend) and the
node budget (max_tree_nodes) from the API, the engine, the controller, the server and the CLI."""

from __future__ import annotations

import numpy as np
import pytest

from test_torch_backend import backend, models_, tokenizer  # noqa: F401 (fixtures)
from specdecode.backends.tree_shape import tree_prefix_within
from specdecode.control.costmodel import CostCurve
from specdecode.control.controller import Source, SpeculationController
from specdecode.engine.plan import plan_generation
from specdecode.drafters import ModelDrafter, NgramDrafter
from specdecode.drafters.tree import grow_tree, set_tree_options
from specdecode.engine import SpeculativeEngine
from specdecode.errors import SpecDecodeError
from specdecode.limits import DEFAULT_TREE_NODES
from specdecode.request import GenerationOptions


def _pair(models_, tokenizer):  # noqa: F811
    target = backend(models_["llama"], tokenizer, "llama")
    draft = backend(models_["llama_near"], tokenizer, "llama_near")
    return target, draft


def test_every_row_of_a_grown_tree_sees_exactly_its_path(models_, tokenizer):  # noqa: F811
    """Each depth's rows, forwarded under the tree mask after the rows before them, get the
    logits of their path run alone as a chain (float32: exactly, to rounding)."""
    _, d = _pair(models_, tokenizer)
    prompt = tokenizer("def add(a, b):")["input_ids"]
    root = d.forward(prompt, [len(prompt) - 1])[0]
    base, cells, rows_seen = len(prompt), [], []

    def rows(ids, pos, vis):
        out = d.forward_rows(ids, pos, vis)
        for r, t in enumerate(ids):  # the row's path: the tree cells it sees (ancestors), then itself
            path = [cells[c] for c in range(len(cells)) if vis[r, base + c]] + [t]
            assert pos[r] == base + len(path) - 1  # its position is its depth
            rows_seen.append((path, out[r]))
        cells.extend(ids)
        return out

    tree = grow_tree(rows, base, root, depth=4, budget=40, width=3, eog_ids=(), over_target=lambda x: x, min_prob=0.0)
    assert len(rows_seen) == 9 and {len(p) for p, _ in rows_seen} == {1, 2, 3}  # depths 1..3 expanded, 3 each
    d.rollback(base)
    for path, logits in rows_seen:
        alone = d.forward(path, [len(path) - 1])[0]
        d.rollback(base)
        np.testing.assert_allclose(logits, alone, atol=1e-4)
    parents = tree.parents
    assert all(p < i for i, p in enumerate(parents))  # parents first
    assert all(a >= b for a, b in zip(tree.node_probs, tree.node_probs[1:]))  # the likeliest first
    assert len(tree.token_ids) == 30 and max(len(p) for p, _ in rows_seen) == 3  # 3 + 9 + 9 + 9 nodes
    d.rollback(base)
    cells.clear(), rows_seen.clear()
    small = grow_tree(rows, base, root, depth=4, budget=4, width=3, eog_ids=(), over_target=lambda x: x, min_prob=0.0)
    assert len(small.token_ids) == 4 and len(rows_seen) < 9  # nodes that could not make the budget: not expanded
    assert small.token_ids == tree.token_ids[:4] and small.parents == tree.parents[:4]  # the same likeliest nodes
    d.rollback(base)
    few = grow_tree(rows, base, root, depth=4, budget=12, width=3, eog_ids=(), over_target=lambda x: x, min_prob=1.0)
    assert len(few.token_ids) == 3 and few.parents == [-1, -1, -1]  # no depth likely enough to expand


@pytest.mark.parametrize("max_tokens", [6, 33])
def test_greedy_with_draft_model_trees_equals_plain_decoding(models_, tokenizer, max_tokens):  # noqa: F811
    target, d = _pair(models_, tokenizer)
    prompt = tokenizer("def add(a, b):")["input_ids"]
    plain = SpeculativeEngine(target, NgramDrafter(), 0).generate(prompt, max_tokens=max_tokens, plain=True)
    eng = SpeculativeEngine(target, ModelDrafter(d, target), 4, max_tree_nodes=10)
    res = eng.generate(prompt, max_tokens=max_tokens)
    assert res.token_ids == plain.token_ids and res.finish_reason == plain.finish_reason
    st = res.stats
    assert st.tree_steps > 0 and st.tree_nodes > st.tree_steps  # trees of several nodes were verified
    assert target.seq_len(0) <= len(prompt) + len(res.token_ids)  # no other branch stays cached
    chains = SpeculativeEngine(target, ModelDrafter(d, target), 4, max_tree_nodes=0).generate(prompt, max_tokens=max_tokens)
    assert chains.token_ids == plain.token_ids and chains.stats.tree_steps == 0


def test_a_request_may_turn_trees_off_or_size_them(models_, tokenizer):  # noqa: F811
    target, d = _pair(models_, tokenizer)
    prompt = tokenizer("def add(a, b):")["input_ids"]
    eng = SpeculativeEngine(target, ModelDrafter(d, target), 4, max_tree_nodes=10)
    assert eng.generate(prompt, max_tokens=12, max_tree_nodes=0).stats.tree_steps == 0
    small = eng.generate(prompt, max_tokens=12, max_tree_nodes=2).stats
    assert small.tree_steps > 0 and small.tree_nodes <= 2 * small.tree_steps


def budget(target, requested: int | None, default: int | None, **options) -> int:
    """The tree budget the generation's plan gives (:func:`specdecode.engine.plan.plan_generation`)."""
    return plan_generation(GenerationOptions.from_kwargs(None, max_tree_nodes=requested, **options), target, 4,
                           default).tree_nodes


def test_the_budget_defaults_to_chains_and_follows_the_request_then_the_engine(models_, tokenizer):  # noqa: F811
    target, d = _pair(models_, tokenizer)
    assert budget(target, None, None) == 0
    assert budget(target, 5, None) == 5
    assert budget(target, None, 7) == 7
    assert budget(target, 0, 7) == 0  # the request's 0 wins
    assert budget(target, None, DEFAULT_TREE_NODES) == DEFAULT_TREE_NODES
    # Never with penalties, a grammar or batch invariance (drafters.tree.trees_allowed).
    assert budget(target, 5, None, repetition_penalty=1.1) == 0
    assert budget(target, 5, None, batch_invariant="on") == 0
    drafter = ModelDrafter(d, target)
    flat = CostCurve(tuple(range(1, 34)), (0.05,) * 33)
    c = SpeculationController([Source(drafter, 0.0)], flat, kmax=8)
    set_tree_options(c, DEFAULT_TREE_NODES)
    assert drafter.tree_nodes == DEFAULT_TREE_NODES  # a controller's sources get the budget


class ChainsOnly:
    name, supports_tree, kv_shared, attention_chosen = "chains-only", False, False, False


def test_trees_asked_of_a_target_that_verifies_chains_only_are_refused(models_, tokenizer):  # noqa: F811
    with pytest.raises(SpecDecodeError, match="max_tree_nodes = 4: chains-only was loaded to verify chains only") as e:
        budget(ChainsOnly(), 4, None)
    assert e.value.param == "max_tree_nodes"
    assert budget(ChainsOnly(), None, None) == 0


def test_a_grown_tree_under_the_controller_is_cut_to_what_pays(models_, tokenizer):  # noqa: F811
    from specdecode.sampling import Sampler, SamplingParams

    target, d = _pair(models_, tokenizer)
    prompt = tokenizer("def add(a, b):")["input_ids"]
    drafter = ModelDrafter(d, target)
    set_tree_options(drafter, 10, 3)
    steep = CostCurve(tuple(range(1, 34)), tuple(0.05 * n for n in range(1, 34)))  # every row costs a step
    c = SpeculationController([Source(drafter, 0.0)], steep, kmax=8)
    c.start(prompt, Sampler(SamplingParams()))
    draft = c.propose(prompt, 8)
    assert draft.parents is None or len(draft.token_ids) <= 2  # a wide tree never pays at this cost
    flat = CostCurve(tuple(range(1, 34)), (0.05,) * 33)
    c = SpeculationController([Source(drafter, 0.0)], flat, kmax=8)
    c.start(prompt, Sampler(SamplingParams()))
    draft = c.propose(prompt, 8)
    assert draft.parents is not None and len(draft.token_ids) == 10  # free rows: the whole budget


def test_tree_prefix_within_a_number_of_leaves():
    parents = [-1, -1, 0, 0, 1, 2]  # leaves after each node: 1, 2, 2, 3, 3, 3
    assert tree_prefix_within(parents, 8) == 6
    assert tree_prefix_within(parents, 2) == 3
    assert tree_prefix_within(parents, 1) == 1


@pytest.mark.parametrize("value", [-1, 65, 2.5, "8", True])
def test_an_out_of_range_budget_is_refused(value):
    with pytest.raises(SpecDecodeError, match="max_tree_nodes") as e:
        GenerationOptions(max_tree_nodes=value)
    assert e.value.param == "max_tree_nodes"


def test_the_speculative_extension_takes_max_tree_nodes():
    from specdecode.server.extensions import parse_speculative

    assert parse_speculative({"max_tree_nodes": 12}) == {"max_tree_nodes": 12}
    with pytest.raises(SpecDecodeError, match=r"speculative.max_tree_nodes = 99 is out of range") as e:
        parse_speculative({"max_tree_nodes": 99})
    assert e.value.param == "speculative.max_tree_nodes"


def test_the_cli_refuses_an_out_of_range_budget_before_loading(capsys):
    from specdecode.cli import main

    assert main(["generate", "--max-tree-nodes", "65", "--prompt", "hi"]) != 0
    err = capsys.readouterr().err
    assert "--max-tree-nodes 65 is out of range" in err and "Traceback" not in err
    from specdecode.cli import build_parser

    assert build_parser().parse_args(["generate", "--max-tree-nodes"]).max_tree_nodes == DEFAULT_TREE_NODES
    assert build_parser().parse_args(["generate"]).max_tree_nodes is None


def test_an_ambiguous_ngram_match_drafts_the_trie_of_its_continuations():
    from specdecode.sampling import Sampler, SamplingParams

    d = NgramDrafter(max_ngram=2)
    context = [1, 2, 3, 1, 9, 1, 2, 4, 1, 7, 1, 2, 3, 5, 8, 1, 2]  # "1 2" before 3, 4 and 3
    d.start(context, Sampler(SamplingParams()))
    chain = d.propose(context, 2)
    assert chain.parents is None  # no budget: the chain of the best occurrence
    set_tree_options(d, 8, 3)
    tree = d.propose(context, 2)
    assert tree.chain().token_ids == chain.token_ids  # its first path is that chain
    paths = {}
    for i, (t, p) in enumerate(zip(tree.token_ids, tree.parents)):
        paths[i] = (paths[p] if p >= 0 else ()) + (t,)
    assert sorted(paths.values()) == [(3,), (3, 1), (3, 5), (4,), (4, 1)]
    # The r-th best occurrence weighs 1 / r: "3" follows the first and the third, "4" the second.
    assert tree.token_ids[0] == 3 and tree.node_probs[0] == pytest.approx((1 + 1 / 3) / (1 + 1 / 2 + 1 / 3))
    assert all(p < i for i, p in enumerate(tree.parents))
    unique = [5, 6, 7, 5, 6]
    d.start(unique, Sampler(SamplingParams()))
    assert d.propose(unique, 2).parents is None  # a unique match stays a chain
    d.start(context, Sampler(SamplingParams(temperature=0.8)))
    assert d.propose(context, 2).parents is None  # sampled generations draft chains


def test_greedy_with_ngram_trees_equals_plain_decoding(models_, tokenizer):  # noqa: F811
    target, _ = _pair(models_, tokenizer)
    prompt = tokenizer("def add(a, b): return a + b\ndef sub(a, b): return a - b\ndef mul(a, b):")["input_ids"]
    plain = SpeculativeEngine(target, NgramDrafter(), 0).generate(prompt, max_tokens=40, plain=True)
    res = SpeculativeEngine(target, NgramDrafter(), 4, max_tree_nodes=8).generate(prompt, max_tokens=40)
    assert res.token_ids == plain.token_ids
    assert res.stats.tree_steps > 0


def test_a_lookups_tree_keeps_its_first_path_and_weighs_only_the_rest():
    from specdecode.control.tree_plan import TreeCalibration, plan_tree
    from specdecode.drafters import Draft

    tree = Draft([5, 6, 7, 8], None, [-1, -1, 0, 1], [0.5, 0.4, 0.3, 0.1])  # first path 5 > 7
    steep = np.array([0.0] + [0.05 * n for n in range(1, 40)])
    cal = TreeCalibration(prior=1.0)
    assert plan_tree(tree, cal, steep, 0.0).token_ids == []  # on its own the tree does not pay here
    kept = plan_tree(tree, cal, steep, 0.0, keep_first_path=True)
    assert kept.token_ids == [5, 7] and kept.parents == [-1, 0]  # the chain stays, its siblings go
    flat = np.array([0.0] + [0.05] * 40)
    full = plan_tree(tree, cal, flat, 0.0, keep_first_path=True)
    assert full.token_ids == [5, 7, 6, 8] and full.parents == [-1, 0, -1, 2]
