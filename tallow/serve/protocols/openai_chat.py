"""OpenAI Chat Completions: POST /v1/chat/completions."""

from __future__ import annotations

from pydantic import BaseModel

from tallow.config import ServerConfig
from tallow.errors import TallowError
from tallow.serve.chat_prompt import render_chat
from tallow.serve.executor import ChoiceUpdate, CompletionSummary, TokenLogprob, Usage
from tallow.serve.plan import Rejection, RequestPlan, parse_request, plan_completion, tokenize
from tallow.serve import structured
from tallow.serve.protocols.base import DONE, OpenAIChunks, StreamProtocol, finite, json_string, to_json
from tallow.output.events import ContentEvent, Event, ReasoningEvent, ToolCall, ToolCallDelta, ToolCallDeltaEvent
from tallow.serve.protocols.openai_schemas import ChatCompletionRequest


def unsupported_chat_fields(req: ChatCompletionRequest) -> Rejection | None:
    """A 400 for a field that would change the reply and that this server does not implement."""
    if req.chat_template is not None:
        return Rejection.invalid("chat_template: a request's own chat template is not accepted (the server's "
                                 "template is used; vLLM refuses it too unless --trust-request-chat-template)",
                                 "chat_template")
    if req.functions is not None:
        return Rejection.invalid("functions is deprecated and not supported: send tools "
                                 '([{"type": "function", "function": {...}}]) instead', "functions")
    if req.function_call is not None:
        return Rejection.invalid("function_call is deprecated and not supported: send tool_choice instead",
                                 "function_call")
    if req.web_search_options is not None:
        return Rejection.invalid("web_search_options: this server has no web search (send the request "
                                 "without it)", "web_search_options")
    if req.modalities is not None and "audio" in req.modalities:
        return Rejection.invalid('modalities: this server answers with text only (send ["text"])', "modalities")
    if req.audio is not None:
        return Rejection.invalid("audio: this server does not produce audio output", "audio")
    if req.echo:
        return Rejection.invalid("echo is not supported on /v1/chat/completions", "echo")
    if req.continue_final_message and req.add_generation_prompt:
        return Rejection.invalid("continue_final_message and add_generation_prompt cannot both be true "
                                 "(set add_generation_prompt to false)", "continue_final_message")
    return None


class OpenAIChat(OpenAIChunks, StreamProtocol):
    id_prefix = "chatcmpl-"

    @classmethod
    def plan_request(cls, raw: bytes, engine, config: ServerConfig) -> RequestPlan | Rejection:
        req = parse_request(raw, ChatCompletionRequest)
        if isinstance(req, Rejection):
            return req
        if len(req.messages) > config.max_messages:
            return Rejection.invalid(f"messages holds at most {config.max_messages} entries", "messages")
        if req.top_logprobs is not None and not req.logprobs:
            return Rejection.invalid("top_logprobs needs logprobs set to true", "top_logprobs")
        refused = unsupported_chat_fields(req)
        if refused is not None:
            return refused
        tools = [tool.model_dump(exclude_none=True) for tool in req.tools] if req.tools else None
        tool_choice = req.tool_choice.model_dump() if isinstance(req.tool_choice, BaseModel) else req.tool_choice
        try:
            prompt = render_chat(engine.chat_template, [m.to_template() for m in req.messages], config,
                                 tools=tools, tool_choice=tool_choice, reasoning_effort=req.reasoning_effort,
                                 template_kwargs=req.chat_template_kwargs,
                                 add_generation_prompt=req.add_generation_prompt,
                                 continue_final_message=req.continue_final_message)
        except TallowError as e:
            return Rejection.from_error(e)
        grammar = chat_grammar(req, prompt, engine.tokenizer, tool_choice)
        if isinstance(grammar, Rejection):
            return grammar
        return plan_completion(
            req, [tokenize(engine.tokenizer, prompt.text, literal_spans=prompt.literal_spans,
                           add_special_tokens=req.add_special_tokens)],
            vocab_size=engine.model_config.vocab_size, max_model_len=engine.max_model_len,
            config=config,
            max_tokens=req.max_completion_tokens or req.max_tokens,
            logprobs=(req.top_logprobs or 0) if req.logprobs else None, prompt_param="messages",
            prompt_text=prompt.model_turn, split_reasoning=True, reasoning_parser=prompt.reasoning_parser,
            tool_parser=prompt.tool_parser, tools=prompt.tools, grammar=grammar,
            max_tool_calls=1 if req.parallel_tool_calls is False else None)

    # ---- streaming ------------------------------------------------------------------
    def start(self) -> list[str]:
        return [self._chunk([{"index": i, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                              "finish_reason": None}]) for i in range(self.num_choices)]

    def add_events(self, update: ChoiceUpdate, usage: Usage) -> list[str]:
        events = update.events
        logprobs = self._logprobs(update.logprobs)
        if logprobs is None and len(events) == 1 and type(events[0]) is ContentEvent and update.finish_reason is None:
            # the common case, a piece of content: its JSON written directly
            return [self.chunk_frame("chat.completion.chunk",
                                     f'[{{"index":{update.index},"delta":{{"content":{json_string(events[0].text)}}},'
                                     f'"logprobs":null,"finish_reason":null}}]', usage, False)]
        frames = []
        for delta in (d for event in update.events for d in _deltas(event)):
            frames.append(self._chunk([{"index": update.index, "delta": delta, "logprobs": logprobs,
                                        "finish_reason": None}], usage))
            logprobs = None
        if update.finish_reason is not None:
            frames.append(self._chunk([{"index": update.index, "delta": {}, "logprobs": logprobs,
                                        "finish_reason": update.finish_reason}], usage))
        return frames

    def finish(self, usage: Usage) -> list[str]:
        frames = [self._chunk([], usage, final=True)] if self.plan.include_usage else []
        return frames + [DONE]

    def _chunk(self, choices: list[dict], usage: Usage | None = None, final: bool = False) -> str:
        return self.chunk_frame("chat.completion.chunk", to_json(choices), usage, final)

    # ---- one body ---------------------------------------------------------------------
    def response(self, summary: CompletionSummary) -> dict:
        choices = []
        for choice in summary.choices:
            message = {"role": "assistant", "content": choice.content if choice.content or not choice.tool_calls
                       else None, "refusal": None}
            if choice.reasoning:
                message["reasoning_content"] = message["reasoning"] = choice.reasoning
            if choice.tool_calls:
                message["tool_calls"] = [_tool_call(call) for call in choice.tool_calls]
            choices.append({"index": choice.index, "message": message,
                            "logprobs": self._logprobs(choice.logprobs or []),
                            "finish_reason": choice.finish_reason})
        body = {"id": self.request_id, "object": "chat.completion", "created": self.created,
                "model": self.model_name, "choices": choices, "usage": summary.usage.to_openai()}
        if self.plan.prompt_logprobs is not None:  # vLLM's extra: the rendered prompt's tokens, scored
            body["prompt_logprobs"] = self.prompt_logprobs_vllm(summary.choices[0].prompt_logprobs)
        return body

    def _logprobs(self, entries: list[TokenLogprob]) -> dict | None:
        if self.plan.params.logprobs is None or not entries:
            return None
        return {"content": [self._logprob(e) for e in entries], "refusal": None}

    def _logprob(self, entry: TokenLogprob) -> dict:
        def one(token_id: int, logprob: float) -> dict:
            data = self.token_bytes(token_id)
            return {"token": data.decode("utf-8", errors="replace"), "logprob": finite(logprob),
                    "bytes": list(data)}

        return {**one(entry.token_id, entry.logprob), "top_logprobs": [one(t, lp) for t, lp in entry.top]}


def chat_grammar(req: ChatCompletionRequest, prompt, tokenizer, tool_choice):
    """The request's grammar: its output format (response_format, structured_outputs, guided_*)
    and its tool_choice, applied after the reasoning (tallow/serve/structured.py)."""
    output = structured.one_format([structured.response_format(req.response_format),
                                    *structured.vllm_formats(req)])
    if isinstance(output, Rejection):
        return output
    fmt = structured.tool_call_grammar(
        tokenizer, tools=prompt.tools, tool_parser=prompt.tool_parser, tool_choice=tool_choice, output=output,
        max_calls=1 if req.parallel_tool_calls is False else None, chat_template=prompt.template_source)
    return structured.grammar_for(fmt, tokenizer, reasoning_parser=prompt.reasoning_parser,
                                  prompt_text=prompt.model_turn)


def _deltas(event: Event) -> list[dict]:
    """The chunk deltas of one event. The calls were streamed by their ToolCallDeltaEvents, so the
    ToolCallsEvent at the end adds nothing."""
    if isinstance(event, ContentEvent):
        return [{"content": event.text}]
    if isinstance(event, ReasoningEvent):
        return [{"reasoning_content": event.text, "reasoning": event.text}]
    if isinstance(event, ToolCallDeltaEvent):
        return [{"tool_calls": [_tool_call_delta(d)]} for d in event.deltas]
    return []


def _tool_call_delta(delta: ToolCallDelta) -> dict:
    """OpenAI's incremental form: id, type and name with the first piece, then argument pieces."""
    if delta.id is None:
        return {"index": delta.index, "function": {"arguments": delta.arguments}}
    return {"index": delta.index, "id": delta.id, "type": "function",
            "function": {"name": delta.name, "arguments": delta.arguments}}


def _tool_call(call: ToolCall) -> dict:
    return {"id": call.id, "type": "function", "function": {"name": call.name, "arguments": call.arguments}}
