"""With --api-key, /stats, /metrics, /docs and /openapi.json answered anyone (issue 24). Every
route but /health now needs the key; /metrics also takes --metrics-key (for a scraper), which
opens nothing else."""

import httpx
import pytest

from serve_utils import FakeEngine, LiveServer
from tallow.config import ServerConfig

KEY = "sk-test-0123456789"
METRICS_KEY = "scrape-0123456789"
PROTECTED = [("GET", "/stats"), ("GET", "/metrics"), ("GET", "/docs"), ("GET", "/redoc"),
             ("GET", "/openapi.json"), ("GET", "/tokenizer_info"), ("POST", "/tokenize"),
             ("POST", "/detokenize"), ("GET", "/v1/models")]


@pytest.fixture(scope="module")
def server():
    with LiveServer(FakeEngine(interval=0.0005), ServerConfig(api_key=KEY, metrics_key=METRICS_KEY)) as live:
        yield live


def call(server, method: str, path: str, key: str | None = None) -> httpx.Response:
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    body = {"prompt": "hi"} if path == "/tokenize" else {"tokens": [104, 105]} if path == "/detokenize" else None
    return httpx.request(method, server.base_url + path, headers=headers, json=body, timeout=30)


@pytest.mark.parametrize("method,path", PROTECTED)
def test_route_needs_the_key(server, method, path):
    assert call(server, method, path).status_code == 401
    assert call(server, method, path, "sk-wrong").status_code == 401
    assert call(server, method, path, KEY).status_code == 200


def test_health_stays_open(server):
    assert call(server, "GET", "/health").status_code == 200


def test_the_chat_page_is_public_unless_turned_off(server):
    # the page holds nothing secret and asks for the key itself (issue 25); its files only
    assert call(server, "GET", "/").status_code == 200
    assert call(server, "GET", "/ui/app.js").status_code == 200
    assert call(server, "GET", "/uix").status_code == 401
    with LiveServer(FakeEngine(interval=0.0005), ServerConfig(api_key=KEY, ui=False)) as no_ui:
        assert call(no_ui, "GET", "/").status_code == 401


def test_metrics_key_opens_metrics_only(server):
    assert call(server, "GET", "/metrics", METRICS_KEY).status_code == 200
    for method, path in PROTECTED:
        if path != "/metrics":
            assert call(server, method, path, METRICS_KEY).status_code == 401, path


def test_without_a_key_everything_is_open():
    with LiveServer(FakeEngine(interval=0.0005)) as live:
        for method, path in PROTECTED:
            assert call(live, method, path).status_code == 200, path
