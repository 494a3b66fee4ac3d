"""The backend protocol: what the engine and drafters need from one loaded model.

Dimension letters: N = tokens in one forward call, M = positions whose logits are
requested, V = vocabulary size.

KV-cache discipline: a backend holds ``n_seq`` sequences (1 unless loaded for several
concurrent generations), each with its own positions. ``forward(..., seq=s)`` appends
tokens to sequence s at positions ``seq_len(s) .. seq_len(s)+N-1``; ``rollback(n, seq=s)``
drops every cached position >= n of sequence s so that its next ``forward`` continues from
position n. Rollback is the one named call for rejecting drafted tokens (as llama.cpp's
``llama_memory_seq_rm``), and for reusing a cached prefix across generations
(:func:`common_prefix_len`). ``forward_batch`` evaluates several sequences' tokens in one
forward pass (continuous batching); ``forward`` is the batch of one. ``kv_len`` is
``seq_len(0)``.

Optional abilities are declared, not probed: ``supports_greedy_draft`` (a whole greedy
draft on the device, :meth:`Backend.greedy_draft`), ``supports_output_subset()``
(logits for a subset of the vocabulary, :meth:`Backend.set_output_subset`) and
``supports_hidden_states`` (the final hidden states of a forward's logit rows, asked for
per call, for draft heads: :meth:`Backend.forward_batch_hidden`, :meth:`Backend.make_heads`).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Collection, NamedTuple, Protocol, Sequence, runtime_checkable

import numpy as np

from ..errors import ContextOverflowError, SpecDecodeError
from .fim import FimTokens


class SeqForward(NamedTuple):
    """One sequence's part of a batched forward: token_ids [N] appended to sequence seq,
    logits wanted for the indices logits_for [M] (ascending, into token_ids)."""

    seq: int
    token_ids: Sequence[int]
    logits_for: Sequence[int]


class Placement(NamedTuple):
    """Where a model's weights run. device: llama.cpp's device name where layers are on a GPU
    ("CUDA0", "Vulkan0", "Metal"), torch's device ("cuda:0", "mps"), "CPU" where none;
    gpu_layers: layers on a GPU device; n_layers: the model's layers as its engine counts them
    (llama.cpp: the blocks and the output layer; 0 where unknown); description: the device's own
    words (the card's name); note: one line on how the placement was chosen."""

    device: str = "CPU"
    gpu_layers: int = 0
    n_layers: int = 0
    description: str = ""
    note: str = ""

    @property
    def on_cpu(self) -> bool:
        """Whether every layer runs on the CPU (the CPU's rules apply: its buffers, its
        attention path, a busy machine's readings)."""
        return self.device == "CPU"

    def to_dict(self) -> dict:
        """The statistics' fields: device, gpu_layers, n_layers."""
        return {"device": self.device, "gpu_layers": self.gpu_layers, "n_layers": self.n_layers}

    def words(self) -> str:
        """In words: "all 29 layers on Vulkan0 (llvmpipe ...)", "12 of 29 layers on CUDA0 (...),
        the rest on the CPU", "on the CPU"."""
        if self.on_cpu:
            return "on the CPU"
        where = f"{self.device} ({self.description})" if self.description else self.device
        if not self.n_layers:
            return f"on {where}"
        if self.gpu_layers >= self.n_layers:
            return f"all {self.n_layers} layers on {where}"
        return f"{self.gpu_layers} of {self.n_layers} layers on {where}, the rest on the CPU"


class HiddenRows(NamedTuple):
    """The target's final (post-norm) hidden states of one sequence's logit rows in one
    forward: positions [M] (absolute positions in the sequence, ascending) and hidden [M, H]
    (a device tensor or a numpy array, the input of :meth:`Backend.make_heads`' function).
    M may be less than the rows asked for (none at all: see the backend's limits)."""

    positions: list[int]
    hidden: Any


@runtime_checkable
class Backend(Protocol):
    """One loaded model with a KV cache of n_seq sequences."""

    name: str  # human-readable model name (file or registry name)
    path: Path | None  # the model file or folder, when loaded from one
    known_sha256: str | None  # the model file's SHA-256 when its loader knows it (a registry model), else None
    n_threads: int | None  # CPU threads, where the backend has a setting
    device: str  # where the weights live ("cpu", "cuda"; llama.cpp: "cpu" or its GPU device's name): a cost-cache key
    supports_greedy_draft: bool  # greedy_draft() runs a whole greedy draft on the device
    supports_hidden_states: bool  # forward_batch_hidden() / make_heads() serve draft heads
    supports_tree: bool  # forward_tree() / keep_tree_rows() verify a tree of drafts in one forward
    max_tree_leaves: int  # the most leaves (branches) a tree forward_tree() verifies may have
    supports_tree_draft: bool  # forward_rows(): rows under an explicit mask (a draft model grows a tree)
    has_text: bool  # a tokenizer and text (False: a model over codes, ModuleBackend)
    thread_safe_tokenizer: bool  # tokenize() may run on any thread, also while another runs a forward
    # The most tokens a batch-invariant forward holds (set_batch_invariant), once measured; None before.
    invariant_block: int | None
    # Its sequences' KV cells share one buffer (llama.cpp's unified cache): a forward then attends
    # past other sequences' cells, and its arithmetic can differ from a run of its own (measured:
    # greedy generations beside others left their solo text, also verified one token a forward),
    # so no generation is batch-invariant there while other sequences may hold cells.
    kv_shared: bool
    chat_template: str | None  # the model's own chat template (Jinja source), None when it has none
    fim_tokens: "FimTokens | None"  # the model's fill-in-the-middle tokens, where it has them
    prefill_split: int | None  # a long forward's calls (llama.cpp: n_batch tokens); None: one call
    context: Any  # the ContextChoice it was loaded with (backends.context), None where not chosen by size
    attention_note: str  # how the attention path was chosen ("" where there is no choice)
    attention_chosen: bool  # the path was chosen by measurement, not asked for (a seed then decodes plainly)

    @property
    def cost_key(self) -> str:
        """What a measured latency depends on beyond the file (e.g. dtype); "" if nothing."""

    @property
    def weights_note(self) -> str:
        """Where the weights live, for the statistics (llama.cpp: its buffer types and their
        MiB); "" if nothing worth saying."""

    @property
    def placement(self) -> Placement:
        """The device the weights run on and how many layers are on a GPU (:class:`Placement`)."""

    @property
    def n_vocab(self) -> int:
        """Vocabulary size V (rows of the output logits)."""

    @property
    def n_ctx(self) -> int:
        """Context window in tokens: kv_len can never exceed it."""

    @property
    def n_seq(self) -> int:
        """Sequences the KV cache holds (ids 0..n_seq-1), each of up to n_ctx positions."""

    @property
    def kv_len(self) -> int:
        """Number of positions held in the KV cache of sequence 0 (``seq_len(0)``)."""

    def seq_len(self, seq: int) -> int:
        """Number of positions held in the KV cache of sequence seq."""

    @property
    def eog_ids(self) -> frozenset[int]:
        """Token ids that end generation (end-of-sequence, end-of-turn)."""

    def tokenize(self, text: str, add_special: bool = True, parse_special: bool = False) -> list[int]:
        """Text -> token ids; add_special prepends BOS where the model wants it."""

    def token_bytes(self, token_id: int) -> bytes:
        """The UTF-8 bytes a token contributes to the output text (b"" for control tokens)."""

    def token_text(self, token_id: int) -> bytes:
        """The token's vocabulary entry as bytes, control tokens included (for compatibility checks)."""

    def apply_chat_template(self, messages: Sequence[dict], tools: Sequence[dict] | None = None) -> str:
        """Render OpenAI-style messages (as :func:`specdecode.messages.template_messages`
        gives them) with the model's own chat template, generation prompt added. tools:
        OpenAI tool objects (``{"type": "function", "function": {...}}``) the template
        presents to the model (None or empty: no tools). Raises SpecDecodeError when the
        model has no chat template or the template rejects the messages."""

    def forward(self, token_ids: Sequence[int], logits_for: Sequence[int], seq: int = 0) -> np.ndarray:
        """Append token_ids [N] to sequence seq's cache and return logits [M, V] (float32).

        logits_for: [M] indices into token_ids (0..N-1, ascending) whose next-token logits
        are wanted; M may be 0. Raises ContextOverflowError when seq_len(seq) + N > n_ctx.
        """

    def forward_batch(self, items: Sequence[SeqForward]) -> list[np.ndarray]:
        """One forward pass over several sequences (distinct seq ids): appends each item's
        tokens to its sequence; returns each item's logits [M_i, V], in order. Nothing is
        appended when it raises (as :meth:`forward`)."""

    def forward_batch_hidden(self, items: Sequence[SeqForward],
                             hidden_for: Collection[int]) -> tuple[list[np.ndarray], dict[int, HiddenRows]]:
        """:meth:`forward_batch`, also returning the final hidden states of the logit rows of
        each item whose sequence id is in hidden_for, by sequence id (only where
        supports_hidden_states; the logits are those forward_batch gives)."""

    def set_batch_invariant(self, on: bool) -> None:
        """Compute the following forwards batch-invariantly (on) or as fast as possible (off):
        batch-invariant, every row of a forward of at most ``invariant_block`` tokens gets
        exactly the logits, and writes exactly the cache, of one-token forwards. Which block
        sizes hold is measured on the machine, not assumed
        (:func:`specdecode.control.invariance.measure_invariant_block`)."""

    def rollback(self, n: int, seq: int = 0) -> None:
        """Drop sequence seq's cached positions >= n (0 <= n <= seq_len(seq))."""

    def close(self) -> None:
        """Free the model and its context."""

    def greedy_draft(self, token_ids: Sequence[int], k: int) -> list[int]:
        """Feed token_ids [N], then draft k tokens greedily; returns the k ids (only where
        supports_greedy_draft). The cache then holds token_ids and the first k-1 drafts."""

    def make_heads(self, weight: np.ndarray, bias: np.ndarray, vocab_subset: np.ndarray):
        """Draft heads on this device (:func:`residual_heads`): returns f(h, k) -> logits
        [k, V] float32 of heads 1..k on hidden state h [H], a row of
        :meth:`forward_batch_hidden`'s HiddenRows (-inf outside vocab_subset)."""

    def supports_output_subset(self) -> bool:
        """Whether set_output_subset can restrict the logits to some token ids."""

    def set_output_subset(self, ids: Sequence[int] | None) -> None:
        """Compute logits only for ids (others -inf); None restores the whole vocabulary."""


class BackendBase:
    """Shared state, argument checks and the default (absent) optional abilities of the
    concrete backends (subclasses set _n_vocab, _n_ctx, _kv_len, _eog and name)."""

    name: str
    path: Path | None = None
    known_sha256: str | None = None
    n_threads: int | None = None
    device: str = "cpu"
    supports_greedy_draft = False
    supports_hidden_states = False
    supports_tree = False
    max_tree_leaves = 1 << 30
    supports_tree_draft = False
    has_text = True
    thread_safe_tokenizer = False
    invariant_block: int | None = None
    kv_shared = False
    chat_template: str | None = None  # a backend whose model has one overrides this
    bos_id: int | None = None  # the model's start and end tokens (its vocabulary's), where it names them
    eos_id: int | None = None
    fim_tokens: FimTokens | None = None  # the model's fill-in-the-middle tokens (:mod:`.fim`), where it has them
    prefill_split: int | None = None  # a long forward's calls (llama.cpp: n_batch tokens); None: one call
    context = None  # the ContextChoice a loader sized the context with (None: a backend given as it is)
    attention_note = ""
    attention_chosen = False
    can_shift = False  # whether shift_cells can move cached positions (llama.cpp: llama_memory_can_shift)
    _n_vocab: int
    _n_ctx: int
    _kv_len: int  # sequence 0's; a multi-sequence backend overrides seq_len
    _eog: frozenset[int]

    @property
    def special_texts(self) -> frozenset[str]:
        """The texts that ``tokenize(parse_special=True)`` reads as one token and
        ``parse_special=False`` reads as text (control tokens such as ``<|im_end|>``): what
        :func:`.chat_prompt.chat_prompt_ids` keeps as text where a request's string holds it.
        Empty for a backend without a tokenizer."""
        return frozenset()

    @property
    def n_vocab(self) -> int:
        return self._n_vocab

    @property
    def n_ctx(self) -> int:
        return self._n_ctx

    @property
    def n_seq(self) -> int:
        return 1

    @property
    def kv_len(self) -> int:
        return self.seq_len(0)

    def seq_len(self, seq: int) -> int:
        self._check_seq(seq)
        return self._kv_len

    def forward_batch(self, items: Sequence[SeqForward]) -> list[np.ndarray]:
        """A backend of one sequence: the batch is that sequence's forward."""
        if len(items) != 1:
            raise SpecDecodeError(f"{self.name} on {type(self).__name__} holds one sequence: it cannot batch "
                                  f"{len(items)} sequences (load it with n_seq = 1, --parallel 1)")
        seq, tokens, rows = items[0]
        return [self.forward(tokens, rows, seq=seq)]

    def _check_seq(self, seq: int) -> None:
        if not 0 <= seq < self.n_seq:
            raise ValueError(f"sequence {seq} outside 0..{self.n_seq - 1}")

    @property
    def eog_ids(self) -> frozenset[int]:
        return self._eog

    @property
    def cost_key(self) -> str:
        return ""

    @property
    def weights_note(self) -> str:
        return ""

    @property
    def placement(self) -> Placement:
        """On the CPU where ``device`` is "cpu", else on that device (layers unknown)."""
        return Placement() if str(self.device) == "cpu" else Placement(str(self.device))

    def greedy_draft(self, token_ids: Sequence[int], k: int) -> list[int]:
        raise RuntimeError(f"{type(self).__name__} drafts token by token (supports_greedy_draft is False)")

    def supports_output_subset(self) -> bool:
        return False

    def set_batch_invariant(self, on: bool) -> None:
        """No setting: what the forwards give is what the measurement finds."""

    def forward_batch_hidden(self, items: Sequence[SeqForward],
                             hidden_for: Collection[int]) -> tuple[list[np.ndarray], dict[int, HiddenRows]]:
        raise SpecDecodeError(f"{self.name} on {type(self).__name__} does not give its hidden states")

    def _one_sequence_hidden(self, items: Sequence[SeqForward],
                             hidden_for: Collection[int]) -> tuple[list[np.ndarray], dict[int, HiddenRows]]:
        """:meth:`forward_batch_hidden` of a backend of one sequence whose
        ``_forward(tokens, rows, seq, hidden)`` gives (logits, HiddenRows or None)."""
        if len(items) != 1:
            return BackendBase.forward_batch(self, items), {}  # raises: one sequence
        seq, tokens, rows = items[0]
        want = int(seq) in {int(s) for s in hidden_for}
        logits, hidden = self._forward(tokens, rows, seq, hidden=want)
        return [logits], ({int(seq): hidden} if want else {})

    def make_heads(self, weight: np.ndarray, bias: np.ndarray, vocab_subset: np.ndarray):
        raise SpecDecodeError(f"{self.name} on {type(self).__name__} cannot run draft heads")

    def scratch_twin(self, n_ctx: int, n_seq: int | None = None, mode: str | None = None) -> "Backend | None":
        """A backend over the same model with a KV cache of its own, for measuring without touching
        this one's sequences (llama.cpp: :func:`.llama_cpp.scratch.scratch_twin`); None where the
        backend makes none (the measurement then runs on it)."""
        return None

    def shift_cells(self, seq: int, start: int, end: int, delta: int) -> None:
        """Move sequence seq's cached positions [start, end) by delta < 0 to [start + delta,
        end + delta), dropping what was cached at [start + delta, start) first (cache reuse:
        :mod:`specdecode.engine.reuse`). seq_len is unchanged: the caller rolls back after the
        last move. Only where ``can_shift``; SpecDecodeError otherwise."""
        raise SpecDecodeError(f"{self.name} on {type(self).__name__} cannot shift its cached positions")

    def set_output_subset(self, ids: Sequence[int] | None) -> None:
        raise SpecDecodeError(f"{self.name} on {type(self).__name__} cannot restrict its output to a vocabulary subset")

    def _check_forward(self, tokens: Sequence[int], logits_for: Sequence[int], seq: int = 0) -> list[int]:
        """Validate a forward call; returns the requested rows, sorted and unique.

        Raises ValueError for rows outside the tokens, ContextOverflowError when the tokens
        do not fit, SpecDecodeError for ids outside the vocabulary.
        """
        n = len(tokens)
        want = sorted(set(int(i) for i in logits_for))
        if want and (want[0] < 0 or want[-1] >= n):
            raise ValueError(f"logits_for {want} out of range for {n} tokens")
        have = self.seq_len(seq)
        if have + n > self._n_ctx:
            raise ContextOverflowError(
                f"{self.name}: {have} cached + {n} new tokens exceed the context of {self._n_ctx} tokens"
            )
        bad = [t for t in tokens if not (0 <= t < self._n_vocab)]
        if bad:
            raise SpecDecodeError(f"token id {bad[0]} is outside the vocabulary of {self.name} ({self._n_vocab})")
        return want

    def _check_rollback(self, n: int, seq: int = 0) -> bool:
        """Validate a rollback of sequence seq to n; True when there is anything to drop."""
        have = self.seq_len(seq)
        if not (0 <= n <= have):
            raise ValueError(f"rollback to {n} outside 0..{have}")
        return n < have
