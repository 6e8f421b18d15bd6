"""Tool calls and reasoning over HTTP: the official openai client against a live server on the
replay: test fixture model (scripted replies through the real tokenizer, engine and sink, so the
streams have real token boundaries), plus the default model answering a request with tools."""

import asyncio
import json
from pathlib import Path

import openai
import pytest

from serve_utils import LiveServer, replay_engine
from tallow.chat_template import ChatTemplate
from tallow.config import ServerConfig
from tallow.errors import TallowError
from tallow.serve.chat_prompt import render_chat
import tallow.testing  # noqa: F401  (registers the replay: model source)

DATA = Path(__file__).parent / "data"
TOOLS_SCRIPT = json.loads((DATA / "replay_serve_tools.json").read_text())
REPLIES = {e.get("match"): e["reply"] for e in TOOLS_SCRIPT["replies"]}
REPLIES_OPEN = {e["match"]: e["reply"]
                for e in json.loads((DATA / "replay_serve_open_think.json").read_text())["replies"]}

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather forecast for a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
                   "required": ["city"]}}}
TIME = {"type": "function", "function": {
    "name": "get_time", "parameters": {"type": "object", "properties": {"timezone": {"type": "string"}}}}}
SEARCH = {"type": "function", "function": {"name": "search", "parameters": {"type": "object", "properties": {}}}}
TOOLS = [WEATHER, TIME, SEARCH]


def scripted_call(reply: str) -> list[tuple[str, dict]]:
    """(name, arguments) of each <tool_call> block in a scripted reply: the expected parse."""
    blocks = reply.split("<tool_call>")[1:]
    return [(c["name"], c["arguments"]) for c in (json.loads(b.split("</tool_call>")[0]) for b in blocks)]


def openai_client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.base_url + "/v1", api_key="none", max_retries=0)


def serve(engine):
    """An openai client on a live server over engine, shut down afterwards."""
    try:
        with LiveServer(engine) as live:
            yield openai_client(live)
    finally:
        asyncio.run(engine.shutdown())


@pytest.fixture(scope="module")
def client():
    yield from serve(replay_engine(DATA / "replay_serve_tools.json"))


@pytest.fixture(scope="module")
def open_think_client():
    yield from serve(replay_engine(DATA / "replay_serve_open_think.json"))


def ask(text: str) -> list[dict]:
    return [{"role": "user", "content": text}]


def collect(chunks) -> dict:
    """A one-choice stream accumulated the way OpenAI clients do; checks the tool-call delta shape."""
    out = {"content": "", "reasoning_content": "", "reasoning": "", "calls": {}, "finish": None, "order": []}
    for chunk in chunks:
        for choice in chunk.choices:
            delta = choice.delta
            out["finish"] = choice.finish_reason or out["finish"]
            if delta.content:
                out["content"] += delta.content
                out["order"].append("content")
            extra = delta.model_extra or {}
            if extra.get("reasoning_content") is not None:
                assert extra["reasoning"] == extra["reasoning_content"]
                out["reasoning_content"] += extra["reasoning_content"]
                out["reasoning"] += extra["reasoning"]
                out["order"].append("reasoning")
            for tc in delta.tool_calls or []:
                out["order"].append("tool_call")
                if tc.index not in out["calls"]:  # the first delta names the call
                    assert tc.id and tc.type == "function" and tc.function.name
                    assert tc.function.arguments == ""
                    out["calls"][tc.index] = {"id": tc.id, "name": tc.function.name, "arguments": ""}
                else:  # then argument pieces only
                    assert tc.id is None and tc.function.name is None
                    out["calls"][tc.index]["arguments"] += tc.function.arguments
    return out


def both(client, messages, **kwargs):
    """The non-streamed choice and the accumulated stream of the same request."""
    whole = client.chat.completions.create(model="m", messages=messages, **kwargs).choices[0]
    streamed = collect(client.chat.completions.create(model="m", messages=messages, stream=True, **kwargs))
    return whole, streamed


def calls_of(whole) -> list[tuple[str, dict]]:
    return [(c.function.name, json.loads(c.function.arguments)) for c in whole.message.tool_calls or []]


def streamed_calls(streamed) -> list[tuple[str, dict]]:
    return [(c["name"], json.loads(c["arguments"])) for _, c in sorted(streamed["calls"].items())]


def test_a_streamed_call_accumulates_to_the_arguments(client):
    whole, streamed = both(client, ask("[one-call] find cafés"), tools=TOOLS)
    expected = scripted_call(REPLIES["[one-call]"])
    assert calls_of(whole) == streamed_calls(streamed) == expected
    assert whole.finish_reason == streamed["finish"] == "tool_calls"
    assert whole.message.content is None and streamed["content"] == ""
    assert whole.message.tool_calls[0].id.startswith("call_") and whole.message.tool_calls[0].type == "function"


def test_two_parallel_calls(client):
    whole, streamed = both(client, ask("[two-calls] weather and time in Paris"), tools=TOOLS,
                           parallel_tool_calls=True)
    expected = scripted_call(REPLIES["[two-calls]"])
    assert len(expected) == 2
    assert calls_of(whole) == streamed_calls(streamed) == expected
    assert sorted(streamed["calls"]) == [0, 1]
    assert len({c.id for c in whole.message.tool_calls}) == 2
    assert whole.finish_reason == streamed["finish"] == "tool_calls"


def test_parallel_tool_calls_false_ends_the_reply_after_the_first_call(client):
    """parallel_tool_calls: false -> generation ends once the first call is parsed: one call,
    finish_reason tool_calls, and fewer tokens than the scripted two-call reply."""
    messages = ask("[two-calls] weather and time in Paris")
    full = client.chat.completions.create(model="m", messages=messages, tools=TOOLS, parallel_tool_calls=True)
    whole, streamed = both(client, messages, tools=TOOLS, parallel_tool_calls=False)
    first = scripted_call(REPLIES["[two-calls]"])[:1]
    assert calls_of(whole) == streamed_calls(streamed) == first
    assert whole.finish_reason == streamed["finish"] == "tool_calls"
    one = client.chat.completions.create(model="m", messages=messages, tools=TOOLS, parallel_tool_calls=False)
    assert one.usage.completion_tokens < full.usage.completion_tokens


def test_content_before_a_call_streams_first(client):
    whole, streamed = both(client, ask("[content-first] forecast?"), tools=TOOLS)
    text = REPLIES["[content-first]"].split("<tool_call>")[0].strip()
    assert whole.message.content == streamed["content"] == text
    assert calls_of(whole) == streamed_calls(streamed) == scripted_call(REPLIES["[content-first]"])
    order = streamed["order"]
    assert order.index("tool_call") > max(i for i, kind in enumerate(order) if kind == "content")


def test_reasoning_then_a_call(client):
    """The markup inside the reasoning stays reasoning; the call after it is parsed."""
    whole, streamed = both(client, ask("[think-call] weather in Bern"), tools=TOOLS)
    reply = REPLIES["[think-call]"]
    reasoning = reply.split("<think>")[1].split("</think>")[0]
    message = whole.message.model_extra
    assert message["reasoning_content"] == message["reasoning"] == streamed["reasoning"] == reasoning
    assert calls_of(whole) == streamed_calls(streamed) == [("get_weather", {"city": "Bern"})]
    assert whole.message.content is None and streamed["content"] == ""
    assert whole.finish_reason == streamed["finish"] == "tool_calls"


def test_reasoning_then_content(client):
    whole, streamed = both(client, ask("[think-answer] what time is it?"), tools=TOOLS)
    reasoning, content = REPLIES["[think-answer]"].removeprefix("<think>").split("</think>")
    assert whole.message.model_extra["reasoning_content"] == streamed["reasoning_content"] == reasoning
    assert whole.message.content == streamed["content"] == content.lstrip("\n")
    assert "<think>" not in streamed["content"] and "</think>" not in streamed["content"]
    assert not whole.message.tool_calls and not streamed["calls"]
    assert whole.finish_reason == streamed["finish"] == "stop"
    assert streamed["order"].index("content") > streamed["order"].index("reasoning")


def test_a_multi_turn_exchange_with_a_tool_message(client):
    """The second reply is scripted to match only when the template rendered the assistant's call
    and the tool result next to each other."""
    messages = ask("[multi] weather in Bern?")
    first = client.chat.completions.create(model="m", messages=messages, tools=TOOLS).choices[0]
    [call] = first.message.tool_calls
    messages += [
        {"role": "assistant", "content": None,
         "tool_calls": [{"id": call.id, "type": "function",
                         "function": {"name": call.function.name, "arguments": call.function.arguments}}]},
        {"role": "tool", "tool_call_id": call.id, "content": "sunny, 21 °C"}]
    whole, streamed = both(client, messages, tools=TOOLS)
    expected = REPLIES[next(k for k in REPLIES if k and k.endswith("sunny"))]
    assert whole.message.content == streamed["content"] == expected
    assert whole.finish_reason == streamed["finish"] == "stop"


def test_tool_choice_none_parses_nothing(client):
    whole, streamed = both(client, ask("[one-call] find cafés"), tools=TOOLS, tool_choice="none")
    assert whole.message.content == streamed["content"] == REPLIES["[one-call]"]
    assert not whole.message.tool_calls and not streamed["calls"]
    assert whole.finish_reason == streamed["finish"] == "stop"


@pytest.mark.parametrize("tool_choice,param", [
    ("required", "tool_choice"), ({"type": "function", "function": {"name": "nope"}}, "tool_choice.function.name")])
def test_a_forced_tool_choice_needs_the_tool(client, tool_choice, param):
    """Enforced tool_choice (tests/test_structured_output.py) needs tools, and a named function one of them."""
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model="m", messages=ask("[one-call]"), tool_choice=tool_choice,
                                       tools=TOOLS if param != "tool_choice" else openai.NOT_GIVEN)
    assert e.value.body["param"] == param


def test_a_template_that_opens_think_starts_the_reply_in_reasoning(open_think_client):
    whole, streamed = both(open_think_client, ask("[open-think] hi!"))
    reasoning, content = REPLIES_OPEN["[open-think]"].split("</think>")
    assert whole.message.model_extra["reasoning"] == streamed["reasoning"] == reasoning
    assert whole.message.content == streamed["content"] == content.lstrip("\n")


def test_a_call_after_reasoning_opened_by_the_template(open_think_client):
    whole, streamed = both(open_think_client, ask("[open-think-call] weather in Oslo"), tools=TOOLS)
    assert calls_of(whole) == streamed_calls(streamed) == scripted_call(REPLIES_OPEN["[open-think-call]"])
    assert whole.message.model_extra["reasoning"] == REPLIES_OPEN["[open-think-call]"].split("</think>")[0]
    assert whole.message.content is None


@pytest.mark.parametrize("switch", [{"reasoning_effort": "none"},
                                    {"extra_body": {"chat_template_kwargs": {"enable_thinking": False}}}])
def test_thinking_can_be_turned_off(open_think_client, switch):
    """The reply is scripted on the closed empty block the template writes with enable_thinking=False."""
    whole = open_think_client.chat.completions.create(model="m", messages=ask("[open-think] hi!"), **switch)
    assert whole.choices[0].message.content == REPLIES_OPEN["<think>\n\n</think>\n\n"]
    assert "reasoning" not in (whole.choices[0].message.model_extra or {})



# ---- the rendering, without a server ---------------------------------------------------------


def smollm2_template() -> ChatTemplate:
    from tallow.models.loader import default_model_path
    from tallow.tokenizer import read_gguf_tokenizer_metadata

    source = read_gguf_tokenizer_metadata(default_model_path())["tokenizer.chat_template"]
    return ChatTemplate(source, bos_token="<|im_start|>", eos_token="<|im_end|>")


ROUND_TRIP = [
    {"role": "user", "content": "Weather in Bern?"},
    {"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Bern"}'}},
        {"id": "call_2", "type": "function", "function": {"name": "get_time", "arguments": "{}"}}]},
    {"role": "tool", "tool_call_id": "call_1", "content": "sunny"},
    {"role": "tool", "tool_call_id": "call_2", "content": "noon"},
]


def test_templates_without_tools_get_the_hermes_fallback():
    template = smollm2_template()
    assert not template.supports_tools
    prompt = render_chat(template, ROUND_TRIP, ServerConfig(), tools=[WEATHER, TIME])
    assert prompt.tool_parser == "hermes" and prompt.reasoning_parser == "none"
    system = prompt.text.split("<|im_end|>")[0]
    assert system.startswith("<|im_start|>system\n# Tools")
    for tool in (WEATHER, TIME):
        assert json.dumps(tool, ensure_ascii=False) in system
    assert ('<|im_start|>assistant\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Bern"}}\n'
            '</tool_call>\n<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call><|im_end|>') in prompt.text
    assert ("<|im_start|>user\n<tool_response>\nsunny\n</tool_response>\n<tool_response>\nnoon\n"
            "</tool_response><|im_end|>") in prompt.text

    none = render_chat(template, ROUND_TRIP, ServerConfig(), tools=[WEATHER], tool_choice="none")
    assert none.tool_parser is None and "# Tools" not in none.text
    assert "<tool_response>\nsunny" in none.text  # the history still renders


def test_templates_with_tools_render_their_own_section():
    template = ChatTemplate(TOOLS_SCRIPT["chat_template"], bos_token=None, eos_token="<|im_end|>")
    prompt = render_chat(template, ROUND_TRIP, ServerConfig(), tools=[WEATHER])
    assert prompt.text == template.render(ROUND_TRIP, tools=[WEATHER])
    assert (prompt.tool_parser, prompt.reasoning_parser) == ("hermes", "qwen3")
    configured = render_chat(template, ROUND_TRIP, ServerConfig(tool_call_parser="qwen3_coder",
                                                                 reasoning_parser="none"), tools=[WEATHER])
    assert (configured.tool_parser, configured.reasoning_parser) == ("qwen3_coder", "none")
    with pytest.raises(TallowError) as e:
        render_chat(template, ROUND_TRIP, ServerConfig(tool_call_parser="nope"), tools=[WEATHER])
    assert e.value.status == 500


# ---- the real default model ------------------------------------------------------------------


def test_the_default_model_answers_a_request_with_tools(real_server):
    whole, streamed = both(openai_client(real_server), ask("What is the weather in Paris? Use the tool."),
                           tools=[WEATHER], temperature=0, max_tokens=32)
    assert whole.finish_reason in ("stop", "length", "tool_calls")
    for name, arguments in calls_of(whole):  # a parsed call is well-formed
        assert name and isinstance(arguments, dict)
    assert whole.message.content or whole.message.tool_calls
    assert streamed["finish"] == whole.finish_reason
    assert streamed["content"] == (whole.message.content or "")


@pytest.mark.parametrize("body, param", [
    ({"tools": [{"type": "function", "function": {"description": "no name"}}]}, "tools[0].function.name"),
    ({"tools": [{"type": "retrieval"}]}, "tools[0].type"),
    ({"tools": [WEATHER], "tool_choice": "sometimes"}, "tool_choice"),
])
def test_malformed_tools_are_400s_naming_the_field(client, body, param):
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model="m", messages=ask("[one-call]"), extra_body=body)
    assert e.value.body["param"] == param
