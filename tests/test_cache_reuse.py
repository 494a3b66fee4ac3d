"""Cache reuse by shifting (issue 60, item 4; :mod:`specdecode.engine.reuse`): llama.cpp's chunk
search on crafted lists, the engine's prefill on a fake code model that counts the tokens it
evaluates and the cells it shifts (and refuses a cache with holes), and a scripted llama.vim
session through ``POST /infill``: keystrokes, a cursor moving down, a ring update."""

from __future__ import annotations

import inspect
import textwrap

import httpx
import pytest

from specdecode.api import Decoder
from specdecode.bench.vim_session import session
from specdecode.backends.sharing import common_prefix_len
from specdecode.engine.reuse import Chunk, plan_reuse
from specdecode.errors import SpecDecodeError
from specdecode.request import GenerationOptions
from specdecode.server import ServerOptions, create_app

from test_fim_cache import FimBytes
from test_server import ServerThread


class ShiftingFimBytes(FimBytes):
    """:class:`FimBytes` whose cache can shift, as llama.cpp's does: cells keep their positions
    (a position list with holes), ``shift_cells`` drops [start + delta, start) and moves
    [start, end); ``shifted`` counts the cells moved. A forward into a cache with a hole below
    its length fails: reuse must leave the prompt's cached part contiguous."""

    can_shift = True

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.shifted = [0] * self.n_seq
        self.shifts: list[tuple[int, int, int]] = []

    def shift_cells(self, seq: int, start: int, end: int, delta: int) -> None:
        cache = self.caches[seq]
        assert delta < 0 and 0 <= start + delta and start <= end <= len(cache)
        for p in range(start + delta, start):
            cache[p] = None
        for p in range(start, end):
            cache[p + delta], cache[p] = cache[p], None
        self.shifted[seq] += end - start
        self.shifts.append((start, end, delta))

    def forward(self, token_ids, logits_for, seq=0):
        assert None not in self.caches[seq], "a hole in the cache below the forward's position"
        return super().forward(token_ids, logits_for, seq)


def test_llama_cpps_chunk_search_moves_runs_of_n_left_in_order():
    cached = list("ABCDEFGHIJ")
    # "ABC" kept, "DE" deleted: "FGHIJ" moves left by 2
    assert plan_reuse(cached, list("ABCFGHIJ"), 3, 3) == [Chunk(5, 3, 5)]
    # a run shorter than N is not moved: nothing after it either
    assert plan_reuse(cached, list("ABCFGxHIJ"), 3, 3) == []
    # text inserted after a moved run ends the search: the prompt's "x" is in no cached run
    assert plan_reuse(cached, list("ABCFGxHIJ"), 3, 2) == [Chunk(5, 3, 2)]
    # two deletions: two chunks, each moved by what was deleted before it
    assert plan_reuse(cached, list("ACDFGH"), 1, 2) == [Chunk(2, 1, 2), Chunk(5, 3, 3)]
    # inserted text: llama.cpp moves chunks left only, so nothing after the insertion is reused
    assert plan_reuse(cached, list("ABCxyDEFGHIJ"), 3, 2) == []
    assert plan_reuse(cached, cached, 10, 1) == [] and plan_reuse([], list("AB"), 0, 1) == []


def test_cache_reuse_must_be_an_integer_in_range():
    for bad in (-1, 1.5, True, "256", 1 << 21):
        with pytest.raises(SpecDecodeError) as e:
            GenerationOptions(cache_reuse=bad)
        assert e.value.param == "cache_reuse"
    with pytest.raises(SpecDecodeError):
        ServerOptions(cache_reuse=-1)


def _chunk(i: int) -> tuple[str, str]:
    return f"chunk{i}.py", "".join(f"value_{i}_{j} = compute({i}, {j})  # a line of chunk {i}\n" for j in range(12))


def test_the_prefill_shifts_chunks_and_evaluates_only_what_follows_the_last():
    """Files dropped from the front of the repository context: the rest are shifted into place,
    the prompt after them evaluated; the middle is the one a fresh evaluation gives (the fake's
    next token reads only the tokens cached, as a causal model's does; a real model's shifted
    keys are close, not equal)."""
    backend = ShiftingFimBytes()
    files = [_chunk(i) for i in range(4)]
    with Decoder(target=backend, draft="ngram", num_speculative_tokens=4, progress=False) as dec:
        first = dec.generate("def f(x):\n", suffix="\n", extra=files, max_tokens=8, cache_reuse=32)
        ids = dec.prompt_ids("def f(x):\n", suffix="\n", extra=files[2:])
        old = dec.prompt_ids("def f(x):\n", suffix="\n", extra=files)
        before = backend.evaluated[0]
        again = dec.generate("def f(x):\n", suffix="\n", extra=files[2:], max_tokens=8, cache_reuse=32)
        fresh = Decoder(target=FimBytes(), draft="none", progress=False)
        try:
            want = fresh.generate("def f(x):\n", suffix="\n", extra=files[2:], max_tokens=8).token_ids
        finally:
            fresh.close()
    s = again.stats
    assert first.stats.prompt_shifted == 0
    # everything after the two files dropped (the two kept, the prefix, the suffix) is one run
    # moved left over them: the whole prompt is cached but its last token (fed with the first step)
    assert s.prompt_cached == len(ids) - 1 and backend.shifted[0] == s.prompt_shifted
    assert s.prompt_shifted == len(ids) - 1 - common_prefix_len(old, ids)  # "<rep>myproject\n<sep>chunk" stays
    evaluated = backend.evaluated[0] - before - s.target_forward_passes - s.drafted
    assert evaluated == 0
    assert again.token_ids == want
    # off (0): only the common prefix, as before
    backend2 = ShiftingFimBytes()
    with Decoder(target=backend2, draft="none", progress=False) as dec:
        dec.generate("def f(x):\n", suffix="\n", extra=files, max_tokens=4)
        off = dec.generate("def f(x):\n", suffix="\n", extra=files[2:], max_tokens=4).stats
    assert off.prompt_shifted == 0 and backend2.shifted[0] == 0 and off.prompt_cached < 20


def test_a_strict_generation_never_shifts():
    backend = ShiftingFimBytes()
    files = [_chunk(i) for i in range(3)]
    with Decoder(target=backend, draft="none", progress=False) as dec:
        dec.generate("a = 1\n", suffix="\n", extra=files, max_tokens=4)
        s = dec.generate("a = 1\n", suffix="\n", extra=files[1:], max_tokens=4, cache_reuse=16,
                         batch_invariant="on").stats
    assert s.prompt_shifted == 0 and backend.shifted[0] == 0


# -- a scripted llama.vim session ---------------------------------------------------------------

# An 80-line file no one here wrote: the standard library's textwrap, its first 80 lines.
FILE = inspect.getsource(textwrap).splitlines()[:80]
CURSOR = 40  # the line typed, 0-based
TYPED = "    width = 70"  # typed one character at a time after the line's own text is cleared


def _ring_chunk(i: int) -> dict:
    name, text = _chunk(i)
    return {"filename": name, "text": text}


def test_a_llama_vim_session_re_evaluates_the_line_the_suffix_and_one_chunk_at_most():
    """Ten keystrokes on an 80-line file with three chunks in the ring: each keystroke evaluates
    the current line, the suffix (as /infill's budget keeps it) and the FIM tokens, nothing more;
    the ring update evaluates its new chunk and shifts the two it kept; Enter shifts the prefix's
    window. Counted on the fake (a text's tokens are its UTF-8 bytes)."""
    backend = ShiftingFimBytes()
    dec = Decoder(target=backend, draft="none", n_ctx=32768, progress=False)
    log = []

    def line_and_suffix(body: dict) -> int:
        """The typed text, the suffix as /infill's budget keeps it (2048 / 4 - 2 - typed), fim_suf and fim_mid."""
        typed = len(body["prompt"].encode())
        return typed + min(len(body["input_suffix"].encode()), 2048 // 4 - 2 - typed) + 2

    try:
        with ServerThread(create_app(dec, options=ServerOptions(cache_reuse=64), max_queue=4)) as s, \
                httpx.Client(base_url=s.url, timeout=60) as http:
            steps = session(FILE, CURSOR, TYPED, [_ring_chunk(i) for i in range(3)], _ring_chunk(3))
            for what, body in steps:
                before = (backend.evaluated[0], backend.shifted[0])
                r = http.post("/infill", json=body)
                assert r.status_code == 200, r.text
                stepped = r.json().get("tokens_predicted", 0) if body["n_predict"] else 0  # one token a step
                prompt_n = r.json()["timings"]["prompt_n"] if body["n_predict"] else None
                log.append((what, backend.evaluated[0] - before[0] - stepped, backend.shifted[0] - before[1],
                            prompt_n, body))
    finally:
        dec.close()
    keys = [x for x in log if x[0].startswith("key")]
    assert len(keys) == 10 and all(shifted == 0 for _, _, shifted, _, _ in keys)
    for what, evaluated, shifted, _, body in log[1:]:
        if what == "ring update":  # the new chunk (fim_sep, its name, its text), then the FIM frame
            new = body["input_extra"][-1]
            assert evaluated <= 1 + len(f"{new['filename']}\n{new['text']}".encode()) + 1 + len(b"filename\n") + 3
            assert shifted >= sum(len(c["text"].encode()) for c in body["input_extra"][:-1])
        elif what == "key 8":  # the ring update held no prefix: it is read again (llama-server's reuse too)
            assert evaluated <= min(len(body["input_prefix"].encode()), 3 * (2048 // 4)) + 1 + line_and_suffix(body)
        elif what == "next line":  # the prefix keeps its last 1,536 tokens: the window moved by a line
            assert evaluated <= len(TYPED[:10]) + 1 + line_and_suffix(body)
            assert shifted >= 3 * (2048 // 4) - len(TYPED) - 1
        else:
            assert evaluated <= line_and_suffix(body), (what, evaluated)
    # timings.prompt_n says what was evaluated: the forwards less the last prompt token's
    assert all(prompt_n == evaluated + 1 for _, evaluated, _, prompt_n, _ in log if prompt_n is not None)


def test_llama_cpp_shifts_its_cache_and_the_next_token_is_the_fresh_evaluations():
    """On the real backend (Qwen2.5-Coder 0.5B): after the first file is dropped, the rest of the
    cached prompt is shifted into place (llama_memory_seq_rm + seq_add), only the tail is read,
    and the next token's logits are close to a fresh evaluation's (the same greedy token; the
    moved keys were computed after another file, so not bitwise)."""
    import numpy as np

    from specdecode.engine.reuse import reuse_chunks

    dec = Decoder(target="qwen2.5-coder-0.5b-instruct", draft="none", n_ctx=2048, n_threads=2, progress=False)
    try:
        b = dec.target
        assert b.can_shift
        files = [_chunk(i) for i in range(3)]
        a = dec.prompt_ids("def total(values):\n    return", suffix="\n", extra=files)
        new = dec.prompt_ids("def total(values):\n    return", suffix="\n", extra=files[1:])
        b.rollback(0)
        b.forward(a[:-1], logits_for=[])
        keep, shifted = reuse_chunks(b, 0, a[:-1], new[:-1], common_prefix_len(a, new), 64)
        assert shifted >= len(new) - 40 and keep == len(new) - 1
        b.rollback(keep)
        assert b.seq_len(0) == keep
        reused = b.forward(new[-1:], logits_for=[0])[0]
        b.rollback(0)
        b.forward(new[:-1], logits_for=[])
        fresh = b.forward(new[-1:], logits_for=[0])[0]
        b.rollback(0)
        assert int(np.argmax(reused)) == int(np.argmax(fresh))
        assert np.corrcoef(reused, fresh)[0, 1] > 0.95
        with pytest.raises(SpecDecodeError):
            b.shift_cells(0, 4, 2, -1)  # end before start
    finally:
        dec.close()
