"""Batch invariance, measured: which forwards give every row exactly the logits of a
one-token step, so that a seeded generation's text cannot depend on K, the drafter or the
batch (the seed promise; :attr:`specdecode.request.GenerationOptions.invariant`).

Kernels choose their arithmetic by shape. On llama.cpp's CPU backend (measured on AMD EPYC
with AVX-512, Qwen2.5-Coder-1.5B Q4_K_M, ``python benchmarks/invariance_probe.py``,
``python benchmarks/batched_numerics.py`` and the probe below): repacked Q4_K weights run one
kernel below 4 rows and another from 4 on; the tiled K-quant matmul starts at 8 rows
(repacking off); flash attention (when on: :func:`specdecode.backends.llama_cpp.lib.flash_attention`)
splits a lone query's KV range of >= 512 cells among the threads and merges the parts, which no
block of two or more rows does. In batch-invariant mode (:meth:`Backend.set_batch_invariant`)
llama.cpp runs one-token forwards on one thread, and a block of up to 3 rows then has bitwise
the lone step's logits at every context length; a block of 4 differs by up to 0.58 in the
logits. Which sizes hold depends on the model's quantization (smollm2's Q4_1: every size tested
up to 33), the build, the CPU and the attention kernel (without flash attention no block of 2
holds), so it is measured once per model and machine and cached beside the cost curve; never
assumed.

Source of the idea: He and Thinking Machines Lab, "Defeating Nondeterminism in LLM
Inference" (2025): batch-invariant kernels make a row's result independent of its batch.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Generator, Sequence

import numpy as np

from ..backends.base import Backend
from ..files import read_cache_json, write_cache_json
from ..limits import MAX_NUM_SPECULATIVE_TOKENS, is_int
from .costcache import COST_CACHE_MAX_AGE_S, machine_key
from .measure import drive
from ..errors import SpecDecodeError


def check_strict_allowed(target: Backend, param: str = "batch_invariant") -> None:
    """The one rule of where strict mode (batch invariance "on") may run: a target whose
    sequences have KV caches of their own. In one shared buffer what runs beside a generation
    changes its arithmetic (measured), so no forward there is batch-invariant. Raises
    SpecDecodeError (param: the option that asked) otherwise."""
    if target.kv_shared:
        raise SpecDecodeError(
            f"strict mode (batch_invariant \"on\") needs a KV cache of its own for each sequence: {target.name} "
            f"holds {target.n_seq} sequences in one shared buffer, where what runs beside a generation changes its "
            "arithmetic; load it with kv_per_sequence=True (serve --strict does)", param=param)

# Block sizes tested, up to a whole verification (K = 32 plus the last committed token).
# Every size up to 8 (llama.cpp's kernels change at 4 and 8 rows), then the bends further up.
INVARIANT_SIZES = (2, 3, 4, 5, 6, 7, 8, 12, 16, 24, MAX_NUM_SPECULATIVE_TOKENS + 1)
# Cached tokens before the tested block: a short cache, and one past 256 cells, where
# llama.cpp's attention view reaches 512 cells and a lone step starts splitting it.
INVARIANT_CONTEXTS = (24, 300)


def measure_invariant_block(backend: Backend, seq: int = 0, sizes: Sequence[int] = INVARIANT_SIZES,
                            contexts: Sequence[int] = INVARIANT_CONTEXTS) -> int:
    """The most tokens one batch-invariant forward may hold (>= 1): the largest tested n such
    that, with :meth:`Backend.set_batch_invariant` on, forwards in blocks of every tested size
    up to n give bitwise (``np.array_equal``) the logits [n, V] of one-token forwards of the
    same tokens after the same cache, after each of ``contexts`` cached tokens (shortened to
    fit n_ctx). Sizes between two tested ones are taken to hold when both do. 1 when blocks
    of 2 already differ: then only plain decoding is batch-invariant.

    Uses sequence seq, which is emptied before and after; tokens are fixed pseudo-random ids.
    Cost: about 2 x (33 one-token forwards + 90 block tokens) when every size holds, 2 x 8
    one-token forwards when the first failure is below 8.
    """
    return drive(invariant_steps(backend, seq, sizes, contexts))


def invariant_steps(backend: Backend, seq: int = 0, sizes: Sequence[int] = INVARIANT_SIZES,
                    contexts: Sequence[int] = INVARIANT_CONTEXTS) -> Generator[None, "bool | None", int]:
    """:func:`measure_invariant_block` in parts, so that a server can measure it between its
    requests (:mod:`.calibration`): made of steps (:func:`.measure.drive`), it yields before
    each part (a context and a range of sizes: its cache prefilled, its one-token forwards,
    its blocks). Each part starts from an empty sequence seq and leaves it empty, with the
    backend's batch-invariant mode off between parts, so that whatever runs in between
    (generations, on any sequence) finds the backend as it left it. Returns the block."""
    sizes = sorted(n for n in sizes if n >= 2)
    vocab = backend.n_vocab
    rng = np.random.default_rng(1)
    toks = [int(t) for t in rng.integers(min(100, vocab - 1), min(vocab, 30000), size=max(contexts) + max(sizes))]
    best = max(sizes)
    for context in contexts:
        # Two phases, so that a failure below 8 rows costs 8 one-token forwards, not 33.
        for phase in ([n for n in sizes if n <= 8], [n for n in sizes if n > 8]):
            phase = [n for n in phase if n <= best and n <= backend.n_ctx - 2]
            if phase:
                yield
                best = _invariant_part(backend, seq, toks, context, phase, sizes, best)
    return best


def _invariant_part(backend: Backend, seq: int, toks: list[int], context: int, phase: list[int],
                    sizes: list[int], best: int) -> int:
    """One part of :func:`invariant_steps`: the sizes of ``phase`` after ``context`` cached
    tokens; returns ``best`` lowered below the first size whose blocks differ."""
    m = max(phase)
    start = max(0, min(context, backend.n_ctx - 1 - m))
    backend.set_batch_invariant(True)
    try:
        backend.rollback(0, seq=seq)
        if start:
            backend.forward(toks[:start], logits_for=[], seq=seq)
        cont = toks[start:start + m]
        lone = np.concatenate([backend.forward([t], [0], seq=seq) for t in cont])  # [m, V]
        for n in phase:
            backend.rollback(start, seq=seq)
            rows = np.concatenate([backend.forward(cont[i:i + n], range(len(cont[i:i + n])), seq=seq)
                                   for i in range(0, m, n)])  # [m, V]
            if not np.array_equal(rows, lone):
                return max([1] + [s for s in sizes if s < n])
        return best
    finally:
        backend.rollback(0, seq=seq)
        backend.set_batch_invariant(False)


def read_invariant_block(backend: Backend, cache_dir: Path, max_age_s: float = COST_CACHE_MAX_AGE_S) -> int | None:
    """The invariant block cached for this backend (:func:`cached_invariant_block`), or None
    where none is (none written, another key, too old, edited by hand)."""
    data = read_cache_json(invariant_cache_path(backend, cache_dir))
    try:
        block = data["invariant_block"] if data is not None and data.get("key") == machine_key(backend) else None
        if (is_int(block) and 1 <= block <= max(INVARIANT_SIZES)
                and time.time() - float(data["measured_at"]) <= max_age_s):
            return block
    except (KeyError, TypeError, ValueError, OverflowError):  # a file edited by hand: measured again
        pass
    return None


def write_invariant_block(backend: Backend, cache_dir: Path, block: int) -> None:
    """Keep a measured invariant block in the cache, beside the cost curve."""
    write_cache_json(invariant_cache_path(backend, cache_dir),
                     {"invariant_block": block, "model": backend.name, "key": machine_key(backend),
                      "measured_at": time.time()})


def invariant_cache_path(backend: Backend, cache_dir: Path) -> Path:
    """Where the invariant block of this backend on this machine is cached (beside its curve)."""
    return cache_dir / "costs" / f"{machine_key(backend)}.invariant.json"


def cached_invariant_block(backend: Backend, seq: int, cache_dir: Path,
                           max_age_s: float = COST_CACHE_MAX_AGE_S) -> int:
    """:func:`measure_invariant_block` once per (model, machine) key, cached beside the cost
    curve (``costs/<key>.invariant.json``); measured again under another key or after
    ``max_age_s`` seconds."""
    block = read_invariant_block(backend, cache_dir, max_age_s)
    if block is None:
        block = measure_invariant_block(backend, seq)
        write_invariant_block(backend, cache_dir, block)
    return block
