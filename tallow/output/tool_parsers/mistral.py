"""mistral: [TOOL_CALLS][{"name": "f", "arguments": {...}}]  or  [TOOL_CALLS]f[ARGS]{...}."""

from __future__ import annotations

import re

from tallow.output.tool_parsers.base import Parsed, ToolParser, json_calls, loads_json, skip_ws, undecided
from tallow.output.tool_parsers.streaming import JsonArgsStream, PartialCall


_MISTRAL_NAME = re.compile(r"[A-Za-z0-9_.\-]+")


class MistralParser(ToolParser):
    """[TOOL_CALLS] followed by a JSON array (or object) of {"name", "arguments"}, or, in the
    newer form, by NAME[ARGS]{...} (optionally NAME[CALL_ID]id[ARGS]{...}), one call per tag."""

    name = "mistral"
    start_tags = ("[TOOL_CALLS]",)
    markers = ("[TOOL_CALLS]", "[ARGS]", "[CALL_ID]")

    def _parse(self, markup: str, final: bool) -> Parsed | None:
        pos = skip_ws(markup, len(self.start_tags[0]))
        if pos == len(markup):
            return undecided(markup, final)
        if markup[pos] in "[{":
            close = self._value_end(markup, pos)
            if close is None:
                return undecided(markup, final)
            return Parsed(close, json_calls(markup[pos:close]))
        name = _MISTRAL_NAME.match(markup, pos)
        if name is None:
            return Parsed(pos, None)
        pos = name.end()
        if markup.startswith("[CALL_ID]", pos):
            args_at = markup.find("[ARGS]", pos)
            if args_at == -1:
                return undecided(markup, final)
            pos = args_at
        if markup.startswith("[ARGS]", pos):
            pos += len("[ARGS]")
        elif pos == len(markup) or any(tag.startswith(markup[pos:]) for tag in ("[ARGS]", "[CALL_ID]")):
            return undecided(markup, final)
        if pos == len(markup):
            return undecided(markup, final)
        if markup[pos] != "{":
            return Parsed(pos, None)
        close = self._value_end(markup, pos)
        if close is None:
            return undecided(markup, final)
        try:
            args = loads_json(markup[pos:close])
        except ValueError:
            return Parsed(close, None)
        return Parsed(close, [(name.group(), args)] if isinstance(args, dict) else None)

    def partial(self, markup: str) -> list[PartialCall]:
        pos = skip_ws(markup, len(self.start_tags[0]))
        if pos == len(markup):
            return []
        if markup[pos] == "[":
            return self._json_object_calls(markup, pos + 1, len(markup), ",")
        if markup[pos] == "{":
            return self._json_object_calls(markup, pos, len(markup), None)
        name = _MISTRAL_NAME.match(markup, pos)
        if name is None:
            return []
        pos = name.end()
        if markup.startswith("[CALL_ID]", pos):
            pos = markup.find("[ARGS]", pos)
            if pos == -1:
                return []
        if not markup.startswith("[ARGS]{", pos):
            return []
        start = pos + len("[ARGS]")
        stream = self._streams.get(start)
        if stream is None:
            stream = self._streams[start] = JsonArgsStream(start)
        stream.feed(markup)
        return [PartialCall(name.group(), stream.out, stream.done)]
