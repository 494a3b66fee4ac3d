"""A scripted llama.vim session (issue 60): the ``/infill`` bodies llama.vim sends while a line is
typed in the middle of a file, with its ring of extra-context chunks, for
``benchmarks/llama_vim_session.py`` (real servers side by side) and the tests (a fake backend
counting what is evaluated and shifted).

llama.vim (ggml-org/llama.vim, ``llama#fim``) sends the ``n_prefix`` lines above the cursor as
``input_prefix``, the current line up to the cursor as ``prompt``, the rest of the line and the
``n_suffix`` lines below as ``input_suffix``, and its ring's chunks (``ring_chunk_size`` lines of
other buffers) as ``input_extra``; in normal mode, ``s:ring_update`` sends the ring alone
(``n_predict`` 0) when a chunk was added, the oldest dropped once ``ring_n_chunks`` are held.
"""

from __future__ import annotations

N_PREFIX, N_SUFFIX = 256, 64  # llama.vim's defaults (lines)


def vim_request(lines: list[str], line: int, typed: str, ring: list[dict], n_predict: int = 8) -> dict:
    """The body of a keystroke with the cursor at the end of ``typed`` on ``line`` (0-based;
    the line's own text after the cursor is ``lines[line][len(typed):]``)."""
    prefix = "\n".join(lines[max(0, line - N_PREFIX):line]) + "\n"
    suffix = lines[line][len(typed):] + "\n" + "\n".join(lines[line + 1:line + 1 + N_SUFFIX]) + "\n"
    return {"input_prefix": prefix, "input_suffix": suffix, "prompt": typed, "input_extra": ring,
            "n_predict": n_predict, "top_k": 40, "top_p": 0.9, "samplers": ["top_k", "top_p", "infill"],
            "stream": False, "cache_prompt": True, "t_max_prompt_ms": 500, "t_max_predict_ms": 1000,
            "temperature": 0}


def ring_update(ring: list[dict]) -> dict:
    """The body ``s:ring_update`` sends to cache the ring's chunks."""
    return {"input_prefix": "", "input_suffix": "", "prompt": "", "input_extra": ring, "n_predict": 0,
            "temperature": 0.0, "samplers": ["temperature"], "stream": False, "cache_prompt": True,
            "t_max_prompt_ms": 1, "t_max_predict_ms": 1, "response_fields": [""]}


def chunks_of(text: str, name: str, size: int = 64) -> list[dict]:
    """A file cut into ring chunks of ``size`` lines (llama.vim's ring_chunk_size)."""
    lines = text.splitlines()
    return [{"filename": name, "text": "\n".join(lines[i:i + size]) + "\n"} for i in range(0, len(lines), size)]


def session(lines: list[str], cursor: int, typed: str, ring: list[dict], new_chunk: dict,
            keys: int = 10, ring_after: int = 7) -> list[tuple[str, dict]]:
    """The session: a first request on ``cursor``'s line (cleared), ``keys`` keystrokes typing
    ``typed``, and after ``ring_after`` of them the ring dropping its oldest chunk for
    ``new_chunk`` (llama.vim's ring update); then Enter (the cursor on the next line).
    Returns (what, body) pairs in order."""
    lines = list(lines)
    lines[cursor] = ""
    out = [("first", vim_request(lines, cursor, "", ring))]
    for k in range(1, keys + 1):
        if k == ring_after + 1:
            ring = ring[1:] + [new_chunk]
            out.append(("ring update", ring_update(ring)))
        out.append((f"key {k}", vim_request(lines, cursor, typed[:k], ring)))
    lines[cursor] = typed[:keys]
    out.append(("next line", vim_request(lines, cursor + 1, "", ring)))
    return out
