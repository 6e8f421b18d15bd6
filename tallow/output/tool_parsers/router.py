"""Tool-call parsers: a TokenRouter that withholds tool-call markup and parses it into calls.

One parser class per format the models write:

    hermes       <tool_call>{"name": "f", "arguments": {...}}</tool_call>   (Hermes, Qwen2.5, Qwen3)
    qwen3_coder  <tool_call><function=f><parameter=k>v</parameter></function></tool_call>
    llama3_json  <|python_tag|>{"name": "f", "parameters": {...}}; {...}   (the tag is optional
                 when the JSON begins the reply)
    mistral      [TOOL_CALLS][{"name": "f", "arguments": {...}}]  or  [TOOL_CALLS]f[ARGS]{...}
    pythonic     [f(a=1), g(b="x")]   (begins the reply)

The router streams content live and holds back only what may still turn out to be markup:
a tail that may begin a start tag, and the whitespace before it. Markup is withheld until the
parser decides: well-formed calls become ToolCalls (arguments as compact JSON), anything else
goes back into the content, in place. Every decision depends only on the text seen so far, so
the result is the same however the text is cut into tokens.

Whitespace that separates markup from the content is dropped: "Let me look.\\n\\n<tool_call>..."
gives the content "Let me look."; text after a call keeps its separator only when content came
before the call.

Reasoning: the sink's thinking splitter runs after the router, so the router sees <think> blocks
itself and passes them through untouched (tool markup inside reasoning stays reasoning). Like
the splitter, it knows one reasoning block.
"""

from __future__ import annotations

import ast
import json
import re
from dataclasses import dataclass
from typing import Any

from tallow.output.reasoning import ReasoningFormat, prompt_opens_reasoning
from tallow.output.sink import Detokenizer, ToolCall, ToolCallDelta, _partial_suffix_len

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

    start_tags: tuple[str, ...] = ()  # open markup anywhere in the content
    reply_start: str = ""  # characters that open markup when they begin the reply
    markers: tuple[str, ...] = ()  # tags that may be special tokens: never skipped
    quotes, brackets = '"', ("{[", "}]")  # the value syntax, for finding where a value ends

    def __init__(self, schemas: Schemas | None = None):
        self.schemas = schemas or {}
        self._closers: dict[int, _Closer] = {}  # for the current markup, by start

    def parse(self, markup: str, final: bool) -> Parsed | None:
        parsed = self._parse(markup, final)
        if parsed is not None:
            self._closers.clear()
        return parsed

    def _parse(self, markup: str, final: bool) -> Parsed | None:
        raise NotImplementedError

    def _value_end(self, markup: str, start: int) -> int | None:
        """The index after the value (object, list, call) that opens at markup[start]; None
        while it is not closed. Resumes the scan where the previous call stopped."""
        closer = self._closers.get(start)
        if closer is None:
            closer = self._closers[start] = _Closer(start, self.quotes, self.brackets)
        return closer.end(markup)


# ---- shared pieces --------------------------------------------------------------------------


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


def _loads(text: str) -> Any:
    """json.loads without NaN and Infinity, which are not JSON."""
    return json.loads(text, parse_constant=_reject_constant)


def _reject_constant(name: str) -> Any:
    raise ValueError(f"{name} is not JSON")


def _compact(args: dict[str, Any]) -> str:
    return json.dumps(args, ensure_ascii=False, separators=(",", ":"), allow_nan=False)


def _undecided(markup: str, final: bool) -> Parsed | None:
    """Markup that cannot be decided yet; at the end of generation, content."""
    return Parsed(len(markup), None) if final else None


def _skip_ws(text: str, pos: int) -> int:
    while pos < len(text) and text[pos].isspace():
        pos += 1
    return pos


def _json_call(obj: Any, args_keys: tuple[str, ...] = ("arguments", "parameters")) -> tuple[str, dict] | None:
    """(name, arguments) from {"name": ..., "arguments" | "parameters": {...} or a JSON string}."""
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str) or not obj["name"]:
        return None
    args = next((obj[k] for k in args_keys if k in obj), {})
    if isinstance(args, str):
        try:
            args = _loads(args)
        except ValueError:
            return None
    return (obj["name"], args) if isinstance(args, dict) else None


def _json_calls(text: str) -> list[tuple[str, dict]] | None:
    """Calls from a JSON object or a JSON array of objects; None unless all are well-formed."""
    try:
        obj = _loads(text)
    except ValueError:
        return None
    items = obj if isinstance(obj, list) else [obj]
    calls = [_json_call(item) for item in items]
    return calls if calls and None not in calls else None


# ---- the formats ----------------------------------------------------------------------------


class HermesParser(ToolParser):
    """<tool_call>{"name": ..., "arguments": {...}}</tool_call>, one call per block. At the end
    of generation an unclosed block still counts when its JSON is complete."""

    start_tags = ("<tool_call>",)
    markers = ("<tool_call>", "</tool_call>")
    _open, _close = "<tool_call>", "</tool_call>"

    def _parse(self, markup: str, final: bool) -> Parsed | None:
        close = markup.find(self._close, len(self._open))
        if close == -1:
            return Parsed(len(markup), _json_calls(markup[len(self._open):])) if final else None
        return Parsed(close + len(self._close), _json_calls(markup[len(self._open):close]))


_FUNCTION = re.compile(r"\s*<function=([^>\n]+)>(.*?)</function>\s*", re.S)
_PARAMETER = re.compile(r"\s*<parameter=([^>\n]+)>(.*?)(?:</parameter>|(?=<parameter=)|\Z)\s*", re.S)


class Qwen3CoderParser(ToolParser):
    """<tool_call><function=NAME><parameter=KEY>VALUE</parameter>...</function></tool_call>

    The <tool_call> wrapper may be missing (then </function> ends the markup), and so may
    </tool_call> at the end of generation; </parameter> may be left out. Values are
    typed by the tool's JSON schema: integer, number, boolean, null, object and array are
    converted, strings and parameters the schema does not know stay strings; a value that
    does not convert stays a string too.
    """

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
        return _loads(text)
    except ValueError:
        pass
    try:
        value = ast.literal_eval(text)
        _compact({"": value})  # JSON-encodable only: no sets, bytes, NaN
        return value
    except (ValueError, TypeError, SyntaxError, RecursionError, MemoryError):
        return None


class Llama3JsonParser(ToolParser):
    """{"name": ..., "parameters": {...}}, after <|python_tag|> or beginning the reply; several
    calls separated by ";". The markup ends where the JSON sequence does."""

    start_tags = ("<|python_tag|>",)
    reply_start = "{"
    markers = ("<|python_tag|>",)

    def _parse(self, markup: str, final: bool) -> Parsed | None:
        tag = self.start_tags[0]
        pos = end = len(tag) if markup.startswith(tag) else 0
        calls: list[tuple[str, dict]] = []
        while True:
            pos = _skip_ws(markup, pos)
            if pos == len(markup) and not final:
                return None
            if pos == len(markup) or markup[pos] != "{":
                return Parsed(end, calls) if calls else Parsed(max(end, pos, 1), None)
            close = self._value_end(markup, pos)
            if close is None:
                return _undecided(markup, final)
            try:
                call = _json_call(_loads(markup[pos:close]), ("parameters", "arguments"))
            except ValueError:
                call = None
            if call is None:
                return Parsed(close, None)
            calls.append(call)
            pos = end = close
            after = _skip_ws(markup, pos)
            if after == len(markup) and not final:
                return None
            if after == len(markup) or markup[after] != ";":
                return Parsed(end, calls)
            pos = end = after + 1


_MISTRAL_NAME = re.compile(r"[A-Za-z0-9_.\-]+")


class MistralParser(ToolParser):
    """[TOOL_CALLS] followed by a JSON array (or object) of {"name", "arguments"}, or, in the
    newer form, by NAME[ARGS]{...} (optionally NAME[CALL_ID]id[ARGS]{...}), one call per tag."""

    start_tags = ("[TOOL_CALLS]",)
    markers = ("[TOOL_CALLS]", "[ARGS]", "[CALL_ID]")

    def _parse(self, markup: str, final: bool) -> Parsed | None:
        pos = _skip_ws(markup, len(self.start_tags[0]))
        if pos == len(markup):
            return _undecided(markup, final)
        if markup[pos] in "[{":
            close = self._value_end(markup, pos)
            if close is None:
                return _undecided(markup, final)
            return Parsed(close, _json_calls(markup[pos:close]))
        name = _MISTRAL_NAME.match(markup, pos)
        if name is None:
            return Parsed(pos, None)
        pos = name.end()
        if markup.startswith("[CALL_ID]", pos):
            args_at = markup.find("[ARGS]", pos)
            if args_at == -1:
                return _undecided(markup, final)
            pos = args_at
        if markup.startswith("[ARGS]", pos):
            pos += len("[ARGS]")
        elif pos == len(markup) or any(tag.startswith(markup[pos:]) for tag in ("[ARGS]", "[CALL_ID]")):
            return _undecided(markup, final)
        if pos == len(markup):
            return _undecided(markup, final)
        if markup[pos] != "{":
            return Parsed(pos, None)
        close = self._value_end(markup, pos)
        if close is None:
            return _undecided(markup, final)
        try:
            args = _loads(markup[pos:close])
        except ValueError:
            return Parsed(close, None)
        return Parsed(close, [(name.group(), args)] if isinstance(args, dict) else None)


class PythonicParser(ToolParser):
    """[f(a=1), g(b="x")] beginning the reply: a Python list of calls with keyword arguments
    whose values are literals."""

    reply_start = "["
    quotes, brackets = "\"'", ("{[(", "}])")

    def _parse(self, markup: str, final: bool) -> Parsed | None:
        close = self._value_end(markup, 0)
        if close is None:
            return _undecided(markup, final)
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
                _compact(args)  # JSON-encodable only: no sets, bytes, NaN
                calls.append((ast.unparse(node.func), args))
            return calls
        except (SyntaxError, ValueError, TypeError, RecursionError, MemoryError):
            return None


TOOL_PARSERS: dict[str, type[ToolParser]] = {
    "hermes": HermesParser,
    "qwen3_coder": Qwen3CoderParser,
    "llama3_json": Llama3JsonParser,
    "mistral": MistralParser,
    "pythonic": PythonicParser,
}


def tool_parser_for_template(chat_template: str | None) -> str | None:
    """The parser a chat template's tool markup implies, or None when it shows none."""
    if not chat_template:
        return None
    for needle, name in (("<function=", "qwen3_coder"), ("<tool_call>", "hermes"),
                         ("[TOOL_CALLS]", "mistral"), ("<|python_tag|>", "llama3_json"),
                         ('"parameters": dictionary of argument', "llama3_json"),
                         ("[func_name1(", "pythonic")):
        if needle in chat_template:
            return name
    return None


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


# ---- the router -----------------------------------------------------------------------------


class ToolCallRouter:
    """A TokenRouter (see tallow.output.sink) that turns tool-call markup into ToolCalls."""

    def __init__(self, detokenizer: Detokenizer, parser: ToolParser,
                 reasoning: ReasoningFormat | None = None, start_in_reasoning: bool = False,
                 max_calls: int | None = None):
        self._detokenizer = detokenizer
        self._max_calls = max_calls
        self.closed = False  # max_calls reached: all later text is dropped; generation should end
        self._parser = parser
        self._reasoning = reasoning
        self._in_reasoning = reasoning is not None and start_in_reasoning
        self._reasoning_done = False  # one block, as the thinking splitter
        self._buffer = ""  # text not decided yet
        self._in_markup = False
        self._markup_ws = ""  # whitespace before the markup: dropped unless the markup is content
        self._content_started = False  # non-whitespace content released outside reasoning
        self._after_call = False  # a call came last (only whitespace since)
        self._calls: list[ToolCall] = []
        self._deltas: list[ToolCallDelta] = []

    def push(self, token_id: int) -> str:
        return self._advance(self._detokenizer.push(token_id), final=False)

    def flush(self) -> str:
        return self._advance(self._detokenizer.flush(), final=True)

    def take_reasoning(self) -> str:
        return ""  # reasoning passes through, tags included, to the thinking splitter

    def tool_calls(self) -> list[ToolCall]:
        return list(self._calls)

    def take_tool_deltas(self) -> list[ToolCallDelta]:
        """The deltas of the calls parsed since the last call (and forgets them)."""
        deltas, self._deltas = self._deltas, []
        return deltas

    # ---- the state machine ----------------------------------------------------------------

    def _advance(self, text: str, final: bool) -> str:
        if self.closed:
            return ""
        self._buffer += text
        out: list[str] = []
        while True:
            if self.closed:
                self._buffer = ""
                return "".join(out)
            if self._in_reasoning:
                done = self._pass_reasoning(out, final)
            elif self._in_markup:
                done = self._parse_markup(out, final)
            else:
                done = self._scan_content(out, final)
            if done:
                return "".join(out)

    def _pass_reasoning(self, out: list[str], final: bool) -> bool:
        close = self._reasoning.close_tag
        at = self._buffer.find(close)
        if at == -1:
            keep = 0 if final else _partial_suffix_len(self._buffer, (close,))
            out.append(self._buffer[:len(self._buffer) - keep])
            self._buffer = self._buffer[len(self._buffer) - keep:]
            return True
        out.append(self._buffer[:at + len(close)])
        self._buffer = self._buffer[at + len(close):]
        self._in_reasoning, self._reasoning_done = False, True
        return False

    def _parse_markup(self, out: list[str], final: bool) -> bool:
        parsed = self._parser.parse(self._buffer, final)
        if parsed is None:
            return True
        markup, self._buffer = self._buffer[:parsed.end], self._buffer[parsed.end:]
        ws, self._markup_ws = self._markup_ws, ""
        self._in_markup = False
        if parsed.calls is None:
            self._release(out, ws + markup)
        else:
            for name, args in parsed.calls:
                self._add_call(name, args)
                if self._max_calls is not None and len(self._calls) >= self._max_calls:
                    self.closed = True
                    break
            self._after_call = True
        return False

    def _scan_content(self, out: list[str], final: bool) -> bool:
        text = self._buffer
        at, tag = self._next_tag(text)
        if tag is None:
            hold = 0 if final else _partial_suffix_len(text, self._tags())
            body = text[:len(text) - hold]
            # Trailing whitespace waits to see whether markup follows; at the end it is
            # content, unless it follows a call.
            lead = body.rstrip()
            self._release(out, lead)
            self._buffer = text[len(lead):]
            if final:
                if not self._after_call:
                    self._release(out, self._buffer)
                self._buffer = ""
            return True
        before, self._buffer = text[:at], text[at:]
        if self._reasoning is not None and tag == self._reasoning.open_tag:
            self._release(out, before)
            out.append(tag)
            self._buffer = self._buffer[len(tag):]
            self._in_reasoning = True
            return False
        lead = before.rstrip()
        self._release(out, lead)
        self._markup_ws = before[len(lead):]
        self._in_markup = True
        return False

    def _tags(self) -> list[str]:
        tags = list(self._parser.start_tags)
        if self._reasoning is not None and not self._reasoning_done:
            tags.append(self._reasoning.open_tag)
        return tags

    def _next_tag(self, text: str) -> tuple[int, str | None]:
        """The earliest tag that opens markup or reasoning in text."""
        best, best_tag = len(text), None
        for tag in self._tags():
            at = text.find(tag)
            if at != -1 and at < best:
                best, best_tag = at, tag
        if not self._content_started:
            first = _skip_ws(text, 0)
            if first < best and text[first] in self._parser.reply_start:
                best, best_tag = first, text[first]
        return best, best_tag

    def _release(self, out: list[str], text: str) -> None:
        """Release content; whitespace between a call and the first content is dropped."""
        if self._after_call and not self._content_started:
            text = text.lstrip()
        if text.strip():
            self._content_started, self._after_call = True, False
        out.append(text)

    def _add_call(self, name: str, args: dict[str, Any]) -> None:
        call = ToolCall.create(name, _compact(args))
        self._deltas += ToolCallDelta.whole(len(self._calls), call)
        self._calls.append(call)


def make_tool_router(tokenizer, parser_name: str, *, tools: list[dict[str, Any]] | None = None,
                     reasoning: ReasoningFormat | None = None, prompt_text: str = "",
                     skip_special_tokens: bool = True, max_calls: int | None = None) -> ToolCallRouter:
    """A ToolCallRouter for a request.

    tokenizer: a tallow Tokenizer. The parser's marker tags stay visible even when special
    tokens are skipped (Mistral's [TOOL_CALLS] and Llama 3's <|python_tag|> are special
    tokens). reasoning: the format the sink's thinking splitter splits on (None when it does
    not split); prompt_text tells whether the reply starts inside a reasoning block. max_calls:
    the router closes after that many calls (parallel_tool_calls: false).
    """
    if parser_name not in TOOL_PARSERS:
        raise ValueError(f"unknown tool-call parser {parser_name!r}; known: {', '.join(TOOL_PARSERS)}")
    parser = TOOL_PARSERS[parser_name](tool_schemas(tools))
    markers = {tokenizer.token_to_id(tag) for tag in parser.markers}
    detokenizer = Detokenizer(tokenizer.token_bytes, tokenizer.special_token_ids - markers,
                              skip_special_tokens)
    start_in_reasoning = reasoning is not None and prompt_opens_reasoning(prompt_text, reasoning)
    return ToolCallRouter(detokenizer, parser, reasoning, start_in_reasoning, max_calls)
