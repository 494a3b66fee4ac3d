"""Fill-in-the-middle prompts from a model's own tokens: the code between a prefix and a suffix,
with other files of the repository as context, as editors ask for it (llama.vim, llama.vscode,
Continue, Zed).

A code model trained for it has FIM tokens (Qwen2.5-Coder: ``<|fim_prefix|>``, ``<|fim_suffix|>``,
``<|fim_middle|>``; ``<|fim_pad|>``, and ``<|repo_name|>`` / ``<|file_sep|>`` for repository
context). llama.cpp reads them from the GGUF (``llama_vocab_fim_pre`` ...); a transformers model
declares them as added tokens whose texts are the same ones llama.cpp matches
(:data:`FIM_TOKEN_TEXTS`). The prompt is llama.cpp's server layout (``format_infill`` in
tools/server/utils.hpp, ggml-org/llama.cpp), so a model answers here as it does there:

    [fim_rep "myproject\\n"] ([fim_sep filename "\\n"] text)* [fim_sep "filename\\n"]
    [BOS where the model adds one] fim_pre prefix prompt fim_suf suffix fim_mid

where ``prompt`` is /infill's own field (llama.vim sends the current line up to the cursor
there), tokenized on its own and put right after the prefix's tokens, as llama.cpp does.

Without fim_sep, each extra file follows a "--- snippet ---" line instead. The middle
ends at an end-of-generation token; fim_pad, fim_rep and fim_sep count as such on both backends
(llama.cpp marks them so), as the model's way of saying the middle has met the suffix.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Protocol

from ..errors import SpecDecodeError

# The texts llama.cpp recognises for each FIM token (src/llama-vocab.cpp, "find FIM tokens"):
# Qwen2.5-Coder, DeepSeek-Coder, CodeLlama, StarCoder, CodeGemma, GLM and others.
FIM_TOKEN_TEXTS: dict[str, tuple[str, ...]] = {
    "pre": ("<|fim_prefix|>", "<fim-prefix>", "<｜fim▁begin｜>", "<PRE>", "▁<PRE>", "<|code_prefix|>",
            "<fim_prefix>", "<|fim_begin|>"),
    "suf": ("<|fim_suffix|>", "<fim-suffix>", "<｜fim▁hole｜>", "<SUF>", "▁<SUF>", "<|code_suffix|>",
            "<fim_suffix>", "<|fim_hole|>"),
    "mid": ("<|fim_middle|>", "<fim-middle>", "<｜fim▁end｜>", "<MID>", "▁<MID>", "<|code_middle|>",
            "<fim_middle>", "<|fim_end|>"),
    "pad": ("<|fim_pad|>", "<fim-pad>", "<PAD>", "<fim_pad>"),
    "rep": ("<|fim_repo|>", "<|repo_name|>", "<fim-repo>", "<REPO>", "<reponame>"),
    "sep": ("<|file_sep|>", "<fim-sep>", "<SEP>", "<filename>"),
}
# What llama.cpp's server writes where it has no file or repository name.
REPO_NAME = "myproject"
CURRENT_FILE = "filename"
DEFAULT_EXTRA_FILE = "tmp"
SNIPPET_SEPARATOR = "\n\n--- snippet ---\n\n"
# llama-server's default logical batch (``-b``), which its /infill budgets read.
LLAMA_SERVER_N_BATCH = 2048


@dataclass(frozen=True)
class FimTokens:
    """A model's fill-in-the-middle token ids: pre, suf, mid always; pad, rep (repository name),
    sep (file separator) where it has them (None otherwise)."""

    pre: int
    suf: int
    mid: int
    pad: int | None = None
    rep: int | None = None
    sep: int | None = None

    @property
    def end_ids(self) -> frozenset[int]:
        """The FIM tokens that end a middle (pad, rep, sep): end-of-generation ids."""
        return frozenset(t for t in (self.pad, self.rep, self.sep) if t is not None)

    @classmethod
    def from_lookup(cls, find: Callable[[str], int | None]) -> "FimTokens | None":
        """The tokens found by ``find(role)`` ("pre", "suf", ... to an id or None); None
        unless pre, suf and mid are all found."""
        found = {role: find(role) for role in FIM_TOKEN_TEXTS}
        if any(found[role] is None for role in ("pre", "suf", "mid")):
            return None
        return cls(**found)

    @classmethod
    def from_texts(cls, token_id: Callable[[str], int | None]) -> "FimTokens | None":
        """The tokens whose texts llama.cpp matches (:data:`FIM_TOKEN_TEXTS`), found by
        ``token_id(text)`` (the id whose entry is exactly that text, or None)."""
        def find(role: str) -> int | None:
            return next((t for text in FIM_TOKEN_TEXTS[role] if (t := token_id(text)) is not None), None)
        return cls.from_lookup(find)


class Tokenizing(Protocol):
    """What a FIM prompt needs of a backend (:class:`.base.Backend` has it)."""

    name: str
    fim_tokens: FimTokens | None

    def tokenize(self, text: str, add_special: bool = True, parse_special: bool = False) -> list[int]: ...


@dataclass(frozen=True)
class FimInput:
    """A fill-in-the-middle request: the text before the cursor (prefix), after it (suffix), and
    other files as context (extra: (filename, text) pairs, in the order given); fit: trim them to
    the context rather than refuse a prompt too long for it (llama.cpp's /infill). prompt:
    /infill's ``prompt`` field, text typed after the prefix (llama.vim: the current line up to the
    cursor), tokenized on its own after the prefix's tokens as llama.cpp does ("" for none)."""

    prefix: str
    suffix: str = ""
    extra: tuple[tuple[str, str], ...] = ()
    fit: bool = False  # trimmed to fit the context as llama.cpp's /infill trims it (:class:`FimBudget`)
    prompt: str = ""


@dataclass(frozen=True)
class FimBudget:
    """llama.cpp's /infill budgets (``format_prompt_infill`` in tools/server/server-common.cpp),
    which trim a FIM prompt to fit rather than refuse it: the prefix keeps its last
    3 (n_batch / 4) tokens, the suffix its first n_batch / 4 - 2 - (the prompt field's tokens),
    the repository context its last n_ctx - n_batch - 2 n_predict (all in tokens; the oldest files
    go first). llama-server passes its own settings there, not the request's: ``-b`` (2048) and
    ``-n`` (-1), so the same request gives the same tokens on both servers.

    reserve: tokens left free for the middle after that: where llama.cpp's budget still leaves
    the prompt longer than n_ctx - reserve (a context under 2 n_batch), the repository context's
    oldest tokens go first, then the prefix's (a prompt llama-server would not take whole)."""

    n_batch: int
    n_ctx: int
    n_predict: int
    reserve: int = 1

    @classmethod
    def for_context(cls, n_ctx: int, n_predict: int) -> "FimBudget":
        """llama-server's defaults (n_batch = LLAMA_SERVER_N_BATCH, n_predict = -1) in a context
        of n_ctx tokens; the request's n_predict (tokens, <= 0: none) is kept free by ``reserve``."""
        return cls(LLAMA_SERVER_N_BATCH, n_ctx, -1, max(1, min(n_predict, n_ctx // 4)))


def check_extra(extra, param: str = "extra") -> tuple[tuple[str, str], ...]:
    """extra as (filename, text) string pairs; also takes llama.cpp's ``[{"filename", "text"}]``.
    Raises SpecDecodeError naming ``param[i]`` for anything else."""
    if extra is None:
        return ()
    if not isinstance(extra, (list, tuple)):
        raise SpecDecodeError(f"{param} must be a list of (filename, text) pairs, got {type(extra).__name__}",
                              param=param)
    pairs = []
    for i, item in enumerate(extra):
        if isinstance(item, dict):
            item = (item.get("filename", DEFAULT_EXTRA_FILE), item.get("text"))
        if not (isinstance(item, (list, tuple)) and len(item) == 2 and all(isinstance(s, str) for s in item)):
            raise SpecDecodeError(f"{param}[{i}] must be a (filename, text) pair of strings, got {item!r:.80}",
                                  param=f"{param}[{i}]")
        pairs.append((item[0], item[1]))
    return tuple(pairs)


def require_fim_tokens(backend: Tokenizing, param: str = "suffix") -> FimTokens:
    """The backend's FIM tokens; SpecDecodeError (param) naming the model where it has none."""
    tokens = backend.fim_tokens
    if tokens is None:
        raise SpecDecodeError(f"the model {backend.name} has no fill-in-the-middle tokens (a prefix, a suffix and a "
                              "middle token, such as Qwen2.5-Coder's <|fim_prefix|>, <|fim_suffix|>, <|fim_middle|>): "
                              f"it cannot complete between a prefix and a suffix; leave {param} out or serve a code "
                              "model trained for it", param=param)
    return tokens


def fim_prompt_ids(backend: Tokenizing, fim: FimInput, param: str = "suffix",
                   budget: FimBudget | None = None) -> list[int]:
    """The FIM prompt's token ids [L] in llama.cpp's server layout (module docstring): every text
    tokenized as text (no special parsing, no BOS), the FIM tokens as ids; with a budget, trimmed
    as llama.cpp's /infill trims it (:class:`FimBudget`). Raises SpecDecodeError (param) where the
    model has no FIM tokens."""
    t = require_fim_tokens(backend, param)

    def text(s: str) -> list[int]:
        return backend.tokenize(s, add_special=False, parse_special=False) if s else []

    ids: list[int] = []
    if t.rep is not None:
        ids += [t.rep, *text(REPO_NAME + "\n")]
    for filename, body in fim.extra:
        ids += [t.sep, *text(filename + "\n")] if t.sep is not None else text(SNIPPET_SEPARATOR)
        ids += text(body)
    if t.sep is not None:
        ids += [t.sep, *text(CURRENT_FILE + "\n")]
    bos = backend.tokenize("", add_special=True, parse_special=False)  # [BOS] where the model adds one
    prefix, typed, suffix = text(fim.prefix), text(fim.prompt), text(fim.suffix)
    if budget is not None:
        prefix = prefix[max(0, len(prefix) - 3 * (budget.n_batch // 4)):]
        suffix = suffix[:max(0, budget.n_batch // 4 - (2 + len(typed)))]
        ids = ids[max(0, len(ids) - max(0, budget.n_ctx - budget.n_batch - 2 * budget.n_predict)):]
        over = len(ids) + len(bos) + len(prefix) + len(typed) + len(suffix) + 3 + budget.reserve - budget.n_ctx
        if over > 0:  # a context under 2 n_batch: the oldest repository context first, then the prefix's start
            cut = min(over, len(ids))
            ids, prefix = ids[cut:], prefix[over - cut:]
    return ids + bos + [t.pre, *prefix, *typed, t.suf, *suffix, t.mid]
