"""One generation's tree of drafts verified in one forward (tree attention: SpecInfer, Medusa,
EAGLE-2): the root and the accepted path stay in the cache, the other branches go, and the
path is handed to the commit as a chain's drafts would be.

Dimension letters: N = drafted nodes, A = nodes of the accepted path, V = vocabulary size.
"""

from __future__ import annotations

from ..backends.base import Backend, HiddenRows
from ..backends.checks import check_finite_logits
from ..drafters.base import HiddenStateDrafter
from ..output import top2_gap
from ..verify import VerifyResult, verify_tree
from .generation import Generation, Verified


def verify_tree_block(target: Backend, gen: Generation, ids: list[int], parents: list[int]) -> Verified:
    """Verify gen's tree of drafts ids [N] (parents [N]) in one forward of the target, keep the
    root and the accepted path in its cache; the path comes back as the block to commit."""
    seq, block, base = gen.slot.seq, [gen.committed[-1]] + ids, len(gen.committed)
    reads_hidden = isinstance(gen.drafter, HiddenStateDrafter)
    logits, hidden = target.forward_tree(block, parents, seq=seq, hidden=reads_hidden)  # [N+1, V]
    check_finite_logits(target, logits[-1])
    r = verify_tree(ids, parents, logits, gen.sampler, base)
    rows = [0] + [i + 1 for i in r.path]  # [A+1]
    target.keep_tree_rows(rows, len(block), seq=seq)
    gaps = None if gen.out.gaps is None else [top2_gap(gen.sampler.scores(logits[row], (), base + j))
                                              for j, row in enumerate(rows)]
    gen.out.stats.record_tree(parents, r.path)
    path = [ids[i] for i in r.path]
    kept = HiddenRows([base - 1 + j for j in range(len(rows))], hidden[rows]) if reads_hidden else None
    return Verified(path, len(ids), VerifyResult(len(path), r.next_token, r.is_bonus), gaps, logits[rows], kept)
