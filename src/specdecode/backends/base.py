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

import weakref
from pathlib import Path
from typing import Any, Callable, Collection, NamedTuple, Protocol, Sequence, runtime_checkable

import numpy as np

from ..errors import ContextOverflowError, ModelFileError, SpecDecodeError
from .fim import FimTokens


def common_prefix_len(cached: Sequence[int], tokens: Sequence[int], limit: int | None = None) -> int:
    """Length of the longest common prefix of two token lists, at most ``limit``: how much of
    a KV cache holding ``cached`` can be kept (``rollback(n)``) for ``tokens``."""
    n, end = 0, min(len(cached), len(tokens), len(tokens) if limit is None else limit)
    while n < end and cached[n] == tokens[n]:
        n += 1
    return n


class SeqForward(NamedTuple):
    """One sequence's part of a batched forward: token_ids [N] appended to sequence seq,
    logits wanted for the indices logits_for [M] (ascending, into token_ids)."""

    seq: int
    token_ids: Sequence[int]
    logits_for: Sequence[int]


class HiddenRows(NamedTuple):
    """The target's final (post-norm) hidden states of one sequence's logit rows in one
    forward: positions [M] (absolute positions in the sequence, ascending) and hidden [M, H]
    (a device tensor or a numpy array, the input of :meth:`Backend.make_heads`' function).
    M may be less than the rows asked for (none at all: see the backend's limits)."""

    positions: list[int]
    hidden: Any


def residual_heads(h, weight, bias, w_out, b_out, einsum: Callable, silu: Callable):
    """Medusa-1 residual heads (:mod:`specdecode.drafters.heads`), the one formula of every
    place that runs them (the backends' :meth:`Backend.make_heads`, training), on numpy
    arrays or torch tensors alike (einsum and silu of that library)::

        z_k = h + SiLU(W_k h + b_k),    logits_k = W_out[S] z_k + b_out[S]

    h [..., H]; weight [K, H, H]; bias [K, H]; w_out [S, H] (the output projection's rows
    of the vocabulary subset S); b_out [S] or None (its bias, where the model has one).
    Returns the subset's logits [..., K, S].
    """
    z = h[..., None, :] + silu(einsum("kij,...j->...ki", weight, h) + bias)  # [..., K, H]
    logits = z @ w_out.T
    return logits if b_out is None else logits + b_out


@runtime_checkable
class Backend(Protocol):
    """One loaded model with a KV cache of n_seq sequences."""

    name: str  # human-readable model name (file or registry name)
    path: Path | None  # the model file or folder, when loaded from one
    known_sha256: str | None  # the model file's SHA-256 when its loader knows it (a registry model), else None
    n_threads: int | None  # CPU threads, where the backend has a setting
    device: str  # where the weights live ("cpu", "cuda")
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

    @property
    def cost_key(self) -> str:
        """What a measured latency depends on beyond the file (e.g. dtype); "" if nothing."""

    @property
    def weights_note(self) -> str:
        """Where the weights live, for the statistics (llama.cpp: its buffer types and their
        MiB); "" if nothing worth saying."""

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

    @property
    def chat_template(self) -> str | None:
        """The model's own chat template (Jinja source), None when it has none."""

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
    fim_tokens: FimTokens | None = None  # the model's fill-in-the-middle tokens (:mod:`.fim`), where it has them
    prefill_split: int | None = None  # a long forward's calls (llama.cpp: n_batch tokens); None: one call
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


def tree_depths(parents: Sequence[int]) -> list[int]:
    """[N + 1] depths of a tree block's rows (row 0 the root, depth 0; row i + 1 node i, whose
    parent is parents[i]: -1 the root, else an earlier node). A row's position is the cached
    length plus its depth. Raises ValueError for a parent that is not an earlier node."""
    depth = [0]
    for i, p in enumerate(parents):
        if not -1 <= int(p) < i:
            raise ValueError(f"parents[{i}] = {p}: a parent must be -1 or an earlier node")
        depth.append(depth[int(p) + 1] + 1)
    return depth


def tree_prefix_within(parents: Sequence[int], max_leaves: int) -> int:
    """The most leading nodes of a tree (parents in topological order) that form a tree of at
    most max_leaves leaves (a prefix of such a list is always a tree)."""
    children = [0] * len(parents)
    leaves = 0
    for i, p in enumerate(parents):
        leaves += 1 if p < 0 or children[p] else 0  # a child of a leaf takes its place
        if p >= 0:
            children[p] += 1
        if leaves > max_leaves:
            return i
    return len(parents)


# Loaded backends a Decoder was given and holds: each holds one sequence's cache of its own.
_IN_USE: "weakref.WeakSet[Backend]" = weakref.WeakSet()


def claim_backends(target, draft) -> list[Backend]:
    """The loaded backends given (target, draft), claimed for this Decoder: one holds one
    sequence's cache, so it serves one Decoder, as target or draft model, not both.
    Raises SpecDecodeError naming the backend otherwise."""
    given = [b for b in (target, draft) if isinstance(b, Backend)]
    if len(given) == 2 and given[0] is given[1]:
        raise SpecDecodeError(f"draft and target are the same backend {target.name}: each holds its own cache, "
                              f"so the draft model needs a backend of its own (wrap the module again)",
                              param="draft")
    for b, param in zip(given, ["target", "draft"] if isinstance(target, Backend) else ["draft"]):
        if b in _IN_USE:
            raise SpecDecodeError(f"{param} {b.name} is in use by another Decoder (a backend holds one "
                                  f"sequence's cache): close that Decoder first, or give this one a backend of "
                                  f"its own (ModuleBackend over the same module)", param=param)
    _IN_USE.update(given)
    return given


def release_backends(backends) -> None:
    """Free backends claimed by :func:`claim_backends` (a Decoder closed or failed to start)."""
    _IN_USE.difference_update(backends)


def check_finite_logits(target: "Backend", row: np.ndarray) -> None:
    """One row of a step's logits [V] (one pass, ~20 us for 150k): a NaN, a +inf, or -inf
    for every token (-inf outside an output subset is fine) means corrupt weights, named
    here rather than sampled from (a NaN row's argmax is token 0; sampling it fails with a
    zero-mass distribution). The step's last row is the one to check: in a causal model a
    NaN at one position reaches every later one through attention. Raises ModelFileError
    naming the model."""
    if not np.isfinite(row.max()):
        raise ModelFileError(f"model {target.name} gave non-finite logits (NaN or infinity): its weights are corrupt, "
                             "or the file is not the model it claims to be")
