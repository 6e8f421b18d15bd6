"""Live servers for the agent-protocol tests (Anthropic Messages, OpenAI Responses), started once
per test session and shared by their files: the default model on dense weights (greedy text is
then the same for any batch shape) and the replay model of tests/data/replay_agents.json, which
renders with Qwen3's template (tools section, <think>) and says scripted replies."""

from __future__ import annotations

import functools
import json
from pathlib import Path

from serve_utils import LiveServer, start_real_engine

from tallow.config import EngineConfig
import tallow.testing  # noqa: F401  (registers the replay: model source)

REPLAY_SCRIPT = Path(__file__).parent / "data" / "replay_agents.json"


def scripted_reply(match: str) -> str:
    """The reply the replay script gives to a prompt with `match` in it."""
    return next(e["reply"] for e in json.loads(REPLAY_SCRIPT.read_text())["replies"] if e.get("match") == match)


@functools.cache
def real_server() -> LiveServer:
    engine = start_real_engine()
    server = LiveServer(engine).__enter__()
    server.engine = engine
    return server


@functools.cache
def replay_server() -> LiveServer:
    from tallow.engine.async_engine import AsyncEngine

    engine = AsyncEngine.from_config(EngineConfig(model=f"replay:{REPLAY_SCRIPT}", quantization="none"))
    server = LiveServer(engine).__enter__()
    server.engine = engine
    return server
