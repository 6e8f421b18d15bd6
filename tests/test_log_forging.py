"""A path (or request id) holding a newline forged a second access-log line, and ANSI escapes
reached the terminal raw (issue 24): every field of the line is now escaped."""

import asyncio
import logging

import httpx

from serve_utils import FakeEngine
from tallow.config import ServerConfig
from tallow.serve.access_log import RequestRecord, escape_field
from tallow.serve.app import build_app

FORGED = "/v1/x\n4c0ffee GET /v1/chat/completions 200 prompt_tokens=1\x1b[2J\x1b[31m\u2028\x85"


def test_a_forged_path_stays_one_line(caplog):
    app = build_app(FakeEngine(), ServerConfig())

    async def go():
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as client:
            # %0A and %1B: the server decodes the path before the access log sees it.
            return await client.get("/v1/x%0A4c0ffee%20GET%20/v1/chat/completions%20200%1B%5B2J")

    with caplog.at_level(logging.INFO, logger="tallow.access"):
        response = asyncio.run(go())
    assert response.status_code == 404
    lines = [r.getMessage() for r in caplog.records if r.name == "tallow.access"]
    assert len(lines) == 1
    line = lines[0]
    assert "\n" not in line and "\x1b" not in line
    assert line.split(" ")[2] == "/v1/x\\x0a4c0ffee\\x20GET\\x20/v1/chat/completions\\x20200\\x1b[2J"
    assert line.split(" ")[3] == "404"


def test_every_control_character_is_escaped():
    record = RequestRecord(FORGED, "GET\r\n", FORGED, 0.0, status=200)
    line = record.line(1.0)
    assert line.isprintable() and "\u2028" not in line and "\x85" not in line
    assert len(line.split(" ")) == 9  # the fields stay where they are
    assert escape_field("plain/path-1.2_x:y") == "plain/path-1.2_x:y"
    # The escapes cannot be forged either: a backslash is escaped itself.
    assert escape_field("\\x0a") == "\\x5cx0a"
