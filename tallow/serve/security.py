"""Security checks at the edge: the API key, remote content in bodies, an exposed bind address.

Nothing in a request body is ever fetched: the server has no vision or file inputs, so a
content part that points at an image, audio or file (by URL or inline) is refused with a
400 that says so, rather than passing as a schema error or being dropped silently.
"""

from __future__ import annotations

import hmac
import ipaddress
import json
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
