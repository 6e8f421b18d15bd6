"""Pydantic wire models for Anthropic's Messages API request bodies, and their translation into
the OpenAI-shaped messages and tools that the chat template takes.

Anthropic puts tool calls and tool results in content blocks: an assistant turn's tool_use
blocks become its tool_calls, a user turn's tool_result blocks become "tool" messages (before
the turn's text, as Anthropic requires them to come first), thinking blocks become the
assistant's reasoning_content. Limits that depend on the server or the model are checked in
the protocol.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import Field

from tallow.serve.protocols.openai_schemas import Count, WireModel


class TextBlock(WireModel):
    type: Literal["text"]
    text: str


class ThinkingBlock(WireModel):
    type: Literal["thinking"]
    thinking: str
    signature: str | None = None


class RedactedThinkingBlock(WireModel):
    type: Literal["redacted_thinking"]
    data: str


class ToolUseBlock(WireModel):
    type: Literal["tool_use"]
    id: str
    name: str
    input: dict[str, Any]


class ToolResultBlock(WireModel):
    type: Literal["tool_result"]
    tool_use_id: str
    content: str | list[TextBlock] = ""
    is_error: bool = False

    def text(self) -> str:
        return self.content if isinstance(self.content, str) else _join(self.content)

    def template_content(self) -> str:
        """The tool message's content: a failed run (is_error) says so, or the model takes its
        output for a result."""
        text = self.text()
        if not self.is_error:
            return text
        return f"Error: {text}" if text else "Error"


ContentBlock = Annotated[TextBlock | ThinkingBlock | RedactedThinkingBlock | ToolUseBlock | ToolResultBlock,
                         Field(discriminator="type")]


class MessageParam(WireModel):
    # "system": a mid-conversation system message (the mid-conversation-system beta Claude Code uses).
    role: Literal["user", "assistant", "system"]
    content: str | list[ContentBlock]

    def text(self) -> str:
        return self.content if isinstance(self.content, str) else _join(
            b for b in self.content if isinstance(b, TextBlock))

    def has_tool_use(self) -> bool:
        return not isinstance(self.content, str) and any(isinstance(b, ToolUseBlock) for b in self.content)

    def is_empty(self) -> bool:
        """No text, thinking or tool block with anything in it."""
        if isinstance(self.content, str):
            return not self.content
        return all(isinstance(b, TextBlock) and not b.text for b in self.content)

    def to_template(self) -> list[dict[str, Any]]:
        """This turn as chat-template messages (a user turn with tool results gives several)."""
        if isinstance(self.content, str):
            return [{"role": self.role, "content": self.content}]
        blocks = self.content
        text = _join(b for b in blocks if isinstance(b, TextBlock))
        if self.role == "system":
            return [{"role": "system", "content": text}]
        if self.role == "user":
            results = [{"role": "tool", "tool_call_id": b.tool_use_id, "content": b.template_content()}
                       for b in blocks if isinstance(b, ToolResultBlock)]
            return results + ([{"role": "user", "content": text}] if text or not results else [])
        message: dict[str, Any] = {"role": "assistant", "content": text}
        thinking = "".join(b.thinking for b in blocks if isinstance(b, ThinkingBlock))
        if thinking:
            message["reasoning_content"] = thinking
        calls = [{"id": b.id, "type": "function", "function": {"name": b.name, "arguments": b.input}}
                 for b in blocks if isinstance(b, ToolUseBlock)]
        if calls:
            message["tool_calls"] = calls
        return [message]


class Tool(WireModel):
    # Client tools have no type (or "custom"); Anthropic's server tools (web_search_..., bash_...)
    # name theirs, and this server runs none of them.
    type: str | None = None
    name: str = Field(min_length=1, max_length=128)
    description: str | None = None
    input_schema: dict[str, Any] | None = None  # required of client tools (the protocol checks)
    strict: bool | None = None  # true: the call's input follows input_schema exactly (a grammar)

    def to_openai(self) -> dict[str, Any]:
        function = {"name": self.name, "parameters": self.input_schema}
        if self.strict:
            function["strict"] = True
        if self.description is not None:
            function["description"] = self.description
        return {"type": "function", "function": function}


class ToolChoice(WireModel):
    type: Literal["auto", "any", "tool", "none"]
    name: str | None = None
    disable_parallel_tool_use: bool | None = None


class ThinkingConfig(WireModel):
    type: Literal["enabled", "adaptive", "disabled"]
    budget_tokens: Count | None = Field(default=None, ge=1)


class KeepThinkingTurns(WireModel):
    type: Literal["thinking_turns"]
    value: Count = Field(ge=0)


class ContextEdit(WireModel):
    # clear_thinking_*: thinking blocks of earlier assistant turns are left out of the prompt;
    # `keep` says how many of the latest turns with thinking keep theirs (default 1, or "all").
    type: str
    keep: Literal["all"] | KeepThinkingTurns | None = None


class ContextManagement(WireModel):
    edits: list[ContextEdit] = []


class JsonOutputFormat(WireModel):
    type: Literal["json_schema"]
    schema_: dict[str, Any] = Field(alias="schema")


class OutputConfig(WireModel):
    """output_config: a JSON schema the reply's text must follow; effort (low / medium / high /
    xhigh / max: any of them) turns reasoning on where the request does not set thinking."""

    format: JsonOutputFormat | None = None
    effort: Literal["low", "medium", "high", "xhigh", "max"] | None = None


class MessagesInput(WireModel):
    """What decides the prompt: the body of count_tokens, and the base of a Messages request."""

    model: str | None = None
    messages: list[MessageParam] = Field(min_length=1)
    system: str | list[TextBlock] | None = None
    tools: list[Tool] | None = None
    tool_choice: ToolChoice | None = None
    thinking: ThinkingConfig | None = None
    context_management: ContextManagement | None = None
    output_config: OutputConfig | None = None
    output_format: JsonOutputFormat | None = None  # the older beta name of output_config.format

    @property
    def thinking_enabled(self) -> bool:
        if self.thinking is None:
            return self.output_config is not None and self.output_config.effort is not None
        return self.thinking.type != "disabled"

    def prefill(self) -> str | None:
        """The text the reply continues (Anthropic's prefill): the final message's, when it is an
        assistant turn with text and no tool_use; else None (a final turn with tool_use stays a
        finished turn, and the reply is a new one)."""
        last = self.messages[-1]
        if last.role != "assistant" or last.has_tool_use():
            return None
        return last.text() or None

    def template_messages(self, merge_system: bool = False) -> list[dict[str, Any]]:
        """The chat template's messages. System messages inside `messages` are system turns in
        place, or with merge_system joined to the system prompt in order (for templates that
        cannot render a system turn there)."""
        system = self.system if isinstance(self.system, str) or self.system is None else _join(self.system)
        systems = [system] if system else []
        out: list[dict[str, Any]] = []
        for k, message in enumerate(self.messages):
            if k == len(self.messages) - 1 and message.role == "assistant" and message.is_empty():
                continue  # an empty final assistant turn: no prefill, the reply is a new turn
            if merge_system and message.role == "system":
                systems.append(message.text())
            else:
                out += message.to_template()
        if systems:
            out.insert(0, {"role": "system", "content": "\n\n".join(systems)})
        return self._clear_thinking(out)

    def _clear_thinking(self, messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
        """context_management's clear_thinking edits: reasoning dropped from all but the latest
        `keep` assistant turns that have it."""
        keep = None
        for edit in (self.context_management.edits if self.context_management else []):
            if edit.type.startswith("clear_thinking"):
                keep = edit.keep if edit.keep is not None else KeepThinkingTurns(type="thinking_turns", value=1)
        if keep is None or keep == "all":
            return messages
        thinking = [i for i, m in enumerate(messages) if m.get("reasoning_content")]
        for i in thinking[:max(len(thinking) - keep.value, 0)]:
            messages[i] = {k: v for k, v in messages[i].items() if k != "reasoning_content"}
        return messages

    def has_mid_system(self) -> bool:
        return any(m.role == "system" for m in self.messages)


class MessagesRequest(MessagesInput):
    max_tokens: Count = Field(ge=1)
    temperature: float | None = Field(default=None, ge=0.0, le=1.0)
    top_p: float | None = Field(default=None, gt=0.0, le=1.0)
    top_k: Count | None = Field(default=None, ge=0)  # above the vocabulary: clamped to it (plan.py)
    stop_sequences: list[str] | None = None
    stream: bool = False
    metadata: dict[str, Any] | None = None
    speculative: bool = True  # tallow extra: false keeps this request from speculating


def _join(blocks) -> str:
    return "\n".join(b.text for b in blocks)
