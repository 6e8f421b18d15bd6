"""qwen3_coder: <tool_call><function=f><parameter=k>v</parameter></function></tool_call>."""

from __future__ import annotations

import ast
import re
from typing import Any

from tallow.output.partial_match import partial_suffix_len
from tallow.output.tool_parsers.base import Parsed, ToolParser, compact_json, loads_json
from tallow.output.tool_parsers.streaming import PartialCall, encode_string


_FUNCTION = re.compile(r"\s*<function=([^>\n]+)>(.*?)</function>\s*", re.S)
_FUNCTION_OPEN = re.compile(r"\s*<function=([^>\n]+)>\s*(?=<parameter=[^>\n]+>|</function>)", re.S)
_PARAMETER_OPEN = re.compile(r"\s*<parameter=([^>\n]+)>", re.S)
_VALUE_ENDS = ("</parameter>", "<parameter=", "</function>")
_PARAMETER = re.compile(r"\s*<parameter=([^>\n]+)>(.*?)(?:</parameter>|(?=<parameter=)|\Z)\s*", re.S)


class Qwen3CoderParser(ToolParser):
    """<tool_call><function=NAME><parameter=KEY>VALUE</parameter>...</function></tool_call>

    The <tool_call> wrapper may be missing (then </function> ends the markup), and so may
    </tool_call> at the end of generation; </parameter> may be left out. Values are
    typed by the tool's JSON schema: integer, number, boolean, null, object and array are
    converted, strings and parameters the schema does not know stay strings; a value that
    does not convert stays a string too.
    """

    name = "qwen3_coder"
    start_tags = ("<tool_call>", "<function=")
    markers = ("<tool_call>", "</tool_call>")

    def _parse(self, markup: str, final: bool) -> Parsed | None:
        wrapped = markup.startswith("<tool_call>")
        body_start = len("<tool_call>") if wrapped else 0
        close_tag = "</tool_call>" if wrapped else "</function>"
        close = markup.find(close_tag, body_start)
        if close == -1:
            if not final:
                return None
            return Parsed(len(markup), self._functions(markup[body_start:]))
        end = close + len(close_tag)
        # Wrapped, the body is what the tags enclose; bare, it is the <function=...> element.
        return Parsed(end, self._functions(markup[body_start:close] if wrapped else markup[:end]))

    def __init__(self, schemas=None):
        super().__init__(schemas)
        # A growing value's start -> (where to search for its end, where its sent text ends, that text encoded).
        self._values: dict[int, tuple[int, int, str]] = {}

    def reset(self) -> None:
        super().reset()
        self._values.clear()

    def partial(self, markup: str) -> list[PartialCall]:
        """A call opens at its first <parameter=KEY> (or at </function> when it has none); string
        values stream as they grow, other values once their parameter closes."""
        wrapped = markup.startswith("<tool_call>")
        pos = len("<tool_call>") if wrapped else 0
        if wrapped:
            close = markup.find("</tool_call>", pos)
            limit = close if close != -1 else len(markup) - partial_suffix_len(markup, ("</tool_call>",))
        else:
            close = markup.find("</function>")
            limit = close + len("</function>") if close != -1 else len(markup)
        body = markup[:limit]  # a copy, but cheap next to the rest
        calls = []
        while True:
            m = _FUNCTION_OPEN.match(body, pos)
            if m is None:
                return calls
            name = m.group(1).strip()
            arguments, pos, closed = self._partial_arguments(name, body, m.end())
            calls.append(PartialCall(name, arguments, closed))
            if not closed or not wrapped:
                return calls

    def _partial_arguments(self, function: str, body: str, pos: int) -> tuple[str, int, bool]:
        """The arguments JSON certain so far of the function whose parameters start at body[pos];
        the index after its </function> and True once it closed."""
        properties = self.schemas.get(function, {}).get("properties", {})
        out = ["{"]
        while True:
            if body.startswith("</function>", pos):
                out.append("}")
                return "".join(out), pos + len("</function>"), True
            m = _PARAMETER_OPEN.match(body, pos)
            if m is None:
                return "".join(out), pos, False
            key = m.group(1).strip()
            head = ("," if len(out) > 1 else "") + encode_string(key) + ":"
            # Where the value ends; searched from where the last call stopped (a tag may have begun there).
            scanned, sent, encoded = self._values.get(m.end(), (m.end(), m.end(), ""))
            ends = [at for at in (body.find(tag, scanned) for tag in _VALUE_ENDS) if at != -1]
            end = min(ends) if ends else None
            schema = properties.get(key, {})
            types = _schema_types(schema)
            is_string = not types or "string" in types
            if end is None:
                visible = len(body) - partial_suffix_len(body, _VALUE_ENDS)
                if is_string and visible > m.end():  # the value so far, less a newline that may be the last
                    start = m.end() + (body[m.end()] == "\n")
                    stop = visible - (visible > start and body[visible - 1] == "\n")
                    if stop > sent:
                        encoded += encode_string(body[max(sent, start):stop])[1:-1]
                        sent = stop
                    out.append(head + '"' + encoded)
                self._values[m.end()] = (max(m.end(), visible - 20), sent, encoded)  # tags are shorter than 20
                return "".join(out), pos, False
            raw = body[m.end():end]
            value = raw.removeprefix("\n").removesuffix("\n")
            out.append(head + compact_json({"": _typed(value, schema)})[4:-1])
            pos = end + len("</parameter>") if body.startswith("</parameter>", end) else end
            pos = len(body) if pos > len(body) else pos
            while pos < len(body) and body[pos].isspace():
                pos += 1

    def _functions(self, body: str) -> list[tuple[str, dict]] | None:
        calls, pos = [], 0
        while pos < len(body):
            m = _FUNCTION.match(body, pos)
            if m is None or m.end() == pos:
                return None
            name = m.group(1).strip()
            args = self._parameters(name, m.group(2))
            if args is None:
                return None
            calls.append((name, args))
            pos = m.end()
        return calls or None

    def _parameters(self, function: str, body: str) -> dict[str, Any] | None:
        properties = self.schemas.get(function, {}).get("properties", {})
        args, pos = {}, 0
        while pos < len(body):
            m = _PARAMETER.match(body, pos)
            if m is None or m.end() == pos:
                return None
            key, value = m.group(1).strip(), m.group(2)
            value = value.removeprefix("\n").removesuffix("\n")
            args[key] = _typed(value, properties.get(key, {}))
            pos = m.end()
        return args


def _schema_types(schema: dict[str, Any]) -> list[str]:
    types = schema.get("type")
    if isinstance(types, str):
        return [types]
    if isinstance(types, list):
        return types
    return [t for sub in schema.get("anyOf", []) + schema.get("oneOf", []) for t in _schema_types(sub)]


def _typed(value: str, schema: dict[str, Any]) -> Any:
    """The parameter value as the schema's type; the string itself when the schema allows a
    string, names no type, or the value does not convert."""
    types = _schema_types(schema)
    if not types or "string" in types:
        return value
    text = value.strip()
    for kind in types:
        if kind == "null" and text.lower() in ("null", "none"):
            return None
        if kind == "boolean" and text.lower() in ("true", "false"):
            return text.lower() == "true"
        if kind in ("integer", "number", "object", "array"):
            parsed = _literal(text)
            wanted = {"integer": int, "number": (int, float), "object": dict, "array": list}[kind]
            if isinstance(parsed, wanted) and not isinstance(parsed, bool):
                return parsed
    return value


def _literal(text: str) -> Any:
    """A JSON value from JSON or a Python literal (as models sometimes write dicts); None when
    it is neither."""
    try:
        return loads_json(text)
    except ValueError:
        pass
    try:
        value = ast.literal_eval(text)
        compact_json({"": value})  # JSON-encodable only: no sets, bytes, NaN
        return value
    except (ValueError, TypeError, SyntaxError, RecursionError, MemoryError):
        return None
