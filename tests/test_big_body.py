"""A big body froze everyone: JSON parsing, template rendering and tokenization of the whole body
held the GIL before any length check (a 10 MB chat body held /health for 5.6 s). Now a body
longer than any request that fits the model's context is refused with a 400 naming the bound
before anything parses it (from Content-Length, or while a chunked body arrives), a long prompt
is tokenized with the GIL released, and the heap is trimmed after a big request."""

import asyncio
import json
import threading

import httpx
import pytest

from deadlines import wait_until
from serve_utils import FakeEngine, LiveServer, replay_engine
from tallow.config import ServerConfig
from tallow.serve.security import BODY_ALLOWANCE, ContextBound

MAX_MODEL_LEN = 1024
MAX_PROMPTS = 3


@pytest.fixture(scope="module")
def server():
    engine = FakeEngine(max_model_len=MAX_MODEL_LEN, interval=0.0005)
    with LiveServer(engine, ServerConfig(max_prompts=MAX_PROMPTS)) as live:
        yield live


def bound_of(server, path):
    key = "/v1/completions" if path == "/v1/completions" else "/v1/chat/completions"
    return httpx.get(server.base_url + "/stats").json()["limits"]["body_bytes"][key]


def over(limit: int) -> bytes:
    """A body longer than `limit` whose bytes past the limit are not JSON: parsing it would answer
    'not valid JSON', so an answer naming the bound shows it was refused unparsed."""
    head = b'{"messages": [{"role": "user", "content": "'
    return head + b"x" * (limit - len(head)) + b"}} not JSON"


def test_the_bound_follows_the_context(server):
    chat, completions = bound_of(server, "/v1/chat/completions"), bound_of(server, "/v1/completions")
    # The byte tokenizer's longest token as JSON: "<|im_start|>", 12 characters of which < and >
    # are written \u003c and \u003e by some encoders (Go's): 10 + 2 x 6 = 22 bytes.
    assert chat == BODY_ALLOWANCE + MAX_MODEL_LEN * 22
    assert completions == BODY_ALLOWANCE + MAX_PROMPTS * MAX_MODEL_LEN * 22
    assert chat < ServerConfig().max_body_bytes


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/messages", "/v1/responses", "/v1/completions"])
def test_a_body_over_the_bound_is_a_400_before_parsing(server, path):
    limit = bound_of(server, path)
    declared = httpx.post(server.base_url + path, content=over(limit + 1),
                          headers={"content-type": "application/json"}, timeout=60)

    def chunks():  # a generator body goes chunked, without Content-Length: refused while it arrives
        body = over(limit + 1)
        for i in range(0, len(body), 256 * 1024):
            yield body[i:i + 256 * 1024]

    chunked = httpx.post(server.base_url + path, content=chunks(), headers={"content-type": "application/json"},
                         timeout=60)
    for r in (declared, chunked):
        assert r.status_code == 400, r.text
        body = r.json()
        message = body["error"]["message"]
        assert f"exceeds {limit} bytes" in message and f"{MAX_MODEL_LEN} tokens" in message
        if path == "/v1/messages":
            assert body["type"] == "error" and body["error"]["type"] == "invalid_request_error"
        else:
            assert body["error"]["type"] == "invalid_request_error"
    # At the bound it is parsed (and this one is not JSON).
    at = httpx.post(server.base_url + path, content=over(limit)[:limit], headers={"content-type": "application/json"},
                    timeout=60)
    assert at.status_code == 400 and "JSON" in at.text and "exceeds" not in at.text
    # The connection stays usable and the server serves.
    assert httpx.post(server.base_url + "/v1/chat/completions", timeout=30,
                      json={"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}).status_code == 200


def test_the_configured_cap_still_answers_413_where_it_is_smaller():
    with LiveServer(FakeEngine(max_model_len=MAX_MODEL_LEN), ServerConfig(max_body_bytes=4096)) as live:
        r = httpx.post(live.base_url + "/v1/chat/completions", content=over(5000), timeout=30)
        assert r.status_code == 413 and "4096 bytes" in r.json()["error"]["message"]
        # /tokenize (outside /v1) is held to the cap too.
        r = httpx.post(live.base_url + "/tokenize", content=b'{"prompt": "' + b"x" * 5000 + b'"}', timeout=30)
        assert r.status_code == 413


def _go_escaped(text: str) -> int:
    """Bytes of `text` as a JSON string body, as Go's encoding/json writes it: Python's json.dumps
    with ensure_ascii (non-ASCII as \\uXXXX), plus Go's HTML-safe escapes of <, > and &."""
    return len(json.dumps(text).replace("<", "\\u003c").replace(">", "\\u003e").replace("&", "\\u0026")) - 2


@pytest.fixture(scope="module")
def replay_server():
    engine = replay_engine([{"reply": "Fine."}], max_model_len=2048, max_num_seqs=2)
    with LiveServer(engine) as live:
        yield live
    asyncio.run(engine.shutdown())


def test_the_bound_holds_every_prompt_that_fits(replay_server):
    """No token of the real vocabulary, as an encoder writes it, is longer than the bound allows
    for one token: a prompt of max_model_len tokens always fits in the bound."""
    tokenizer = replay_server.engine.tokenizer
    bound = ContextBound.for_model(tokenizer, replay_server.engine.max_model_len)
    longest = 0
    for token in tokenizer.token_bytes_table():
        try:
            longest = max(longest, _go_escaped(token.decode("utf-8")))
        except UnicodeDecodeError:  # a fragment of a character of 2 to 4 bytes, which is written
            longest = max(longest, 3 * len(token))  # \\uXXXX (6) or a surrogate pair (12): 3 per byte
    assert longest <= bound.token_bytes
    text = "x" * longest
    body = json.dumps({"messages": [{"role": "user", "content": text * replay_server.engine.max_model_len}]})
    assert len(body) <= bound.body_bytes()


def test_health_answers_while_a_big_body_is_tokenized(replay_server, monkeypatch):
    tokenizer = replay_server.engine.tokenizer
    encode = tokenizer.encode
    started, finished = threading.Event(), threading.Event()

    def watched(text, *args, **kwargs):
        big = len(text) > 500_000
        if big:
            started.set()
        try:
            return encode(text, *args, **kwargs)
        finally:
            if big:
                finished.set()

    monkeypatch.setattr(tokenizer, "encode", watched)
    words = "the quick brown fox jumps over the lazy dog while seven bakers sing of rivers "
    content = words * (1_500_000 // len(words))
    limit = bound_of(replay_server, "/v1/chat/completions")
    assert len(content) < limit  # allowed in: it is planned, and fails on its token count
    result = {}

    def send():
        result["r"] = httpx.post(replay_server.base_url + "/v1/chat/completions", timeout=120,
                                 json={"messages": [{"role": "user", "content": content}], "max_tokens": 4})

    sender = threading.Thread(target=send)
    sender.start()
    wait_until(started.is_set, timeout=60)
    health = httpx.get(replay_server.base_url + "/health", timeout=60)
    answered_during_tokenization = not finished.is_set()
    sender.join(120)
    assert health.status_code == 200
    assert answered_during_tokenization
    r = result["r"]
    assert r.status_code == 400 and r.json()["error"]["code"] == "context_length_exceeded"
    # The heap is trimmed after it (where the C library can).
    trimmer = replay_server.app.state.gate.trimmer
    if trimmer.available:
        wait_until(lambda: trimmer.trims >= 1, timeout=30)
