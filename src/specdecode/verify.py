"""Acceptance rules: pure functions over arrays (no model, no cache, no I/O).

Dimension letters used in shape comments:
    K: number of drafted tokens in this step (``num_speculative_tokens``), K >= 0
    V: vocabulary size

Sources:
    Leviathan, Kalman, Matias, "Fast Inference from Transformers via Speculative
    Decoding" (ICML 2023), Algorithm 1 and Section 2.3 (speculative sampling).
    Chen et al., "Accelerating Large Language Model Decoding with Speculative
    Sampling" (DeepMind 2023), Algorithm 2 (modified rejection sampling).
    Stern, Shazeer, Uszkoreit, "Blockwise Parallel Decoding for Deep Autoregressive
    Models" (NeurIPS 2018), Section 3 (greedy verification by exact match).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Sequence

import numpy as np

from .backends.tree_shape import tree_depths
from .sampling import sample_token


@dataclass(frozen=True)
class VerifyResult:
    """Outcome of verifying one block of drafts.

    num_accepted: drafted tokens accepted, 0..K (a prefix of the draft).
    next_token: the target's own token appended after the accepted prefix: the
        recovered token if a draft was rejected, else the bonus token.
    is_bonus: True when all K drafts were accepted and next_token is the bonus token.
    """

    num_accepted: int
    next_token: int
    is_bonus: bool


def committed_tokens(draft_ids: Sequence[int], result: VerifyResult) -> list[int]:
    """The tokens a step commits: the accepted drafts, then the target's own token.

    draft_ids: [K]. Returns a list of result.num_accepted + 1 token ids.
    """
    return [int(t) for t in draft_ids[: result.num_accepted]] + [result.next_token]


def verify_greedy(draft_ids: Sequence[int], target_argmax: Sequence[int]) -> VerifyResult:
    """Greedy verification (temperature 0): accept drafts while each equals the target's argmax.

    draft_ids: [K] drafted token ids.
    target_argmax: [K+1] argmax of the target's (shaped) logits at each verified position;
        position i predicts the token after the committed prefix plus draft_ids[:i].

    Returns the number of accepted drafts n and, as next_token, target_argmax[n]:
    the target's correction at the first mismatch, or the bonus token when n == K.
    This is exact-match verification (Stern et al. 2018, Sec. 3; Leviathan et al.
    2023, Sec. 2.3 with temperature 0).

    Raises ValueError if len(target_argmax) != len(draft_ids) + 1.
    """
    k = len(draft_ids)
    if len(target_argmax) != k + 1:
        raise ValueError(f"target_argmax has {len(target_argmax)} positions, expected K+1 = {k + 1}")
    n = 0
    while n < k and int(draft_ids[n]) == int(target_argmax[n]):
        n += 1
    return VerifyResult(num_accepted=n, next_token=int(target_argmax[n]), is_bonus=(n == k))


def verify_speculative_sampling(
    draft_ids: Sequence[int],
    draft_probs: np.ndarray | None,
    target_probs: np.ndarray,
    rng: np.random.Generator,
) -> VerifyResult:
    """The speculative sampling rule (Leviathan et al. 2023, Algorithm 1; Chen et al. 2023, Alg. 2).

    draft_ids: [K] drafted token ids.
    draft_probs: [K, V] the distribution each drafted token was actually drawn from
        (after the same shaping the target uses), or None for drafters that give no
        probabilities (ngram, greedy drafts): then each row is one-hot at the draft.
    target_probs: [K+1, V] the target's shaped distribution at each verified position.
    rng: the generator that supplies the uniform draws (seeded for reproducibility).

    For i = 0..K-1, accept draft x = draft_ids[i] with probability
    min(1, target(x) / draft(x)). At the first rejection, sample the recovered token from
    normalize(max(0, target_probs[i] - draft_probs[i])) and stop. If all K are accepted,
    sample the bonus token from target_probs[K]. The committed tokens are then distributed
    exactly as sampling from target_probs autoregressively (Leviathan et al., Theorem 1).

    Raises ValueError on inconsistent shapes.
    """
    k = len(draft_ids)
    if target_probs.ndim != 2 or target_probs.shape[0] != k + 1:
        raise ValueError(f"target_probs has shape {target_probs.shape}, expected (K+1, V) with K = {k}")
    if draft_probs is not None and (draft_probs.ndim != 2 or draft_probs.shape != (k, target_probs.shape[1])):
        raise ValueError(f"draft_probs has shape {draft_probs.shape}, expected ({k}, {target_probs.shape[1]})")
    for i in range(k):
        x = int(draft_ids[i])
        p_target = float(target_probs[i, x])
        p_draft = 1.0 if draft_probs is None else float(draft_probs[i, x])
        if p_draft <= 0.0:
            # A token the drafter could not have drawn: treat as certain rejection of that token.
            accept = False
        else:
            accept = rng.random() < min(1.0, p_target / p_draft)
        if accept:
            continue
        residual = np.asarray(target_probs[i], dtype=np.float64).copy()
        if draft_probs is None:
            residual[x] = max(0.0, residual[x] - 1.0)
        else:
            residual = np.maximum(residual - draft_probs[i], 0.0)
        if not residual.sum() > 0.0:
            # Only reachable through floating-point round-off when target == draft; then
            # sampling from the target itself is the correct limit.
            residual = np.asarray(target_probs[i], dtype=np.float64)
        return VerifyResult(num_accepted=i, next_token=sample_token(residual, rng), is_bonus=False)
    return VerifyResult(num_accepted=k, next_token=sample_token(target_probs[k], rng), is_bonus=True)


def verify_keyed(draft_ids: Sequence[int], target_token: Callable[[int], int]) -> VerifyResult:
    """Verification when the target's token at each position is a function of its
    distribution and that position's noise alone (the "gumbel" rule,
    :meth:`specdecode.sampling.Sampler.draw`): accept drafts while each equals the target's
    token there; the first that does not is replaced by the target's (recovered), and when
    all K match the target's token at position K is the bonus. The committed tokens are then
    exactly what plain decoding with the same seed produces, so the output has the target's
    distribution whatever drafted them, and a deterministic draft is accepted with the target's
    probability of it, as under the rejection rule (Leviathan et al. 2023, Algorithm 1, with a
    one-hot draft distribution).

    draft_ids: [K]. target_token(i): the target's token at block position i (0..K), called
    lazily in order, so that positions after the first mismatch cost nothing.
    """
    for i, draft in enumerate(draft_ids):
        tok = target_token(i)
        if tok != draft:
            return VerifyResult(num_accepted=i, next_token=tok, is_bonus=False)
    k = len(draft_ids)
    return VerifyResult(num_accepted=k, next_token=target_token(k), is_bonus=True)


# --- token trees ------------------------------------------------------------------------
# A tree of drafts is N nodes in topological order: tokens [N] and parents [N], parents[i]
# the index of node i's parent (< i), or -1 for a child of the root, the last committed token.
# The verifying forward has N + 1 rows: row 0 at the root, row i + 1 at node i (each row
# predicts the token after the path that ends there). A chain is parents = [-1, 0, 1, ...].


@dataclass(frozen=True)
class TreeVerifyResult:
    """Outcome of verifying a tree of drafts.

    path: the accepted nodes, root to deepest (a path of the tree; may be empty).
    next_token: the target's own token after the path: recovered when the deepest accepted
        node (or the root) has children, none accepted; else the bonus token.
    is_bonus: next_token follows a leaf.
    """

    path: tuple[int, ...]
    next_token: int
    is_bonus: bool

    @property
    def num_accepted(self) -> int:
        return len(self.path)


def tree_children(parents: Sequence[int]) -> list[list[int]]:
    """[N + 1] lists: children of the root (index 0) and of each node i (index i + 1), in
    node order. Raises ValueError unless every parent precedes its child."""
    out: list[list[int]] = [[] for _ in range(len(parents) + 1)]
    for i, p in enumerate(parents):
        if not -1 <= int(p) < i:
            raise ValueError(f"parents[{i}] = {p}: a parent must be -1 (the root) or an earlier node")
        out[int(p) + 1].append(i)
    return out


def tree_path_tokens(tokens: Sequence[int], result: TreeVerifyResult) -> list[int]:
    """The tokens a tree step commits: the accepted path's, then the target's own token."""
    return [int(tokens[i]) for i in result.path] + [result.next_token]


def _walk(tokens: Sequence[int], parents: Sequence[int], choose: Callable[[int, list[int]], tuple[int | None, int]]
          ) -> TreeVerifyResult:
    """Descend from the root: choose(row, children) gives the accepted child (or None) and
    the target's token at that row when none is accepted (or the child's token)."""
    children, path, row = tree_children(parents), [], 0
    while True:
        kids = children[row]
        child, token = choose(row, kids)
        if child is None:
            return TreeVerifyResult(tuple(path), int(token), is_bonus=not kids)
        path.append(child)
        row = child + 1


def verify_tree_greedy(tokens: Sequence[int], parents: Sequence[int], target_argmax: Sequence[int]) -> TreeVerifyResult:
    """Greedy tree verification: the longest path whose every token is the target's argmax
    after the path before it (SpecInfer, Miao et al. 2024, greedy case; Medusa's typical
    acceptance at temperature 0). target_argmax: [N + 1], one per row. Sibling tokens need
    not be distinct (the first equal one is taken). Raises ValueError on a bad shape."""
    if len(target_argmax) != len(tokens) + 1 or len(parents) != len(tokens):
        raise ValueError(f"a tree of {len(tokens)} nodes needs {len(tokens)} parents and {len(tokens) + 1} rows")

    def choose(row: int, kids: list[int]) -> tuple[int | None, int]:
        want = int(target_argmax[row])
        return next((c for c in kids if int(tokens[c]) == want), None), want

    return _walk(tokens, parents, choose)


def verify_tree_keyed(tokens: Sequence[int], parents: Sequence[int], target_token: Callable[[int], int]
                      ) -> TreeVerifyResult:
    """Tree verification under the seeded Gumbel rule: at each row the target's token is a
    function of its distribution and that position's noise (:func:`verify_keyed`), so a
    sibling is accepted when it equals it, and the text is plain decoding's for the seed.
    target_token(row): called lazily for the rows on the walked path only."""
    def choose(row: int, kids: list[int]) -> tuple[int | None, int]:
        want = int(target_token(row))
        return next((c for c in kids if int(tokens[c]) == want), None), want

    return _walk(tokens, parents, choose)


def verify_tree_sampling(tokens: Sequence[int], parents: Sequence[int], target_probs: np.ndarray,
                         rng: np.random.Generator) -> TreeVerifyResult:
    """Multi-draft speculative sampling over a tree of deterministic drafts (SpecInfer's
    recursive rejection sampling, Miao et al. 2024, Algorithm 2, with one-hot draft
    distributions). At a node with target distribution p (row of target_probs [N + 1, V])
    and children c_1..c_m (distinct tokens), child c_i is accepted with probability
    r(c_i) / sum(r), where r is p with the rejected siblings' tokens removed; when all are
    rejected the target's token is drawn from r. The token that follows the node is thus
    distributed exactly as p, and the committed path as the target's autoregressive samples.
    Raises ValueError on a bad shape or repeated sibling tokens."""
    n = len(tokens)
    if target_probs.ndim != 2 or target_probs.shape[0] != n + 1 or len(parents) != n:
        raise ValueError(f"target_probs has shape {target_probs.shape}, expected ({n + 1}, V) for {n} nodes")

    def choose(row: int, kids: list[int]) -> tuple[int | None, int]:
        r = np.asarray(target_probs[row], dtype=np.float64).copy()
        if len({int(tokens[c]) for c in kids}) != len(kids):
            raise ValueError(f"the children of row {row} repeat a token: siblings must be distinct")
        for c in kids:
            x, total = int(tokens[c]), r.sum()
            if total > 0.0 and rng.random() < r[x] / total:
                return c, x
            r[x] = 0.0
        if not r.sum() > 0.0:  # every token of the support was drafted and rejected (round-off)
            r = np.asarray(target_probs[row], dtype=np.float64)
        return None, sample_token(r, rng)

    return _walk(tokens, parents, choose)


def verify_tree(tokens: Sequence[int], parents: Sequence[int], logits: np.ndarray, sampler, base: int
                ) -> TreeVerifyResult:
    """The rule the sampler asks for over a tree block's logits [N + 1, V] (row 0 the root):
    greedy (the longest path of argmaxes), the seeded Gumbel rule (the noise of position base
    + the row's depth), or multi-draft speculative sampling. For generations without a
    grammar or penalties (each path would need its own history): the caller checks."""
    if sampler.params.greedy:
        return verify_tree_greedy(tokens, parents, [sampler.argmax(logits[r], ()) for r in range(len(logits))])
    depth = tree_depths(parents)
    if sampler.keyed:
        return verify_tree_keyed(tokens, parents,
                                 lambda r: sampler.draw(sampler.probs(logits[r], ()), base + depth[r]))
    probs = np.stack([sampler.probs(logits[r], ()) for r in range(len(logits))])
    return verify_tree_sampling(tokens, parents, probs, sampler.rng)
