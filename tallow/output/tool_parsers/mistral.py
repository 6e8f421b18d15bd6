"""mistral: [TOOL_CALLS][{"name": "f", "arguments": {...}}]  or  [TOOL_CALLS]f[ARGS]{...}."""

from __future__ import annotations

import re
import secrets
import string

from tallow.output.tool_parsers.base import Parsed, ToolParser, json_calls, loads_json, skip_ws, undecided
from tallow.output.tool_parsers.grammar import GrammarTool, LarkGrammar, call_object_schema, json_rule, lit
from tallow.output.tool_parsers.input_grammar import arguments_object, call_object
from tallow.output.tool_parsers.streaming import JsonArgsStream, PartialCall


_MISTRAL_NAME = re.compile(r"[A-Za-z0-9_.\-]+")
_ID_CHARACTERS = string.ascii_letters + string.digits


class MistralParser(ToolParser):
    """[TOOL_CALLS] followed by a JSON array (or object) of {"name", "arguments"}, or, in the
    newer form, by NAME[ARGS]{...} (optionally NAME[CALL_ID]id[ARGS]{...}), one call per tag."""

    name = "mistral"
    start_tags = ("[TOOL_CALLS]",)
    markers = ("[TOOL_CALLS]", "[ARGS]", "[CALL_ID]")

    def new_call_id(self) -> str:
        """Nine letters and digits: Mistral's templates refuse any other id when the call comes
        back in the conversation (vLLM's Mistral parser makes the same)."""
        return "".join(secrets.choice(_ID_CHARACTERS) for _ in range(9))

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

    # The markup in the form the template writes: [TOOL_CALLS]NAME[ARGS]{...} per call when the
    # template knows [ARGS] (tokenizer v11+), else [TOOL_CALLS][{"name": ..., "arguments": {...}}, ...].
    def markup_rule(self, g: LarkGrammar, tools: list[GrammarTool], max_calls: int | None,
                    chat_template: str | None) -> str:
        tag = g.tag(self.start_tags[0])
        if _named_form(chat_template):
            return g.repeat(g.add(f"{tag} {self._named_calls(g, tools)}"), None, max_calls)
        return g.add(f"{tag} {self._array(g, tools, max_calls)}")

    def mid_text_calls(self, g: LarkGrammar, tools: list[GrammarTool],
                       chat_template: str | None) -> list[tuple[str, str]]:
        if _named_form(chat_template):
            return [(self.start_tags[0], self._named_calls(g, tools))]
        return [(self.start_tags[0], self._array(g, tools, None))]

    def _array(self, g: LarkGrammar, tools: list[GrammarTool], max_calls: int | None) -> str:
        if any(tool.input_grammar is not None for tool in tools):  # the array written in Lark
            return g.add(f'"[" {g.repeat(call_object(g, tools), lit(", "), max_calls)} "]"')
        array = {"type": "array", "items": call_object_schema(tools), "minItems": 1}
        if max_calls is not None:
            array["maxItems"] = max_calls
        items = array["items"]
        if "$defs" in items:  # the references resolve from the array's root
            array["$defs"] = items.pop("$defs")
        return g.add(json_rule(array))

    def _named_calls(self, g: LarkGrammar, tools: list[GrammarTool]) -> str:
        return g.add(" | ".join(f"{lit(tool.name)} {g.tag('[ARGS]')} {arguments_object(g, tool)}" for tool in tools))

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


def _named_form(chat_template: str | None) -> bool:
    return bool(chat_template) and "[ARGS]" in chat_template
