"""What a GGUF's vocabulary says beyond its tokens, read through llama.cpp once at load: the
end-of-generation ids, the fill-in-the-middle tokens (:mod:`.fim`) and the control tokens."""

from __future__ import annotations

from typing import Any

from ..fim import FimTokens


def read_fim_tokens(lib: Any, vocab: Any, n_vocab: int) -> FimTokens | None:
    """The FIM tokens llama.cpp found in the GGUF (``llama_vocab_fim_pre`` ...), None unless it
    has a prefix, a suffix and a middle token."""
    def find(role: str) -> int | None:
        t = int(getattr(lib, f"llama_vocab_fim_{role}")(vocab))
        return t if 0 <= t < n_vocab else None
    return FimTokens.from_lookup(find)


def read_eog(lib: Any, vocab: Any, n_vocab: int, fim: FimTokens | None) -> frozenset[int]:
    """The end-of-generation ids: llama.cpp's (``llama_vocab_is_eog``), and the FIM tokens that
    end a middle (llama.cpp counts them already; kept explicit, as the torch backend adds them)."""
    eog = {t for t in range(n_vocab) if lib.llama_vocab_is_eog(vocab, t)}
    return frozenset(eog | (fim.end_ids if fim is not None else set()))


def control_token_ids(lib: Any, vocab: Any, n_vocab: int) -> list[int]:
    """The ids llama.cpp reads as one token only with parse_special (control and unknown
    tokens; user-defined ones it reads as tokens either way)."""
    parsed_only_special = lib.LLAMA_TOKEN_ATTR_CONTROL | lib.LLAMA_TOKEN_ATTR_UNKNOWN
    return [t for t in range(n_vocab) if lib.llama_vocab_get_attr(vocab, t) & parsed_only_special]
