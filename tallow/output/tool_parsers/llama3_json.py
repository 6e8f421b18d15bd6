"""llama3_json: <|python_tag|>{"name": "f", "parameters": {...}}; {...} (the tag is optional when
the JSON begins the reply)."""

from __future__ import annotations

from tallow.output.tool_parsers.base import Parsed, ToolParser, json_call, loads_json, skip_ws, undecided
from tallow.output.tool_parsers.grammar import GrammarTool, LarkGrammar
from tallow.output.tool_parsers.input_grammar import call_object
from tallow.output.tool_parsers.streaming import PartialCall


class Llama3JsonParser(ToolParser):
    """{"name": ..., "parameters": {...}}, after <|python_tag|> or beginning the reply; several
    calls separated by ";". The markup ends where the JSON sequence does."""

    name = "llama3_json"
    start_tags = ("<|python_tag|>",)
    reply_start = "{"
    markers = ("<|python_tag|>",)

    def _parse(self, markup: str, final: bool) -> Parsed | None:
        tag = self.start_tags[0]
        pos = end = len(tag) if markup.startswith(tag) else 0
        calls: list[tuple[str, dict]] = []
        while True:
            pos = skip_ws(markup, pos)
            if pos == len(markup) and not final:
                return None
            if pos == len(markup) or markup[pos] != "{":
                return Parsed(end, calls) if calls else Parsed(max(end, pos, 1), None)
            close = self._value_end(markup, pos)
            if close is None:
                return undecided(markup, final)
            try:
                call = json_call(loads_json(markup[pos:close]), ("parameters", "arguments"))
            except ValueError:
                call = None
            if call is None:
                return Parsed(close, None)
            calls.append(call)
            pos = end = close
            after = skip_ws(markup, pos)
            if after == len(markup) and not final:
                return None
            if after == len(markup) or markup[after] != ";":
                return Parsed(end, calls)
            pos = end = after + 1

    # The markup as Llama 3.1+ writes custom tool calls: {"name": ..., "parameters": {...}} beginning
    # the reply (several joined by "; "), or after <|python_tag|> in the middle of text.
    def markup_rule(self, g: LarkGrammar, tools: list[GrammarTool], max_calls: int | None,
                    chat_template: str | None) -> str:
        call = g.add(call_object(g, tools, args_key="parameters"))
        return g.repeat(call, '"; "', max_calls)

    def mid_text_calls(self, g: LarkGrammar, tools: list[GrammarTool],
                       chat_template: str | None) -> list[tuple[str, str]]:
        return [(self.start_tags[0], self.markup_rule(g, tools, None, chat_template))]
    def partial(self, markup: str) -> list[PartialCall]:
        tag = self.start_tags[0]
        start = len(tag) if markup.startswith(tag) else 0
        return self._json_object_calls(markup, start, len(markup), ";", ("parameters", "arguments"))
