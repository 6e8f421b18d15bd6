"""OpenAI Responses: POST /v1/responses (GET and DELETE /v1/responses/{id} read the store).

The reply becomes output items: a reasoning item (reasoning_text), a message (one output_text
part), a function_call per tool call. A stream announces each item (output_item.added, then
content_part.added for reasoning and messages), streams its text or arguments
(reasoning_text.delta, output_text.delta, function_call_arguments.delta), closes it in the
reverse order (... .done), and ends with response.completed, or response.incomplete when
max_output_tokens cut the reply short. Every event carries a sequence_number.

With store (the default) the finished response is kept, with its conversation, for
previous_response_id; the protocol class is bound to the app's ResponsesStore by with_store().
"""

from __future__ import annotations

import secrets
from dataclasses import dataclass, field
from typing import Any

from tallow.config import ServerConfig
from tallow.errors import TallowError
from tallow.serve.chat_prompt import render_chat
from tallow.serve.errors import OPENAI, error_body
from tallow.serve.executor import ChoiceUpdate, CompletionSummary, Usage
from tallow.serve.plan import Rejection, RequestPlan, parse_request, plan_completion, tokenize
from tallow.serve.protocols.base import StreamProtocol, to_json
from tallow.serve.protocols.openai_schemas import SamplingFields
from tallow.serve.protocols.responses_schemas import ResponsesRequest
from tallow.serve.responses_store import ResponsesStore
from tallow.output.events import ContentEvent, ReasoningEvent, ToolCallDeltaEvent


@dataclass
class ResponsesPlan(RequestPlan):
    """A RequestPlan plus what the answer echoes and stores."""

    request: ResponsesRequest | None = None
    # This request's turns, those of previous_response_id included; instructions are not.
    conversation: list[dict[str, Any]] = field(default_factory=list)


def _item_id(prefix: str) -> str:
    return f"{prefix}_{secrets.token_hex(12)}"


def _message_item(text: str = "") -> dict[str, Any]:
    return {"type": "message", "id": _item_id("msg"), "status": "in_progress", "role": "assistant",
            "content": [{"type": "output_text", "text": text, "annotations": []}]}


def _reasoning_item(text: str = "") -> dict[str, Any]:
    return {"type": "reasoning", "id": _item_id("rs"), "status": "in_progress", "summary": [],
            "content": [{"type": "reasoning_text", "text": text}]}


def _function_call_item(call_id: str, name: str, arguments: str = "") -> dict[str, Any]:
    return {"type": "function_call", "id": _item_id("fc"), "status": "in_progress", "call_id": call_id,
            "name": name, "arguments": arguments}


def _assistant_turn(output: list[dict[str, Any]]) -> dict[str, Any]:
    """The output items as the assistant's chat turn, for the stored conversation."""
    turn: dict[str, Any] = {"role": "assistant", "content": _text(output, "message")}
    reasoning = _text(output, "reasoning")
    if reasoning:
        turn["reasoning_content"] = reasoning
    calls = [{"id": item["call_id"], "type": "function",
              "function": {"name": item["name"], "arguments": item["arguments"]}}
             for item in output if item["type"] == "function_call"]
    if calls:
        turn["tool_calls"] = calls
    return turn


def _text(output: list[dict[str, Any]], item_type: str) -> str:
    return "".join(part["text"] for item in output if item["type"] == item_type for part in item["content"])


class OpenAIResponses(StreamProtocol):
    id_prefix = "resp_"
    store: ResponsesStore

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.req: ResponsesRequest = self.plan.request
        self._sequence_number = 0
        self._output: list[dict[str, Any]] = []  # the items of the stream, the open one last
        self._open: str | None = None  # the open item: "message", "reasoning" or "call:<index>"
        self._finish_reason: str | None = None

    @classmethod
    def with_store(cls, store: ResponsesStore) -> type[OpenAIResponses]:
        """The protocol bound to `store`: plans read previous responses from it, answers go into it."""
        return type(cls.__name__, (cls,), {"store": store})

    @classmethod
    def plan_request(cls, raw: bytes, engine, config: ServerConfig) -> RequestPlan | Rejection:
        req = parse_request(raw, ResponsesRequest)
        if isinstance(req, Rejection):
            return req
        for k, tool in enumerate(req.tools or []):
            if tool.type != "function":
                return Rejection.invalid(f"tools[{k}]: the built-in tool type {tool.type!r} is not supported; "
                                         "only function tools are", f"tools[{k}].type")
            if tool.name is None:
                return Rejection.invalid(f"tools[{k}].name: Field required", f"tools[{k}].name")
        conversation = []
        if req.previous_response_id is not None:
            previous = cls.store.get(req.previous_response_id)
            if previous is None:
                return Rejection.invalid(f"Previous response with id '{req.previous_response_id}' not found.",
                                         "previous_response_id", status=404)
            conversation = list(previous.conversation)
        conversation += req.input_messages()
        messages = ([{"role": "system", "content": req.instructions}] if req.instructions else []) + conversation
        if not conversation:
            return Rejection.invalid("input must not be empty", "input")
        if len(messages) > config.max_messages:
            return Rejection.invalid(f"the conversation holds at most {config.max_messages} messages", "input")
        try:
            prompt = render_chat(engine.chat_template, messages, config,
                                 tools=[t.to_chat() for t in req.tools] if req.tools else None,
                                 tool_choice=req.tool_choice,
                                 reasoning_effort=req.reasoning.effort if req.reasoning else None)
        except TallowError as e:
            return Rejection.from_error(e)
        sampling = SamplingFields(stream=req.stream, temperature=req.temperature, top_p=req.top_p,
                                  speculative=req.speculative)
        plan = plan_completion(
            sampling, [tokenize(engine.tokenizer, prompt.text, literal_spans=prompt.literal_spans)],
            vocab_size=engine.model_config.vocab_size, max_model_len=engine.max_model_len,
            config=config, max_tokens=req.max_output_tokens, logprobs=None,
            prompt_param="input", prompt_text=prompt.text, split_reasoning=True,
            reasoning_parser=prompt.reasoning_parser, tool_parser=prompt.tool_parser, tools=prompt.tools,
            max_tool_calls=1 if req.parallel_tool_calls is False else None)
        if isinstance(plan, Rejection):
            return plan
        return ResponsesPlan(**vars(plan), request=req, conversation=conversation)

    def error(self, message: str) -> list[str]:
        error = error_body(OPENAI, 500, message)["error"]  # Responses' error event: the type is its code
        return [self._event("error", code=error["type"], message=error["message"], param=error["param"])]

    # ---- streaming ------------------------------------------------------------------
    def start(self) -> list[str]:
        snapshot = self._response("in_progress", [], None)
        return [self._event("response.created", response=snapshot),
                self._event("response.in_progress", response=snapshot)]

    def add_events(self, update: ChoiceUpdate, usage: Usage) -> list[str]:
        frames = []
        for ev in update.events:
            if isinstance(ev, ContentEvent):
                frames += self._open_item("message", _message_item)
                frames.append(self._text_delta("response.output_text.delta", ev.text, logprobs=[]))
            elif isinstance(ev, ReasoningEvent):
                frames += self._open_item("reasoning", _reasoning_item)
                frames.append(self._text_delta("response.reasoning_text.delta", ev.text))
            elif isinstance(ev, ToolCallDeltaEvent):
                for d in ev.deltas:
                    if d.name is not None:
                        frames += self._open_item(f"call:{d.index}", lambda: _function_call_item(d.id, d.name))
                    if d.arguments:
                        item = self._output[-1]
                        item["arguments"] += d.arguments
                        frames.append(self._event("response.function_call_arguments.delta", item_id=item["id"],
                                                  output_index=len(self._output) - 1, delta=d.arguments))
        if update.finish_reason is not None:
            self._finish_reason = update.finish_reason
            frames += self._close()
        return frames

    def finish(self, usage: Usage) -> list[str]:
        response = self._answer(self._output, usage, self._finish_reason)
        name = "response.completed" if response["status"] == "completed" else "response.incomplete"
        return [self._event(name, response=response)]

    def _event(self, type: str, **fields: Any) -> str:
        payload = {"type": type, "sequence_number": self._sequence_number, **fields}
        self._sequence_number += 1
        return f"event: {type}\ndata: {to_json(payload)}\n\n"

    def _open_item(self, key: str, make) -> list[str]:
        if self._open == key:
            return []
        frames = self._close()
        item = make()
        parts = item.get("content", [])
        output_index = len(self._output)
        self._output.append(item)
        self._open = key
        frames.append(self._event("response.output_item.added", output_index=output_index,
                                  item={**item, "content": []} if parts else item))
        for k, part in enumerate(parts):
            frames.append(self._event("response.content_part.added", item_id=item["id"], output_index=output_index,
                                      content_index=k, part=part))
        return frames

    def _text_delta(self, type: str, text: str, **fields: Any) -> str:
        item = self._output[-1]
        item["content"][0]["text"] += text
        return self._event(type, item_id=item["id"], output_index=len(self._output) - 1, content_index=0,
                           delta=text, **fields)

    def _close(self) -> list[str]:
        if self._open is None:
            return []
        self._open = None
        item, output_index = self._output[-1], len(self._output) - 1
        item["status"] = "incomplete" if self._finish_reason == "length" else "completed"
        at = {"item_id": item["id"], "output_index": output_index}
        frames = []
        if item["type"] == "function_call":
            frames.append(self._event("response.function_call_arguments.done", **at, name=item["name"],
                                      arguments=item["arguments"]))
        for k, part in enumerate(item.get("content", [])):
            done = "response.output_text.done" if part["type"] == "output_text" else "response.reasoning_text.done"
            extra = {"logprobs": []} if part["type"] == "output_text" else {}
            frames.append(self._event(done, **at, content_index=k, text=part["text"], **extra))
            frames.append(self._event("response.content_part.done", **at, content_index=k, part=part))
        frames.append(self._event("response.output_item.done", output_index=output_index, item=item))
        return frames

    # ---- one body ---------------------------------------------------------------------
    def response(self, summary: CompletionSummary) -> dict:
        choice = summary.choices[0]
        output = []
        if choice.reasoning:
            output.append(_reasoning_item(choice.reasoning))
        if choice.content:
            output.append(_message_item(choice.content))
        output += [_function_call_item(call.id, call.name, call.arguments) for call in choice.tool_calls]
        for item in output:
            item["status"] = "completed"
        if output and choice.finish_reason == "length":
            output[-1]["status"] = "incomplete"
        return self._answer(output, summary.usage, choice.finish_reason)

    def _answer(self, output: list[dict[str, Any]], usage: Usage, finish_reason: str | None) -> dict:
        """The finished response; stored when the request asked for it."""
        status = "incomplete" if finish_reason == "length" else "completed"
        response = self._response(status, output, usage)
        if self.req.store:
            self.store.put(self.request_id, response, self.plan.conversation + [_assistant_turn(output)])
        return response

    def _response(self, status: str, output: list[dict[str, Any]], usage: Usage | None) -> dict:
        req = self.req
        return {
            "id": self.request_id, "object": "response", "created_at": self.created, "status": status,
            "error": None,
            "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete" else None,
            "instructions": req.instructions, "max_output_tokens": req.max_output_tokens,
            "model": self.model_name, "output": output,
            "parallel_tool_calls": req.parallel_tool_calls is not False,
            "previous_response_id": req.previous_response_id,
            "reasoning": {"effort": req.reasoning.effort if req.reasoning else None, "summary": None},
            "store": req.store, "temperature": 1.0 if req.temperature is None else req.temperature,
            "text": {"format": {"type": "text"}}, "tool_choice": req.tool_choice or "auto",
            "tools": [t.model_dump(exclude_none=True) for t in req.tools or []],
            "top_p": 1.0 if req.top_p is None else req.top_p, "truncation": "disabled",
            "usage": None if usage is None else self._usage(usage, _text(output, "reasoning")),
            "user": None, "metadata": req.metadata or {},
        }

    def _usage(self, usage: Usage, reasoning: str) -> dict:
        """OpenAI's accounting: input_tokens include the cached ones; reasoning tokens are the
        reasoning text's tokens (its tags not counted)."""
        reasoning_tokens = min(len(self.tokenizer.encode(reasoning)), usage.completion_tokens) if reasoning else 0
        return {"input_tokens": usage.prompt_tokens,
                "input_tokens_details": {"cached_tokens": usage.cached_tokens, "cache_write_tokens": 0},
                "output_tokens": usage.completion_tokens,
                "output_tokens_details": {"reasoning_tokens": reasoning_tokens},
                "total_tokens": usage.total_tokens,
                **({"speculation": dict(usage.speculation)} if usage.speculation is not None else {})}
