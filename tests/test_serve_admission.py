"""Admission (429 past capacity), models and stats routes, over a slow fake engine."""

import asyncio

import httpx
import pytest

from deadlines import async_wait_until
from serve_utils import FakeEngine, LiveServer
from tallow.config import ServerConfig
from tallow.serve.admission import AdmissionQueue

STREAM = {"messages": [{"role": "user", "content": "go"}], "max_tokens": 400, "ignore_eos": True,
          "temperature": 0, "stream": True}


@pytest.fixture(scope="module")
def server():
    engine = FakeEngine(max_num_seqs=1, interval=0.01)
    with LiveServer(engine, ServerConfig(max_queue=1, served_model_name="tallow-test")) as live:
        yield live


def test_requests_past_running_plus_queue_get_429(server):
    async def go():
        async with httpx.AsyncClient(base_url=server.base_url, timeout=30) as client:
            async with client.stream("POST", "/v1/chat/completions", json=STREAM) as running, \
                    client.stream("POST", "/v1/chat/completions", json=STREAM) as queued:
                assert (running.status_code, queued.status_code) == (200, 200)
                lines = running.aiter_lines()  # held: a dropped line iterator closes the response
                await anext(lines)
                full = await client.post("/v1/chat/completions", json=STREAM)
                stats = (await client.get("/stats")).json()
            # Both streams were dropped above: the capacity comes back.
            await async_wait_until(lambda: server.engine.stats()["running"] == 0
                                   and server.app.state.admission.in_flight == 0)
            again = await client.post("/v1/chat/completions", json={**STREAM, "stream": False, "max_tokens": 2})
            return full, stats, again

    full, stats, again = asyncio.run(go())
    assert full.status_code == 429
    assert full.headers["Retry-After"] == "1"
    assert full.json()["error"]["type"] == "rate_limit_error"
    assert stats["engine"]["running"] == 1 and stats["engine"]["waiting"] == 1
    assert stats["requests"]["queue_full"] == 1 and stats["requests"]["in_flight"] == 2
    assert again.status_code == 200


def test_a_request_with_n_choices_weighs_n():
    queue = AdmissionQueue(max_running=2, max_queue=1)
    first = queue.try_admit(2)
    assert first is not None and queue.try_admit(2) is None
    second = queue.try_admit(1)
    assert second is not None and queue.in_flight == 3
    first.release()
    first.release()
    assert queue.in_flight == 1 and queue.num_rejected == 1


def test_models_routes(server):
    models = httpx.get(server.base_url + "/v1/models").json()
    assert [m["id"] for m in models["data"]] == ["tallow-test"]
    assert httpx.get(server.base_url + "/v1/models/tallow-test").json()["max_model_len"] == 1024
    missing = httpx.get(server.base_url + "/v1/models/other")
    assert missing.status_code == 404 and missing.json()["error"]["param"] == "model"
    assert httpx.get(server.base_url + "/health").status_code == 200
