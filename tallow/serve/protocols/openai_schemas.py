"""Pydantic wire models for the OpenAI Chat Completions and Completions request bodies, and the
base every protocol's models share (WireModel) and the sampling fields every protocol maps onto
(SamplingFields, which plan.py reads).

Types and static ranges live here; limits that depend on the server or the model
(n cap, context length, vocabulary) are checked in plan.py.
"""

from __future__ import annotations

import functools
import typing
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

# Integers the engine holds in int64 tensors or hands to torch (a seed: torch's generators take a
# signed 64-bit seed, and vLLM's API bounds it the same way).
INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1
Int64 = Annotated[int, Field(ge=INT64_MIN, le=INT64_MAX)]
Count = Annotated[int, Field(le=INT64_MAX)]

Probability = Annotated[float, Field(ge=0.0, le=1.0)]
Penalty = Annotated[float, Field(ge=-2.0, le=2.0)]
Bias = Annotated[float, Field(ge=-100.0, le=100.0)]
# OpenAI's reasoning effort values (Chat's reasoning_effort, Responses' reasoning.effort)
ReasoningEffort = Literal["none", "minimal", "low", "medium", "high", "xhigh", "max"]


class WireModel(BaseModel):
    # Strict: "0.5" is not a float and "true" is not a bool; unknown fields are ignored. A float
    # field takes finite numbers only (1e400 parses to inf); NaN and Infinity literals anywhere in
    # a body are refused before this (plan.parse_request).
    model_config = ConfigDict(strict=True, extra="ignore", allow_inf_nan=False)

    @model_validator(mode="before")
    @classmethod
    def _null_is_the_default(cls, data: Any) -> Any:
        """null in a field with a default that takes no null is that default, as OpenAI's and
        vLLM's APIs read it (their SDK types mark n, stream, logprobs, presence_penalty, ...
        nullable, and clients that write every field send null)."""
        if isinstance(data, dict):
            keys = _defaulted_non_null_keys(cls)
            nulls = [k for k, v in data.items() if v is None and k in keys]
            if nulls:
                data = {k: v for k, v in data.items() if k not in nulls}
        return data


@functools.cache
def _defaulted_non_null_keys(cls: type[BaseModel]) -> frozenset[str]:
    """The wire names of cls's fields that have a default other than None and do not take None."""
    keys = set()
    for name, info in cls.model_fields.items():
        if info.is_required() or info.default is None or info.default_factory is not None:
            continue
        annotation = info.annotation
        if annotation is Any or type(None) in typing.get_args(annotation):
            continue
        keys.add(info.alias or name)
    return frozenset(keys)


class StreamOptions(WireModel):
    include_usage: bool = False
    continuous_usage_stats: bool = False


class SamplingFields(WireModel):
    """The sampling and stop fields both OpenAI endpoints share (plus vLLM's extras)."""

    model: str | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    max_tokens: Count | None = Field(default=None, ge=1)
    temperature: float | None = Field(default=None, ge=0.0, le=2.0)
    top_p: float | None = Field(default=None, gt=0.0, le=1.0)
    n: Count = Field(default=1, ge=1)
    seed: Int64 | None = None
    stop: str | list[str] | None = None
    presence_penalty: Penalty = 0.0
    frequency_penalty: Penalty = 0.0
    logit_bias: dict[str, Bias] | None = None
    user: str | None = None
    # vLLM extras
    top_k: Count | None = Field(default=None, ge=-1)  # above the vocabulary: clamped to it (plan.py)
    min_p: Probability = 0.0
    repetition_penalty: float = Field(default=1.0, gt=0.0)
    min_tokens: Count = Field(default=0, ge=0)
    ignore_eos: bool = False
    stop_token_ids: list[Int64] | None = None
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    # vLLM's: each prompt token's logprob (and the top k there), in the response's prompt_logprobs.
    prompt_logprobs: Count | None = Field(default=None, ge=0)
    # Not implemented: null or equal to n (the same as no best_of); more candidates than n is a 400
    # (plan_completion), never silently fewer.
    best_of: Count | None = Field(default=None, ge=1)
    # vLLM extras not implemented: set (not null, not false), a 400 naming them (plan_completion).
    truncate_prompt_tokens: int | None = None
    allowed_token_ids: list[Int64] | None = None
    bad_words: list[str] | None = None
    use_beam_search: bool = False
    return_tokens_as_token_ids: bool = False
    # tallow extra: false keeps this request from speculating (when the server speculates)
    speculative: bool = True


class JsonSchemaSpec(WireModel):
    name: str = Field(min_length=1, max_length=64)
    description: str | None = None
    schema_: dict[str, Any] | bool | None = Field(default=None, alias="schema")
    strict: bool | None = None


class ResponseFormat(WireModel):
    """response_format: the reply's content as text, any JSON object, or JSON of a schema."""

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaSpec | None = None


class StructuredOutputsParams(WireModel):
    """vLLM's structured_outputs: exactly one of json, regex, choice, grammar, json_object."""

    json_: dict[str, Any] | bool | str | None = Field(default=None, alias="json")
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    structural_tag: str | dict[str, Any] | None = None


class StructuredFields(WireModel):
    """The output-format fields of both OpenAI endpoints (tallow/serve/structured.py maps them)."""

    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputsParams | None = None
    # vLLM's older names
    guided_json: dict[str, Any] | bool | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    guided_decoding_backend: str | None = None  # accepted; llguidance is the one backend


class TextPart(WireModel):
    type: Literal["text"]
    text: str


class ToolCallFunction(WireModel):
    name: str
    # A JSON string (OpenAI's shape); an object is taken too and passed to the template as given.
    arguments: str | dict[str, Any] = "{}"


class AssistantToolCall(WireModel):
    """One entry of an assistant message's tool_calls: {"function": null} or a call without a
    name is a 400 naming the field, not a template that fails on it."""

    id: str | None = None
    type: Literal["function"] = "function"
    function: ToolCallFunction


class ChatMessage(WireModel):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    name: str | None = None
    tool_calls: list[AssistantToolCall] | None = None
    tool_call_id: str | None = None
    reasoning_content: str | None = None
    reasoning: str | None = None  # vLLM's newer name for reasoning_content (the templates see both)

    def to_template(self) -> dict[str, Any]:
        """The message as the chat template sees it: text parts joined by newlines (as vLLM's and
        ChatTemplate's own join for templates that take strings), unset fields left out,
        a developer message as a system one (OpenAI's newer name for it; most templates know only
        system and drop or refuse other roles), as on /v1/responses."""
        message = self.model_dump(exclude_none=True)
        if message["role"] == "developer":
            message["role"] = "system"
        if isinstance(self.content, list):
            message["content"] = "\n".join(part.text for part in self.content)
        return message


class FunctionDefinition(WireModel):
    name: str = Field(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_.\-]+$")
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class ToolDefinition(WireModel):
    type: Literal["function"]
    function: FunctionDefinition


class FunctionName(WireModel):
    name: str


class NamedToolChoice(WireModel):
    type: Literal["function"]
    function: FunctionName


class ChatCompletionRequest(StructuredFields, SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: Count | None = Field(default=None, ge=1)
    logprobs: bool = False
    top_logprobs: Count | None = Field(default=None, ge=0)
    tools: list[ToolDefinition] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    # false: generation ends after the first call (a forced call: the grammar allows one).
    parallel_tool_calls: bool | None = None
    # Only "none" has an effect: thinking off where the template supports it (see chat_prompt.py).
    reasoning_effort: ReasoningEffort | None = None
    add_generation_prompt: bool = True
    # vLLM's: the prompt ends inside the last (assistant) message, which the reply continues.
    continue_final_message: bool = False
    chat_template_kwargs: dict[str, Any] | None = None
    # vLLM's: true puts the tokenizer's special tokens (BOS) in front of the rendered prompt as well
    # (templates write their own, hence false by default)
    add_special_tokens: bool = False
    # vLLM's echo of the last message in the reply: not implemented (true is a 400)
    echo: bool = False
    # Fields that would change the reply's meaning and are not implemented: set, they are a 400
    # (openai_chat.py), never ignored. A request's own chat_template: vLLM refuses it too unless
    # started with --trust-request-chat-template. functions / function_call: the deprecated
    # forms of tools / tool_choice.
    chat_template: str | None = None
    functions: list[dict[str, Any]] | None = None
    function_call: str | dict[str, Any] | None = None
    # OpenAI's hosted search and audio output: not done here (a 400 unless text only).
    web_search_options: dict[str, Any] | None = None
    modalities: list[Literal["text", "audio"]] | None = None
    audio: dict[str, Any] | None = None
    # A hint for the reply's length: accepted (the model is not steered by it), values checked.
    verbosity: Literal["low", "medium", "high"] | None = None


class CompletionRequest(StructuredFields, SamplingFields):
    prompt: str | list[str] | list[Int64] | list[list[Int64]]
    # 0 with echo: score the prompt only (no generated token).
    max_tokens: Count | None = Field(default=None, ge=0)
    echo: bool = False
    suffix: str | None = None
    logprobs: Count | None = Field(default=None, ge=0)
    # vLLM's: false leaves out the special tokens (BOS) the tokenizer would put in front of a text
    # prompt (a prompt that already holds its template's BOS text)
    add_special_tokens: bool = True
