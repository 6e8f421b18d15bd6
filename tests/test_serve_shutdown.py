"""SIGTERM on `tallow serve` (a subprocess on a replay model): new requests get 503 at once,
a request in flight that ends within --shutdown-timeout finishes normally, one that would run
longer is aborted at the timeout (its stream still ends properly), and the process exits 0."""

import json
import signal
import time

import httpx
import pytest

from deadlines import wait_until
from serve_process import StreamReader, spawn_server, stop

SHUTDOWN_TIMEOUT_S = 4.0


@pytest.fixture
def serve(tmp_path):
    script = tmp_path / "reply.json"
    # Paced at >= 5 ms a step, so the 4000-token request cannot finish within the timeout
    # however fast the machine (it ran to the end once on a fast CI runner).
    script.write_text(json.dumps({"step_delay_s": 0.005,
                                  "replies": [{"reply": "One, two, three, four, five, six, seven, eight, nine, ten."}]}))
    log = open(tmp_path / "serve.log", "w+")
    proc, url = spawn_server(["--model", f"replay:{script}", "--shutdown-timeout", str(SHUTDOWN_TIMEOUT_S),
                              "--max-num-seqs", "4", "--kv-cache-memory", "0.05"], log)
    yield proc, url, log
    stop(proc)


@pytest.mark.slow  # fast-tier budget: CI runs it in the slow tier
def test_sigterm_drains_then_exits_zero(serve):
    proc, url, log = serve
    short, long = StreamReader(url, max_tokens=40), StreamReader(url, max_tokens=4000)
    for reader in (short, long):
        reader.start()
        assert reader.started.wait(30)

    sent = time.monotonic()
    proc.send_signal(signal.SIGTERM)
    wait_until(lambda: httpx.get(url + "/health").status_code == 503)  # the server has taken the signal
    refused = httpx.post(url + "/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}]})
    health = httpx.get(url + "/health")
    code = proc.wait(timeout=SHUTDOWN_TIMEOUT_S + 20)
    elapsed = time.monotonic() - sent
    short.join(5)
    long.join(5)
    log.seek(0)
    output = log.read()

    assert refused.status_code == 503 and "shutting down" in refused.json()["error"]["message"]
    assert health.status_code == 503
    assert (short.status, short.finish_reason, short.done, short.tokens) == (200, "length", True, 40)
    assert (long.status, long.finish_reason, long.done) == (200, "abort", True)
    assert 0 < long.tokens < 4000
    assert code == 0, output
    # It drained for the whole timeout before aborting. No upper bound: the machine may be slow,
    # and proc.wait's timeout above is the limit.
    assert elapsed >= SHUTDOWN_TIMEOUT_S
    assert "draining" in output and "aborting 1 requests" in output
