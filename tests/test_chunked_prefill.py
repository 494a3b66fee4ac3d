"""Chunked prefill with decode priority (issue 47, item 1): a long prompt is read a chunk at a
time between the other generations' steps, so a short streamed answer that started first
is not stalled by it.

The server test runs on a fake text model whose forwards advance a scripted clock (a fixed
cost per forward plus a cost per token, as a CPU's forwards grow with their tokens); the worker
times its steps and chunks with that clock, so the order and the gaps are judged in scripted
seconds, never by the wall clock.
"""

from __future__ import annotations

import json
import threading
import time
import httpx
import numpy as np
import pytest

from conftest import OracleDrafter, ScriptedBackend
from specdecode.api import Decoder
from specdecode.engine import SpeculativeEngine
from specdecode.engine.chunking import FIRST_CHUNK, MAX_CHUNK, MIN_CHUNK, PREFILL_CHUNK_STEPS, PrefillChunker
from specdecode.errors import SpecDecodeError
from specdecode.server import create_app

from test_server import ServerThread
from test_server_access import ByteBackend

MODEL = "clocked-bytes"
WAIT = 60.0  # seconds a test waits for an event due at once (a loaded machine is slow, not wrong)


# --- the engine: a prompt read in chunks is the prompt read whole ---------------------------

def scripted(n_prompt: int, script: list[int], n_seq: int = 1) -> ScriptedBackend:
    return ScriptedBackend([bytes([65 + i]) for i in range(20)], script, n_prompt=n_prompt, n_seq=n_seq)


def test_a_prompt_read_in_chunks_gives_what_a_whole_prefill_gives():
    prompt, script = [3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13], [5, 6, 7, 8, 9, 1, 2, 3]
    t = scripted(len(prompt), script)
    whole = SpeculativeEngine(t, OracleDrafter(t), num_speculative_tokens=3).generate(prompt, max_tokens=8)
    t2 = scripted(len(prompt), script)
    eng = SpeculativeEngine(t2, OracleDrafter(t2), num_speculative_tokens=3)
    gen = eng.begin(prompt, max_tokens=8, chunked=True)
    assert gen.prefilling and t2.forward_calls == []  # nothing read yet
    with pytest.raises(SpecDecodeError, match="prefill"):
        eng.step([gen])  # it cannot step before its prompt is read
    assert [eng.prefill(gen, 4), eng.prefill(gen, 4)] == [4, 4] and gen.prefilling
    assert eng.prefill(gen, 4) == 2 and not gen.prefilling  # the last 2 of the 10 (the 11th goes with the step)
    assert t2.forward_calls == [4, 4, 2]
    with pytest.raises(SpecDecodeError, match="prefill"):
        eng.prefill(gen, 4)  # read already
    while not gen.done:
        eng.step([gen])
    result = eng.end(gen)[-1]
    assert result.token_ids == whole.token_ids == script[:8]
    assert result.stats.prompt_cached == 0


def test_a_generation_ended_while_reading_keeps_what_it_read_for_the_next():
    prompt, script = list(range(2, 14)), [5, 6, 7]
    t = scripted(len(prompt), script)
    eng = SpeculativeEngine(t, OracleDrafter(t), num_speculative_tokens=2)
    gen = eng.begin(prompt, max_tokens=3, chunked=True)
    eng.prefill(gen, 6)
    eng.end(gen)  # a cancelled request: its slot is free, the 6 tokens read stay cached
    assert t.seq_len(0) == 6
    again = eng.begin(prompt, max_tokens=3, chunked=True)
    assert again.out.stats.prompt_cached == 6
    assert eng.prefill(again) == len(prompt) - 1 - 6 and not again.prefilling
    while not again.done:
        eng.step([again])
    assert eng.end(again)[-1].token_ids == script


def test_a_cached_prompt_steps_at_once_and_a_strict_one_reads_whole():
    prompt, script = list(range(2, 12)), [5, 6, 7]
    t = scripted(len(prompt), script)
    eng = SpeculativeEngine(t, OracleDrafter(t), num_speculative_tokens=2, invariance=lambda target, seq: 4)
    eng.generate(prompt, max_tokens=3)
    gen = eng.begin(prompt, max_tokens=3, chunked=True)  # every token but the last is cached
    assert not gen.prefilling and gen.out.stats.prompt_cached == len(prompt) - 1
    eng.end(gen)
    t.forward_calls.clear()
    strict = eng.begin(prompt, max_tokens=3, chunked=True, batch_invariant="on")
    assert not strict.prefilling and t.forward_calls[-1] == len(prompt) - 1  # read whole, from an empty cache
    eng.end(strict)


def test_a_seeded_or_strict_prompt_reuses_the_whole_calls_a_fresh_prefill_makes():
    """Issue 61: a seed threw the whole cache away (Codex's 9,148-token request read again, 420 s).
    A batch-invariant generation now keeps the cells that a fresh prefill computes alike: whole
    calls of the target's prefill split (llama.cpp's n_batch) from position 0 that are also in
    the common prefix; a prefix read from elsewhere (a call not starting on a split) is not."""
    prompt, script = list(range(2, 16)), [5, 6, 7]  # 13 prompt tokens read, in calls of 4 from 0
    t = scripted(len(prompt), script)
    t.prefill_split, t.invariant_block = 4, 4  # the block known (cached, or measured by an earlier request)
    eng = SpeculativeEngine(t, OracleDrafter(t), num_speculative_tokens=2, invariance=lambda target, seq: 4)
    eng.generate(prompt, max_tokens=3)
    t.forward_calls.clear()
    other = prompt[:10] + [17, 18, 19, 16]  # shares 10 tokens: whole calls [0, 4) and [4, 8)
    strict = eng.generate(other, max_tokens=3, batch_invariant="on")
    assert strict.stats.prompt_cached == 8 and t.forward_calls[0] == len(other) - 1 - 8
    # Its cells after 8 came from a call that began on a split: canonical, so the same prompt again
    # keeps all 13 (the same calls, the last one too) ...
    assert eng.generate(other, max_tokens=3, batch_invariant="on").stats.prompt_cached == 13
    # ... but a prefix read from position 5 (a call not on a split) is not: only [0, 4) is kept.
    eng.generate(prompt[:5] + [9] * 8 + [16], max_tokens=3)
    assert eng.generate(prompt[:5] + [9] * 8 + [16], max_tokens=3, batch_invariant="on").stats.prompt_cached == 4
    # Without a split (one call reads any prompt: rows' arithmetic depends on the call), nothing.
    t.prefill_split = None
    assert eng.generate(other, max_tokens=3, batch_invariant="on").stats.prompt_cached == 0


# --- the chunk size ---------------------------------------------------------------------------

def test_chunks_cost_a_few_steps_while_others_decode_and_whole_splits_alone():
    c = PrefillChunker(split=16, steps=4, solo_s=1.0)
    assert c.size(decoding=True) == FIRST_CHUNK and c.size(decoding=False) == 16  # nothing measured yet
    c.observe_chunk(32, 32 * 0.02)  # 20 ms a prompt token
    assert c.size(decoding=False) == 48  # 1 s holds 50 tokens: 3 whole splits of 16
    assert c.size(decoding=True) == FIRST_CHUNK  # no step timed yet
    assert PrefillChunker(split=None).size(decoding=False) is None  # one call reads any prompt: the rest at once
    slow = PrefillChunker(split=512, solo_s=1.0, token_s=0.02)
    assert slow.size(decoding=False) == 512  # a split costs 10 s: still one, never a part of one
    c.observe_step(0.06)
    assert c.size(decoding=True) == 12  # 4 steps of 60 ms: 240 ms
    c.observe_chunk(0, 5.0)  # an empty chunk says nothing
    assert c.token_s == pytest.approx(0.02)
    for _ in range(50):
        c.observe_chunk(10, 10 * 0.024)  # the context grew: tokens cost more, chunks shrink
    assert c.size(decoding=True) == 10
    c.observe_step(0.001)
    assert c.size(decoding=True) == MIN_CHUNK
    fast = PrefillChunker(token_s=1e-7, step_s=0.01)
    assert fast.size(decoding=True) == MAX_CHUNK


# --- the server: decode first -----------------------------------------------------------------

class ClockedBytes(ByteBackend):
    """ByteBackend's text model over bytes, of ``n_seq`` sequences, whose greedy answer to any
    prompt is "a" repeated; each forward advances ``now`` by ``fixed`` + ``per_token`` x its
    tokens, and is logged as (seq, tokens, rows, start, end) for each sequence in it.
    ``hold_after``: the forward that follows that many forwards with logits waits for ``gate``
    (``holding`` set meanwhile); ``hold_reads``: likewise, after that many forwards without."""

    def __init__(self, n_seq: int = 2, n_ctx: int = 8192, fixed: float = 0.05, per_token: float = 0.02,
                 hold_after: int | None = None, hold_reads: int | None = None) -> None:
        super().__init__(n_ctx)
        self.name = MODEL
        self.seqs: list[list[int]] = [[] for _ in range(n_seq)]
        self.fixed, self.per_token, self.now = fixed, per_token, 0.0
        self.log: list[tuple[int, int, int, float, float]] = []
        self.hold_after, self.gate, self.holding = hold_after, threading.Event(), threading.Event()
        self._with_rows = self._reads = 0
        self.hold_reads = hold_reads

    n_seq = property(lambda self: len(self.seqs))
    _kv_len = property(lambda self: len(self.seqs[0]))

    def seq_len(self, seq: int) -> int:
        self._check_seq(seq)
        return len(self.seqs[seq])

    def clock(self) -> float:
        return self.now

    def forward(self, token_ids, logits_for, seq=0):
        return self.forward_batch([(seq, token_ids, logits_for)])[0]

    def forward_batch(self, items):
        rows = [self._check_forward(tokens, want, seq) for seq, tokens, want in items]
        if any(rows):
            if self.hold_after is not None and self._with_rows == self.hold_after and not self.gate.is_set():
                self.holding.set()
                assert self.gate.wait(WAIT), "the test never opened the gate"
            self._with_rows += 1
        else:
            if self.hold_reads is not None and self._reads == self.hold_reads and not self.gate.is_set():
                self.holding.set()
                assert self.gate.wait(WAIT), "the test never opened the gate"
            self._reads += 1
        start = self.now
        self.now += self.fixed + self.per_token * sum(len(tokens) for _, tokens, _ in items)
        out = []
        for (seq, tokens, _), want in zip(items, rows):
            self.log.append((seq, len(tokens), len(want), start, self.now))
            self.seqs[seq].extend(int(t) for t in tokens)
            row = np.zeros((len(want), self._n_vocab), dtype=np.float32)
            row[:, ord("a")] = 10.0
            out.append(row)
        return out

    def rollback(self, n: int, seq: int = 0) -> None:
        if self._check_rollback(n, seq):
            del self.seqs[seq][n:]

    def close(self) -> None:
        pass


def stream_text(url: str, body: dict, out: list) -> None:
    """POST a streamed completion; append its text pieces to out."""
    with httpx.Client(base_url=url, timeout=WAIT) as h, h.stream("POST", "/v1/completions", json=body) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                out.append(json.loads(line[6:])["choices"][0]["text"])


def two_streams(backend: ClockedBytes, first: dict, second: dict) -> tuple[str, str]:
    """Stream ``first`` on a two-slot server over backend; once the backend holds (its gate),
    stream ``second``, and open the gate when that request waits in the worker's queue (so it
    arrives while the first is under way, whatever the machine's speed). Returns both texts."""
    outs: tuple[list, list] = ([], [])
    with Decoder(target=backend, draft="none", num_speculative_tokens=0, parallel=2, progress=False) as dec:
        app = create_app(dec)
        worker = app.state.worker
        worker.clock = backend.clock
        with ServerThread(app) as s:
            threads = [threading.Thread(target=stream_text, args=(s.url, {"model": MODEL, "temperature": 0,
                                                                           "stream": True, **body}, out))
                       for body, out in zip((first, second), outs)]
            threads[0].start()
            assert backend.holding.wait(WAIT)
            threads[1].start()
            deadline = time.monotonic() + WAIT
            while worker.queue_len() < 1:
                assert time.monotonic() < deadline, "the second request never reached the worker"
                time.sleep(0.01)
            backend.gate.set()
            for t in threads:
                t.join(WAIT)
    return "".join(outs[0]), "".join(outs[1])


def test_a_short_answer_streams_through_a_long_prompts_prefill():
    backend = ClockedBytes(hold_after=1)  # the short answer's second step waits until the long prompt is queued
    short, long = two_streams(backend, {"prompt": "hi", "max_tokens": 32}, {"prompt": "x" * 3000, "max_tokens": 4})
    assert short == "a" * 32 and long == "a" * 4
    seq_long = max(backend.log, key=lambda e: e[1])[0]  # the largest forward reads the long prompt
    chunks = [(start, end) for seq, n, rows, start, end in backend.log if seq == seq_long and rows == 0]
    short_steps = [end for seq, n, rows, start, end in backend.log if seq != seq_long and rows > 0]
    long_first = min(start for seq, n, rows, start, end in backend.log if seq == seq_long and rows > 0)
    assert len(chunks) > 10  # read in pieces, not in one forward
    # The 32-token answer ends before the long prompt's first token.
    assert len(short_steps) == 32 and short_steps[-1] <= long_first
    # Its largest gap while the prompt is read: one chunk plus one step, no more.
    reading = [t for t in short_steps if chunks[0][0] <= t <= chunks[-1][1]]
    gaps = np.diff(reading)
    step_cost = backend.fixed + backend.per_token
    chunk_cost = max(end - start for start, end in chunks)
    assert len(reading) > 10 and gaps.max() <= chunk_cost + step_cost + 1e-9
    # While the answer decodes a chunk costs about PREFILL_CHUNK_STEPS steps once measured (the
    # first is FIRST_CHUNK tokens); once it has ended, the rest is read at once (a target
    # without a prefill_split reads any prompt in one call).
    beside = [end - start for start, end in chunks[1:] if end <= short_steps[-1]]
    assert len(beside) > 10 and max(beside) <= (PREFILL_CHUNK_STEPS + 1) * step_cost
    after = [start for start, end in chunks if start >= short_steps[-1]]
    assert 1 <= len(after) <= 2  # (the chunk of the answer's last step's round, then the rest)


def test_a_prompt_alone_is_read_in_the_calls_a_whole_read_makes():
    """Nobody decoding: the prompt is read in whole multiples of the target's split (llama.cpp's
    n_batch), the calls a whole read makes, so a request alone gets the bits it always got."""
    backend = ClockedBytes()
    backend.prefill_split = 64
    with Decoder(target=backend, draft="none", num_speculative_tokens=0, parallel=2, progress=False) as dec:
        app = create_app(dec)
        app.state.worker.clock = backend.clock
        with ServerThread(app) as s:
            out = []
            stream_text(s.url, {"model": MODEL, "prompt": "y" * 1000, "max_tokens": 2, "temperature": 0,
                                "stream": True}, out)
    assert "".join(out) == "aa"
    reads = [n for seq, n, rows, _, _ in backend.log if rows == 0]
    assert sum(reads) == 999 and all(n % 64 == 0 for n in reads[:-1]) and len(reads) > 1


def test_a_short_prompt_is_read_before_a_long_one_that_came_first():
    """Two prompts being read: the one with the least left goes first, so a chat that arrives
    while a 3,000-token prompt is read alone gets its first token long before that prompt's
    (bench-serve measured TTFT 46 s for such chats when the oldest prompt was read first)."""
    backend = ClockedBytes(hold_reads=1)  # the long prompt's second chunk waits until the chat is queued
    backend.prefill_split = 64
    long, short = two_streams(backend, {"prompt": "x" * 3000, "max_tokens": 4}, {"prompt": "hi", "max_tokens": 8})
    assert short == "a" * 8 and long == "a" * 4
    seq_long = max(backend.log, key=lambda e: e[1])[0]
    long_reads = [start for seq, n, rows, start, end in backend.log if seq == seq_long and rows == 0]
    short_steps = [end for seq, n, rows, start, end in backend.log if seq != seq_long and rows > 0]
    assert len(long_reads) > 10 and len(short_steps) == 8
    assert short_steps[0] < long_reads[3]  # its first token within a chunk or two, not after the long prompt
