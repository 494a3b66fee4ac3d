"""The text side of a GGUF model on llama.cpp: tokenizing, token pieces, control tokens and the
chat template, as a part of :class:`.backend.LlamaCppBackend` (which holds ``_lib``, ``_vocab``,
``_model``, ``_piece_cache`` and ``_special_texts``)."""

from __future__ import annotations

import ctypes
from typing import Sequence

from ...errors import SpecDecodeError
from ...limits import check_text
from .vocab import control_token_ids


class LlamaText:
    """Tokenize and detokenize with the GGUF's own vocabulary; render its chat template."""

    @property
    def bos_id(self) -> int | None:
        t = int(self._lib.llama_vocab_bos(self._vocab))
        return t if t >= 0 else None

    @property
    def eos_id(self) -> int | None:
        """The vocabulary's end-of-sequence token (llama_vocab_eos), None where it has none."""
        eos = int(self._lib.llama_vocab_eos(self._vocab))
        return eos if eos >= 0 else None

    def tokenize(self, text: str, add_special: bool = True, parse_special: bool = False) -> list[int]:
        self._require_open()
        data = check_text(text, "the text to tokenize").encode("utf-8")
        n_max = len(data) + 8
        buf = (self._lib.llama_token * n_max)()
        n = self._lib.llama_tokenize(self._vocab, data, len(data), buf, n_max, add_special, parse_special)
        if n < 0:
            n_max = -n
            buf = (self._lib.llama_token * n_max)()
            n = self._lib.llama_tokenize(self._vocab, data, len(data), buf, n_max, add_special, parse_special)
        return list(buf[:n])

    @property
    def special_texts(self) -> frozenset[str]:
        """The texts of the vocabulary's control tokens (llama.cpp reads them as tokens only
        with parse_special; user-defined tokens it reads as tokens either way), read once."""
        if self._special_texts is None:
            self._require_open()
            texts = (self.token_text(t).decode("utf-8", "replace")
                     for t in control_token_ids(self._lib, self._vocab, self.n_vocab))
            self._special_texts = frozenset(t for t in texts if t)
        return self._special_texts

    def _piece(self, token_id: int, special: bool) -> bytes:
        buf = ctypes.create_string_buffer(64)
        n = self._lib.llama_token_to_piece(self._vocab, token_id, buf, 64, 0, special)
        if n < 0:
            buf = ctypes.create_string_buffer(-n)
            n = self._lib.llama_token_to_piece(self._vocab, token_id, buf, -n, 0, special)
        return buf.raw[:n]

    def token_bytes(self, token_id: int) -> bytes:
        piece = self._piece_cache.get(token_id)
        if piece is None:
            piece = self._piece(token_id, special=False)
            self._piece_cache[token_id] = piece
        return piece

    def token_text(self, token_id: int) -> bytes:
        return self._lib.llama_vocab_get_text(self._vocab, token_id) or b""

    @property
    def chat_template(self) -> str | None:
        t = self._lib.llama_model_chat_template(self._model, None)
        return t.decode("utf-8") if t else None

    def apply_chat_template(self, messages: Sequence[dict], tools: Sequence[dict] | None = None) -> str:
        """Render messages (and tools, when given) with the GGUF's own Jinja chat template, as
        llama-cpp-python's Jinja2ChatFormatter does (a sandboxed environment; add_generation_prompt,
        bos_token, eos_token, tools). Raises SpecDecodeError when the model has no chat
        template or the template rejects the messages (its raise_exception, or a field it lacks)."""
        import jinja2
        from llama_cpp.llama_chat_format import Jinja2ChatFormatter

        if not self.chat_template:
            raise SpecDecodeError(f"model {self.name} has no chat template; use a plain prompt instead")
        if any(not isinstance(m, dict) or "role" not in m or "content" not in m for m in messages):
            raise SpecDecodeError(f"chat messages need 'role' and 'content', got {list(messages)!r:.200}")
        bos, eos = self.bos_id, self.eos_id
        fmt = Jinja2ChatFormatter(template=self.chat_template,
                                  eos_token=self.token_text(eos).decode("utf-8", "replace") if eos is not None else "",
                                  bos_token=self.token_text(bos).decode("utf-8", "replace") if bos is not None else "")
        try:
            return fmt(messages=list(messages), tools=list(tools) if tools else None).prompt
        except (jinja2.TemplateError, ValueError, TypeError) as e:
            raise SpecDecodeError(f"the chat template of {self.name} rejected the messages: {e}") from None
