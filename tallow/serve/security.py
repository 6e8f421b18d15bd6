"""Security checks at the edge: the API key, the body bound, remote content in bodies, an exposed
bind address.

Nothing in a request body is ever fetched: the server has no vision or file inputs, so a
content part that points at an image, audio or file (by URL or inline) is refused with a
400 that says so, rather than passing as a schema error or being dropped silently.
"""

from __future__ import annotations

import hmac
import ipaddress
import json
from dataclasses import dataclass
from typing import Any

# Content part types of the OpenAI, Anthropic and Responses protocols that carry media or files.
REMOTE_CONTENT_TYPES = frozenset({"image_url", "input_image", "input_audio", "input_file", "file", "image",
                                  "document", "audio_url", "video_url"})
_PART_LISTS = ("content", "input")
# Cheap pre-check: a body without any of these bytes has no such part, so it is not parsed twice.
_REMOTE_CONTENT_HINTS = (b"image", b"audio", b"file", b"document", b"video")


def api_key_matches(headers, api_key: str) -> bool:
    """Whether `Authorization: Bearer <key>` or `x-api-key: <key>` carries api_key (constant time)."""
    given = headers.get("x-api-key")
    if given is None:
        scheme, _, token = headers.get("authorization", "").partition(" ")
        given = token.strip() if scheme.lower() == "bearer" else ""
    return hmac.compare_digest(given.encode(), api_key.encode())


# What a body may hold besides its prompts' text, in bytes: sampling fields, a response format's
# schema (a grammar's text is at most 1 MiB: engine/grammar.py), tool and message structure, a
# pretty-printer's whitespace.
BODY_ALLOWANCE = 2 * 1024 * 1024

# The most bytes a JSON encoder writes for one byte of string content: control characters and
# the HTML-sensitive < > & as \u00XX (Go's encoding/json escapes those three), " and \\ with a
# backslash, other ASCII as itself, a non-ASCII character as \uXXXX (a surrogate pair past
# U+FFFF): at most 3 bytes per byte of its UTF-8. (An encoder that escaped plain letters as
# \u0061 could exceed the bound; no common one does.)
_ESCAPED = bytes(6 if b < 0x20 or b in b"<>&" else 2 if b in b'"\\' else 1 if b < 0x80 else 3
                 for b in range(256))


@dataclass(frozen=True)
class ContextBound:
    """How long a request body to a model of `max_model_len` tokens can be and still fit: its
    prompt text is at most max_model_len tokens, each at most `token_bytes` bytes of JSON (the
    vocabulary's longest token as escaped, or a token id written as a number), plus
    BODY_ALLOWANCE for the rest. A longer body is refused before it is parsed."""

    max_model_len: int
    token_bytes: int

    @classmethod
    def for_model(cls, tokenizer, max_model_len: int) -> "ContextBound":
        vocab_size = tokenizer.vocab_size
        table = (tokenizer.token_bytes_table() if hasattr(tokenizer, "token_bytes_table")
                 else [tokenizer.token_bytes(i) for i in range(vocab_size)])
        longest = max((sum(_ESCAPED[b] for b in token) for token in table), default=1)
        # A token-id prompt ([1, 2, ...]): the digits of the largest id, a comma and a space.
        return cls(max_model_len, max(longest, len(str(vocab_size - 1)) + 2))

    def body_bytes(self, prompts: int = 1) -> int:
        """The longest body of a request with up to `prompts` prompts that each fit the context."""
        return BODY_ALLOWANCE + prompts * self.max_model_len * self.token_bytes

    def message(self, limit: int, prompts: int) -> str:
        each = "" if prompts == 1 else f" in each of up to {prompts} prompts"
        return (f"the request body exceeds {limit} bytes, more than any request that fits this model's "
                f"context can take ({self.max_model_len} tokens{each}, a token at most {self.token_bytes} "
                f"bytes as JSON, plus {BODY_ALLOWANCE} bytes for the other fields)")


def remote_content_part(raw: bytes) -> str | None:
    """The JSON path of the first media/file content part in a request body, or None."""
    if not any(hint in raw for hint in _REMOTE_CONTENT_HINTS):
        return None
    try:
        body = json.loads(raw)
    except (ValueError, RecursionError):
        return None  # the protocol's parser answers malformed JSON
    return _find_part(body)


def _find_part(body: Any) -> str | None:
    """Depth-first without recursion (bodies may nest deeply). Only the items of a "content"
    or "input" list are content parts, so tool schemas and metadata are left alone."""
    stack = [(body, "", False)]
    while stack:
        value, path, is_part = stack.pop()
        if isinstance(value, dict):
            if is_part and value.get("type") in REMOTE_CONTENT_TYPES:
                return path
            for key, sub in reversed(value.items()):
                sub_path = f"{path}.{key}" if path else str(key)
                if key in _PART_LISTS and isinstance(sub, list):
                    stack += [(item, f"{sub_path}[{i}]", True) for i, item in reversed(list(enumerate(sub)))]
                else:
                    stack.append((sub, sub_path, False))
        elif isinstance(value, list):
            stack += [(item, f"{path}[{i}]", False) for i, item in reversed(list(enumerate(value)))]
    return None


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def exposure_warning(host: str, api_key: str | None) -> str | None:
    """A warning for serving beyond this machine without an API key, else None."""
    if api_key or is_loopback(host):
        return None
    return (f"WARNING: tallow is listening on {host} without an API key: anyone who can reach this "
            f"address can use the model. Set --api-key or TALLOW_API_KEY.")
