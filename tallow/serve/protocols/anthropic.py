"""Anthropic Messages: POST /v1/messages and POST /v1/messages/count_tokens.

A stream follows Anthropic's event grammar: message_start; per content block (thinking, text,
tool_use) content_block_start, content_block_delta (thinking_delta, text_delta,
input_json_delta) and content_block_stop; message_delta (stop_reason, stop_sequence, final
usage); message_stop. Errors come in Anthropic's shape (serve/errors.py; a full queue answers
529 overloaded_error); a stream that stays silent gets pings (`with_idle_pings`).

Usage follows Anthropic's accounting: input_tokens are the prompt tokens computed for this
request, cache_read_input_tokens those served from the prefix cache; their sum is the prompt.
message_start goes out with the first output (the prefix cache's share is known then), so its
usage and the final message_delta's agree; a ping due before it (a queued request, a long
prefill) goes out after it, and then message_start counts the whole prompt as input
(cache_read_input_tokens 0): the final message_delta carries every count, as Anthropic's does,
and clients take them from it.

A thinking block closes with a signature_delta (the non-streamed block has it as `signature`):
an opaque token of its text under a per-process key. A thinking block sent back is accepted
with any signature.

Claude Code's requests: system messages inside `messages` are system turns where the template
renders them there, else joined to the system prompt in order; thinking {"type": "enabled",
"budget_tokens"} is enforced (the engine forces the end-of-reasoning tag at the budget,
engine/forced_tokens.py), {"type": "adaptive"} turns reasoning on; context_management's
clear_thinking edits drop earlier thinking from the prompt; cache_control, metadata and the
anthropic-beta header / ?beta=true query are accepted (the prefix cache needs no markers).

Prefill: a final assistant message with text (and no tool_use) is continued, as Anthropic does:
the prompt ends where its text ends (render_chat's continue_final_message) and the reply's
content holds the continuation alone, as text (no thinking split unless thinking is on). Its
text may not end with whitespace (a 400, as Anthropic's), nor be combined with a grammar
(output_config.format, tool_choice any / tool); its tokens count as input.
"""

from __future__ import annotations

import asyncio
import base64
import hashlib
import hmac
import json
import secrets
from collections.abc import AsyncIterator, Callable
from dataclasses import replace
from typing import Any

from fastapi.responses import Response, StreamingResponse

from tallow.config import ServerConfig
from tallow.errors import TallowError
from tallow.serve.chat_prompt import ChatPrompt, render_chat
from tallow.serve.errors import ANTHROPIC, ANTHROPIC_OVERLOADED, error_body
from tallow.serve.executor import ChoiceUpdate, CompletionSummary, Usage, ordered_segments
from tallow.serve.plan import Rejection, RequestPlan, parse_request, plan_completion, tokenize
from tallow.serve import structured
from tallow.serve.protocols.anthropic_schemas import MessagesInput, MessagesRequest, ToolResultBlock, ToolUseBlock
from tallow.serve.protocols.base import StreamProtocol, to_json
from tallow.output.events import ContentEvent, ReasoningEvent, ToolCallDeltaEvent
from tallow.output.reasoning import REASONING_PARSERS, prompt_opens_reasoning
from tallow.serve.protocols.openai_schemas import SamplingFields

# A stream silent this long (a queued request, a long prefill) gets a ping event.
PING_INTERVAL_S = 1.0
_STOP_REASONS = {"tool_calls": "tool_use", "length": "max_tokens", "stop": "end_turn"}
# A reply cut off by the server (finish_reason "abort": the shutdown timeout). Anthropic's
# stop_reason has no value for it, so the stream ends with an error event after stop_reason null,
# and a body is a 503 (overloaded_error) rather than a message that looks finished.
ABORTED_MESSAGE = "the server stopped this reply before it finished (shutting down)"


def event(name: str, payload: dict) -> str:
    return f"event: {name}\ndata: {to_json(payload)}\n\n"


PING = event("ping", {"type": "ping"})
# The key of thinking blocks' signatures: one per process.
_SIGNATURE_KEY = secrets.token_bytes(32)


def thinking_signature(thinking: str) -> str:
    """A thinking block's signature: opaque (base64 of an HMAC of its text), stable, never empty."""
    digest = hmac.new(_SIGNATURE_KEY, thinking.encode("utf-8", "surrogatepass"), hashlib.sha256).digest()
    return base64.b64encode(digest).decode("ascii")


def with_idle_pings(response: Response) -> Response:
    """A response of POST /v1/messages: a stream gets a ping whenever it stays silent, after its
    message_start (which a ping due before the first output brings forward)."""
    if isinstance(response, StreamingResponse):
        protocol = getattr(response, "protocol", None)  # the AnthropicMessages writing the stream
        response.body_iterator = with_pings(response.body_iterator,
                                            before_ping=protocol.before_ping if protocol is not None else None)
    return response


async def with_pings(frames: AsyncIterator[str], interval: float | None = None,
                     before_ping: Callable[[], list[str]] | None = None) -> AsyncIterator[str]:
    """`frames`, with a ping whenever none came for a whole `interval` (PING_INTERVAL_S): the
    stream's silence is checked once an interval, so a ping comes one to two intervals into it.
    A ping goes out after the frames `before_ping` returns then (the stream's message_start, the
    first time).

    One task draws the frames into a one-slot queue for the whole stream, and a timer that re-arms
    itself once an interval puts a ping there: no task or timer per frame. Leaving early cancels
    the drawing task (which the frame generator sees as a disconnect) and closes `frames`.
    """
    interval = interval or PING_INTERVAL_S
    loop = asyncio.get_running_loop()
    queue: asyncio.Queue = asyncio.Queue(maxsize=1)

    async def draw() -> None:
        try:
            async for frame in frames:
                await queue.put(frame)
        except Exception as e:  # handed to the consumer, which raises it
            await queue.put(_Failed(e))
        else:
            await queue.put(_END)
        finally:
            close = getattr(frames, "aclose", None)
            if close is not None:
                await close()

    taken = 0  # items the consumer has taken, pings included

    def tick(taken_before: int) -> None:
        nonlocal timer
        if taken == taken_before and queue.empty():
            # Nothing drawn is waiting (the queue is empty), so what before_ping sends goes first.
            queue.put_nowait("".join(before_ping()) + PING if before_ping is not None else PING)
        timer = loop.call_later(interval, tick, taken)

    drawing = asyncio.create_task(draw())
    timer = loop.call_later(interval, tick, taken)
    try:
        while True:
            item = await queue.get()
            taken += 1
            if item is _END:
                return
            if isinstance(item, _Failed):
                raise item.error
            yield item
    finally:
        timer.cancel()
        drawing.cancel()


_END = object()


class _Failed:
    def __init__(self, error: Exception):
        self.error = error


def _tool_use_id(call_id: str) -> str:
    return "toolu_" + call_id.removeprefix("call_")


def _render(req: MessagesInput, engine, config: ServerConfig) -> ChatPrompt | Rejection:
    if len(req.messages) > config.max_messages:
        return Rejection.invalid(f"messages holds at most {config.max_messages} entries", "messages")
    misplaced = _misplaced_content(req)
    if misplaced is not None:
        return misplaced
    for k, tool in enumerate(req.tools or []):
        if tool.type not in (None, "custom"):
            return Rejection.invalid(f"tools[{k}]: the server tool type {tool.type!r} is not supported; "
                                     "define client tools with name, description and input_schema",
                                     f"tools[{k}].type")
        if tool.input_schema is None:
            return Rejection.invalid(f"tools[{k}].input_schema: Field required", f"tools[{k}].input_schema")
    for k, edit in enumerate(req.context_management.edits if req.context_management else []):
        if not edit.type.startswith("clear_thinking"):
            return Rejection.invalid(f"context_management.edits[{k}].type: the edit {edit.type!r} is not supported; "
                                     "clear_thinking edits are", f"context_management.edits[{k}].type")
    prefill = req.prefill()
    if prefill is not None and prefill != prefill.rstrip():
        # As Anthropic's API refuses it (the model would continue after a space it never wrote).
        field = f"messages.{len(req.messages) - 1}.content"
        return Rejection.invalid(f"{field}: final assistant content cannot end with trailing whitespace", field)
    tools = [tool.to_openai() for tool in req.tools] if req.tools else None
    choice = _tool_choice(req)

    def render(merge_system: bool) -> ChatPrompt:
        # A prefill is continued: the prompt ends where its text ends (Chat's continue_final_message).
        return render_chat(engine.chat_template, req.template_messages(merge_system), config, tools=tools,
                           tool_choice=choice, template_kwargs={"enable_thinking": req.thinking_enabled},
                           continue_final_message=prefill is not None)

    try:
        if req.has_mid_system():
            # System turns in place where the template renders them there; else (it raises, or
            # leaves them out) joined to the system prompt.
            try:
                prompt = render(False)
                if all(m.text().strip() in prompt.text for m in req.messages if m.role == "system"):
                    return prompt
            except TallowError:
                pass
            return render(True)
        return render(False)
    except TallowError as e:
        return Rejection.from_error(e)


def _misplaced_content(req: MessagesInput) -> Rejection | None:
    """Anthropic's 400s for a turn's content: every message has some but an optional final
    assistant one (an empty one there: the reply is a new turn), tool_use blocks only in assistant
    turns, tool_result blocks only in user turns."""
    last = len(req.messages) - 1
    for i, message in enumerate(req.messages):
        if not message.content and not (i == last and message.role == "assistant"):
            return Rejection.invalid(f"messages.{i}: all messages must have non-empty content except for the "
                                     "optional final assistant message", f"messages.{i}.content")
        for j, block in enumerate(() if isinstance(message.content, str) else message.content):
            if isinstance(block, ToolUseBlock) and message.role != "assistant":
                field = f"messages.{i}.content.{j}"
                return Rejection.invalid(f"{field}: `tool_use` blocks can only be in `assistant` messages "
                                         f"(this one is a `{message.role}` message)", field)
            if isinstance(block, ToolResultBlock) and message.role != "user":
                field = f"messages.{i}.content.{j}"
                return Rejection.invalid(f"{field}: `tool_result` blocks can only be in `user` messages "
                                         f"(this one is a `{message.role}` message)", field)
    return None


def _tool_choice(req: MessagesInput) -> str | dict[str, Any]:
    """Anthropic's tool_choice in OpenAI's terms: any -> "required", tool -> a named function."""
    choice = req.tool_choice
    if choice is None or choice.type == "auto":
        return "auto"
    if choice.type == "any":
        return "required"
    if choice.type == "tool":
        return {"type": "function", "function": {"name": choice.name}}
    return "none"


def _grammar(req: MessagesRequest, prompt: ChatPrompt, tokenizer):
    """output_config.format (or output_format) and an enforced tool_choice, after the reasoning."""
    if req.output_config is not None and req.output_config.format is not None and req.output_format is not None:
        return Rejection.invalid("output_format cannot be combined with output_config.format", "output_format")
    fmt, param = ((req.output_config.format, "output_config.format.schema")
                  if req.output_config is not None and req.output_config.format is not None
                  else (req.output_format, "output_format.schema"))
    # Anthropic's structured outputs are always strict: what the schema says is what comes back.
    output = None if fmt is None else structured.json_schema_format(fmt.schema_, param, strict=True)
    if isinstance(output, Rejection):
        return output
    choice = _tool_choice(req)
    if req.prefill() is not None and (output is not None or choice not in ("auto", "none")):
        # The grammar would start the reply from scratch (and after a reasoning block that the
        # continued prompt has already closed), not from the middle of the prefilled text.
        field = f"messages.{len(req.messages) - 1}"
        what = (param.removesuffix(".schema") if output is not None
                else f"tool_choice {req.tool_choice.type!r}")
        return Rejection.invalid(f"{field}: a prefilled final assistant message cannot be combined with {what}",
                                 field)
    max_calls = 1 if req.tool_choice is not None and req.tool_choice.disable_parallel_tool_use else None
    result = structured.tool_call_grammar(
        tokenizer, tools=prompt.tools, tool_parser=prompt.tool_parser, tool_choice=choice, output=output,
        max_calls=max_calls, chat_template=prompt.template_source, tool_field="", schema_field="input_schema")
    return structured.grammar_for(result, tokenizer, reasoning_parser=prompt.reasoning_parser,
                                  prompt_text=prompt.model_turn)


class AnthropicMessages(StreamProtocol):
    id_prefix = "msg_"
    error_protocol = ANTHROPIC
    queue_full_status = ANTHROPIC_OVERLOADED

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._num_blocks = 0
        self._open: str | None = None  # the streaming block: "text", "thinking" or "tool_use:<index>"
        self._stop: tuple[str, str | None] = ("end_turn", None)  # stop_reason, stop_sequence
        self._started = False  # message_start sent
        self._thinking: list[str] = []  # the open thinking block's text so far

    @classmethod
    def plan_request(cls, raw: bytes, engine, config: ServerConfig) -> RequestPlan | Rejection:
        req = parse_request(raw, MessagesRequest)
        if isinstance(req, Rejection):
            return req
        if req.tool_choice is not None and req.tool_choice.type == "tool" and not req.tool_choice.name:
            return Rejection.invalid("tool_choice.name: Field required for tool_choice of type 'tool'",
                                     "tool_choice.name")
        if (req.tool_choice is not None and req.tool_choice.type == "tool"
                and req.tool_choice.name not in [tool.name for tool in req.tools or []]):
            return Rejection.invalid(f"tool_choice.name: no tool is named {req.tool_choice.name!r} (the tools: "
                                     f"{', '.join(tool.name for tool in req.tools or []) or 'none'})",
                                     "tool_choice.name")
        budget = req.thinking.budget_tokens if req.thinking is not None and req.thinking_enabled else None
        if budget is not None and budget >= req.max_tokens:
            return Rejection.invalid("thinking.budget_tokens must be less than max_tokens", "thinking.budget_tokens")
        prompt = _render(req, engine, config)
        if isinstance(prompt, Rejection):
            return prompt
        grammar = _grammar(req, prompt, engine.tokenizer)
        if isinstance(grammar, Rejection):
            return grammar
        sampling = SamplingFields(model=req.model, stream=req.stream, temperature=req.temperature, top_p=req.top_p,
                                  top_k=req.top_k, stop=req.stop_sequences, speculative=req.speculative)
        ids = tokenize(engine.tokenizer, prompt.text, literal_spans=prompt.literal_spans)
        plan = plan_completion(
            sampling, [ids], vocab_size=engine.model_config.vocab_size, max_model_len=engine.max_model_len,
            config=config, max_tokens=req.max_tokens, logprobs=None, stop_param="stop_sequences",
            prompt_param="messages", prompt_text=prompt.model_turn,
            # A prefill's continuation is text, whatever tags the prefill holds, unless thinking is on.
            split_reasoning=req.thinking_enabled or req.prefill() is None,
            reasoning_parser=prompt.reasoning_parser, tool_parser=prompt.tool_parser, tools=prompt.tools,
            max_tool_calls=1 if req.tool_choice is not None and req.tool_choice.disable_parallel_tool_use else None,
            grammar=grammar)
        if isinstance(plan, Rejection) and plan.code == "context_length_exceeded":
            # Anthropic's words for it, which its clients (Claude Code, LiteLLM) recognise
            return Rejection.invalid(f"prompt is too long: {len(ids)} tokens > {engine.max_model_len - 1} maximum",
                                     "messages")
        fmt = REASONING_PARSERS.get(prompt.reasoning_parser or "none")
        if budget is not None and fmt is not None and not isinstance(plan, Rejection):
            # thinking.budget_tokens enforced: the engine forces the end tag at the budget.
            tok = engine.tokenizer
            plan.params = replace(plan.params, reasoning_budget=budget,
                                  reasoning_start_ids=tuple(tok.encode(fmt.open_tag)),
                                  reasoning_end_ids=tuple(tok.encode(fmt.close_tag)),
                                  reasoning_open=prompt_opens_reasoning(prompt.model_turn, fmt))
        return plan

    @staticmethod
    def count_tokens(raw: bytes, engine, config: ServerConfig) -> dict | Rejection:
        """The body of POST /v1/messages/count_tokens: the prompt tokens the request would use."""
        req = parse_request(raw, MessagesInput)
        if isinstance(req, Rejection):
            return req
        prompt = _render(req, engine, config)
        if isinstance(prompt, Rejection):
            return prompt
        return {"input_tokens": len(tokenize(engine.tokenizer, prompt.text, literal_spans=prompt.literal_spans))}

    def error(self, message: str, status: int = 500) -> list[str]:
        return [event("error", error_body(ANTHROPIC, status, message))]

    # ---- streaming ------------------------------------------------------------------
    def start(self) -> list[str]:
        return []  # message_start waits for the first output, or a ping: see the module docstring

    def before_ping(self) -> list[str]:
        """The frames a ping must follow: message_start, when it has not gone out yet, its usage
        then the prompt's tokens, none of them known to come from the prefix cache."""
        return self._message_start(Usage(prompt_tokens=len(self.plan.prompts[0])))

    def _message_start(self, usage: Usage) -> list[str]:
        if self._started:
            return []
        self._started = True
        message = self._message([], None, None, _usage(usage))
        return [event("message_start", {"type": "message_start", "message": message})]

    def add_events(self, update: ChoiceUpdate, usage: Usage) -> list[str]:
        frames = self._message_start(usage)
        for ev in update.events:
            if isinstance(ev, ContentEvent):
                frames += self._delta("text", {"type": "text_delta", "text": ev.text})
            elif isinstance(ev, ReasoningEvent):
                frames += self._delta("thinking", {"type": "thinking_delta", "thinking": ev.text})
                self._thinking.append(ev.text)
            elif isinstance(ev, ToolCallDeltaEvent):
                for d in ev.deltas:
                    block = f"tool_use:{d.index}"
                    if d.name is not None:
                        frames += self._start(block, {"type": "tool_use", "id": _tool_use_id(d.id), "name": d.name,
                                                      "input": {}})
                    if d.arguments:
                        frames += self._delta(block, {"type": "input_json_delta", "partial_json": d.arguments})
        if update.finish_reason is not None:
            frames += self._close()
            self._stop = self._stop_reason(update.finish_reason, update.stop_string)
        return frames

    def finish(self, usage: Usage) -> list[str]:
        stop_reason, stop_sequence = self._stop
        frames = self._message_start(usage) + [event("message_delta", {"type": "message_delta",
                                                 "delta": {"stop_reason": stop_reason, "stop_sequence": stop_sequence},
                                                 "usage": _usage(usage)})]
        if stop_reason is None:  # aborted: no message_stop, an error instead
            return frames + [event("error", error_body(ANTHROPIC, 503, ABORTED_MESSAGE))]
        return frames + [event("message_stop", {"type": "message_stop"})]

    def _delta(self, block: str, delta: dict) -> list[str]:
        frames = []
        if self._open != block:
            empty = {"text": {"type": "text", "text": ""},
                     "thinking": {"type": "thinking", "thinking": "", "signature": ""}}[block]
            frames = self._start(block, empty)
        return frames + [event("content_block_delta", {"type": "content_block_delta",
                                                       "index": self._num_blocks - 1, "delta": delta})]

    def _start(self, block: str, content_block: dict) -> list[str]:
        frames = self._close()
        self._open = block
        self._num_blocks += 1
        return frames + [event("content_block_start", {"type": "content_block_start",
                                                       "index": self._num_blocks - 1,
                                                       "content_block": content_block})]

    def _close(self) -> list[str]:
        if self._open is None:
            return []
        frames = []
        if self._open == "thinking":
            signature = thinking_signature("".join(self._thinking))
            self._thinking = []
            frames.append(event("content_block_delta", {"type": "content_block_delta", "index": self._num_blocks - 1,
                                                        "delta": {"type": "signature_delta",
                                                                  "signature": signature}}))
        self._open = None
        return frames + [event("content_block_stop", {"type": "content_block_stop", "index": self._num_blocks - 1})]

    # ---- one body ---------------------------------------------------------------------
    def response(self, summary: CompletionSummary) -> dict:
        choice = summary.choices[0]
        if choice.finish_reason == "abort":
            raise TallowError(ABORTED_MESSAGE, status=503, type="service_unavailable")
        content: list[dict[str, Any]] = []
        for kind, value in ordered_segments(choice):  # in the order generated, as the stream's blocks
            if kind == "reasoning":
                content.append({"type": "thinking", "thinking": value, "signature": thinking_signature(value)})
            elif kind == "text":
                content.append({"type": "text", "text": value})
            else:
                call = choice.tool_calls[value]
                content.append({"type": "tool_use", "id": _tool_use_id(call.id), "name": call.name,
                                "input": json.loads(call.arguments)})
        return self._message(content, *self._stop_reason(choice.finish_reason, choice.stop_string),
                             _usage(summary.usage))

    def _message(self, content: list[dict], stop_reason: str | None, stop_sequence: str | None,
                 usage: dict) -> dict:
        return {"id": self.request_id, "type": "message", "role": "assistant", "model": self.model_name,
                "content": content, "stop_reason": stop_reason, "stop_sequence": stop_sequence, "usage": usage}

    @staticmethod
    def _stop_reason(finish_reason: str, stop_string: str | None) -> tuple[str | None, str | None]:
        if finish_reason == "abort":
            return None, None
        if stop_string is not None and finish_reason == "stop":
            return "stop_sequence", stop_string
        return _STOP_REASONS.get(finish_reason, "end_turn"), None


def _usage(usage: Usage) -> dict:
    body = {"input_tokens": usage.prompt_tokens - usage.cached_tokens, "cache_creation_input_tokens": 0,
            "cache_read_input_tokens": usage.cached_tokens, "output_tokens": usage.completion_tokens}
    if usage.fill:
        body["fill"] = usage.fill  # jump-forward tokens of a grammar (tallow's extension)
    if usage.speculation is not None:
        body["speculation"] = dict(usage.speculation)
    return body
