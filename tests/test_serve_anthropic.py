"""Anthropic Messages end to end: the official anthropic client against a live server, over the
default model (greedy, dense weights), the replay model (tool use, thinking) and a slow fake
engine (pings, a full queue)."""

import asyncio
import json
from pathlib import Path

import anthropic
import httpx
import pytest
from deadlines import wait_until
from serve_utils import FakeEngine, LiveServer, scripted_reply

from tallow.chat_template import ChatTemplate
from tallow.config import ServerConfig
from tallow.engine.core import TokenOutput
from tallow.output.events import ContentEvent, ReasoningEvent
from tallow.serve.executor import ChoiceResult, ChoiceUpdate, CompletionSummary, Usage
from tallow.serve.plan import Rejection
from tallow.serve.protocols import anthropic as anthropic_protocol
from tallow.serve.protocols.anthropic import AnthropicMessages
from tallow.serve.protocols.anthropic_schemas import MessagesInput

WEATHER_TOOL = {"name": "get_weather", "description": "The weather forecast for a city.",
                "input_schema": {"type": "object", "properties": {
                    "city": {"type": "string"}, "unit": {"type": "string"},
                    "days": {"type": "array", "items": {"type": "integer"}}}, "required": ["city"]}}


# This SDK no longer sends sampling parameters itself; the wire protocol still has them.
GREEDY = {"extra_body": {"temperature": 0}}


def client_for(server) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=server.base_url, api_key="test-key", max_retries=0)


@pytest.fixture(scope="module")
def real(real_server):
    return client_for(real_server)


@pytest.fixture(scope="module")
def replay(agent_replay_server):
    return client_for(agent_replay_server)


def ask(text: str) -> list[dict]:
    return [{"role": "user", "content": text}]


def test_plain_message_and_its_stream(real):
    messages = ask("Write one sentence about the sea.")
    whole = real.messages.create(model="m", max_tokens=12, **GREEDY, messages=messages)
    assert whole.type == "message" and whole.role == "assistant" and whole.id.startswith("msg_")
    [block] = whole.content
    assert block.type == "text" and block.text
    assert whole.stop_reason in ("end_turn", "max_tokens") and whole.stop_sequence is None
    assert 0 < whole.usage.output_tokens <= 12

    with real.messages.stream(model="m", max_tokens=12, **GREEDY, messages=messages) as stream:
        events = list(stream)
        streamed = stream.get_final_message()
    deltas = [e.delta.text for e in events if e.type == "content_block_delta"]
    assert "".join(deltas) == block.text == streamed.content[0].text
    kinds = [e.type for e in events if e.type in ("message_start", "content_block_start", "content_block_stop",
                                                   "message_delta", "message_stop")]
    assert kinds == ["message_start", "content_block_start", "content_block_stop", "message_delta", "message_stop"]
    assert (streamed.stop_reason, streamed.usage.output_tokens) == (whole.stop_reason, whole.usage.output_tokens)


def test_max_tokens_stop_reason(real):
    reply = real.messages.create(model="m", max_tokens=3, **GREEDY, messages=ask("Tell me a long story."))
    assert reply.stop_reason == "max_tokens" and reply.usage.output_tokens == 3


@pytest.mark.parametrize("stream", [False, True])
def test_stop_sequences(real, stream):
    messages = ask("List three colours, separated by commas.")
    text = real.messages.create(model="m", max_tokens=10, **GREEDY, messages=messages).content[0].text
    stop = next(word for word in text.split()[1:] if text.find(word) > 0)
    kwargs = dict(model="m", max_tokens=10, **GREEDY, messages=messages, stop_sequences=["never-seen", stop])
    if stream:
        with real.messages.stream(**kwargs) as s:
            reply = s.get_final_message()
    else:
        reply = real.messages.create(**kwargs)
    assert (reply.stop_reason, reply.stop_sequence) == ("stop_sequence", stop)
    assert reply.content[0].text == text[:text.find(stop)]


def test_count_tokens_equals_the_prompt_the_message_used(real):
    kwargs = dict(model="m", system=[{"type": "text", "text": "Answer briefly."}],
                  messages=[*ask("Hi there."), {"role": "assistant", "content": "Hello!"}, *ask("What is 2+2?")])
    counted = real.messages.count_tokens(**kwargs).input_tokens
    usage = real.messages.create(max_tokens=2, **GREEDY, **kwargs).usage
    assert counted == usage.input_tokens + usage.cache_read_input_tokens
    without_system = real.messages.count_tokens(model="m", messages=kwargs["messages"]).input_tokens
    assert without_system != counted  # the system prompt is part of the prompt (SmolLM2 has a default one)


def test_bad_requests_are_invalid_request_errors(real, real_server):
    bad = [dict(max_tokens=0, messages=ask("Hi")),
           dict(max_tokens=8, messages=[]),
           dict(max_tokens=8, messages=ask("Hi"), extra_body={"temperature": 1.5}),
           dict(max_tokens=8, messages=[{"role": "user", "content": [{"type": "image", "source": {}}]}]),
           dict(max_tokens=8, messages=ask("Hi"), tools=[WEATHER_TOOL], tool_choice={"type": "tool", "name": "nope"}),
           dict(max_tokens=8, messages=ask("Hi"), tool_choice={"type": "any"}),
           dict(max_tokens=8, messages=ask("Hi"), tools=[{"type": "web_search_20250305", "name": "web_search"}]),
           dict(max_tokens=8, messages=ask("Hi"), thinking={"type": "enabled", "budget_tokens": 8})]
    for kwargs in bad:
        with pytest.raises(anthropic.BadRequestError) as e:
            real.messages.create(model="m", **kwargs)
        assert e.value.body["type"] == "error"
        assert e.value.body["error"]["type"] == "invalid_request_error" and e.value.body["error"]["message"]
    r = httpx.post(real_server.base_url + "/v1/messages", content=b'{"model": "m"', timeout=10)
    assert r.status_code == 400 and r.json()["error"]["type"] == "invalid_request_error"


def test_tool_use_round_trip(replay):
    messages = ask("What is the weather in Paris?")
    tool_call = scripted_reply("weather").split("<tool_call>")[1].split("</tool_call>")[0]
    expected_input = json.loads(tool_call)["arguments"]

    with replay.messages.stream(model="m", max_tokens=200, tools=[WEATHER_TOOL], messages=messages) as stream:
        events = list(stream)
        streamed = stream.get_final_message()
    partial_json = "".join(e.delta.partial_json for e in events
                           if e.type == "content_block_delta" and e.delta.type == "input_json_delta")
    assert json.loads(partial_json) == expected_input
    starts = [e.content_block.type for e in events if e.type == "content_block_start"]
    assert starts == ["text", "tool_use"]

    whole = replay.messages.create(model="m", max_tokens=200, tools=[WEATHER_TOOL], messages=messages)
    for reply in (streamed, whole):
        assert reply.stop_reason == "tool_use"
        text, tool_use = reply.content
        assert text.text == scripted_reply("weather").split("\n<tool_call>")[0]
        assert (tool_use.name, tool_use.input) == ("get_weather", expected_input)
        assert tool_use.id.startswith("toolu_")

    turn = [*messages, {"role": "assistant", "content": whole.content},
            {"role": "user", "content": [{"type": "tool_result", "tool_use_id": whole.content[1].id,
                                          "content": [{"type": "text", "text": "22 °C, sunny"}]}]}]
    answer = replay.messages.create(model="m", max_tokens=200, tools=[WEATHER_TOOL], messages=turn)
    assert [b.text for b in answer.content] == [scripted_reply("<tool_response>")]
    assert answer.stop_reason == "end_turn"


def test_thinking_blocks(replay):
    thought, answer = scripted_reply("riddle").removeprefix("<think>").split("</think>")
    answer = answer.lstrip("\n")  # the newlines after </think> are dropped; the reasoning is kept as is
    kwargs = dict(model="m", max_tokens=200, messages=ask("Solve this riddle."),
                  thinking={"type": "enabled", "budget_tokens": 100})
    whole = replay.messages.create(**kwargs)
    assert [(b.type, b.thinking if b.type == "thinking" else b.text) for b in whole.content] == [
        ("thinking", thought), ("text", answer)]
    with replay.messages.stream(**kwargs) as stream:
        events = list(stream)
        stream.get_final_message()
    thinking = "".join(e.delta.thinking for e in events
                       if e.type == "content_block_delta" and e.delta.type == "thinking_delta")
    assert thinking == thought
    # The thinking block is signed (opaque, stable for the same text): a signature_delta just
    # before its content_block_stop, the same signature as the non-streamed block's.
    assert whole.content[0].signature
    raw = [e for e in events if e.type not in ("text", "thinking", "signature", "input_json")]  # the SDK's own
    stop = next(k for k, e in enumerate(raw) if e.type == "content_block_stop" and e.index == 0)
    assert raw[stop - 1].type == "content_block_delta" and raw[stop - 1].delta.type == "signature_delta"
    assert raw[stop - 1].delta.signature == whole.content[0].signature
    assert stream.get_final_message().content[0].signature == whole.content[0].signature
    # An earlier turn's thinking block is accepted back.
    follow_up = [*kwargs["messages"], {"role": "assistant", "content": whole.content}, *ask("Another riddle?")]
    assert replay.messages.create(**{**kwargs, "messages": follow_up}).content[-1].text == answer


KEY = "secret"
HEADERS = {"x-api-key": KEY, "anthropic-version": "2023-06-01"}


@pytest.fixture
def fake(monkeypatch):
    """A slow fake engine (a token every 0.3 s, one sequence at a time, no queue) behind an API key."""
    monkeypatch.setattr(anthropic_protocol, "PING_INTERVAL_S", 0.05)
    engine = FakeEngine(max_num_seqs=1, interval=0.3)
    engine.chat_template = ChatTemplate(None, bos_token="<|im_start|>", eos_token="<|im_end|>")
    with LiveServer(engine, ServerConfig(max_queue=0, api_key=KEY)) as live:
        yield live
    asyncio.run(engine.shutdown())


def test_pings_while_waiting_and_overloaded_when_the_queue_is_full(fake):
    body = {"model": "m", "max_tokens": 3, "messages": ask("Hi"), "stream": True}
    url = fake.base_url + "/v1/messages"
    with httpx.stream("POST", url, json=body, headers=HEADERS, timeout=10) as r:
        lines = r.iter_lines()
        first = next(lines)
        busy = httpx.post(url, json={**body, "stream": False}, headers=HEADERS, timeout=10)
        names = [first] + [line for line in lines if line.startswith("event: ")]
    assert busy.status_code == 529 and busy.json()["error"]["type"] == "overloaded_error"
    # The silence before the first output is pinged, and a stream always begins with message_start
    # (brought forward by the first ping).
    assert names[0] == "event: message_start"
    assert "event: ping" in names[:names.index("event: content_block_start")]
    assert names[-2:] == ["event: message_delta", "event: message_stop"]


def test_a_long_prefill_still_starts_with_message_start_and_ends_with_the_whole_usage(fake):
    """A prefill longer than the ping interval: message_start goes out before the first ping, and
    the SDK's accumulated usage (message_delta's counts) is the final one."""
    client = anthropic.Anthropic(base_url=fake.base_url, api_key=KEY, max_retries=0)
    prompt_tokens = client.messages.count_tokens(model="m", messages=ask("Hi")).input_tokens
    with client.messages.stream(model="m", max_tokens=3, messages=ask("Hi")) as stream:
        events = list(stream)
        final = stream.get_final_message()
    types = [e.type for e in events]
    assert types[0] == "message_start" and types.count("message_start") == 1  # (the SDK drops pings)
    early = events[0].message.usage
    assert (early.input_tokens, early.cache_read_input_tokens, early.output_tokens) == (prompt_tokens, 0, 0)
    [delta] = [e for e in events if e.type == "message_delta"]
    assert delta.usage.model_dump(include={"input_tokens", "cache_creation_input_tokens",
                                           "cache_read_input_tokens", "output_tokens"}) == {
        "input_tokens": prompt_tokens, "cache_creation_input_tokens": 0, "cache_read_input_tokens": 0,
        "output_tokens": 3}
    assert (final.usage.input_tokens, final.usage.output_tokens) == (prompt_tokens, 3)


def streaming_protocol(engine, **body) -> AnthropicMessages:
    plan = AnthropicMessages.plan_request(json.dumps({"model": "m", "max_tokens": 50, "stream": True, **body}).encode(),
                                          engine, ServerConfig())
    assert not isinstance(plan, Rejection), plan
    return AnthropicMessages(plan, "m", engine.tokenizer, "msg_test")


def sse_events(frames: list[str]) -> list[dict]:
    return [json.loads(line.removeprefix("data: ")) for frame in frames for line in frame.splitlines()
            if line.startswith("data: ")]


def test_message_start_before_a_ping_and_after_the_first_output():
    engine = fake_engine()
    cached = Usage(prompt_tokens=40, completion_tokens=1, cached_tokens=32)
    # The first output before any ping: message_start carries the prefix cache's true share, and a
    # ping after it needs nothing before it.
    protocol = streaming_protocol(engine, messages=ask("Hi"))
    assert protocol.start() == []
    first = sse_events(protocol.add_events(ChoiceUpdate(0, [ContentEvent("a")], []), cached))
    assert first[0]["type"] == "message_start"
    assert first[0]["message"]["usage"]["input_tokens"] == 8
    assert first[0]["message"]["usage"]["cache_read_input_tokens"] == 32
    assert protocol.before_ping() == []
    # A ping before the first output: message_start first, the whole prompt as input then; the
    # final message_delta carries the split and the output, and no second message_start comes.
    protocol = streaming_protocol(engine, messages=ask("Hi"))
    protocol.start()
    [start] = sse_events(protocol.before_ping())
    prompt_tokens = len(protocol.plan.prompts[0])
    assert start["type"] == "message_start" and start["message"]["usage"] == {
        "input_tokens": prompt_tokens, "cache_creation_input_tokens": 0, "cache_read_input_tokens": 0,
        "output_tokens": 0}
    frames = protocol.add_events(ChoiceUpdate(0, [ContentEvent("a")], [], finish_reason="stop"), cached)
    frames += protocol.finish(cached)
    rest = sse_events(frames)
    assert "message_start" not in [e["type"] for e in rest]
    [delta] = [e for e in rest if e["type"] == "message_delta"]
    assert delta["usage"] == {"input_tokens": 8, "cache_creation_input_tokens": 0, "cache_read_input_tokens": 32,
                              "output_tokens": 1}


def test_each_thinking_block_closes_with_a_signature():
    engine = fake_engine()
    protocol = streaming_protocol(engine, messages=ask("Hi"), thinking={"type": "adaptive"})
    usage = Usage(prompt_tokens=10, completion_tokens=3)
    frames = protocol.add_events(ChoiceUpdate(0, [ReasoningEvent("Let me "), ReasoningEvent("think.")], []), usage)
    frames += protocol.add_events(ChoiceUpdate(0, [ContentEvent("Hello")], [], finish_reason="stop"), usage)
    events = sse_events(frames + protocol.finish(usage))
    types = [(e["type"], e.get("delta", {}).get("type")) for e in events]
    stop = types.index(("content_block_stop", None))
    assert types[stop - 1] == ("content_block_delta", "signature_delta") and events[stop - 1]["index"] == 0
    signature = events[stop - 1]["delta"]["signature"]
    assert signature and signature == anthropic_protocol.thinking_signature("Let me think.")
    # The text block closes without one.
    assert [t for t in types if t[1] == "signature_delta"] == [("content_block_delta", "signature_delta")]
    # The non-streamed block carries the same signature.
    summary = CompletionSummary(choices=[ChoiceResult(0, "Hello", "Let me think.", [], "stop", None)], usage=usage)
    body = streaming_protocol(engine, messages=ask("Hi")).response(summary)
    assert body["content"][0] == {"type": "thinking", "thinking": "Let me think.", "signature": signature}


async def _drain(frames):
    return [frame async for frame in frames]


def test_with_pings_sends_what_must_precede_a_ping_first():
    async def slow():
        await asyncio.sleep(0.2)
        yield "frame"

    sent = []

    def before_ping():
        sent.append(1)
        return ["start;"] if len(sent) == 1 else []

    out = asyncio.run(_drain(anthropic_protocol.with_pings(slow(), 0.02, before_ping=before_ping)))
    assert out[0] == "start;" + anthropic_protocol.PING
    assert out[1:-1] == [anthropic_protocol.PING] * (len(out) - 2) and out[-1] == "frame"


def test_api_key_headers(fake):
    reply = anthropic.Anthropic(base_url=fake.base_url, api_key=KEY, max_retries=0).messages.create(
        model="m", max_tokens=1, messages=ask("Hi"))
    assert reply.usage.output_tokens == 1
    with pytest.raises(anthropic.AuthenticationError) as e:
        anthropic.Anthropic(base_url=fake.base_url, api_key="wrong", max_retries=0).messages.count_tokens(
            model="m", messages=ask("Hi"))
    assert e.value.body["error"]["type"] == "authentication_error"


class FailingStream:
    """An engine stream whose model step fails at once."""

    def __init__(self, prompt_ids):
        self.output = TokenOutput([], None, None, "error", len(prompt_ids), 0)

    def __aiter__(self):
        return self

    async def __anext__(self):
        if self.output is None:
            raise StopAsyncIteration
        output, self.output = self.output, None
        return output

    def abort(self):
        self.output = None


def test_engine_failures_are_anthropic_errors(fake, monkeypatch):
    monkeypatch.setattr(fake.engine, "submit", lambda ids, params, request_id=None: [FailingStream(ids)])
    body = {"model": "m", "max_tokens": 3, "messages": ask("Hi")}
    url = fake.base_url + "/v1/messages"
    whole = httpx.post(url, json=body, headers=HEADERS, timeout=10)
    assert whole.status_code == 500 and whole.json()["error"]["type"] == "api_error"
    with httpx.stream("POST", url, json={**body, "stream": True}, headers=HEADERS, timeout=10) as r:
        lines = [line for line in r.iter_lines() if line]
    assert lines[-2] == "event: error"
    error = json.loads(lines[-1].removeprefix("data: "))
    assert error["type"] == "error" and error["error"]["type"] == "api_error" and error["error"]["message"]


def test_a_dropped_stream_frees_the_engine(fake):
    body = {"model": "m", "max_tokens": 100, "messages": ask("Tell me a story."), "stream": True}
    with httpx.stream("POST", fake.base_url + "/v1/messages", json=body, headers=HEADERS, timeout=10) as r:
        lines = r.iter_lines()
        while next(lines) != "event: content_block_delta":
            pass
        assert fake.engine.stats()["running"] == 1
    wait_until(lambda: fake.engine.stats()["running"] == 0)


# ---- prefill (a final assistant message is continued), tool_result.is_error, effort ------------------

QWEN3_TEMPLATE = (Path(__file__).parent / "data" / "qwen3_chat_template.jinja").read_text()
PREFILL = [{"role": "user", "content": "Give the data as JSON"}, {"role": "assistant", "content": "{"}]


def fake_engine(source: str | None = QWEN3_TEMPLATE, reply: str | None = None) -> FakeEngine:
    """A fast fake engine that renders with a real template (Qwen3's: <think>, tools) and says `reply`."""
    engine = FakeEngine(reply=reply)
    engine.chat_template = ChatTemplate(source, bos_token=None, eos_token="<|im_end|>",
                                        special_tokens=engine.tokenizer.special_tokens)
    return engine


def planned_prompt(engine, **body) -> str:
    plan = AnthropicMessages.plan_request(json.dumps({"model": "m", "max_tokens": 50, **body}).encode(), engine,
                                          ServerConfig())
    assert not isinstance(plan, Rejection), plan
    return engine.tokenizer.decode(plan.prompts[0], skip_special_tokens=False)


def rejection(engine, **body) -> Rejection:
    plan = AnthropicMessages.plan_request(json.dumps({"model": "m", "max_tokens": 50, **body}).encode(), engine,
                                          ServerConfig())
    assert isinstance(plan, Rejection)
    return plan


@pytest.mark.parametrize("source,opened", [(None, "<|im_start|>assistant\n"),
                                           (QWEN3_TEMPLATE, "<|im_start|>assistant\n<think>\n\n</think>\n\n")])
def test_a_final_assistant_message_is_continued(source, opened):
    engine = fake_engine(source)
    question = "<|im_start|>user\nGive the data as JSON<|im_end|>\n"
    # The prompt ends with the prefill: no end of turn after it, no new assistant turn.
    assert planned_prompt(engine, messages=PREFILL).endswith(question + opened + "{")
    blocks = [PREFILL[0], {"role": "assistant", "content": [{"type": "text", "text": '{"a":'}]}]
    assert planned_prompt(engine, messages=blocks).endswith(opened + '{"a":')
    # Thinking on (Qwen3's template closes the turn's reasoning block before the prefill) and a
    # thinking block of the prefilled turn: still continued.
    assert planned_prompt(engine, messages=PREFILL, thinking={"type": "adaptive"}).endswith(opened + "{")
    with_thought = [PREFILL[0], {"role": "assistant", "content": [
        {"type": "thinking", "thinking": "t", "signature": ""}, {"type": "text", "text": "{"}]}]
    prompt = planned_prompt(engine, messages=with_thought, thinking={"type": "adaptive"})
    assert prompt.endswith("{") and prompt.count("<|im_start|>assistant") == 1
    # count_tokens counts the same prompt.
    body = json.dumps({"model": "m", "messages": PREFILL}).encode()
    assert AnthropicMessages.count_tokens(body, engine, ServerConfig())["input_tokens"] == len(
        engine.tokenizer.encode(planned_prompt(engine, messages=PREFILL)))


def test_final_assistant_turns_that_are_not_continued():
    engine = fake_engine()
    fresh = planned_prompt(engine, messages=PREFILL[:1])
    assert fresh.endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")
    # An empty final assistant message is no prefill: left out, the reply is a new turn.
    for empty in ("", [], [{"type": "text", "text": ""}]):
        assert planned_prompt(engine, messages=[PREFILL[0], {"role": "assistant", "content": empty}]) == fresh
    # A final turn with tool_use is a finished turn (its call written out and closed): a new one follows.
    call = {"role": "assistant", "content": [{"type": "text", "text": "Let me look."},
                                              {"type": "tool_use", "id": "toolu_1", "name": "get_weather",
                                               "input": {"city": "Paris"}}]}
    prompt = planned_prompt(engine, messages=[PREFILL[0], call], tools=[WEATHER_TOOL])
    assert prompt.endswith("</tool_call><|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n")


@pytest.mark.parametrize("text", ["{ ", "{\n", [{"type": "text", "text": "Sure: "}]])
def test_a_prefill_ending_in_whitespace_is_a_400(text):
    engine = fake_engine()
    messages = [PREFILL[0], {"role": "assistant", "content": text}]
    refused = rejection(engine, messages=messages)
    assert (refused.status, refused.param) == (400, "messages.1.content")
    assert "final assistant content cannot end with trailing whitespace" in refused.message
    refused = AnthropicMessages.count_tokens(json.dumps({"messages": messages}).encode(), engine, ServerConfig())
    assert isinstance(refused, Rejection) and refused.param == "messages.1.content"


def test_a_prefill_with_a_grammar_is_a_400():
    engine = fake_engine()
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    assert "output_config.format" in rejection(
        engine, messages=PREFILL, output_config={"format": {"type": "json_schema", "schema": schema}}).message
    assert "tool_choice 'any'" in rejection(engine, messages=PREFILL, tools=[WEATHER_TOOL],
                                            tool_choice={"type": "any"}).message
    # tool_choice auto: the continuation may still call a tool.
    assert planned_prompt(engine, messages=PREFILL, tools=[WEATHER_TOOL]).endswith("\n\n{")


@pytest.fixture
def continuing():
    """A live server over a fast fake engine with Qwen3's template, whose reply continues a "{"."""
    engine = fake_engine(reply='"a": 1}')
    with LiveServer(engine) as live:
        yield live
    asyncio.run(engine.shutdown())


@pytest.mark.parametrize("stream", [False, True])
def test_the_reply_continues_the_prefill(continuing, stream):
    client = client_for(continuing)
    if stream:
        with client.messages.stream(model="m", max_tokens=50, messages=PREFILL) as s:
            events = list(s)
            reply = s.get_final_message()
        assert [e.content_block.type for e in events if e.type == "content_block_start"] == ["text"]
    else:
        reply = client.messages.create(model="m", max_tokens=50, messages=PREFILL)
    # The content is the continuation alone (not the prefill), and the turn ends normally.
    assert [(b.type, b.text) for b in reply.content] == [("text", '"a": 1}')]
    assert reply.stop_reason == "end_turn"
    [(prompt_ids, _)] = continuing.engine.submitted
    prompt = continuing.engine.tokenizer.decode(prompt_ids, skip_special_tokens=False)
    assert prompt.endswith("Give the data as JSON<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n{")
    # Usage: the prompt (prefill included) is input; the continuation (and its eos) is output.
    assert reply.usage.input_tokens + reply.usage.cache_read_input_tokens == len(prompt_ids)
    assert reply.usage.output_tokens == len('"a": 1}'.encode()) + 1


def test_a_prefill_is_text_unless_thinking_is_on():
    """A prefill that opens <think>: without thinking its continuation is text, whole; with it,
    the continuation's reasoning is a thinking block."""
    engine = fake_engine(reply="weighing it</think>\n\nDone.")
    messages = [PREFILL[0], {"role": "assistant", "content": "<think>\nLet me see:"}]
    with LiveServer(engine) as live:
        client = client_for(live)
        plain = client.messages.create(model="m", max_tokens=50, messages=messages)
        thinking = client.messages.create(model="m", max_tokens=50, messages=messages,
                                          thinking={"type": "enabled", "budget_tokens": 40})
        with client.messages.stream(model="m", max_tokens=50, messages=messages) as s:
            streamed = s.get_final_message()
    asyncio.run(engine.shutdown())
    for prompt_ids, _ in engine.submitted:
        assert engine.tokenizer.decode(prompt_ids, skip_special_tokens=False).endswith("\n<think>\nLet me see:")
    def blocks(reply):
        return [(b.type, b.thinking if b.type == "thinking" else b.text) for b in reply.content]

    for reply in (plain, streamed):
        assert blocks(reply) == [("text", "weighing it</think>\n\nDone.")]
    assert blocks(thinking) == [("thinking", "weighing it"), ("text", "Done.")]


def test_prefill_and_continue_final_message_agree(real_server):
    """The real model: Anthropic's prefill and Chat's continue_final_message continue the same
    prompt, greedily to the same text."""
    import openai

    messages = [{"role": "user", "content": "List three colours."}, {"role": "assistant", "content": "1. Red"}]
    oai = openai.OpenAI(base_url=real_server.base_url + "/v1", api_key="none", max_retries=0)
    chat = oai.chat.completions.create(model="m", temperature=0, max_tokens=8, messages=messages,
                                       extra_body={"continue_final_message": True, "add_generation_prompt": False})
    message = client_for(real_server).messages.create(model="m", max_tokens=8, **GREEDY, messages=messages)
    assert message.content[0].text == chat.choices[0].message.content
    assert message.usage.input_tokens + message.usage.cache_read_input_tokens == chat.usage.prompt_tokens
    assert message.usage.output_tokens == chat.usage.completion_tokens


def test_a_failed_tool_result_says_error():
    def tool_message(content, is_error):
        req = MessagesInput.model_validate({"messages": [
            {"role": "user", "content": "weather?"},
            {"role": "assistant", "content": [{"type": "tool_use", "id": "toolu_1", "name": "get_weather",
                                               "input": {"city": "Paris"}}]},
            {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_1", "content": content,
                                          **({"is_error": is_error} if is_error is not None else {})}]}]})
        [tool] = [m for m in req.template_messages() if m["role"] == "tool"]
        return tool["content"]

    assert tool_message("22 °C", None) == tool_message("22 °C", False) == "22 °C"
    assert tool_message("city not found", True) == "Error: city not found"
    assert tool_message([{"type": "text", "text": "timed out"}], True) == "Error: timed out"
    assert tool_message("", True) == "Error"
    prompt = planned_prompt(fake_engine(), tools=[WEATHER_TOOL], messages=[
        {"role": "user", "content": "weather?"},
        {"role": "assistant", "content": [{"type": "tool_use", "id": "toolu_1", "name": "get_weather",
                                           "input": {"city": "Paris"}}]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_1", "is_error": True,
                                      "content": "city not found"}]}])
    assert "<tool_response>\nError: city not found\n</tool_response>" in prompt


@pytest.mark.parametrize("effort", ["low", "medium", "high", "xhigh", "max"])
def test_every_effort_turns_thinking_on(effort):
    # Qwen3's template leaves the reasoning open to the model (no empty closed block) when thinking is on.
    prompt = planned_prompt(fake_engine(), messages=PREFILL[:1], output_config={"effort": effort})
    assert prompt.endswith("<|im_start|>assistant\n")


def test_refusals_name_the_anthropic_field():
    """A 400 names the field as the client sent it (stop_sequences, tool_choice.name), not the
    OpenAI field the request maps onto."""
    engine = fake_engine()
    user = PREFILL[:1]
    for stops in ([""], ["ok", ""], [f"s{k}" for k in range(ServerConfig().max_stop_strings + 1)]):
        refused = rejection(engine, messages=user, stop_sequences=stops)
        assert (refused.status, refused.param) == (400, "stop_sequences")
        assert refused.message.startswith("stop_sequences")
    refused = rejection(engine, messages=user, tools=[WEATHER_TOOL], tool_choice={"type": "tool", "name": "nope"})
    assert (refused.status, refused.param) == (400, "tool_choice.name") and "'nope'" in refused.message
    assert rejection(engine, messages=user, tool_choice={"type": "tool", "name": "nope"}).param == "tool_choice.name"


def test_blocks_come_in_the_order_generated_streamed_or_not():
    # text after a call: the stream shows tool_use then text; the whole reply must say the same
    engine = fake_engine(reply='<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n'
                               '</tool_call>\nChecking Paris.')
    messages = [{"role": "user", "content": "Weather in Paris?"}]
    with LiveServer(engine) as live:
        client = client_for(live)
        whole = client.messages.create(model="m", max_tokens=100, tools=[WEATHER_TOOL], messages=messages)
        with client.messages.stream(model="m", max_tokens=100, tools=[WEATHER_TOOL], messages=messages) as s:
            streamed = s.get_final_message()
    asyncio.run(engine.shutdown())

    def blocks(reply):
        return [(b.type, b.input if b.type == "tool_use" else b.text) for b in reply.content]

    assert blocks(whole) == [("tool_use", {"city": "Paris"}), ("text", "Checking Paris.")] == blocks(streamed)


def test_content_in_the_wrong_turn_or_empty_is_a_400():
    """As Anthropic's API: every message has content but an optional final assistant one; tool_use
    blocks only in assistant turns, tool_result blocks only in user turns; the 400 names where."""
    engine = fake_engine()
    call = {"type": "tool_use", "id": "toolu_1", "name": "get_weather", "input": {"city": "Paris"}}
    result = {"type": "tool_result", "tool_use_id": "toolu_1", "content": "22 °C"}
    ask_ = {"role": "user", "content": "Weather in Paris?"}
    for messages, field in (
            ([{"role": "user", "content": [{"type": "text", "text": "Weather?"}, call]}], "messages.0.content.1"),
            ([ask_, {"role": "assistant", "content": [result]}], "messages.1.content.0"),
            ([ask_, {"role": "assistant", "content": [call]}, {"role": "assistant", "content": [result]}],
             "messages.2.content.0"),
            ([{"role": "user", "content": []}], "messages.0"),
            ([ask_, {"role": "assistant", "content": []}, ask_], "messages.1"),
            ([ask_, {"role": "assistant", "content": "Sunny."}, {"role": "user", "content": ""}], "messages.2")):
        refused = rejection(engine, messages=messages, tools=[WEATHER_TOOL])
        assert (refused.status, refused.type) == (400, "invalid_request_error"), refused
        assert refused.message.startswith(field + ":"), refused.message
        if "content." not in field:
            assert refused.message == (f"{field}: all messages must have non-empty content except for the "
                                       "optional final assistant message")
        counted = AnthropicMessages.count_tokens(json.dumps({"messages": messages, "tools": [WEATHER_TOOL]}).encode(),
                                                 engine, ServerConfig())
        assert isinstance(counted, Rejection) and counted.message == refused.message
    # The right turns, and an empty final assistant turn: accepted.
    planned_prompt(engine, tools=[WEATHER_TOOL], messages=[
        ask_, {"role": "assistant", "content": [call]}, {"role": "user", "content": [result]},
        {"role": "assistant", "content": []}])


def test_content_in_the_wrong_turn_is_an_anthropic_400_over_http(fake):
    client = anthropic.Anthropic(base_url=fake.base_url, api_key=KEY, max_retries=0)
    with pytest.raises(anthropic.BadRequestError) as e:
        client.messages.create(model="m", max_tokens=5, messages=[
            {"role": "user", "content": [{"type": "tool_use", "id": "toolu_1", "name": "f", "input": {}}]}])
    assert e.value.body["type"] == "error" and e.value.body["error"]["type"] == "invalid_request_error"
    assert e.value.body["error"]["message"].startswith("messages.0.content.0: `tool_use` blocks")
    assert fake.engine.submitted == []
