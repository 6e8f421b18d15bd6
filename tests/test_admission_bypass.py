"""One request can bypass admission: a request heavier than the server's whole capacity (prompts x
n sequences) was admitted whenever nothing else was in flight, and the number of prompts per
request had no cap ({"prompt": [100 strings], "n": 16} ran 1,600 sequences while every other
client got 429). Now such a request answers 400 at once, naming the limit, idle server or not; a
/v1/completions request holds at most --max-prompts prompts; the 429 / Retry-After path for a
request that fits but finds the server full is unchanged."""

import asyncio

import httpx
import pytest

from deadlines import async_wait_until
from serve_utils import FakeEngine, LiveServer
from tallow.cli import main as cli_main
from tallow.config import ServerConfig

RUNNING, QUEUE = 2, 2  # capacity 4 sequences
STREAM = {"messages": [{"role": "user", "content": "go"}], "max_tokens": 400, "ignore_eos": True, "stream": True}


@pytest.fixture(scope="module")
def server():
    engine = FakeEngine(max_num_seqs=RUNNING, interval=0.01)
    with LiveServer(engine, ServerConfig(max_queue=QUEUE, max_prompts=3)) as live:
        yield live


def post(server, path, body):
    return httpx.post(server.base_url + path, json=body, timeout=30)


def assert_idle(server):
    assert server.app.state.admission.in_flight == 0 and not server.engine.submitted


def test_a_request_heavier_than_the_capacity_is_a_400_on_an_idle_server(server):
    server.engine.submitted.clear()
    heavy = post(server, "/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "n": 5,
                                                  "max_tokens": 2})
    assert heavy.status_code == 400, heavy.text
    error = heavy.json()["error"]
    assert error["param"] == "n" and "capacity of 4" in error["message"] and "5 sequences" in error["message"]
    # Prompts x n: 2 prompts with n = 3 weigh 6.
    several = post(server, "/v1/completions", {"prompt": ["a", "b"], "n": 3, "max_tokens": 2})
    assert several.status_code == 400 and "6 sequences" in several.json()["error"]["message"]
    assert_idle(server)  # nothing ran
    # At the capacity it runs.
    fits = post(server, "/v1/completions", {"prompt": ["a", "b"], "n": 2, "max_tokens": 2})
    assert fits.status_code == 200 and len(fits.json()["choices"]) == 4


def test_stats_report_the_limits(server):
    limits = httpx.get(server.base_url + "/stats").json()["limits"]
    assert limits["admission_capacity"] == RUNNING + QUEUE and limits["max_prompts"] == 3


def test_prompts_per_request_are_capped(server):
    server.engine.submitted.clear()
    many = post(server, "/v1/completions", {"prompt": ["a", "b", "c", "d"], "max_tokens": 2})
    assert many.status_code == 400
    error = many.json()["error"]
    assert error["param"] == "prompt" and "at most 3" in error["message"] and "got 4" in error["message"]
    ids = post(server, "/v1/completions", {"prompt": [[72, 105]] * 4, "max_tokens": 2})
    assert ids.status_code == 400 and ids.json()["error"]["param"] == "prompt"
    assert_idle(server)
    # One prompt given as token ids is one prompt, however long.
    assert post(server, "/v1/completions", {"prompt": [72, 105, 33, 32], "max_tokens": 2}).status_code == 200


def test_the_prompt_cap_is_a_serve_option_of_64(capsys):
    assert ServerConfig().max_prompts == 64
    with pytest.raises(SystemExit):
        cli_main(["serve", "--help"])
    assert "--max-prompts" in capsys.readouterr().out


def test_a_full_server_still_answers_429_with_retry_after(server):
    async def go():
        async with httpx.AsyncClient(base_url=server.base_url, timeout=30) as client:
            async with client.stream("POST", "/v1/chat/completions", json={**STREAM, "n": 4}) as full:
                assert full.status_code == 200
                lines = full.aiter_lines()
                await anext(lines)
                refused = await client.post("/v1/chat/completions", json={**STREAM, "stream": False, "max_tokens": 2})
            await async_wait_until(lambda: server.app.state.admission.in_flight == 0)
            again = await client.post("/v1/chat/completions", json={**STREAM, "stream": False, "max_tokens": 2})
            return refused, again

    refused, again = asyncio.run(go())
    assert refused.status_code == 429 and refused.headers["Retry-After"] == "1"
    assert refused.json()["error"]["type"] == "rate_limit_error"
    assert again.status_code == 200
