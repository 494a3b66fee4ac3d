"""Scratch contexts over a loaded llama.cpp model: a backend that shares the model's weights and
batch with a :class:`.backend.LlamaCppBackend` but has a KV cache of its own, for measuring
without touching the cache the slots hold (the attention paths: :mod:`specdecode.control.attention`;
a server's cost curve, context costs and invariant block: :mod:`specdecode.control.calibration`).

``backend``: the :class:`.backend.LlamaCppBackend` a twin is made from.
"""

from __future__ import annotations

import copy
from contextlib import contextmanager
from typing import Iterator, Sequence

from ...errors import ModelFileError
from .lib import context_params, last_error


@contextmanager
def attention_probes(backend, modes: Sequence[str], n_ctx: int) -> Iterator[dict]:
    """Scratch contexts over the loaded model, one per attention path in modes, each of one
    sequence of n_ctx tokens (at most what the model was trained for), as backends of their
    own ({mode: backend}: forward, rollback, n_ctx), for measuring the paths
    (:mod:`specdecode.control.attention`) without touching this backend's context. Freed on
    exit. Raises ModelFileError where llama.cpp cannot create one."""
    probes: dict = {}
    try:
        for mode in modes:
            probes[mode] = backend.scratch_twin(n_ctx, 1, mode)
        yield probes
    finally:
        for probe in probes.values():
            probe.close()


def scratch_twin(backend, n_ctx: int, n_seq: int | None = None, mode: str | None = None):
    """A backend over this one's model (weights and batch shared: use one at a time) with a
    context of its own: n_seq sequences (default this one's) sharing n_ctx cells (at most
    what the model was trained for), attention as mode (default this one's path). What it
    measures is cached under this backend's key. Its close() frees its context only.
    Raises ModelFileError where llama.cpp cannot create the context."""
    backend._require_open()
    n_seq = backend.n_seq if n_seq is None else n_seq
    n_ctx = min(n_ctx, backend._n_ctx_train) if backend._n_ctx_train > 0 else n_ctx
    mode = mode or backend._flash_attention
    per_seq = -(-n_ctx // n_seq)  # one unified buffer: any sequence may use every cell
    ctx = backend._lib.llama_init_from_model(backend._model, context_params(
        backend._lib, per_seq, n_seq, backend._n_batch, backend._rows_max, 0, False, backend.n_threads, mode))
    if not ctx:
        raise ModelFileError(f"llama.cpp could not create a scratch context of {n_ctx} tokens for "
                             f"{backend.path}{last_error()}")
    twin = copy.copy(backend)
    twin._twin = True
    twin._ctx, twin._mem, twin._flash_attention = ctx, backend._lib.llama_get_memory(ctx), mode
    twin._n_ctx, twin._seq_lens, twin._embeddings = per_seq * n_seq, [0] * n_seq, False
    twin._shape = (per_seq, n_seq, 0, False, backend.n_threads)
    twin.kv_shared = n_seq > 1
    return twin
