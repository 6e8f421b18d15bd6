"""OpenAI Responses end to end: the official openai client's responses API against a live server,
over the default model (greedy, dense weights) and the replay model (function calls); and the
ResponsesStore's bounds."""

import asyncio
import json

from pathlib import Path

import openai
import pytest
from serve_utils import FakeEngine, LiveServer, scripted_reply

from tallow.chat_template import ChatTemplate
from tallow.config import ServerConfig
from tallow.serve.plan import Rejection
from tallow.serve.protocols.responses import OpenAIResponses
from tallow.serve.responses_store import ResponsesStore

WEATHER_TOOL = {"type": "function", "name": "get_weather", "description": "The weather forecast for a city.",
                "parameters": {"type": "object", "properties": {
                    "city": {"type": "string"}, "unit": {"type": "string"},
                    "days": {"type": "array", "items": {"type": "integer"}}}, "required": ["city"]}}


def client_for(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.base_url + "/v1", api_key="none", max_retries=0)


@pytest.fixture(scope="module")
def real(real_server):
    return client_for(real_server)


@pytest.fixture(scope="module")
def replay(agent_replay_server):
    return client_for(agent_replay_server)


def test_create_and_stream_agree(real):
    kwargs = dict(model="m", input="Write one sentence about the sea.", instructions="Be brief.",
                  max_output_tokens=10, temperature=0)
    whole = real.responses.create(**kwargs)
    assert whole.id.startswith("resp_") and whole.object == "response"
    [message] = whole.output
    assert message.type == "message" and message.content[0].type == "output_text" and whole.output_text
    usage = whole.usage
    assert usage.total_tokens == usage.input_tokens + usage.output_tokens and usage.output_tokens <= 10
    assert usage.output_tokens_details.reasoning_tokens == 0
    if usage.output_tokens == 10:
        assert (whole.status, whole.incomplete_details.reason) == ("incomplete", "max_output_tokens")
    else:
        assert whole.status == "completed" and whole.incomplete_details is None

    events = list(real.responses.create(stream=True, **kwargs))
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert [e.type for e in events] == [
        "response.created", "response.in_progress", "response.output_item.added", "response.content_part.added",
        *["response.output_text.delta"] * (len(events) - 8), "response.output_text.done",
        "response.content_part.done", "response.output_item.done",
        "response.completed" if whole.status == "completed" else "response.incomplete"]
    final = events[-1].response
    deltas = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert deltas == final.output_text == whole.output_text
    assert final.usage.output_tokens == usage.output_tokens


def test_previous_response_id_continues_from_the_prefix_cache(real, real_server):
    first = real.responses.create(model="m", input="Name a colour.", max_output_tokens=6, temperature=0)
    second = real.responses.create(model="m", previous_response_id=first.id, input="Name another one.",
                                   max_output_tokens=6, temperature=0)
    assert second.previous_response_id == first.id
    # The prompt holds the first turn, its reply and the new question; the first prompt's full
    # blocks come from the prefix cache.
    assert second.usage.input_tokens > first.usage.input_tokens + first.usage.output_tokens
    block_size = real_server.engine.core.config.block_size
    assert second.usage.input_tokens_details.cached_tokens >= first.usage.input_tokens - (block_size - 1) > 0


def test_retrieve_delete_and_unknown_ids(real):
    created = real.responses.create(model="m", input="Say hi.", max_output_tokens=3, temperature=0)
    got = real.responses.retrieve(created.id)
    assert (got.id, got.output_text, got.usage.output_tokens) == (created.id, created.output_text,
                                                                   created.usage.output_tokens)
    deleted = real.responses.delete(created.id)
    assert deleted is None or getattr(deleted, "deleted", True)
    for call in (lambda: real.responses.retrieve(created.id), lambda: real.responses.delete(created.id),
                 lambda: real.responses.retrieve("resp_unknown")):
        with pytest.raises(openai.NotFoundError):
            call()
    # Creating on top of an unknown response: OpenAI's 400 with the code clients key their resend on.
    with pytest.raises(openai.BadRequestError) as e:
        real.responses.create(model="m", input="Hi", previous_response_id="resp_unknown")
    assert e.value.code == "previous_response_not_found" and e.value.param == "previous_response_id"
    unstored = real.responses.create(model="m", input="Say hi.", max_output_tokens=3, temperature=0, store=False)
    with pytest.raises(openai.NotFoundError):
        real.responses.retrieve(unstored.id)


def test_bad_requests(real):
    for kwargs in (dict(input="Hi", tools=[{"type": "retrieval"}]),
                   dict(input="Hi", tool_choice="required"),
                   dict(input="Hi", tools=[WEATHER_TOOL], tool_choice={"type": "function", "name": "nope"}),
                   dict(input="Hi", text={"format": {"type": "json_schema", "name": "x", "schema": {"type": 7}}}),
                   dict(input="Hi", max_output_tokens=0),
                   dict(input=[{"type": "message", "role": "user", "content": [{"type": "input_image"}]}])):
        with pytest.raises(openai.BadRequestError) as e:
            real.responses.create(model="m", **kwargs)
        assert e.value.body["type"] == "invalid_request_error"


def test_function_call_round_trip(replay):
    call = json.loads(scripted_reply("weather").split("<tool_call>")[1].split("</tool_call>")[0])
    question = "What is the weather in Paris?"
    first = replay.responses.create(model="m", input=question, tools=[WEATHER_TOOL])
    message, function_call = first.output
    assert message.content[0].text == scripted_reply("weather").split("\n<tool_call>")[0]
    assert (function_call.type, function_call.name) == ("function_call", call["name"])
    assert json.loads(function_call.arguments) == call["arguments"]

    events = list(replay.responses.create(model="m", input=question, tools=[WEATHER_TOOL], stream=True))
    arguments = "".join(e.delta for e in events if e.type == "response.function_call_arguments.delta")
    [done] = [e for e in events if e.type == "response.function_call_arguments.done"]
    assert json.loads(arguments) == call["arguments"] and done.arguments == arguments

    result = {"type": "function_call_output", "call_id": function_call.call_id, "output": "22 °C, sunny"}
    answer = replay.responses.create(model="m", previous_response_id=first.id, input=[result], tools=[WEATHER_TOOL])
    assert answer.output_text == scripted_reply("<tool_response>")
    # The same turn with the history sent back as items instead.
    history = [{"role": "user", "content": question}, {"type": "function_call", "call_id": function_call.call_id,
                                                       "name": function_call.name,
                                                       "arguments": function_call.arguments}, result]
    stateless = replay.responses.create(model="m", input=history, tools=[WEATHER_TOOL], store=False)
    assert stateless.output_text == answer.output_text


def planned(protocol, body: dict):
    engine = FakeEngine()
    source = (Path(__file__).parent / "data" / "qwen3_chat_template.jinja").read_text()
    engine.chat_template = ChatTemplate(source, bos_token=None, eos_token="<|im_end|>",
                                        special_tokens=engine.tokenizer.special_tokens)
    return protocol.plan_request(json.dumps({"model": "m", "tools": [WEATHER_TOOL], **body}).encode(), engine,
                                 ServerConfig())


def test_a_call_output_without_its_call_is_a_400():
    protocol = OpenAIResponses.with_store(ResponsesStore(60, 1 << 20))
    call = {"type": "function_call", "call_id": "call_1", "name": "get_weather", "arguments": '{"city": "Paris"}'}
    output = {"type": "function_call_output", "call_id": "call_1", "output": "22 °C"}
    question = {"role": "user", "content": "Weather in Paris?"}
    # No function_call with that call_id: OpenAI's 400, on input.
    for items, what in (([question, output], "function call output"),
                        ([question, {**call, "call_id": "call_2"}, output], "function call output"),
                        ([question, {**output, "type": "custom_tool_call_output"}], "custom tool call output")):
        rejection = planned(protocol, {"input": items})
        assert isinstance(rejection, Rejection) and rejection.status == 400 and rejection.param == "input"
        assert rejection.message == f"No tool call found for {what} with call_id call_1."
    # With its call in the input, or in the previous response's conversation: accepted.
    assert not isinstance(planned(protocol, {"input": [question, call, output]}), Rejection)
    protocol.store.put("resp_1", {"id": "resp_1"}, [
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": "", "tool_calls": [{"id": "call_1", "type": "function", "function": {
            "name": "get_weather", "arguments": '{"city": "Paris"}'}}]}])
    assert not isinstance(planned(protocol, {"previous_response_id": "resp_1", "input": [output]}), Rejection)
    assert isinstance(planned(protocol, {"previous_response_id": "resp_1", "input": [{**output, "call_id": "x"}]}),
                      Rejection)


def test_reasoning_items_and_tokens(replay):
    thought = scripted_reply("riddle").split("<think>")[1].split("</think>")[0]
    reply = replay.responses.create(model="m", input="Solve this riddle.")
    reasoning, message = reply.output
    assert reasoning.type == "reasoning" and reasoning.content[0].text == thought
    assert message.content[0].text == scripted_reply("riddle").split("</think>")[1].lstrip("\n")
    assert 0 < reply.usage.output_tokens_details.reasoning_tokens < reply.usage.output_tokens
    events = list(replay.responses.create(model="m", input="Solve this riddle.", stream=True))
    assert "".join(e.delta for e in events if e.type == "response.reasoning_text.delta") == thought


class Clock:
    def __init__(self):
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_store_expires_entries_after_the_ttl():
    clock = Clock()
    store = ResponsesStore(ttl_s=10, max_bytes=10_000, clock=clock)
    store.put("a", {"id": "a"}, [])
    clock.now = 5
    store.put("b", {"id": "b"}, [])
    clock.now = 10
    assert store.get("a") is None and store.get("b").response == {"id": "b"}
    clock.now = 15
    assert store.get("b") is None and store.num_bytes == 0


def test_store_drops_the_oldest_past_the_byte_cap():
    def entry(i):
        return {"id": str(i), "text": "x" * 100}

    size = len(json.dumps([entry(0), []]).encode())
    store = ResponsesStore(ttl_s=100, max_bytes=3 * size)
    for i in range(4):
        assert store.put(str(i), entry(i), [])
    assert [store.get(str(i)) is not None for i in range(4)] == [False, True, True, True]
    assert store.num_bytes == 3 * size
    assert not store.put("big", {"text": "x" * 4 * size}, [])
    assert store.delete("3") and not store.delete("3") and store.num_bytes == 2 * size


def test_items_come_in_the_order_generated_streamed_or_not():
    # text after a call: the stream shows the function_call item, then a message; so must the whole
    engine = FakeEngine(reply='<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n'
                              '</tool_call>\nChecking Paris.')
    source = (Path(__file__).parent / "data" / "qwen3_chat_template.jinja").read_text()
    engine.chat_template = ChatTemplate(source, bos_token=None, eos_token="<|im_end|>",
                                        special_tokens=engine.tokenizer.special_tokens)
    with LiveServer(engine) as live:
        client = client_for(live)
        whole = client.responses.create(model="m", input="Weather in Paris?", tools=[WEATHER_TOOL])
        events = list(client.responses.create(model="m", input="Weather in Paris?", tools=[WEATHER_TOOL],
                                              stream=True))
    asyncio.run(engine.shutdown())
    streamed = [e for e in events if e.type == "response.completed"][0].response

    def items(reply):
        return [(i.type, json.loads(i.arguments) if i.type == "function_call" else i.content[0].text)
                for i in reply.output]

    assert items(whole) == [("function_call", {"city": "Paris"}), ("message", "Checking Paris.")] == items(streamed)


def test_reasoning_summary_takes_openais_values():
    """reasoning.summary is one of auto, concise, detailed (or null), as OpenAI's API has it;
    reasoning.effort is one of OpenAI's efforts."""
    protocol = OpenAIResponses.with_store(ResponsesStore(60, 1 << 20))
    for summary in ("auto", "concise", "detailed", None):
        assert not isinstance(planned(protocol, {"input": "Hi", "reasoning": {"summary": summary}}), Rejection)
    for reasoning, param in (({"summary": "wizard"}, "reasoning.summary"), ({"summary": ""}, "reasoning.summary"),
                             ({"summary": 1}, "reasoning.summary"), ({"effort": "extreme"}, "reasoning.effort")):
        rejection = planned(protocol, {"input": "Hi", "reasoning": reasoning})
        assert isinstance(rejection, Rejection) and (rejection.status, rejection.param) == (400, param), rejection
        assert rejection.type == "invalid_request_error" and rejection.message.startswith(param)
