"""hermes: <tool_call>{"name": "f", "arguments": {...}}</tool_call> (Hermes, Qwen2.5, Qwen3)."""

from __future__ import annotations

from tallow.output.partial_match import partial_suffix_len
from tallow.output.tool_parsers.base import Parsed, ToolParser, json_calls
from tallow.output.tool_parsers.grammar import GrammarTool, LarkGrammar
from tallow.output.tool_parsers.input_grammar import call_object
from tallow.output.tool_parsers.streaming import PartialCall


class HermesParser(ToolParser):
    """<tool_call>{"name": ..., "arguments": {...}}</tool_call>, one call per block. At the end
    of generation an unclosed block still counts when its JSON is complete."""

    name = "hermes"
    start_tags = ("<tool_call>",)
    markers = ("<tool_call>", "</tool_call>")
    _open, _close = "<tool_call>", "</tool_call>"

    def _parse(self, markup: str, final: bool) -> Parsed | None:
        close = markup.find(self._close, len(self._open))
        if close == -1:
            return Parsed(len(markup), json_calls(markup[len(self._open):])) if final else None
        return Parsed(close + len(self._close), json_calls(markup[len(self._open):close]))

    # The markup as the templates write it: <tool_call>\n{"name": ..., "arguments": {...}}\n</tool_call>,
    # calls one per line.
    def markup_rule(self, g: LarkGrammar, tools: list[GrammarTool], max_calls: int | None,
                    chat_template: str | None) -> str:
        call = g.add(f"{g.tag(self._open)} {self._rest(g, tools)}")
        return g.repeat(call, '"\\n"', max_calls)

    def mid_text_calls(self, g: LarkGrammar, tools: list[GrammarTool],
                       chat_template: str | None) -> list[tuple[str, str]]:
        return [(self._open, self._rest(g, tools))]

    def _rest(self, g: LarkGrammar, tools: list[GrammarTool]) -> str:
        return g.add(f'"\\n" {call_object(g, tools)} "\\n" {g.tag(self._close)}')
    def partial(self, markup: str) -> list[PartialCall]:
        close = markup.find(self._close, len(self._open))
        limit = close if close != -1 else len(markup) - partial_suffix_len(markup, (self._close,))
        return self._json_object_calls(markup, len(self._open), limit, None)
