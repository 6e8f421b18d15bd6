"""The chat page at GET / (tallow/serve/ui/): its headers and --no-ui without a browser, then
the page itself in headless Chromium (Playwright; tests marked `browser`, run by
`make test-browser`, skipped when Playwright or Chromium is missing)."""

from __future__ import annotations

import json
import tempfile
import threading

import httpx
import pytest

from chat_ui_utils import WEATHER_TOOL, XSS_REPLY, chromium_path, launch_browser, ui_script
from deadlines import wait_until
from serve_utils import LiveServer, replay_engine
from tallow.config import ServerConfig
from tallow.serve.app import build_app

# ---- without a browser ---------------------------------------------------------------------


def test_page_is_static_with_a_self_only_csp():
    from fastapi.testclient import TestClient

    client = TestClient(build_app(None, ServerConfig(api_key="secret")))
    r = client.get("/")
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/html")
    csp = r.headers["content-security-policy"]
    assert "default-src 'self'" in csp and "script-src 'self'" in csp and "unsafe-inline" not in csp
    assert "http" not in r.text.replace('name="viewport"', "")  # no CDN: every file from the server
    for name, kind in (("app.js", "javascript"), ("markdown.js", "javascript"), ("style.css", "css")):
        asset = client.get(f"/ui/{name}")
        assert asset.status_code == 200 and kind in asset.headers["content-type"], name
        assert "://" not in asset.text, name
    assert client.get("/ui/../config.py").status_code == 401  # the client resolves it to /config.py: not the page's
    assert client.get("/ui/..%2Fconfig.py").status_code == 404  # kept under /ui/: no file of that name
    assert client.get("/ui/secret.txt").status_code == 404
    # public (no key needed) while the API still refuses without it
    assert client.post("/v1/chat/completions", json={}).status_code == 401


def test_no_ui_turns_the_page_off():
    from fastapi.testclient import TestClient

    client = TestClient(build_app(None, ServerConfig(ui=False)))
    assert client.get("/").status_code == 404
    assert client.get("/ui/app.js").status_code == 404
    from tallow.cli import main

    with pytest.raises(SystemExit):  # the flag exists on serve (parsed before anything loads)
        main(["serve", "--no-ui", "--help"])


# ---- in a browser --------------------------------------------------------------------------


@pytest.fixture(scope="module")
def browser():
    sync_api = pytest.importorskip("playwright.sync_api", reason="make test-browser installs playwright")
    if chromium_path() is None:
        pytest.skip("no chromium (make test-browser installs it)")
    with sync_api.sync_playwright() as p:
        b = launch_browser(p)
        yield b
        b.close()


@pytest.fixture
def page(browser):
    context = browser.new_context()
    pg = context.new_page()
    pg.dialogs = []
    pg.on("dialog", lambda d: (pg.dialogs.append(d.message), d.dismiss()))
    pg.chat_bodies = []
    pg.on("request", lambda r: r.url.endswith("/v1/chat/completions") and pg.chat_bodies.append(r.post_data_json))
    pg.set_default_timeout(60_000)
    yield pg
    context.close()


@pytest.fixture(scope="module")
def ui_replay_server():
    import asyncio

    engine = replay_engine(ui_script())
    with LiveServer(engine) as live:
        yield live
    # Playwright's sync API keeps an event loop running in this thread: shut down from another
    closer = threading.Thread(target=asyncio.run, args=(engine.shutdown(),))
    closer.start()
    closer.join(30)


def open_page(page, url: str) -> None:
    page.goto(url + "/")
    until(page, "document.getElementById('model-name').textContent !== 'tallow'")


def until(page, js: str, timeout: float = 60.0) -> None:
    """Wait (under a deadline) until the JavaScript expression js is true in the page. Evaluated
    through the debugger protocol: wait_for_function's string predicates need eval, which the
    page's Content-Security-Policy refuses."""
    wait_until(lambda: page.evaluate(js), timeout=timeout, interval=0.05)


def set_settings(page, **fields) -> None:
    page.click("#settings-toggle")
    for name, value in fields.items():
        page.fill(f"#set-{name.replace('_', '-')}", str(value))
    page.click("#settings-toggle")


def send(page, text: str) -> None:
    page.fill("#input", text)
    page.press("#input", "Enter")


def stored_messages(page) -> list[dict]:
    return page.evaluate("JSON.parse(localStorage.getItem('tallow.conversations'))[0].messages")


def running(url: str) -> int:
    return httpx.get(url + "/stats").json()["engine"]["running"]


@pytest.mark.browser
def test_reply_streams_in_and_matches_the_api(page, real_server):
    url = real_server.base_url
    open_page(page, url)
    assert not page.is_visible("#settings")
    set_settings(page, temperature=0, max_tokens=40)
    assert not page.is_visible("#settings")
    send(page, "What is the capital of France?")
    # text shows while the request is still open (the stop button is up): streamed, not at the end
    until(page, "document.querySelector('.msg.assistant .content')?.textContent.length > 0 "
                           "&& !document.getElementById('stop').hidden")
    until(page, "document.getElementById('stop').hidden")
    msgs = stored_messages(page)
    assert [m["role"] for m in msgs] == ["user", "assistant"]
    body = page.chat_bodies[-1]
    assert body["messages"] == [{"role": "user", "content": "What is the capital of France?"}], body
    assert body["temperature"] == 0 and body["max_tokens"] == 40 and body["stream"] is True, body
    # the same request not streamed (stream_options, which the page sends, only go with stream: true)
    plain = {k: v for k, v in body.items() if k != "stream_options"}
    expected = httpx.post(url + "/v1/chat/completions", timeout=120, json={**plain, "stream": False}).json()
    assert msgs[1]["content"] == expected["choices"][0]["message"]["content"]
    meta = page.text_content(".msg.assistant .meta")
    usage = expected["usage"]
    assert f"prompt {usage['prompt_tokens']}" in meta and f"completion {usage['completion_tokens']}" in meta
    assert "TTFT" in meta and "tok/s" in meta
    # live server state from /stats
    until(page, "document.getElementById('stat-running').textContent === '0'")
    assert page.dialogs == []


@pytest.mark.browser
def test_stop_aborts_the_request(page, real_server):
    url = real_server.base_url
    open_page(page, url)
    set_settings(page, temperature=0, max_tokens=3000)
    send(page, "Write a long essay about the history of France.")  # greedy: hundreds of tokens
    until(page, "document.querySelector('.msg.assistant .content')?.textContent.length > 0")
    wait_until(lambda: running(url) == 1, timeout=30)
    disconnected = httpx.get(url + "/stats").json()["requests"].get("disconnected", 0)
    page.click("#stop")
    wait_until(lambda: running(url) == 0, timeout=15)
    # the server saw the client leave (and aborted the run), not a reply that had ended anyway
    wait_until(lambda: httpx.get(url + "/stats").json()["requests"].get("disconnected", 0) == disconnected + 1)
    until(page, "document.querySelector('.msg.assistant .meta').textContent.includes('stopped')")
    assert page.is_visible("#send") and not page.is_visible("#stop")
    # the conversation goes on after a stop: regenerate sends again
    set_settings(page, max_tokens=4)
    page.click("text=Regenerate")
    until(page, "document.querySelector('.msg.assistant .meta').textContent.includes('length')")


@pytest.mark.browser
def test_reasoning_and_tool_call_rendered(page, ui_replay_server):
    url = ui_replay_server.base_url
    open_page(page, url)
    send(page, "Here is a riddle for you")
    page.wait_for_selector(".msg.assistant details.reasoning")
    until(page, "document.getElementById('stop').hidden")
    assert "an echo" in page.text_content(".msg.assistant .reasoning-text")
    assert page.text_content(".msg.assistant .content").strip() == "An echo."
    assert page.get_attribute(".msg.assistant details.reasoning", "open") is None  # collapsed once done
    # the conversation is kept in the browser: still there after a reload
    page.reload()
    until(page, "document.querySelectorAll('.msg').length === 2")
    assert page.text_content("#conversations li.active").startswith("Here is a riddle")
    assert "an echo" in page.text_content(".msg.assistant .reasoning-text")
    # a tool call as a card
    page.click("#new-chat")
    set_settings(page, tools=json.dumps(WEATHER_TOOL))
    send(page, "What is the weather in Paris?")
    page.wait_for_selector(".msg.assistant .tool-call")
    until(page, "document.getElementById('stop').hidden")
    assert page.text_content(".tool-call .tool-name").endswith("get_weather")
    args = json.loads(page.text_content(".tool-call pre"))
    assert args == {"city": "Paris", "unit": "celsius", "days": [1, 2]}
    assert page.text_content(".msg.assistant .content").strip() == "I will look it up."
    # edit and resend: the user's message comes back into the box, the turn is dropped
    page.click(".msg.user >> text=Edit")
    assert page.input_value("#input") == "What is the weather in Paris?"
    assert page.locator(".msg").count() == 0


@pytest.mark.browser
def test_hostile_markup_is_inert(page, ui_replay_server):
    url = ui_replay_server.base_url
    open_page(page, url)
    hostile_user = "hostile <img src=x onerror=alert(1)> [x](javascript:alert(1))"
    send(page, hostile_user)
    until(page, "document.getElementById('stop').hidden && document.querySelectorAll('.msg.assistant').length")
    assert stored_messages(page)[1]["content"] == XSS_REPLY
    assert page.locator("#messages img").count() == 0
    assert page.locator("#messages [onerror]").count() == 0
    assert page.locator("#messages a[href^='javascript']").count() == 0
    assert "<img src=x onerror=alert(1)>" in page.text_content(".msg.assistant .content")
    assert "[click me](javascript:alert(1))" in page.text_content(".msg.assistant .content")
    assert page.text_content(".msg.user .content") == hostile_user
    safe = page.locator(".msg.assistant a")
    assert safe.count() == 1 and safe.get_attribute("href") == "https://example.com/docs"
    page.click(".msg.assistant >> text=javascript:alert(1)", force=True)
    assert page.dialogs == []


@pytest.mark.browser
def test_api_key_prompt(page):
    from serve_process import spawn_server, stop

    key = "tallow-test-key-7781"
    with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as f:
        json.dump(ui_script(), f)
    with tempfile.TemporaryFile("w+") as log:
        proc, url = spawn_server(["--model", f"replay:{f.name}", "--api-key", key], log)
        try:
            page.goto(url + "/")
            page.wait_for_selector("#key-dialog[open]")
            page.fill("#key-input", "wrong")
            page.press("#key-input", "Enter")
            page.wait_for_selector("#key-dialog[open]")  # refused: asked again
            page.fill("#key-input", key)
            page.press("#key-input", "Enter")
            until(page, "document.getElementById('model-name').textContent !== 'tallow'")
            send(page, "Here is a riddle for you")
            until(page, "document.querySelector('.msg.assistant .content')?.textContent.includes('An echo')")
            assert page.evaluate("sessionStorage.getItem('tallow.apiKey')") == key
            local = page.evaluate("JSON.stringify(Object.assign({}, localStorage))")
            assert key not in local
        finally:
            stop(proc)
