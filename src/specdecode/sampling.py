"""Logits to probabilities: penalties, temperature, top-k, top-p, min-p; a seeded generator.

Dimension letters: V = vocabulary size, N = number of positions.

The same :class:`Sampler` shapes the target's logits at every verified position and the
draft model's logits when it drafts, so both distributions of the speculative sampling
rule are transformed the same way (docs/architecture.md, Invariants). History-dependent penalties
are computed from exactly the token prefix that ends at the position being scored.

Order of transforms (as in Hugging Face transformers' logits processors):
    penalties (repetition, frequency, presence) -> temperature -> top-k -> top-p -> min-p.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Sequence

import numpy as np

from .errors import SpecDecodeError
from .grammar import GrammarConstraint, apply_mask
from .limits import DEFAULT_SAMPLING_RULE, SAMPLING_RULES

NOISE_CACHE = 64  # positions whose noise a Sampler keeps (a step verifies at most 33)


@dataclass(frozen=True)
class SamplingParams:
    """How to turn the target's logits into the next token.

    temperature: 0 means greedy (argmax); otherwise logits are divided by it. Range [0, 100].
    top_k: keep the k most likely tokens; 0 disables. Range >= 0.
    top_p: nucleus sampling, keep the smallest set with cumulative probability >= top_p;
        1.0 disables. Range (0, 1].
    min_p: drop tokens whose probability is below min_p times the top probability;
        0 disables. Range [0, 1].
    repetition_penalty: CTRL-style (Keskar et al. 2019) divisor for positive logits of tokens
        already in the history (multiplier for negative ones); 1.0 disables. Range > 0.
    frequency_penalty, presence_penalty: OpenAI-style, subtract
        count * frequency_penalty + (count > 0) * presence_penalty. Range [-2, 2].
    penalty_last_n: how many of the most recent tokens (prompt included) the penalties see;
        -1 means the whole context. As llama.cpp's ``repeat_last_n`` (default 64).
    seed: seed of the random generator; None draws one from the OS.
    sampling_rule: how drafts are verified under sampling (:data:`specdecode.limits.SAMPLING_RULES`):
        "gumbel": every position's token is the Gumbel-max choice under noise keyed by
        (seed, position), so the same seed gives the same text at any K, with any drafter or
        none, alone or in a batch; "rejection": the rejection rule of Leviathan et al.
        (Algorithm 1) / Chen et al. (Algorithm 2), which uses a draft model's probabilities
        and draws from one stream whose use depends on K (it accepts more of a draft model's
        sampled drafts); "auto" (default): gumbel when a seed is given, else rejection. All
        keep the target's distribution.

    Raises SpecDecodeError naming the value when a field is out of range.
    """

    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    penalty_last_n: int = 64
    seed: int | None = None
    sampling_rule: str = DEFAULT_SAMPLING_RULE

    def __post_init__(self) -> None:
        def bad(name: str, value: object, allowed: str) -> SpecDecodeError:
            return SpecDecodeError(f"{name} = {value!r} is out of range: {allowed}", param=name)

        if not (0.0 <= self.temperature <= 100.0):
            raise bad("temperature", self.temperature, "expected 0 <= temperature <= 100 (0 = greedy)")
        if self.top_k < 0:
            raise bad("top_k", self.top_k, "expected top_k >= 0 (0 = disabled)")
        if not (0.0 < self.top_p <= 1.0):
            raise bad("top_p", self.top_p, "expected 0 < top_p <= 1")
        if not (0.0 <= self.min_p <= 1.0):
            raise bad("min_p", self.min_p, "expected 0 <= min_p <= 1")
        if not self.repetition_penalty > 0.0:
            raise bad("repetition_penalty", self.repetition_penalty, "expected repetition_penalty > 0")
        if not (-2.0 <= self.frequency_penalty <= 2.0):
            raise bad("frequency_penalty", self.frequency_penalty, "expected -2 <= frequency_penalty <= 2")
        if not (-2.0 <= self.presence_penalty <= 2.0):
            raise bad("presence_penalty", self.presence_penalty, "expected -2 <= presence_penalty <= 2")
        if self.penalty_last_n < -1:
            raise bad("penalty_last_n", self.penalty_last_n, "expected -1 (whole context) or >= 0")
        if self.seed is not None and not (0 <= self.seed < 2**64):
            raise bad("seed", self.seed, "expected 0 <= seed < 2**64")
        if self.sampling_rule not in SAMPLING_RULES:
            raise SpecDecodeError(f"sampling_rule {self.sampling_rule!r} is not one of {', '.join(SAMPLING_RULES)}",
                                  param="sampling_rule")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def keyed(self) -> bool:
        """Sampling under the gumbel rule: "gumbel", or "auto" with a seed."""
        rule = self.sampling_rule
        return not self.greedy and (rule == "gumbel" or rule == "auto" and self.seed is not None)

    @property
    def has_penalties(self) -> bool:
        return (
            self.repetition_penalty != 1.0 or self.frequency_penalty != 0.0 or self.presence_penalty != 0.0
        ) and self.penalty_last_n != 0


@dataclass
class Sampler:
    """Applies :class:`SamplingParams` to logits; owns the generation's randomness.

    One Sampler serves one generation. Its randomness is keyed by position: :meth:`draw`
    of the token at absolute index i of the sequence (prompt included) under the "gumbel"
    rule is a function of the distribution and of noise that depends only on (seed, i -
    prompt_len), never on how many draws came before, so drafts made and discarded consume
    nothing a later step needs. The "rejection" rule draws from one seeded stream (``rng``)
    in the order the engine asks. constraint: the generation's grammar (structured output),
    or None; its mask comes before every other transform, for target and draft alike.
    prompt_len: tokens of the prompt (output position = index - prompt_len).
    """

    params: SamplingParams
    constraint: "GrammarConstraint | None" = None
    prompt_len: int = 0
    rng: np.random.Generator = field(init=False)
    seed: int = field(init=False)

    def __post_init__(self) -> None:
        # A generation without a seed gets one, so that its noise is still keyed by position.
        self.seed = self.params.seed if self.params.seed is not None else int(np.random.SeedSequence().entropy) % 2**64
        self.rng = np.random.default_rng(self.seed)
        self._noise: dict[int, np.ndarray] = {}  # absolute index -> E [V]

    @property
    def keyed(self) -> bool:
        """Sampled tokens are Gumbel-max choices under position-keyed noise (the "gumbel"
        rule, or "auto" with a seed)."""
        return self.params.keyed

    def noise(self, index: int, n_vocab: int) -> np.ndarray:
        """Exponential draws E [V] (E_i ~ Exp(1), float32) for the token at absolute index
        ``index``: Philox (a counter-based generator) keyed by (seed, output position); the
        same at every call. The last NOISE_CACHE positions are kept (target and draft model
        read the same)."""
        e = self._noise.get(index)
        if e is None or len(e) != n_vocab:
            pos = index - self.prompt_len
            gen = np.random.Generator(np.random.Philox(key=np.array([self.seed, pos % 2**64], dtype=np.uint64)))
            e = np.maximum(gen.standard_exponential(n_vocab, dtype=np.float32), np.float32(1e-30))  # never 0
            if len(self._noise) >= NOISE_CACHE:
                self._noise.pop(next(iter(self._noise)))
            self._noise[index] = e
        return e

    def draw(self, probs: np.ndarray, index: int) -> int:
        """The token at absolute index ``index`` drawn from probs [V]: under the "gumbel" rule
        argmin over p > 0 of E_i / p_i with E_i ~ Exp(1) from :meth:`noise` (the exponential
        race, which is Gumbel-max: argmax log p_i + G_i with G_i = -log E_i; P(i) = p_i
        exactly); else one draw from the stream ``rng``. Raises ValueError for zero mass."""
        if not self.keyed:
            return sample_token(probs, self.rng)
        with np.errstate(divide="ignore"):
            race = self.noise(index, len(probs)) / probs  # p_i = 0: +inf, never chosen
        best = int(np.argmin(race))
        if not probs[best] > 0.0:
            raise ValueError("cannot sample from a distribution with zero mass")
        return best

    def scores(self, logits: np.ndarray, history: Sequence[int], index: int) -> np.ndarray:
        """What the rule chose the token at ``index`` by, [V] (larger wins): the penalized
        logits under greedy; under sampling log p_i + G_i, the Gumbel-perturbed log
        probabilities (-inf where p_i = 0), whose top-2 gap says how close the choice was.
        logits: [V] after the grammar mask."""
        if self.params.greedy:
            return np.asarray(self.penalize(logits, history), dtype=np.float64)
        probs = self.probs(logits, history)
        with np.errstate(divide="ignore"):
            if not self.keyed:
                return np.log(probs)
            return np.log(probs) - np.log(self.noise(index, len(probs)))

    def constrain(self, logits: np.ndarray, pending: Sequence[int] = ()) -> np.ndarray:
        """The grammar mask (structured output), applied first: logits [V] at the position
        after the committed tokens and ``pending`` drafts, disallowed tokens at -inf (a new
        array; logits itself when there is no grammar)."""
        if self.constraint is None:
            return logits
        return apply_mask(logits, self.constraint.mask(pending))

    def penalize(self, logits: np.ndarray, history: Sequence[int]) -> np.ndarray:
        """Apply the history-dependent penalties.

        logits: [V] raw logits at one position. history: every token before that
        position (prompt, committed tokens and the drafts before it). Returns a new [V]
        float32 array (or logits itself when no penalty is set).
        """
        p = self.params
        if not p.has_penalties or len(history) == 0:
            return logits
        window = history if p.penalty_last_n == -1 else history[-p.penalty_last_n :]
        ids, counts = np.unique(np.asarray(window, dtype=np.int64), return_counts=True)
        keep = (ids >= 0) & (ids < logits.shape[-1])
        ids, counts = ids[keep], counts[keep]
        out = np.array(logits, dtype=np.float32, copy=True)
        vals = out[ids]
        if p.repetition_penalty != 1.0:
            vals = np.where(vals > 0, vals / p.repetition_penalty, vals * p.repetition_penalty)
        vals = vals - counts * p.frequency_penalty - p.presence_penalty
        out[ids] = vals
        return out

    def shape(self, logits: np.ndarray) -> np.ndarray:
        """Temperature, top-k, top-p, min-p on penalized logits: [V] -> probabilities [V] float64.

        Must not be called for greedy params (temperature 0): there the token is the argmax.
        """
        p = self.params
        assert not p.greedy, "shape() is for temperature > 0; greedy uses argmax"
        z = np.asarray(logits, dtype=np.float64) / p.temperature
        v = z.shape[-1]
        if 0 < p.top_k < v:
            kth = np.partition(z, v - p.top_k)[v - p.top_k]
            z = np.where(z >= kth, z, -np.inf)
        z = z - z.max()
        probs = np.exp(z)
        probs /= probs.sum()
        if p.top_p < 1.0:
            probs = _top_p(probs, p.top_p)
        if p.min_p > 0.0:
            probs = np.where(probs >= p.min_p * probs.max(), probs, 0.0)
            probs /= probs.sum()
        return probs

    def probs(self, logits: np.ndarray, history: Sequence[int]) -> np.ndarray:
        """Penalties then :meth:`shape`: logits [V] at one position -> probabilities [V]."""
        return self.shape(self.penalize(logits, history))

    def argmax(self, logits: np.ndarray, history: Sequence[int]) -> int:
        """Greedy choice at one position: argmax of the penalized logits [V]."""
        return int(np.argmax(self.penalize(logits, history)))


def _sample(probs: np.ndarray, rng: np.random.Generator) -> int:
    """Draw one index from probs: [V] (non-negative, any positive sum)."""
    cdf = np.cumsum(probs, dtype=np.float64)
    total = cdf[-1]
    if not total > 0.0:
        raise ValueError("cannot sample from a distribution with zero mass")
    idx = int(np.searchsorted(cdf, rng.random() * total, side="right"))
    # Guard against idx == V when the uniform draw lands on the top edge in floating point.
    idx = min(idx, len(cdf) - 1)
    while probs[idx] <= 0.0:  # skip zero-probability slots that share a cdf value
        idx -= 1
    return idx


def log_softmax(logits: np.ndarray) -> np.ndarray:
    """log softmax of logits [V] (or any shape: over all its entries), in float64."""
    z = logits.astype(np.float64)
    z = z - z.max()
    return z - np.log(np.exp(z).sum())


def sample_token(probs: np.ndarray, rng: np.random.Generator) -> int:
    """Sample one token id from probs: [V], a (possibly unnormalised) distribution."""
    return _sample(np.asarray(probs, dtype=np.float64), rng)


def _top_p(probs: np.ndarray, top_p: float) -> np.ndarray:
    """Keep the smallest most-likely set whose mass reaches top_p; probs: [V] normalised.

    Sorting a 150k vocabulary costs milliseconds per position, so sort only a top slice
    first and fall back to the full sort when the slice does not reach top_p (exact).
    """
    v = probs.shape[-1]
    m = min(v, 1024)
    while True:
        if m < v:
            cand = np.argpartition(probs, v - m)[v - m :]
        else:
            cand = np.arange(v)
        order = cand[np.argsort(-probs[cand], kind="stable")]
        cum = np.cumsum(probs[order])
        if cum[-1] >= top_p or m == v:
            # Number kept: first index where cumulative mass reaches top_p, inclusive.
            n_keep = int(np.searchsorted(cum, top_p, side="left")) + 1
            n_keep = min(n_keep, len(order))
            # Ties at the cut-off are kept so that the result does not depend on sort order.
            threshold = probs[order[n_keep - 1]]
            out = np.where(probs >= threshold, probs, 0.0)
            return out / out.sum()
        m = min(v, m * 8)
