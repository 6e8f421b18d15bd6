"""Request validation and planning, through the HTTP app (httpx ASGITransport) over the fake engine."""

import asyncio
import json

import httpx
import pytest

from serve_utils import ByteTokenizer, ChatMLTemplate, FakeEngine
from tallow.config import ServerConfig
from tallow.serve.app import attach_engine, build_app

CHAT = "/v1/chat/completions"
TEXT = "/v1/completions"
USER = [{"role": "user", "content": "hi"}]


def post(app, path: str, body=None, content: bytes | None = None) -> httpx.Response:
    async def go():
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as client:
            return await client.post(path, json=body, content=content)

    return asyncio.run(go())


@pytest.fixture
def engine():
    return FakeEngine(max_model_len=128)


@pytest.fixture
def app(engine):
    return build_app(engine, ServerConfig())


REJECTIONS = [
    (CHAT, {}, "messages"),
    (CHAT, {"messages": []}, "messages"),
    (CHAT, {"messages": [{"role": "robot", "content": "x"}]}, "messages[0].role"),
    (CHAT, {"messages": [{"role": "user", "content": 5}]}, "messages[0].content"),
    (CHAT, {"messages": [{"role": "user", "content": [{"type": "image", "url": "x"}]}]}, "messages[0].content[0]"),
    (CHAT, {"messages": USER, "temperature": "hot"}, "temperature"),
    (CHAT, {"messages": USER, "temperature": 2.5}, "temperature"),
    (CHAT, {"messages": USER, "temperature": -0.1}, "temperature"),
    (CHAT, {"messages": USER, "top_p": 0}, "top_p"),
    (CHAT, {"messages": USER, "top_p": 1.5}, "top_p"),
    (CHAT, {"messages": USER, "n": 0}, "n"),
    (CHAT, {"messages": USER, "n": 17}, "n"),
    (CHAT, {"messages": USER, "max_tokens": 0}, "max_tokens"),
    (CHAT, {"messages": USER, "max_completion_tokens": 0}, "max_completion_tokens"),
    (CHAT, {"messages": USER, "logprobs": True, "top_logprobs": 21}, "top_logprobs"),
    (CHAT, {"messages": USER, "top_logprobs": 2}, "top_logprobs"),
    (CHAT, {"messages": USER, "presence_penalty": 2.5}, "presence_penalty"),
    (CHAT, {"messages": USER, "frequency_penalty": -3}, "frequency_penalty"),
    (CHAT, {"messages": USER, "logit_bias": {"abc": 1}}, "logit_bias"),
    (CHAT, {"messages": USER, "logit_bias": {"999": 1}}, "logit_bias"),
    (CHAT, {"messages": USER, "logit_bias": {"5": 101}}, "logit_bias.5"),
    (CHAT, {"messages": USER, "stop": ["x"] * 17}, "stop"),
    (CHAT, {"messages": USER, "stop": 3}, "stop"),
    (CHAT, {"messages": USER, "stream": "yes"}, "stream"),
    (CHAT, {"messages": USER, "min_p": 1.5}, "min_p"),
    (CHAT, {"messages": USER, "stop_token_ids": [1000]}, "stop_token_ids"),
    (CHAT, {"messages": USER, "min_tokens": 9, "max_tokens": 4}, "min_tokens"),
    # more than the context leaves after the prompt: would run to the end of the context ignoring eos
    (CHAT, {"messages": USER, "min_tokens": 200}, "min_tokens"),
    (CHAT, {"messages": USER, "min_tokens": 200, "max_tokens": 500}, "min_tokens"),
    (TEXT, {"prompt": "hi", "min_tokens": 127, "max_tokens": 1000}, "min_tokens"),
    (TEXT, {"prompt": "hi", "suffix": "bye"}, "suffix"),
    (TEXT, {}, "prompt"),
    (TEXT, {"prompt": ""}, "prompt"),
    (TEXT, {"prompt": []}, "prompt"),
    (TEXT, {"prompt": [1, 258]}, "prompt"),
    (TEXT, {"prompt": "hi", "logprobs": 21}, "logprobs"),
    (TEXT, {"prompt": "hi", "echo": True, "logprobs": 1, "n": 2}, "n"),
    (TEXT, {"prompt": "hi", "max_tokens": 0}, "max_tokens"),
    (TEXT, {"prompt": "hi", "prompt_logprobs": 21}, "prompt_logprobs"),
    (CHAT, {"messages": USER, "prompt_logprobs": 1, "stream": True}, "prompt_logprobs"),
    (TEXT, {"prompt": "hi", "max_tokens": -1}, "max_tokens"),
    # Numeric edges: the engine's int64 / float32 tensors, and finite numbers only.
    (TEXT, {"prompt": "hi", "seed": 2**63}, "seed"),
    (TEXT, {"prompt": "hi", "seed": -(2**63) - 1}, "seed"),
    (TEXT, {"prompt": "hi", "top_k": 2**63}, "top_k"),
    (TEXT, {"prompt": "hi", "top_p": 1e-46}, "top_p"),
    (TEXT, {"prompt": "hi", "repetition_penalty": 1e-300}, "repetition_penalty"),
    (TEXT, {"prompt": "hi", "repetition_penalty": 1e300}, "repetition_penalty"),
    (TEXT, {"prompt": "hi", "n": 2**64}, "n"),
    (TEXT, {"prompt": "hi", "max_tokens": 2**64}, "max_tokens"),
    (TEXT, {"prompt": [2**64]}, "prompt"),
    (TEXT, {"prompt": "hi", "stop_token_ids": [2**63]}, "stop_token_ids[0]"),
    (CHAT, {"messages": USER, "logit_bias": {"1_000": 1}}, "logit_bias"),
    (CHAT, {"messages": USER, "logit_bias": {" 7 ": 1}}, "logit_bias"),
    (CHAT, {"messages": USER, "logit_bias": {"\u0663": 1}}, "logit_bias"),
    (CHAT, {"messages": USER, "logit_bias": {"-1": 1}}, "logit_bias"),
]


@pytest.mark.parametrize("path,body,param", REJECTIONS, ids=[f"{p.split('/')[-1]}-{f}" for p, _, f in REJECTIONS])
def test_rejection_names_the_field(app, engine, path, body, param):
    r = post(app, path, body)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["type"] == "invalid_request_error"
    assert error["param"] == param
    assert param.split("[")[0] in error["message"]
    assert engine.submitted == []


def test_malformed_json_is_a_400(app):
    r = post(app, CHAT, content=b'{"messages": [')
    assert r.status_code == 400
    assert "JSON" in r.json()["error"]["message"]


@pytest.mark.parametrize("raw,param", [
    (b'{"messages": [{"role": "user", "content": "hi"}], "temperature": NaN}', "temperature"),
    (b'{"messages": [{"role": "user", "content": "hi"}], "repetition_penalty": Infinity}', "repetition_penalty"),
    (b'{"messages": [{"role": "user", "content": "hi"}], "logit_bias": {"5": -Infinity}}', "logit_bias.5"),
    (b'{"messages": [{"role": "user", "content": "hi"}], "chat_template_kwargs": {"a": [1, NaN]}}',
     "chat_template_kwargs.a[1]"),
    (b'{"messages": [{"role": "user", "content": "hi"}], "temperature": 1e400}', "temperature"),
])
def test_non_finite_json_numbers_are_400s_naming_where(app, engine, raw, param):
    r = post(app, CHAT, content=raw)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param
    assert engine.submitted == []


def test_nan_inside_a_string_is_text(app, engine):
    r = post(app, CHAT, {"messages": [{"role": "user", "content": "NaN and Infinity"}], "max_tokens": 2})
    assert r.status_code == 200, r.text


def test_numeric_edges_that_are_valid_reach_the_engine(app, engine):
    """Seeds at both ends of int64, top_k past the vocabulary (clamped to it), min_p that is 0 as a
    float32, a subnormal-free tiny temperature (greedy)."""
    r = post(app, TEXT, {"prompt": "hi", "max_tokens": 2, "seed": 2**63 - 1, "top_k": 2**63 - 1, "n": 2,
                         "min_p": 1e-46, "temperature": 1e-300})
    assert r.status_code == 200, r.text
    params = engine.submitted[-1][1]
    assert params.seed == 2**63 - 1 and params.top_k == 258 and params.greedy
    r = post(app, TEXT, {"prompt": "hi", "max_tokens": 2, "seed": -(2**63), "temperature": 1})
    assert r.status_code == 200, r.text
    assert engine.submitted[-1][1].seed == -(2**63)


def test_prompt_beyond_the_context_is_rejected_with_its_length(app, engine):
    content = "x" * 200
    prompt_len = len(ByteTokenizer().encode(ChatMLTemplate().render([{"role": "user", "content": content}])))
    r = post(app, CHAT, {"messages": [{"role": "user", "content": content}]})
    assert r.status_code == 400
    error = r.json()["error"]
    assert error["param"] == "messages" and error["code"] == "context_length_exceeded"
    assert str(prompt_len) in error["message"] and "128" in error["message"]


def test_min_tokens_up_to_the_room_left_is_accepted(app, engine):
    room = 128 - len(ByteTokenizer().encode(ChatMLTemplate().render(USER)))
    refused = post(app, CHAT, {"messages": USER, "min_tokens": room + 1})
    assert refused.status_code == 400 and refused.json()["error"]["param"] == "min_tokens"
    assert f"min_tokens ({room + 1}) must not exceed" in refused.json()["error"]["message"]
    assert post(app, CHAT, {"messages": USER, "min_tokens": room, "max_tokens": 2 * room}).status_code == 200
    assert engine.submitted[-1][1].min_tokens == room


@pytest.mark.parametrize("path,base", [(CHAT, {"messages": USER}), (TEXT, {"prompt": "hi"})])
def test_stream_options_need_stream(app, engine, path, base):
    """OpenAI's and vLLM's 400: stream_options only with stream true (null is no stream_options)."""
    for extra in ({"stream_options": {"include_usage": True}}, {"stream": False, "stream_options": {}},
                  {"stream": None, "stream_options": {"include_usage": False}}):
        r = post(app, path, {**base, "max_tokens": 2, **extra})
        assert r.status_code == 400, (extra, r.text)
        assert r.json()["error"] == {"message": "Stream options can only be defined when `stream=True`.",
                                     "type": "invalid_request_error", "param": "stream_options", "code": None}
    assert engine.submitted == []
    for extra in ({"stream_options": None}, {"stream": False, "stream_options": None},
                  {"stream": True, "stream_options": {"include_usage": True}}):
        assert post(app, path, {**base, "max_tokens": 2, **extra}).status_code == 200, extra


@pytest.mark.parametrize("max_tokens", [None, 5, 1000])
def test_max_tokens_is_clamped_to_the_room_left(app, engine, max_tokens):
    body = {"messages": USER, "temperature": 0}
    if max_tokens is not None:
        body["max_tokens"] = max_tokens
    assert post(app, CHAT, body).status_code == 200
    prompt_ids, params = engine.submitted[0]
    assert prompt_ids == ByteTokenizer().encode(ChatMLTemplate().render(USER))
    room = 128 - len(prompt_ids)
    assert params.max_tokens == (room if max_tokens is None else min(max_tokens, room))


def test_every_sampling_field_reaches_the_engine(app, engine):
    body = {"messages": [{"role": "system", "content": "be brief"},
                         {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}],
            "max_completion_tokens": 7, "max_tokens": 99, "temperature": 0.7, "top_p": 0.9, "n": 2, "seed": 11,
            "stop": "zz", "presence_penalty": 0.5, "frequency_penalty": -0.5, "logit_bias": {"65": -100},
            "logprobs": True, "top_logprobs": 3, "user": "u", "top_k": 5, "min_p": 0.1,
            "repetition_penalty": 1.2, "min_tokens": 2, "ignore_eos": True, "stop_token_ids": [10],
            "include_stop_str_in_output": True, "skip_special_tokens": False}
    r = post(app, CHAT, body)
    assert r.status_code == 200, r.text
    assert len(r.json()["choices"]) == 2
    prompt_ids, p = engine.submitted[0]
    assert prompt_ids == ByteTokenizer().encode(ChatMLTemplate().render(
        [{"role": "system", "content": "be brief"}, {"role": "user", "content": "a\nb"}]))  # parts joined as vLLM
    assert (p.max_tokens, p.temperature, p.top_p, p.n, p.seed, p.stop) == (7, 0.7, 0.9, 2, 11, ["zz"])
    assert (p.presence_penalty, p.frequency_penalty, p.logit_bias, p.logprobs) == (0.5, -0.5, {65: -100.0}, 3)
    assert (p.top_k, p.min_p, p.repetition_penalty, p.min_tokens, p.ignore_eos) == (5, 0.1, 1.2, 2, True)
    assert (p.stop_token_ids, p.include_stop_str_in_output, p.skip_special_tokens) == ([10], True, False)


def test_completion_prompt_shapes(app, engine):
    tok = ByteTokenizer()
    ab, cde = tok.encode("ab"), tok.encode("cde")
    for prompt, expected in [("ab", [ab]), (["ab", "cde"], [ab, cde]), (ab, [ab]), ([ab, cde], [ab, cde])]:
        engine.submitted.clear()
        r = post(app, TEXT, {"prompt": prompt, "temperature": 0})
        assert r.status_code == 200, r.text
        assert [ids for ids, _ in engine.submitted] == expected
        assert all(p.max_tokens == 16 for _, p in engine.submitted)  # the legacy default
        assert len(r.json()["choices"]) == len(expected)


def test_loading_answers_503_then_serves():
    app = build_app(None, ServerConfig())
    async def go():
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as client:
            health = await client.get("/health")
            chat = await client.post(CHAT, json={"messages": USER})
            attach_engine(app, FakeEngine())
            return health, chat, await client.get("/health"), await client.get("/v1/models")

    health, chat, ready, models = asyncio.run(go())
    assert health.status_code == 503 and chat.status_code == 503
    assert chat.json()["error"]["message"]
    assert ready.status_code == 200
    assert models.json()["data"][0]["id"] == "fake-model"


def test_api_key_is_required_when_set(engine):
    app = build_app(engine, ServerConfig(api_key="secret"))

    async def go():
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as client:
            return (await client.post(CHAT, json={"messages": USER}),
                    await client.post(CHAT, json={"messages": USER, "max_tokens": 2},
                                      headers={"Authorization": "Bearer secret"}))

    denied, allowed = asyncio.run(go())
    assert denied.status_code == 401 and denied.json()["error"]["type"] == "authentication_error"
    assert allowed.status_code == 200


def test_tool_calls_are_parsed_from_the_reply():
    call = {"name": "get_weather", "arguments": {"city": "Paris"}}
    reply = f"<tool_call>\n{json.dumps(call)}\n</tool_call>"
    app = build_app(FakeEngine(reply=reply), ServerConfig(tool_call_parser="hermes"))
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {
        "type": "object", "properties": {"city": {"type": "string"}}}}}]
    body = {"messages": USER, "tools": tools, "temperature": 0, "max_tokens": 200}

    choice = post(app, CHAT, body).json()["choices"][0]
    assert choice["finish_reason"] == "tool_calls" and choice["message"]["content"] is None
    [parsed] = choice["message"]["tool_calls"]
    assert parsed["function"]["name"] == call["name"]
    assert json.loads(parsed["function"]["arguments"]) == call["arguments"]

    frames = post(app, CHAT, {**body, "stream": True}).text.split("\n\n")
    chunks = [json.loads(f.removeprefix("data: ")) for f in frames if f.startswith("data: {")]
    deltas = [c["choices"][0]["delta"] for c in chunks if c["choices"]]
    assert not any(d.get("content") for d in deltas)
    parts = [c for d in deltas for c in d.get("tool_calls", [])]
    assert {p["index"] for p in parts} == {0} and parts[0]["function"]["name"] == parsed["function"]["name"]
    assert "".join(p["function"]["arguments"] for p in parts) == parsed["function"]["arguments"]
    assert chunks[-1]["choices"][0]["finish_reason"] == "tool_calls"

    plain = post(app, CHAT, {**body, "tools": None}).json()["choices"][0]
    assert (plain["message"]["content"], plain["finish_reason"]) == (reply, "stop")


def test_one_tool_call_when_parallel_calls_are_off_on_every_protocol():
    """parallel_tool_calls: false (Responses, chat) and disable_parallel_tool_use (Anthropic):
    a reply with two calls gives the first one only."""
    calls = [{"name": "get_weather", "arguments": {"city": "Paris"}},
             {"name": "get_weather", "arguments": {"city": "Rome"}}]
    reply = "".join(f"<tool_call>\n{json.dumps(c)}\n</tool_call>\n" for c in calls)
    app = build_app(FakeEngine(reply=reply), ServerConfig(tool_call_parser="hermes"))
    params = {"type": "object", "properties": {"city": {"type": "string"}}}
    chat_tools = [{"type": "function", "function": {"name": "get_weather", "parameters": params}}]
    for off in (None, False):
        extra = {} if off is None else {"parallel_tool_calls": off}
        chat = post(app, CHAT, {"messages": USER, "tools": chat_tools, "max_tokens": 200, "temperature": 0,
                                **extra}).json()
        got = [json.loads(c["function"]["arguments"]) for c in chat["choices"][0]["message"]["tool_calls"]]
        assert got == [c["arguments"] for c in calls][:1 if off is False else 2]

        responses = post(app, "/v1/responses", {"input": "weather?", "max_output_tokens": 200, "temperature": 0,
                                                **extra, "tools": [
            {"type": "function", "name": "get_weather", "parameters": params}]}).json()
        got = [json.loads(o["arguments"]) for o in responses["output"] if o["type"] == "function_call"]
        assert got == [c["arguments"] for c in calls][:1 if off is False else 2]

        choice = {"type": "auto"} if off is None else {"type": "auto", "disable_parallel_tool_use": True}
        message = post(app, "/v1/messages", {"model": "m", "max_tokens": 200, "temperature": 0, "tool_choice": choice,
                                             "messages": USER, "tools": [
                                                 {"name": "get_weather", "input_schema": params}]}).json()
        got = [b["input"] for b in message["content"] if b["type"] == "tool_use"]
        assert got == [c["arguments"] for c in calls][:1 if off is False else 2]
        assert message["stop_reason"] == "tool_use"
