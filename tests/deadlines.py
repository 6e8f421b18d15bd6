"""Waiting on a condition under a deadline (no fixed sleeps): shared by the engine and the
serving tests; it imports nothing of the server stack, so engine-only tests (and the GPU
machine, which has no uvicorn) can use it."""

from __future__ import annotations

import asyncio
import time


def wait_until(condition, timeout: float = 10.0, interval: float = 0.01) -> None:
    """Poll condition() until it holds; fail the test when it still does not after timeout seconds."""
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, f"timed out after {timeout} s waiting for {condition}"
        time.sleep(interval)


async def async_wait_until(condition, timeout: float = 10.0, interval: float = 0.01) -> None:
    """wait_until for a coroutine: polls without blocking the event loop."""
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, f"timed out after {timeout} s waiting for {condition}"
        await asyncio.sleep(interval)
