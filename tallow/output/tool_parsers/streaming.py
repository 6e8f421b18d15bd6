"""Streaming a tool call's arguments while the model writes them.

A parser's partial(markup) names the calls whose opening is unambiguous (the name complete and
the argument section opened) and, for each, the arguments JSON that is certain so far: a prefix
of the call's final `arguments` string that only grows as the markup grows. The router streams
the difference.

JsonArgsStream turns raw JSON (hermes, llama3_json, mistral) into the compact form the router's
final arguments use (compact_json: no insignificant whitespace, strings as json.dumps writes them
with ensure_ascii=False, numbers as json.dumps writes the parsed number), incrementally: string
values go out as they grow, keys, numbers and literals once complete, a comma once the next item
begins. So the streamed text is always a JSON prefix that close_json() can complete, and for
well-formed arguments the concatenation is exactly compact_json(json.loads(raw)) (one exception:
a key written twice streams twice, where json.loads keeps the last; the router then keeps the
streamed text, which decodes to the same object).
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass

encode_string = json.encoder.encode_basestring  # a str as json.dumps(ensure_ascii=False) writes it


@dataclass(frozen=True)
class PartialCall:
    """A call being streamed: its name and the arguments JSON certain so far; closed once the
    arguments are complete (then `arguments` is valid JSON)."""

    name: str
    arguments: str
    closed: bool


_WS = re.compile(r"[ \t\n\r]*")
# A string body's complete part: plain characters and whole escapes.
_STRING_PART = re.compile(r'(?:[^"\\\x00-\x1f]|\\["\\/bfnrt]|\\u[0-9a-fA-F]{4})*')
_PARTIAL_ESCAPE = re.compile(r"\\(?:u[0-9a-fA-F]{0,3})?\Z")
_HIGH_SURROGATE_END = re.compile(r"\\u[dD][89abAB][0-9a-fA-F]{2}\Z")
_NUMBER = re.compile(r"-?(?:0|[1-9][0-9]*)(?:\.[0-9]+)?(?:[eE][+-]?[0-9]+)?\Z")
_SCALAR_CHARS = re.compile(r"[A-Za-z0-9+\-.]*")


class JsonArgsStream:
    """Compact JSON out of a raw JSON object that starts at text[start] ("{"), fed a text that
    only grows: feed(text, limit) reads text[:limit] from where it stopped.

    out: the compact JSON certain so far; done: the object closed (end: the index after it);
    failed: the raw text stopped being JSON (out stays what it was, a prefix close_json completes).
    """

    def __init__(self, start: int):
        self.pos = start
        self.out = ""
        self.done = False
        self.failed = False
        self.end: int | None = None
        self._stack: list[str] = []  # "{" or "["
        self._expect = "value"  # value | key | colon | after (a value ended) | value_or_close | key_or_close
        self._pending = ""  # a comma, written when the next item begins
        self._string: str | None = None  # "key" or "value" while inside a string
        self._key = ""  # the raw body of the key being read

    def feed(self, text: str, limit: int | None = None) -> None:
        limit = len(text) if limit is None else limit
        while not (self.done or self.failed) and self.pos < limit:
            if self._string is not None:
                if not self._read_string(text, limit):
                    return
                continue
            self.pos = _WS.match(text, self.pos, limit).end()
            if self.pos >= limit:
                return
            char = text[self.pos]
            expect = self._expect
            if expect in ("value", "value_or_close"):
                if char == "]" and expect == "value_or_close":
                    self._close_bracket("[")
                elif char in "{[":
                    self._write(char)
                    self._stack.append(char)
                    self._expect = "key_or_close" if char == "{" else "value_or_close"
                    self.pos += 1
                elif char == '"':
                    self._write('"')
                    self._string = "value"
                    self.pos += 1
                else:
                    if not self._read_scalar(text, limit):
                        return
            elif expect in ("key", "key_or_close"):
                if char == "}" and expect == "key_or_close":
                    self._close_bracket("{")
                elif char == '"':
                    self._string, self._key = "key", ""
                    self.pos += 1
                else:
                    self.failed = True
            elif expect == "colon":
                if char != ":":
                    self.failed = True
                else:
                    self.pos += 1
                    self._expect = "value"
            else:  # after a value
                top = self._stack[-1]
                if char == ",":
                    self._pending = ","
                    self._expect = "key" if top == "{" else "value"
                    self.pos += 1
                elif char == "}]"[top == "["]:
                    self._close_bracket(top)
                else:
                    self.failed = True

    # ---- pieces ---------------------------------------------------------------------------

    def _write(self, text: str) -> None:
        self.out += self._pending + text
        self._pending = ""

    def _close_bracket(self, bracket: str) -> None:
        self._stack.pop()
        self._pending = ""
        self.out += "}" if bracket == "{" else "]"
        self.pos += 1
        self._value_ended()

    def _value_ended(self) -> None:
        if self._stack:
            self._expect = "after"
        else:
            self.done, self.end = True, self.pos

    def _read_string(self, text: str, limit: int) -> bool:
        """Reads string body; False when it waits for more text."""
        start = self.pos
        stop = _STRING_PART.match(text, start, limit).end()
        if stop < limit and text[stop] == '"':
            self._string_piece(text[start:stop], closed=True)
            self.pos = stop + 1
            return True
        if stop < limit and not _PARTIAL_ESCAPE.match(text[stop:limit]):  # a control character, a bad escape
            self.failed = True
            return False
        body = text[start:stop]
        if _HIGH_SURROGATE_END.search(body):  # may pair with the next escape
            body = body[:-6]
        self._string_piece(body, closed=False)
        self.pos = start + len(body)
        return False

    def _string_piece(self, body: str, closed: bool) -> None:
        if self._string == "key":
            self._key += body
            if closed:
                self._write(encode_string(json.loads(f'"{self._key}"')) + ":")
                self._string = None
                self._expect = "colon"
            return
        if body:
            self.out += encode_string(json.loads(f'"{body}"'))[1:-1]
        if closed:
            self.out += '"'
            self._string = None
            self._value_ended()

    def _read_scalar(self, text: str, limit: int) -> bool:
        stop = _SCALAR_CHARS.match(text, self.pos, limit).end()
        if stop == limit:
            return False  # the number or literal may go on
        token = text[self.pos:stop]
        if token in ("true", "false", "null"):
            value = token
        elif _NUMBER.match(token):
            number = json.loads(token)
            if number in (float("inf"), float("-inf")):
                self.failed = True
                return False
            value = json.dumps(number)
        else:
            self.failed = True
            return False
        self._write(value)
        self.pos = stop
        self._value_ended()
        return True


def close_json(prefix: str) -> str:
    """What completes a JSON prefix as the streams write them (strings possibly open, a key's
    colon possibly last, no dangling comma) into valid JSON."""
    stack: list[str] = []
    in_string = escaped = False
    last = ""
    for char in prefix:
        if in_string:
            if escaped:
                escaped = False
            elif char == "\\":
                escaped = True
            elif char == '"':
                in_string = False
            continue
        if char == '"':
            in_string = True
        elif char in "{[":
            stack.append(char)
        elif char in "}]":
            stack.pop()
        if not char.isspace():
            last = char
    tail = '"' if in_string else ""
    if not in_string and last == ":":
        tail += "null"
    elif not in_string and last == ",":
        tail += '"":null' if stack and stack[-1] == "{" else "null"
    return tail + "".join("}" if b == "{" else "]" for b in reversed(stack))
