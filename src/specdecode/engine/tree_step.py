"""One generation's tree of drafts verified in one forward (tree attention: SpecInfer, Medusa,
EAGLE-2): the root and the accepted path stay in the cache, the other branches go, and the
path and the target's token are committed as a chain's would be.

Dimension letters: N = drafted nodes, V = vocabulary size.
"""

from __future__ import annotations

import time
from typing import Any

from ..backends.base import check_finite_logits
from ..control.planner import observe_verification
from ..drafters.base import HiddenStateDrafter
from ..output import TextDelta, top2_gap
from ..verify import VerifyResult, verify_tree


def tree_step(engine: Any, gen: Any, ids: list[int], parents: list[int], t1: float) -> TextDelta:
    """Verify one generation's tree of drafts [N] in one forward (tree attention), keep the
    root and the accepted path in the cache, and commit the path and the target's token."""
    seq, block, base = gen.slot.seq, [gen.committed[-1]] + ids, len(gen.committed)
    reads_hidden = isinstance(gen.drafter, HiddenStateDrafter)
    logits, hidden = engine.target.forward_tree(block, parents, seq=seq, hidden=reads_hidden)
    check_finite_logits(engine.target, logits[-1])
    r = verify_tree(ids, parents, logits, gen.sampler, base)
    rows = [0] + [i + 1 for i in r.path]
    engine.target.keep_tree_rows(rows, len(block), seq=seq)
    if reads_hidden:
        gen.drafter.observe_hidden([base - 1 + j for j in range(len(rows))], hidden[rows])
    t2 = time.perf_counter()
    observe_verification(gen.drafter, len(block), t2 - t1, True)
    gen.out.stats.verify_s += t2 - t1
    gaps = None if gen.out.gaps is None else [top2_gap(gen.sampler.scores(logits[row], (), base + j))
                                              for j, row in enumerate(rows)]
    path = [ids[i] for i in r.path]
    delta = engine.commit(gen, path, VerifyResult(len(path), r.next_token, r.is_bonus), gaps, logits[rows])
    gen.out.stats.record_tree(parents, r.path)
    return delta
