"""Which attention path llama.cpp runs on the CPU, chosen once per model and machine (issues 47, 60).

llama.cpp's CPU flash-attention kernel (its default, "auto") walks the KV cache once per query
row; without it a block's rows are multiplied by the cache together. Which one-token step is
cheaper depends on the CPU and the model, and the difference moves every plain step: on an AMD
EPYC Zen 4 a choice made on a 1 ms difference of one-token steps after 64 tokens cost plain
decoding 20% at 170-280 tokens of context (23.7 against 29-31 tokens/s, issue 60). And the path
changes the text (greedy decoding at a near-tie), so it must not move with ``--ctx-size``,
``--parallel`` or the day.

So, where neither ``--flash-attn`` nor SPECDECODE_LLAMA_FLASH_ATTN names it,
:func:`resolve_attention` reads the choice cached for this model file, CPU, threads and weights'
buffers (:func:`attention_key`: not the context size, not the slots) or, the first time,
measures it (:func:`measure_choice`): the one-token step, what every plain step pays, after
CONTEXTS tokens (the hundreds to thousands a model serves), ROUNDS times each, both paths
interleaved, on two scratch contexts of their own (``backend.attention_probes``: the loaded
context is not touched, so its size does not matter). Flash attention goes off only where its
median one-token step is at least MARGIN dearer after *every* context measured; else llama.cpp's
own path stays (llama-server's, so that plain decoding matches it). The choice is kept for good:
only deleting the cache file (or pinning) changes it.

Without flash attention no block of two or more rows has bitwise the logits of one-token steps
(the measured invariant block is 1; it is measured per path, the path being part of the cost
key): strict and seeded requests stay exact by verifying one token a forward.

Everything above is the CPU's: where llama.cpp runs a model's layers on a GPU, its own choice
(flash attention on, where the device supports it) is the fast path and nothing is measured.

Units: seconds, tokens.
"""

from __future__ import annotations

import platform
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Sequence

import numpy as np

from ..backends.llama_cpp.lib import attention_requested
from ..files import read_cache_json, write_cache_json
from .costcache import key_of

PATHS = ("auto", "off")  # llama.cpp's own (flash attention on the CPU), and off
# Contexts (tokens cached before the timed step) and timed one-token steps per path at each.
CONTEXTS = (256, 1024, 2048)
ROUNDS = 7
# Off only where its median one-token step is at least this much cheaper after every context:
# wider than the spread of medians of seven interleaved steps on a shared 2-vCPU machine.
MARGIN = 0.03
PREFILL_CHUNK = 512  # tokens a prefill forward of the scratch contexts reads


@dataclass(frozen=True)
class AttentionChoice:
    """The path chosen and what it was chosen on: the median one-token step (seconds) of each
    path after each of ``contexts`` tokens (``t1[path][i]``)."""

    path: str
    contexts: tuple[int, ...]
    t1: dict

    def note(self) -> str:
        """"T(1) after 256/1024/2048 tokens 61/63/70 ms with flash attention, 62/66/81 ms without"."""
        def ms(path: str) -> str:
            return "/".join(f"{t * 1000:.0f}" for t in self.t1[path])
        return (f"T(1) after {'/'.join(map(str, self.contexts))} tokens {ms('auto')} ms with flash attention, "
                f"{ms('off')} ms without")

    def to_json(self) -> dict:
        return {"path": self.path, "contexts": list(self.contexts), "t1": {p: list(v) for p, v in self.t1.items()}}

    @classmethod
    def from_json(cls, data: dict | None) -> "AttentionChoice | None":
        """The cached choice, or None where the file holds none that is well formed."""
        try:
            choice = cls(str(data["path"]), tuple(int(c) for c in data["contexts"]),
                         {p: tuple(float(t) for t in data["t1"][p]) for p in PATHS})
        except (TypeError, KeyError, ValueError):
            return None
        ok = choice.path in PATHS and choice.contexts and all(len(v) == len(choice.contexts) for v in choice.t1.values())
        return choice if ok else None


def choose(t1: dict) -> str:
    """"off" where its one-token step (``t1["off"][i]``) is at least MARGIN cheaper than llama.cpp's
    own (``t1["auto"][i]``) after every context measured; else "auto". "auto" with nothing measured."""
    on, off = t1["auto"], t1["off"]
    if not on or len(on) != len(off):
        return "auto"
    return "off" if all(b <= (1 - MARGIN) * a for a, b in zip(on, off)) else "auto"


def attention_key(backend) -> str:
    """What the choice depends on: the model file (path, size, time), the CPU, the threads, the
    weights' buffers, the library; not the context size nor the sequences (``--parallel``)."""
    return key_of(backend, ["attention", type(backend).__name__, platform.machine(), str(backend.n_threads or ""),
                            backend.weights_note.split(";")[0]], [])


def choice_path(backend, folder: Path) -> Path:
    """The cache file of this model's choice on this machine."""
    return Path(folder) / "costs" / f"{attention_key(backend)}-attention.json"


def measure_choice(backend, contexts: Sequence[int] = CONTEXTS, rounds: int = ROUNDS,
                   timer: Callable[[], float] = time.perf_counter) -> AttentionChoice:
    """Time both paths' one-token step after each context on scratch contexts
    (``backend.attention_probes(PATHS, n_ctx)``: {path: a backend of one sequence}), each
    context's rounds interleaved path by path (the order alternating), medians kept; contexts the
    probes cannot hold are left out. timer: seconds (a test's clock)."""
    with backend.attention_probes(PATHS, max(contexts) + 2) as probes:
        fit = sorted(c for c in contexts if c + 2 <= min(p.n_ctx for p in probes.values()))
        if not fit:
            return AttentionChoice("auto", (), {p: () for p in PATHS})
        vocab = backend.n_vocab
        rng = np.random.default_rng(1)
        toks = [int(t) for t in rng.integers(min(100, vocab - 1), min(vocab, 30000), size=max(fit) + 1)]
        for probe in probes.values():
            for start in range(0, max(fit), PREFILL_CHUNK):
                probe.forward(toks[start:min(start + PREFILL_CHUNK, max(fit))], logits_for=[])
        t1 = {p: [] for p in PATHS}
        for c in sorted(fit, reverse=True):  # each probe rolled back to the next context
            times = {p: [] for p in PATHS}
            for p, probe in probes.items():
                probe.rollback(c)
                probe.forward([toks[c]], logits_for=[0])  # untimed: the first step after a rollback
                probe.rollback(c)
            for r in range(rounds):
                for p in (PATHS if r % 2 == 0 else PATHS[::-1]):
                    t0 = timer()
                    probes[p].forward([toks[c]], logits_for=[0])
                    times[p].append(timer() - t0)
                    probes[p].rollback(c)
            for p in PATHS:
                t1[p].insert(0, float(np.median(times[p])))
        t1 = {p: tuple(v) for p, v in t1.items()}
    return AttentionChoice(choose(t1), tuple(fit), t1)


def resolve_attention(backend, folder: Path, timer: Callable[[], float] | None = None,
                      say: Callable[[str], None] | None = None, measure: bool = True) -> None:
    """Set the attention path of a loaded llama.cpp backend (its ``use_attention``) where
    neither ``--flash-attn`` nor SPECDECODE_LLAMA_FLASH_ATTN names it: the choice cached for this
    model and machine (:func:`choice_path`), or measured now and cached for good
    (:func:`measure_choice`). timer: seconds (a test's clock); say: a line before measuring
    (default: stderr). measure False (a server, which answers at once): from the cache only;
    where it holds none, llama.cpp's own path, and the note says so. Where layers are on a GPU
    (``backend.placement``) nothing is measured: llama.cpp's own path (flash attention where the
    device has it) is the fast one there."""
    if attention_requested():
        return
    if not backend.placement.on_cpu:  # the rule below is the CPU kernels'; on a GPU llama.cpp's own path is the fast one
        backend.use_attention("auto", f"llama.cpp's own: the layers are on {backend.placement.device}, where its "
                                      "flash attention is the fast path (the CPU's measured rule does not apply)")
        return
    cache = choice_path(backend, folder)
    choice = AttentionChoice.from_json(read_cache_json(cache))
    if choice is None:
        if not measure:
            backend.use_attention("auto", "llama.cpp's own: not measured on this machine yet (a first `specdecode "
                                          "generate` or `bench` of this model measures it once; --flash-attn pins it)")
            return
        (say or _stderr)("specdecode: timing llama.cpp's attention with and without flash attention, once per model "
                         "and machine (kept: later starts skip it)...")
        choice = measure_choice(backend, timer=timer) if timer is not None else measure_choice(backend)
        if choice.contexts:
            write_cache_json(cache, choice.to_json())
    if not choice.contexts:
        backend.use_attention("auto", "llama.cpp's own: the model's context is too short to measure the paths")
        return
    why = "flash attention off: its one-token step is dearer" if choice.path == "off" else "llama.cpp's own"
    backend.use_attention(choice.path, f"chosen by measurement once for this model and machine, {why} "
                                       f"({choice.note()}; --flash-attn pins it)", chosen=choice.path != "auto")


def _stderr(line: str) -> None:
    print(line, file=sys.stderr, flush=True)
