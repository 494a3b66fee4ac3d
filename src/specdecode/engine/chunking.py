"""How large a piece of a prompt to read next (chunked prefill with decode priority), as vLLM
schedules decode steps first and fills the rest of a step's token budget with prefill chunks
(``max_num_batched_tokens``; Agrawal et al. 2024, "Taming Throughput-Latency Tradeoff in LLM
Inference with Sarathi-Serve"). On a CPU a forward's cost grows with its tokens, so the budget
here is time, not tokens: while other generations decode, a chunk costs about
``PREFILL_CHUNK_STEPS`` of their steps, so that their largest gap between two tokens is one
step plus one chunk. With nobody decoding, a prompt is read as a whole read would read it, so
that a request alone gets the bits it always got: in whole multiples of the target's own split
(``prefill_split``: llama.cpp's n_batch, the tokens it decodes per call; a read in chunks of
those calls is the same calls), as many as fit in about ``PREFILL_SOLO_S`` seconds, so that a
request that arrives meanwhile waits for one chunk, not for the whole prompt; a target without
a split (one forward reads any prompt) reads the rest at once.

Both costs are measured as they happen (a step's seconds, a chunk's seconds per token, each an
exponential moving average), so the size follows the machine, the model and the context the
prompt has reached; the first chunk, before anything is measured, is ``FIRST_CHUNK`` tokens.
"""

from __future__ import annotations

from dataclasses import dataclass

PREFILL_CHUNK_STEPS = 4.0  # while others decode: a chunk's cost, in their steps
PREFILL_SOLO_S = 1.0  # with nobody decoding: a chunk's cost in seconds
FIRST_CHUNK = 32  # tokens, before a chunk has been timed
MIN_CHUNK = 8  # tokens: below this a chunk's fixed cost would dominate
MAX_CHUNK = 8192  # tokens
EMA = 0.3  # weight of the newest measurement


@dataclass
class PrefillChunker:
    """Sizes the chunks of chunked prefill from measured costs.

    split: the target's ``prefill_split`` (None: none). steps: while others decode, a chunk's
    cost in their steps. solo_s: with nobody decoding, a chunk's cost in seconds (in multiples
    of split). step_s / token_s: the measured cost of a step (seconds) and of one prompt token
    in a chunk (seconds), None until measured.
    """

    split: int | None = None
    steps: float = PREFILL_CHUNK_STEPS
    solo_s: float = PREFILL_SOLO_S
    step_s: float | None = None
    token_s: float | None = None

    def observe_step(self, seconds: float) -> None:
        """A batched step of the decoding generations took ``seconds``."""
        self.step_s = _ema(self.step_s, seconds)

    def observe_chunk(self, tokens: int, seconds: float) -> None:
        """A chunk of ``tokens`` prompt tokens took ``seconds`` (ignored when empty)."""
        if tokens > 0:
            self.token_s = _ema(self.token_s, seconds / tokens)

    def size(self, decoding: bool) -> int | None:
        """Tokens for the next chunk (None: the rest of the prompt). While others decode
        (``decoding``): about ``steps`` of their steps' time, within MIN_CHUNK..MAX_CHUNK
        (FIRST_CHUNK before a chunk and a step are timed). Else: the most whole splits that
        fit in about ``solo_s`` (at least one; one before a chunk is timed), or None without
        a split."""
        if not decoding:
            if self.split is None:
                return None
            return self.split * max(1, int(self.solo_s / (self.token_s * self.split) + 1e-9) if self.token_s else 1)
        if self.step_s is None or not self.token_s:
            return FIRST_CHUNK
        return int(min(MAX_CHUNK, max(MIN_CHUNK, self.steps * self.step_s / self.token_s + 1e-9)))


def _ema(old: float | None, new: float) -> float:
    return new if old is None else (1 - EMA) * old + EMA * new
