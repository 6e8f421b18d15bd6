"""OpenAI Responses: POST /v1/responses (GET and DELETE /v1/responses/{id} read the store).

The reply becomes output items: a reasoning item (reasoning_text; with reasoning.summary also a
summary_text part, the reasoning text itself: there is no summarizer; with include
["reasoning.encrypted_content"] its text sealed in encrypted_content, which a later request's
input opens again), a message (one output_text part), a function_call per tool call (a
custom_tool_call for a custom tool, whose input follows the tool's Lark / regex grammar when it
has one; tool_choice {"type": "custom", "name"} forces it; namespaced tools as responses_tools.py
maps them). A
stream announces each item (output_item.added, then content_part.added for reasoning and
messages), streams its text or arguments (reasoning_text.delta, output_text.delta,
function_call_arguments.delta; a custom tool's input goes out whole at its end), closes it in the
reverse order (... .done), and ends with response.completed, response.incomplete when
max_output_tokens cut the reply short, or response.failed (server_error) when the server's
shutdown cut it off. Every event carries a sequence_number.

With store (the default) the finished response is kept, with its conversation, for
previous_response_id; with store: false nothing is kept. The protocol class is bound to the app's
ResponsesStore and ReasoningSealer by with_store().
"""

from __future__ import annotations

import json
import secrets
from dataclasses import dataclass, field
from typing import Any

from tallow.config import ServerConfig
from tallow.errors import TallowError
from tallow.serve.chat_prompt import render_chat
from tallow.serve.errors import OPENAI, error_body
from tallow.serve.executor import ChoiceUpdate, CompletionSummary, Usage, ordered_segments
from tallow.serve.plan import Rejection, RequestPlan, parse_request, plan_completion, tokenize
from tallow.serve import structured
from tallow.serve.protocols.base import StreamProtocol, to_json
from tallow.serve.protocols.openai_schemas import SamplingFields
from tallow.serve.protocols.responses_schemas import (INCLUDE_HONOURED, INCLUDE_HOSTED, FunctionCallOutputItem,
                                                      ReasoningItem, ReasoningText, ResponsesRequest)
from tallow.serve.protocols.responses_tools import DROPPED_TOOLS_HEADER, ToolError, ToolRef, ToolSet, \
    build_tool_set, custom_input
from tallow.serve.reasoning_blob import ReasoningSealer
from tallow.serve.responses_store import ResponsesStore
from tallow.output.events import ContentEvent, ReasoningEvent, ToolCallDeltaEvent


@dataclass
class ResponsesPlan(RequestPlan):
    """A RequestPlan plus what the answer echoes and stores."""

    request: ResponsesRequest | None = None
    # This request's turns, those of previous_response_id included; instructions are not.
    conversation: list[dict[str, Any]] = field(default_factory=list)
    tool_set: ToolSet = field(default_factory=ToolSet)


def _item_id(prefix: str) -> str:
    return f"{prefix}_{secrets.token_hex(12)}"


def _message_item(text: str = "") -> dict[str, Any]:
    return {"type": "message", "id": _item_id("msg"), "status": "in_progress", "role": "assistant",
            "content": [{"type": "output_text", "text": text, "annotations": [], "logprobs": []}]}


def _reasoning_item(text: str = "") -> dict[str, Any]:
    return {"type": "reasoning", "id": _item_id("rs"), "status": "in_progress", "summary": [],
            "content": [{"type": "reasoning_text", "text": text}]}


def _function_call_item(tools: ToolSet, call_id: str, flat_name: str, arguments: str = "") -> dict[str, Any]:
    """The item of a call to `flat_name` (the name the model wrote): a function_call (with its
    namespace, if any) or a custom_tool_call."""
    ref = tools.ref(flat_name)
    if ref.kind == "custom":
        item = {"type": "custom_tool_call", "id": _item_id("ctc"), "call_id": call_id, "name": ref.name,
                "input": custom_input(arguments) if arguments else ""}
    else:
        item = {"type": "function_call", "id": _item_id("fc"), "status": "in_progress", "call_id": call_id,
                "name": ref.name, "arguments": arguments}
    if ref.namespace is not None:
        item["namespace"] = ref.namespace
    return item


def _assistant_turn(output: list[dict[str, Any]], tools: ToolSet) -> dict[str, Any]:
    """The output items as the assistant's chat turn, for the stored conversation."""
    turn: dict[str, Any] = {"role": "assistant", "content": _text(output, "message")}
    reasoning = _text(output, "reasoning")
    if reasoning:
        turn["reasoning_content"] = reasoning
    calls = [{"id": item["call_id"], "type": "function",
              "function": {"name": tools.flat_name(item["name"], item.get("namespace")),
                           "arguments": item["arguments"] if item["type"] == "function_call"
                           else json.dumps({"input": item["input"]}, ensure_ascii=False)}}
             for item in output if item["type"] in ("function_call", "custom_tool_call")]
    if calls:
        turn["tool_calls"] = calls
    return turn


def _echo_tool(tool: dict[str, Any], tool_set: ToolSet) -> dict[str, Any]:
    """A request's tool as the response echoes it: a function tool with its strict (as it ran: a
    tool sent without it was strict unless its schema could not be enforced) and parameters (null
    when not given), as OpenAI's Response object has them; other tools as sent."""
    if tool.get("type") == "function":
        strict = tool.get("strict")
        if strict is None:
            strict = tool.get("name") not in tool_set.lenient
        return {**tool, "strict": strict, "parameters": tool.get("parameters")}
    return tool


def _text(output: list[dict[str, Any]], item_type: str) -> str:
    return "".join(part["text"] for item in output if item["type"] == item_type for part in item["content"])


def _unsupported_fields(req: ResponsesRequest) -> Rejection | None:
    """A 400 for a field whose value would change the reply in a way this server does not do."""
    if req.background:
        return Rejection.invalid("background responses are not supported by this server: send background "
                                 "false (or leave it out) and wait for the reply or stream it", "background")
    if req.truncation == "auto":
        return Rejection.invalid('truncation "auto" is not supported: this server never drops input items '
                                 '(use "disabled"; an input that does not fit the context is a 400)', "truncation")
    if req.conversation is not None:
        return Rejection.invalid("conversation: this server keeps no conversation objects; chain turns with "
                                 "previous_response_id or send the whole input", "conversation")
    if req.prompt is not None:
        return Rejection.invalid("prompt: this server keeps no stored prompt templates; send the "
                                 "instructions and input themselves", "prompt")
    if req.top_logprobs:
        return Rejection.invalid("top_logprobs is not supported on /v1/responses (use /v1/chat/completions "
                                 "with logprobs)", "top_logprobs")
    return None


def _orphan_output(req: ResponsesRequest, conversation: list[dict[str, Any]]) -> Rejection | None:
    """A 400 for a function_call_output (custom_tool_call_output) whose call_id no call of the
    conversation (this input's items, previous_response_id's turns) has, as OpenAI's."""
    if isinstance(req.input, str):
        return None
    call_ids = {call["id"] for turn in conversation for call in turn.get("tool_calls") or ()}
    for item in req.input:
        if isinstance(item, FunctionCallOutputItem) and item.call_id not in call_ids:
            what = "function call output" if item.type == "function_call_output" else "custom tool call output"
            return Rejection.invalid(f"No tool call found for {what} with call_id {item.call_id}.", "input")
    return None


class OpenAIResponses(StreamProtocol):
    id_prefix = "resp_"
    store: ResponsesStore
    sealer: ReasoningSealer

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.req: ResponsesRequest = self.plan.request
        self._sequence_number = 0
        self._output: list[dict[str, Any]] = []  # the items of the stream, the open one last
        self._open: str | None = None  # the open item: "message", "reasoning" or "call:<index>"
        self._finish_reason: str | None = None
        self._custom_arguments = ""  # the open custom tool call's arguments ({"input": ...}) so far
        self._tools: ToolSet = self.plan.tool_set
        include = self.req.include or ()
        self._encrypt = "reasoning.encrypted_content" in include
        self._summary = self.req.reasoning is not None and self.req.reasoning.summary is not None

    @classmethod
    def with_store(cls, store: ResponsesStore, sealer: ReasoningSealer | None = None) -> type[OpenAIResponses]:
        """The protocol bound to `store` (plans read previous responses from it, answers go into it)
        and to `sealer` (reasoning.encrypted_content)."""
        return type(cls.__name__, (cls,), {"store": store, "sealer": sealer or ReasoningSealer()})

    @classmethod
    def plan_request(cls, raw: bytes, engine, config: ServerConfig) -> RequestPlan | Rejection:
        req = parse_request(raw, ResponsesRequest)
        if isinstance(req, Rejection):
            return req
        try:
            tool_set = build_tool_set(req.tools or [], strict=config.strict_tools)
        except ToolError as e:
            return Rejection.invalid(str(e), e.param)
        for value in req.include or []:
            if value not in INCLUDE_HONOURED and value not in INCLUDE_HOSTED:
                return Rejection.invalid(f"include: {value!r} is not supported by this server; supported: "
                                         f"{', '.join(sorted(INCLUDE_HONOURED | INCLUDE_HOSTED))}", "include")
        refused = _unsupported_fields(req)
        if refused is not None:
            return refused
        if not isinstance(req.input, str):
            for k, item in enumerate(req.input):
                if isinstance(item, ReasoningItem) and item.encrypted_content is not None:
                    text = cls.sealer.open(item.encrypted_content)
                    if text is None:
                        return Rejection.invalid(f"input[{k}].encrypted_content: not reasoning this server sealed "
                                                 "(altered, or from another server or key)",
                                                 f"input[{k}].encrypted_content")
                    item.content = [ReasoningText(type="reasoning_text", text=text)]
        conversation = []
        if req.previous_response_id is not None:
            previous = cls.store.get(req.previous_response_id)
            if previous is None:
                # (OpenAI's answer: 400 with this code, on which clients resend the whole history)
                return Rejection.invalid(f"Previous response with id '{req.previous_response_id}' not found.",
                                         "previous_response_id", code="previous_response_not_found")
            conversation = list(previous.conversation)
        conversation += req.input_messages(tool_set.flat_name)
        orphan = _orphan_output(req, conversation)
        if orphan is not None:
            return orphan
        messages = ([{"role": "system", "content": req.instructions}] if req.instructions else []) + conversation
        if not conversation:
            return Rejection.invalid("input must not be empty", "input")
        if len(messages) > config.max_messages:
            return Rejection.invalid(f"the conversation holds at most {config.max_messages} messages", "input")
        tool_choice = _tool_choice(req.tool_choice, tool_set)
        if isinstance(tool_choice, Rejection):
            return tool_choice
        try:
            prompt = render_chat(engine.chat_template, messages, config,
                                 tools=tool_set.chat_tools or None,
                                 tool_choice=tool_choice,
                                 reasoning_effort=req.reasoning.effort if req.reasoning else None)
        except TallowError as e:
            return Rejection.from_error(e)
        grammar = responses_grammar(req, prompt, engine.tokenizer, tool_set, tool_choice)
        if isinstance(grammar, Rejection):
            return grammar
        sampling = SamplingFields(model=req.model, stream=req.stream, temperature=req.temperature, top_p=req.top_p,
                                  speculative=req.speculative)
        plan = plan_completion(
            sampling, [tokenize(engine.tokenizer, prompt.text, literal_spans=prompt.literal_spans)],
            vocab_size=engine.model_config.vocab_size, max_model_len=engine.max_model_len,
            config=config, max_tokens=req.max_output_tokens, logprobs=None,
            prompt_param="input", prompt_text=prompt.model_turn, split_reasoning=True,
            reasoning_parser=prompt.reasoning_parser, tool_parser=prompt.tool_parser, tools=prompt.tools,
            max_tool_calls=min((k for k in (1 if req.parallel_tool_calls is False else None, req.max_tool_calls)
                                if k is not None), default=None), grammar=grammar)
        if isinstance(plan, Rejection):
            return plan
        if tool_set.dropped:
            plan.response_headers[DROPPED_TOOLS_HEADER] = ",".join(tool_set.dropped)
        return ResponsesPlan(**vars(plan), request=req, conversation=conversation, tool_set=tool_set)

    def error(self, message: str, status: int = 500) -> list[str]:
        error = error_body(OPENAI, status, message)["error"]  # Responses' error event: the type is its code
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
                        frames += self._open_item(f"call:{d.index}",
                                                  lambda: _function_call_item(self._tools, d.id, d.name))
                    if d.arguments:
                        item = self._output[-1]
                        if item["type"] == "custom_tool_call":  # its input goes out whole at the end
                            self._custom_arguments += d.arguments
                            continue
                        item["arguments"] += d.arguments
                        frames.append(self._event("response.function_call_arguments.delta", item_id=item["id"],
                                                  output_index=len(self._output) - 1, delta=d.arguments))
        if update.finish_reason is not None:
            self._finish_reason = update.finish_reason
            frames += self._close()
        return frames

    def finish(self, usage: Usage) -> list[str]:
        response = self._answer(self._output, usage, self._finish_reason)
        name = f"response.{response['status']}"  # response.completed, .incomplete or .failed
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
        at = {"item_id": item["id"], "output_index": output_index}
        frames = []
        if item["type"] == "custom_tool_call":  # no status in OpenAI's custom_tool_call
            item["input"] = custom_input(self._custom_arguments) if self._custom_arguments else ""
            self._custom_arguments = ""
            if item["input"]:
                frames.append(self._event("response.custom_tool_call_input.delta", **at, delta=item["input"]))
            frames.append(self._event("response.custom_tool_call_input.done", **at, input=item["input"]))
        else:
            item["status"] = "incomplete" if self._finish_reason in ("length", "abort") else "completed"
        if item["type"] == "function_call":
            frames.append(self._event("response.function_call_arguments.done", **at, name=item["name"],
                                      arguments=item["arguments"]))
        for k, part in enumerate(item.get("content", [])):
            done = "response.output_text.done" if part["type"] == "output_text" else "response.reasoning_text.done"
            extra = {"logprobs": []} if part["type"] == "output_text" else {}
            frames.append(self._event(done, **at, content_index=k, text=part["text"], **extra))
            frames.append(self._event("response.content_part.done", **at, content_index=k, part=part))
        if item["type"] == "reasoning":
            frames += self._finish_reasoning(item, at)
        frames.append(self._event("response.output_item.done", output_index=output_index, item=item))
        return frames

    def _finish_reasoning(self, item: dict[str, Any], at: dict[str, Any]) -> list[str]:
        """A closing reasoning item's summary (its text: no summarizer) and sealed text, as asked."""
        text = item["content"][0]["text"]
        frames = []
        if self._summary:
            part = {"type": "summary_text", "text": text}
            item["summary"] = [part]
            frames += [self._event("response.reasoning_summary_part.added", **at, summary_index=0,
                                   part={"type": "summary_text", "text": ""}),
                       self._event("response.reasoning_summary_text.delta", **at, summary_index=0, delta=text),
                       self._event("response.reasoning_summary_text.done", **at, summary_index=0, text=text),
                       self._event("response.reasoning_summary_part.done", **at, summary_index=0, part=part)]
        if self._encrypt:
            item["encrypted_content"] = self.sealer.seal(text)
        return frames

    # ---- one body ---------------------------------------------------------------------
    def response(self, summary: CompletionSummary) -> dict:
        choice = summary.choices[0]
        output = []
        for kind, value in ordered_segments(choice):  # in the order generated, as the stream's items
            if kind == "reasoning":
                item = _reasoning_item(value)
                self._finish_reasoning(item, {})
                output.append(item)
            elif kind == "text":
                output.append(_message_item(value))
            else:
                call = choice.tool_calls[value]
                output.append(_function_call_item(self._tools, call.id, call.name, call.arguments))
        for item in output:
            if item["type"] != "custom_tool_call":
                item["status"] = "completed"
        if output and choice.finish_reason in ("length", "abort") and output[-1]["type"] != "custom_tool_call":
            output[-1]["status"] = "incomplete"
        return self._answer(output, summary.usage, choice.finish_reason)

    def _answer(self, output: list[dict[str, Any]], usage: Usage, finish_reason: str | None) -> dict:
        """The finished response; stored when the request asked for it."""
        status = {"length": "incomplete", "abort": "failed"}.get(finish_reason, "completed")
        response = self._response(status, output, usage)
        if self.req.store:
            self.store.put(self.request_id, response, self.plan.conversation + [_assistant_turn(output, self._tools)])
        return response

    def _response(self, status: str, output: list[dict[str, Any]], usage: Usage | None) -> dict:
        """status "incomplete": cut at max_output_tokens; "failed": cut off by the server (its
        shutdown timeout), with OpenAI's server_error (the output so far kept, items incomplete)."""
        req = self.req
        return {
            "id": self.request_id, "object": "response", "created_at": self.created, "status": status,
            "error": ({"code": "server_error", "message": "the server shut down before this response finished"}
                      if status == "failed" else None),
            "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete" else None,
            "instructions": req.instructions, "max_output_tokens": req.max_output_tokens,
            "model": self.model_name, "output": output,
            "parallel_tool_calls": req.parallel_tool_calls is not False,
            "previous_response_id": req.previous_response_id,
            "reasoning": {"effort": req.reasoning.effort if req.reasoning else None,
                          "summary": req.reasoning.summary if req.reasoning else None},
            "store": req.store, "temperature": 1.0 if req.temperature is None else req.temperature,
            "text": {"format": _text_format(req)}, "tool_choice": req.tool_choice or "auto",
            "tools": [_echo_tool(t, self._tools) for t in req.tools or []],
            "top_p": 1.0 if req.top_p is None else req.top_p, "truncation": req.truncation or "disabled",
            "max_tool_calls": req.max_tool_calls, "background": False,
            "metadata": req.metadata or {},
        } | ({} if usage is None else {"usage": self._usage(usage, _text(output, "reasoning"))})

    def _usage(self, usage: Usage, reasoning: str) -> dict:
        """OpenAI's accounting: input_tokens include the cached ones; reasoning tokens are the
        reasoning text's tokens (its tags not counted)."""
        reasoning_tokens = min(len(self.tokenizer.encode(reasoning)), usage.completion_tokens) if reasoning else 0
        return {"input_tokens": usage.prompt_tokens,
                "input_tokens_details": {"cached_tokens": usage.cached_tokens, "cache_write_tokens": 0},
                "output_tokens": usage.completion_tokens,
                "output_tokens_details": {"reasoning_tokens": reasoning_tokens},
                "total_tokens": usage.total_tokens, **({"fill": usage.fill} if usage.fill else {}),
                **({"speculation": dict(usage.speculation)} if usage.speculation is not None else {})}


def _tool_choice(choice: Any, tool_set: ToolSet) -> Any:
    """Responses' tool_choice as render_chat and the grammar take it: {"type": "function" |
    "custom", "name"} -> {"type": "function", "function": {"name": <the flat name>}}."""
    if not isinstance(choice, dict):
        return choice
    kind, name = choice.get("type"), choice.get("name")
    if kind not in ("function", "custom") or not isinstance(name, str):
        return Rejection.invalid("tool_choice: only 'none', 'auto', 'required', {\"type\": \"function\", "
                                 "\"name\": ...} and {\"type\": \"custom\", \"name\": ...} are supported", "tool_choice")
    if kind == "custom":
        flat = [f for f, ref in tool_set.refs.items() if ref.kind == "custom" and name in (ref.name, f)]
        if not flat:
            return Rejection.invalid(f"tool_choice.name: no custom tool is named {name!r}", "tool_choice.name")
        name = flat[0]
    elif tool_set.refs.get(name, ToolRef("custom", name)).kind != "function":
        return Rejection.invalid(f"tool_choice.name: no function tool is named {name!r} (the tools: "
                                 f"{', '.join(tool_set.refs) or 'none'})", "tool_choice.name")
    return {"type": "function", "function": {"name": name}}


def responses_grammar(req: ResponsesRequest, prompt, tokenizer, tool_set: ToolSet | None = None,
                      choice: Any = None):
    """The request's grammar: text.format, tool_choice (as _tool_choice maps it) and custom tools'
    grammars, after the reasoning (serve/structured.py)."""
    fmt = req.text.format if req.text is not None else None
    output = None
    if fmt is not None and fmt.type == "json_object":
        output = structured.json_object_format("text.format")
    elif fmt is not None and fmt.type == "json_schema":
        if fmt.name is None:
            return Rejection.invalid("text.format.name: Field required", "text.format.name")
        output = (structured.json_object_format("text.format") if fmt.schema_ is None else
                  structured.json_schema_format(fmt.schema_, "text.format.schema", strict=bool(fmt.strict)))
        if isinstance(output, Rejection):
            return output
    tools = prompt.tools
    if tools and tool_set is not None and tool_set.strict_by_default:
        tools = [_default_strict(tool, k, prompt, tokenizer, tool_set) for k, tool in enumerate(tools)]
    result = structured.tool_call_grammar(
        tokenizer, tools=tools, tool_parser=prompt.tool_parser, tool_choice=choice, output=output,
        max_calls=1 if req.parallel_tool_calls is False else None, chat_template=prompt.template_source,
        tool_field="", input_grammars=tool_set.input_grammars if tool_set is not None else None)
    return structured.grammar_for(result, tokenizer, reasoning_parser=prompt.reasoning_parser,
                                  prompt_text=prompt.model_turn)


def _default_strict(tool: dict[str, Any], k: int, prompt, tokenizer, tool_set: ToolSet) -> dict[str, Any]:
    """A rendered function tool sent without strict, as strict where its schema can be enforced
    (OpenAI's default on /v1/responses); otherwise left lenient and noted in tool_set.lenient."""
    name = tool["function"]["name"]
    if name not in tool_set.strict_by_default:
        return tool
    if prompt.tool_parser is None or structured.strict_schema_rejection(tokenizer, [tool], 0, f"tools[{k}]"):
        tool_set.lenient.add(name)
        return tool
    return {**tool, "function": {**tool["function"], "strict": True}}


def _text_format(req: ResponsesRequest) -> dict[str, Any]:
    fmt = req.text.format if req.text is not None else None
    if fmt is None:
        return {"type": "text"}
    return fmt.model_dump(by_alias=True, exclude_none=True)
