"""ResponsesStore: stored Responses API responses, for GET /v1/responses/{id} and for
continuing a conversation with previous_response_id.

In memory and bounded: each entry lives ttl_s seconds, and once the entries' total size passes
max_bytes the oldest go first. Plans look entries up from worker threads while the event loop
stores them, hence the lock.
"""

from __future__ import annotations

import json
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class StoredResponse:
    response: dict[str, Any]  # the response object, as GET returns it
    conversation: list[dict[str, Any]]  # chat-template messages through this response's output
    size: int  # bytes, as counted against max_bytes
    expires_at: float


class ResponsesStore:
    def __init__(self, ttl_s: float, max_bytes: int, clock: Callable[[], float] = time.monotonic):
        self.ttl_s = ttl_s
        self.max_bytes = max_bytes
        self._clock = clock
        self._entries: OrderedDict[str, StoredResponse] = OrderedDict()  # oldest first
        self._bytes = 0
        self._lock = threading.Lock()

    @property
    def num_bytes(self) -> int:
        return self._bytes

    def put(self, response_id: str, response: dict[str, Any], conversation: list[dict[str, Any]]) -> bool:
        """Store a response; False when it alone is larger than max_bytes (then it is not kept)."""
        size = len(json.dumps([response, conversation], ensure_ascii=False).encode())
        if size > self.max_bytes:
            return False
        with self._lock:
            self._drop(response_id)
            self._evict(self._clock())
            while self._bytes + size > self.max_bytes:
                self._drop(next(iter(self._entries)))
            self._entries[response_id] = StoredResponse(response, conversation, size, self._clock() + self.ttl_s)
            self._bytes += size
        return True

    def get(self, response_id: str) -> StoredResponse | None:
        """The entry, or None when it was never stored, was deleted or has expired."""
        with self._lock:
            self._evict(self._clock())
            return self._entries.get(response_id)

    def delete(self, response_id: str) -> bool:
        with self._lock:
            self._evict(self._clock())
            return self._drop(response_id)

    def _evict(self, now: float) -> None:
        """Drop the expired entries (every entry lives ttl_s, so they are the oldest)."""
        while self._entries and next(iter(self._entries.values())).expires_at <= now:
            self._drop(next(iter(self._entries)))

    def _drop(self, response_id: str) -> bool:
        entry = self._entries.pop(response_id, None)
        if entry is None:
            return False
        self._bytes -= entry.size
        return True
