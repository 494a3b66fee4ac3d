"""The speculative decoding loop: owns committed tokens, stopping, streaming and statistics.

One step (DESIGN.md):
    drafter.propose(committed, k) -> draft [k] (+ draft probs [k, V])
    target.forward([last committed] + draft) -> target logits [k+1, V]
    sampling -> target choice (greedy argmax [k+1] or target probs [k+1, V])
    verify -> num_accepted, next token (recovered or bonus)
    commit num_accepted + 1 tokens, cut at end-of-generation / stop string / max_tokens
    target.rollback(len(committed) - 1)

KV invariant: after every step the target's KV cache holds exactly committed[:-1]
(``target.kv_len == len(committed) - 1``): the last committed token is fed at the
start of the next step together with the drafts.

Sources: Leviathan et al. 2023, Algorithm 1; Chen et al. 2023, Algorithm 2.
Dimension letters: K = drafted tokens this step, V = vocabulary size.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Iterator, Sequence

import numpy as np

from .backends.base import Backend
from .drafters import Draft, Drafter, common_prefix_len
from .errors import ContextOverflowError, SpecDecodeError
from .sampling import Sampler, SamplingParams
from .stats import Stats
from .textstream import TextAssembler
from .verify import committed_tokens, verify_greedy, verify_speculative_sampling

MAX_NUM_SPECULATIVE_TOKENS = 32


@dataclass
class TokenLogprob:
    """log-probability of an emitted token under the target's raw distribution, and the top N."""

    token_id: int
    token: str
    logprob: float
    top_logprobs: list[tuple[int, str, float]]

    def to_dict(self) -> dict:
        return {
            "token_id": self.token_id,
            "token": self.token,
            "logprob": self.logprob,
            "top_logprobs": [{"token_id": i, "token": t, "logprob": lp} for i, t, lp in self.top_logprobs],
        }


@dataclass
class GenerationResult:
    """text: the generated text (stop string excluded). token_ids: the emitted tokens
    (end-of-generation token excluded). finish_reason: "stop" or "length".
    logprobs: one entry per emitted token when requested, else None.
    top2_gaps: per emitted token, the gap between the target's two largest raw logits at
    that position (recorded when asked; used by the parity report).
    from_draft: per emitted token, True when it was an accepted draft (False for the
    target's own recovered or bonus tokens)."""

    text: str
    token_ids: list[int]
    finish_reason: str
    stats: Stats
    logprobs: list[TokenLogprob] | None = None
    top2_gaps: list[float] | None = None
    from_draft: list[bool] = field(default_factory=list)
    prompt_ids: list[int] = field(default_factory=list)

    def to_dict(self) -> dict:
        d = {
            "text": self.text,
            "token_ids": self.token_ids,
            "finish_reason": self.finish_reason,
            "stats": self.stats.to_dict(),
        }
        if self.logprobs is not None:
            d["logprobs"] = [lp.to_dict() for lp in self.logprobs]
        return d


def _top2_gap(row: np.ndarray) -> float:
    two = np.partition(row, row.shape[-1] - 2)[-2:]
    return float(abs(two[1] - two[0]))


def _log_softmax(row: np.ndarray) -> np.ndarray:
    z = row.astype(np.float64)
    z = z - z.max()
    return z - np.log(np.exp(z).sum())


class SpeculativeEngine:
    """Runs generations of one target with one drafter.

    target: the model whose output is reproduced exactly.
    drafter: proposes tokens (NoDrafter for plain decoding).
    num_speculative_tokens: K, drafted tokens per step (0 <= K <= 32).

    Raises SpecDecodeError on an out-of-range K.
    """

    def __init__(self, target: Backend, drafter: Drafter, num_speculative_tokens: int = 4) -> None:
        if not (0 <= num_speculative_tokens <= MAX_NUM_SPECULATIVE_TOKENS):
            raise SpecDecodeError(
                f"num_speculative_tokens = {num_speculative_tokens} is out of range: "
                f"expected 0 <= K <= {MAX_NUM_SPECULATIVE_TOKENS}"
            )
        self.target = target
        self.drafter = drafter
        self.num_speculative_tokens = num_speculative_tokens
        self._target_cached: list[int] = []  # tokens in the target's KV cache, for prefix reuse

    def stream(
        self,
        prompt_ids: Sequence[int],
        sampling: SamplingParams = SamplingParams(),
        max_tokens: int = 256,
        stop: Sequence[str] = (),
        logprobs: int | None = None,
        record_top2_gaps: bool = False,
        drafter: Drafter | None = None,
        num_speculative_tokens: int | None = None,
    ) -> Iterator[str | GenerationResult]:
        """Generate; yields text deltas (str) as tokens are committed, then the GenerationResult.

        prompt_ids: [L] prompt tokens (at least one; BOS included if the model wants it).
        max_tokens: cap on emitted tokens (>= 1). stop: strings that end the output.
        logprobs: N >= 0 to record the N most likely tokens per emitted token.
        record_top2_gaps: record the target's top-2 logit gap at each emitted token.
        drafter, num_speculative_tokens: override the engine's for this call (e.g. a
            NoDrafter for the plain baseline on the same loaded target).

        Raises SpecDecodeError for bad options, ContextOverflowError when the prompt does
        not fit in the context.
        """
        target = self.target
        drafter = drafter or self.drafter
        K = self.num_speculative_tokens if num_speculative_tokens is None else num_speculative_tokens
        if not (0 <= K <= MAX_NUM_SPECULATIVE_TOKENS):
            raise SpecDecodeError(
                f"num_speculative_tokens = {K} is out of range: expected 0 <= K <= {MAX_NUM_SPECULATIVE_TOKENS}"
            )
        if max_tokens < 1:
            raise SpecDecodeError(f"max_tokens = {max_tokens} is out of range: expected max_tokens >= 1")
        if logprobs is not None and not (0 <= logprobs <= 20):
            raise SpecDecodeError(f"logprobs = {logprobs} is out of range: expected 0 <= logprobs <= 20")
        if any(not isinstance(s, str) or not s for s in stop):
            raise SpecDecodeError(f"stop strings must be non-empty strings, got {list(stop)!r}")
        if not prompt_ids:
            raise SpecDecodeError("the prompt is empty: at least one token is needed")
        if len(prompt_ids) >= target.n_ctx:
            raise ContextOverflowError(
                f"the prompt has {len(prompt_ids)} tokens but the context holds {target.n_ctx}: "
                f"it must be shorter than the context to leave room for at least one new token"
            )

        sampler = Sampler(sampling)
        stats = Stats(prompt_tokens=len(prompt_ids))
        eog = target.eog_ids
        committed = list(prompt_ids)
        emitted: list[int] = []
        lp_out: list[TokenLogprob] | None = [] if logprobs is not None else None
        gaps: list[float] | None = [] if record_top2_gaps else None
        draft_pos: list[int] = []  # per emitted token: its draft position, -1 for the target's own
        text = TextAssembler(stop)
        finish_reason = "length"

        # Prefill: reuse the longest cached prefix, then cache prompt[:-1] (see KV invariant).
        t0 = time.perf_counter()
        keep = common_prefix_len(self._target_cached, committed, len(committed) - 1)
        target.rollback(keep)
        if len(committed) - 1 > keep:
            target.forward(committed[keep:-1], logits_for=[])
        self._target_cached = committed[:-1]
        drafter.start(prompt_ids, sampler)
        t1 = time.perf_counter()
        stats.prefill_s = t1 - t0

        try:
            while True:
                remaining = max_tokens - len(emitted)
                # A step commits up to k+1 tokens; prompt plus output never exceeds n_ctx.
                room = target.n_ctx - len(committed) - 1
                if remaining <= 0 or room < 0:
                    break
                k = min(K, remaining - 1, room)

                ts = time.perf_counter()
                draft = drafter.propose(committed, k) if k > 0 else Draft([])
                draft_ids = draft.token_ids[:k]
                draft_probs = draft.probs[: len(draft_ids)] if draft.probs is not None else None
                k = len(draft_ids)
                tv = time.perf_counter()
                stats.draft_s += tv - ts

                logits = target.forward([committed[-1]] + draft_ids, logits_for=range(k + 1))  # [k+1, V]
                # Position i is scored after the committed tokens and drafts[:i] (penalties only).
                hist = (lambda i: committed + draft_ids[:i]) if sampling.has_penalties else (lambda i: ())
                if sampling.greedy:
                    choice = [sampler.argmax(logits[i], hist(i)) for i in range(k + 1)]
                    result = verify_greedy(draft_ids, choice)
                else:
                    target_probs = np.stack([sampler.probs(logits[i], hist(i)) for i in range(k + 1)])  # [k+1, V]
                    result = verify_speculative_sampling(draft_ids, draft_probs, target_probs, sampler.rng)
                stats.verify_s += time.perf_counter() - tv

                new = committed_tokens(draft_ids, result)
                eog_hit = False
                for j, tok in enumerate(new):
                    if tok in eog:
                        new = new[:j]
                        eog_hit = True
                        break
                new = new[:remaining]
                n_acc = min(result.num_accepted, len(new))
                stats.record_step(k, n_acc)

                committed.extend(new)
                target.rollback(len(committed) - 1)
                self._target_cached = committed[:-1]
                assert target.kv_len == len(committed) - 1, "target KV length must be committed length - 1"
                drafter.observe(result.num_accepted)

                delta, stopped = text.add([target.token_bytes(t) for t in new])
                if new and not emitted:
                    stats.first_token_s = time.perf_counter() - t0
                emitted.extend(new)
                draft_pos.extend(j if j < n_acc else -1 for j in range(len(new)))
                for j, tok in enumerate(new):
                    row = logits[j]
                    if gaps is not None:
                        gaps.append(_top2_gap(row))
                    if lp_out is not None:
                        lp_out.append(self._logprob(row, tok, logprobs or 0))
                if stopped:
                    # Text, token ids and logprobs are cut at the same point: tokens whose
                    # bytes start at or after the stop string are dropped, even ones whose
                    # text was held back in an earlier step.
                    n_keep = text.num_tokens
                    stats.retract_accepted(p for p in draft_pos[n_keep:] if p >= 0)
                    del emitted[n_keep:], draft_pos[n_keep:]
                    if gaps is not None:
                        del gaps[n_keep:]
                    if lp_out is not None:
                        del lp_out[n_keep:]
                stats.completion_tokens = len(emitted)
                stats.decode_s = time.perf_counter() - t1
                if delta:
                    yield delta
                if stopped or eog_hit:
                    finish_reason = "stop"
                    stats.eog_committed = int(eog_hit and not stopped)
                    break
        finally:
            # Nothing after the stop point stays in a cache: keep exactly the emitted text's prefix.
            final_len = len(prompt_ids) + len(emitted)
            if target.kv_len > final_len - 1:
                target.rollback(final_len - 1)
                self._target_cached = self._target_cached[: final_len - 1]
            drafter.finish(committed[:final_len])

        tail = text.finish()
        if tail:
            yield tail
        stats.completion_tokens = len(emitted)
        stats.decode_s = time.perf_counter() - t1
        yield GenerationResult(
            text=text.text,
            token_ids=emitted,
            finish_reason=finish_reason,
            stats=stats,
            logprobs=lp_out,
            top2_gaps=gaps,
            from_draft=[p >= 0 for p in draft_pos],
            prompt_ids=list(prompt_ids),
        )

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

    def _logprob(self, row: np.ndarray, tok: int, n: int) -> TokenLogprob:
        lps = _log_softmax(row)
        top = np.argpartition(lps, -n)[-n:] if n > 0 else np.array([], dtype=np.int64)
        top = top[np.argsort(-lps[top])]
        piece = lambda t: self.target.token_bytes(int(t)).decode("utf-8", errors="replace")
        return TokenLogprob(
            token_id=int(tok),
            token=piece(tok),
            logprob=float(lps[tok]),
            top_logprobs=[(int(t), piece(t), float(lps[t])) for t in top],
        )
