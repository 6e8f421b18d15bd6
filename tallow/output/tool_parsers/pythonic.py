"""pythonic: [f(a=1), g(b="x")] beginning the reply."""

from __future__ import annotations

import ast
import re

from tallow.output.tool_parsers.base import Parsed, ToolParser, compact_json, undecided
from tallow.output.tool_parsers.streaming import PartialCall, encode_string

_CALL_OPEN = re.compile(r"\s*([A-Za-z_]\w*(?:\.[A-Za-z_]\w*)*)\((?=\s*(?:\)|[A-Za-z_]\w*\s*=[^=]))")
_KEYWORD = re.compile(r"\s*([A-Za-z_]\w*)\s*=(?!=)\s*")
_STRING_BODY = {q: re.compile(rf"(?:[^\\{q}]|\\.)*", re.S) for q in "\"'"}
# An escape that no further character can change.
_COMPLETE_ESCAPE = re.compile(r"\\(?:N\{[^}]*\}|x[0-9a-fA-F]{2}|u[0-9a-fA-F]{4}|U[0-9a-fA-F]{8}|[0-7]{1,3}(?=[^0-7])|[0-7]{3}"
                              r"|[^xuUN0-7])", re.S)
_ESCAPE = re.compile(r"\\(?:N\{[^}]*\}|.)", re.S)


class PythonicParser(ToolParser):
    """[f(a=1), g(b="x")] beginning the reply: a Python list of calls with keyword arguments
    whose values are literals."""

    name = "pythonic"
    reply_start = "["
    quotes, brackets = "\"'", ("{[(", "}])")

    def _parse(self, markup: str, final: bool) -> Parsed | None:
        close = self._value_end(markup, 0)
        if close is None:
            return undecided(markup, final)
        return Parsed(close, self._calls(markup[:close]))

    def __init__(self, schemas=None):
        super().__init__(schemas)
        self._strings: dict[int, tuple[int, str]] = {}  # a growing string value's start -> decoded so far

    def reset(self) -> None:
        super().reset()
        self._strings.clear()

    def partial(self, markup: str) -> list[PartialCall]:
        """A call opens at NAME( followed by a keyword or ")"; a value that is a plain quoted
        string streams as it grows, other values once complete."""
        calls, pos = [], 1
        while True:
            m = _CALL_OPEN.match(markup, pos)
            if m is None:
                return calls
            arguments, pos, closed = _partial_arguments(markup, m.end(), self._strings)
            calls.append(PartialCall(m.group(1), arguments, closed))
            if not closed:
                return calls
            while pos < len(markup) and markup[pos].isspace():
                pos += 1
            if not markup.startswith(",", pos):
                return calls
            pos += 1

    @staticmethod
    def _calls(source: str) -> list[tuple[str, dict]] | None:
        try:
            tree = ast.parse(source, mode="eval").body
            if not isinstance(tree, ast.List) or not tree.elts:
                return None
            calls = []
            for node in tree.elts:
                if not isinstance(node, ast.Call) or node.args or any(k.arg is None for k in node.keywords):
                    return None
                args = {k.arg: ast.literal_eval(k.value) for k in node.keywords}
                compact_json(args)  # JSON-encodable only: no sets, bytes, NaN
                calls.append((ast.unparse(node.func), args))
            return calls
        except (SyntaxError, ValueError, TypeError, RecursionError, MemoryError):
            return None


def _partial_arguments(text: str, pos: int, strings: dict[int, tuple[int, str]]) -> tuple[str, int, bool]:
    """The arguments JSON certain so far of the call whose arguments start at text[pos]; the
    index after its ")" and True once it closed. strings: the growing string values decoded so far."""
    out = ["{"]
    while True:
        while pos < len(text) and text[pos].isspace():
            pos += 1
        if text.startswith(")", pos):
            out.append("}")
            return "".join(out), pos + 1, True
        if len(out) > 1:
            if not text.startswith(",", pos):
                return "".join(out), pos, False
            pos += 1
        m = _KEYWORD.match(text, pos)
        if m is None or m.end() == len(text):
            return "".join(out), pos, False
        head = ("," if len(out) > 1 else "") + encode_string(m.group(1)) + ":"
        growing, after = _growing_string(text, m.end(), strings)
        # A string that has not closed: the value goes on (no need to scan it again).
        end = None if growing is not None and after is None else _value_end(text, after or m.end())
        if end is None:
            if growing is not None:
                out.append(head + encode_string(growing)[:-1])
            return "".join(out), pos, False
        try:
            value = compact_json({"": ast.literal_eval(text[m.end():end].strip())})[4:-1]
        except (SyntaxError, ValueError, TypeError, RecursionError, MemoryError):
            if growing is not None:  # what went out stays: the call is broken from here on
                out.append(head + encode_string(growing)[:-1])
            return "".join(out), pos, False
        out.append(head + value)
        pos = end


# A string (closed or not), a run of plain characters, or one character.
_VALUE_TOKEN = re.compile(r""""(?:[^"\\]|\\.)*"?|'(?:[^'\\]|\\.)*'?|[^"'()\[\]{},]+|.""", re.S)


def _value_end(text: str, pos: int) -> int | None:
    """Where the value at text[pos] ends (a "," or ")" outside brackets and strings); None while
    it does not."""
    depth = 0
    while pos < len(text):
        token = _VALUE_TOKEN.match(text, pos)
        char = text[pos]
        if char in "([{":
            depth += 1
        elif char in ")]}":
            if depth == 0:
                return pos if char == ")" else None
            depth -= 1
        elif char == "," and depth == 0:
            return pos
        pos = token.end()
    return None


def _growing_string(text: str, pos: int, strings: dict[int, tuple[int, str]]) -> tuple[str | None, int | None]:
    """The decoded text so far of a plain (not triple-quoted, unprefixed) string literal that
    opens at text[pos], and the index after its closing quote once it closed; (None, None) when
    the value is something else. Decodes only what was added since the last call (strings[pos]:
    where the decoded part ends, and its text)."""
    if pos >= len(text) or text[pos] not in "\"'":
        return None, None
    quote = text[pos]
    if pos + 1 == len(text) or text[pos + 1] == quote:  # "" or the start of a triple quote: wait
        return None, None
    done, decoded = strings.get(pos, (pos + 1, ""))
    cut = _STRING_BODY[quote].match(text, done).end()
    closed = cut < len(text) and text[cut] == quote
    if not closed:  # decode up to an escape that may still grow
        cut = len(text)
        last = None
        for last in _ESCAPE.finditer(text, done):
            pass
        if last is not None and not _COMPLETE_ESCAPE.match(text, last.start()):
            cut = last.start()
        elif text.endswith("\\") and (len(text) - len(text.rstrip("\\"))) % 2:
            cut -= 1
    if cut > done:
        try:
            piece = ast.literal_eval(quote + text[done:cut] + quote)
        except (SyntaxError, ValueError):
            return None, None
        if not isinstance(piece, str):
            return None, None
        decoded += piece
        strings[pos] = (cut, decoded)
    return decoded, cut + 1 if closed else None
