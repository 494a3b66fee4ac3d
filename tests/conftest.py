"""Shared fixtures: the small real model (smollm2-135m-instruct, pulled once into the
cache) and a deterministic fake backend for crafted engine cases."""

from __future__ import annotations

import os
from typing import Sequence

import numpy as np
import pytest

from specdecode.backends.base import BackendBase
from specdecode.assembly import registry
from specdecode.drafters import Draft, DrafterBase
from specdecode.errors import ContextOverflowError

SMOLLM = "smollm2-135m-instruct"

# The attention path is pinned to llama.cpp's own for the suite (and the processes it starts): chosen by
# measurement (specdecode.control.attention), it would differ between the machines CI runs on, and
# with it each model's invariant block. tests/test_attention_path.py measures both paths with the variable unset.
os.environ.setdefault("SPECDECODE_LLAMA_FLASH_ATTN", "auto")


@pytest.fixture(scope="session")
def smollm_path():
    return registry.resolve(SMOLLM, progress=False)


@pytest.fixture(scope="session")
def smollm(smollm_path):
    from specdecode.backends.llama_cpp import LlamaCppBackend

    b = LlamaCppBackend(smollm_path, n_ctx=2048, name=SMOLLM)
    yield b
    b.close()


@pytest.fixture(scope="session")
def smollm_draft(smollm_path):
    from specdecode.backends.llama_cpp import LlamaCppBackend

    b = LlamaCppBackend(smollm_path, n_ctx=2048, name=SMOLLM + " (draft)")
    yield b
    b.close()


def step_outcome(accepted: int, verified: int = 0, seconds: float = 0.0, confidence: float = 0.5,
                 drafted: int | None = None, timed: bool = True):
    """A step's outcome as the engine hands it to a drafter: accepted drafts of drafted (default
    accepted), the batch's timing (verified tokens, seconds; 0: none) and a target row whose top-1
    probability is confidence."""
    from specdecode.drafters import StepOutcome

    m = int(np.ceil((1 - confidence) / confidence)) + 1  # others below the top one
    row = np.log(np.array([confidence] + [(1 - confidence) / m] * m, dtype=np.float64)).astype(np.float32)
    return StepOutcome(accepted, accepted if drafted is None else drafted, row[None, :], verified, seconds, timed)


class ScriptedBackend(BackendBase):
    """A fake target whose greedy continuation of the prompt is a fixed script.

    Vocabulary: ids 0..V-1 with byte pieces given by ``pieces``; id ``eos`` ends
    generation. At absolute position t (predicting token t+1) the logits put a margin of
    ``margin`` on script[t + 1 - n_prompt] (eos past the end of the script), computed from
    the tokens actually in the cache, so it behaves as a real causal LM would: rolling
    back and re-feeding reproduces the same logits.
    """

    def __init__(self, pieces: Sequence[bytes], script: Sequence[int], n_prompt: int, eos: int = 0,
                 n_ctx: int = 512, margin: float = 5.0, n_seq: int = 1):
        self.name = "scripted"
        self.pieces = list(pieces)
        self.script = list(script)
        self.n_prompt = n_prompt
        self.eos = eos
        self._n_ctx = n_ctx
        self.margin = margin
        self.caches: list[list[int]] = [[] for _ in range(n_seq)]
        self.forward_calls: list[int] = []  # tokens per forward call (all sequences of a batch)
        self.batch_sizes: list[int] = []  # sequences per forward call

    n_vocab = property(lambda self: len(self.pieces))
    n_ctx = property(lambda self: self._n_ctx)
    n_seq = property(lambda self: len(self.caches))
    cache = property(lambda self: self.caches[0])
    kv_len = property(lambda self: len(self.caches[0]))
    eog_ids = property(lambda self: frozenset({self.eos}))

    def seq_len(self, seq: int) -> int:
        return len(self.caches[seq])

    def tokenize(self, text, add_special=True, parse_special=False):
        raise TypeError("scripted backend takes token ids directly")

    def token_bytes(self, token_id: int) -> bytes:
        return self.pieces[token_id]

    def token_text(self, token_id: int) -> bytes:
        return self.pieces[token_id]

    def apply_chat_template(self, messages):
        raise TypeError("scripted backend has no chat template")

    def next_token(self, position: int) -> int:
        i = position + 1 - self.n_prompt
        return self.script[i] if 0 <= i < len(self.script) else self.eos

    def forward(self, token_ids, logits_for, seq=0):
        return self.forward_batch([(seq, token_ids, logits_for)])[0]

    def forward_batch(self, items):
        seqs = [seq for seq, _, _ in items]
        assert len(set(seqs)) == len(seqs), "each sequence once per batch"
        for seq, token_ids, _ in items:
            if len(self.caches[seq]) + len(token_ids) > self._n_ctx:
                raise ContextOverflowError("scripted context overflow")
        self.forward_calls.append(sum(len(t) for _, t, _ in items))
        self.batch_sizes.append(len(items))
        return [self._forward(seq, token_ids, logits_for) for seq, token_ids, logits_for in items]

    def _forward(self, seq, token_ids, logits_for):
        cache = self.caches[seq]
        start = len(cache)
        cache.extend(int(t) for t in token_ids)
        rows = []
        for i in logits_for:
            row = np.zeros(self.n_vocab, dtype=np.float32)
            row[self.next_token(start + i)] = self.margin
            rows.append(row)
        return np.stack(rows) if rows else np.zeros((0, self.n_vocab), dtype=np.float32)

    invariant_block = None  # measured by the engine when a generation asks for batch invariance
    invariant_mode = False

    def set_batch_invariant(self, on: bool) -> None:
        self.invariant_mode = on

    def rollback(self, n: int, seq: int = 0) -> None:
        assert 0 <= n <= len(self.caches[seq])
        del self.caches[seq][n:]

    def close(self) -> None:
        pass


class OracleDrafter(DrafterBase):
    """Proposes exactly what the scripted target will produce (tokens past eos included)."""

    name = "oracle"

    def __init__(self, target: ScriptedBackend):
        self.target = target

    def start(self, prompt_ids, sampler):
        pass

    def propose(self, context, k):
        pos = len(context) - 1
        out = []
        for i in range(k):
            idx = pos + i + 1 - self.target.n_prompt
            out.append(self.target.script[idx] if 0 <= idx < len(self.target.script) else 1)
        return Draft(out)

    def observe(self, outcome):
        pass

    def finish(self, committed):
        pass


class WrongDrafter(DrafterBase):
    """Always proposes a token the target does not want (wraps another backend's argmax + 1)."""

    name = "wrong"

    def __init__(self, target_next, n_vocab: int):
        self.target_next = target_next
        self.n_vocab = n_vocab

    def start(self, prompt_ids, sampler):
        pass

    def propose(self, context, k):
        return Draft([(self.target_next(list(context)) + 1 + i) % self.n_vocab for i in range(k)])

    def observe(self, outcome):
        pass

    def finish(self, committed):
        pass


class ScriptedClock:
    """time.perf_counter for one test: it stands still but when a fake backend's forward
    advances it by that forward's scripted cost, so that the step times the engine hands the
    controller and its guard are the script's, whatever the machine's load (drafting and the
    engine's own Python take no time on it)."""

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds
