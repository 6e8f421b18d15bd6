"""Detokenizer: token ids -> text, incrementally, without splitting a UTF-8 character."""

from __future__ import annotations

import codecs
from collections.abc import Callable, Sequence


class Detokenizer:
    """Token ids -> text, incrementally, on bytes.

    Byte-level BPE and byte-fallback vocabularies split multi-byte characters across
    tokens, so decoding token by token would emit U+FFFD halves. This decodes the byte
    stream instead: push() returns only complete characters and holds an incomplete
    UTF-8 tail until the next token completes it. The concatenated output equals
    b"".join(bytes of every kept token).decode("utf-8", errors="replace").
    """

    def __init__(self, token_bytes: Callable[[int], bytes] | Sequence[bytes],
                 special_ids: frozenset[int], skip_special_tokens: bool = True):
        self._token_bytes = token_bytes if callable(token_bytes) else token_bytes.__getitem__
        self._skipped = special_ids if skip_special_tokens else frozenset()
        self._decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def push(self, token_id: int) -> str:
        if token_id in self._skipped:
            return ""
        return self._decoder.decode(self._token_bytes(token_id))

    def flush(self) -> str:
        """At the end of generation: an incomplete tail, decoded as U+FFFD."""
        return self._decoder.decode(b"", final=True)
