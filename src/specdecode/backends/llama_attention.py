"""Which attention path llama.cpp runs, chosen by measurement (issue 47, item 3).

llama.cpp's CPU flash-attention kernel (its default, "auto") walks the KV cache once per query
row; without it a block's rows are multiplied by the cache together. So at long contexts a
verification costs much less without it, and after a short one about the same or a little more.
Measured on an AMD EPYC with AVX2 only (2 vCPU, default target; ``python
benchmarks/cost_curves.py --vary flash_attn=auto,off --contexts 64,1000,4000``): T(33) 762 ms
with it and 838 ms without after 64 tokens, 1,025 and 872 ms after 1,000. Users do not know to
set SPECDECODE_LLAMA_FLASH_ATTN, so where it is unset :func:`resolve_attention` times both
paths on the loaded model (T(1) and T(33) after 64 and after PROBE_CONTEXT tokens), chooses
with :func:`choose_attention`, and caches the answer per llama.cpp build, CPU, threads, weights
placement and model file (:func:`.llama_buffers.probe_key`).

Without flash attention no block of two or more rows has bitwise the logits of one-token steps
(the measured invariant block is 1; it is measured per path, the path being part of the cost
key): strict and seeded requests stay exact by verifying one token a forward.

Units: seconds, tokens.
"""

from __future__ import annotations

import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import numpy as np

from ..files import cache_dir, read_cache_json, write_cache_json
from .llama_buffers import probe_key
from .llama_lib import attention_requested

PROBE_CONTEXT = 1024  # tokens before the long-context timing (a shorter window: the most that fits, from MIN_CONTEXT)
MIN_CONTEXT = 512
SHORT_CONTEXT = 64
SIZES = (1, 33)
ROUNDS = 3
# Flash attention off is chosen where it is at least MARGIN cheaper at every size after the long
# context and at most SHORT_LOSS dearer after the short one.
MARGIN = 0.05
SHORT_LOSS = 0.15
PATHS = ("auto", "off")


@dataclass(frozen=True)
class AttentionProbe:
    """Both paths timed: seconds[path]["n@c"] = T(n) after c tokens; the path chosen."""

    context: int
    seconds: dict
    choice: str

    def note(self) -> str:
        """Why this path: "T(33) after 1024 tokens 1038 ms without it, 1006 ms with it"."""
        key = f"{max(SIZES)}@{self.context}"
        on, off = self.seconds["auto"][key], self.seconds["off"][key]
        return (f"T({max(SIZES)}) after {self.context} tokens {off * 1000:.0f} ms without it, "
                f"{on * 1000:.0f} ms with it")

    def to_dict(self) -> dict:
        return {"context": self.context, "seconds": self.seconds, "choice": self.choice}

    @classmethod
    def from_dict(cls, d: dict) -> "AttentionProbe":
        """Raises ValueError for anything but :meth:`to_dict`'s JSON (a file edited by hand)."""
        ctx, secs, choice = d.get("context"), d.get("seconds"), d.get("choice")
        keys = {f"{n}@{c}" for n in SIZES for c in (SHORT_CONTEXT, ctx)}
        ok = (isinstance(ctx, int) and not isinstance(ctx, bool) and choice in PATHS and isinstance(secs, dict)
              and set(secs) == set(PATHS) and all(isinstance(secs[p], dict) and set(secs[p]) == keys for p in PATHS)
              and all(isinstance(v, (int, float)) and not isinstance(v, bool) and 0 < v < 3600
                      for p in PATHS for v in secs[p].values()))
        if not ok:
            raise ValueError(f"not an attention probe: {d!r:.80}")
        return cls(ctx, secs, choice)


def choose_attention(seconds: dict, context: int) -> str:
    """"off" where flash attention off is at least MARGIN cheaper at every size after ``context``
    tokens and at most SHORT_LOSS dearer after SHORT_CONTEXT; else "auto" (llama.cpp's own)."""
    on, off = seconds["auto"], seconds["off"]
    cheaper = all(off[f"{n}@{context}"] <= (1 - MARGIN) * on[f"{n}@{context}"] for n in SIZES)
    dearer = any(off[f"{n}@{SHORT_CONTEXT}"] > (1 + SHORT_LOSS) * on[f"{n}@{SHORT_CONTEXT}"] for n in SIZES)
    return "off" if cheaper and not dearer else "auto"


def time_paths(backend, context: int, rounds: int = ROUNDS,
               timer: Callable[[], float] = time.perf_counter) -> dict:
    """{path: {"n@c": T(n) after c tokens}} for both PATHS on the backend (its ``use_attention``
    switches; sequence 0, left empty): per path, the long context read once, one untimed forward
    of each size, ``rounds`` rounds at the long context, rolled back to the short one, as many there."""
    rng = np.random.default_rng(2)
    vocab = backend.n_vocab
    toks = [int(t) for t in rng.integers(min(100, vocab - 1), min(vocab, 30000), size=context + max(SIZES))]
    out = {}
    for path in PATHS:
        backend.use_attention(path)
        backend.rollback(0)
        backend.forward(toks[:context], logits_for=[])
        samples: dict[str, list[float]] = {}
        for c in (context, SHORT_CONTEXT):
            backend.rollback(c)
            for r in range(rounds + (c == context)):  # the first round at the long context warms up
                for n in (SIZES if r % 2 == 0 else SIZES[::-1]):
                    t0 = timer()
                    backend.forward(toks[context:context + n], logits_for=list(range(n)))
                    dt = timer() - t0
                    backend.rollback(c)
                    if not (c == context and r == 0):
                        samples.setdefault(f"{n}@{c}", []).append(dt)
        backend.rollback(0)
        out[path] = {k: float(np.median(v)) for k, v in samples.items()}
    return out


def resolve_attention(backend, folder: Path | None = None, timer: Callable[[], float] = time.perf_counter,
                      say: Callable[[str], None] | None = None) -> None:
    """Set the attention path of a loaded llama.cpp backend (:meth:`LlamaCppBackend.use_attention`)
    where SPECDECODE_LLAMA_FLASH_ATTN does not name it: the cached probe's choice, else both
    paths timed now (:func:`time_paths`) and the choice cached. A window too short for
    MIN_CONTEXT tokens keeps llama.cpp's own. say: a line before timing (default: stderr)."""
    if attention_requested() or not hasattr(backend, "use_attention"):
        return
    context = min(PROBE_CONTEXT, backend.n_ctx - 1 - max(SIZES))
    if context < MIN_CONTEXT:
        return
    file = (folder or cache_dir()) / "costs" / (
        f"attention-{probe_key(backend.path, backend.n_threads)}-{backend.buffers}-{context}.json")
    data = read_cache_json(file)
    probe = None
    if data is not None:
        try:
            probe = AttentionProbe.from_dict(data)
        except ValueError:
            probe = None
    if probe is None:
        (say or _stderr)("specdecode: timing llama.cpp's attention with and without flash attention on this model, "
                         "once per model and machine (cached: later starts skip it)...")
        seconds = time_paths(backend, context, timer=timer)
        probe = AttentionProbe(context, seconds, choose_attention(seconds, context))
        write_cache_json(file, probe.to_dict())
    backend.use_attention(probe.choice, f"chosen by measurement: {probe.note()}")


def _stderr(line: str) -> None:
    print(line, file=sys.stderr, flush=True)
