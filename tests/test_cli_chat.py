"""`tallow chat` in a pseudo-terminal (pexpect): the default model loaded in process, and a live
server through --url. A question is answered (as the API answers it, greedy), Ctrl+C mid-reply
returns to the prompt (and the server's sequence is freed), /reset clears the history (seen in
what /save writes)."""

from __future__ import annotations

import json
import os
import sys

import httpx
import pytest

from deadlines import wait_until

pexpect = pytest.importorskip("pexpect")

PROMPT = ">>> "
LONG = "Write a long essay about the history of France."


def spawn(*args: str):
    child = pexpect.spawn(sys.executable, ["-m", "tallow.testing", "chat", *args], encoding="utf-8",
                          timeout=60, dimensions=(40, 200),
                          env={**os.environ, "OMP_NUM_THREADS": "1", "TERM": "dumb"})
    child.expect_exact("/help for commands")
    child.expect_exact(PROMPT)
    return child


def saved(child, path) -> list[dict]:
    child.sendline(f"/save {path}")
    child.expect_exact("(saved")
    child.expect_exact(PROMPT)
    return json.loads(path.read_text())["messages"]


def ask(child, text: str) -> None:
    child.sendline(text)
    child.expect_exact(PROMPT)


def stop_mid_reply(child) -> None:
    child.sendline(LONG)
    child.expect_exact(LONG + "\r\n")  # the echo of the line
    child.expect(r"\w+\W+\w+\W+\w+")  # the reply is streaming
    child.sendintr()
    child.expect_exact("[stopped]")
    child.expect_exact(PROMPT)


def test_chat_in_process(tmp_path):
    child = spawn("--model", "default", "--temperature", "0", "--max-tokens", "400")
    try:
        ask(child, "What is the capital of France?")
        assert "Paris" in child.before
        stop_mid_reply(child)
        msgs = saved(child, tmp_path / "a.json")
        assert [m["role"] for m in msgs] == ["user", "assistant", "user", "assistant"]
        assert "Paris" in msgs[1]["content"] and msgs[2]["content"] == LONG
        assert 0 < len(msgs[3]["content"])  # what came before the stop
        child.sendline("/system Answer in one word.")
        child.expect_exact("system prompt set")
        child.expect_exact(PROMPT)
        assert saved(child, tmp_path / "b.json") == [{"role": "system", "content": "Answer in one word."}]
        ask(child, "hello")
        child.sendline("/reset")
        child.expect_exact("(conversation cleared)")
        child.expect_exact(PROMPT)
        assert saved(child, tmp_path / "c.json") == [{"role": "system", "content": "Answer in one word."}]
        # multi-line input: one message
        child.sendline("first line\\")
        child.sendline("second line")
        child.expect_exact(PROMPT)
        assert saved(child, tmp_path / "d.json")[1] == {"role": "user", "content": "first line\nsecond line"}
        child.sendeof()
        child.expect(pexpect.EOF)
    finally:
        child.close(force=True)
    assert child.exitstatus == 0


def test_chat_with_a_server(real_server, tmp_path):
    url = real_server.base_url
    child = spawn("--url", url, "--temperature", "0", "--max-tokens", "400")
    try:
        question = "What is the capital of France?"
        ask(child, question)
        msgs = saved(child, tmp_path / "a.json")
        expected = httpx.post(url + "/v1/chat/completions", timeout=60, json={
            "messages": [{"role": "user", "content": question}], "temperature": 0, "max_tokens": 400}).json()
        assert msgs[1]["content"] == expected["choices"][0]["message"]["content"]
        disconnected = httpx.get(url + "/stats").json()["requests"].get("disconnected", 0)
        stop_mid_reply(child)
        wait_until(lambda: httpx.get(url + "/stats").json()["engine"]["running"] == 0, timeout=15)
        # the server saw the client leave (and aborted the run), not a reply that had ended anyway
        wait_until(lambda: httpx.get(url + "/stats").json()["requests"].get("disconnected", 0) == disconnected + 1)
        child.sendline("/exit")
        child.expect(pexpect.EOF)
    finally:
        child.close(force=True)
    assert child.exitstatus == 0


def test_reasoning_is_dimmed(tmp_path):
    from chat_ui_utils import ui_script

    script = tmp_path / "replay.json"
    script.write_text(json.dumps(ui_script()))
    child = spawn("--model", f"replay:{script}")
    try:
        child.sendline("Here is a riddle for you")
        child.expect_exact("\x1b[2m")  # dim on
        child.expect_exact("an echo.")
        child.expect_exact("\x1b[0m")  # dim off before the answer
        child.expect_exact("An echo.")
        child.expect_exact(PROMPT)
        # only the answer is kept in the history, as the server's message content
        assert saved(child, tmp_path / "a.json")[1] == {"role": "assistant", "content": "An echo."}
        child.sendline("/exit")
        child.expect(pexpect.EOF)
    finally:
        child.close(force=True)
