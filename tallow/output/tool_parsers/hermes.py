"""hermes: <tool_call>{"name": "f", "arguments": {...}}</tool_call> (Hermes, Qwen2.5, Qwen3)."""

from __future__ import annotations

from tallow.output.tool_parsers.base import Parsed, ToolParser, json_calls


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
