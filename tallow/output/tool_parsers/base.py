"""The tool-call parser contract (ToolParser, Parsed) and the pieces the formats share."""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from tallow.output.tool_parsers.grammar import ANY_TEXT, GrammarTool, LarkGrammar, lit
from tallow.output.tool_parsers.streaming import JsonArgsStream, PartialCall

Schemas = dict[str, dict[str, Any]]  # tool name -> JSON schema of its parameters


@dataclass(frozen=True)
class Parsed:
    """What a parser decided about the markup at the head of the text.

    markup[:end] is consumed: as tool calls (name, arguments), or, when calls is None, as
    content (it was not well-formed markup).
    """

    end: int
    calls: list[tuple[str, dict[str, Any]]] | None


class ToolParser:
    """One tool-call format.

    The router hands parse() the text from the start of the markup (a start tag, or a
    reply_start character as the first character of the reply), growing with every token,
    until parse() decides; the next call starts new markup. parse() returns None while it
    cannot decide; with final=True (generation ended) it must decide. A decision must hold for
    every continuation of the text.
    """

    name: str = ""  # the name --tool-call-parser knows it by (the registry's key)
    start_tags: tuple[str, ...] = ()  # open markup anywhere in the content
    reply_start: str = ""  # characters that open markup when they begin the reply
    markers: tuple[str, ...] = ()  # tags that may be special tokens: never skipped
    quotes, brackets = '"', ("{[", "}]")  # the value syntax, for finding where a value ends

    def new_call_id(self) -> str | None:
        """A fresh id for a parsed call, in the form the format's templates take back; None: the
        OpenAI-style default (ToolCall.create)."""
        return None

    def __init__(self, schemas: Schemas | None = None):
        self.schemas = schemas or {}
        self._closers: dict[int, _Closer] = {}  # for the current markup, by start
        self._streams: dict[int, JsonArgsStream] = {}  # for the current markup, by start

    def parse(self, markup: str, final: bool) -> Parsed | None:
        parsed = self._parse(markup, final)
        if parsed is not None:
            self.reset()
        return parsed

    def reset(self) -> None:
        """Forget the current markup (parse() does when it decides; the router again after the
        decided markup's last partial())."""
        self._closers.clear()
        self._streams.clear()

    def partial(self, markup: str) -> list[PartialCall]:
        """The calls of the undecided markup whose opening is unambiguous (the name complete and
        the argument section opened), each with the arguments JSON certain so far (see
        streaming.py). A function of the markup only, and monotone: for a longer markup the
        list and every call's arguments only grow. The router streams them; formats that do not
        stream return []. Called with markup parse() has not decided, or has just decided (cut to
        the end it decided; then reset()); resumes where the previous call stopped."""
        return []

    def _json_object_calls(self, markup: str, pos: int, limit: int, sep: str | None,
                           args_keys: tuple[str, ...] = ("arguments", "parameters")) -> list[PartialCall]:
        """Streamed calls of {"name": ..., "arguments": {...}} objects from markup[pos], separated
        by `sep` (None: one object), up to `limit`. A call opens once its name and the opening
        brace of its arguments are read (the keys in that order)."""
        calls: list[PartialCall] = []
        while True:
            pos = skip_ws(markup, pos)
            head = _JSON_HEAD.match(markup, pos, limit)
            if head is None or head.group(2) not in args_keys:
                return calls
            try:
                name = loads_json(f'"{head.group(1)}"')
            except ValueError:
                return calls
            if not name:
                return calls
            stream = self._streams.get(head.end() - 1)
            if stream is None:
                stream = self._streams[head.end() - 1] = JsonArgsStream(head.end() - 1)
            stream.feed(markup, limit)
            calls.append(PartialCall(name, stream.out, stream.done))
            if sep is None or not stream.done:
                return calls
            end = self._value_end(markup[:limit], pos)
            if end is None:
                return calls
            pos = skip_ws(markup, end)
            if pos >= limit or markup[pos] != sep:
                return calls
            pos += 1

    def _parse(self, markup: str, final: bool) -> Parsed | None:
        raise NotImplementedError

    # ---- constrained decoding: the grammar of this format's calls --------------------------------

    def call_grammar(self, tools: list[GrammarTool], *, required: bool, max_calls: int | None = None,
                     special_ids: Mapping[str, int] | None = None, content: str | None = None,
                     chat_template: str | None = None) -> str:
        """A Lark grammar (llguidance's dialect) of the reply, from where the grammar starts (after
        the reasoning), that this parser reads back as calls of `tools`.

        required: one or more calls (at most max_calls) and nothing else. Otherwise the reply is
        `content` (a Lark expression: the response format's %json) or calls; with content None, free
        text in which every call the model opens must be a well-formed call of one of the tools
        (the mid-text tags; a format whose markup begins the reply: that, or text that does not
        begin with it). special_ids: the tokenizer's special tokens (text -> id): a tag that is one
        is matched as that token. chat_template: the template's source, for formats with variants.
        Raises UnenforceableSchema for a strict tool whose schema the format cannot enforce.
        """
        g = LarkGrammar(special_ids or {})
        # A little whitespace may come first (after "</think>", the models write a blank line).
        g.add(r"/[ \t\r\n]{0,8}/", "LEAD_WS")
        if required:
            return g.text(f"LEAD_WS {self.markup_rule(g, tools, max_calls, chat_template)}")
        if content is not None:
            return g.text(f"LEAD_WS ({g.add(content)} | {self.markup_rule(g, tools, max_calls, chat_template)})")
        tags = []
        for trigger, rest in self.mid_text_calls(g, tools, chat_template):
            if g.is_special(trigger):
                tags.append(g.add(f"TEXT {g.tag(trigger)} {rest}"))
            else:  # lazy: the text ends at the first trigger, and the call must follow
                head = g.add(f"TEXT {lit(trigger)}", options="[lazy]")
                tags.append(g.add(f"{head} {rest}"))
        g.add(ANY_TEXT, "TEXT")
        free = f"({' | '.join(tags)})* TEXT" if tags else "TEXT"
        if not self.reply_start:
            return g.text(free)
        # The markup that begins the reply, or text whose first character does not open it.
        starts = "".join("\\" + c for c in self.reply_start)
        g.add(f"/[ \\t\\r\\n]*[^ \\t\\r\\n{starts}]/", "TEXT_HEAD")
        markup = self.markup_rule(g, tools, max_calls, chat_template)
        return g.text(f"LEAD_WS {markup} | TEXT_HEAD {free} | LEAD_WS")

    def markup_rule(self, g: LarkGrammar, tools: list[GrammarTool], max_calls: int | None,
                    chat_template: str | None) -> str:
        """The rule (defined in g) of this format's markup for one or more calls of `tools`, at
        most max_calls (None: any number), as the model writes it."""
        raise NotImplementedError(f"the {self.name} tool-call format has no grammar")

    def mid_text_calls(self, g: LarkGrammar, tools: list[GrammarTool],
                       chat_template: str | None) -> list[tuple[str, str]]:
        """(tag, the rest of the markup after it) for each way a call opens in the middle of text;
        [] for a format whose markup only begins the reply (reply_start)."""
        return []

    def _value_end(self, markup: str, start: int) -> int | None:
        """The index after the value (object, list, call) that opens at markup[start]; None
        while it is not closed. Resumes the scan where the previous call stopped."""
        closer = self._closers.get(start)
        if closer is None:
            closer = self._closers[start] = _Closer(start, self.quotes, self.brackets)
        return closer.end(markup)


class _Closer:
    """Finds where the bracket at text[start] closes, skipping strings, in a text that only
    grows between calls: each call scans only the new text, so streaming stays linear."""

    _STRING_BODY = {q: re.compile(rf"(?:[^{q}\\]|\\.)*", re.S) for q in "\"'"}

    def __init__(self, start: int, quotes: str, brackets: tuple[str, str]):
        self._pos = start  # scanned up to here
        self._depth = 0
        self._quote: str | None = None  # inside a string opened by this quote
        self._end: int | None = None
        self._opens, self._closes = brackets
        self._quotes = quotes
        self._next_stop = re.compile("[" + re.escape(quotes + self._opens + self._closes) + "]")

    def end(self, text: str) -> int | None:
        while self._end is None:
            if self._quote is not None:
                pos = self._STRING_BODY[self._quote].match(text, self._pos).end()
                if pos == len(text) or text[pos] != self._quote:  # the text ends inside the string
                    self._pos = pos
                    return None
                self._pos, self._quote = pos + 1, None
                continue
            stop = self._next_stop.search(text, self._pos)
            if stop is None:
                self._pos = len(text)
                return None
            char, self._pos = stop.group(), stop.end()
            if char in self._quotes:
                self._quote = char
            elif char in self._opens:
                self._depth += 1
            else:
                self._depth -= 1
                if self._depth == 0:
                    self._end = self._pos
        return self._end


_JSON_HEAD = re.compile(r'\{\s*"name"\s*:\s*"((?:[^"\\\x00-\x1f]|\\.)*)"\s*,\s*"(arguments|parameters)"\s*:\s*\{')


def loads_json(text: str) -> Any:
    """json.loads without NaN and Infinity, which are not JSON, nor numbers beyond a float's range
    (1e999 would parse to inf, which compact_json cannot write back)."""
    return json.loads(text, parse_constant=_reject_constant, parse_float=_finite_float)


def _finite_float(text: str) -> float:
    value = float(text)
    if value in (float("inf"), float("-inf")):
        raise ValueError(f"{text} is beyond a float's range")
    return value


def _reject_constant(name: str) -> Any:
    raise ValueError(f"{name} is not JSON")


def compact_json(args: dict[str, Any]) -> str:
    return json.dumps(args, ensure_ascii=False, separators=(",", ":"), allow_nan=False)


def undecided(markup: str, final: bool) -> Parsed | None:
    """Markup that cannot be decided yet; at the end of generation, content."""
    return Parsed(len(markup), None) if final else None


def skip_ws(text: str, pos: int) -> int:
    while pos < len(text) and text[pos].isspace():
        pos += 1
    return pos


def json_call(obj: Any, args_keys: tuple[str, ...] = ("arguments", "parameters")) -> tuple[str, dict] | None:
    """(name, arguments) from {"name": ..., "arguments" | "parameters": {...} or a JSON string}."""
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str) or not obj["name"]:
        return None
    args = next((obj[k] for k in args_keys if k in obj), {})
    if isinstance(args, str):
        try:
            args = loads_json(args)
        except ValueError:
            return None
    return (obj["name"], args) if isinstance(args, dict) else None


def json_calls(text: str) -> list[tuple[str, dict]] | None:
    """Calls from a JSON object or a JSON array of objects; None unless all are well-formed."""
    try:
        obj = loads_json(text)
    except ValueError:
        return None
    items = obj if isinstance(obj, list) else [obj]
    calls = [json_call(item) for item in items]
    return calls if calls and None not in calls else None


def tool_schemas(tools: list[dict[str, Any]] | None) -> Schemas:
    """Tool name -> parameters schema, from OpenAI ({"type": "function", "function": {...}}) or
    Anthropic ({"name", "input_schema"}) tool definitions."""
    schemas: Schemas = {}
    for tool in tools or []:
        fn = tool.get("function", tool)
        if isinstance(fn, dict) and isinstance(fn.get("name"), str):
            params = fn.get("parameters", fn.get("input_schema"))
            schemas[fn["name"]] = params if isinstance(params, dict) else {}
    return schemas
