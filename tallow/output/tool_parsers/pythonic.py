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

    def partial(self, markup: str) -> list[PartialCall]:
        """A call opens at NAME( followed by a keyword or ")"; a value that is a plain quoted
        string streams as it grows, other values once complete."""
        calls, pos = [], 1
        while True:
            m = _CALL_OPEN.match(markup, pos)
            if m is None:
                return calls
            arguments, pos, closed = _partial_arguments(markup, m.end())
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


def _partial_arguments(text: str, pos: int) -> tuple[str, int, bool]:
    """The arguments JSON certain so far of the call whose arguments start at text[pos]; the
    index after its ")" and True once it closed."""
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
        end = _value_end(text, m.end())
        if end is None:
            growing = _growing_string(text, m.end())
            if growing is not None:
                out.append(head + encode_string(growing)[:-1])
            return "".join(out), pos, False
        try:
            value = compact_json({"": ast.literal_eval(text[m.end():end].strip())})[4:-1]
        except (SyntaxError, ValueError, TypeError, RecursionError, MemoryError):
            return "".join(out), pos, False
        out.append(head + value)
        pos = end


def _value_end(text: str, pos: int) -> int | None:
    """Where the value at text[pos] ends (a "," or ")" outside brackets and strings); None while
    it does not."""
    depth, quote = 0, None
    while pos < len(text):
        char = text[pos]
        if quote is not None:
            if char == "\\":
                pos += 1
            elif char == quote:
                quote = None
        elif char in "\"'":
            quote = char
        elif char in "([{":
            depth += 1
        elif char in ")]}":
            if depth == 0:
                return pos if char == ")" else None
            depth -= 1
        elif char == "," and depth == 0:
            return pos
        pos += 1
    return None


def _growing_string(text: str, pos: int) -> str | None:
    """The decoded text so far of a plain (not triple-quoted, unprefixed) string literal that
    opens at text[pos]; None when the value is something else."""
    if pos >= len(text) or text[pos] not in "\"'":
        return None
    quote = text[pos]
    body = text[pos + 1:]
    if body.startswith(quote) or not body:  # "" or the start of a triple quote: wait
        return None
    cut = _STRING_BODY[quote].match(body).end()
    if cut == len(body) or body[cut] != quote:  # not closed: decode up to an escape that may still grow
        cut = len(body)
        last = None
        for last in _ESCAPE.finditer(body):
            pass
        if last is not None and not _COMPLETE_ESCAPE.match(body, last.start()):
            cut = last.start()
        elif body.endswith("\\") and (len(body) - len(body.rstrip("\\"))) % 2:
            cut -= 1
    try:
        value = ast.literal_eval(quote + body[:cut] + quote)
    except (SyntaxError, ValueError):
        return None
    return value if isinstance(value, str) else None
