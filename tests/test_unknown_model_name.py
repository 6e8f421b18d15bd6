"""An unknown `model` is served by the loaded model (agent CLIs send their own names; see the
README); the response must then name the model that served it, never echo the name asked for,
on every protocol, streamed or not. --strict-model-names answers 404 instead (issue 24)."""

import asyncio
import json

import httpx
import pytest

from serve_utils import FakeEngine
from tallow.config import ServerConfig
from tallow.serve.app import build_app

ASKED = "gpt-4o-mini"
BODIES = {
    "/v1/chat/completions": {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 3},
    "/v1/completions": {"prompt": "hi", "max_tokens": 3},
    "/v1/messages": {"max_tokens": 3, "messages": [{"role": "user", "content": "hi"}]},
    "/v1/responses": {"input": "hi", "max_output_tokens": 3},
}


def post(app, path: str, body: dict) -> httpx.Response:
    async def go():
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as client:
            return await client.post(path, json=body)

    return asyncio.run(go())


def named_models(response: httpx.Response, stream: bool) -> set[str]:
    if not stream:
        return {response.json()["model"]}
    names = set()
    for line in response.text.splitlines():
        if line.startswith("data: {"):
            frame = json.loads(line[6:])
            frame = frame.get("response") or frame.get("message") or frame
            if "model" in frame:
                names.add(frame["model"])
    return names


@pytest.mark.parametrize("served_name", [None, "my-alias"])
@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("path", BODIES)
def test_the_served_model_is_named(path, stream, served_name):
    app = build_app(FakeEngine(), ServerConfig(served_model_name=served_name))
    response = post(app, path, {**BODIES[path], "model": ASKED, "stream": stream})
    assert response.status_code == 200, response.text
    served = served_name or "fake-model"
    assert named_models(response, stream) == {served}
    assert post(app, path, {**BODIES[path], "model": served}).json()["model"] == served


@pytest.mark.parametrize("path", BODIES)
def test_strict_model_names_refuse_others(path):
    app = build_app(FakeEngine(), ServerConfig(strict_model_names=True))
    response = post(app, path, {**BODIES[path], "model": ASKED})
    assert response.status_code == 404, response.text
    assert post(app, path, {**BODIES[path], "model": "fake-model"}).status_code == 200
