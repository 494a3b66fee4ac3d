"""Structured output: a grammar that constrains the target's distribution, under speculation.

A :class:`Grammar` (JSON schema, any JSON object, regular expression, or Lark grammar) is
compiled by llguidance (the matcher llama.cpp and vLLM use) over the loaded model's own
vocabulary. A :class:`GrammarConstraint` follows one generation:

- its state is the committed tokens: :meth:`GrammarConstraint.commit` advances it by the
  tokens a step commits, never by drafts;
- :meth:`GrammarConstraint.mask` gives the allowed tokens after the committed prefix plus
  some pending draft tokens, consuming them on a scratch path that is rolled back (the
  matcher's ``rollback``), so that the target's distribution at verified position i is
  masked by the state after the committed prefix and drafts[:i], and a draft model's at its
  draft position i likewise;
- :meth:`GrammarConstraint.valid_prefix` says how many drafted tokens the grammar allows:
  a draft is cut before verification at its first token the grammar rejects, since the
  masked target could never accept it. For drafts drawn from a masked distribution (a
  draft model) nothing is ever cut; for deterministic drafts (lookups, one-hot draft
  probabilities) the cut equals rejecting the token and resampling from the masked target
  (the residual of a one-hot draft at a token of zero target mass is the target's own
  distribution), so output is distributed exactly as plain constrained decoding.
- end of generation is allowed only where the grammar is complete: llguidance's mask holds
  the end-of-generation tokens only in accepting states.

A *lazy* grammar (``Grammar.trigger``, a regular expression; llama.cpp's lazy grammars, PR
#9639) allows any text that does not open the trigger, and constrains the output once it
does (a tool call: only the tools' names and their arguments' schemas are left). Once the
text can no longer open it, the grammar allows any text from there on, so the constraint
retires (no mask, no cost); it does so at the same position for drafts and for committed
tokens, so speculation keeps the output of plain decoding under the same rule. A lazy grammar
that llguidance cannot compile constrains nothing (the calls are then read from free text).

Dimension letters: V = vocabulary size, K = drafted tokens.
"""

from __future__ import annotations

import json
import threading
import weakref
from collections import OrderedDict
from dataclasses import dataclass
from typing import TYPE_CHECKING, Sequence

import numpy as np

from .errors import SpecDecodeError

if TYPE_CHECKING:
    from .backends.base import Backend

GRAMMAR_KINDS = ("json_object", "json_schema", "regex", "lark")


def _llguidance():
    try:
        import llguidance
    except ImportError:  # a dependency; only a broken install lacks it
        raise SpecDecodeError("structured output needs the llguidance package: pip install llguidance") from None
    return llguidance


@dataclass(frozen=True)
class Grammar:
    """What the output must match. kind: one of GRAMMAR_KINDS; source: the JSON schema (as a
    JSON string), the regular expression or the Lark grammar ("" for json_object).
    name: where it came from, for error messages (a file name, "response_format").
    trigger: for a lazy grammar (see the module docstring), the regular expression of the text
    that opens what it constrains; the grammar itself must allow any text that does not."""

    kind: str
    source: str = ""
    name: str = "grammar"
    trigger: str = ""  # a lazy grammar's opening (a regular expression); "" for a grammar from the first token

    @classmethod
    def json_schema(cls, schema: dict | str, name: str = "json_schema") -> "Grammar":
        """A JSON schema (dict or JSON text). Raises SpecDecodeError for text that is not JSON."""
        if isinstance(schema, str):
            try:
                schema = json.loads(schema)
            except json.JSONDecodeError as e:
                raise SpecDecodeError(f"{name}: the JSON schema is not valid JSON ({e.msg} at line {e.lineno})",
                                      param=name) from None
            except RecursionError:
                raise SpecDecodeError(f"{name}: the JSON schema's arrays and objects nest too deeply to read",
                                      param=name) from None
        if not isinstance(schema, (dict, bool)):
            raise SpecDecodeError(f"{name}: a JSON schema must be an object, got {type(schema).__name__}", param=name)
        return cls("json_schema", json.dumps(schema), name)

    def llguidance_grammar(self) -> str:
        """The grammar in llguidance's own form."""
        m = _llguidance().LLMatcher
        if self.kind == "json_object":
            return m.grammar_from_json_schema({"type": "object"})
        if self.kind == "json_schema":
            return m.grammar_from_json_schema(self.source)
        if self.kind == "regex":
            return m.grammar_from_regex(self.source)
        if self.kind == "lark":
            return m.grammar_from_lark(self.source)
        raise SpecDecodeError(f"grammar kind {self.kind!r} is not one of {', '.join(GRAMMAR_KINDS)}", param=self.name)


# One llguidance tokenizer per loaded model: building it reads the whole vocabulary.
_TOKENIZERS: "weakref.WeakKeyDictionary[Backend, object]" = weakref.WeakKeyDictionary()


def lltokenizer(backend: "Backend"):
    """llguidance's tokenizer over a backend's vocabulary: each id's bytes (control tokens
    marked with llguidance's 0xFF prefix, so that text can never produce them), the
    end-of-generation ids, and the backend's own tokenizer for text. Cached per backend."""
    cached = _TOKENIZERS.get(backend)
    if cached is not None:
        return cached
    llg = _llguidance()
    tokens = []
    special = []
    for i in range(backend.n_vocab):
        piece = backend.token_bytes(i)
        if not piece:  # a control token: no text of its own
            special.append(i)
            piece = b"\xff" + backend.token_text(i)
        tokens.append(piece)
    eog = sorted(backend.eog_ids)

    class _Vocab:
        eos_token_id = eog[0] if eog else None
        bos_token_id = None
        special_token_ids = special

        def __call__(self, text: str) -> list[int]:
            return backend.tokenize(text, add_special=False, parse_special=False)

    _Vocab.tokens = tokens
    tok = llg.LLTokenizer(llg.TokenizerWrapper(_Vocab()), n_vocab=backend.n_vocab, eos_token=eog or None)
    _TOKENIZERS[backend] = tok
    return tok


# Compiled grammars, by tokenizer and grammar: a server sees the same schema again and again,
# and copying a compiled matcher costs far less than compiling it.
_COMPILED: "OrderedDict[tuple[int, Grammar], object]" = OrderedDict()
_COMPILED_MAX = 64
# A server compiles a request's grammar on its preparation thread while the worker copies
# matchers from the cache (grammar.check_grammar there, GrammarConstraint here).
_COMPILED_LOCK = threading.Lock()


def _compiled(grammar: Grammar, tok) -> object:
    """A fresh llguidance matcher of the grammar (kept to be copied); raises SpecDecodeError
    naming the grammar with llguidance's message when it does not compile."""
    key = (id(tok), grammar)
    with _COMPILED_LOCK:
        matcher = _COMPILED.get(key)
        if matcher is not None:
            _COMPILED.move_to_end(key)
            return matcher
    llg = _llguidance()
    try:
        matcher = llg.LLMatcher(tok, grammar.llguidance_grammar(), log_level=0)
        error = matcher.get_error() if matcher.is_error() else ""
    except ValueError as e:
        error = str(e)
    if error:
        one_line = " ".join(error.split())  # llguidance points at the place over several lines
        raise SpecDecodeError(f"{grammar.name}: the grammar cannot be compiled: {one_line}", param=grammar.name)
    with _COMPILED_LOCK:
        _COMPILED[key] = matcher
        _COMPILED.move_to_end(key)
        if len(_COMPILED) > _COMPILED_MAX:
            _COMPILED.popitem(last=False)
    return matcher


def check_grammar(grammar: Grammar, backend: "Backend") -> None:
    """Compile the grammar over the backend's vocabulary; raise SpecDecodeError naming it
    (``param`` = grammar.name) with llguidance's message when it cannot be compiled."""
    GrammarConstraint(grammar, backend)


class GrammarConstraint:
    """The grammar's state over one generation (see the module docstring).

    grammar: what to match. backend: the target (its vocabulary and tokenizer).
    Raises SpecDecodeError when the grammar does not compile.
    """

    def __init__(self, grammar: Grammar, backend: "Backend") -> None:
        self.n_vocab = backend.n_vocab
        self.eog_ids = backend.eog_ids
        self._pending: list[int] = []  # tokens consumed past the committed prefix (scratch)
        self._gate = None  # a lazy grammar's trigger, followed over the committed text
        self.retired = False  # a lazy grammar whose trigger the text can no longer open: no constraint
        try:
            self.matcher = _compiled(grammar, lltokenizer(backend)).deep_copy()
        except SpecDecodeError:
            if not grammar.trigger:
                raise
            self.retired = True
            return
        if grammar.trigger:
            gate = Grammar("regex", f"{grammar.trigger}(?s:.*)", name=grammar.name)
            self._gate = _compiled(gate, lltokenizer(backend)).deep_copy()

    def _leaves_trigger(self, tokens: Sequence[int]) -> int | None:
        """The index of the first of tokens (after the committed ones) with which the text can
        no longer open a lazy grammar's trigger; None when it still can (or no trigger)."""
        if self._gate is None:
            return None
        n = int(self._gate.validate_tokens([int(t) for t in tokens]))
        return n if n < len(tokens) else None

    def _to(self, pending: Sequence[int]) -> bool:
        """Move the scratch path to committed + pending (rolling back what differs); False
        when the grammar rejects one of them."""
        keep = 0
        while keep < min(len(self._pending), len(pending)) and self._pending[keep] == pending[keep]:
            keep += 1
        if keep < len(self._pending):
            self.matcher.rollback(len(self._pending) - keep)
            del self._pending[keep:]
        for t in pending[keep:]:
            if not self.matcher.validate_tokens([int(t)]) or not self.matcher.consume_token(int(t)):
                return False
            self._pending.append(int(t))
        return True

    def mask(self, pending: Sequence[int] = ()) -> np.ndarray:
        """[V] bool: the tokens allowed after the committed prefix and ``pending`` (drafts).

        After a drafted end-of-generation token every token is allowed: nothing after it is
        ever committed, and a row of all -inf would have no distribution to sample from.
        Raises SpecDecodeError if ``pending`` leaves the grammar (callers pass only
        drafts that :meth:`valid_prefix` allowed)."""
        if any(int(t) in self.eog_ids for t in pending) or self.retired or self._leaves_trigger(pending) is not None:
            return np.ones(self.n_vocab, dtype=bool)
        if not self._to(pending):
            raise SpecDecodeError("internal: a pending token leaves the grammar")
        bits = np.frombuffer(self.matcher.compute_bitmask(), dtype=np.uint8)
        return np.unpackbits(bits, bitorder="little")[: self.n_vocab].astype(bool)

    def valid_prefix(self, draft_ids: Sequence[int]) -> int:
        """How many leading tokens of draft_ids [K] the grammar allows after the committed prefix."""
        if self.retired:
            return len(draft_ids)
        self._to(())
        m = self._leaves_trigger(draft_ids)
        upto = draft_ids if m is None else draft_ids[:m + 1]
        n = int(self.matcher.validate_tokens([int(t) for t in upto]))
        return len(draft_ids) if m is not None and n == m + 1 else n

    def commit(self, tokens: Sequence[int]) -> None:
        """Advance the state by committed tokens (never by rejected drafts)."""
        if self.retired:
            return
        self._to(())
        m = self._leaves_trigger(tokens)
        for t in tokens if m is None else tokens[:m + 1]:
            if not self.matcher.consume_token(int(t)):
                raise SpecDecodeError(f"internal: committed token {t} leaves the grammar: {self.matcher.get_error()}")
        if m is not None:
            self.retired = True
        elif self._gate is not None:
            for t in tokens:
                self._gate.consume_token(int(t))

    @property
    def accepting(self) -> bool:
        """The committed text is complete under the grammar (end of generation allowed)."""
        if self.retired:
            return True
        self._to(())
        return bool(self.matcher.is_accepting())


def apply_mask(logits: np.ndarray, allowed: np.ndarray) -> np.ndarray:
    """logits [V] with every disallowed token at -inf (a new array). allowed: [V'] bool,
    V' <= V (ids past V' are disallowed)."""
    out = np.full(logits.shape, -np.inf, dtype=np.float32)
    n = min(len(allowed), logits.shape[-1])
    out[:n] = np.where(allowed[:n], logits[:n], -np.inf)
    return out
