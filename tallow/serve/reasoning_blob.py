"""Responses' `reasoning.encrypted_content`: a reasoning item's text sealed into an opaque blob the
client sends back in the next turn (Codex does, with store: false), so the server keeps nothing.

The blob is encrypt-then-MAC with the standard library only: a random 16-byte nonce, the UTF-8
text XORed with an HMAC-SHA256 keystream (HMAC(enc_key, nonce || counter)), then an HMAC-SHA256
tag over version || nonce || ciphertext with a second key; both keys derive from the server's
secret (ServerConfig.reasoning_key, else random per process). A blob that was not made by this
server's secret, or was altered, does not open (the protocol answers 400).
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import secrets

_VERSION = b"\x01"
_NONCE = 16
_TAG = 32


class ReasoningSealer:
    def __init__(self, secret: str | bytes | None = None):
        if secret is None:
            secret = secrets.token_bytes(32)
        elif isinstance(secret, str):
            secret = secret.encode()
        self._enc_key = hmac.new(secret, b"tallow reasoning encryption", hashlib.sha256).digest()
        self._mac_key = hmac.new(secret, b"tallow reasoning authentication", hashlib.sha256).digest()

    def _keystream(self, nonce: bytes, length: int) -> bytes:
        out = bytearray()
        counter = 0
        while len(out) < length:
            out += hmac.new(self._enc_key, nonce + counter.to_bytes(8, "big"), hashlib.sha256).digest()
            counter += 1
        return bytes(out[:length])

    def seal(self, text: str) -> str:
        data = text.encode("utf-8")
        nonce = secrets.token_bytes(_NONCE)
        body = _VERSION + nonce + bytes(a ^ b for a, b in zip(data, self._keystream(nonce, len(data))))
        tag = hmac.new(self._mac_key, body, hashlib.sha256).digest()
        return base64.urlsafe_b64encode(body + tag).decode("ascii")

    def open(self, blob: str) -> str | None:
        """The text sealed in `blob`, or None when it is not this server's or was altered."""
        try:
            raw = base64.urlsafe_b64decode(blob.encode("ascii"))
        except (ValueError, UnicodeEncodeError):
            return None
        if len(raw) < 1 + _NONCE + _TAG or raw[:1] != _VERSION:
            return None
        body, tag = raw[:-_TAG], raw[-_TAG:]
        if not hmac.compare_digest(tag, hmac.new(self._mac_key, body, hashlib.sha256).digest()):
            return None
        nonce, cipher = body[1:1 + _NONCE], body[1 + _NONCE:]
        try:
            return bytes(a ^ b for a, b in zip(cipher, self._keystream(nonce, len(cipher)))).decode("utf-8")
        except UnicodeDecodeError:
            return None
