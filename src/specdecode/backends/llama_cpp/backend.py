"""llama.cpp backend (GGUF files) over llama-cpp-python's low-level C API: one ``llama_decode``
evaluates [last committed token + K drafts] and marks only the positions whose logits the
acceptance rule needs (the high-level ``Llama`` keeps an n_batch x vocabulary score buffer),
and ``llama_memory_seq_rm`` rolls back rejected positions.

Dimension letters: N = tokens in one forward, M = requested logit rows, V = vocabulary.
"""

from __future__ import annotations

from pathlib import Path
from typing import Collection, Sequence

import numpy as np

from ...errors import ModelFileError, SpecDecodeError
from ...limits import DEFAULT_GPU_LAYERS, MAX_THREADS, MIN_N_CTX, check_gpu_layers
from ..base import BackendBase, HiddenRows, Placement, SeqForward
from ..context import available_memory, choose_context, llama_kv_bytes
from .heads import numpy_heads
from .tree import forward_tree, keep_rows
from .text import LlamaText
from .vocab import read_eog, read_fim_tokens
from .buffers import load_model
from .offload import COMPUTE_RESERVE, ModelLayout, list_devices, model_layout, offload_devices, plan_offload
from .scratch import attention_probes, scratch_twin
from .lib import context_params, default_threads, flash_attention, init_llama, last_error

MAX_OUTPUT_ROWS = 64  # most logit rows one sequence may ask of one forward
class LlamaCppBackend(LlamaText, BackendBase):
    """One GGUF model on llama.cpp, with a KV cache of n_seq sequences.

    path: GGUF file. n_ctx: context window in tokens of each sequence (None, the default: what
    the model was trained for, within the memory available; never past that; kv_reserve: the
    caches to fit, in units of this one's: :mod:`.context`; ``context`` says why). n_threads:
    CPU threads (default: the machine's cores). n_batch: most tokens per llama_decode call;
    longer forwards are split. n_seq: sequences (llama.cpp sequence ids 0..n_seq-1) for
    concurrent generations; their tokens share one ``llama_decode`` in :meth:`forward_batch`.
    gpu_layers: layers on the build's GPU (llama.cpp's n_gpu_layers): a number (more than the
    model has: all), "all", or "auto" (the default: all where they fit the device's free memory
    with the context's KV cache, else as many as fit; the CPU on a CPU-only build: :mod:`.offload`;
    ``placement`` says where they went, and ``offload_note`` why).

    The cache is llama.cpp's unified KV buffer of n_ctx * n_seq cells (``kv_unified``): a batch
    whose sequences bring different numbers of tokens stays one ubatch. kv_per_sequence: a
    buffer of n_ctx cells for each sequence instead (``kv_unified`` off; strict mode), so that
    a sequence's forwards attend over its own cells only, laid out as in a run of its own, and
    stay batch-invariant in a batch (``kv_shared`` False); a batch of unequal blocks is then
    split into several ubatches by llama.cpp. Hidden states: the
    embeddings output, on for the calls that need it. Trees (:mod:`.tree`): tree_branches leaves.

    Raises ModelFileError when llama.cpp cannot load the file, SpecDecodeError on bad
    options.
    """

    supports_hidden_states = True
    thread_safe_tokenizer = True  # llama_tokenize only reads the vocabulary (llama-server tokenizes on HTTP threads)
    supports_tree, max_tree_leaves = property(lambda self: self._tree_branches > 0), property(lambda self: self._tree_branches)

    def __init__(
        self,
        path: str | Path,
        n_ctx: int | None = None,
        n_threads: int | None = None,
        n_batch: int = 512,
        name: str | None = None,
        n_seq: int = 1,
        tree_branches: int = 0,
        kv_per_sequence: bool = False,
        kv_reserve: float = 1.0,
        gpu_layers: int | str = DEFAULT_GPU_LAYERS,
    ) -> None:
        init_llama()
        import llama_cpp

        self._lib = llama_cpp
        self.path = Path(path)
        self.name = name or self.path.name
        if n_ctx is not None and n_ctx < MIN_N_CTX:
            raise SpecDecodeError(f"n_ctx = {n_ctx} is out of range: expected n_ctx >= {MIN_N_CTX}", param="n_ctx")
        n_threads = default_threads() if n_threads is None else n_threads
        if not 1 <= n_threads <= MAX_THREADS:
            raise SpecDecodeError(f"n_threads = {n_threads} is out of range: expected 1..{MAX_THREADS}",
                                  param="n_threads")
        max_seq = int(llama_cpp.llama_max_parallel_sequences())
        if not 1 <= n_seq <= max_seq:
            raise SpecDecodeError(f"n_seq = {n_seq} is out of range: llama.cpp holds 1..{max_seq} sequences")
        if kv_per_sequence and tree_branches:
            raise SpecDecodeError("a KV cache per sequence (strict mode) verifies chains only: trees of drafts need "
                                  "branch sequences in one shared cache; drop --max-tree-nodes", param="max_tree_nodes")
        gpu_layers = check_gpu_layers(gpu_layers, "gpu_layers")
        self._flash_attention = flash_attention()  # llama.cpp's choice unless asked: lib.flash_attention
        self._model = None
        self._buffers, self._weight_buffers = "none", {}
        self._ctx = None
        self._batch = None

        model = self._load_placed(gpu_layers, n_ctx, n_seq * kv_reserve, n_threads)
        self._vocab = llama_cpp.llama_model_get_vocab(model)
        self._n_vocab = int(llama_cpp.llama_vocab_n_tokens(self._vocab))
        trained, kv_bytes = int(llama_cpp.llama_model_n_ctx_train(model)), llama_kv_bytes(llama_cpp, model)
        memory, where = self._kv_memory()
        self.context = choose_context(n_ctx, trained, kv_bytes, n_seq, self.name, memory, kv_reserve, memory_label=where)
        self._n_ctx_train = trained
        n_ctx = self.context.n_ctx
        self._n_batch = self.prefill_split = max(1, min(n_batch, n_ctx))  # (a prompt read in its multiples: the same calls)
        self._rows_max = min(self._n_batch, MAX_OUTPUT_ROWS * n_seq)

        self.kv_shared = not kv_per_sequence and n_seq > 1  # (a tree's branch cells are cleared after its step)
        self._shape = (n_ctx, n_seq, tree_branches, kv_per_sequence, n_threads)
        self._open_context()
        self._batch = llama_cpp.llama_batch_init(self._n_batch, 0, 1 + tree_branches)
        self._tree_branches = tree_branches
        self.n_threads = n_threads
        self.attention_note, self.attention_chosen = "", False  # how the path was chosen (control/attention.py)

        self._embeddings = False  # whether the context outputs embeddings (llama_set_embeddings)
        self._n_embd = int(self._lib.llama_model_n_embd(self._model))
        self.fim_tokens = read_fim_tokens(self._lib, self._vocab, self._n_vocab)
        self._eog = read_eog(self._lib, self._vocab, self._n_vocab, self.fim_tokens)
        self._piece_cache: dict[int, bytes] = {}
        self._special_texts: frozenset[str] | None = None

    def _load_placed(self, asked: int | str, n_ctx: int | None, slots: float, n_threads: int):
        """Load the model with the layers :func:`.offload.plan_offload` puts on the build's GPU
        (``asked``: --gpu-layers), the rest in the CPU's buffers; sets ``_plan`` and ``device``
        ("cpu" unless some layer is on a GPU: a cost-cache key, as before offloading). Returns
        the model. Raises ModelFileError when llama.cpp cannot load the file."""
        devices = list_devices()
        plan = (plan_offload(asked, model_layout(self.path), devices, n_ctx, slots, self.name)
                if offload_devices(devices) else None)
        offloaded = plan.gpu_layers if plan is not None else 0
        cpu_blocks = None if not offloaded else plan.n_layers - offloaded  # blocks left on the CPU
        model, self._buffers, self._weight_buffers = load_model(self.path, n_threads, offloaded, cpu_blocks)
        if not model:
            raise ModelFileError(
                f"llama.cpp could not load model file {self.path}: the file is corrupt, truncated or not a "
                f"supported GGUF model{last_error()}"
            )
        self._model = model
        if plan is None:  # no GPU device: the CPU, saying so where layers were asked for
            n_blocks = int(self._lib.llama_model_n_layer(model))
            plan = plan_offload(asked, ModelLayout((0,) * n_blocks, 0, 0), devices, n_ctx, name=self.name)
        self._plan = plan
        self.device = plan.device if offloaded else "cpu"
        return model

    def _kv_memory(self) -> tuple[int | None, str]:
        """The memory the KV caches are sized from and its words for the context's note: the
        GPU's free memory now that the weights are in, where every layer (and so the cache) is on
        it; else the machine's available memory (:func:`..context.available_memory`)."""
        p = self._plan
        if p.gpu_layers and p.gpu_layers >= p.n_layers:
            free = sum(d.free for d in offload_devices(list_devices()))
            if free > 0:
                return max(0, free - COMPUTE_RESERVE), f"free on {p.device}"
        return available_memory(), "available"

    def _open_context(self) -> None:
        """A llama.cpp context over the model with this backend's shape and attention path; its cache empty."""
        n_ctx, n_seq, tree_branches, kv_per_sequence, n_threads = self._shape
        ctx = self._lib.llama_init_from_model(self._model, context_params(
            self._lib, n_ctx, n_seq, self._n_batch, self._rows_max, tree_branches, kv_per_sequence, n_threads,
            self._flash_attention))
        if not ctx:
            self.close()
            raise ModelFileError(f"llama.cpp could not create a context of {n_ctx} tokens for {self.path}{last_error()}")
        self._ctx, self._mem = ctx, self._lib.llama_get_memory(ctx)
        self.can_shift = bool(self._lib.llama_memory_can_shift(self._mem))
        # llama.cpp rounds the context up (to a multiple of 256): the limit is the one asked for.
        self._n_ctx = min(n_ctx, int(self._lib.llama_n_ctx(ctx)) // n_seq)
        self._seq_lens = [0] * n_seq

    def use_attention(self, mode: str, note: str = "", chosen: bool = False) -> None:
        """Compute attention as ``mode`` ("auto", "on", "off") from now on: a new context, every
        sequence's cache empty (:mod:`specdecode.control.attention` chooses it at load). note: why;
        chosen: by specdecode, not asked for (a seed then decodes plainly: the engine's ``begin``)."""
        self._require_open()
        if mode != self._flash_attention:
            self._lib.llama_free(self._ctx)
            self._ctx, self._flash_attention = None, mode
            self._open_context()
            self._embeddings = False
        self.attention_note, self.attention_chosen = note, chosen

    def attention_probes(self, modes: Sequence[str], n_ctx: int):
        """Scratch backends over this model, one per attention path (:func:`.scratch.attention_probes`)."""
        return attention_probes(self, modes, n_ctx)

    def scratch_twin(self, n_ctx: int, n_seq: int | None = None, mode: str | None = None) -> "LlamaCppBackend":
        """A backend over this model with a context of its own (:func:`.scratch.scratch_twin`)."""
        return scratch_twin(self, n_ctx, n_seq, mode)

    @property
    def cost_key(self) -> str:
        """What besides the file and threads a measured latency depends on: the attention kernel
        (:func:`~specdecode.backends.llama_cpp.lib.flash_attention`) and the weights' buffer type
        (:mod:`.buffers`)."""
        key = f"flash_attn={self._flash_attention}|buffers={self._buffers}"
        p = self._plan  # layers on a GPU time differently (a CPU-only key stays as it was before offloading)
        return key + (f"|gpu_layers={p.gpu_layers}/{p.n_layers}" if p.gpu_layers else "")

    @property
    def placement(self) -> Placement:
        """Where the layers run (:mod:`.offload`): llama.cpp's GPU device and how many layers are
        on it, or the CPU."""
        p = self._plan
        return Placement(p.device, p.gpu_layers, p.n_layers, p.description if p.gpu_layers else "", p.note)

    @property
    def offload_note(self) -> str:
        """One line: how many layers went to a GPU and why (:func:`.offload.plan_offload`)."""
        return self._plan.note

    @property
    def buffers(self) -> str:
        """"amx", "repack" or "none": the buffer type chosen for the weights (:mod:`.buffers`)."""
        return self._buffers

    @property
    def weight_buffers(self) -> dict[str, float]:
        """The buffer types holding the weights, as llama.cpp reported them while loading
        ({"CPU_REPACK": 596.5, "CPU_Mapped": 1059.9}, MiB)."""
        return dict(self._weight_buffers)

    @property
    def weights_note(self) -> str:
        """Where the layers run where some are on a GPU, the buffer choice and what llama.cpp
        reported holding the weights: "repack (CPU_REPACK 597 MiB, CPU_Mapped 1060 MiB)", "all 29
        layers on Vulkan0 (llvmpipe ...): offloaded (CPU_Mapped 178 MiB, Vulkan0 1001 MiB)"."""
        held = ", ".join(f"{name} {mib:.0f} MiB" for name, mib in sorted(self._weight_buffers.items()))
        where = "" if self.placement.on_cpu else f"{self.placement.words()}: "
        return where + (f"{self._buffers} ({held})" if held else self._buffers) + \
            f"; flash attention {self._flash_attention}" + (f" ({self.attention_note})" if self.attention_note else "")

    @property
    def flash_attention(self) -> str:
        """"auto", "on" or "off": how this context computes attention (:func:`.lib.flash_attention`)."""
        return self._flash_attention

    # --- evaluation -------------------------------------------------------------------
    @property
    def n_seq(self) -> int:
        return len(self._seq_lens)

    def seq_len(self, seq: int) -> int:
        self._check_seq(seq)
        return self._seq_lens[seq]

    def forward(self, token_ids: Sequence[int], logits_for: Sequence[int], seq: int = 0) -> np.ndarray:
        """Append token_ids [N] to sequence seq at positions seq_len(seq).. and return logits
        [M, V] float32 (a copy): :meth:`forward_batch` of one sequence."""
        return self.forward_batch([SeqForward(seq, token_ids, logits_for)])[0]

    def forward_batch(self, items: Sequence[SeqForward]) -> list[np.ndarray]:
        """Evaluate each item's tokens [N_i] on its sequence in one pass (llama_decode calls
        of up to n_batch tokens, the sequences' tokens side by side); returns logits
        [M_i, V] float32 per item.

        Raises ValueError for repeated or unknown sequences, ContextOverflowError when a
        sequence's tokens do not fit, SpecDecodeError when more than MAX_OUTPUT_ROWS rows
        are asked of one sequence or llama.cpp reports a failure (every sequence is then
        left as it was).
        """
        return self.forward_batch_hidden(items, ())[0]

    def forward_batch_hidden(self, items: Sequence[SeqForward],
                             hidden_for: Collection[int]) -> tuple[list[np.ndarray], dict[int, HiddenRows]]:
        """:meth:`forward_batch`, also returning the hidden states [M, H] (numpy float32) of
        the logit rows of the sequences in hidden_for. With embeddings on, llama.cpp outputs
        every token of a llama_decode: only a call of at most the output buffer's rows
        (min(n_batch, 64 n_seq)) may have them, so a longer chunk (a long prefill) gives no
        hidden rows. Raises as forward_batch."""
        self._require_open()
        seqs = [int(it[0]) for it in items]
        if len(set(seqs)) != len(seqs):
            raise ValueError(f"a batched forward takes each sequence once, got {seqs}")
        hidden_for = {int(s) for s in hidden_for}
        # Flattened batch: (seq, token, position, output row or -1) per token.
        flat: list[tuple[int, int, int, int]] = []
        outs: list[np.ndarray] = []
        where: list[tuple[int, int]] = []  # output row -> (item, row in item)
        for i, (seq, token_ids, logits_for) in enumerate(items):
            tokens = [int(t) for t in token_ids]
            want = self._check_forward(tokens, logits_for, seq)
            if len(want) > MAX_OUTPUT_ROWS:
                raise SpecDecodeError(f"{self.name}: {len(want)} logit rows asked for, at most "
                                      f"{MAX_OUTPUT_ROWS} per sequence and call")
            rows = {j: r for r, j in enumerate(want)}
            base = self._seq_lens[seq]
            for j, tok in enumerate(tokens):
                r = rows.get(j, -1)
                if r >= 0:
                    where.append((i, r))
                flat.append((seq, tok, base + j, len(where) - 1 if r >= 0 else -1))
            outs.append(np.empty((len(want), self._n_vocab), dtype=np.float32))
        hidden: dict[int, tuple[list[int], list[np.ndarray]]] = {s: ([], []) for s in seqs if s in hidden_for}
        before = list(self._seq_lens)
        for start in range(0, len(flat), self._n_batch):
            self._decode(flat[start: start + self._n_batch], where, outs, hidden, before)
        return outs, {s: HiddenRows(pos, np.stack(rows) if rows else np.zeros((0, self._n_embd), np.float32))
                      for s, (pos, rows) in hidden.items()}

    def _decode(self, chunk: list[tuple[int, int, int, int]], where: list[tuple[int, int]], outs: list[np.ndarray],
                hidden: dict[int, tuple[list[int], list[np.ndarray]]], before: list[int]) -> None:
        """One llama_decode of chunk [(seq, token, position, output row or -1)]: copies the
        logit rows into outs (where: output row -> (item, row)) and, for the sequences that
        hidden holds, the hidden rows into it; on failure every sequence goes back to its
        length in before."""
        lib, b = self._lib, self._batch
        for j, (seq, tok, pos, r) in enumerate(chunk):  # its rows fit: <= min(n_batch, 64 * n_seq)
            b.token[j] = tok
            b.pos[j] = pos
            b.n_seq_id[j] = 1
            b.seq_id[j][0] = seq
            b.logits[j] = r >= 0
        b.n_tokens = len(chunk)
        embeddings = (len(chunk) <= self._rows_max
                      and any(r >= 0 and seq in hidden for seq, _, _, r in chunk))
        if embeddings != self._embeddings:
            lib.llama_set_embeddings(self._ctx, embeddings)
            self._embeddings = embeddings
        rc = lib.llama_decode(self._ctx, b)
        if rc != 0:
            for seq, n in enumerate(before):  # leave every sequence as it was before this call
                lib.llama_memory_seq_rm(self._mem, seq, n, -1)
            self._seq_lens = list(before)
            raise SpecDecodeError(f"{self.name}: llama_decode failed with code {rc}")
        for j, (seq, _, pos, r) in enumerate(chunk):
            self._seq_lens[seq] = pos + 1
            if r >= 0:
                i, row = where[r]
                outs[i][row] = np.ctypeslib.as_array(lib.llama_get_logits_ith(self._ctx, j), shape=(self._n_vocab,))
                if embeddings and seq in hidden:
                    ptr = lib.llama_get_embeddings_ith(self._ctx, j)
                    hidden[seq][0].append(pos)
                    hidden[seq][1].append(np.ctypeslib.as_array(ptr, shape=(self._n_embd,)).copy())

    # --- hidden states, for draft heads --------------------------------------------------
    @property
    def hidden_size(self) -> int:
        return self._n_embd

    def make_heads(self, weight: np.ndarray, bias: np.ndarray, vocab_subset: np.ndarray):
        """Residual heads in numpy over the GGUF's output rows (:func:`.heads.numpy_heads`)."""
        return numpy_heads(self.path, self._n_vocab, weight, bias, vocab_subset)

    def forward_tree(self, token_ids: Sequence[int], parents: Sequence[int], seq: int = 0, hidden: bool = False):
        """A tree block on seq (:mod:`.tree`): (logits [N, V], hidden [N, H] or None)."""
        self._require_open()
        return forward_tree(self, token_ids, parents, seq, hidden)

    def keep_tree_rows(self, rows: Sequence[int], n_rows: int, seq: int = 0) -> None:
        keep_rows(self, rows, n_rows, seq)  # the root and path into seq; branches cleared

    def set_batch_invariant(self, on: bool) -> None:
        """Batch-invariant forwards (see the contract): one-token forwards on one thread (with
        more, ggml-cpu's flash attention splits a lone query's KV range of >= 512 cells among
        them, as no block does); blocks of a few rows run the lone step's kernels (repacked
        weights change kernels at 4 rows, tiled at 8): the engine keeps to ``invariant_block``."""
        self._require_open()
        self._lib.llama_set_n_threads(self._ctx, 1 if on else self.n_threads, self.n_threads)

    def rollback(self, n: int, seq: int = 0) -> None:
        """Drop sequence seq's cached positions >= n (llama_memory_seq_rm over [n, end))."""
        self._require_open()
        if self._check_rollback(n, seq):
            if not self._lib.llama_memory_seq_rm(self._mem, seq, n, -1):
                raise SpecDecodeError(f"{self.name}: llama.cpp cannot roll back this model's cache to {n}")
            self._seq_lens[seq] = n

    def shift_cells(self, seq: int, start: int, end: int, delta: int) -> None:
        """See the contract: llama_memory_seq_rm over [start + delta, start), then
        llama_memory_seq_add over [start, end) by delta (llama.cpp's server does the same for
        --cache-reuse); the keys' RoPE is rotated by delta at the next forward."""
        self._require_open()
        self._check_seq(seq)
        if not (self.can_shift and delta < 0 and 0 <= start + delta and start <= end <= self._seq_lens[seq]):
            raise SpecDecodeError(f"{self.name}: cannot shift cached positions [{start}, {end}) by {delta} "
                                  f"(sequence {seq} holds {self._seq_lens[seq]}; shifting "
                                  f"{'supported' if self.can_shift else 'not supported by this cache'})")
        if not self._lib.llama_memory_seq_rm(self._mem, seq, start + delta, start):
            raise SpecDecodeError(f"{self.name}: llama.cpp cannot drop cached positions [{start + delta}, {start})")
        self._lib.llama_memory_seq_add(self._mem, seq, start, end, delta)

    def _require_open(self) -> None:
        """llama.cpp aborts the process on a freed context: refuse with an error instead."""
        if getattr(self, "_ctx", None) is None:
            raise SpecDecodeError(f"the model {self.name} is closed: load it again to use it")

    def close(self) -> None:
        lib = getattr(self, "_lib", None)
        if lib is None:
            return
        if getattr(self, "_twin", False):  # a scratch twin: its context only, never the shared model
            if getattr(self, "_ctx", None):
                lib.llama_free(self._ctx)
            self._ctx = self._model = self._batch = None
            return
        for attr, free in (("_batch", lib.llama_batch_free), ("_ctx", lib.llama_free), ("_model", lib.llama_model_free)):
            if getattr(self, attr):
                free(getattr(self, attr))
                setattr(self, attr, None)

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:
            pass
