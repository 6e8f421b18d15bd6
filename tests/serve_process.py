"""`tallow serve` in a subprocess (the CLI with the test fixtures registered: `python -m
tallow.testing`), and a thread that streams one chat completion from it. Shared by the tests of
what the process itself does: SIGTERM draining, exiting after an engine failure."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import threading
import time

import httpx


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def spawn_server(serve_args: list[str], log, cli_args: tuple[str, ...] = (),
                 start_timeout: float = 120.0) -> tuple[subprocess.Popen, str]:
    """Start `python -m tallow.testing [cli_args] serve [serve_args] --port P` writing to `log`,
    and wait (under start_timeout) until /health answers 200. Returns (process, base url)."""
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "tallow.testing", *cli_args, "serve", *serve_args,
                             "--port", str(port)],
                            stdout=log, stderr=subprocess.STDOUT, env={**os.environ, "OMP_NUM_THREADS": "1"})
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + start_timeout
    while True:
        if proc.poll() is not None or time.monotonic() >= deadline:
            proc.kill()
            log.seek(0)
            raise AssertionError(f"the server did not start:\n{log.read()}")
        try:
            if httpx.get(url + "/health").status_code == 200:
                return proc, url
        except httpx.TransportError:
            pass
        time.sleep(0.2)


def stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.kill()
        proc.wait()


class StreamReader(threading.Thread):
    """Streams one chat completion of max_tokens (eos ignored); keeps its status, finish reason,
    the error frame, the usage's completion tokens and whether [DONE] came."""

    def __init__(self, url: str, max_tokens: int):
        super().__init__(daemon=True)
        self.url, self.max_tokens = url, max_tokens
        self.started = threading.Event()
        self.status = self.finish_reason = self.error = None
        self.done = False
        self.tokens = 0

    def run(self) -> None:
        body = {"messages": [{"role": "user", "content": f"count to {self.max_tokens}"}], "max_tokens": self.max_tokens,
                "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}
        with httpx.stream("POST", self.url + "/v1/chat/completions", json=body, timeout=60) as r:
            self.status = r.status_code
            for line in r.iter_lines():
                if line == "data: [DONE]":
                    self.done = True
                elif line.startswith("data: "):
                    chunk = json.loads(line[6:])
                    self.started.set()
                    self.error = chunk.get("error", self.error)
                    for choice in chunk.get("choices", []):
                        self.finish_reason = choice["finish_reason"] or self.finish_reason
                    if chunk.get("usage"):
                        self.tokens = chunk["usage"]["completion_tokens"]
