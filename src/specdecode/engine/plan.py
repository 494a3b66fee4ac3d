"""A generation's plan, decided once (docs/architecture.md, "Decided once"; issue 61, item 4).

One pure function, :func:`plan_generation`, from a generation's options, the target's
abilities and the engine's defaults to what the generation runs with: plain decoding or K
drafted tokens a step (and the drafting request its drafter is configured with), strict mode,
batch invariance and its block, the tree budget, and cache reuse. The engine's ``begin`` runs
it; a server runs it before it queues a request, so that what ``begin`` would refuse is a 400
first (the same function, the same words). Before, strict mode was decided in four places and
guarded in three more, tree eligibility in four, and ``begin`` made four strictness
adjustments.

The rules:

- draft and K: :func:`.drafters.kinds.resolve_request` (the request's choice within what the
  engine loaded).
- strict mode (``batch_invariant`` "on") needs a KV cache per sequence
  (:func:`.control.invariance.check_strict_allowed`; SpecDecodeError naming the option).
- a seed's "auto" asks for batch invariance where it may hold (a cache per sequence): with the
  target's invariant block known and >= 2 tokens, verification in blocks of that size; with a
  block of 1 it verifies as usual (a seed's text is then plain decoding's only where the
  attention path was the user's choice), or, where specdecode chose the path by measurement,
  plain one-token steps (K = 0), so that a choice the user did not make never breaks the seed's
  promise; with the block not known yet (a server measures it between requests), plain
  one-token steps in batch-invariant mode, which are exactly strict.
- trees: only where the target verifies them (asked of one that does not: SpecDecodeError
  naming max_tree_nodes), for a generation without penalties or grammar, not batch-invariant
  (:func:`.drafters.tree.trees_allowed`'s rule).
- cache reuse (moving cached chunks into place) never for a batch-invariant generation: a moved
  chunk is close to a fresh evaluation, not bitwise.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from ..backends.base import Backend
from ..control.invariance import check_strict_allowed
from ..drafters.kinds import RequestChoice, resolve_request
from ..drafters.tree import trees_allowed
from ..errors import SpecDecodeError
from ..request import GenerationOptions


@dataclass(frozen=True)
class GenerationPlan:
    """What one generation runs with (:func:`plan_generation`).

    choice: the request's drafter choice (plain, or K with the drafting request). k: drafted
    tokens a step at most (0: plain steps). plain: no drafter at all (the request's own plain
    decoding, or a seed's plain one-token steps). invariant: verified batch-invariantly, in
    blocks of at most ``invariant_block`` tokens. strict: strict mode (as the statistics say).
    invariant_block: as the statistics report it: the block where invariant (1: one-token
    steps), 1 where a seed decodes in plain steps, 0 where it does not apply. tree_nodes: the
    tree budget (0: chains). cache_reuse: the shortest cached chunk moved into place (0: none).
    """

    choice: RequestChoice
    k: int
    plain: bool
    invariant: bool
    strict: bool
    invariant_block: int
    tree_nodes: int
    cache_reuse: int


def wants_invariance(options: GenerationOptions, target: Backend) -> bool:
    """Whether the plan reads the target's invariant block: strict mode, or a seed's "auto"
    where each sequence has a cache of its own (in a shared one it verifies as usual)."""
    return options.batch_invariant == "on" or (options.invariant and not target.kv_shared)


def plan_generation(options: GenerationOptions, target: Backend, engine_k: int, tree_default: int | None,
                    block: int | None = None, token_bytes: Callable[[int], bytes] | None = None) -> GenerationPlan:
    """The plan of one generation (module docstring). options: its options. target: what
    verifies (its ``kv_shared``, ``supports_tree`` and ``attention_chosen``). engine_k: the
    engine's K. tree_default: the engine's tree budget (None: 0). block: the target's invariant
    block (tokens; None: not known yet), read only where :func:`wants_invariance`.
    token_bytes: the target's, for drafters that read inputs as bytes. Pure: it measures and
    changes nothing. Raises SpecDecodeError naming the option at fault."""
    choice = resolve_request(options.draft, options.num_speculative_tokens, engine_k, options.request_inputs(),
                             options.plain, token_bytes)
    if options.batch_invariant == "on":
        check_strict_allowed(target)
    k, plain, invariant, reported = choice.k, choice.plain, wants_invariance(options, target), 0
    strict = options.batch_invariant == "on"
    if invariant and block is None:  # measured later: plain one-token steps, exactly strict
        block, strict = 1, True
    if invariant:
        if block >= 2 or strict:
            reported = block
        else:  # a seed's "auto" with a block of one token: as usual, or plain steps where specdecode chose the path
            invariant = False
            if target.attention_chosen:
                k, plain, reported = 0, True, 1
    nodes = options.max_tree_nodes if options.max_tree_nodes is not None else tree_default
    if nodes and not target.supports_tree:
        raise SpecDecodeError(f"max_tree_nodes = {nodes}: {target.name} was loaded to verify chains only; load it "
                              f"with trees (Decoder(max_tree_nodes=N), --max-tree-nodes N) or ask for 0",
                              param="max_tree_nodes")
    trees = trees_allowed(options.sampling, options.grammar, invariant)
    return GenerationPlan(choice, k, plain, invariant, invariant and strict, reported, (nodes or 0) if trees else 0,
                          0 if invariant else options.cache_reuse)
