"""The chat page's screenshots in docs/ (light and dark: a conversation with reasoning and code),
taken from the replay source in headless Chromium. Run from the repository root:

    PYTHONPATH=.:tests python tests/chat_ui_screenshots.py
"""

from __future__ import annotations

import asyncio
import sys
from pathlib import Path

from playwright.sync_api import sync_playwright

from chat_ui_utils import launch_browser, ui_script
from deadlines import wait_until
from serve_utils import LiveServer, replay_engine
from tallow.config import ServerConfig

DOCS = Path(__file__).resolve().parent.parent / "docs"


def main() -> int:
    engine = replay_engine(ui_script())
    with LiveServer(engine, ServerConfig(served_model_name="replay (docs screenshot)")) as live, sync_playwright() as p:
        browser = launch_browser(p)
        for theme in ("light", "dark"):
            page = browser.new_page(viewport={"width": 1100, "height": 860}, color_scheme=theme)
            page.goto(live.base_url + "/")
            wait_until(lambda: page.evaluate("document.getElementById('model-name').textContent !== 'tallow'"), 30)
            for text in ("Here is a riddle for you", "How do I reverse a string in Python?"):
                page.fill("#input", text)
                page.press("#input", "Enter")
                wait_until(lambda: page.evaluate("document.getElementById('stop').hidden"), 30)
            for summary in page.locator("details.reasoning summary").all():
                summary.click()
            page.screenshot(path=str(DOCS / f"chat-ui-{theme}.png"))
            page.close()
        browser.close()
    asyncio.run(engine.shutdown())
    return 0


if __name__ == "__main__":
    sys.exit(main())
