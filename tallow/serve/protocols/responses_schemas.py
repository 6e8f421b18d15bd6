"""Pydantic wire models for the OpenAI Responses API request body, and its input items'
translation into the OpenAI-shaped chat messages that the chat template takes.

Items map onto chat turns: a message item is a turn (developer -> system), consecutive
function_call (and custom_tool_call) items join the assistant turn before them as its
tool_calls, a function_call_output (custom_tool_call_output) is a "tool" message, a reasoning
item becomes the next assistant turn's reasoning_content. Tools stay raw dicts here: their
types (function, custom, namespace, hosted) are read by responses_tools.py.
"""

from __future__ import annotations

import json
from typing import Annotated, Any, Literal

from pydantic import Discriminator, Field, Tag

from tallow.serve.protocols.openai_schemas import Count, ReasoningEffort, WireModel


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
    namespace: str | None = None


class CustomToolCallItem(WireModel):
    type: Literal["custom_tool_call"]
    call_id: str
    name: str
    input: str
    namespace: str | None = None


class FunctionCallOutputItem(WireModel):
    type: Literal["function_call_output", "custom_tool_call_output"]
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
    # This server's sealed reasoning (reasoning_blob.py); the protocol opens it into content.
    encrypted_content: str | None = None

    def text(self) -> str:
        return "\n".join(p.text for p in self.content or self.summary)


def _item_type(item: Any) -> str:
    """A message item may leave out its type (the SDK's EasyInputMessage)."""
    return item.get("type", "message") if isinstance(item, dict) else getattr(item, "type", "message")


InputItem = Annotated[Annotated[MessageItem, Tag("message")] | Annotated[FunctionCallItem, Tag("function_call")]
                      | Annotated[CustomToolCallItem, Tag("custom_tool_call")]
                      | Annotated[FunctionCallOutputItem, Tag("function_call_output")]
                      | Annotated[FunctionCallOutputItem, Tag("custom_tool_call_output")]
                      | Annotated[ReasoningItem, Tag("reasoning")], Discriminator(_item_type)]


# `include` values: what this server honours, and what concerns only hosted tools (which it drops,
# so no such item is ever produced). Others are a 400.
INCLUDE_HONOURED = frozenset({"reasoning.encrypted_content"})
INCLUDE_HOSTED = frozenset({"file_search_call.results", "web_search_call.results", "web_search_call.action.sources",
                            "message.input_image.image_url", "computer_call_output.output.image_url",
                            "code_interpreter_call.outputs"})


class TextFormat(WireModel):
    """text.format: the reply as text, any JSON object, or JSON of a schema (flat, unlike Chat's)."""

    type: Literal["text", "json_object", "json_schema"]
    name: str | None = Field(default=None, min_length=1, max_length=64)
    description: str | None = None
    schema_: dict[str, Any] | bool | None = Field(default=None, alias="schema")
    strict: bool | None = None


class TextConfig(WireModel):
    format: TextFormat | None = None
    verbosity: Literal["low", "medium", "high"] | None = None


class ReasoningConfig(WireModel):
    effort: ReasoningEffort | None = None
    # OpenAI's values (the summary is the reasoning text itself: there is no summarizer)
    summary: Literal["auto", "concise", "detailed"] | None = None


class ResponsesRequest(WireModel):
    model: str | None = None
    input: str | list[InputItem]
    instructions: str | None = None
    max_output_tokens: Count | None = Field(default=None, ge=1)
    temperature: float | None = Field(default=None, ge=0.0, le=2.0)
    top_p: float | None = Field(default=None, gt=0.0, le=1.0)
    tools: list[dict[str, Any]] | None = None
    tool_choice: Literal["none", "auto", "required"] | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    reasoning: ReasoningConfig | None = None
    text: TextConfig | None = None
    stream: bool = False
    store: bool = True
    previous_response_id: str | None = None
    # OpenAI's bounds: at most 16 pairs, keys up to 64 characters, values up to 512.
    metadata: Annotated[dict[Annotated[str, Field(max_length=64)], Annotated[str, Field(max_length=512)]],
                        Field(max_length=16)] | None = None
    # Honoured: at most this many tool calls, then the reply ends (as parallel_tool_calls false does
    # for one).
    max_tool_calls: Count | None = Field(default=None, ge=1)
    # Not implemented, so a 400 when they would change the reply (responses.py): background true
    # (no background runs), truncation "auto" (the input is never cut: a prompt that does not fit
    # is a 400 either way), top_logprobs above 0 (no logprobs on output_text).
    background: bool | None = None
    truncation: Literal["auto", "disabled"] | None = None
    top_logprobs: Count | None = Field(default=None, ge=0, le=20)
    # OpenAI's stored conversations and prompt templates: not kept here (a 400: answering without
    # the conversation's items or the prompt's text would answer another request).
    conversation: str | dict[str, Any] | None = None
    prompt: dict[str, Any] | None = None
    include: list[str] | None = None
    # Accepted: the prefix cache finds shared prefixes by itself; client_metadata is the client's own.
    prompt_cache_key: str | None = None
    client_metadata: dict[str, Any] | None = None
    speculative: bool = True  # tallow extra: false keeps this request from speculating

    def input_messages(self, flat_name=lambda name, namespace: name) -> list[dict[str, Any]]:
        """The input items as chat-template messages (instructions not included); flat_name gives
        the name the model sees for a (namespaced) tool."""
        if isinstance(self.input, str):
            return [{"role": "user", "content": self.input}]
        out: list[dict[str, Any]] = []
        reasoning = None
        for item in self.input:
            if isinstance(item, ReasoningItem):
                reasoning = item.text()
            elif isinstance(item, FunctionCallOutputItem):
                out.append({"role": "tool", "tool_call_id": item.call_id, "content": item.text()})
            elif isinstance(item, (FunctionCallItem, CustomToolCallItem)):
                if not out or out[-1]["role"] != "assistant":
                    out.append({"role": "assistant", "content": ""})
                arguments = (item.arguments if isinstance(item, FunctionCallItem)
                             else json.dumps({"input": item.input}, ensure_ascii=False))
                call = {"id": item.call_id, "type": "function",
                        "function": {"name": flat_name(item.name, item.namespace), "arguments": arguments}}
                out[-1].setdefault("tool_calls", []).append(call)
            else:
                role = "system" if item.role == "developer" else item.role
                out.append({"role": role, "content": item.text()})
            if reasoning is not None and not isinstance(item, ReasoningItem) and out[-1]["role"] == "assistant":
                out[-1]["reasoning_content"], reasoning = reasoning, None
        return out
