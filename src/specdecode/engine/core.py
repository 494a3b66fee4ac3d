"""The engine's step: one batched step drafts, verifies, commits and tells each drafter what
happened, for every running generation (:class:`SpeculativeEngine`); :mod:`.forwards` runs the
step's forwards (batch invariance), :mod:`.tree_step` verifies a tree of drafts,
:mod:`.generation` holds what a generation and a slot keep. The package docstring is the map."""

from __future__ import annotations

import time
from typing import Callable, Iterator, Sequence

import numpy as np

from .reuse import reuse_chunks
from ..backends.base import Backend, SeqForward
from ..backends.tree_shape import tree_prefix_within
from ..control.invariance import measure_invariant_block
from ..control.planner import plan_batch
from ..drafters.base import Draft, Drafter, HiddenStateDrafter, NoDrafter, StepOutcome
from ..drafters.tree import set_tree_options
from ..errors import ContextOverflowError, SpecDecodeError
from ..grammar import GrammarConstraint
from ..limits import check_max_tree_nodes, check_num_speculative_tokens
from ..output import GenerationResult, OutputAccumulator, TextDelta, TokenLogprob, drive, top2_gap
from ..request import GenerationOptions
from ..sampling import Sampler
from .forwards import BatchForwards
from .generation import Generation, Slot, Verified
from .plan import plan_generation, wants_invariance
from .tree_step import verify_tree_block
from ..backends.base import HiddenRows
from ..verify import committed_tokens, verify_greedy, verify_keyed, verify_speculative_sampling

__all__ = ["SpeculativeEngine", "Generation", "GenerationResult", "TextDelta", "TokenLogprob"]


# A free slot's cache is reused when it holds at least this share of the prompt; else the least
# recently used slot is taken (llama.cpp's server: --slot-prompt-similarity, 0.5 by default).
SLOT_REUSE_SHARE = 0.5


class SpeculativeEngine:
    """Runs generations of one target with one drafter, one at a time or several in one
    batch (continuous batching).

    target: the model whose output is reproduced exactly.
    drafter: proposes tokens (NoDrafter for plain decoding).
    num_speculative_tokens: K, drafted tokens per step (0 <= K <= MAX_NUM_SPECULATIVE_TOKENS).
    n_slots: concurrent generations (default: the target's n_seq); slot i runs on the
        target's KV sequence i with ``drafter.fork(i)`` (slot 0 with the drafter itself).
    max_tree_nodes: nodes a tree of drafts may hold (0: chains; None: the plan's default, :mod:`.plan`).

    A single generation (:meth:`stream`) is the batch of one: :meth:`begin` takes a slot
    and prefills it, :meth:`step` runs one batched step for any set of running
    generations, :meth:`end` finishes one and frees its slot. Generations join and leave
    between steps; each keeps its own sampler, random stream, penalties, grammar, stop
    strings and max_tokens, and rolls back its own sequence.

    Batch invariance: a generation whose options ask for it (seeded sampling, by default, where
    the measured block holds at least 2 tokens) is verified in forwards of at most the target's
    ``invariant_block`` tokens (``invariance(target, seq)`` measures it, once; None: later), in
    batch-invariant mode, and reuses of its slot's cache only the whole prefill calls a fresh
    prefill makes alike (:meth:`.generation.Slot.invariant_reusable`): every row then has the
    logits of plain decoding, whatever K, drafter or batch. What a generation runs with is its
    plan (:mod:`.plan`), decided once in :meth:`begin`.

    Raises SpecDecodeError on an out-of-range K or n_slots.
    """

    def __init__(self, target: Backend, drafter: Drafter, num_speculative_tokens: int = 4,
                 n_slots: int | None = None, invariance: Callable[[Backend, int], "int | None"] = measure_invariant_block,
                 max_tree_nodes: int | None = None) -> None:
        self.target = target
        self.max_tree_nodes = check_max_tree_nodes(max_tree_nodes)  # None: the controller's default
        self.drafter = drafter
        self.num_speculative_tokens = check_num_speculative_tokens(num_speculative_tokens, allow_auto=False)
        n = target.n_seq if n_slots is None else n_slots
        if not 1 <= n <= target.n_seq:
            raise SpecDecodeError(f"n_slots = {n} is out of range: the target {target.name} holds "
                                  f"{target.n_seq} sequence(s)", param="parallel")
        self.slots = [Slot(i, drafter if i == 0 else drafter.fork(i), target.n_ctx) for i in range(n)]
        self._plain = NoDrafter()  # plain decoding on the same target (GenerationOptions.plain)
        self._uses = 0
        self.forwards = BatchForwards(target, invariance)  # the step's forwards, batch-invariant where asked
        self.draft_name = drafter.name  # what a generation's statistics name its drafter (Decoder: the --draft given)

    def free_slots(self) -> int:
        """Slots without a running generation."""
        return sum(1 for s in self.slots if s.gen is None)

    def stream(self, prompt_ids: Sequence[int], options: GenerationOptions | None = None, *,
               drafter: Drafter | None = None, **fields) -> Iterator[TextDelta | GenerationResult]:
        """Generate; yields text deltas as tokens are committed, then the GenerationResult.

        Each delta is a :class:`specdecode.output.TextDelta`: a str that also carries the
        tokens it completes (token_ids, logprobs); one may be empty text that only
        completes tokens.

        prompt_ids: [L] prompt tokens (at least one; BOS included if the model wants it).
        options: :class:`specdecode.request.GenerationOptions`, or its fields (and the
            sampling fields) as keywords. drafter: override the slot's for this call.

        Raises SpecDecodeError for bad options, ContextOverflowError when the prompt does
        not fit in the context.
        """
        yield from drive(self.begin(prompt_ids, options, drafter=drafter, **fields), self.step, self.end)

    def begin(self, prompt_ids: Sequence[int], options: GenerationOptions | None = None, *,
              drafter: Drafter | None = None, slot: int | None = None,
              accepted: Callable[[], None] | None = None, chunked: bool = False, **fields) -> Generation:
        """Start a generation (options as :meth:`stream`) in a free slot: the given one, else
        the free slot whose cached tokens share the longest prefix with the prompt (least
        recently used among equals) where that prefix is at least SLOT_REUSE_SHARE of the
        prompt, else the least recently used free slot; its prompt is prefilled there (reusing
        the prefix it shares). accepted: called once every option has been accepted, right
        before the prompt is read (a server opens its stream there, ahead of a long prefill).
        chunked: the prompt is read later, in pieces, by :meth:`prefill` (``gen.prefilling``
        until it is all read; a server interleaves the pieces with other generations' steps);
        a batch-invariant generation still reads its whole prompt here, as a fresh start would.

        Raises SpecDecodeError for bad options or when no slot is free,
        ContextOverflowError when the prompt does not fit.
        """
        options = GenerationOptions.from_kwargs(options, **fields) if fields or options is None else options
        plan_generation(options, self.target, self.num_speculative_tokens, self.max_tree_nodes,
                        1, self.target.token_bytes)  # refused here, before a slot is taken or anything measured
        self._check(prompt_ids)
        started = time.perf_counter()
        where = self._choose_slot(prompt_ids, slot)
        block = self.forwards.invariant_block(where) if wants_invariance(options, self.target) else None
        plan = plan_generation(options, self.target, self.num_speculative_tokens, self.max_tree_nodes, block,
                               self.target.token_bytes)  # decided once: docs/architecture.md, "Decided once"
        grammar = options.grammar
        sampler = Sampler(options.sampling, GrammarConstraint(grammar, self.target) if grammar is not None else None,
                          prompt_len=len(prompt_ids))
        out = OutputAccumulator(prompt_ids, self.target.eog_ids, self.target.token_bytes, options.max_tokens,
                                options.stop, options.logprobs, options.record_top2_gaps, started, options.trace)
        chosen = self._plain if plan.plain else drafter or where.drafter
        gen = Generation(list(prompt_ids), chosen, sampler, out, where, plan.k, len(prompt_ids), plan.invariant)
        out.stats.invariant_block, out.stats.strict = plan.invariant_block, plan.strict
        if gen.invariant:  # reuse only cells a fresh prefill computes alike: whole calls from 0
            where.cached_len = min(where.cached_len, where.invariant_reusable(prompt_ids, self.target.prefill_split))
        self.forwards.set_invariant(gen.invariant)
        gen.tree_nodes = plan.tree_nodes
        set_tree_options(gen.drafter, plan.tree_nodes)
        # What it runs with, decided here once; the response reports it.
        out.stats.draft = "none" if plan.choice.plain else plan.choice.drafting.draft or self.draft_name
        out.stats.num_speculative_tokens, out.stats.max_tree_nodes = plan.choice.k, gen.tree_nodes
        gen.drafter.start(prompt_ids, sampler)
        if not plan.choice.plain:  # may refuse the request's draft or inputs: the slot stays free
            gen.drafter.configure(plan.choice.drafting)
        if accepted is not None:
            accepted()
        reuse = plan.cache_reuse
        if chunked and not gen.invariant:
            out.stats.prompt_cached, out.stats.prompt_shifted = self._start_prefill(where, gen.committed, reuse)
            gen.prefilling = True
            self._hold(where, gen)
            self.prefill(gen, 0)  # nothing left to read (a prompt cached whole): it can step at once
            return gen
        out.stats.prompt_cached, out.stats.prompt_shifted = self._prefill(where, gen.committed, gen.drafter, reuse)
        self._hold(where, gen)
        out.decode_started = time.perf_counter()
        out.stats.prefill_s = out.decode_started - started
        return gen

    def _hold(self, slot: Slot, gen: Generation) -> None:
        slot.gen = gen
        self._uses += 1
        slot.last_used = self._uses

    def prefill(self, gen: Generation, max_tokens: int | None = None) -> int:
        """Read up to max_tokens more of the prompt of a generation begun with ``chunked``
        (None: all that is left) into its slot's cache, in one forward; returns the tokens
        read. Once the prompt is read (committed[:-1], the KV invariant), ``gen.prefilling``
        is False and it steps like any other (a drafter that reads hidden states gets the
        last chunk's last row). What was read stays reusable if the generation ends before.

        Raises SpecDecodeError for a generation that has ended or is not prefilling."""
        if gen.slot.gen is not gen or not gen.prefilling:
            raise SpecDecodeError("prefill() takes a generation begun with chunked=True whose prompt is not read yet")
        slot, committed = gen.slot, gen.committed
        start, end = slot.cached_len, len(committed) - 1
        n = end - start if max_tokens is None else max(0, min(max_tokens, end - start))
        if n > 0:
            self.forwards.set_invariant(False)  # (chunked generations are never batch-invariant)
            slot.forget()  # until the forward succeeds
            self._read(slot.seq, committed[start:start + n], gen.drafter, hidden_last=start + n == end)
            slot.tokens, slot.cached_len = committed, start + n
            slot.note_read(start, n, self.target.prefill_split)
        if slot.cached_len == end:
            gen.prefilling = False
            gen.out.decode_started = time.perf_counter()
            gen.out.stats.prefill_s = gen.out.decode_started - gen.out.started
        return n

    def _choose_slot(self, prompt_ids: Sequence[int], slot: int | None) -> Slot:
        free = [s for s in self.slots if s.gen is None]
        if slot is not None:
            if not 0 <= slot < len(self.slots):
                raise SpecDecodeError(f"slot {slot} is out of range: the engine has {len(self.slots)}", param="slot")
            free = [s for s in free if s.seq == slot]
        if not free:
            raise SpecDecodeError(f"no free slot among {len(self.slots)}" if slot is None else f"slot {slot} is busy",
                                  param="slot")
        best = max(free, key=lambda s: (s.reusable(prompt_ids), -s.last_used))
        if best.reusable(prompt_ids) >= SLOT_REUSE_SHARE * len(prompt_ids):
            return best
        # Little in common (a header every prompt shares, such as a fill-in-the-middle prompt's
        # first tokens): the least recently used slot, an empty one first, so that a slot that
        # holds another client's file is not overwritten for a few tokens' reuse.
        return min(free, key=lambda s: s.last_used)

    def step(self, gens: Sequence[Generation]) -> list[TextDelta]:
        """One batched step for the running generations ``gens`` (distinct, not done): each
        drafts up to its k tokens (sized for the batch by a cost-aware drafter), the target
        verifies every block in one forward, each commits what it accepts plus the target's
        own token; returns each generation's text delta, in order."""
        if not gens:
            return []
        if len({id(g) for g in gens}) != len(gens) or any(g.slot.gen is not g or g.done or g.prefilling for g in gens):
            raise SpecDecodeError("step() takes running generations, each once: one has ended, is done or is "
                                  "still reading its prompt (prefill)")
        caps = [min(gen.k, gen.out.remaining - 1, gen.room) for gen in gens]
        caps = [min(cap, gen.out.stats.invariant_block - 1) if gen.invariant else cap for gen, cap in zip(gens, caps)]
        if len(gens) > 1:
            plan_batch([g.drafter for g in gens], [g.committed for g in gens], caps)
        blocks = []
        for gen, cap in zip(gens, caps):
            t0 = time.perf_counter()
            draft_ids, draft_probs, parents = self._draft(gen, cap, tree_ok=len(gens) == 1)
            gen.out.stats.draft_s += time.perf_counter() - t0
            blocks.append((draft_ids, draft_probs))
        t1 = time.perf_counter()
        if parents is not None:  # one generation's tree of drafts, alone in the step
            verified, sample = [verify_tree_block(self.target, gens[0], blocks[0][0], parents)], True
        else:
            items = [SeqForward(gen.slot.seq, [gen.committed[-1]] + ids, range(len(ids) + 1))  # [k+1, V] each
                     for gen, (ids, _) in zip(gens, blocks)]
            logits, hidden, sample = self.forwards.run(gens, items)
            verified = [self._verify(gen, ids, probs, lg, hidden.get(gen.slot.seq))
                        for gen, (ids, probs), lg in zip(gens, blocks, logits)]
        t2 = time.perf_counter()
        n = sum(len(ids) + 1 for ids, _ in blocks)  # the step's verified tokens, over the batch
        deltas = []
        for i, (gen, v) in enumerate(zip(gens, verified)):
            gen.out.stats.verify_s += t2 - t1
            deltas.append(self.commit(gen, v))
            a = v.result.num_accepted  # the one feedback door; the batch's timing rides with the first
            gen.drafter.observe(StepOutcome(a, v.num_drafted, v.logits[:a + 1], n if i == 0 else 0, t2 - t1, sample,
                                            v.hidden))
        return deltas

    def _draft(self, gen: Generation, k: int, tree_ok: bool = False) -> tuple[list[int], np.ndarray | None, list | None]:
        """Up to k drafted ids (cut where the grammar rejects one), their probs [k, V], and a
        tree's parents (None for a chain). A tree is verified as one only alone in the step
        and within the generation's budget (0 where :func:`trees_allowed` says no); else its
        first path is the chain."""
        draft = gen.drafter.propose(gen.committed, k) if k > 0 else Draft([])
        if draft.parents is not None:
            n = (tree_ok and gen.tree_nodes > 0  # (a budget only where trees_allowed, on a target that verifies them)
                 and min(tree_prefix_within(draft.parents, self.target.max_tree_leaves), gen.tree_nodes, gen.room))
            if n and n > 0:  # the most leading nodes the target verifies as one tree
                return list(draft.token_ids[:n]), None, list(draft.parents[:n])
            draft = draft.chain()
        draft_ids = draft.token_ids[:k]
        if gen.sampler.constraint is not None:  # a token the grammar rejects could never be accepted
            draft_ids = draft_ids[: gen.sampler.constraint.valid_prefix(draft_ids)]
        k = len(draft_ids)
        return draft_ids, draft.probs[:k] if draft.probs is not None else None, None  # [k, V] or one-hot

    def commit(self, gen: Generation, v: Verified) -> TextDelta:
        """Commit the accepted drafts and the target's token; roll the slot's sequence back
        to the KV invariant; returns the text delta."""
        new = gen.out.cut(committed_tokens(v.draft_ids, v.result))
        if gen.sampler.constraint is not None:
            gen.sampler.constraint.commit(new)
        committed, slot = gen.committed, gen.slot
        committed.extend(new)
        self.target.rollback(len(committed) - 1, seq=slot.seq)
        slot.cached_len = len(committed) - 1  # slot.tokens is committed itself
        assert self.target.seq_len(slot.seq) == len(committed) - 1, "target KV length must be committed length - 1"
        return gen.out.add(new, v.result.num_accepted, len(v.draft_ids), v.logits, v.gaps, gen.drafter.last_source)

    def end(self, gen: Generation) -> list[TextDelta | GenerationResult]:
        """Finish a generation (done, or stopped early: a cancelled request) and free its
        slot; returns what is left to stream: the last text delta (if any) and the
        GenerationResult. Nothing after the emitted text stays in a cache."""
        slot, out = gen.slot, gen.out
        if slot.gen is not gen:
            raise SpecDecodeError("this generation has already ended")
        try:
            final_len = gen.prompt_len + len(out.emitted)
            if self.target.seq_len(slot.seq) > final_len - 1:
                self.target.rollback(final_len - 1, seq=slot.seq)
            slot.tokens, slot.cached_len = gen.committed[:final_len - 1], min(slot.cached_len, final_len - 1)
            gen.drafter.finish(gen.committed[:final_len])
        finally:
            slot.gen = None
            out.stats.controller_note = gen.drafter.explain()
            out.stats.weights = self.target.weights_note
            out.stats.placement = self.target.placement.to_dict()
            out.stats.draft_placements = [{"name": b.name, **b.placement.to_dict()} for b in gen.drafter.draft_backends()]
            if (counts := gen.drafter.input_counts()) is not None:
                out.stats.accepted_prediction_tokens, out.stats.rejected_prediction_tokens = counts
        tail = out.end("length")
        items: list[TextDelta | GenerationResult] = [tail] if tail or tail.token_ids else []
        return items + [out.result()]

    @staticmethod
    def _verify(gen: Generation, draft_ids: list[int], draft_probs: np.ndarray | None,
                logits: np.ndarray, hidden: HiddenRows | None) -> Verified:
        """The acceptance rule on the target's logits [k+1, V]: greedy match; under sampling
        the target's position-keyed choices ("gumbel" rule) or speculative sampling on the
        sampler-shaped distributions ("rejection"). Also the top-2 gap of the scores the rule
        chose each committed token by (when the generation records gaps), else None."""
        sampler, k, base = gen.sampler, len(draft_ids), len(gen.committed)
        if sampler.constraint is not None:  # position i: the grammar state after drafts[:i]
            logits = np.stack([sampler.constrain(logits[i], draft_ids[:i]) for i in range(k + 1)])
        # Position i is scored after the committed tokens and drafts[:i] (penalties only).
        if sampler.params.has_penalties:
            hist = lambda i: gen.committed + draft_ids[:i]  # noqa: E731
        else:
            hist = lambda i: ()  # noqa: E731
        if sampler.params.greedy:
            result = verify_greedy(draft_ids, [sampler.argmax(logits[i], hist(i)) for i in range(k + 1)])
        elif sampler.keyed:
            result = verify_keyed(draft_ids, lambda i: sampler.draw(sampler.probs(logits[i], hist(i)), base + i))
        else:
            target_probs = np.stack([sampler.probs(logits[i], hist(i)) for i in range(k + 1)])  # [k+1, V]
            result = verify_speculative_sampling(draft_ids, draft_probs, target_probs, sampler.rng)
        gaps = None if gen.out.gaps is None else [top2_gap(sampler.scores(logits[i], hist(i), base + i))
                                                  for i in range(result.num_accepted + 1)]
        return Verified(draft_ids, k, result, gaps, logits, hidden)

    def _check(self, prompt_ids: Sequence[int]) -> None:
        if not prompt_ids:
            raise SpecDecodeError("the prompt is empty: at least one token is needed", param="prompt")
        if len(prompt_ids) >= self.target.n_ctx:
            raise ContextOverflowError(
                f"the prompt has {len(prompt_ids)} tokens but the context holds {self.target.n_ctx}: "
                f"it must be shorter than the context to leave room for at least one new token", param="prompt")

    def _prefill(self, slot: Slot, committed: list[int], drafter: Drafter, reuse: int = 0) -> tuple[int, int]:
        """Cache committed[:-1] in the slot's sequence (see the KV invariant), reusing the
        longest cached prefix (and with reuse N > 0, cached chunks of >= N tokens after it:
        :mod:`.reuse`); a drafter that reads hidden states gets the last position's in the
        prefill's outcome (where the backend gives it), for the first step's draft.
        Returns (tokens reused, not evaluated again; of them, tokens shifted into place)."""
        keep, shifted = self._start_prefill(slot, committed, reuse)
        slot.forget()  # until the forward succeeds
        if len(committed) - 1 > keep:
            self._read(slot.seq, committed[keep:-1], drafter, hidden_last=True)
        slot.tokens, slot.cached_len = committed, len(committed) - 1
        slot.note_read(keep, len(committed) - 1 - keep, self.target.prefill_split)
        return keep, shifted

    def _start_prefill(self, slot: Slot, committed: list[int], reuse: int = 0) -> tuple[int, int]:
        """Roll the slot's sequence back to the prefix it shares with committed, after moving
        cached chunks of >= reuse tokens that committed holds further along into place
        (:func:`.reuse.reuse_chunks`; reuse 0: none). Returns (tokens of committed now cached,
        of them shifted)."""
        keep = slot.reusable(committed)
        cached, cached_len = slot.tokens, slot.cached_len  # (the list itself: forget() rebinds, never mutates)
        slot.forget()
        slot.canonical = min(slot.canonical, keep)  # what follows is rolled back, or shifted into place
        shifted = 0
        if reuse > 0 and keep < len(committed) - 1:
            keep, shifted = reuse_chunks(self.target, slot.seq, cached[:cached_len], committed[:-1], keep, reuse)
        self.target.rollback(min(keep, self.target.seq_len(slot.seq)), seq=slot.seq)
        slot.tokens, slot.cached_len = committed, keep
        return keep, shifted

    def _read(self, seq: int, ids: list[int], drafter: Drafter, hidden_last: bool) -> None:
        """One forward of prompt tokens ids [n] into seq, no logits; with hidden_last, a
        drafter that reads hidden states gets the last row's."""
        if hidden_last and isinstance(drafter, HiddenStateDrafter):
            _, hidden = self.target.forward_batch_hidden([SeqForward(seq, ids, [len(ids) - 1])], {seq})
            drafter.observe(StepOutcome(hidden=hidden.get(seq)))
        else:
            self.target.forward(ids, logits_for=[], seq=seq)

    def forget_prefix(self) -> None:
        """Make the next generation prefill its whole prompt (no reuse of the cached prefix),
        e.g. so that side-by-side runs pay the same prefill."""
        for slot in self.slots:
            slot.forget()

    def generate(self, prompt_ids: Sequence[int], options: GenerationOptions | None = None, *,
                 drafter: Drafter | None = None, **fields) -> GenerationResult:
        """Run :meth:`stream` to the end and return its GenerationResult."""
        result = None
        for item in self.stream(prompt_ids, options, drafter=drafter, **fields):
            if isinstance(item, GenerationResult):
                result = item
        assert result is not None
        return result

