"""pythonic: [f(a=1), g(b="x")] beginning the reply."""

from __future__ import annotations

import ast
import json
from typing import Any

from tallow.output.tool_parsers.base import Parsed, ToolParser, compact_json, undecided
from tallow.output.tool_parsers.grammar import (GrammarTool, LarkGrammar, UnenforceableSchema, json_rule, lit,
                                                python_literal)


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
