"""Speculation through the server: every protocol's usage carries {"proposed", "accepted"},
/metrics has vLLM's spec_decode counters equal to what the usages said, and a request with
`speculative: false` does not speculate (counted by reason in /stats). The replay model
forces a scripted reply that repeats itself, so n-gram drafts are accepted."""

import json
import logging

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from deadlines import wait_until
from serve_utils import LiveServer, replay_engine
import tallow.testing  # noqa: F401  (registers the replay: model source)

REPLY = "The quick brown fox jumps over the lazy dog. " * 4


@pytest.fixture(scope="module")
def server():
    engine = replay_engine([{"reply": REPLY}], speculative_method="ngram", speculative_row_cost=0.0)
    with LiveServer(engine) as live:
        yield live


def spec_counters(server) -> dict:
    text = httpx.get(server.base_url + "/metrics").text
    out = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.name.startswith("vllm:spec_decode"):
                out[(s.name, s.labels.get("position"))] = s.value
    return out


def test_usage_speculation_on_every_protocol_and_the_metrics(server):
    url = server.base_url
    before = spec_counters(server)
    usages = []
    chat = {"messages": [{"role": "user", "content": "hi"}], "temperature": 0, "max_tokens": 60}
    r = httpx.post(url + "/v1/chat/completions", json=chat).json()
    assert r["choices"][0]["message"]["content"] == REPLY.strip() or REPLY.startswith(
        r["choices"][0]["message"]["content"])
    usages.append(r["usage"])
    with httpx.stream("POST", url + "/v1/chat/completions",
                      json={**chat, "stream": True, "stream_options": {"include_usage": True}}) as s:
        chunks = [json.loads(line[6:]) for line in s.iter_lines() if line.startswith("data: {")]
    text = "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks if c["choices"])
    assert text == r["choices"][0]["message"]["content"]
    usages.append(chunks[-1]["usage"])
    r = httpx.post(url + "/v1/completions", json={"prompt": "hi", "temperature": 0, "max_tokens": 60}).json()
    usages.append(r["usage"])
    r = httpx.post(url + "/v1/messages", json={"model": "x", "max_tokens": 60, "temperature": 0,
                                               "messages": [{"role": "user", "content": "hi"}]}).json()
    usages.append(r["usage"])
    r = httpx.post(url + "/v1/responses", json={"input": "hi", "temperature": 0, "max_output_tokens": 60}).json()
    usages.append(r["usage"])
    for usage in usages:
        spec = usage["speculation"]
        assert 0 < spec["accepted"] <= spec["proposed"], usage
    after = spec_counters(server)

    def moved(name, position=None):
        return after.get((name, position), 0) - before.get((name, position), 0)

    assert moved("vllm:spec_decode_num_draft_tokens_total") == sum(u["speculation"]["proposed"] for u in usages)
    assert moved("vllm:spec_decode_num_accepted_tokens_total") == sum(u["speculation"]["accepted"] for u in usages)
    assert moved("vllm:spec_decode_num_drafts_total") > 0
    assert moved("vllm:spec_decode_num_accepted_tokens_per_pos_total", "0") > 0


def test_trace_shows_the_accepted_runs(server, caplog):
    with caplog.at_level(logging.INFO, logger="tallow.trace"):
        r = httpx.post(server.base_url + "/v1/chat/completions", headers={"x-tallow-trace": "1"}, json={
            "messages": [{"role": "user", "content": "hi"}], "temperature": 0, "max_tokens": 60})
        wait_until(lambda: any(rec.name == "tallow.trace" for rec in caplog.records), timeout=10)
    [trace] = [json.loads(rec.getMessage()) for rec in caplog.records if rec.name == "tallow.trace"]
    drafts = trace["sequences"][0]["drafts"]
    spec = r.json()["usage"]["speculation"]
    assert sum(p for _, p, _ in drafts) == spec["proposed"] and sum(a for _, _, a in drafts) == spec["accepted"]


def test_speculative_false_does_not_speculate(server):
    url = server.base_url
    stats = httpx.get(url + "/stats").json()["engine"]["speculative"]
    before = stats["requests_not_speculating"].get("request", 0)
    r = httpx.post(url + "/v1/chat/completions", json={
        "messages": [{"role": "user", "content": "hi"}], "temperature": 0, "max_tokens": 30,
        "speculative": False}).json()
    assert "speculation" not in r["usage"]
    stats = httpx.get(url + "/stats").json()["engine"]["speculative"]
    assert stats["requests_not_speculating"]["request"] == before + 1
    bad = httpx.post(url + "/v1/chat/completions", json={
        "messages": [{"role": "user", "content": "hi"}], "speculative": "no"})
    assert bad.status_code == 400 and "speculative" in bad.text
