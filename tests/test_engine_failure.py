"""The engine thread failing outside a step's model run: every request in flight ends at once
with finish_reason "error", the engine turns `failed` and refuses new requests, and `tallow
serve` answers /health 503 and exits with status 1 after its grace period. A failure that
belongs to one request (its add command) fails that request only."""

from __future__ import annotations

import asyncio
import json
import time

import httpx
import pytest

import tallow.testing  # noqa: F401  (registers the replay: model source)
from tallow.config import EngineConfig
from tallow.engine.async_engine import AsyncEngine
from tallow.engine.sampling import SamplingParams
from tallow.errors import TallowError
from serve_process import StreamReader, spawn_server, stop

REPLY = "One, two, three, four, five, six, seven, eight, nine, ten."
DEADLINE_S = 30


@pytest.fixture
def script(tmp_path):
    path = tmp_path / "reply.json"
    # Paced, so that requests of many tokens are still running when the fault comes.
    path.write_text(json.dumps({"step_delay_s": 0.005, "replies": [{"reply": REPLY}]}))
    return path


@pytest.fixture
def engine(script):
    engine = AsyncEngine.from_config(EngineConfig(model=f"replay:{script}", quantization="none", max_num_seqs=4,
                                                  kv_cache_memory_bytes=16 * 1024**2))
    yield engine
    asyncio.run(engine.shutdown())


def prompt(engine: AsyncEngine, text: str) -> list[int]:
    return engine.tokenizer.encode(text)


async def first_output(stream):
    return await asyncio.wait_for(stream.__anext__(), DEADLINE_S)


async def rest(stream) -> list:
    async def collect():
        return [out async for out in stream]

    return await asyncio.wait_for(collect(), DEADLINE_S)


def test_a_scheduler_fault_fails_every_request_and_the_engine(engine):
    async def main():
        long = SamplingParams(max_tokens=4000, ignore_eos=True)
        streams = [engine.generate(prompt(engine, f"count {i}"), long) for i in range(3)]
        for st in streams:  # all three are running
            assert (await first_output(st)).token_ids

        def raise_fault():
            raise RuntimeError("injected fault")

        engine.core.scheduler.schedule = raise_fault  # an instance attribute: this engine only
        t0 = time.monotonic()
        ends = await asyncio.gather(*(rest(st) for st in streams))
        elapsed = time.monotonic() - t0
        failure = await asyncio.wait_for(engine.wait_failed(), DEADLINE_S)
        with pytest.raises(TallowError) as refused:
            engine.generate(prompt(engine, "count again"), SamplingParams(max_tokens=4))
        return ends, elapsed, failure, refused.value

    ends, elapsed, failure, refused = asyncio.run(main())
    assert [outs[-1].finish_reason for outs in ends] == ["error"] * 3
    assert all(sum(len(o.token_ids) for o in outs) < 3999 for outs in ends)  # ended early, not by length
    assert elapsed < 10
    assert engine.failed and failure == engine.failure == "RuntimeError: injected fault"
    assert refused.status == 503 and "the engine has failed (RuntimeError: injected fault)" in refused.message
    engine._thread.join(DEADLINE_S)
    assert not engine._thread.is_alive()  # the engine thread stopped stepping


def test_a_fault_confined_to_one_request_fails_only_that_one(engine):
    core = engine.core
    add = core.add

    def add_or_fail(seq):
        if seq.request_id == "poisoned":
            raise RuntimeError("injected fault in one request")
        add(seq)

    core.add = add_or_fail

    async def main():
        params = SamplingParams(max_tokens=64)
        good = [engine.generate(prompt(engine, f"count {i}"), params) for i in range(2)]
        bad = engine.generate(prompt(engine, "count 2"), params, request_id="poisoned")
        outs = await asyncio.gather(*(rest(st) for st in [*good, bad]))
        after = await rest(engine.generate(prompt(engine, "count 3"), params))
        return outs, after

    outs, after = asyncio.run(main())
    text = [engine.tokenizer.decode([t for o in run for t in o.token_ids]) for run in outs]
    assert [run[-1].finish_reason for run in outs] == ["stop", "stop", "error"]
    assert text == [REPLY, REPLY, ""]
    assert engine.tokenizer.decode([t for o in after for t in o.token_ids]) == REPLY
    assert not engine.failed and engine.failure is None


# ---- `tallow serve` in a subprocess ------------------------------------------------------


GRACE_S = 4.0


@pytest.mark.slow  # fast-tier budget: CI runs it in the slow tier
def test_serve_answers_503_then_exits_non_zero_when_the_engine_fails(script, tmp_path):
    fault = tmp_path / "fault"
    log = open(tmp_path / "serve.log", "w+")
    proc, url = spawn_server(["--model", f"replay:{script}", "--shutdown-timeout", str(GRACE_S),
                              "--max-num-seqs", "4", "--kv-cache-memory", "0.05"], log,
                             cli_args=("--fail-scheduler-when", str(fault)))
    try:
        readers = [StreamReader(url, max_tokens=4000) for _ in range(3)]
        for reader in readers:
            reader.start()
        for reader in readers:
            assert reader.started.wait(DEADLINE_S)

        fault.touch()
        failed_at = time.monotonic()
        for reader in readers:
            reader.join(DEADLINE_S)
        health = httpx.get(url + "/health")
        refused = httpx.post(url + "/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}]})
        code = proc.wait(timeout=GRACE_S + 30)
        elapsed = time.monotonic() - failed_at
    finally:
        stop(proc)
    log.seek(0)
    output = log.read()

    for reader in readers:
        assert not reader.is_alive()
        assert (reader.status, reader.done) == (200, True)
        assert reader.error["message"].startswith("the engine failed while generating request ")
    assert health.status_code == 503, output
    assert health.json() == {"status": "failed", "error": "the engine failed: RuntimeError: injected fault: "
                                                          f"{fault} exists"}
    assert refused.status_code == 503 and "the engine has failed" in refused.json()["error"]["message"]
    assert code == 1, output
    assert GRACE_S <= elapsed < GRACE_S + 25
    assert "the engine failed outside a step's model run" in output
