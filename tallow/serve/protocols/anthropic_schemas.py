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


ContentBlock = Annotated[TextBlock | ThinkingBlock | RedactedThinkingBlock | ToolUseBlock | ToolResultBlock,
                         Field(discriminator="type")]


class MessageParam(WireModel):
    role: Literal["user", "assistant"]
    content: str | list[ContentBlock]

    def to_template(self) -> list[dict[str, Any]]:
        """This turn as chat-template messages (a user turn with tool results gives several)."""
        if isinstance(self.content, str):
            return [{"role": self.role, "content": self.content}]
        blocks = self.content
        text = _join(b for b in blocks if isinstance(b, TextBlock))
        if self.role == "user":
            results = [{"role": "tool", "tool_call_id": b.tool_use_id, "content": b.text()}
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

    def to_openai(self) -> dict[str, Any]:
        function = {"name": self.name, "parameters": self.input_schema}
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


class MessagesInput(WireModel):
    """What decides the prompt: the body of count_tokens, and the base of a Messages request."""

    model: str | None = None
    messages: list[MessageParam] = Field(min_length=1)
    system: str | list[TextBlock] | None = None
    tools: list[Tool] | None = None
    tool_choice: ToolChoice | None = None
    thinking: ThinkingConfig | None = None

    @property
    def thinking_enabled(self) -> bool:
        return self.thinking is not None and self.thinking.type != "disabled"

    def template_messages(self) -> list[dict[str, Any]]:
        system = self.system if isinstance(self.system, str) or self.system is None else _join(self.system)
        out = [{"role": "system", "content": system}] if system else []
        for message in self.messages:
            out += message.to_template()
        return out


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
