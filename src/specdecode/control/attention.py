"""Which attention path llama.cpp runs, chosen by measurement (issue 47, item 3).

llama.cpp's CPU flash-attention kernel (its default, "auto") walks the KV cache once per query
row; without it a block's rows are multiplied by the cache together. So after a long context a
forward costs less without it, and after a short one about the same or more. Measured on an AMD
EPYC with AVX2 only (2 vCPU, default target; docs/measured.md): T(33) 828 ms with it and 893 ms
without after 64 tokens, 1,653 and 1,192 ms after 4,096. Users do not know to set SPECDECODE_LLAMA_FLASH_ATTN, so where it is
unset :func:`resolve_attention` measures both paths' context costs on the loaded model
(:func:`.context_costs.context_cost_steps`: T(n) after 64 tokens and what 1,024 and 4,096 add,
each path's cached under its own cost key, as the controller then reads them) and keeps the path
:func:`choose_attention` prefers.

Without flash attention no block of two or more rows has bitwise the logits of one-token steps
(the measured invariant block is 1; it is measured per path, the path being part of the cost
key): strict and seeded requests stay exact by verifying one token a forward.

Everything above is the CPU's: where llama.cpp runs a model's layers on a GPU, its own choice
(flash attention on, where the device supports it) is the fast path and nothing is measured.

Units: seconds, tokens.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Callable

from ..backends.llama_cpp.lib import attention_requested
from .context_costs import ContextCosts, cached_context_costs, context_cost_steps, fitting, read_cached_context_costs

PATHS = ("auto", "off")  # llama.cpp's own (flash attention on the CPU), and off
# Flash attention off is chosen where, after the longest context measured, it is at least MARGIN
# cheaper at every size, its one-token step (what every plain step pays) costs no more on average
# over the measured contexts (the base and each longer one, alike), and after the base context
# that step is at most SHORT_LOSS dearer (chats). SHORT_LOSS is wider than the noise of a median
# of three forwards: on an AMD EPYC Zen 4 the off path's T(1) after 64 tokens measured 35.6 ms
# there and 29.5 ms in its 33-size curve (llama.cpp's own path: 32.0 and 29.8 ms), and with it off
# plain decoding of the editor prompts ran 1.04x faster.
MARGIN = 0.05
SHORT_LOSS = 0.15


def choose_attention(costs: dict[str, ContextCosts]) -> str:
    """"off" or "auto" from both paths' context costs (each with ``base``): see MARGIN and
    SHORT_LOSS. "auto" where either measured no context. The measured contexts are weighed alike:
    where the contexts served are known to be short, SPECDECODE_LLAMA_FLASH_ATTN says so."""
    on, off = costs["auto"], costs["off"]
    if not (on.measured and off.measured and on.base and off.base):
        return "auto"
    c = min(on.contexts[-1], off.contexts[-1])
    cheaper = all(off.total(n, c) <= (1 - MARGIN) * on.total(n, c) for n in on.ns)
    served = [on.base_context, *[x for x in on.contexts if x <= c]]
    n1 = on.ns[0]  # the one-token step (the smallest size measured)
    plain = sum(off.total(n1, x) for x in served) <= sum(on.total(n1, x) for x in served)
    short = off.base[0] <= (1 + SHORT_LOSS) * on.base[0]
    return "off" if cheaper and plain and short else "auto"


def note(costs: dict[str, ContextCosts]) -> str:
    """"T(33) after 4096 tokens 1287 ms without it, 1521 ms with it; T(1) after 64 tokens 54 ms, 53 ms"."""
    on, off = costs["auto"], costs["off"]
    n, c = on.ns[-1], min(on.contexts[-1], off.contexts[-1])
    return (f"T({n}) after {c} tokens {off.total(n, c) * 1000:.0f} ms without it, {on.total(n, c) * 1000:.0f} ms "
            f"with it; T(1) after {on.base_context} tokens {off.base[0] * 1000:.0f} ms, {on.base[0] * 1000:.0f} ms")


def resolve_attention(backend, folder: Path, timer: Callable[[], float] | None = None,
                      say: Callable[[str], None] | None = None, measure: bool = True) -> None:
    """Set the attention path of a loaded llama.cpp backend (its ``use_attention``) where
    SPECDECODE_LLAMA_FLASH_ATTN does not name it: both paths' context costs, from the cache
    under ``folder`` or measured now (each path's cached under its cost key), and the path
    :func:`choose_attention` prefers. A window too short for any context keeps llama.cpp's own.
    timer: seconds (a test's clock); say: a line before measuring (default: stderr). measure
    False (a server, which answers at once): from the cache only; where either path's costs are
    not cached, llama.cpp's own path, and the note says so. Where layers are on a GPU
    (``backend.placement``) nothing is measured: llama.cpp's own path (flash attention where the
    device has it) is the fast one there."""
    if attention_requested():
        return
    if not backend.placement.on_cpu:  # the rule below is the CPU kernels'; on a GPU llama.cpp's own path is the fast one
        backend.use_attention("auto", f"llama.cpp's own: the layers are on {backend.placement.device}, where its "
                                      "flash attention is the fast path (the CPU's measured rule does not apply)")
        return
    if not fitting(backend)[0]:
        return
    told = []

    def tell() -> None:
        if not told:
            told.append(1)
            (say or _stderr)("specdecode: timing llama.cpp's attention with and without flash attention after "
                             "long contexts, once per model and machine (cached: later starts skip it)...")

    steps = (lambda b: context_cost_steps(b, timer=timer)) if timer is not None else context_cost_steps
    costs = {}
    for path in PATHS:
        backend.use_attention(path)
        costs[path] = cached_context_costs(backend, folder, tell, steps) if measure else \
            read_cached_context_costs(backend, folder)
    if None in costs.values():
        backend.use_attention("auto", "llama.cpp's own: the paths are not measured on this machine yet (a first "
                                      "`specdecode generate` or `bench` of this model measures them)")
        return
    choice = choose_attention(costs)
    backend.use_attention(choice, f"chosen by measurement: {note(costs)}", chosen=choice != "auto")


def _stderr(line: str) -> None:
    print(line, file=sys.stderr, flush=True)
