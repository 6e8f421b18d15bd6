"""A row whose logits go non-finite fails that request alone with a 500 (issue 24); its message
now names the request id, the one the engine's log line about the failed row names, on every
protocol, streamed or not."""

import asyncio
import json

import httpx
import pytest

from serve_utils import FakeEngine
from tallow.config import ServerConfig
from tallow.engine.core import TokenOutput
from tallow.serve.app import build_app


class FailingStream:
    def __init__(self, prompt_ids):
        self.outputs = [TokenOutput([], None, None, "error", len(prompt_ids), 0)]

    def __aiter__(self):
        return self

    async def __anext__(self):
        if not self.outputs:
            raise StopAsyncIteration
        return self.outputs.pop()

    def abort(self) -> None:
        self.outputs = []


class FailingEngine(FakeEngine):
    """Every sequence fails at once, as the engine fails a row with non-finite logits."""

    def __init__(self):
        super().__init__()
        self.request_ids: list[str] = []

    def submit(self, prompt_ids, params, request_id=None, **kwargs):
        self.request_ids.append(request_id)
        return [FailingStream(prompt_ids) for _ in range(params.n)]


BODIES = {
    "/v1/chat/completions": {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4},
    "/v1/completions": {"prompt": "hi", "max_tokens": 4},
    "/v1/messages": {"model": "m", "max_tokens": 4, "messages": [{"role": "user", "content": "hi"}]},
    "/v1/responses": {"input": "hi", "max_output_tokens": 4},
}


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("path", BODIES)
def test_the_500_names_the_request(path, stream):
    engine = FailingEngine()
    app = build_app(engine, ServerConfig())

    async def go():
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as client:
            return await client.post(path, json={**BODIES[path], "stream": stream})

    response = asyncio.run(go())
    [request_id] = engine.request_ids
    if stream:
        assert response.status_code == 200
        errors = [json.loads(line[6:]) for line in response.text.splitlines()
                  if line.startswith("data: ") and '"error"' in line]
        assert errors, response.text
        text = json.dumps(errors[-1])
    else:
        assert response.status_code == 500, response.text
        text = response.text
    assert request_id and request_id in text, (request_id, text)
