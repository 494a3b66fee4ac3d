"""The speculative decoding loop: one step drafts, verifies and commits; the loop around it
streams what the step commits.

One step (docs/architecture.md):
    drafter.propose(committed, k) -> draft [k] (+ draft probs [k, V])
    target.forward([last committed] + draft) -> target logits [k+1, V]
    sampling -> target choice (greedy argmax [k+1] or target probs [k+1, V])
    verify -> num_accepted, next token (recovered or bonus)
    commit num_accepted + 1 tokens, cut at end-of-generation / max_tokens
    target.rollback(len(committed) - 1)

What the committed tokens become (text, stop strings, logprobs, statistics) is
:class:`specdecode.output.OutputAccumulator`'s job.

KV invariant: after every step the target's KV cache holds exactly committed[:-1]
(``target.kv_len == len(committed) - 1``): the last committed token is fed at the
start of the next step together with the drafts.

Sources: Leviathan et al. 2023, Algorithm 1; Chen et al. 2023, Algorithm 2.
Dimension letters: K = drafted tokens this step, V = vocabulary size.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Iterator, Sequence

import numpy as np

from .backends.base import Backend, common_prefix_len
from .drafters import Draft, Drafter
from .errors import ContextOverflowError, SpecDecodeError
from .grammar import Grammar, GrammarConstraint
from .limits import DEFAULT_MAX_TOKENS, check_logprobs, check_num_speculative_tokens
from .output import GenerationResult, OutputAccumulator, TextDelta, TokenLogprob
from .sampling import Sampler, SamplingParams
from .verify import VerifyResult, committed_tokens, verify_greedy, verify_speculative_sampling

__all__ = ["SpeculativeEngine", "GenerationResult", "TextDelta", "TokenLogprob"]


@dataclass
class _Generation:
    """The state one generation's steps share."""

    committed: list[int]  # prompt and emitted tokens
    drafter: Drafter
    sampler: Sampler
    out: OutputAccumulator


class SpeculativeEngine:
    """Runs generations of one target with one drafter.

    target: the model whose output is reproduced exactly.
    drafter: proposes tokens (NoDrafter for plain decoding).
    num_speculative_tokens: K, drafted tokens per step (0 <= K <= MAX_NUM_SPECULATIVE_TOKENS).

    Raises SpecDecodeError on an out-of-range K.
    """

    def __init__(self, target: Backend, drafter: Drafter, num_speculative_tokens: int = 4) -> None:
        self.target = target
        self.drafter = drafter
        self.num_speculative_tokens = check_num_speculative_tokens(num_speculative_tokens, allow_auto=False)
        self._target_cached: list[int] = []  # tokens in the target's KV cache, for prefix reuse

    def stream(
        self,
        prompt_ids: Sequence[int],
        sampling: SamplingParams = SamplingParams(),
        max_tokens: int = DEFAULT_MAX_TOKENS,
        stop: Sequence[str] = (),
        logprobs: int | None = None,
        record_top2_gaps: bool = False,
        drafter: Drafter | None = None,
        num_speculative_tokens: int | None = None,
        grammar: Grammar | None = None,
    ) -> Iterator[TextDelta | GenerationResult]:
        """Generate; yields text deltas as tokens are committed, then the GenerationResult.

        Each delta is a :class:`specdecode.output.TextDelta`: a str that also carries the
        tokens it completes (token_ids, logprobs); one may be empty text that only
        completes tokens.

        prompt_ids: [L] prompt tokens (at least one; BOS included if the model wants it).
        max_tokens: cap on emitted tokens (>= 1). stop: strings that end the output.
        logprobs: N >= 0 to record the N most likely tokens per emitted token.
        record_top2_gaps: record the target's top-2 logit gap at each emitted token.
        drafter, num_speculative_tokens: override the engine's for this call (e.g. a
            NoDrafter for the plain baseline on the same loaded target).
        grammar: structured output (:mod:`specdecode.grammar`): the output matches it, and is
            what plain decoding under the same grammar would give.

        Raises SpecDecodeError for bad options, ContextOverflowError when the prompt does
        not fit in the context.
        """
        K = self.num_speculative_tokens if num_speculative_tokens is None else num_speculative_tokens
        self._check(prompt_ids, K, max_tokens, stop, logprobs)
        started = time.perf_counter()
        sampler = Sampler(sampling, GrammarConstraint(grammar, self.target) if grammar is not None else None)
        out = OutputAccumulator(prompt_ids, self.target.eog_ids, self.target.token_bytes, max_tokens, stop,
                                logprobs, record_top2_gaps, started)
        gen = _Generation(list(prompt_ids), drafter or self.drafter, sampler, out)
        self._prefill(gen.committed)
        gen.drafter.start(prompt_ids, sampler)
        out.decode_started = time.perf_counter()
        out.stats.prefill_s = out.decode_started - started
        try:
            while out.finish_reason is None:
                # A step commits up to k+1 tokens; prompt plus output never exceeds n_ctx.
                room = self.target.n_ctx - len(gen.committed) - 1
                if room < 0:
                    break
                delta = self._step(gen, min(K, out.remaining - 1, room))
                if delta or delta.token_ids:
                    yield delta
        finally:
            # Nothing after the stop point stays in a cache: keep exactly the emitted text's prefix.
            final_len = len(prompt_ids) + len(out.emitted)
            if self.target.kv_len > final_len - 1:
                self.target.rollback(final_len - 1)
                self._target_cached = self._target_cached[: final_len - 1]
            gen.drafter.finish(gen.committed[:final_len])
        tail = out.end("length")
        out.stats.controller_note = gen.drafter.explain()
        if tail or tail.token_ids:
            yield tail
        yield out.result()

    def _step(self, gen: _Generation, k: int) -> TextDelta:
        """Draft up to k tokens, verify them in one target forward, commit what is accepted
        plus the target's own token; returns the text delta to stream."""
        target, committed, stats = self.target, gen.committed, gen.out.stats
        t0 = time.perf_counter()
        draft = gen.drafter.propose(committed, k) if k > 0 else Draft([])
        draft_ids = draft.token_ids[:k]
        if gen.sampler.constraint is not None:  # a token the grammar rejects could never be accepted
            draft_ids = draft_ids[: gen.sampler.constraint.valid_prefix(draft_ids)]
        k = len(draft_ids)
        draft_probs = draft.probs[:k] if draft.probs is not None else None  # [k, V] or one-hot
        t1 = time.perf_counter()
        stats.draft_s += t1 - t0

        logits = target.forward([committed[-1]] + draft_ids, logits_for=range(k + 1))  # [k+1, V]
        result = self._verify(gen, draft_ids, draft_probs, logits)
        t2 = time.perf_counter()
        stats.verify_s += t2 - t1
        gen.drafter.observe_verification(k + 1, t2 - t1)

        new = gen.out.cut(committed_tokens(draft_ids, result))
        if gen.sampler.constraint is not None:
            gen.sampler.constraint.commit(new)
        committed.extend(new)
        target.rollback(len(committed) - 1)
        self._target_cached = committed[:-1]
        assert target.kv_len == len(committed) - 1, "target KV length must be committed length - 1"
        gen.drafter.observe(result.num_accepted)
        return gen.out.add(new, result.num_accepted, k, logits)

    @staticmethod
    def _verify(gen: _Generation, draft_ids: list[int], draft_probs: np.ndarray | None,
                logits: np.ndarray) -> VerifyResult:
        """The acceptance rule on the target's logits [k+1, V]: greedy match, or speculative
        sampling on the sampler-shaped target distributions."""
        sampler, k = gen.sampler, len(draft_ids)
        if sampler.constraint is not None:  # position i: the grammar state after drafts[:i]
            logits = np.stack([sampler.constrain(logits[i], draft_ids[:i]) for i in range(k + 1)])
        # Position i is scored after the committed tokens and drafts[:i] (penalties only).
        if sampler.params.has_penalties:
            hist = lambda i: gen.committed + draft_ids[:i]  # noqa: E731
        else:
            hist = lambda i: ()  # noqa: E731
        if sampler.params.greedy:
            return verify_greedy(draft_ids, [sampler.argmax(logits[i], hist(i)) for i in range(k + 1)])
        target_probs = np.stack([sampler.probs(logits[i], hist(i)) for i in range(k + 1)])  # [k+1, V]
        return verify_speculative_sampling(draft_ids, draft_probs, target_probs, sampler.rng)

    def _check(self, prompt_ids: Sequence[int], k: int, max_tokens: int, stop: Sequence[str],
               logprobs: int | None) -> None:
        check_num_speculative_tokens(k, allow_auto=False)
        check_logprobs(logprobs)
        if max_tokens < 1:
            raise SpecDecodeError(f"max_tokens = {max_tokens} is out of range: expected max_tokens >= 1",
                                  param="max_tokens")
        if any(not isinstance(s, str) or not s for s in stop):
            raise SpecDecodeError(f"stop strings must be non-empty strings, got {list(stop)!r}", param="stop")
        if not prompt_ids:
            raise SpecDecodeError("the prompt is empty: at least one token is needed", param="prompt")
        if len(prompt_ids) >= self.target.n_ctx:
            raise ContextOverflowError(
                f"the prompt has {len(prompt_ids)} tokens but the context holds {self.target.n_ctx}: "
                f"it must be shorter than the context to leave room for at least one new token", param="prompt")

    def _prefill(self, committed: list[int]) -> None:
        """Cache committed[:-1] (see the KV invariant), reusing the longest cached prefix."""
        keep = common_prefix_len(self._target_cached, committed, len(committed) - 1)
        self.target.rollback(keep)
        if len(committed) - 1 > keep:
            self.target.forward(committed[keep:-1], logits_for=[])
        self._target_cached = committed[:-1]

    def forget_prefix(self) -> None:
        """Make the next generation prefill its whole prompt (no reuse of the cached prefix),
        e.g. so that side-by-side runs pay the same prefill."""
        self._target_cached = []

    def generate(self, prompt_ids: Sequence[int], **kwargs) -> GenerationResult:
        """Run :meth:`stream` to the end and return its GenerationResult."""
        result = None
        for item in self.stream(prompt_ids, **kwargs):
            if isinstance(item, GenerationResult):
                result = item
        assert result is not None
        return result
