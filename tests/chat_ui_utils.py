"""Shared by the chat page's browser tests and its screenshot script: a replay script whose
replies exercise the page (reasoning, a tool call, code, hostile markup), and headless Chromium
through Playwright (Debian's /usr/bin/chromium: Playwright cannot download its own here)."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

AGENT_SCRIPT = Path(__file__).parent / "data" / "replay_agents.json"
XSS_REPLY = ("Look: <img src=x onerror=alert(1)> and [click me](javascript:alert(1)) "
             "and [docs](https://example.com/docs)")
CODE_REPLY = ("<think>\nThe user wants a function that reverses a string. Slicing with a step of -1 "
              "does it in one expression.\n</think>\n\nUse slicing with a negative step:\n\n"
              "```python\ndef reverse(text: str) -> str:\n    return text[::-1]\n```\n\n"
              "For example `reverse(\"tallow\")` gives **\"wollat\"**.")


def ui_script() -> dict:
    """replay_agents.json's template and replies, plus a hostile reply and one with code."""
    script = json.loads(AGENT_SCRIPT.read_text())
    script["replies"] = [{"match": "hostile", "reply": XSS_REPLY}, {"match": "reverse", "reply": CODE_REPLY},
                         *script["replies"]]
    return script


WEATHER_TOOL = [{"type": "function", "function": {
    "name": "get_weather", "description": "the weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}, "unit": {"type": "string"},
                                                   "days": {"type": "array", "items": {"type": "integer"}}},
                   "required": ["city"]}}}]


def chromium_path() -> str | None:
    path = os.environ.get("TALLOW_CHROMIUM") or shutil.which("chromium") or shutil.which("chromium-browser")
    return path


def launch_browser(playwright):
    return playwright.chromium.launch(executable_path=chromium_path(), headless=True,
                                      args=["--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage"])
