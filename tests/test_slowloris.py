"""Slow clients were never timed out (slowloris): sockets sending one header byte a second were
never closed, and near the open-file limit every new connection failed. Against `tallow serve`
in a subprocess with a short --http-read-timeout: a request's headers and its body must arrive
within the limit (then 408 and the connection closes), a response may take longer, idle
keep-alive connections are closed, and a connection past --max-connections gets a clear 503
while the ones already open are served."""

import contextlib
import json
import socket
import threading
import time

import httpx
import pytest

from deadlines import wait_until
from serve_process import StreamReader, spawn_server, stop

READ_TIMEOUT_S = 1.5
KEEP_ALIVE_S = 2.0
MAX_CONNECTIONS = 6
# How long a socket may stay open past the read timeout before the test calls it never closed.
SLACK_S = 20.0
CHAT = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("slowloris")
    script = tmp / "reply.json"
    script.write_text(json.dumps({"step_delay_s": 0.01, "replies": [{"reply": "Fine, thank you."}]}))
    log = open(tmp / "serve.log", "w+")
    proc, url = spawn_server(["--model", f"replay:{script}", "--max-num-seqs", "8", "--kv-cache-memory", "0.05",
                              "--http-read-timeout", str(READ_TIMEOUT_S), "--keep-alive-timeout", str(KEEP_ALIVE_S),
                              "--max-connections", str(MAX_CONNECTIONS)], log)
    yield url
    stop(proc)


def connect(url: str) -> socket.socket:
    host, port = url.removeprefix("http://").split(":")
    return socket.create_connection((host, int(port)), timeout=SLACK_S)


class Drip(threading.Thread):
    """Sends `data` over a socket a few bytes at a time, `pause` seconds apart, until it is all
    sent or the server closes; keeps what the server answered."""

    def __init__(self, sock: socket.socket, data: bytes, pause: float, step: int = 1):
        super().__init__(daemon=True)
        self.sock, self.data, self.pause, self.step = sock, data, pause, step
        self.closed = threading.Event()
        self.received = b""

    def run(self) -> None:
        reader = threading.Thread(target=self._read, daemon=True)
        reader.start()
        for i in range(0, len(self.data), self.step):
            if self.closed.wait(self.pause):
                return
            try:
                self.sock.sendall(self.data[i:i + self.step])
            except OSError:
                return

    def _read(self) -> None:
        try:
            while chunk := self.sock.recv(65536):
                self.received += chunk
        except OSError:  # reset: the server closed while bytes were still coming
            pass
        self.closed.set()


def chat_ok(url: str) -> None:
    r = httpx.post(url + "/v1/chat/completions", json=CHAT, timeout=60)
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["message"]["content"]


def assert_timed_out(drip: Drip) -> None:
    wait_until(drip.closed.is_set, timeout=READ_TIMEOUT_S + SLACK_S)
    if drip.received:  # the 408 came before the close (a reset can drop it)
        assert drip.received.startswith(b"HTTP/1.1 408"), drip.received[:200]
        assert b"--http-read-timeout" in drip.received


def test_headers_one_byte_at_a_time_are_cut_off_while_others_are_served(server):
    head = (b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            b"X-Padding: " + b"a" * 400 + b"\r\n\r\n")
    drip = Drip(connect(server), head, pause=0.05)  # 20 s to send it all: far past the timeout
    drip.start()
    chat_ok(server)  # served meanwhile
    assert_timed_out(drip)
    chat_ok(server)


def test_a_body_slower_than_the_limit_is_cut_off(server):
    body = json.dumps(CHAT).encode()
    head = (b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            b"Content-Length: %d\r\n\r\n" % len(body))
    sock = connect(server)
    sock.sendall(head)  # the headers at once, then the body a byte at a time
    drip = Drip(sock, body, pause=0.1)
    drip.start()
    chat_ok(server)
    assert_timed_out(drip)


def test_a_connection_that_sends_nothing_is_closed(server):
    drip = Drip(connect(server), b"", pause=0)
    drip.start()
    assert_timed_out(drip)


@pytest.mark.slow  # fast-tier budget: CI runs it in the slow tier
def test_an_idle_keep_alive_connection_is_closed(server):
    sock = connect(server)
    body = json.dumps(CHAT).encode()
    sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                 b"Content-Length: %d\r\n\r\n%s" % (len(body), body))
    drip = Drip(sock, b"", pause=0)
    drip.start()
    wait_until(drip.closed.is_set, timeout=KEEP_ALIVE_S + SLACK_S)
    assert drip.received.startswith(b"HTTP/1.1 200")  # answered, then closed once idle


@pytest.mark.slow  # fast-tier budget: CI runs it in the slow tier
def test_a_response_may_take_longer_than_the_read_timeout(server):
    reader = StreamReader(server, max_tokens=300)  # 300 steps of >= 10 ms: past the 1.5 s limit
    started = time.monotonic()
    reader.start()
    reader.join(120)
    assert (reader.status, reader.finish_reason, reader.done, reader.tokens) == (200, "length", True, 300)
    assert time.monotonic() - started > READ_TIMEOUT_S


def test_connections_past_the_cap_get_a_clear_503(server):
    long = {**CHAT, "max_tokens": 2000, "ignore_eos": True, "stream": True}
    readers = []
    with contextlib.ExitStack() as stack:
        # Five connections busy with long streams (a response is not limited by the read timeout).
        for _ in range(MAX_CONNECTIONS - 1):
            client = stack.enter_context(httpx.Client(base_url=server, timeout=60))
            stream = stack.enter_context(client.stream("POST", "/v1/chat/completions", json=long))
            assert stream.status_code == 200
            lines = stream.iter_lines()
            next(lines)
            readers.append(lines)  # held: a dropped line iterator closes its response, and the connection
        early = stack.enter_context(httpx.Client(base_url=server, timeout=60))
        assert early.post("/v1/chat/completions", json=CHAT).status_code == 200  # the sixth: at the cap
        late = httpx.post(server + "/v1/chat/completions", json=CHAT, timeout=60)
        # The connection opened before the cap was reached is still served (kept alive).
        again = early.post("/v1/chat/completions", json=CHAT)
        anthropic = httpx.post(server + "/v1/messages", timeout=60,
                               json={"model": "m", "max_tokens": 4, "messages": [{"role": "user", "content": "hi"}]})
    assert late.status_code == 503
    assert late.headers["Retry-After"] == "1" and late.headers["connection"] == "close"
    assert "too many open connections" in late.json()["error"]["message"]
    assert anthropic.status_code == 503 and anthropic.json()["type"] == "error"
    assert again.status_code == 200
    # Once they are gone, new clients are served again.
    wait_until(lambda: httpx.post(server + "/v1/chat/completions", json=CHAT, timeout=60).status_code == 200,
               timeout=SLACK_S, interval=0.2)
