"""pythonic: [f(a=1), g(b="x")] beginning the reply."""

from __future__ import annotations

import ast
import json
import re
from typing import Any

from tallow.output.tool_parsers.base import Parsed, ToolParser, compact_json, undecided
from tallow.output.tool_parsers.input_grammar import string_value
from tallow.output.tool_parsers.grammar import (GrammarTool, LarkGrammar, UnenforceableSchema, json_rule, lit,
                                                python_literal)
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

    # The markup as the templates show it: [f(a=1, b="x"), g()] beginning the reply; keyword
    # arguments in the schema's order, each at most once (required ones always), values as
    # Python literals of their schema.
    def markup_rule(self, g: LarkGrammar, tools: list[GrammarTool], max_calls: int | None,
                    chat_template: str | None) -> str:
        call = g.add(" | ".join(_PythonValues(g, tool).call() for tool in tools))
        return g.add(f'"[" {g.repeat(call, lit(", "), max_calls)} "]"')


# Python literals with no schema to follow (a tool that is not constrained, or {}).
_ANY_VALUE = r"""
PY_STRING: /"([^"\\\x00-\x1f]|\\["\\nrtbf])*"/
PY_NUMBER: /-?(0|[1-9][0-9]*)(\.[0-9]+)?([eE][+-]?[0-9]+)?/
py_any: PY_STRING | PY_NUMBER | "True" | "False" | "None" | py_list | py_dict
py_list: "[" (py_any (", " py_any)*)? "]"
py_dict: "{" (PY_STRING ": " py_any (", " PY_STRING ": " py_any)*)? "}"
"""
_KNOWN = {"type", "description", "title", "default", "examples", "properties", "required", "items", "minItems",
          "maxItems", "enum", "const", "anyOf", "oneOf", "$ref", "$defs", "definitions", "additionalProperties",
          "minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum", "multipleOf", "minLength", "maxLength",
          "pattern", "format", "$comment", "deprecated", "$schema", "nullable"}


class _PythonValues:
    """The Lark of one tool's call, its argument values written as Python literals."""

    def __init__(self, g: LarkGrammar, tool: GrammarTool):
        self.g, self.tool = g, tool
        self.schema = tool.schema
        self.defs = {**(self.schema.get("definitions") or {}), **(self.schema.get("$defs") or {})}
        self.refs: dict[str, str] = {}  # $ref -> its rule

    def call(self) -> str:
        if self.tool.input_grammar is not None:  # a custom tool: its input, a string as JSON writes it
            value = string_value(self.g, self.tool.name, self.tool.input_grammar, "json")
            return self.g.add(f'{lit(self.tool.name + "(input=")} {value} ")"')
        if not self.tool.constrained:
            self._any()
            return self.g.add(f'{lit(self.tool.name + "(")} ({_KWARG} (", " {_KWARG})*)? ")"')
        return self.g.add(f'{lit(self.tool.name + "(")} {self._fields(self.schema, "=", python_key=True)} ")"')

    def _any(self) -> str:
        if "py_any" not in self.g.rules:
            for line in _ANY_VALUE.strip().splitlines():
                name, body = line.split(": ", 1)
                self.g.add(body, name)
            self.g.add(f'/[A-Za-z_][A-Za-z0-9_]*/ "=" py_any', "py_kwarg")
        return "py_any"

    def _fields(self, schema: dict[str, Any], joiner: str, python_key: bool) -> str:
        properties = schema.get("properties") or {}
        required = set(schema.get("required") or [])
        items = []
        for key, sub in properties.items():
            if python_key and not key.isidentifier():
                self._unenforceable(f"the argument name {key!r} is not a Python identifier")
            name = key if python_key else json.dumps(key, ensure_ascii=False)
            items.append((self.g.add(f"{lit(name + joiner)} {self.value(sub)}"), key in required))
        return self.g.sequence(items, lit(", "))

    def value(self, schema: Any) -> str:
        g = self.g
        if schema is True or schema == {}:
            return self._any()
        if not isinstance(schema, dict):
            self._unenforceable(f"the schema {schema!r} cannot be written as a Python literal")
            return self._any()
        unknown = sorted(set(schema) - _KNOWN)
        if unknown:
            self._unenforceable(f"the keywords {', '.join(unknown)} are not supported in the pythonic format")
        if "$ref" in schema:
            ref = schema["$ref"]
            if ref not in self.refs:
                name = ref.rsplit("/", 1)[-1]
                target = self.defs.get(name) if ref.startswith(("#/$defs/", "#/definitions/")) else None
                if target is None:
                    self._unenforceable(f"the reference {ref!r} does not resolve")
                    return self._any()
                self.refs[ref] = rule = g.add("", f"py_ref{len(g.rules)}")  # defined below: recursion
                g.rules[rule] = self.value(target)
            return self.refs[ref]
        if "const" in schema:
            return lit(python_literal(schema["const"]))
        if "enum" in schema:
            return g.add(" | ".join(lit(python_literal(v)) for v in schema["enum"]))
        for key in ("anyOf", "oneOf"):
            if key in schema:
                base = {k: v for k, v in schema.items() if k not in (key, "description", "title")}
                return g.add(" | ".join(self.value({**base, **sub} if isinstance(sub, dict) else sub)
                                        for sub in schema[key]))
        types = schema.get("type")
        if isinstance(types, list):
            return g.add(" | ".join(self.value({**schema, "type": t}) for t in types))
        if schema.get("nullable") is True:
            return g.add(f'{self.value({k: v for k, v in schema.items() if k != "nullable"})} | "None"')
        if types == "boolean":
            return '("True" | "False")'
        if types == "null":
            return '"None"'
        if types in ("string", "integer", "number"):
            # JSON's strings (without \/) and numbers are Python literals too.
            return g.add(json_rule({k: v for k, v in schema.items() if k not in ("$defs", "definitions")}))
        if types == "array":
            item = self.value(schema.get("items", {}))
            low, high = int(schema.get("minItems", 0)), schema.get("maxItems")
            if high is not None and int(high) == 0:
                return '"[]"'
            more = f"{{{max(low - 1, 0)},{'' if high is None else int(high) - 1}}}"
            body = f"{item} ({lit(', ')} {item}){more}"
            return g.add(f'"[" {body} "]"' if low > 0 else f'"[" ({body})? "]"')
        if types == "object" or "properties" in schema:
            if not schema.get("properties"):
                self._any()
                return "py_dict"
            return g.add(f'"{{" {self._fields(schema, ": ", python_key=False)} "}}"')
        if types is None:
            return self._any()
        self._unenforceable(f"the type {types!r} is not supported")
        return self._any()

    def _unenforceable(self, message: str) -> None:
        if self.tool.strict:
            raise UnenforceableSchema(self.tool.name, message)


_KWARG = "py_kwarg"

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
