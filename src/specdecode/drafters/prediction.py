"""Predicted outputs: drafts that follow a text the client expects the answer to be close to
(OpenAI's ``prediction: {"type": "content", ...}``; a code assistant sends the file being
edited), re-aligned after each divergence as a diff would.

The prediction is tokenized once with the target's tokenizer. The drafter keeps where the
output stands in it: each committed token that equals the prediction's next one advances
the position; one that does not loses it, and after each further token the drafter looks
for the place where the last committed tokens match the prediction again (the longest
agreement with the output's end, then the place nearest to where the output would stand
had it only substituted tokens; a match that ends a line may be shorter, as a diff
re-synchronises on whole lines). While aligned it proposes up to k tokens from there at
once; the cost-aware controller sizes k from its acceptance estimates and does not
confirm in small blocks while the prediction keeps being right (:attr:`confirmed`).

A prediction never changes the output: drafts are verified like any other, so greedy
decoding gives the target's tokens and sampling its distribution. accepted / rejected
count the drafted prediction tokens the target kept / discarded (what
``usage.completion_tokens_details.accepted_prediction_tokens`` and
``rejected_prediction_tokens`` report).

Dimension letters: K = drafted tokens, L = context length, P = prediction length.
"""

from __future__ import annotations

from typing import Callable, Sequence

from .base import Draft, DraftingRequest, LookupDrafter, Match, StepOutcome

# Tokens of agreement with the output's end that re-align a lost prediction: MIN_ALIGN in
# general, MIN_ALIGN_LINE when the agreement ends a line (a diff's next unchanged line).
MIN_ALIGN = 3
MIN_ALIGN_LINE = 2
MAX_AGREE = 16  # agreement is counted up to this many tokens
# One agreeing token re-aligns where it is this close to the expected position: the output
# substituted a few tokens (a renamed identifier) and goes on as predicted.
WEAK_WINDOW = 8
# Re-alignment looks at the candidates within this many tokens of the expected position
# first, and the whole prediction only when none of those agrees enough.
NEAR_WINDOW = 512


class PredictionDrafter(LookupDrafter):
    """Drafts from a predicted output (see the module docstring).

    The request field ``prediction`` hands over one generation's prediction [P] (through
    :meth:`configure` after ``start``, which clears it; or :meth:`set_prediction`); :meth:`lookup` reports a match of length 1 + the tokens in a
    row the output has agreed with it (0: no prediction, or lost), always unique.
    """

    name = "prediction"
    request_fields = ("prediction",)
    # Acceptance priors per band of agreement (first drafted token, each further one once the
    # one before was accepted), as controller.MATCH_PRIORS: a client's prediction is usually
    # right where it is aligned; the estimates then follow what the target accepts.
    # Bands (controller.MATCH_BANDS) of 1 + agreement: 1 at the start, 2 for a re-alignment on
    # one token (a guess), more as the output keeps agreeing.
    match_priors = {u: ((0.85, 0.95), (0.5, 0.9), (0.75, 0.95), (0.9, 0.97), (0.95, 0.98), (0.97, 0.99))
                    for u in (False, True)}

    def __init__(self) -> None:
        self.accepted = 0
        self.rejected = 0
        self._set(None, None, 0)

    def _set(self, ids: Sequence[int] | None, token_bytes: Callable[[int], bytes] | None, start: int) -> None:
        self._pred: list[int] = list(ids or [])
        self._token_bytes = token_bytes
        self._newline: dict[int, bool] = {}
        self._where: dict[int, list[int]] = {}  # token -> its positions in the prediction, ascending
        for i, t in enumerate(self._pred):
            self._where.setdefault(t, []).append(i)
        self._out_start = start  # context index of the first output token
        self._read = start  # context tokens read so far
        self._pos: int | None = 0 if self._pred else None  # prediction index of the next output token
        self._expect = 0  # where the output would stand in the prediction had it only substituted tokens
        self._agree = 0
        self._confirmed = bool(self._pred)
        self._last_k = 0

    @property
    def has_prediction(self) -> bool:
        return bool(self._pred)

    @property
    def confirmed(self) -> bool:
        """Whether the prediction has been right so far: aligned from the start and every
        proposal accepted whole, or its last proposal after a re-alignment accepted whole.
        The controller then lets it draft long blocks at once."""
        return self._confirmed and self._pos is not None

    def start(self, prompt_ids: Sequence[int], sampler) -> None:
        self.accepted = self.rejected = 0
        self._set(None, None, len(prompt_ids))

    def set_prediction(self, ids: Sequence[int] | None, token_bytes: Callable[[int], bytes] | None = None) -> None:
        """This generation's predicted output [P] (target token ids; None or empty: none).
        token_bytes(id) gives a token's text, to find line ends (optional)."""
        self._set(ids, token_bytes, self._out_start)

    def take_inputs(self, request: DraftingRequest) -> None:
        self.set_prediction(request.inputs.get("prediction"), request.token_bytes)

    def input_counts(self) -> tuple[int, int] | None:
        return (self.accepted, self.rejected) if self.has_prediction else None

    def fork(self, seq: int) -> "PredictionDrafter":
        return PredictionDrafter()

    def _is_newline(self, token: int) -> bool:
        if self._token_bytes is None:
            return False
        if token not in self._newline:
            self._newline[token] = b"\n" in self._token_bytes(token)
        return self._newline[token]

    def _sync(self, context: Sequence[int]) -> None:
        """Read the tokens committed since the last call."""
        if len(context) < self._read:  # a shorter context: another text; start over at its end
            self._read = self._out_start = len(context)
        if not self._pred:  # no prediction (the usual case): nothing to follow
            self._read = len(context)
            return
        pred, n = self._pred, len(self._pred)
        for t in context[self._read:]:
            self._expect += 1
            if self._pos is not None and self._pos < n and pred[self._pos] == t:
                self._pos += 1
                self._agree += 1
            else:
                self._pos, self._agree, self._confirmed = None, 0, False
        grew = len(context) > self._read
        self._read = len(context)
        if self._pos is None and grew:
            self._realign(context)

    def _realign(self, context: Sequence[int]) -> None:
        """Find where the output's last tokens agree with the prediction again."""
        out = context[self._out_start:]
        if not out:
            return
        last = out[-1]
        cands = self._where.get(last, ())
        if not cands:
            return
        need = MIN_ALIGN_LINE if self._is_newline(last) else MIN_ALIGN
        best = (self._best(out, cands, 1, near=True, window=WEAK_WINDOW)
                or self._best(out, cands, need, near=True) or self._best(out, cands, need, near=False))
        if best is not None:
            pos, agree = best
            self._pos, self._agree, self._expect = pos, agree, pos

    def _best(self, out: Sequence[int], cands: Sequence[int], need: int, near: bool,
              window: int = NEAR_WINDOW) -> tuple[int, int] | None:
        """(next position, agreeing tokens) of the best candidate c (pred[c] == out[-1]) within
        ``window`` of the expected position (near) or beyond it, agreeing for >= need tokens."""
        pred, e = self._pred, self._expect
        best_key, best = None, None
        span = min(MAX_AGREE, len(out))
        for c in cands:
            if near != (abs(c + 1 - e) <= window) or c + 1 >= len(pred):
                continue
            agree = 1
            while agree < span and agree <= c and pred[c - agree] == out[-1 - agree]:
                agree += 1
            if agree < need:
                continue
            key = (min(agree, 8), -abs(c + 1 - e))
            if best_key is None or key > best_key:
                best_key, best = key, (c + 1, agree)
        return best

    def lookup(self, context: Sequence[int]) -> Match:
        self._sync(context)
        if self._pos is None or self._pos >= len(self._pred):
            return Match(0, -1, False)
        return Match(1 + self._agree, self._pos, True)

    def available(self, context: Sequence[int]) -> int:
        self._sync(context)
        return 0 if self._pos is None else len(self._pred) - self._pos

    def propose(self, context: Sequence[int], k: int) -> Draft:
        self._sync(context)
        if self._pos is None or k <= 0:
            self._last_k = 0
            return Draft([])
        ids = self._pred[self._pos:self._pos + k]
        self._last_k = len(ids)
        return Draft(ids)

    def observe(self, outcome: StepOutcome) -> None:
        num_accepted = outcome.num_accepted
        k, self._last_k = self._last_k, 0
        if k == 0:
            return
        self.accepted += num_accepted
        self.rejected += k - num_accepted
        self._confirmed = num_accepted == k
