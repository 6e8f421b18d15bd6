"""Structured output and enforced tool calls end to end (tallow/serve/structured.py and the
grammar engine): the official clients against live servers on the default model (a 135M model
does not write valid JSON on its own: that is the point) and on the replay: fixture model, whose
scripted replies reason first; jsonschema is the judge of every JSON the server returns.

The schema suite: GENERATED_SCHEMAS bounded schemas (every string, array and number has limits,
so no reply is cut by max_tokens: a cut reply fails the test as a design error), each run greedy
and sampled with a seed, all 100 requests in flight at once (about 25 s on a busy 2-core machine,
so the whole suite is in the fast tier).
"""

from __future__ import annotations

import asyncio
import json
import random
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import anthropic
import httpx
import jsonschema
import openai
import pydantic
import pytest
from typing import Annotated

from serve_utils import LiveServer, replay_engine
import tallow.testing  # noqa: F401  (registers the replay: model source)
from tallow.serve import structured
from tallow.serve.plan import Rejection

pytest.importorskip("llguidance")

GENERATED_SCHEMAS = 50
MAX_TOKENS = 400


def ask(text: str) -> list[dict]:
    return [{"role": "user", "content": text}]


@pytest.fixture(scope="module")
def client(real_server) -> openai.OpenAI:
    return openai.OpenAI(base_url=real_server.base_url + "/v1", api_key="none", max_retries=0, timeout=300)


@pytest.fixture(scope="module")
def claude(real_server) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=real_server.base_url, api_key="none", max_retries=0, timeout=300)


# ---- the generated schemas -------------------------------------------------------------------


def generated_schema(rng: random.Random, depth: int = 0) -> dict:
    """A bounded JSON schema: nested objects, arrays with minItems/maxItems, enums, numbers with
    bounds, required and optional properties, anyOf, string patterns llguidance supports."""
    kinds = ["string", "pattern", "enum", "integer", "number", "boolean", "anyOf"]
    if depth < 2:
        kinds += ["object", "array"]
    kind = rng.choice(kinds)
    if kind == "string":
        return {"type": "string", "minLength": rng.randint(0, 2), "maxLength": rng.randint(3, 12)}
    if kind == "pattern":
        return {"type": "string", "pattern": rng.choice([r"^[a-z]{2,6}$", r"^[A-Z][a-z]{1,5}$", r"^\d{3}-\d{2}$",
                                                         r"^(red|green|blue)$", r"^[a-f0-9]{4}$"])}
    if kind == "enum":
        return {"enum": rng.sample(["alpha", "beta", "gamma", "delta", 1, 2, True, None], rng.randint(1, 4))}
    if kind == "integer":
        low = rng.randint(-50, 50)
        return {"type": "integer", "minimum": low, "maximum": low + rng.randint(0, 100)}
    if kind == "number":
        low = rng.randint(-10, 10)
        # multipleOf bounds the digits too: a sampled number may otherwise run on until max_tokens.
        return {"type": "number", "minimum": low, "maximum": low + rng.randint(1, 20), "multipleOf": 0.25}
    if kind == "boolean":
        return {"type": "boolean"}
    if kind == "anyOf":
        return {"anyOf": [generated_schema(rng, 2), generated_schema(rng, 2)]}
    if kind == "array":
        low = rng.randint(0, 2)
        return {"type": "array", "items": generated_schema(rng, depth + 1), "minItems": low,
                "maxItems": low + rng.randint(0, 2)}
    return generated_object(rng, depth + 1)


def generated_object(rng: random.Random, depth: int = 0) -> dict:
    names = rng.sample(["name", "age", "city", "tags", "score", "kind", "ok", "note", "id", "items"], rng.randint(1, 4))
    properties = {name: generated_schema(rng, depth) for name in names}
    required = [n for n in names if rng.random() < 0.7]
    return {"type": "object", "properties": properties, "required": required, "additionalProperties": False}


SCHEMAS = [generated_object(random.Random(k)) for k in range(GENERATED_SCHEMAS)]


def run_schemas(client: openai.OpenAI, schemas: list[dict]) -> None:
    """Every schema greedy and sampled (seeded), all requests at once; each reply parses and
    validates, and none was cut by max_tokens."""
    def one(job):
        k, schema, sampled = job
        extra = dict(temperature=1.0, seed=1000 + k) if sampled else dict(temperature=0)
        r = client.chat.completions.create(
            model="m", messages=ask("Describe a person as JSON."), max_tokens=MAX_TOKENS,
            response_format={"type": "json_schema", "json_schema": {"name": f"s{k}", "schema": schema}}, **extra)
        return job, r.choices[0]

    jobs = [(k, schema, sampled) for k, schema in enumerate(schemas) for sampled in (False, True)]
    with ThreadPoolExecutor(len(jobs)) as pool:
        results = list(pool.map(one, jobs))
    for (k, schema, sampled), choice in results:
        assert choice.finish_reason == "stop", (k, sampled, "cut by max_tokens: the schema is not bounded enough",
                                                choice.message.content)
        jsonschema.validate(json.loads(choice.message.content), schema)


@pytest.mark.slow  # fast-tier budget: CI runs it in the slow tier
def test_generated_schemas(client):
    run_schemas(client, SCHEMAS)


# ---- the other output formats ------------------------------------------------------------------


def test_json_object_regex_and_choice(client, real_server):
    r = client.chat.completions.create(model="m", messages=ask("Give me a JSON object."), max_tokens=200,
                                       temperature=0, response_format={"type": "json_object"})
    assert isinstance(json.loads(r.choices[0].message.content), dict)
    r = client.chat.completions.create(model="m", messages=ask("A phone number?"), max_tokens=30, temperature=1,
                                       seed=3, extra_body={"structured_outputs": {"regex": r"\d{3}-\d{4}"}})
    assert __import__("re").fullmatch(r"\d{3}-\d{4}", r.choices[0].message.content)
    for extra in ({"structured_outputs": {"choice": ["yes", "no", "maybe"]}},
                  {"guided_choice": ["yes", "no", "maybe"]}):
        r = client.chat.completions.create(model="m", messages=ask("Is water wet?"), max_tokens=10, temperature=1,
                                           seed=5, extra_body=extra)
        assert r.choices[0].message.content in ("yes", "no", "maybe")
    r = client.chat.completions.create(model="m", messages=ask("Yes or no?"), max_tokens=10, temperature=1, seed=2,
                                       extra_body={"guided_grammar": 'root ::= "yes" | "no"'})  # GBNF
    assert r.choices[0].message.content in ("yes", "no")
    r = client.chat.completions.create(model="m", messages=ask("Yes or no?"), max_tokens=10, temperature=1, seed=2,
                                       extra_body={"structured_outputs": {"grammar": 'start: "yes" | "no"'}})
    assert r.choices[0].message.content in ("yes", "no")
    # The legacy completions endpoint takes them too.
    r = httpx.post(real_server.base_url + "/v1/completions", timeout=60, json={
        "prompt": "The answer is", "max_tokens": 10, "temperature": 0, "guided_regex": "(yes|no)!"}).json()
    assert r["choices"][0]["text"] in ("yes!", "no!")
    r = httpx.post(real_server.base_url + "/v1/completions", timeout=60, json={
        "prompt": "A JSON object:", "max_tokens": 100, "temperature": 0,
        "guided_json": {"type": "object", "properties": {"a": {"type": "integer", "minimum": 0, "maximum": 9}},
                        "required": ["a"], "additionalProperties": False}}).json()
    assert json.loads(r["choices"][0]["text"])["a"] in range(10)


def test_a_reply_cut_by_max_tokens_finishes_with_length(client):
    r = client.chat.completions.create(model="m", messages=ask("JSON please"), max_tokens=3, temperature=0,
                                       response_format={"type": "json_schema", "json_schema": {
                                           "name": "x", "schema": {"type": "object", "properties": {
                                               "a": {"type": "string"}}, "required": ["a"]}}})
    assert r.choices[0].finish_reason == "length"


def test_logprobs_are_reported_after_the_mask(client):
    r = client.chat.completions.create(model="m", messages=ask("Pick."), max_tokens=5, temperature=0, logprobs=True,
                                       top_logprobs=5, extra_body={"guided_choice": ["yes", "no"]})
    first = r.choices[0].logprobs.content[0]
    assert all(alt.token in ("yes", "no", "y", "n", "ye") or alt.logprob < -1e3 for alt in first.top_logprobs)
    assert first.logprob > -1e3


BAD_REQUESTS = [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nonsense"}}}},
     "response_format.json_schema.schema"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "strict": True, "schema": {
        "type": "object", "properties": {"a": {"type": "string", "format": "no-such-format"}}}}}},
     "response_format.json_schema.schema"),
    ({"response_format": {"type": "json_schema"}}, "response_format.json_schema"),
    ({"response_format": {"type": "xml"}}, "response_format.type"),
    ({"structured_outputs": {"regex": "(unclosed"}}, "structured_outputs.regex"),
    ({"structured_outputs": {"grammar": "start: undefined_rule"}}, "structured_outputs.grammar"),
    ({"structured_outputs": {"choice": []}}, "structured_outputs.choice"),
    ({"guided_json": "{not json"}, "guided_json"),
    ({"guided_regex": "[a-", "guided_choice": ["a"]}, "guided_choice"),
    ({"response_format": {"type": "json_object"}, "guided_regex": "a"}, "guided_regex"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}],
      "tool_choice": {"type": "function", "function": {"name": "g"}}}, "tool_choice.function.name"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"tools": [{"type": "function", "function": {"name": "f", "strict": True, "parameters": {
        "type": "object", "properties": {"a": {"type": "string", "format": "no-such-format"}}}}}]},
     "tools[0].function.parameters"),
]


@pytest.mark.parametrize("extra,param", BAD_REQUESTS, ids=[p for _, p in BAD_REQUESTS])
def test_a_grammar_the_backend_rejects_is_a_400_naming_the_field(real_server, extra, param):
    for path, body in (("/v1/chat/completions", {"messages": ask("Hi")}), ("/v1/completions", {"prompt": "Hi"})):
        if path == "/v1/completions" and ("tools" in extra or "tool_choice" in extra):
            continue
        r = httpx.post(real_server.base_url + path, json={**body, "max_tokens": 5, **extra}, timeout=60)
        assert r.status_code == 400, r.text
        error = r.json()["error"]
        assert error["param"] == param and error["type"] == "invalid_request_error", error
        assert error["message"]


@pytest.mark.parametrize("extra", [
    {"structured_outputs": {"grammar": 'start: "a" start'}},  # no way to finish: llguidance's item limit
    {"guided_choice": [f"c{i}" for i in range(2001)]},  # past llguidance's row limit at the first token
])
def test_a_grammar_that_fails_while_generating_is_a_400_and_hurts_nothing(real_server, client, extra):
    # it was a 500 "the engine failed" (and 200 + an error frame streamed); the request's own
    # grammar is the cause, so a 400 that says why, and the next request is served as usual
    r = httpx.post(real_server.base_url + "/v1/chat/completions", timeout=120,
                   json={"messages": ask("Hi"), "max_tokens": 8, **extra})
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["type"] == "invalid_request_error" and "grammar" in error["message"], error
    with httpx.stream("POST", real_server.base_url + "/v1/chat/completions", timeout=120,
                      json={"messages": ask("Hi"), "max_tokens": 8, "stream": True, **extra}) as s:
        frames = [line for line in s.iter_lines() if line.startswith("data: {")]
    # streamed: after the 200, an error frame of the request's own kind (not a server error)
    assert '"invalid_request_error"' in frames[-1] and "its grammar" in frames[-1], frames[-1]
    ok = client.chat.completions.create(model="m", messages=ask("Hi"), max_tokens=4, temperature=0)
    assert ok.choices[0].finish_reason in ("length", "stop")


def test_a_grammar_that_fails_in_an_anthropic_stream_is_an_invalid_request_error_event(real_server):
    body = {"model": "m", "max_tokens": 8, "stream": True, "messages": [{"role": "user", "content": "Hi"}],
            "output_config": {"format": {"type": "json_schema", "schema": {"$ref": "#"}}}}
    with httpx.stream("POST", real_server.base_url + "/v1/messages", json=body, timeout=120,
                      headers={"anthropic-version": "2023-06-01"}) as s:
        lines = list(s.iter_lines())
    at = lines.index("event: error")
    error = json.loads(lines[at + 1].removeprefix("data: "))
    assert error["error"]["type"] == "invalid_request_error" and "admits no output" in error["error"]["message"]


def test_min_tokens_a_grammar_cannot_meet_is_a_400_that_says_so(real_server):
    # the grammar allows only the end, min_tokens holds the end back: every token masked (a 500)
    r = httpx.post(real_server.base_url + "/v1/completions", timeout=60,
                   json={"prompt": "Hello", "max_tokens": 8, "min_tokens": 1, "structured_outputs": {"regex": ""}})
    assert r.status_code == 400, r.text
    assert "min_tokens 1 cannot be met" in r.json()["error"]["message"]


def test_a_json_schema_nested_too_deeply_is_a_400_naming_the_field(real_server):
    deep = "[" * 5000 + "]" * 5000  # json.loads raised RecursionError: a 500
    r = httpx.post(real_server.base_url + "/v1/chat/completions", timeout=60,
                   json={"messages": ask("Hi"), "max_tokens": 4, "guided_json": deep})
    assert r.status_code == 400 and r.json()["error"]["param"] == "guided_json", r.text


# ---- the official clients --------------------------------------------------------------------------


class City(pydantic.BaseModel):
    name: str = pydantic.Field(max_length=20)
    population: int = pydantic.Field(ge=0, le=10**8)
    coastal: bool
    districts: list[Annotated[str, pydantic.Field(max_length=20)]] = pydantic.Field(max_length=2)


@pytest.mark.parametrize("stream", [False, True])
def test_openai_chat_completions_parse(client, stream):
    kwargs = dict(model="m", messages=ask("Describe Paris."), max_tokens=MAX_TOKENS, temperature=0,
                  response_format=City)
    if stream:
        with client.chat.completions.stream(**kwargs) as s:
            completion = s.get_final_completion()
    else:
        completion = client.chat.completions.parse(**kwargs)
    parsed = completion.choices[0].message.parsed
    assert isinstance(parsed, City)
    jsonschema.validate(json.loads(completion.choices[0].message.content), City.model_json_schema())


@pytest.mark.parametrize("stream", [False, True])
def test_openai_responses_parse(client, stream):
    kwargs = dict(model="m", input="Describe Oslo.", max_output_tokens=MAX_TOKENS, temperature=0, text_format=City)
    if stream:
        with client.responses.stream(**kwargs) as s:
            response = s.get_final_response()
    else:
        response = client.responses.parse(**kwargs)
    assert isinstance(response.output_parsed, City)


class GetWeather(pydantic.BaseModel):
    city: str = pydantic.Field(max_length=20)
    days: int = pydantic.Field(ge=1, le=7)


NOTE_TOOL = {"type": "function", "function": {"name": "add_note", "strict": True, "parameters": {
    "type": "object", "properties": {"text": {"type": "string", "maxLength": 30}}, "required": ["text"],
    "additionalProperties": False}}}


@pytest.mark.parametrize("choice", ["required", {"type": "function", "function": {"name": "GetWeather"}}])
@pytest.mark.parametrize("stream", [False, True])
def test_openai_forced_tool_calls(client, choice, stream):
    tools = [openai.pydantic_function_tool(GetWeather), NOTE_TOOL]
    kwargs = dict(model="m", messages=ask("What is the weather in Rome?"), tools=tools, tool_choice=choice,
                  max_tokens=MAX_TOKENS, temperature=1, seed=11, parallel_tool_calls=False)
    if stream:
        with client.beta.chat.completions.stream(**kwargs) as s:
            completion = s.get_final_completion()
    else:
        completion = client.chat.completions.parse(**kwargs)
    choice_out = completion.choices[0]
    assert choice_out.finish_reason == "tool_calls"
    [call] = choice_out.message.tool_calls
    if isinstance(choice, dict):
        assert call.function.name == "GetWeather"
    if call.function.name == "GetWeather":
        assert isinstance(call.function.parsed_arguments, GetWeather)
    else:
        jsonschema.validate(json.loads(call.function.arguments), NOTE_TOOL["function"]["parameters"])


def test_responses_forced_tool_call(client):
    tool = {"type": "function", "name": "get_weather", "strict": True, "parameters": GetWeather.model_json_schema()}
    for choice in ("required", {"type": "function", "name": "get_weather"}):
        r = client.responses.create(model="m", input="Weather in Lima?", tools=[tool], tool_choice=choice,
                                    max_output_tokens=MAX_TOKENS, temperature=0, parallel_tool_calls=False)
        [call] = [item for item in r.output if item.type == "function_call"]
        GetWeather.model_validate_json(call.arguments)


WEATHER_TOOL = {"name": "get_weather", "description": "The weather in a city.",
                "input_schema": GetWeather.model_json_schema()}


@pytest.mark.parametrize("choice", [{"type": "any"}, {"type": "tool", "name": "get_weather"}])
@pytest.mark.parametrize("stream", [False, True])
def test_anthropic_forced_tool_use(claude, choice, stream):
    kwargs = dict(model="m", max_tokens=MAX_TOKENS, messages=ask("Weather in Kyoto?"), tools=[WEATHER_TOOL],
                  tool_choice={**choice, "disable_parallel_tool_use": True}, extra_body={"temperature": 1})
    if stream:
        with claude.messages.stream(**kwargs) as s:
            message = s.get_final_message()
    else:
        message = claude.messages.create(**kwargs)
    assert message.stop_reason == "tool_use"
    [block] = [b for b in message.content if b.type == "tool_use"]
    assert block.name == "get_weather"
    GetWeather.model_validate(block.input)


def test_anthropic_output_config_format(claude, real_server):
    schema = {"type": "object", "properties": {"answer": {"type": "string", "maxLength": 20},
                                               "sure": {"type": "boolean"}},
              "required": ["answer", "sure"], "additionalProperties": False}
    for field in ({"output_config": {"format": {"type": "json_schema", "schema": schema}}},
                  {"output_format": {"type": "json_schema", "schema": schema}}):
        r = httpx.post(real_server.base_url + "/v1/messages", timeout=120, json={
            "model": "m", "max_tokens": 200, "temperature": 0, "messages": ask("Capital of France?"), **field})
        assert r.status_code == 200, r.text
        [text] = [b["text"] for b in r.json()["content"] if b["type"] == "text"]
        jsonschema.validate(json.loads(text), schema)
    r = httpx.post(real_server.base_url + "/v1/messages", timeout=60, json={
        "model": "m", "max_tokens": 20, "messages": ask("Hi"),
        "output_config": {"format": {"type": "json_schema", "schema": {"type": "bogus"}}}})
    assert r.status_code == 400 and r.json()["type"] == "error"
    assert "output_config.format.schema" in r.json()["error"]["message"]


# ---- reasoning first, then the grammar (the replay model) ---------------------------------------------

ANSWER_SCHEMA = {"type": "object", "properties": {"answer": {"type": "string"}, "confidence": {"type": "integer"}},
                 "required": ["answer", "confidence"], "additionalProperties": False}
REASONED = '<think>\nSomething that repeats sound { is an "echo".\n</think>\n\n{"answer": "echo", "confidence": 3}'
THINKING_OFF = '{"answer": "echo", "confidence": 3}'
REASONED_CALL = ('<think>\nA call with days=9, {"broken": json\n</think>\n\n<tool_call>\n'
                 '{"name": "get_weather", "arguments": {"city": "Paris", "days": 9}}\n</tool_call>')


@pytest.fixture(scope="module")
def reasoning_client():
    template = json.loads((Path(__file__).parent / "data" / "replay_agents.json").read_text())["chat_template"]
    engine = replay_engine({"chat_template": template, "replies": [
        {"match": "<think>\n\n</think>", "reply": THINKING_OFF}, {"match": "riddle", "reply": REASONED},
        {"match": "weather", "reply": REASONED_CALL}]})
    try:
        with LiveServer(engine) as live:
            yield openai.OpenAI(base_url=live.base_url + "/v1", api_key="none", max_retries=0)
    finally:
        asyncio.run(engine.shutdown())


def test_reasoning_is_free_and_the_content_follows_the_schema(reasoning_client):
    """The reasoning holds a brace and a quote that the schema would refuse: the grammar starts after
    </think>, so the reply is the scripted one."""
    fmt = {"type": "json_schema", "json_schema": {"name": "a", "schema": ANSWER_SCHEMA, "strict": True}}
    r = reasoning_client.chat.completions.create(model="m", messages=ask("A riddle for you."), response_format=fmt,
                                                 max_tokens=200)
    message = r.choices[0].message
    assert message.model_extra["reasoning"] == REASONED.split("</think>")[0].removeprefix("<think>")
    jsonschema.validate(json.loads(message.content), ANSWER_SCHEMA)
    assert json.loads(message.content) == {"answer": "echo", "confidence": 3}


def test_with_thinking_off_the_grammar_starts_at_the_first_token(reasoning_client):
    fmt = {"type": "json_schema", "json_schema": {"name": "a", "schema": ANSWER_SCHEMA}}
    r = reasoning_client.chat.completions.create(model="m", messages=ask("A riddle for you."), response_format=fmt,
                                                 max_tokens=200, reasoning_effort="none")
    assert json.loads(r.choices[0].message.content) == {"answer": "echo", "confidence": 3}


# ---- planning: the fields -> SamplingParams.grammar (no model) -----------------------------------------


@pytest.fixture(scope="module")
def planner():
    """What plan_request reads of an engine: the default tokenizer with Qwen3's template (tools, <think>)."""
    from types import SimpleNamespace

    from tallow.chat_template import ChatTemplate
    from tallow.models.config import ModelConfig
    from tallow.models.loader import default_model_path
    from tallow.tokenizer import Tokenizer, read_gguf_tokenizer_metadata

    tok = Tokenizer.from_gguf_metadata(read_gguf_tokenizer_metadata(default_model_path()))
    source = (Path(__file__).parent / "data" / "qwen3_chat_template.jinja").read_text()
    template = ChatTemplate(source, bos_token=tok.bos_token, eos_token=tok.eos_token,
                            special_tokens=tok.special_tokens)
    return SimpleNamespace(tokenizer=tok, chat_template=template, max_model_len=4096,
                           model_config=ModelConfig("llama", tok.vocab_size, 64, 128, 2, 4, 2, 16))


def plan(planner, protocol: str, body: dict):
    from tallow.config import ServerConfig
    from tallow.serve.protocols.anthropic import AnthropicMessages
    from tallow.serve.protocols.openai_chat import OpenAIChat
    from tallow.serve.protocols.responses import OpenAIResponses
    from tallow.serve.responses_store import ResponsesStore

    cls = {"chat": OpenAIChat, "anthropic": AnthropicMessages,
           "responses": OpenAIResponses.with_store(ResponsesStore(ttl_s=60, max_bytes=1 << 20))}[protocol]
    return cls.plan_request(json.dumps(body).encode(), planner, ServerConfig())


SCHEMA = {"type": "object", "properties": {"b": {"type": "integer"}, "a": {"type": "string"}}, "required": ["a"]}
CLOSE_THINK = "</think>"


@pytest.mark.parametrize("protocol,body", [
    ("chat", {"messages": ask("x"), "response_format": {"type": "json_schema", "json_schema": {
        "name": "s", "schema": SCHEMA}}}),
    ("chat", {"messages": ask("x"), "structured_outputs": {"json": SCHEMA}}),
    ("chat", {"messages": ask("x"), "guided_json": json.dumps(SCHEMA)}),
    ("responses", {"input": "x", "text": {"format": {"type": "json_schema", "name": "s", "schema": SCHEMA}}}),
    ("anthropic", {"max_tokens": 9, "messages": ask("x"), "output_config": {
        "format": {"type": "json_schema", "schema": SCHEMA}, "effort": "high"}}),
    ("anthropic", {"max_tokens": 9, "messages": ask("x"), "thinking": {"type": "enabled", "budget_tokens": 5},
                   "output_format": {"type": "json_schema", "schema": SCHEMA}}),
])
def test_the_format_applies_after_the_reasoning(planner, protocol, body):
    p = plan(planner, protocol, body)
    grammar = p.params.grammar
    assert grammar.start_after == tuple(planner.tokenizer.encode(CLOSE_THINK))
    # The schema keeps its key order (llguidance writes properties in it).
    assert '{"b":{"type":"integer"},"a":{"type":"string"}}' in grammar.text


@pytest.mark.parametrize("protocol,body", [
    ("chat", {"messages": ask("x"), "reasoning_effort": "none", "response_format": {"type": "json_object"}}),
    ("chat", {"messages": ask("x"), "chat_template_kwargs": {"enable_thinking": False},
              "guided_regex": "[0-9]+"}),
    ("responses", {"input": "x", "reasoning": {"effort": "none"}, "text": {"format": {"type": "json_object"}}}),
    ("anthropic", {"max_tokens": 9, "messages": ask("x"), "output_format": {"type": "json_schema", "schema": SCHEMA}}),
])
def test_with_thinking_off_the_grammar_starts_at_once(planner, protocol, body):
    grammar = plan(planner, protocol, body).params.grammar
    assert grammar is not None and grammar.start_after is None


def test_no_format_no_grammar(planner):
    assert plan(planner, "chat", {"messages": ask("x"), "response_format": {"type": "text"}}).params.grammar is None
    tools = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]
    assert plan(planner, "chat", {"messages": ask("x"), "tools": tools}).params.grammar is None
    strict = [{"type": "function", "function": {"name": "f", "strict": True, "parameters": {"type": "object"}}}]
    grammar = plan(planner, "chat", {"messages": ask("x"), "tools": strict}).params.grammar
    assert grammar.kind == "lark" and "<tool_call>" in grammar.text


@pytest.mark.parametrize("protocol,body", [
    ("chat", {"messages": ask("x"), "tool_choice": "required"}),
    ("chat", {"messages": ask("x"), "tool_choice": {"type": "function", "function": {"name": "f"}}}),
    ("responses", {"input": "x", "tool_choice": "required"}),
    ("responses", {"input": "x", "tool_choice": {"type": "function", "name": "f"}}),
    ("anthropic", {"max_tokens": 9, "messages": ask("x"), "tool_choice": {"type": "any"}}),
    ("anthropic", {"max_tokens": 9, "messages": ask("x"), "tool_choice": {"type": "tool", "name": "f"}}),
])
def test_forced_tool_choice_becomes_the_call_grammar(planner, protocol, body):
    tools = [{"name": "f", "input_schema": SCHEMA}, {"name": "g", "input_schema": {"type": "object"}}] \
        if protocol == "anthropic" else [{"type": "function", "name": "f", "parameters": SCHEMA},
                                         {"type": "function", "name": "g", "parameters": {"type": "object"}}] \
        if protocol == "responses" else [{"type": "function", "function": {"name": "f", "parameters": SCHEMA}},
                                         {"type": "function", "function": {"name": "g"}}]
    grammar = plan(planner, protocol, {**body, "tools": tools}).params.grammar
    # Anthropic's thinking is off unless the request turns it on: the grammar starts at once.
    after = None if protocol == "anthropic" else tuple(planner.tokenizer.encode(CLOSE_THINK))
    assert grammar.kind == "lark" and grammar.start_after == after
    assert '"const": "f"' in grammar.text
    assert ('"const": "g"' in grammar.text) == ("name" not in json.dumps(body["tool_choice"]))


NOTHING = [False, {"not": {}}, {"enum": []}, {"anyOf": [False, {"not": True}]},
           {"type": "object", "properties": {"a": False}, "required": ["a"]}]


@pytest.mark.parametrize("schema", NOTHING, ids=[json.dumps(s) for s in NOTHING])
@pytest.mark.parametrize("strict", [None, False, True])
@pytest.mark.parametrize("protocol,param", [("chat", "response_format.json_schema.schema"),
                                            ("responses", "text.format.schema"),
                                            ("anthropic", "output_config.format.schema")])
def test_a_schema_that_admits_no_value_is_a_400_naming_it(planner, protocol, param, schema, strict):
    """Not a 200 with any JSON (lenient), nor a 400 about a "not" the client never sent (strict)."""
    fmt = {"type": "json_schema", "name": "s", "schema": schema, **({} if strict is None else {"strict": strict})}
    body = {"chat": {"messages": ask("x"), "response_format": {"type": "json_schema", "json_schema": {
                k: v for k, v in fmt.items() if k != "type"}}},
            "responses": {"input": "x", "text": {"format": fmt}},
            "anthropic": {"max_tokens": 9, "messages": ask("x"), "output_config": {"format": {
                "type": "json_schema", "schema": schema}}}}[protocol]
    if protocol == "anthropic" and schema is False:
        pytest.skip("output_config.format.schema is an object on the wire")
    rejection = plan(planner, protocol, body)
    assert isinstance(rejection, Rejection) and rejection.status == 400, rejection
    assert rejection.param == param and "admits no value" in rejection.message and "not" not in rejection.param


@pytest.mark.parametrize("protocol,param", [("chat", "tools[0].function.parameters"),
                                            ("responses", "tools[0].parameters"),
                                            ("anthropic", "tools[0].input_schema")])
@pytest.mark.parametrize("strict", [False, True])
def test_a_tool_schema_that_admits_no_value_is_a_400_naming_it(planner, protocol, param, strict):
    nothing = {"not": {}}
    tools = {"chat": [{"type": "function", "function": {"name": "f", "parameters": nothing, "strict": strict}}],
             "responses": [{"type": "function", "name": "f", "parameters": nothing, "strict": strict}],
             "anthropic": [{"name": "f", "input_schema": nothing}]}[protocol]
    choice = {"anthropic": {"type": "any"}}.get(protocol, "required")
    body = {"input": "x"} if protocol == "responses" else {"max_tokens": 9, "messages": ask("x")}
    rejection = plan(planner, protocol, {**body, "tools": tools, "tool_choice": choice})
    assert isinstance(rejection, Rejection) and rejection.param == param and "admits no value" in rejection.message


def test_schemas_that_admit_values_are_not_refused():
    for schema in (True, {}, {"not": {"type": "string"}}, {"anyOf": [False, {"type": "integer"}]},
                   {"type": "object", "properties": {"a": False}}, {"enum": [1]}):
        assert not structured.admits_nothing(schema), schema
        assert isinstance(structured.json_schema_format(schema, "p"), structured.OutputFormat)


def test_strict_tools_under_auto_and_a_format_with_tools(client):
    """Under tool_choice auto: a strict tool's calls follow its schema once the model opens one; with
    an output format and tools (the OpenAI Agents SDK's shape) the reply is that JSON or calls. The
    free text may run to max_tokens: only the calls and the JSON are checked."""
    weather = openai.pydantic_function_tool(GetWeather)
    assert weather["function"]["strict"] is True
    answer = {"type": "object", "properties": {"text": {"type": "string", "maxLength": 40}}, "required": ["text"],
              "additionalProperties": False}
    with_format = {"response_format": {"type": "json_schema", "json_schema": {"name": "answer", "schema": answer,
                                                                               "strict": True}}}

    def one(job):
        seed, extra = job
        # With the format the reply is bounded (the JSON, or one call): it must end by itself.
        return extra, client.chat.completions.create(
            model="m", messages=ask("Weather in Rome? Use the tool."), tools=[weather],
            max_tokens=120 if extra else 40, parallel_tool_calls=False, temperature=1, seed=seed,
            **extra).choices[0]

    with ThreadPoolExecutor(8) as pool:
        results = list(pool.map(one, [(seed, extra) for seed in range(2) for extra in ({}, with_format)]))
    for extra, choice in results:
        for call in choice.message.tool_calls or []:
            GetWeather.model_validate_json(call.function.arguments)
        if extra:
            assert choice.finish_reason in ("stop", "tool_calls"), choice
            if not choice.message.tool_calls:
                jsonschema.validate(json.loads(choice.message.content), answer)


# ---- each tool-call format, forced (the replay model says the template's markup) ------------------------

FORMAT_TEMPLATE = (
    "{%- if tools %}<|im_start|>system\nTools: {% for t in tools %}{{ t | tojson }}{% endfor %}\n"
    "MARKUP<|im_end|>\n{% endif %}"
    "{%- for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
    "{%- if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
# The markup that makes the template imply each parser, and what the model says with it: a call of
# get_weather whose days (9) break the schema's maximum (7), which the grammar must not let through.
FORMAT_REPLIES = {
    "qwen3_coder": ("<function=NAME>", "<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n"
                                       "<parameter=days>\n9\n</parameter>\n</function>\n</tool_call>"),
    "mistral": ("[TOOL_CALLS]", '[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris", "days": 9}}]'),
    "llama3_json": ("<|python_tag|>", '{"name": "get_weather", "parameters": {"city": "Paris", "days": 9}}'),
    "pythonic": ("[func_name1(", '[get_weather(city="Paris", days=9)]'),
    "hermes": ("<tool_call>", '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "days": 9}}\n'
                              "</tool_call>"),
}


@pytest.mark.parametrize("name", sorted(FORMAT_REPLIES))
def test_forced_calls_in_each_format(name):
    markup, reply = FORMAT_REPLIES[name]
    engine = replay_engine({"chat_template": FORMAT_TEMPLATE.replace("MARKUP", markup),
                            "replies": [{"reply": reply}]})
    # Not strict, but closed (additionalProperties false), so after the digit the call can only close.
    params = openai.pydantic_function_tool(GetWeather)["function"]["parameters"]
    weather = {"type": "function", "function": {"name": "get_weather", "parameters": params}}
    try:
        with LiveServer(engine) as live:
            client = openai.OpenAI(base_url=live.base_url + "/v1", api_key="none", max_retries=0)
            free = client.chat.completions.create(model="m", messages=ask("Weather?"), tools=[weather],
                                                  max_tokens=100, temperature=0).choices[0]
            forced = client.chat.completions.create(model="m", messages=ask("Weather?"), tools=[weather],
                                                    tool_choice="required", parallel_tool_calls=False, max_tokens=100,
                                                    temperature=0).choices[0]
    finally:
        asyncio.run(engine.shutdown())
    # Unconstrained, the parser reads the scripted call as it is: days 9.
    [call] = free.message.tool_calls
    assert json.loads(call.function.arguments) == {"city": "Paris", "days": 9}
    # Forced, the grammar takes the model's markup up to the digit it cannot allow.
    assert forced.finish_reason == "tool_calls", (name, forced.message)
    [call] = forced.message.tool_calls
    args = GetWeather.model_validate_json(call.function.arguments)
    assert args.city == "Paris" and args.days != 9


def test_reasoning_then_a_forced_call(reasoning_client):
    """Qwen3's template (tools, <think>): the reasoning is free, the forced call after it follows the
    schema (the scripted days=9 breaks its maximum of 7: the grammar corrects it)."""
    weather = openai.pydantic_function_tool(GetWeather, name="get_weather")
    r = reasoning_client.chat.completions.create(model="m", messages=ask("The weather in Paris?"), tools=[weather],
                                                 tool_choice="required", parallel_tool_calls=False, max_tokens=200)
    choice = r.choices[0]
    assert choice.message.model_extra["reasoning"] == REASONED_CALL.split("</think>")[0].removeprefix("<think>")
    assert choice.finish_reason == "tool_calls"
    [call] = choice.message.tool_calls
    args = GetWeather.model_validate_json(call.function.arguments)
    assert args.city == "Paris" and args.days != 9
