"""Lark pieces (llguidance's dialect) for the tool-call grammars the parsers build.

`ToolParser.call_grammar` (base.py) composes a whole-reply grammar from what each format
contributes: its markup for one or more calls (`ToolParser.markup_rule`) and, for text with calls
in it, the tags that open a call mid-text (`ToolParser.mid_text_calls`). This module holds what
they share: literals, special tokens by id, a tool's arguments as an inline `%json` schema (its
`$defs` hoisted so `#/$defs/...` references still resolve), and the grammar text under
construction (`LarkGrammar`).

JSON inside a call is written as json.dumps writes it: one line, ", " between items and ": "
after keys (JSON_STYLE); a small model given free whitespace can pad a call until max_tokens.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from tallow.engine.grammar import JSON_OPTIONS, closed_objects

if TYPE_CHECKING:
    from tallow.output.tool_parsers.input_grammar import InputGrammar

# llguidance's JSON options (its "x-guidance" key), as json.dumps(obj) writes JSON: the engine's.
JSON_STYLE = JSON_OPTIONS

# Any text: the free text around calls.
ANY_TEXT = r"/(?s:.*)/"


class UnenforceableSchema(ValueError):
    """A tool's schema that this tool-call format cannot enforce exactly (under strict: a 400)."""

    def __init__(self, tool: str, message: str):
        super().__init__(f"tool {tool!r}: {message}")
        self.tool = tool


@dataclass(frozen=True)
class GrammarTool:
    """One tool as a grammar sees it: its arguments' schema, and whether it must hold exactly
    (constrained: the schema; not: any JSON object)."""

    name: str
    parameters: dict[str, Any]
    constrained: bool = True
    strict: bool = False  # strict: true: a schema the format cannot enforce is an error, not ignored
    # A custom tool's grammar for its one string argument, "input" (input_grammar.py): always held.
    input_grammar: InputGrammar | None = None

    @property
    def schema(self) -> dict[str, Any]:
        return self.parameters if self.constrained else {"type": "object"}


def grammar_tools(tools: list[dict[str, Any]] | None, *, constrain_all: bool,
                  input_grammars: Mapping[str, InputGrammar] | None = None) -> list[GrammarTool]:
    """OpenAI-shaped tool definitions -> GrammarTools. constrain_all: every tool's arguments follow
    its schema (a forced call); else only those of tools marked strict: true, and custom tools
    with an input grammar (input_grammars: tool name -> its grammar), which are always held."""
    out = []
    for tool in tools or []:
        fn = tool.get("function", tool)
        params = fn.get("parameters")
        if not isinstance(params, dict) or not params:
            # parameters left out (or {}): "a function with an empty parameter list" (OpenAI's
            # spec), so a forced call's arguments are {}, not any object
            params = {"type": "object", "properties": {}, "additionalProperties": False}
        custom = (input_grammars or {}).get(fn["name"])
        strict = fn.get("strict") is True or custom is not None
        out.append(GrammarTool(fn["name"], params, constrain_all or strict, strict, custom))
    return out


def lit(text: str) -> str:
    """A Lark string literal."""
    return json.dumps(text, ensure_ascii=False)


def regex_escape(text: str) -> str:
    """text as a literal inside /.../ (Rust regex syntax)."""
    return "".join("\\" + c if c in r"\.+*?()|[]{}^$#&-~/" else c for c in text)


def json_rule(schema: dict[str, Any]) -> str:
    """An inline %json schema, written as JSON_STYLE; unsupported keywords ignored (a strict
    tool's schema is checked on its own first: tallow.serve.structured)."""
    return "%json " + json.dumps({**closed_objects(schema), "x-guidance": {**JSON_STYLE, "lenient": True}},
                                 ensure_ascii=False)


def hoist_defs(schema: dict[str, Any], prefix: str) -> tuple[dict[str, Any], dict[str, Any]]:
    """(schema with its $defs / definitions removed and references to them renamed, the
    renamed definitions): to embed a tool's schema below a new root whose $defs holds them."""
    defs: dict[str, Any] = {}
    for key in ("$defs", "definitions"):
        for name, sub in (schema.get(key) or {}).items():
            defs[f"{prefix}{name}"] = sub
    renames = {f"#/{key}/{name}": f"#/$defs/{prefix}{name}" for key in ("$defs", "definitions")
               for name in (schema.get(key) or {})}

    def walk(node: Any) -> Any:
        if isinstance(node, dict):
            return {k: (renames.get(v, v) if k == "$ref" and isinstance(v, str) else walk(v))
                    for k, v in node.items()}
        if isinstance(node, list):
            return [walk(v) for v in node]
        return node

    body = walk({k: v for k, v in schema.items() if k not in ("$defs", "definitions")})
    return body, {name: walk(sub) for name, sub in defs.items()}


def call_object_schema(tools: list[GrammarTool], *, name_key: str = "name",
                       args_key: str = "arguments") -> dict[str, Any]:
    """The JSON schema of one call object {name_key: <tool name>, args_key: {...}} for any of
    `tools`, the name first (the order the models write)."""
    options, defs = [], {}
    for k, tool in enumerate(tools):
        args, tool_defs = hoist_defs(tool.schema, f"t{k}_")
        defs.update(tool_defs)
        options.append({"type": "object", "properties": {name_key: {"const": tool.name}, args_key: args},
                        "required": [name_key, args_key], "additionalProperties": False})
    schema = options[0] if len(options) == 1 else {"anyOf": options}
    return {**schema, "$defs": defs} if defs else schema


def python_literal(value: Any) -> str:
    """value as Python source (pythonic calls): JSON with True / False / None."""
    if value is True:
        return "True"
    if value is False:
        return "False"
    if value is None:
        return "None"
    if isinstance(value, list):
        return "[" + ", ".join(python_literal(v) for v in value) + "]"
    if isinstance(value, dict):
        return "{" + ", ".join(f"{json.dumps(k, ensure_ascii=False)}: {python_literal(v)}"
                               for k, v in value.items()) + "}"
    return json.dumps(value, ensure_ascii=False)


@dataclass
class LarkGrammar:
    """A Lark grammar under construction: named rules and terminals, and the special tokens of
    the tokenizer (text -> id), which a grammar must name as tokens, not spell as text."""

    special_ids: Mapping[str, int] = field(default_factory=dict)
    rules: dict[str, str] = field(default_factory=dict)
    _count: int = 0

    def tag(self, text: str) -> str:
        """A tag as the model writes it: the special token when the tokenizer has one, else text."""
        token_id = self.special_ids.get(text)
        return f"<[{token_id}]>" if token_id is not None else lit(text)

    def is_special(self, text: str) -> bool:
        return text in self.special_ids

    def add(self, body: str, name: str | None = None, options: str = "") -> str:
        """A new rule (lowercase name) or terminal (uppercase name) for `body`; returns its name."""
        if name is None:
            self._count += 1
            name = f"r{self._count}"
        self.rules[f"{name}{options}"] = body
        return name

    def repeat(self, item: str, separator: str | None, max_count: int | None) -> str:
        """item, then up to max_count - 1 more (None: any number), each after `separator` (a
        literal, or None)."""
        if max_count == 1:
            return item
        more = "*" if max_count is None else f"{{0,{max_count - 1}}}"
        sep = f"{separator} " if separator else ""
        return self.add(f"{item} ({sep}{item}){more}")

    def text(self, start: str) -> str:
        lines = ["%llguidance {}", f"start: {start}"]
        lines += [f"{name}: {body}" for name, body in self.rules.items()]
        return "\n".join(lines) + "\n"

    def sequence(self, items: list[tuple[str, bool]], separator: str | None) -> str:
        """Lark for items in order, each present (required) or optional, joined by `separator`
        (a literal or None) where two are present. Returns an expression, "" for nothing."""
        if separator is None:
            return " ".join(item if required else f"({item})?" for item, required in items)
        # more_i: what may follow once something was written (separator first); first_i: from
        # item i on, nothing written yet.
        more: str = ""
        first: str = ""
        for item, required in reversed(items):
            sep_item = f"{separator} {item}"
            new_more = f"{sep_item} {more}".strip() if required else f"({sep_item})? {more}".strip()
            with_item = f"{item} {more}".strip()
            if required:
                new_first = with_item
            else:
                new_first = self.add(f"{with_item} | {first}") if first else f"({with_item})?"
            more = self.add(new_more) if new_more else ""
            first = new_first
        return first
