"""Replies cut off by the shutdown timeout read as finished on Anthropic (`end_turn`) and
Responses (`completed`) (issue 24); OpenAI said "abort". Now every protocol says so:
Chat / Completions finish_reason "abort" (as vLLM), Responses status "failed" with OpenAI's
error code server_error (the output so far kept, marked incomplete), Anthropic (whose stop_reason has no such value)
stop_reason null and an error event in a stream, a 503 error for a body."""

import asyncio
import json

import httpx
import pytest

from openapi_schemas import validate, validate_event
from serve_utils import FakeEngine
from tallow.config import ServerConfig
from tallow.serve.app import build_app

BODIES = {
    "/v1/chat/completions": {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 500, "ignore_eos": True},
    "/v1/completions": {"prompt": "hi", "max_tokens": 500, "ignore_eos": True},
    "/v1/messages": {"model": "m", "max_tokens": 500, "messages": [{"role": "user", "content": "hi"}]},
    "/v1/responses": {"input": "hi", "max_output_tokens": 500},
}


def cut_off(path: str, stream: bool) -> httpx.Response:
    """The response to `path` when the engine shuts down (as at the shutdown timeout) midway."""
    engine = FakeEngine(max_model_len=1024, interval=0.005, reply="word " * 400)
    app = build_app(engine, ServerConfig())

    async def go():
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as client:
            request = asyncio.create_task(client.post(path, json={**BODIES[path], "stream": stream}, timeout=30))
            for _ in range(2000):
                if engine.running or request.done():
                    break
                await asyncio.sleep(0.005)
            await asyncio.sleep(0.05)  # a few tokens out
            await engine.shutdown()
            return await request

    return asyncio.run(go())


def events(response: httpx.Response) -> list[tuple[str | None, dict | str]]:
    out, name = [], None
    for line in response.text.splitlines():
        if line.startswith("event: "):
            name = line[7:]
        elif line.startswith("data: "):
            data = line[6:]
            out.append((name, data if data == "[DONE]" else json.loads(data)))
    return out


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/completions"])
def test_openai_says_abort(path):
    body = cut_off(path, False)
    assert body.status_code == 200 and body.json()["choices"][0]["finish_reason"] == "abort"
    chunks = [data for _, data in events(cut_off(path, True)) if data != "[DONE]"]
    assert [c["choices"][0]["finish_reason"] for c in chunks if c["choices"]][-1] == "abort"


def test_responses_fails_with_server_error():
    failed = {"code": "server_error", "message": "the server shut down before this response finished"}
    body = cut_off("/v1/responses", False)
    assert body.status_code == 200
    assert body.json()["status"] == "failed" and body.json()["error"] == failed
    assert body.json()["incomplete_details"] is None
    assert body.json()["output"][-1]["status"] == "incomplete"
    validate("Response", body.json())  # OpenAI's published schema
    streamed = events(cut_off("/v1/responses", True))
    for _, event in streamed:
        validate_event(event)
    last = streamed[-1][1]
    assert last["type"] == "response.failed"
    assert last["response"]["status"] == "failed" and last["response"]["error"] == failed


def test_anthropic_never_says_end_turn():
    body = cut_off("/v1/messages", False)
    assert body.status_code == 503, body.text
    assert body.json()["type"] == "error" and body.json()["error"]["type"] == "overloaded_error"
    streamed = events(cut_off("/v1/messages", True))
    names = [name for name, _ in streamed]
    assert "message_stop" not in names
    delta = next(data for name, data in streamed if name == "message_delta")
    assert delta["delta"]["stop_reason"] is None
    assert streamed[-1][0] == "error" and streamed[-1][1]["error"]["type"] == "overloaded_error"
    assert any(name == "content_block_delta" for name in names)  # it had started
