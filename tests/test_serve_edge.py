"""The serving edge: error bodies in each protocol's shape, the Anthropic stream's pings, and
server settings that must reach their use (the chat template's time limit)."""

import asyncio
import time
from contextlib import aclosing

import httpx
import pytest

from serve_utils import FakeEngine
from tallow.chat_template import ChatTemplate
from tallow.config import ServerConfig
from tallow.serve.app import build_app
from tallow.serve.errors import ANTHROPIC, OPENAI, error_body
from tallow.serve.protocols.anthropic import PING, with_pings

USER = [{"role": "user", "content": "hi"}]
HOSTILE = ("{% for i in range(100000) %}{% for j in range(100000) %}{% for k in range(100000) %}"
           "{% endfor %}{% endfor %}{% endfor %}")


def request(app, method: str, path: str, body=None) -> httpx.Response:
    async def go():
        transport = httpx.ASGITransport(app=app, raise_app_exceptions=False)
        async with httpx.AsyncClient(transport=transport, base_url="http://t") as client:
            return await client.request(method, path, json=body)

    return asyncio.run(go())


def test_error_body_shapes():
    assert error_body(OPENAI, 400, "bad", param="n") == {
        "error": {"message": "bad", "type": "invalid_request_error", "param": "n", "code": None}}
    assert error_body(OPENAI, 400, "long", param="messages", code="context_length_exceeded") == {
        "error": {"message": "long", "type": "invalid_request_error", "param": "messages",
                  "code": "context_length_exceeded"}}
    assert error_body(OPENAI, 503, "busy")["error"]["type"] == "service_unavailable"
    assert error_body(OPENAI, 500, "boom")["error"]["type"] == "server_error"
    assert error_body(OPENAI, 404, "gone", "not_found_error")["error"]["type"] == "not_found_error"
    # Anthropic's shape: no param or code; the type is Anthropic's name for the status.
    assert error_body(ANTHROPIC, 400, "bad", param="n") == {
        "type": "error", "error": {"type": "invalid_request_error", "message": "bad"}}
    for status, kind in [(401, "authentication_error"), (404, "not_found_error"), (413, "request_too_large"),
                         (503, "overloaded_error"), (529, "overloaded_error"), (500, "api_error")]:
        assert error_body(ANTHROPIC, status, "m", "server_error")["error"]["type"] == kind


def test_each_route_answers_in_its_protocols_shape():
    app = build_app(FakeEngine(), ServerConfig())
    chat = request(app, "POST", "/v1/chat/completions", {"messages": USER, "n": 0})
    assert chat.status_code == 400 and set(chat.json()["error"]) == {"message", "type", "param", "code"}
    assert chat.json()["error"]["param"] == "n"
    responses = request(app, "POST", "/v1/responses", {"input": "hi", "previous_response_id": "resp_x"})
    # OpenAI's answer to an unknown id: 400 with a code clients key their resend of the history on
    assert responses.status_code == 400 and responses.json()["error"]["param"] == "previous_response_id"
    assert responses.json()["error"]["code"] == "previous_response_not_found"
    for path, body in [("/v1/messages", {"max_tokens": 0, "messages": USER}),
                       ("/v1/messages/count_tokens", {"messages": 5})]:
        r = request(app, "POST", path, body)
        assert r.status_code == 400, r.text
        assert r.json()["type"] == "error" and set(r.json()["error"]) == {"type", "message"}
        assert r.json()["error"]["type"] == "invalid_request_error"


def test_loading_and_internal_errors_in_each_protocols_shape():
    loading = build_app(None, ServerConfig())
    r = request(loading, "POST", "/v1/messages", {"max_tokens": 1, "messages": USER})
    assert r.status_code == 503 and r.json() == {"type": "error", "error": {
        "type": "overloaded_error", "message": "the model is still loading"}}
    r = request(loading, "POST", "/v1/chat/completions", {"messages": USER})
    assert r.status_code == 503 and r.json()["error"]["type"] == "service_unavailable"

    engine = FakeEngine()

    def broken(*args, **kwargs):
        raise RuntimeError("tokenizer exploded")

    engine.tokenizer.encode = broken
    app = build_app(engine, ServerConfig())
    r = request(app, "POST", "/v1/messages", {"max_tokens": 1, "messages": USER})
    assert r.status_code == 500 and r.json() == {"type": "error", "error": {
        "type": "api_error", "message": "internal server error: RuntimeError"}}
    r = request(app, "POST", "/v1/chat/completions", {"messages": USER})
    assert r.status_code == 500 and r.json() == {"error": {
        "message": "internal server error: RuntimeError", "type": "server_error", "param": None, "code": None}}


def test_the_servers_template_time_limit_applies():
    """ServerConfig.template_timeout_s, not the template's own default (5 s), bounds a render;
    chat_template_kwargs cannot raise it."""
    engine = FakeEngine()
    engine.chat_template = ChatTemplate(HOSTILE, bos_token=None, eos_token=None)
    assert engine.chat_template.timeout_s == 5.0
    app = build_app(engine, ServerConfig(template_timeout_s=0.25))
    for extra in [{}, {"chat_template_kwargs": {"timeout_s": 60}}]:
        start = time.monotonic()
        r = request(app, "POST", "/v1/chat/completions", {"messages": USER, **extra})
        assert r.status_code == 400, r.text
        assert "longer than 0.25 s" in r.json()["error"]["message"]
        assert time.monotonic() - start < 4
    assert engine.submitted == []


def run(coro):
    return asyncio.run(coro)


def test_pings_fill_silence_and_frames_pass_in_order():
    async def go():
        resume = asyncio.Event()

        async def source():
            for i in range(100):
                yield f"frame {i}\n"
            await resume.wait()  # silent until the consumer has seen a ping
            yield "last\n"

        out = []
        async with asyncio.timeout(10), aclosing(with_pings(source(), interval=0.02)) as frames:
            async for frame in frames:
                out.append(frame)
                if frame == PING:
                    resume.set()
        return out

    out = run(go())
    assert [f for f in out if f != PING] == [f"frame {i}\n" for i in range(100)] + ["last\n"]
    assert PING in out[out.index("frame 99\n"):out.index("last\n")]


def test_pings_draw_frames_without_a_task_per_frame():
    async def go():
        loop = asyncio.get_running_loop()
        created = []

        def factory(loop, coro, **kwargs):
            created.append(coro)
            return asyncio.Task(coro, loop=loop, **kwargs)

        async def source():
            for i in range(200):
                yield str(i)

        loop.set_task_factory(factory)
        try:
            frames = [f async for f in with_pings(source(), interval=30)]
        finally:
            loop.set_task_factory(None)
        return frames, len(created)

    frames, tasks = run(go())
    assert frames == [str(i) for i in range(200)]
    assert tasks == 1  # the one drawing task, for the whole stream


def test_leaving_early_closes_the_frames_and_errors_pass_through():
    async def go():
        closed = asyncio.Event()

        async def endless():
            try:
                i = 0
                while True:
                    yield str(i)
                    i += 1
            finally:
                closed.set()

        async with aclosing(with_pings(endless(), interval=30)) as frames:
            got = [await anext(frames) for _ in range(3)]
        async with asyncio.timeout(5):
            await closed.wait()

        async def failing():
            yield "a"
            raise ValueError("broken source")

        seen = []
        with pytest.raises(ValueError, match="broken source"):
            async for frame in with_pings(failing(), interval=30):
                seen.append(frame)
        return got, seen

    got, seen = run(go())
    assert got == ["0", "1", "2"] and seen == ["a"]


def test_an_unhandled_error_is_a_500_and_the_connection_stays_open(monkeypatch, caplog):
    """An exception no handler takes is answered with the protocol's 500 and not raised on to the
    server: uvicorn neither logs "Exception in ASGI application" nor closes the keep-alive
    connection, so a pooled client's next request goes over the same connection."""
    from serve_utils import LiveServer

    engine = FakeEngine()
    with LiveServer(engine) as live:
        def broken(*args, **kwargs):
            raise RuntimeError("tokenizer exploded")

        opened = []
        with httpx.Client(base_url=live.base_url, timeout=10, limits=httpx.Limits(max_connections=1)) as client:
            monkeypatch.setattr(engine.tokenizer, "encode", broken)
            with caplog.at_level("INFO"):
                r = client.post("/v1/chat/completions", json={"messages": USER})
                opened.append(r.extensions["network_stream"])
                assert r.status_code == 500 and r.json() == {"error": {
                    "message": "internal server error: RuntimeError", "type": "server_error", "param": None,
                    "code": None}}
                anthropic = client.post("/v1/messages", json={"max_tokens": 1, "messages": USER})
                opened.append(anthropic.extensions["network_stream"])
                assert anthropic.status_code == 500 and anthropic.json() == {"type": "error", "error": {
                    "type": "api_error", "message": "internal server error: RuntimeError"}}
                monkeypatch.undo()
                ok = client.post("/v1/chat/completions", json={"messages": USER, "max_tokens": 2})
                opened.append(ok.extensions["network_stream"])
        assert ok.status_code == 200, ok.text
        assert opened[0] is opened[1] is opened[2]  # one connection: never closed by the server
        assert not [rec for rec in caplog.records if "Exception in ASGI application" in rec.getMessage()]
        # logged once, with its traceback
        logged = [rec for rec in caplog.records if rec.getMessage().startswith("unhandled error on")]
        assert len(logged) == 2 and all(rec.exc_info for rec in logged)


@pytest.mark.parametrize("method,path,status", [
    ("POST", "/v1/nothing", 404), ("GET", "/nothing", 404), ("GET", "/v1/chat/completions", 405),
    ("DELETE", "/v1/completions", 405), ("POST", "/v1/models", 405), ("GET", "/v1/responses", 405)])
def test_unknown_routes_and_methods_answer_in_openais_shape(method, path, status):
    """OpenAI's answer to a URL it does not serve: {"error": {"message": "Invalid URL (POST
    /v1/nothing)", "type": "invalid_request_error", "param": null, "code": null}}."""
    app = build_app(FakeEngine(), ServerConfig())
    r = request(app, method, path)
    assert r.status_code == status
    error = r.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert (error["type"], error["param"], error["code"]) == ("invalid_request_error", None, None)
    assert f"({method} {path})" in error["message"]
    if status == 404:
        assert error["message"] == f"Invalid URL ({method} {path})"
    else:
        assert r.headers["allow"] and method not in r.headers["allow"]


def test_unknown_routes_and_methods_under_messages_answer_in_anthropics_shape():
    app = build_app(FakeEngine(), ServerConfig())
    for method, path, status, kind in [("POST", "/v1/messages/batches", 404, "not_found_error"),
                                       ("GET", "/v1/messages", 405, "invalid_request_error"),
                                       ("GET", "/v1/messages/count_tokens", 405, "invalid_request_error")]:
        r = request(app, method, path)
        assert r.status_code == status
        body = r.json()
        assert body["type"] == "error" and set(body["error"]) == {"type", "message"}
        assert body["error"]["type"] == kind and path in body["error"]["message"]
        if status == 405:
            assert r.headers["allow"] == "POST"
