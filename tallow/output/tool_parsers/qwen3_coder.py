"""qwen3_coder: <tool_call><function=f><parameter=k>v</parameter></function></tool_call>."""

from __future__ import annotations

import ast
import re
from typing import Any

from tallow.output.partial_match import partial_suffix_len
from tallow.output.tool_parsers.base import Parsed, ToolParser, compact_json, loads_json
from tallow.output.tool_parsers.input_grammar import string_value
from tallow.output.tool_parsers.grammar import (GrammarTool, LarkGrammar, UnenforceableSchema, hoist_defs,
                                                json_rule, lit, regex_escape)
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

    # The markup as the template writes it: <tool_call>\n<function=NAME>\n<parameter=KEY>\nVALUE\n
    # </parameter>\n...</function>\n</tool_call>, the parameters in the schema's order, each at most
    # once (required ones always). A value the parser keeps as a string (the schema allows a string
    # or names no type) is raw text; any other is JSON of its schema.
    def markup_rule(self, g: LarkGrammar, tools: list[GrammarTool], max_calls: int | None,
                    chat_template: str | None) -> str:
        call = g.add(f"{g.tag('<tool_call>')} {self._rest(g, tools)}")
        return g.repeat(call, '"\\n"', max_calls)

    def mid_text_calls(self, g: LarkGrammar, tools: list[GrammarTool],
                       chat_template: str | None) -> list[tuple[str, str]]:
        # The <tool_call> wrapper, or a bare <function=...> element.
        bare = g.add(" | ".join(self._function(g, tool, bare=True) for tool in tools))
        return [("<tool_call>", self._rest(g, tools)), ("<function=", bare)]

    def _rest(self, g: LarkGrammar, tools: list[GrammarTool]) -> str:
        functions = g.add(" | ".join(self._function(g, tool) for tool in tools))
        return g.add(f'"\\n" {functions} "\\n" {g.tag("</tool_call>")}')

    def _function(self, g: LarkGrammar, tool: GrammarTool, bare: bool = False) -> str:
        schema = tool.schema
        body, defs = hoist_defs(schema, "")
        properties = body.get("properties") or {}
        required = set(body.get("required") or [])
        if not tool.constrained or not properties:
            # Any parameters: one or more <parameter=KEY>VALUE</parameter> of any names.
            param = g.add(f'"<parameter=" /[^>\\n<]+/ ">\\n" {_raw_value(g)} "\\n"')
            params = f"({param})*"
        else:
            items = [(self._parameter(g, tool, key, sub, defs), key in required) for key, sub in properties.items()]
            params = g.sequence(items, None)
        head = "" if bare else '"<function=" '
        return g.add(f'{head}{lit(tool.name + ">")} "\\n" {params} "</function>"')

    def _parameter(self, g: LarkGrammar, tool: GrammarTool, key: str, schema: dict[str, Any],
                   defs: dict[str, Any]) -> str:
        if not isinstance(schema, dict):
            schema = {}
        types = _schema_types(schema)
        if tool.input_grammar is not None and key == "input":  # a custom tool's input, raw
            value = f'{string_value(g, tool.name, tool.input_grammar, "raw")} "\\n</parameter>"'
        elif types and "string" not in types:
            value = json_rule({**schema, "$defs": defs} if defs else schema)
            value = f'{value} "\\n</parameter>"'
        else:
            value = _raw_value(g, schema, tool, key)
        return g.add(f'{lit(f"<parameter={key}>")} "\\n" {value} "\\n"')
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


# A raw (string) value and the "\n</parameter>" after it, in one lexeme: text that holds none of
# the tags that would end the value, the function or the call early for the parser.
_RAW_END = r"\n<\/parameter>"
_NO_TAGS = r"~/(?s:.*)(<\/parameter>(?s:.)|<parameter=|<\/function>|<\/tool_call>)(?s:.*)/"
_EXACT_MAX_LENGTH = 48  # a raw value's maxLength up to which the tag exclusion is enforced with it
_STRING_KEYWORDS = {"type", "description", "title", "default", "examples", "minLength", "maxLength", "enum",
                    "const", "$comment", "deprecated", "readOnly", "writeOnly"}


def _raw_value(g: LarkGrammar, schema: dict[str, Any] | None = None, tool: GrammarTool | None = None,
               key: str = "") -> str:
    """The terminal of a raw string value of `schema` followed by "\n</parameter>"."""
    schema = schema or {}
    choices = schema.get("enum", [schema["const"]] if "const" in schema else None)
    if choices is not None and all(isinstance(c, str) for c in choices):
        return "(" + " | ".join(lit(c + "\n</parameter>") for c in choices) + ")"
    unenforced = sorted(set(schema) - _STRING_KEYWORDS)
    if tool is not None and tool.strict and (unenforced or choices is not None
                                             or _schema_types(schema) not in ([], ["string"])):
        raise UnenforceableSchema(tool.name, f"parameter {key!r}: the qwen3_coder format writes it as raw text, "
                                  f"which cannot be held to {', '.join(unenforced) or 'this schema'}")
    low, high = int(schema.get("minLength", 0)), schema.get("maxLength")
    length = f"{{{low},{'' if high is None else int(high)}}}"
    if high is not None and int(high) > _EXACT_MAX_LENGTH:
        # A long bounded count intersected with the tag exclusion is more than llguidance's lexer
        # builds ("too many expressions"): the value is lazy instead (it ends at the first
        # "\n</parameter>"), and may then hold a bare closing tag, which the parser would cut at.
        return g.add(f"/(?s:.){length}{_RAW_END}/", f"raw{len(g.rules)}", options="[lazy]")
    return g.add(f"/(?s:.){length}{_RAW_END}/ & {_NO_TAGS}", f"RAW{len(g.rules)}")
