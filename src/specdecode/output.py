"""What a generation emits, and the books kept on it.

:class:`OutputAccumulator` owns everything between the verified tokens and the user:
the cut at the first end-of-generation token and at max_tokens, the stop strings (through
:class:`specdecode.textstream.TextAssembler`, which cuts text and tokens at one point),
logprobs and top-2 gaps per emitted token, and the statistics. The engine's step only
drafts, verifies and commits; it hands each step's tokens here.

Each text delta is a :class:`TextDelta`: a str that also names the emitted tokens it
completes (their ids and, when asked for, their logprobs), so that a stream can report
each token's logprob with the text that carries it.

Dimension letters: K = drafted tokens this step, V = vocabulary size.
"""

from __future__ import annotations

import bisect
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Collection, Iterator, Sequence

import numpy as np

from .sampling import log_softmax
from .stats import Stats
from .textstream import TextAssembler


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


class TextDelta(str):
    """A streamed piece of text (a str, so it can be used as one) and the tokens it completes.

    token_ids: the emitted tokens first reported with this delta: those whose bytes now
        lie wholly inside the text streamed so far (and start before its end), in order.
        The last delta of a generation reports every kept token not reported before (a
        token that straddles a stop string included); tokens cut by a stop string are
        never reported. Over a generation the deltas' token_ids concatenate to the
        result's token_ids, as their texts concatenate to its text.
    logprobs: the TokenLogprob entries of those tokens (same order), or None when the
        generation does not record logprobs.

    A delta may be empty text that still completes tokens (e.g. a token whose bytes end
    exactly where a stop string begins). Operations on it (``+``, slicing) give plain str.
    """

    token_ids: list[int]
    logprobs: list[TokenLogprob] | None
    runs: list[dict] | None  # traced generations: the text as runs {"text", "by"} (by: the drafter, None: the target)
    step: dict | None  # traced generations: the step it came from {"k", "accepted", "committed", "by"}

    def __new__(cls, text: str = "", token_ids: Sequence[int] = (),
                logprobs: list[TokenLogprob] | None = None, runs: list[dict] | None = None,
                step: dict | None = None) -> "TextDelta":
        self = super().__new__(cls, text)
        self.token_ids = list(token_ids)
        self.logprobs = logprobs
        self.runs, self.step = runs, step
        return self

    def __repr__(self) -> str:
        return f"TextDelta({str.__repr__(self)}, token_ids={self.token_ids!r})"


def top2_gap(row: np.ndarray) -> float:
    """Gap between the two largest entries of row [V] (a near-tie when small)."""
    two = np.partition(row, row.shape[-1] - 2)[-2:]
    return float(abs(two[1] - two[0]))


def _streamed_bytes(text: TextAssembler) -> int:
    """Bytes of the generated text the assembler has streamed so far. (Read from its
    private offset: the decoded deltas do not give it back when a token's bytes are not
    valid UTF-8.)"""
    return text._emitted


class OutputAccumulator:
    """The emitted tokens, text, logprobs and statistics of one generation.

    prompt_ids: [L] the prompt. eog_ids: end-of-generation ids. token_bytes: id -> the
    bytes it adds to the text. max_tokens: exact cap (>= 1). stop: stop strings.
    logprobs: N >= 0 to record the N most likely tokens per emitted token, else None.
    record_top2_gaps: record the target's top-2 logit gap per emitted token.
    Times are seconds from time.perf_counter(); ``started`` is when the call began.
    """

    def __init__(self, prompt_ids: Sequence[int], eog_ids: Collection[int], token_bytes: Callable[[int], bytes],
                 max_tokens: int, stop: Sequence[str] = (), logprobs: int | None = None,
                 record_top2_gaps: bool = False, started: float | None = None, trace: bool = False) -> None:
        self.prompt_ids = list(prompt_ids)
        self.eog_ids = eog_ids
        self.token_bytes = token_bytes
        self.max_tokens = max_tokens
        self.n_logprobs = logprobs
        self.started = time.perf_counter() if started is None else started
        self.decode_started = self.started
        self.stats = Stats(prompt_tokens=len(prompt_ids))
        self._step_eog = 0  # 1 when the current step's tokens ended at an end-of-generation token
        self.emitted: list[int] = []
        self.logprobs: list[TokenLogprob] | None = [] if logprobs is not None else None
        self.gaps: list[float] | None = [] if record_top2_gaps else None
        self._draft_pos: list[int] = []  # per emitted token: its draft position, -1 for the target's own
        self._draft_by: list[str | None] = []  # per emitted token: the drafter of an accepted draft, else None
        # trace: each delta also says which drafter each piece of its text came from (runs) and its step.
        self.trace, self._step, self._traced_bytes = trace, None, 0
        self._token_ends: list[int] = []  # per emitted token: byte offset where its bytes end
        self._reported = 0  # emitted tokens already reported by a TextDelta
        self._text = TextAssembler(stop)
        self.finish_reason: str | None = None  # set once the generation has ended

    @property
    def remaining(self) -> int:
        """Tokens that may still be emitted (max_tokens cap)."""
        return self.max_tokens - len(self.emitted)

    def cut(self, new: list[int]) -> list[int]:
        """The tokens of a step that may be committed: up to (not including) the first
        end-of-generation token, and at most ``remaining``. Sets finish_reason "stop" at an
        end-of-generation token."""
        self._step_eog = 0
        for j, tok in enumerate(new):
            if tok in self.eog_ids:
                if j < self.remaining:  # else max_tokens ends the output before it
                    self.finish_reason = "stop"
                    self.stats.eog_committed = self._step_eog = 1
                new = new[:j]
                break
        return new[: self.remaining]

    def add(self, new: list[int], num_accepted: int, k: int, logits: np.ndarray,
            gaps: Sequence[float] | None = None, by: str | None = None) -> TextDelta:
        """Record one step that drafted k tokens and committed new (its first num_accepted
        accepted drafts, then the target's own); logits: [k+1, V] the target's raw logits
        at the step's positions (logprobs are of the raw distribution); gaps: the top-2 gap
        of the scores the acceptance rule chose each committed token by (penalties, grammar
        mask, temperature and noise applied; default: of the raw logits). Returns the text
        delta that is safe to stream ("" if none), with the tokens it completes (see
        :class:`TextDelta`); by: the drafter that drafted them (traces name it)."""
        # An end-of-generation token that was an accepted draft is accepted, though not
        # emitted; drafts after it are not counted at all (nothing after the end is).
        eog_drafted = bool(self._step_eog) and num_accepted > len(new)
        n_acc = len(new) + 1 if eog_drafted else min(num_accepted, len(new))
        self.stats.record_step(n_acc if eog_drafted else k, n_acc, len(new) + self._step_eog)
        self._step_eog = 0
        pieces = [self.token_bytes(t) for t in new]
        delta, stopped = self._text.add(pieces)
        if new and not self.emitted:
            self.stats.first_token_s = time.perf_counter() - self.started
        end = self._token_ends[-1] if self._token_ends else 0
        for piece in pieces:
            end += len(piece)
            self._token_ends.append(end)
        self.emitted.extend(new)
        self._draft_pos.extend(j if j < n_acc else -1 for j in range(len(new)))
        self._draft_by.extend(by if j < n_acc else None for j in range(len(new)))
        self._step = {"k": k, "accepted": n_acc, "committed": len(new), "by": by if k else None}
        for j, tok in enumerate(new):
            if self.gaps is not None:
                self.gaps.append(gaps[j] if gaps is not None else top2_gap(logits[j]))
            if self.logprobs is not None:
                self.logprobs.append(self._logprob(logits[j], tok))
        if stopped:
            # Text, token ids and logprobs are cut at the same point: tokens whose bytes
            # start at or after the stop string are dropped, even ones whose text was held
            # back in an earlier step.
            n_keep = self._text.num_tokens
            self.stats.retract_accepted(p for p in self._draft_pos[n_keep:] if p >= 0)
            for kept in (self.emitted, self._draft_pos, self._draft_by, self._token_ends, self.gaps, self.logprobs):
                if kept is not None:
                    del kept[n_keep:]
            self.finish_reason = "stop"
            self.stats.eog_committed = 0
        elif self.finish_reason is None and self.remaining <= 0:
            self.finish_reason = "length"
        self.stats.completion_tokens = len(self.emitted)
        self.stats.decode_s = time.perf_counter() - self.decode_started
        # After a stop the text is final: every kept token is reported with this delta.
        return self._delta(delta, final=stopped)

    def end(self, finish_reason: str = "length") -> TextDelta:
        """The generation ends (sets finish_reason if no stop came first); returns the
        held-back tail of the text ("" if none) with every token not reported before."""
        if self.finish_reason is None:
            self.finish_reason = finish_reason
        self.stats.completion_tokens = len(self.emitted)
        self.stats.decode_s = time.perf_counter() - self.decode_started
        return self._delta(self._text.finish(), final=True)

    def _delta(self, text: str, final: bool) -> TextDelta:
        """text with the tokens it completes: those not reported yet whose bytes end within
        the bytes streamed so far and start before their end (a token of no bytes at the
        streamed end waits where there are stop strings: one found there later would drop
        it; without them it is reported at once, as every code of a model over codes is);
        all of the rest when ``final``."""
        n = len(self.emitted)
        if final:
            upto = n
        else:
            streamed = _streamed_bytes(self._text)
            no_stops = self._text._matcher is None
            upto = self._reported
            while upto < n and self._token_ends[upto] <= streamed and (no_stops or self._token_start(upto) < streamed):
                upto += 1
        lo, self._reported = self._reported, max(self._reported, upto)
        step, self._step = self._step, None
        return TextDelta(text, self.emitted[lo:upto], self.logprobs[lo:upto] if self.logprobs is not None else None,
                         self._runs(text) if self.trace else None, step if self.trace else None)

    def _runs(self, text: str) -> list[dict]:
        """text (the next streamed characters) as runs of one source each: the drafter of the
        token whose bytes hold each character (None: the target's own token)."""
        runs: list[list] = []
        at = self._traced_bytes
        for ch in text:
            i = bisect.bisect_right(self._token_ends, at)
            by = self._draft_by[i] if i < len(self._draft_by) else None
            if runs and runs[-1][1] == by:
                runs[-1][0] += ch
            else:
                runs.append([ch, by])
            at += len(ch.encode("utf-8", "surrogatepass"))
        self._traced_bytes = at
        return [{"text": t, "by": b} for t, b in runs]

    def _token_start(self, i: int) -> int:
        return self._token_ends[i - 1] if i > 0 else 0

    def result(self) -> GenerationResult:
        """The GenerationResult (after :meth:`end`)."""
        assert self.finish_reason is not None, "end() must be called before result()"
        return GenerationResult(
            text=self._text.text, token_ids=self.emitted, finish_reason=self.finish_reason, stats=self.stats,
            logprobs=self.logprobs, top2_gaps=self.gaps, from_draft=[p >= 0 for p in self._draft_pos],
            prompt_ids=self.prompt_ids,
        )

    def _logprob(self, row: np.ndarray, tok: int) -> TokenLogprob:
        n = min(self.n_logprobs or 0, len(row))  # a codebook may be smaller than the N asked for
        lps = log_softmax(row)
        top = np.argpartition(lps, -n)[-n:] if n > 0 else np.array([], dtype=np.int64)
        top = top[np.argsort(-lps[top])]
        top = top[np.isfinite(lps[top])]  # a token a grammar forbids (-inf) is no candidate, and -inf is not JSON

        def piece(t) -> str:
            return self.token_bytes(int(t)).decode("utf-8", errors="replace")

        return TokenLogprob(token_id=int(tok), token=piece(tok), logprob=float(lps[tok]),
                            top_logprobs=[(int(t), piece(t), float(lps[t])) for t in top])


def drive(gen: Any, step: Callable[[list[Any]], list[TextDelta]],
          end: Callable[[Any], list]) -> Iterator[TextDelta | GenerationResult]:
    """Step one generation (an engine.core.Generation, typed Any: this module sits below the
    engine) to its end: yield its non-empty deltas, then what ``end`` returns (the last delta
    and the GenerationResult). A consumer that stops early (a closed stream) still ends it,
    so that its slot is freed."""
    ended = False
    try:
        while not gen.done:
            delta = step([gen])[0]
            if delta or delta.token_ids:
                yield delta
        ended = True
        yield from end(gen)
    finally:
        if not ended:
            end(gen)
