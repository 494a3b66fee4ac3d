"""The store behind the Responses API's ``previous_response_id`` and ``GET``/``DELETE
/v1/responses/{id}`` (:mod:`.responses_api`): responses kept in memory as their JSON, bounded
in count and bytes, the oldest dropped first.

Pure: no FastAPI, no model.
"""

from __future__ import annotations

import json
import threading
from collections import OrderedDict

# What the store keeps: this many responses at most, and this many bytes of their JSON (the
# response objects with every field they echo, and their conversations), the oldest forgotten first.
STORE_MAX_RESPONSES = 1024
STORE_MAX_BYTES = 64 * 2**20


class ResponseStore:
    """Stored responses (``store``, the default, as OpenAI's): the response object and the
    conversation a ``previous_response_id`` continues, kept in memory as their JSON text (so
    that what is counted is what is held: every echoed field, ``text``'s schema, ``tools``,
    ``instructions`` and ``metadata`` included), at most max_responses of them and max_bytes
    bytes, ENTRY_BYTES counted per response besides its JSON, the oldest dropped first. A
    response larger than max_bytes alone is not kept (:meth:`put` says so) and drops none.
    Thread-safe."""

    ENTRY_BYTES = 512  # what one entry holds besides its JSON: its id, the dict's slot, the objects

    def __init__(self, max_responses: int = STORE_MAX_RESPONSES, max_bytes: int = STORE_MAX_BYTES) -> None:
        self.max_responses = max_responses
        self.max_bytes = max_bytes
        self._items: OrderedDict[str, tuple[bytes, bytes]] = OrderedDict()
        self._bytes = 0
        self._lock = threading.Lock()

    @property
    def held_bytes(self) -> int:
        """The bytes the store counts now: its responses' JSON and ENTRY_BYTES each."""
        with self._lock:
            return self._bytes

    @classmethod
    def _size(cls, item: tuple[bytes, bytes]) -> int:
        return len(item[0]) + len(item[1]) + cls.ENTRY_BYTES

    def put(self, response: dict, history: list[dict]) -> bool:
        """Keep a response object (by its ``id``) and the conversation after it, dropping the
        oldest until both bounds hold. Returns False, keeping nothing and dropping nothing,
        when this one response is larger than max_bytes alone."""
        # ASCII JSON: a lone surrogate a client sent cannot fail the encoding, and every
        # byte it takes is counted (an escaped character is counted as its escape).
        item = (json.dumps(response, separators=(",", ":")).encode(),
                json.dumps(history, separators=(",", ":")).encode())
        size = self._size(item)
        if size > self.max_bytes:
            return False
        with self._lock:
            old = self._items.pop(response["id"], None)
            self._bytes += size - (self._size(old) if old is not None else 0)
            self._items[response["id"]] = item
            while len(self._items) > self.max_responses or self._bytes > self.max_bytes:
                _, dropped = self._items.popitem(last=False)
                self._bytes -= self._size(dropped)
        return True

    def response_json(self, response_id: str) -> bytes | None:
        """The stored response object as JSON (UTF-8, ASCII only), None when it is not stored."""
        with self._lock:
            item = self._items.get(response_id)
        return None if item is None else item[0]

    def history(self, response_id: str) -> list[dict] | None:
        """The conversation a follow-up of the response continues (fresh objects), None when
        it is not stored."""
        with self._lock:
            item = self._items.get(response_id)
        return None if item is None else json.loads(item[1])

    def delete(self, response_id: str) -> bool:
        with self._lock:
            item = self._items.pop(response_id, None)
            if item is not None:
                self._bytes -= self._size(item)
            return item is not None
