"""Ctrl+C on `tallow serve` ended with a CancelledError traceback (issue 24). SIGINT (once, twice
in a row as an impatient user or `make` sends it, or while the model loads) now ends the server
cleanly: status 0, no traceback. A subprocess server on a replay model."""

import json
import signal
import subprocess
import sys

import pytest

from deadlines import wait_until
from serve_process import StreamReader, free_port, spawn_server, stop


@pytest.fixture
def script(tmp_path):
    path = tmp_path / "reply.json"
    path.write_text(json.dumps({"step_delay_s": 0.005, "replies": [{"reply": "One, two, three, four."}]}))
    return path


def serve_args(script) -> list[str]:
    return ["--model", f"replay:{script}", "--shutdown-timeout", "30", "--kv-cache-memory", "0.05"]


def output_of(proc, log) -> tuple[int, str]:
    code = proc.wait(timeout=60)
    log.seek(0)
    return code, log.read()


def assert_clean(code: int, output: str) -> None:
    assert code in (0, 130), output
    assert "Traceback" not in output and "CancelledError" not in output, output


def test_ctrl_c_when_idle(script, tmp_path):
    log = open(tmp_path / "serve.log", "w+")
    proc, _ = spawn_server(serve_args(script), log)
    try:
        proc.send_signal(signal.SIGINT)
        assert_clean(*output_of(proc, log))
    finally:
        stop(proc)


@pytest.mark.slow  # fast-tier budget: CI runs it in the slow tier
def test_ctrl_c_twice_with_a_stream_in_flight(script, tmp_path):
    log = open(tmp_path / "serve.log", "w+")
    proc, url = spawn_server(serve_args(script), log)
    try:
        reader = StreamReader(url, max_tokens=4000)
        reader.start()
        assert reader.started.wait(30)
        proc.send_signal(signal.SIGINT)
        wait_until(lambda: "draining" in (tmp_path / "serve.log").read_text())
        proc.send_signal(signal.SIGINT)  # the second: exit without waiting out the 30 s
        assert_clean(*output_of(proc, log))
        reader.join(10)
    finally:
        stop(proc)


@pytest.mark.slow  # fast-tier budget: CI runs it in the slow tier
def test_ctrl_c_while_the_model_loads(script, tmp_path):
    log = open(tmp_path / "serve.log", "w+")
    proc = subprocess.Popen([sys.executable, "-m", "tallow.testing", "serve", *serve_args(script),
                             "--port", str(free_port())], stdout=log, stderr=subprocess.STDOUT)
    try:
        wait_until(lambda: "Uvicorn running" in (tmp_path / "serve.log").read_text(), timeout=60)
        proc.send_signal(signal.SIGINT)
        assert_clean(*output_of(proc, log))
    finally:
        stop(proc)
