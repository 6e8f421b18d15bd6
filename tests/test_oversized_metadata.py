"""Responses `metadata` took 10,000 keys (issue 24): it is now bounded as OpenAI bounds it, at
most 16 pairs, keys up to 64 characters, values up to 512; beyond is a 400 naming metadata."""

import asyncio

import httpx
import pytest

from serve_utils import FakeEngine
from tallow.config import ServerConfig
from tallow.serve.app import build_app


def post(body: dict) -> httpx.Response:
    app = build_app(FakeEngine(max_model_len=256), ServerConfig())

    async def go():
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as client:
            return await client.post("/v1/responses", json={"input": "hi", "max_output_tokens": 4, **body})

    return asyncio.run(go())


@pytest.mark.parametrize("metadata", [
    {f"k{i}": "v" for i in range(17)},
    {f"k{i}": "v" for i in range(10_000)},
    {"k" * 65: "v"},
    {"k": "v" * 513},
    {"k": 5},
])
def test_metadata_beyond_openai_bounds_is_400(metadata):
    response = post({"metadata": metadata})
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"].startswith("metadata")


def test_metadata_at_the_bounds_is_echoed():
    metadata = {f"{i:02d}" + "k" * 62: "v" * 512 for i in range(16)}
    response = post({"metadata": metadata})
    assert response.status_code == 200, response.text
    assert response.json()["metadata"] == metadata
