"""Observability: /metrics moves as requests run and equals what the clients saw; request traces
(x-tallow-trace) and access lines report each request's phases, tokens and ids."""

import asyncio
import json
import logging

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from deadlines import wait_until
from serve_utils import FakeEngine, LiveServer, replay_engine
from tallow.config import ServerConfig
from tallow.serve.app import build_app
import tallow.testing  # noqa: F401  (registers the replay: model source)

REPLY = "The quick brown fox jumps over the lazy dog. " * 4


def scrape(server) -> dict:
    """Every sample as {(name, ((label, value), ...)): value}, model_name left out."""
    text = httpx.get(server.base_url + "/metrics").text
    samples = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            labels = tuple(sorted((k, v) for k, v in s.labels.items() if k not in ("model_name", "le")))
            if "le" not in s.labels:
                samples[(s.name, labels)] = s.value
    return samples


def delta(before: dict, after: dict, name: str, **labels) -> float:
    key = (name, tuple(sorted(labels.items())))
    return after.get(key, 0.0) - before.get(key, 0.0)


@pytest.fixture(scope="module")
def server():
    engine = FakeEngine(reply=REPLY, interval=0.002)
    with LiveServer(engine, ServerConfig(served_model_name="metered")) as live:
        yield live


def test_metrics_equal_what_the_clients_counted(server):
    url = server.base_url
    before = scrape(server)
    chat = {"messages": [{"role": "user", "content": "hi"}], "temperature": 0}
    usages, reasons = [], []
    # Not streamed: length, and a stop string.
    for body in ({**chat, "max_tokens": 6}, {**chat, "max_tokens": 40, "stop": ["fox"]}):
        r = httpx.post(url + "/v1/chat/completions", json=body).json()
        usages.append(r["usage"])
        reasons += [c["finish_reason"] for c in r["choices"]]
    # Streamed with n=2 and usage.
    body = {**chat, "max_tokens": 5, "n": 2, "stream": True, "stream_options": {"include_usage": True}}
    with httpx.stream("POST", url + "/v1/chat/completions", json=body) as r:
        for line in r.iter_lines():
            if line.startswith("data: {"):
                chunk = json.loads(line[6:])
                reasons += [c["finish_reason"] for c in chunk["choices"] if c["finish_reason"]]
                if chunk.get("usage"):
                    usages.append(chunk["usage"])
    # Completions: two prompts, up to eos.
    r = httpx.post(url + "/v1/completions", json={"prompt": ["a", "b"], "max_tokens": 500}).json()
    usages.append(r["usage"])
    reasons += [c["finish_reason"] for c in r["choices"]]
    # Refused: an invalid body, and no body at all.
    assert httpx.post(url + "/v1/chat/completions", json={**chat, "temperature": "hot"}).status_code == 400
    assert httpx.post(url + "/v1/completions", content=b"{").status_code == 400
    after = scrape(server)

    num_sequences = len(reasons)
    assert sorted(set(reasons)) == ["length", "stop"]
    generated = sum(u["completion_tokens"] for u in usages)
    assert delta(before, after, "vllm:prompt_tokens_total") == sum(u["prompt_tokens"] for u in usages)
    assert delta(before, after, "vllm:generation_tokens_total") == generated
    for reason in set(reasons):
        assert delta(before, after, "vllm:request_success_total", finished_reason=reason) == reasons.count(reason)
    assert delta(before, after, "vllm:time_to_first_token_seconds_count") == num_sequences
    assert delta(before, after, "vllm:e2e_request_latency_seconds_count") == num_sequences
    assert delta(before, after, "vllm:inter_token_latency_seconds_count") == generated - num_sequences
    assert delta(before, after, "tallow:requests_rejected_total", reason="invalid") == 2
    assert after[("vllm:num_requests_running", ())] == 0


def test_gauges_and_aborts_follow_a_live_stream(server):
    before = scrape(server)
    body = {"messages": [{"role": "user", "content": "go"}], "max_tokens": 2000, "ignore_eos": True,
            "stream": True}
    with httpx.stream("POST", server.base_url + "/v1/chat/completions", json=body) as r:
        lines = r.iter_lines()
        next(lines)
        during = scrape(server)
    wait_until(lambda: delta(before, scrape(server), "tallow:requests_aborted_total") == 1)
    assert during[("vllm:num_requests_running", ())] == 1
    assert delta(before, during, "vllm:time_to_first_token_seconds_count") == 1
    assert scrape(server)[("vllm:num_requests_running", ())] == 0


def test_each_app_has_its_own_registry():
    apps = [build_app(FakeEngine(), ServerConfig(served_model_name=f"m{i}")) for i in range(2)]
    texts = [app.state.metrics.render()[0].decode() for app in apps]
    assert 'model_name="m0"' in texts[0] and 'model_name="m1"' in texts[1]
    assert "m1" not in texts[0]


# ---- the real engine (replay model): engine-side times, prefix cache, traces -------------------
REPLAY_REPLY = "Tracing shows where the time goes, one phase at a time."


@pytest.fixture(scope="module")
def replay_server():
    engine = replay_engine([{"reply": REPLAY_REPLY}], max_num_seqs=4, num_kv_blocks=64,
                           long_prefill_token_threshold=16)
    with LiveServer(engine) as live:
        yield live
    asyncio.run(engine.shutdown())


def test_engine_metrics_on_the_real_engine(replay_server):
    before = scrape(replay_server)
    body = {"messages": [{"role": "user", "content": "Tell me about tracing in servers, please."}],
            "max_tokens": 8}
    for _ in range(2):  # the second request finds the prompt in the prefix cache
        assert httpx.post(replay_server.base_url + "/v1/chat/completions", json=body).status_code == 200
    after = scrape(replay_server)
    assert delta(before, after, "vllm:request_queue_time_seconds_count") == 2
    assert delta(before, after, "vllm:prefix_cache_queries_total") > 0
    assert 0 < delta(before, after, "vllm:prefix_cache_hits_total") <= delta(
        before, after, "vllm:prefix_cache_queries_total")
    assert after[("vllm:kv_cache_usage_perc", ())] < 1.0
    assert ("vllm:num_preemptions_total", ()) in after


def test_trace_and_access_lines(replay_server, caplog):
    url = replay_server.base_url + "/v1/chat/completions"
    body = {"messages": [{"role": "user", "content": "A prompt long enough to take several prefill chunks."}],
            "max_tokens": 12}
    with caplog.at_level(logging.INFO, logger="tallow"):
        traced = httpx.post(url, json=body, headers={"x-tallow-trace": "1"})
        untraced = httpx.post(url, json=body)
    traces = [json.loads(r.getMessage()) for r in caplog.records if r.name == "tallow.trace"]
    access = [r.getMessage() for r in caplog.records if r.name == "tallow.access"]
    assert len(traces) == 1 and len(access) == 2

    trace, usage = traces[0], traced.json()["usage"]
    assert trace["request_id"] == traced.headers["x-request-id"] and trace["status"] == 200
    phases = trace["phases_ms"]
    assert list(phases) == ["parse", "template", "tokenize", "plan"]
    assert 0 <= phases["parse"] <= phases["template"] <= phases["tokenize"] <= phases["plan"]
    [seq] = trace["sequences"]
    chunks = seq["prefill_chunks"]
    assert len(chunks) >= 2 and all(n <= 16 for _, _, n in chunks)  # long_prefill_token_threshold
    assert chunks[0][1] + sum(n for _, _, n in chunks) == usage["prompt_tokens"]
    assert [start for _, start, _ in chunks] == sorted(start for _, start, _ in chunks)
    assert phases["plan"] <= seq["submitted"] <= seq["scheduled"] <= chunks[0][0]
    assert chunks[-1][0] <= seq["first_token"] <= seq["finish"] <= trace["total_ms"]
    assert seq["tokens"] == usage["completion_tokens"] == 12 and seq["engine_finish"] == "length"
    assert seq["queue_wait"] == pytest.approx(seq["scheduled"] - seq["submitted"], abs=0.01)
    assert trace["finish_reasons"] == ["length"]

    for response, line in zip((traced, untraced), access):
        u = response.json()["usage"]
        assert line.startswith(f"{response.headers['x-request-id']} POST /v1/chat/completions 200 ")
        assert f"prompt_tokens={u['prompt_tokens']} completion_tokens={u['completion_tokens']}" in line
        assert "finish=length" in line and "ttft_ms=-" not in line
