"""Anthropic Messages end to end: the official anthropic client against a live server, over the
default model (greedy, dense weights), the replay model (tool use, thinking) and a slow fake
engine (pings, a full queue)."""

import asyncio
import json

import anthropic
import httpx
import pytest
from deadlines import wait_until
from serve_utils import FakeEngine, LiveServer, scripted_reply

from tallow.chat_template import ChatTemplate
from tallow.config import ServerConfig
from tallow.engine.core import TokenOutput
from tallow.serve.protocols import anthropic as anthropic_protocol

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
    thinking = "".join(e.delta.thinking for e in events
                       if e.type == "content_block_delta" and e.delta.type == "thinking_delta")
    assert thinking == thought
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
    # message_start waits for the first output (its usage then holds the prefix cache's share):
    # the silence before it is pinged too.
    assert names.index("event: message_start") < names.index("event: content_block_start")
    assert "event: ping" in names[:names.index("event: content_block_start")]
    assert names[-2:] == ["event: message_delta", "event: message_stop"]


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
