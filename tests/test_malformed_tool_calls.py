"""A malformed tool_calls history in an assistant message (issue 24): `{"function": null}` and
its kin answered 500 (an AttributeError in the template step) and the keep-alive connection was
dropped. Each is now a 400 naming the field, and the same connection serves the next request."""

import httpx
import pytest

from serve_utils import FakeEngine, LiveServer

CALL = {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'}}

MALFORMED = [
    ({"function": None}, "messages[1].tool_calls[0].function"),
    ({"id": "c", "type": "function"}, "messages[1].tool_calls[0].function"),
    ({"function": {"arguments": "{}"}}, "messages[1].tool_calls[0].function.name"),
    ({"function": {"name": None}}, "messages[1].tool_calls[0].function.name"),
    ({"function": {"name": "f", "arguments": 5}}, "messages[1].tool_calls[0].function.arguments"),
    ({"type": "web_search", "function": {"name": "f"}}, "messages[1].tool_calls[0].type"),
    (None, "messages[1].tool_calls[0]"),
    ("call", "messages[1].tool_calls[0]"),
]


def history(call) -> dict:
    return {"messages": [{"role": "user", "content": "weather?"},
                         {"role": "assistant", "content": None, "tool_calls": [call]},
                         {"role": "tool", "tool_call_id": "call_1", "content": "12 C"}],
            "max_tokens": 4}


@pytest.fixture(scope="module")
def server():
    with LiveServer(FakeEngine(interval=0.0005)) as live:
        yield live


@pytest.mark.parametrize("call,param", MALFORMED)
def test_malformed_tool_call_is_400_and_the_connection_lives(server, call, param):
    with httpx.Client(base_url=server.base_url, timeout=30) as client:
        bad = client.post("/v1/chat/completions", json=history(call))
        assert bad.status_code == 400, bad.text
        error = bad.json()["error"]
        assert error["param"] == param and error["type"] == "invalid_request_error"
        # The same keep-alive connection answers the next request.
        good = client.post("/v1/chat/completions", json=history(CALL))
        assert good.status_code == 200, good.text
        assert good.json()["choices"][0]["message"]["content"]


def test_well_formed_history_reaches_the_template(server):
    with_object_arguments = {**CALL, "function": {"name": "get_weather", "arguments": {"city": "Oslo"}}}
    for call in (CALL, with_object_arguments, {"function": {"name": "get_weather"}}):
        response = httpx.post(server.base_url + "/v1/chat/completions", json=history(call), timeout=30)
        assert response.status_code == 200, response.text
