"""Faults stay contained: a request whose sink, tokenizer or protocol raises fails alone with a
500 while the 7 others of its batch finish correctly; an engine step that raises fails that
step's requests, and the engine serves the next ones."""

import asyncio
import json
import logging

import httpx
import pytest

from deadlines import wait_until
from serve_utils import LiveServer, engine_idle, replay_engine
from tallow.config import ServerConfig
from tallow.output import pipeline as pipeline_module
from tallow.output.stop import StopMatcher
from tallow.serve.protocols.openai_chat import OpenAIChat
import tallow.testing  # noqa: F401  (registers the replay: model source)

MAX_TOKENS = 24
MARK = "EXPLODE"
# Request i gets its own reply; each forward waits 10 ms, so the batch's requests run together.
BATCH_SCRIPT = {"step_delay_s": 0.01, "replies": [
    *({"match": f"request number {i}", "reply": f"Reply {i} to request {i}: " + "all is well, " * 12}
      for i in range(8)),
    {"reply": "Nothing matched."}]}


class ExplodingStopMatcher(StopMatcher):
    """The stop matcher of a request whose stop strings hold MARK raises midway through."""

    def __init__(self, stops, include_stop_str_in_output=False):
        super().__init__(stops, include_stop_str_in_output)
        self.explodes = MARK in stops
        self.pushes = 0

    def push(self, text: str) -> str:
        self.pushes += 1
        if self.explodes and self.pushes > 3:
            raise RuntimeError("the sink broke")
        return super().push(text)


def break_sink(monkeypatch, engine):
    monkeypatch.setattr(pipeline_module, "StopMatcher", ExplodingStopMatcher)
    return {"stop": [MARK]}


def break_tokenizer(monkeypatch, engine):
    encode = engine.tokenizer.encode

    def exploding(text, *args, **kwargs):
        if MARK in text:
            raise RuntimeError("the tokenizer broke")
        return encode(text, *args, **kwargs)

    monkeypatch.setattr(engine.tokenizer, "encode", exploding)
    return {"messages": [{"role": "user", "content": f"say {MARK}"}]}


def break_protocol(monkeypatch, engine):
    response, add_events = OpenAIChat.response, OpenAIChat.add_events

    def exploding(method):
        def wrapper(self, *args):
            if self.plan.params.max_tokens == MAX_TOKENS - 1:
                raise RuntimeError("the protocol broke")
            return method(self, *args)
        return wrapper

    monkeypatch.setattr(OpenAIChat, "response", exploding(response))
    monkeypatch.setattr(OpenAIChat, "add_events", exploding(add_events))
    return {"max_tokens": MAX_TOKENS - 1}


def chat(i: int, stream: bool, **overrides) -> dict:
    return {"messages": [{"role": "user", "content": f"request number {i}"}], "max_tokens": MAX_TOKENS,
            "temperature": 0, "stream": stream, **overrides}


def expected_text(engine, i: int) -> str:
    """The first MAX_TOKENS tokens of request i's scripted reply."""
    reply = BATCH_SCRIPT["replies"][i]["reply"]
    return engine.tokenizer.decode(engine.tokenizer.encode(reply)[:MAX_TOKENS])


async def run_batch(base_url: str, bodies: list[dict], engine) -> tuple[list, int]:
    """Send all bodies at once; each answer as (status, content or error message), and the
    peak number of sequences the engine ran together."""
    peak = 0

    async def watch():
        nonlocal peak
        while True:
            peak = max(peak, engine.stats()["running"])
            await asyncio.sleep(0.001)

    async def one(client: httpx.AsyncClient, body: dict):
        if not body["stream"]:
            r = await client.post("/v1/chat/completions", json=body)
            data = r.json()
            return r.status_code, data["choices"][0]["message"]["content"] if r.status_code == 200 else data
        text, error = "", None
        async with client.stream("POST", "/v1/chat/completions", json=body) as r:
            if r.status_code != 200:
                return r.status_code, json.loads(await r.aread())
            async for line in r.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                if "error" in chunk:
                    error = chunk
                for choice in chunk.get("choices", []):
                    text += choice["delta"].get("content") or ""
        return r.status_code, error or text

    watcher = asyncio.create_task(watch())
    async with httpx.AsyncClient(base_url=base_url, timeout=60) as client:
        answers = await asyncio.gather(*(one(client, body) for body in bodies))
    watcher.cancel()
    return answers, peak


@pytest.fixture(scope="module")
def server():
    engine = replay_engine(BATCH_SCRIPT, max_num_seqs=8)
    with LiveServer(engine) as live:
        yield live
    asyncio.run(engine.shutdown())


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("breaks", [break_sink, break_tokenizer, break_protocol])
def test_a_failing_request_fails_alone(server, monkeypatch, breaks, stream):
    engine = server.engine
    bad = 5
    failure = breaks(monkeypatch, engine)
    bodies = [chat(i, stream) for i in range(8)]
    bodies[bad] = {**bodies[bad], **failure}
    answers, peak = asyncio.run(run_batch(server.base_url, bodies, engine))

    for i, (status, answer) in enumerate(answers):
        if i != bad:
            assert (status, answer) == (200, expected_text(engine, i)), i
    status, error = answers[bad]
    if stream and breaks is not break_tokenizer:  # the failure comes after the 200 has been sent
        assert status == 200 and error["error"]["type"] == "server_error"
    else:
        assert status == 500 and error["error"]["type"] == "server_error"
    assert "RuntimeError" in error["error"]["message"]
    if breaks is not break_tokenizer:  # the tokenizer fails before the engine sees the request
        # The seven good requests ran together, the failing one beside them; it fails after
        # its first tokens, which on a loaded machine can be before the last request arrives.
        assert peak >= 7
    # The failed request's sequence is aborted at the engine's next command drain, and a
    # stream's slot is released when its response handler returns, which can come a moment
    # after the client has read the last frame.
    wait_until(lambda: engine_idle(engine) and server.app.state.admission.in_flight == 0)


REPLY = "Steady as she goes: the engine keeps serving after a failed step."


@pytest.fixture(scope="module")
def replay_server():
    engine = replay_engine([{"reply": REPLY}], max_num_seqs=4, num_kv_blocks=64)
    with LiveServer(engine, ServerConfig()) as live:
        yield live
    asyncio.run(engine.shutdown())


def test_a_failing_engine_step_fails_its_requests_and_the_engine_stays_up(replay_server, monkeypatch, caplog):
    core = replay_server.engine.core
    run = core.runner.run
    failures = []

    def failing_run(out):
        if any(s.seq.params.max_tokens == 13 for s in out.scheduled):
            failures.append(len(out.scheduled))
            raise RuntimeError("the device fell over")
        return run(out)

    monkeypatch.setattr(core.runner, "run", failing_run)
    url = replay_server.base_url + "/v1/chat/completions"
    with caplog.at_level(logging.ERROR, logger="tallow.engine.core"):
        failed = httpx.post(url, json=chat(0, False, max_tokens=13), timeout=60)
    assert failed.status_code == 500 and "engine failed" in failed.json()["error"]["message"]
    assert failures == [1]
    assert "engine step failed" in caplog.text and "(seq, start, tokens)" in caplog.text

    served = httpx.post(url, json=chat(1, False, max_tokens=12), timeout=60)
    assert served.status_code == 200
    assert served.json()["choices"][0]["message"]["content"] == core.tokenizer.decode(
        core.tokenizer.encode(REPLY)[:12])
    stats = core.stats()
    assert stats["running"] == stats["waiting"] == 0
    assert stats["kv_blocks_free"] == stats["kv_blocks_total"]
