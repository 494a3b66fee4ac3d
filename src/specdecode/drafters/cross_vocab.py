"""A draft model whose tokenizer is not the target's: lossless drafting across vocabularies
(Timor et al., "Accelerating LLM Inference with Lossless Speculative Decoding Algorithms for
Heterogeneous Vocabularies", ICML 2025).

Two methods, one drafter:

- **SLEM** (string-level exact match, the paper's Algorithm 2): the draft model continues the
  committed text greedily in its own tokens until its text holds K + 1 whole target tokens; the
  text is tokenized with the target's tokenizer and verified as a draft without probabilities
  (one-hot). That is lossless under greedy decoding and sampling alike, as for prompt lookup:
  the target keeps a token with its own probability of it. The safe boundary: unless the
  draft model ended the text, its last word (and the white space before it) is left out,
  since the draft may not have finished it and a tokenizer merges it with what follows; so
  is a character cut in the middle of its UTF-8 bytes, and bytes that are no UTF-8; and of
  the target's tokens of that text the last is held back (it too may merge with what follows).
- **TLI** (token-level intersection, the paper's Section 4): the draft model's distribution
  restricted to the tokens both vocabularies have (:class:`specdecode.backends.vocab_map.VocabMap`,
  matched by text), renormalised, over the target's ids. Each drafted token is one target
  token drawn from a distribution the drafter reports (probs [K, Vt]), so speculative
  sampling (Chen et al. 2023) keeps the target's distribution, and sampled drafts are
  accepted more often than one-hot ones.

``method="auto"`` runs SLEM for greedy generations and TLI for sampled ones.

Both read the committed text the same way (:class:`TextMirror`): the target's ids rendered
as text (a control token as its marker, ``<|im_start|>``) and tokenized with the draft's
tokenizer, only the tail that changed since the last step (from a few draft tokens before the
first changed byte), so the draft model's KV cache keeps its longest common prefix with the new
tokens and reads only the rest, never the whole prompt again.

Dimension letters: K = drafted tokens, L = context length, Vd / Vt = draft / target vocabulary.
"""

from __future__ import annotations

from bisect import bisect_right
from typing import Sequence

import numpy as np

from ..backends.base import Backend
from ..backends.sharing import common_prefix_len
from ..backends.vocab_map import VocabMap, build_vocab_map, render
from ..errors import IncompatibleVocabularyError, SpecDecodeError
from ..sampling import Sampler
from .base import ContinuationRule, Draft
from .model import OwnedDraftModel

METHODS = ("slem", "tli")
# Draft tokens before the first changed byte that the mirror tokenizes again with the new text:
# a tokenizer may merge the old end with new text ("hel" + "lo" -> "hello").
MARGIN = 4
# A draft model whose vocabulary shares fewer token texts with the target's than this share of
# the smaller one cannot read the target's text usefully (another script, codes): refused.
MIN_SHARED = 0.2
# SLEM drafts at most this many draft tokens per target token asked for (plus 2): tokenizers
# differ in how much text a token holds.
SLEM_BUDGET = 2


def _complete_utf8(data: bytes | bytearray, end: int) -> int:
    """The largest e <= end such that data[:e] ends with a whole UTF-8 character (data's
    start is a character start)."""
    i = end - 1
    while i >= 0 and end - i <= 4 and 0x80 <= data[i] < 0xC0:
        i -= 1
    if i < 0 or end - i > 4:
        return end  # not UTF-8 continuation bytes after a lead byte: leave it to the decoder
    lead = data[i]
    size = 1 if lead < 0x80 else 2 if lead >= 0xC0 and lead < 0xE0 else 3 if lead < 0xF0 else 4
    return end if end - i >= size else i


class TextMirror:
    """The committed target ids [L] as the draft model's tokens.

    text: the target ids rendered (:func:`specdecode.backends.vocab_map.render`); dids: the
    draft's tokens of text[:covered] (the draft's own start tokens, such as a BOS, first);
    covered: bytes of text the draft tokens cover (whole UTF-8 characters)."""

    def __init__(self, draft: Backend, target: Backend) -> None:
        self.draft, self.target = draft, target
        self.prefix = [t for t in draft.tokenize("", add_special=True, parse_special=False)
                       if t not in draft.eog_ids]
        self.tids: list[int] = []
        self.tends: list[int] = []  # byte end of each target id's text
        self.text = bytearray()
        self.dids: list[int] = list(self.prefix)
        self.dends: list[int] = [0] * len(self.prefix)  # byte end of each draft token
        self.covered = 0
        self._rt: dict[int, bytes] = {}
        self._rd: dict[int, bytes] = {}

    def render_target(self, t: int) -> bytes:
        b = self._rt.get(t)
        if b is None:
            b = self._rt[t] = render(self.target, t)
        return b

    def render_draft(self, d: int) -> bytes:
        b = self._rd.get(d)
        if b is None:
            b = self._rd[d] = render(self.draft, d)
        return b

    def update(self, context: Sequence[int]) -> list[int]:
        """The draft's tokens of context [L] (target ids); reads only what changed."""
        keep = common_prefix_len(self.tids, context)
        changed = self.tends[keep - 1] if keep else 0
        if keep == len(self.tids) == len(context):
            return self.dids
        del self.tids[keep:], self.tends[keep:], self.text[changed:]
        for t in context[keep:]:
            self.text += self.render_target(t)
            self.tids.append(t)
            self.tends.append(len(self.text))
        j = max(len(self.prefix), bisect_right(self.dends, min(changed, self.covered)) - MARGIN)
        while j > len(self.prefix) and self.dends[j - 1] < len(self.text) and 0x80 <= self.text[self.dends[j - 1]] < 0xC0:
            j -= 1  # start the re-read at a character's first byte
        if not self._read_from(j):
            self._read_from(len(self.prefix))  # a tokenizer that does not read a tail alone (a prefix space)
        return self.dids

    def _read_from(self, j: int) -> bool:
        """Tokenize text from draft token j on; False when the tokens do not spell the text
        exactly (then the byte ends are estimates)."""
        start = self.dends[j - 1] if j else 0
        end = _complete_utf8(self.text, len(self.text))
        piece = bytes(self.text[start:end]).decode("utf-8", "replace")
        new = self.draft.tokenize(piece, add_special=False, parse_special=True) if piece else []
        ends, pos = [], start
        for d in new:
            pos += len(self.render_draft(d))
            ends.append(pos)
        del self.dids[j:], self.dends[j:]
        self.dids.extend(new)
        self.dends.extend(min(e, end) for e in ends)
        self.covered = end
        return pos == end or j == len(self.prefix)


class CrossVocabDrafter(OwnedDraftModel):
    """A draft model with its own tokenizer drafts for the target (see the module docstring).

    method: "slem", "tli" or "auto" (SLEM for greedy generations, TLI for sampled ones);
    :attr:`ran` says which the current generation runs. vocab_map: the matched vocabularies
    (built here when not given). Raises SpecDecodeError for an unknown method,
    IncompatibleVocabularyError for a model without text (a model over codes) or when the
    vocabularies share too few token texts (the overlap measured is in the message).
    """

    name = "model"
    # The controller's priors (first drafted token, each later one given the one before), per
    # method: the first target token is the uncertain one (where the two tokenizers' words
    # meet); a draft that starts right tends to go on. Measured with K = 4 on llama.cpp (Zen 4,
    # qwen2.5-coder-1.5b target, two code-editing and two chat prompts of the suite): SLEM
    # 110/183 first, 188/254 then; TLI 118/229, 134/225. On torch bf16 SLEM code editing 34/50,
    # 90/99. One rate at the first token's acceptance plans one-token drafts where verification
    # is flat; the controller's TwoRateEstimator learns both from there.
    ACCEPTANCE_PRIORS = {"slem": (0.6, 0.75), "tli": (0.5, 0.6)}

    def __init__(self, backend: Backend, target: Backend, method: str = "auto", seq: int = 0,
                 vocab_map: VocabMap | None = None) -> None:
        if method not in (*METHODS, "auto"):
            raise SpecDecodeError(f"draft vocabulary method {method!r} is unknown: expected 'slem', 'tli' or 'auto'",
                                  param="draft_vocab")
        if not (backend.has_text and target.has_text):
            raise IncompatibleVocabularyError(f"draft {backend.name} and target {target.name}: drafting across "
                                              f"vocabularies needs two models over text")
        self.backend, self.target, self.method, self.seq = backend, target, method, seq
        self.vmap = vocab_map if vocab_map is not None else build_vocab_map(backend, target)
        if self.vmap.shared < MIN_SHARED * min(backend.n_vocab, target.n_vocab):
            raise IncompatibleVocabularyError(
                f"draft {backend.name} cannot draft for target {target.name} across tokenizers: "
                f"{self.vmap.overlap_note()}, under {MIN_SHARED:.0%} of the smaller vocabulary")
        self._d_idx = np.nonzero(self.vmap.d2t >= 0)[0]
        self._t_idx = self.vmap.d2t[self._d_idx]
        self._owner, self._closed = True, False
        self._mirror = TextMirror(backend, target)
        self._cached: list[int] = []
        self._sampler: Sampler | None = None
        self.keep_drafting: ContinuationRule | None = None
        self.ran = "slem" if method == "auto" else method
        self.drafted = {m: 0 for m in METHODS}
        self.accepted = {m: 0 for m in METHODS}
        self._last_k = 0

    @property
    def label(self) -> str:
        """How the controller's explanation names it."""
        return f"draft model {self.backend.name} ({self.ran.upper()} across tokenizers)"

    @property
    def acceptance_priors(self) -> tuple[float, float]:
        """(first, then) acceptance the controller starts from: the method that runs (SLEM
        until a generation says otherwise)."""
        return self.ACCEPTANCE_PRIORS[self.ran]

    def fork(self, seq: int) -> "CrossVocabDrafter":
        twin = self._twin(seq)
        twin._mirror, twin._cached, twin._sampler = TextMirror(self.backend, self.target), [], None
        twin.drafted, twin.accepted = dict.fromkeys(METHODS, 0), dict.fromkeys(METHODS, 0)
        return twin

    def start(self, prompt_ids: Sequence[int], sampler: Sampler) -> None:
        self._sampler = sampler
        self.ran = self.method if self.method != "auto" else "slem" if sampler.params.greedy else "tli"
        self.drafted, self.accepted = dict.fromkeys(METHODS, 0), dict.fromkeys(METHODS, 0)

    def pending(self, context: Sequence[int]) -> int:
        """Tokens to read before drafting: the target's not yet mirrored, and the draft's
        tokens of the mirrored text not in its KV cache."""
        unread = len(context) - common_prefix_len(self._mirror.tids, context)
        return unread + len(self._mirror.dids) - common_prefix_len(self._cached, self._mirror.dids)

    def propose(self, context: Sequence[int], k: int) -> Draft:
        sampler = self._sampler
        assert sampler is not None, "start() must be called before propose()"
        dids = self._mirror.update(context)
        k = min(k, self.backend.n_ctx - len(dids) - 1)
        if k <= 0 or not dids:
            self._last_k = 0
            return Draft([])
        keep = common_prefix_len(self._cached, dids, len(dids) - 1)  # feed at least one token
        self.backend.rollback(keep, seq=self.seq)
        del self._cached[keep:]
        assert self.backend.seq_len(self.seq) == len(self._cached), "draft KV length must equal its cached tokens"
        logits = self.backend.forward(dids[keep:], logits_for=[len(dids) - keep - 1], seq=self.seq)[0]
        self._cached.extend(dids[keep:])
        draft = self._slem(logits, k) if self.ran == "slem" else self._tli(context, logits, k, sampler)
        self._last_k = len(draft.token_ids)
        self.drafted[self.ran] += self._last_k
        return draft

    def _feed(self, d: int) -> np.ndarray:
        logits = self.backend.forward([d], logits_for=[0], seq=self.seq)[0]
        self._cached.append(d)
        return logits

    def _slem(self, logits: np.ndarray, k: int) -> Draft:
        """Draft text greedily in the draft's tokens (at most SLEM_BUDGET * (k + 1) + 2 of them,
        until the text holds k + 1 whole target tokens), then as the target's first k tokens:
        the last whole token of a text that goes on is held back, since the target's tokenizer
        may merge it with what follows (":" then "\n" is one token ":\n"). Measured before
        that (llama.cpp, Zen 4, K = 4, two code-editing prompts): the 4th of 4 drafted tokens
        accepted after the 3rd 28/42 times, the 2nd and 3rd 46/54 and 42/46."""
        text, done, end_id, p_cum = b"", False, None, 1.0
        ids: list[int] = []
        budget = SLEM_BUDGET * (k + 1) + 2
        for i in range(budget):
            tok = int(np.argmax(logits))
            if tok in self.backend.eog_ids or not self.backend.token_bytes(tok):  # the end, or a control token
                end_id, done = self.vmap.draft_eog_to_target.get(tok), True
                break
            text += self._mirror.render_draft(tok)
            ids = self._target_ids(text, False)
            if len(ids) > k:
                return Draft(ids[:k])
            if self.keep_drafting is not None:
                z = logits - logits[tok]
                p_cum *= float(1.0 / np.exp(z).sum())
                # The rule counts target tokens that can be handed over: asked only once the
                # safe text holds one before the held-back last (a draft token alone is often a
                # word not yet safe to hand over: stopping then would have paid for a forward
                # and drafted nothing).
                if len(ids) > 1 and not self.keep_drafting(len(ids) - 1, p_cum):
                    break
            if i + 1 < budget:
                logits = self._feed(tok)
        ids = self._target_ids(text, done)
        if end_id is not None and b"".join(self.target.token_bytes(t) for t in ids) == text:
            ids.append(end_id)
        return Draft(ids[:k] if done else ids[:min(k, len(ids) - 1)])

    def _target_ids(self, text: bytes, whole: bool) -> list[int]:
        """The target's tokens of drafted text [bytes]: up to its last whole UTF-8 character,
        and unless the draft ended there (whole), without its last word and the white space
        before it, which the draft may not have finished ("retur" | "n"), a tokenizer may merge
        with what follows (" " + "a" is one token " a")."""
        end = _complete_utf8(text, len(text))
        try:
            piece = text[:end].decode("utf-8")
        except UnicodeDecodeError as e:  # bytes that are no text: the draft up to them
            piece, whole = text[:e.start].decode("utf-8"), False
        if not whole:
            n = len(piece)
            while n and (piece[n - 1].isalnum() or piece[n - 1] == "_"):
                n -= 1
            while n and piece[n - 1].isspace():
                n -= 1
            piece = piece[:n]
        return self.target.tokenize(piece, add_special=False, parse_special=False) if piece else []

    def _over_target(self, logits: np.ndarray) -> np.ndarray:
        """The draft's logits [Vd] over the target's ids [Vt]: -inf where the target has no
        token of the same text (probability 0 after the sampler's softmax: renormalised over
        the intersection)."""
        out = np.full(self.target.n_vocab, -np.inf, dtype=np.float32)
        out[self._t_idx] = logits[self._d_idx]
        return out

    def _tli(self, context: Sequence[int], logits: np.ndarray, k: int, sampler: Sampler) -> Draft:
        """Draft k target tokens from the draft's distribution over the shared tokens."""
        history = list(context) if sampler.params.has_penalties else []
        drafts: list[int] = []
        rows: list[np.ndarray] = []
        p_cum = 1.0
        for i in range(k):
            lt = sampler.constrain(self._over_target(logits), drafts)
            if not np.isfinite(lt).any():  # a grammar that allows none of the shared tokens here
                break
            if sampler.params.greedy:
                tok = sampler.argmax(lt, history)
                if self.keep_drafting is not None:
                    z = lt - lt[tok]
                    p_cum *= float(1.0 / np.exp(z[np.isfinite(z)]).sum())
            else:
                q = sampler.probs(lt, history)
                tok = sampler.draw(q, len(context) + i)
                rows.append(q)
                p_cum *= float(q.max())
            d = int(self.vmap.t2d[tok])
            drafts.append(tok)
            if sampler.params.has_penalties:
                history.append(tok)
            if tok in self.target.eog_ids:
                break
            if i + 1 < k and self.keep_drafting is not None and not self.keep_drafting(i + 1, p_cum):
                break
            if i + 1 < k:
                logits = self._feed(d)
        return Draft(drafts, np.stack(rows) if rows else None)

    def observe(self, outcome) -> None:
        k, self._last_k = self._last_k, 0
        if k:
            self.accepted[self.ran] += outcome.num_accepted

    def finish(self, committed: Sequence[int]) -> None:
        """End of a generation: keep the draft's cache of the committed text only."""
        dids = self._mirror.update(committed)
        keep = common_prefix_len(self._cached, dids)
        self.backend.rollback(keep, seq=self.seq)
        del self._cached[keep:]

    def explain(self) -> str:
        """Which method ran, its acceptance, and the vocabularies' overlap."""
        m = self.ran
        return (f"{self.label}: {self.accepted[m]} of {self.drafted[m]} drafted tokens accepted; "
                f"{self.vmap.overlap_note()}")
