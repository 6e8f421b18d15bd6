"""The API key on every /v1 route (in each protocol's error shape), the body cap, media parts,
the request caps, request ids, and the warning for an exposed bind address."""

import re

import httpx
import pytest
from starlette.routing import Route

from serve_utils import FakeEngine, LiveServer
from tallow.config import ServerConfig
from tallow.serve.security import api_key_matches, exposure_warning

KEY = "sk-test-0123456789"
CHAT = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
# One valid body per protocol route; routes not in the app (yet) are skipped.
PROTOCOL_BODIES = {
    "/v1/chat/completions": CHAT,
    "/v1/completions": {"prompt": "Once upon", "max_tokens": 4},
    "/v1/messages": {"model": "m", "max_tokens": 4, "messages": [{"role": "user", "content": "hi"}]},
    "/v1/responses": {"model": "m", "input": "hi", "max_output_tokens": 4},
}


@pytest.fixture(scope="module")
def server():
    config = ServerConfig(api_key=KEY, max_body_bytes=4096, max_messages=3, max_stop_strings=2,
                          max_logit_bias=2, max_n=2)
    with LiveServer(FakeEngine(interval=0.0005), config) as live:
        yield live


def post(server, path: str, body, headers: dict | None = None, **kwargs) -> httpx.Response:
    return httpx.post(server.base_url + path, json=body, headers=headers, timeout=30, **kwargs)


def bearer(key: str = KEY) -> dict:
    return {"Authorization": f"Bearer {key}"}


def served_routes(server) -> list[tuple[str, str]]:
    """(method, path) of every /v1 route the app has, path parameters filled in."""
    routes = []
    for route in server.app.routes:
        if isinstance(route, Route) and route.path.startswith("/v1"):
            path = re.sub(r"\{[^}]*\}", "x", route.path)
            routes += [(method, path) for method in sorted(route.methods - {"HEAD"})]
    return routes


@pytest.mark.parametrize("path", PROTOCOL_BODIES)
def test_protocol_routes_need_the_key(server, path):
    if path not in {path for _, path in served_routes(server)}:
        pytest.skip(f"{path} is not served yet")
    body = PROTOCOL_BODIES[path]
    missing = post(server, path, body)
    wrong = post(server, path, body, bearer("sk-wrong"))
    assert missing.status_code == wrong.status_code == 401
    error = missing.json()
    if path.startswith("/v1/messages"):
        assert error["type"] == "error" and error["error"]["type"] == "authentication_error"
    else:
        assert error["error"]["type"] == "authentication_error" and "API key" in error["error"]["message"]
    assert post(server, path, body, bearer()).status_code == 200
    assert post(server, path, body, {"x-api-key": KEY}).status_code == 200


def test_every_v1_route_refuses_a_request_without_the_key(server):
    routes = served_routes(server)
    assert ("POST", "/v1/chat/completions") in routes and ("GET", "/v1/models") in routes
    for method, path in routes:
        response = httpx.request(method, server.base_url + path, json={}, timeout=30)
        assert response.status_code == 401, (method, path)


def test_health_is_open_and_metrics_need_the_key(server):
    # /metrics was open with --api-key until issue 24 (tests/test_unprotected_routes.py has the rest).
    assert httpx.get(server.base_url + "/health").status_code == 200
    assert httpx.get(server.base_url + "/metrics").status_code == 401
    assert httpx.get(server.base_url + "/metrics", headers=bearer()).status_code == 200


def test_key_matching():
    assert api_key_matches(httpx.Headers({"authorization": f"bearer {KEY}"}), KEY)
    assert api_key_matches(httpx.Headers({"x-api-key": KEY}), KEY)
    assert not api_key_matches(httpx.Headers({"authorization": KEY}), KEY)  # no scheme
    assert not api_key_matches(httpx.Headers({"authorization": f"Bearer {KEY}x"}), KEY)
    assert not api_key_matches(httpx.Headers({"authorization": "Bearer "}), KEY)
    assert not api_key_matches(httpx.Headers({}), KEY)


def test_body_over_the_cap_is_413_with_or_without_content_length(server):
    big = {**CHAT, "messages": [{"role": "user", "content": "x" * 5000}]}
    declared = post(server, "/v1/chat/completions", big, bearer())
    assert declared.status_code == 413 and "4096 bytes" in declared.json()["error"]["message"]

    def chunks():  # a generator body is sent chunked, without Content-Length
        yield b'{"messages": [{"role": "user", "content": "'
        for _ in range(10):
            yield b"y" * 1000
        yield b'"}]}'

    chunked = httpx.post(server.base_url + "/v1/chat/completions", content=chunks(), headers=bearer(), timeout=30)
    assert chunked.status_code == 413
    assert post(server, "/v1/chat/completions", CHAT, bearer()).status_code == 200


def test_media_parts_are_refused_not_fetched(server):
    part = {"type": "image_url", "image_url": {"url": "http://127.0.0.1:9/never-fetched.png"}}
    body = {**CHAT, "messages": [{"role": "user", "content": [{"type": "text", "text": "what is it?"}, part]}]}
    refused = post(server, "/v1/chat/completions", body, bearer())
    assert refused.status_code == 400
    error = refused.json()["error"]
    assert error["param"] == "messages[0].content[1]" and "never fetches URLs" in error["message"]
    # A tool schema that happens to say "image" is not a content part.
    tools = [{"type": "function", "function": {"name": "draw", "parameters": {"type": "object", "properties": {
        "kind": {"type": "string", "enum": ["image", "file"]}}}}}]
    assert post(server, "/v1/chat/completions", {**CHAT, "tools": tools}, bearer()).status_code == 200


@pytest.mark.parametrize("field, value, param", [
    ("messages", [{"role": "user", "content": "hi"}] * 4, "messages"),
    ("stop", ["a", "b", "c"], "stop"),
    ("logit_bias", {"1": 1.0, "2": 1.0, "3": 1.0}, "logit_bias"),
    ("n", 3, "n"),
])
def test_request_caps(server, field, value, param):
    over = post(server, "/v1/chat/completions", {**CHAT, field: value}, bearer())
    assert over.status_code == 400 and over.json()["error"]["param"] == param
    at_cap = value[:-1] if isinstance(value, list) else value - 1 if isinstance(value, int) else \
        dict(list(value.items())[:-1])
    assert post(server, "/v1/chat/completions", {**CHAT, field: at_cap}, bearer()).status_code == 200


def test_request_ids(server):
    first = post(server, "/v1/chat/completions", CHAT, bearer())
    second = post(server, "/v1/chat/completions", CHAT, bearer())
    assert re.fullmatch(r"[0-9a-f]{32}", first.headers["x-request-id"])
    assert first.headers["x-request-id"] != second.headers["x-request-id"]
    given = post(server, "/v1/chat/completions", CHAT, {**bearer(), "x-request-id": "client-42"})
    assert given.headers["x-request-id"] == "client-42"
    hostile = post(server, "/v1/chat/completions", CHAT, {**bearer(), "x-request-id": "a b\tc"})
    assert hostile.headers["x-request-id"] != "a b\tc"
    assert post(server, "/v1/chat/completions", CHAT).headers["x-request-id"]  # on refusals too


def test_exposed_bind_warning():
    assert exposure_warning("0.0.0.0", None) is not None
    assert "192.168.1.5" in exposure_warning("192.168.1.5", None)
    for host in ("127.0.0.1", "::1", "localhost"):
        assert exposure_warning(host, None) is None
    assert exposure_warning("0.0.0.0", KEY) is None
