"""The client tier: real agent frameworks against `tallow serve` on the default model.

These tests run in their own virtual environment (`make test-clients` builds .venv-clients from
client_tests/requirements.txt): the frameworks pin openai and pydantic versions that must not
move tallow's. The server runs from tallow's own environment: TALLOW_PYTHON (the Makefile passes
.venv/bin/python) in a subprocess. Nothing here imports tallow.
"""

from __future__ import annotations

import os
import socket
import subprocess
import tempfile
import time

import httpx
import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="session")
def base_url():
    """`tallow serve --model default` in a subprocess; its /v1 URL once /health answers 200."""
    python = os.environ.get("TALLOW_PYTHON", os.path.join(ROOT, ".venv", "bin", "python"))
    port = _free_port()
    log = tempfile.TemporaryFile(mode="w+")
    proc = subprocess.Popen([python, "-m", "tallow.cli", "serve", "--model", "default", "--port", str(port)],
                            cwd=ROOT, stdout=log, stderr=subprocess.STDOUT,
                            env={**os.environ, "PYTHONPATH": ROOT})  # this checkout's tallow
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 180
    try:
        while True:
            if proc.poll() is not None or time.monotonic() >= deadline:
                log.seek(0)
                pytest.fail(f"tallow serve did not start (python {python}):\n{log.read()}")
            try:
                if httpx.get(url + "/health").status_code == 200:
                    break
            except httpx.TransportError:
                pass
            time.sleep(0.2)
        yield url + "/v1"
    finally:
        proc.terminate()
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
        log.close()
