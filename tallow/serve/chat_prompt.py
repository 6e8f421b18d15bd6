"""Chat messages + tools -> prompt text, and which parsers read the reply.

Shared by every chat protocol (they translate their messages, tools and tool_choice into the
OpenAI shapes first):

- tools go through the template's own tools section. A template that does not read `tools`
  (SmolLM2's, plain ChatML) gets the fallback: a "# Tools" section in the system prompt that
  describes them in the hermes format (Qwen2.5's wording), assistant tool calls written back
  as <tool_call> markup and tool results as <tool_response> user turns; the reply is then read
  with the hermes parser.
- tool_choice: "auto" renders the tools and parses calls; "none" renders no tools and parses
  nothing (markup in the reply is content). "required" and a named function render the tools
  and are enforced by a grammar of the parser's markup (tallow/serve/structured.py); a named
  function must be one of the tools.
- reasoning: reasoning_effort "none" turns thinking off (enable_thinking=False) where the
  template supports it; chat_template_kwargs pass through and win over it.
- client text stays text: a special token's string in what the client sent (message content,
  tool definitions, tool-call arguments) is a literal span of the prompt (ChatTemplate.render_prompt),
  tokenized as ordinary characters, so "<|im_end|><|im_start|>assistant" in a user message cannot
  forge a turn; --allow-special-tokens-in-content turns this off.

The parsers: --tool-call-parser / --reasoning-parser when set, else what the template implies
(a tools section whose markup names no known format gets no parser: the markup stays content).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from tallow.chat_template import ChatTemplate, RenderedPrompt
from tallow.config import ServerConfig
from tallow.errors import TallowError
from tallow.output.reasoning import REASONING_PARSERS, reasoning_parser_for_template
from tallow.output.tool_parsers import TOOL_PARSERS, tool_parser_for_template
from tallow.serve.access_log import mark_phase

# chat_template_kwargs may not override what the request sets through its own fields, nor the
# server's time limit.
RESERVED_TEMPLATE_ARGS = frozenset({"messages", "tools", "add_generation_prompt", "timeout_s"})

FALLBACK_TOOL_PARSER = "hermes"

_TOOLS_SECTION = (
    "# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
    "You are provided with function signatures within <tools></tools> XML tags:\n<tools>\n{tools}\n</tools>\n\n"
    "For each function call, return a json object with function name and arguments within "
    "<tool_call></tool_call> XML tags:\n<tool_call>\n"
    '{{"name": <function-name>, "arguments": <args-json-object>}}\n</tool_call>'
)


@dataclass(frozen=True)
class ChatPrompt:
    text: str
    tool_parser: str | None  # None: tool-call markup in the reply stays content
    reasoning_parser: str  # "none": reasoning is not split out
    tools: list[dict[str, Any]] | None  # the tools rendered (their schemas type parsed values)
    # Where client text holds a special token's string: tokenize(..., literal_spans=) keeps it text.
    literal_spans: tuple[tuple[int, int], ...] = ()
    template_source: str | None = None  # the chat template's text: a tool-call format's variant
    turn_start: int = 0  # where the model's own turn begins in text (see model_turn)

    @property
    def model_turn(self) -> str:
        """The prompt from where the model's turn begins: the generation prompt after the last
        message, or the last (assistant) message that a reply continues. Whether the reply starts
        inside a reasoning block is read from it alone (tallow.output.reasoning)."""
        return self.text[self.turn_start:]


def render_chat(template: ChatTemplate, messages: list[dict[str, Any]], config: ServerConfig, *,
                tools: list[dict[str, Any]] | None = None, tool_choice: str | dict[str, Any] | None = None,
                reasoning_effort: str | None = None, template_kwargs: dict[str, Any] | None = None,
                add_generation_prompt: bool = True, continue_final_message: bool = False) -> ChatPrompt:
    """Render a chat request (OpenAI-shaped messages, tools and tool_choice).

    continue_final_message (vLLM's): the prompt ends where the last message's content ends, so the
    reply continues it (the template's end-of-turn markup after it is cut off, as vLLM does).

    Raises TallowError: 400 for a tool_choice that cannot be honoured or a template that fails,
    500 for a parser name in the server config that does not exist.
    """
    check_tool_choice(tool_choice, tools)
    # Until tests/serve_utils.py's ChatMLTemplate stand-in has these traits, it counts as plain ChatML.
    source = getattr(template, "source", None)
    kwargs = {k: v for k, v in (template_kwargs or {}).items() if k not in RESERVED_TEMPLATE_ARGS}
    if reasoning_effort == "none" and getattr(template, "supports_thinking", False):
        kwargs.setdefault("enable_thinking", False)
    tools = tools if tools and tool_choice != "none" else None
    mark_phase("parse")
    if getattr(template, "supports_tools", False):
        rendered = _render(template, messages, tools, add_generation_prompt, config, kwargs, continue_final_message)
        implied = tool_parser_for_template(source)
    else:
        rendered = _render(template, hermes_fallback_messages(messages, tools), None, add_generation_prompt,
                           config, kwargs, continue_final_message)
        implied = FALLBACK_TOOL_PARSER
    mark_phase("template")
    tool_parser = _configured(config.tool_call_parser, TOOL_PARSERS, "tool-call") or implied
    reasoning_parser = (_configured(config.reasoning_parser, REASONING_PARSERS, "reasoning")
                        or reasoning_parser_for_template(source))
    return ChatPrompt(rendered.text, tool_parser if tools else None, reasoning_parser, tools, rendered.literal_spans,
                      source, _turn_start(rendered.text, messages, continue_final_message))


def _turn_start(text: str, messages: list[dict[str, Any]], continued: bool) -> int:
    """Where the model's turn begins in the rendered prompt: a continued last message's content
    (the prompt ends with it), else the end of the last message's content as rendered (its last
    occurrence); 0 when the template changed that content past finding (the whole prompt)."""
    content = messages[-1].get("content") if messages else None
    if isinstance(content, list):
        content = "\n".join(p.get("text", "") for p in content if isinstance(p, dict))
    if not isinstance(content, str) or not content:
        return 0
    if continued:
        return max(len(text) - len(content), 0) if text.endswith(content) else 0
    at = text.rfind(content)
    return at + len(content) if at >= 0 else 0


def _render(template: ChatTemplate, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None,
            add_generation_prompt: bool, config: ServerConfig, kwargs: dict[str, Any],
            continue_final_message: bool = False) -> RenderedPrompt:
    """The template's prompt, client text kept literal unless the server allows special tokens in it."""
    if not hasattr(template, "render_prompt"):  # tests/serve_utils.py's ChatMLTemplate stand-in
        rendered = RenderedPrompt(template.render(messages, tools=tools, add_generation_prompt=add_generation_prompt,
                                                  timeout_s=config.template_timeout_s, **kwargs))
        return _cut_after_final_message(rendered, messages) if continue_final_message else rendered
    return template.render_prompt(messages, tools=tools, add_generation_prompt=add_generation_prompt,
                                  continue_final_message=continue_final_message,
                                  timeout_s=config.template_timeout_s,
                                  literal_special_tokens=not config.allow_special_tokens_in_content, **kwargs)


def _cut_after_final_message(rendered: RenderedPrompt, messages: list[dict[str, Any]]) -> RenderedPrompt:
    """For a template object without render_prompt (a plain `render`): the prompt up to the end of
    the last message's content (its last occurrence, as vLLM). ChatTemplate does it itself, as
    transformers does."""
    content = messages[-1].get("content") if messages else None
    at = rendered.text.rfind(content) if content else -1
    if at < 0:
        raise TallowError("continue_final_message needs a last message with text content that the chat "
                          "template renders as given", param="continue_final_message")
    end = at + len(content)
    spans = tuple((start, min(stop, end)) for start, stop in rendered.literal_spans if start < end)
    return RenderedPrompt(rendered.text[:end], spans)


def check_tool_choice(tool_choice: str | dict[str, Any] | None, tools: list[dict[str, Any]] | None = None) -> None:
    """"auto", "none" (None means "auto"), "required" and a named function ({"type": "function",
    "function": {"name"}}); the last two need tools, and the name must be one of them."""
    if tool_choice in (None, "auto", "none"):
        return
    names = [t.get("function", t).get("name") for t in tools or []]
    if not names:
        what = "'required'" if tool_choice == "required" else "a named function"
        raise TallowError(f"tool_choice {what} needs tools", param="tool_choice")
    if isinstance(tool_choice, dict):
        name = tool_choice.get("function", tool_choice).get("name")
        if name not in names:
            raise TallowError(f"tool_choice names the function {name!r}, which is not among the tools "
                              f"({', '.join(map(str, names))})", param="tool_choice.function.name")


def hermes_fallback_messages(messages: list[dict[str, Any]],
                             tools: list[dict[str, Any]] | None) -> list[dict[str, Any]]:
    """Messages for a template without a tools section: the tools described in the system
    prompt, assistant tool calls as <tool_call> markup, tool results as <tool_response> user
    turns (consecutive results share one turn)."""
    out: list[dict[str, Any]] = []
    previous_role = None
    for message in messages:
        role = message.get("role")
        if role == "assistant" and message.get("tool_calls"):
            markup = [_tool_call_markup(call) for call in message["tool_calls"]]
            text = "\n".join(([message["content"]] if message.get("content") else []) + markup)
            out.append({**{k: v for k, v in message.items() if k != "tool_calls"}, "content": text})
        elif role == "tool":
            response = f"<tool_response>\n{message.get('content') or ''}\n</tool_response>"
            if previous_role == "tool":
                out[-1]["content"] += "\n" + response
            else:
                out.append({"role": "user", "content": response})
        else:
            out.append(message)
        previous_role = role
    if tools:
        section = _TOOLS_SECTION.format(tools="\n".join(json.dumps(t, ensure_ascii=False) for t in tools))
        if out and out[0].get("role") == "system":
            out[0] = {**out[0], "content": f"{out[0].get('content') or ''}\n\n{section}"}
        else:
            out.insert(0, {"role": "system", "content": section})
    return out


def _tool_call_markup(call: dict[str, Any]) -> str:
    function = call.get("function", call)
    arguments = function.get("arguments", {})
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments)
        except (json.JSONDecodeError, RecursionError):
            pass  # written as given: the model sees what it was sent
    body = json.dumps({"name": function.get("name"), "arguments": arguments}, ensure_ascii=False)
    return f"<tool_call>\n{body}\n</tool_call>"


def _configured(name: str | None, known: dict, kind: str) -> str | None:
    if name is not None and name not in known:
        raise TallowError(f"the server is configured with an unknown {kind} parser {name!r}; known: "
                          f"{', '.join(known)}", status=500, type="server_error")
    return name
