"""A lone UTF-16 surrogate escape in a body got the JSON parser's "end of hex escape" (issue 24):
now a 400 that says what is wrong and names the field, on every protocol."""

import asyncio

import httpx
import pytest

from serve_utils import FakeEngine
from tallow.config import ServerConfig
from tallow.serve.app import build_app

CASES = [
    ("/v1/chat/completions", b'{"messages": [{"role": "user", "content": "hi \\ud800"}]}', "messages[0].content"),
    ("/v1/chat/completions", b'{"messages": [{"role": "user", "content": "\\udc00 hi"}]}', "messages[0].content"),
    ("/v1/chat/completions", b'{"messages": [{"role": "user", "content": "\\ud800\\u0041"}]}', "messages[0].content"),
    ("/v1/completions", b'{"prompt": "x", "stop": ["a", "\\udbff"]}', "stop[1]"),
    ("/v1/messages", b'{"model": "m", "max_tokens": 4, "messages": [{"role": "user", "content": "\\ud83d"}]}',
     "messages[0].content"),
    ("/v1/responses", b'{"input": "\\ud83d"}', "input"),
]


@pytest.mark.parametrize("path,raw,param", CASES)
def test_lone_surrogate_is_a_clear_400(path, raw, param):
    app = build_app(FakeEngine(max_model_len=256), ServerConfig())

    async def go():
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as client:
            return await client.post(path, content=raw, headers={"content-type": "application/json"})

    response = asyncio.run(go())
    assert response.status_code == 400, response.text
    body = response.json()
    message = body["error"]["message"]
    assert "surrogate" in message and "end of hex escape" not in message, message
    assert message.startswith(param + ":")
    if path != "/v1/messages":
        assert body["error"]["param"] == param


def test_a_paired_surrogate_is_text():
    app = build_app(FakeEngine(max_model_len=256), ServerConfig())

    async def go():
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as client:
            return await client.post("/v1/chat/completions", content=b'{"messages": [{"role": "user", '
                                     b'"content": "\\ud83d\\ude00"}], "max_tokens": 2}',
                                     headers={"content-type": "application/json"})

    assert asyncio.run(go()).status_code == 200
