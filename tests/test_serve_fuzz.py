"""Hostile input: generated bodies on every POST /v1 route (100 per route in the fast tier, 600
in the slow one; and ids on the other routes) against the in-process app over the fake engine.
None may be answered with a 5xx, and none may leave a sequence running or an admission slot
taken."""

import asyncio
import json
import math
import re
from urllib.parse import quote

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from starlette.routing import Route

from serve_utils import FakeEngine
from tallow.config import ServerConfig
from tallow.serve.app import build_app

# Generated bodies per POST route: 100 in the fast tier, 600 in the slow one (pytest -m slow).
EXAMPLES_PER_ROUTE = [100, pytest.param(600, marks=pytest.mark.slow)]

# Numbers at the edges of what the engine's int64 and float32 tensors hold, and past them; NaN
# and the infinities reach the wire as JSON's non-standard NaN / Infinity literals.
EDGE_NUMBERS = [2**63, 2**64, -(2**63) - 1, 2**63 - 1, -(2**63), 1e-46, 1e-300, 1e300, math.nan, math.inf,
                -math.inf]
edge_numbers = st.sampled_from(EDGE_NUMBERS)
scalars = (st.none() | st.booleans() | st.integers(-2**70, 2**70) | st.integers(-3, 300)
           | st.floats(allow_nan=True, allow_infinity=True) | st.text(max_size=12) | edge_numbers)
json_values = st.recursive(scalars, lambda inner: st.lists(inner, max_size=4)
                           | st.dictionaries(st.text(max_size=8), inner, max_size=4), max_leaves=10)
small_ints = st.integers(-2, 40)
texts = st.text(max_size=30)
roles = st.sampled_from(["system", "developer", "user", "assistant", "tool", "function", "model", ""])
part_types = st.sampled_from(["text", "image_url", "input_text", "output_text", "image", "tool_use", "tool_result",
                              "thinking", "input_image", "function_call", "refusal"])
parts = st.fixed_dictionaries({"type": part_types}, optional={
    "text": texts, "image_url": json_values, "id": texts, "name": texts, "input": json_values,
    "tool_use_id": texts, "content": texts | json_values, "thinking": texts})
contents = texts | st.lists(parts, max_size=3) | json_values
messages = st.lists(st.fixed_dictionaries({"role": roles}, optional={
    "content": contents, "name": texts, "tool_calls": json_values, "tool_call_id": texts,
    "reasoning_content": texts}), max_size=4) | json_values
tools = st.lists(st.fixed_dictionaries({"type": st.sampled_from(["function", "web_search", "custom"])}, optional={
    "function": st.fixed_dictionaries({"name": texts}, optional={"parameters": json_values}),
    "name": texts, "input_schema": json_values, "parameters": json_values}), max_size=2) | json_values
token_ids = st.lists(st.integers(-5, 300), max_size=6)

# Every field some protocol reads, each with plausible and implausible values.
FIELDS = {
    "model": texts, "messages": messages, "input": texts | messages, "prompt": texts | token_ids
    | st.lists(texts | token_ids, max_size=3) | json_values, "system": texts | st.lists(parts, max_size=2),
    "instructions": texts, "max_tokens": small_ints | json_values, "max_completion_tokens": small_ints,
    "max_output_tokens": small_ints, "temperature": st.floats(-1, 3) | json_values, "top_p": st.floats(-0.5, 1.5),
    "top_k": small_ints, "min_p": st.floats(-1, 2), "n": st.integers(-1, 20) | json_values, "seed": json_values,
    "stop": texts | st.lists(texts, max_size=20) | json_values, "stop_sequences": st.lists(texts, max_size=5),
    "stream": st.booleans() | json_values, "stream_options": json_values,
    "logprobs": st.booleans() | small_ints | json_values, "top_logprobs": small_ints,
    "logit_bias": st.dictionaries(st.text(max_size=4), st.floats(-150, 150), max_size=4) | json_values,
    "presence_penalty": st.floats(-3, 3), "frequency_penalty": st.floats(-3, 3), "repetition_penalty": st.floats(-1, 3),
    "min_tokens": small_ints, "ignore_eos": st.booleans(), "echo": st.booleans(), "suffix": texts,
    "stop_token_ids": token_ids | json_values, "skip_special_tokens": st.booleans(),
    "include_stop_str_in_output": st.booleans(), "tools": tools, "tool_choice": json_values
    | st.sampled_from(["auto", "none", "required", "any"]), "parallel_tool_calls": json_values,
    "chat_template_kwargs": json_values, "reasoning_effort": texts, "thinking": json_values,
    "metadata": json_values, "store": json_values, "previous_response_id": texts, "response_format": json_values,
    "user": json_values,
}

# Mostly valid bodies per protocol, so that generation, streaming and the sink are reached too.
words = st.text(st.characters(codec="utf-8", exclude_categories=["Cs"]), min_size=1, max_size=24)
text_parts = st.lists(st.fixed_dictionaries({"type": st.just("text"), "text": words}), min_size=1, max_size=2)
chat_messages = st.lists(st.fixed_dictionaries({"role": st.sampled_from(["system", "user", "assistant"]),
                                                "content": words | text_parts}), min_size=1, max_size=3)
function_tools = st.lists(st.fixed_dictionaries({"type": st.just("function"), "function": st.fixed_dictionaries(
    {"name": st.from_regex(r"[a-z_]{1,8}", fullmatch=True), "parameters": st.just({"type": "object"})})}),
    max_size=2)
sampling = {
    "temperature": st.floats(0, 2), "top_p": st.floats(0.01, 1), "top_k": st.integers(-1, 50),
    "seed": st.integers(0, 2**31), "stream": st.booleans(), "ignore_eos": st.booleans(),
    "stop": st.lists(words, max_size=3), "min_tokens": st.integers(0, 4),
    "presence_penalty": st.floats(-2, 2), "frequency_penalty": st.floats(-2, 2),
    "logit_bias": st.dictionaries(st.integers(0, 257).map(str), st.floats(-100, 100), max_size=3),
    "stop_token_ids": st.lists(st.integers(0, 257), max_size=2), "n": st.integers(1, 4),
    "stream_options": st.fixed_dictionaries({}, optional={"include_usage": st.booleans(),
                                                          "continuous_usage_stats": st.booleans()}),
    "include_stop_str_in_output": st.booleans(), "skip_special_tokens": st.booleans(),
}
anthropic_messages = st.lists(st.fixed_dictionaries({"role": st.sampled_from(["user", "assistant"]),
                                                     "content": words | text_parts}), min_size=1, max_size=3)
anthropic = ({"messages": anthropic_messages}, {
    "model": words, "system": words | text_parts, "stop_sequences": st.lists(words, max_size=3),
    "temperature": st.floats(0, 1), "top_p": st.floats(0.01, 1), "top_k": st.integers(0, 50),
    "stream": st.booleans(), "metadata": st.just({"user_id": "u"}),
    "tool_choice": st.sampled_from([{"type": "auto"}, {"type": "none"}]),
    "thinking": st.sampled_from([{"type": "enabled", "budget_tokens": 1024}, {"type": "disabled"}])})
VALID_BODIES = {
    "/v1/chat/completions": ({"messages": chat_messages}, {
        **sampling, "max_tokens": st.integers(1, 40), "logprobs": st.booleans(), "top_logprobs": st.integers(0, 5),
        "tools": function_tools, "tool_choice": st.sampled_from(["auto", "none"])}),
    "/v1/completions": ({"prompt": words | st.lists(st.integers(0, 257), min_size=1, max_size=8)
                         | st.lists(words, min_size=1, max_size=2)}, {
        **sampling, "max_tokens": st.integers(1, 40), "echo": st.booleans(), "logprobs": st.integers(0, 5)}),
    "/v1/messages": ({**anthropic[0], "max_tokens": st.integers(1, 40)}, anthropic[1]),
    "/v1/messages/count_tokens": anthropic,
    "/v1/responses": ({"input": words | chat_messages}, {
        "instructions": words, "max_output_tokens": st.integers(16, 40), "temperature": st.floats(0, 2),
        "top_p": st.floats(0.01, 1), "stream": st.booleans(), "store": st.booleans(), "tools": st.just([]),
        "tool_choice": st.sampled_from(["auto", "none"])}),
}


def bodies_for(path: str) -> st.SearchStrategy[bytes]:
    """A third valid bodies, a third valid bodies with one field replaced by any JSON value,
    a third anything (field soup, any JSON, any bytes)."""
    required, optional = VALID_BODIES.get(path, ({}, {}))
    valid = st.fixed_dictionaries(required, optional=optional)
    names = sorted(set(required) | set(optional) | set(FIELDS))
    mutated = st.tuples(valid, st.sampled_from(names), json_values | edge_numbers).map(
        lambda t: {**t[0], t[1]: t[2]})
    anything = st.fixed_dictionaries({}, optional=FIELDS) | json_values
    return (valid | mutated | anything).map(lambda body: json.dumps(body).encode()) | st.binary(max_size=64)


@pytest.fixture(scope="module")
def app_client():
    loop = asyncio.new_event_loop()
    engine = FakeEngine(max_model_len=96, max_num_seqs=8, interval=0)
    app = build_app(engine, ServerConfig(max_n=4))
    client = httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://fuzz")
    yield loop, client, app, engine
    loop.run_until_complete(client.aclose())
    loop.close()


def routes(methods: set[str]) -> list[tuple[str, str]]:
    app = build_app(FakeEngine(), ServerConfig())
    return sorted((method, route.path) for route in app.routes if isinstance(route, Route)
                  and route.path.startswith("/v1") for method in route.methods & methods)


def check(app_client, method: str, path: str, body: bytes | None) -> None:
    loop, client, app, engine = app_client
    response = loop.run_until_complete(client.request(
        method, path, content=body, headers={"content-type": "application/json"}))
    assert response.status_code < 500, (body, response.status_code, response.text[:500])
    assert not engine.running and not engine.waiting, body
    assert app.state.admission.in_flight == 0, body


@pytest.mark.parametrize("examples", EXAMPLES_PER_ROUTE)
@pytest.mark.parametrize("path", [path for _, path in routes({"POST"})])
def test_generated_bodies_never_break_a_post_route(app_client, path, examples):
    @settings(max_examples=examples, deadline=None, derandomize=True, database=None,
              suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
    @given(body=bodies_for(path))
    def fuzz(body: bytes) -> None:
        check(app_client, "POST", path, body)

    fuzz()


@pytest.mark.parametrize("method, path", routes({"GET", "DELETE"}))
def test_generated_ids_never_break_a_route(app_client, method, path):
    @settings(max_examples=100, deadline=None, derandomize=True, database=None)
    @given(value=st.text(st.characters(exclude_categories=["Cs"]), min_size=1, max_size=20))
    def fuzz(value: str) -> None:
        check(app_client, method, re.sub(r"\{[^}]*\}", quote(value, safe=""), path), None)

    if "{" not in path:
        check(app_client, method, path, None)
        return
    fuzz()


def test_json_numbers_that_are_not_finite_are_refused(app_client):
    loop, client, _, _ = app_client
    for value in (math.nan, math.inf, -math.inf):
        body = json.dumps({"messages": [{"role": "user", "content": "hi"}], "temperature": value}).encode()
        response = loop.run_until_complete(client.post("/v1/chat/completions", content=body))
        assert response.status_code == 400


# Every numeric field some route reads (a path into the body), with the smallest valid body per route.
NUMERIC_FIELDS = [("max_tokens",), ("max_completion_tokens",), ("max_output_tokens",), ("temperature",),
                  ("top_p",), ("top_k",), ("min_p",), ("n",), ("seed",), ("presence_penalty",),
                  ("frequency_penalty",), ("repetition_penalty",), ("min_tokens",), ("logprobs",),
                  ("top_logprobs",), ("logit_bias", "5"), ("stop_token_ids", 0), ("prompt", 0),
                  ("thinking", "budget_tokens")]
MINIMAL_BODIES = {
    "/v1/chat/completions": {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, "logprobs": True},
    "/v1/completions": {"prompt": [5, 6], "max_tokens": 4, "logprobs": 1},
    "/v1/messages": {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4},
    "/v1/messages/count_tokens": {"messages": [{"role": "user", "content": "hi"}]},
    "/v1/responses": {"input": "hi", "max_output_tokens": 16},
}


def _with_value(body: dict, path: tuple, value) -> dict:
    body = json.loads(json.dumps(body))
    if path == ("logit_bias", "5"):
        body["logit_bias"] = {"5": value}
    elif path == ("thinking", "budget_tokens"):
        body["thinking"] = {"type": "enabled", "budget_tokens": value}
    elif path in (("stop_token_ids", 0), ("prompt", 0)):
        body[path[0]] = [value]
    else:
        body[path[0]] = value
    return body


@pytest.mark.parametrize("path", sorted(MINIMAL_BODIES))
def test_numeric_edge_values_on_every_field(app_client, path):
    """Each edge number in each numeric field: never a 5xx; and a request the plan accepts runs
    through the real sampler in a batch with three ordinary rows without raising, those rows
    drawing the tokens they draw without it."""
    import torch

    from tallow.engine.request import Sequence
    from tallow.engine.sampler import Sampler
    from tallow.engine.sampling import SamplingParams

    _, _, _, engine = app_client
    vocab = engine.model_config.vocab_size
    logits = torch.randn(4, vocab, generator=torch.Generator().manual_seed(0))
    ordinary = [SamplingParams(temperature=0), SamplingParams(temperature=0.7, seed=1, top_p=0.9),
                SamplingParams(temperature=1.0, seed=2, top_k=5, logprobs=2)]

    def sample(params: list[SamplingParams]):
        seqs = [Sequence([5, 6, 7], p, eos_token_ids={0}) for p in params]
        out = Sampler(vocab, torch.device("cpu"))(logits[: len(seqs)], seqs)
        return out.token_ids.tolist(), out.invalid.tolist()

    alone, _ = sample(ordinary)
    for field in NUMERIC_FIELDS:
        for value in EDGE_NUMBERS:
            body = json.dumps(_with_value(MINIMAL_BODIES[path], field, value)).encode()
            engine.submitted.clear()
            check(app_client, "POST", path, body)
            for _, params in engine.submitted:
                tokens, invalid = sample(ordinary + [params])
                assert tokens[:3] == alone and not any(invalid), (body, params)
