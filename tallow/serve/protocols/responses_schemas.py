"""Pydantic wire models for the OpenAI Responses API request body, and its input items'
translation into the OpenAI-shaped chat messages that the chat template takes.

Items map onto chat turns: a message item is a turn (developer -> system), consecutive
function_call items join the assistant turn before them as its tool_calls, a
function_call_output is a "tool" message, a reasoning item becomes the next assistant turn's
reasoning_content.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import Discriminator, Field, Tag

from tallow.serve.protocols.openai_schemas import Count, WireModel


class TextContent(WireModel):
    type: Literal["input_text", "output_text", "text"]
    text: str


class MessageItem(WireModel):
    type: Literal["message"] = "message"
    role: Literal["user", "assistant", "system", "developer"]
    content: str | list[TextContent]

    def text(self) -> str:
        return self.content if isinstance(self.content, str) else "\n".join(p.text for p in self.content)


class FunctionCallItem(WireModel):
    type: Literal["function_call"]
    call_id: str
    name: str
    arguments: str


class FunctionCallOutputItem(WireModel):
    type: Literal["function_call_output"]
    call_id: str
    output: str | list[TextContent]

    def text(self) -> str:
        return self.output if isinstance(self.output, str) else "\n".join(p.text for p in self.output)


class ReasoningText(WireModel):
    type: Literal["reasoning_text", "summary_text"]
    text: str


class ReasoningItem(WireModel):
    type: Literal["reasoning"]
    summary: list[ReasoningText] = []
    content: list[ReasoningText] | None = None

    def text(self) -> str:
        return "\n".join(p.text for p in self.content or self.summary)


def _item_type(item: Any) -> str:
    """A message item may leave out its type (the SDK's EasyInputMessage)."""
    return item.get("type", "message") if isinstance(item, dict) else getattr(item, "type", "message")


InputItem = Annotated[Annotated[MessageItem, Tag("message")] | Annotated[FunctionCallItem, Tag("function_call")]
                      | Annotated[FunctionCallOutputItem, Tag("function_call_output")]
                      | Annotated[ReasoningItem, Tag("reasoning")], Discriminator(_item_type)]


class FunctionTool(WireModel):
    # Built-in tools (web_search, file_search, ...) have other types and no name: the protocol
    # answers them with a 400 of its own.
    type: str
    name: str | None = None
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None

    def to_chat(self) -> dict[str, Any]:
        function = {"name": self.name, "parameters": self.parameters or {"type": "object", "properties": {}}}
        if self.description is not None:
            function["description"] = self.description
        return {"type": "function", "function": function}


class ReasoningConfig(WireModel):
    effort: Literal["none", "minimal", "low", "medium", "high"] | None = None
    summary: str | None = None


class ResponsesRequest(WireModel):
    model: str | None = None
    input: str | list[InputItem]
    instructions: str | None = None
    max_output_tokens: Count | None = Field(default=None, ge=1)
    temperature: float | None = Field(default=None, ge=0.0, le=2.0)
    top_p: float | None = Field(default=None, gt=0.0, le=1.0)
    tools: list[FunctionTool] | None = None
    tool_choice: Literal["none", "auto", "required"] | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    reasoning: ReasoningConfig | None = None
    stream: bool = False
    store: bool = True
    previous_response_id: str | None = None
    metadata: dict[str, str] | None = None
    speculative: bool = True  # tallow extra: false keeps this request from speculating

    def input_messages(self) -> list[dict[str, Any]]:
        """The input items as chat-template messages (instructions not included)."""
        if isinstance(self.input, str):
            return [{"role": "user", "content": self.input}]
        out: list[dict[str, Any]] = []
        reasoning = None
        for item in self.input:
            if isinstance(item, ReasoningItem):
                reasoning = item.text()
            elif isinstance(item, FunctionCallOutputItem):
                out.append({"role": "tool", "tool_call_id": item.call_id, "content": item.text()})
            elif isinstance(item, FunctionCallItem):
                if not out or out[-1]["role"] != "assistant":
                    out.append({"role": "assistant", "content": ""})
                call = {"id": item.call_id, "type": "function",
                        "function": {"name": item.name, "arguments": item.arguments}}
                out[-1].setdefault("tool_calls", []).append(call)
            else:
                role = "system" if item.role == "developer" else item.role
                out.append({"role": role, "content": item.text()})
            if reasoning is not None and not isinstance(item, ReasoningItem) and out[-1]["role"] == "assistant":
                out[-1]["reasoning_content"], reasoning = reasoning, None
        return out
