"""No POST route declared its request body in /openapi.json (issue 24): a generated client or a
schema fuzzer saw none. Each now references its pydantic model's schema; checked with jsonschema
on real bodies, and the routes still take fields they do not know."""

import asyncio

import httpx
import jsonschema
import pytest

from serve_utils import FakeEngine
from tallow.config import ServerConfig
from tallow.serve.app import build_app

VALID = {
    "/v1/chat/completions": {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2},
    "/v1/completions": {"prompt": "hi", "max_tokens": 2},
    "/v1/messages": {"model": "m", "max_tokens": 2, "messages": [{"role": "user", "content": "hi"}]},
    "/v1/messages/count_tokens": {"model": "m", "messages": [{"role": "user", "content": "hi"}]},
    "/v1/responses": {"input": "hi", "max_output_tokens": 2},
    "/tokenize": {"prompt": "hi"},
    "/detokenize": {"tokens": [104, 105]},
}
INVALID = {
    "/v1/chat/completions": {"messages": "hi"},
    "/v1/completions": {"prompt": 5.5},
    "/v1/messages": {"model": "m", "messages": [{"role": "robot", "content": "hi"}]},
    "/v1/messages/count_tokens": {"messages": [{"role": "user"}]},
    "/v1/responses": {"input": 5},
    "/tokenize": {"prompt": 5},
    "/detokenize": {"tokens": "ab"},
}


@pytest.fixture(scope="module")
def app():
    return build_app(FakeEngine(), ServerConfig())


def request(app, method: str, path: str, body=None) -> httpx.Response:
    async def go():
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as client:
            return await client.request(method, path, json=body)

    return asyncio.run(go())


@pytest.fixture(scope="module")
def document(app):
    response = request(app, "GET", "/openapi.json")
    assert response.status_code == 200
    return response.json()


def body_validator(document: dict, path: str) -> jsonschema.Draft202012Validator:
    schema = document["paths"][path]["post"]["requestBody"]["content"]["application/json"]["schema"]
    return jsonschema.Draft202012Validator({**schema, "components": document["components"]})


def test_every_post_route_declares_its_body(document):
    posts = [path for path, operations in document["paths"].items() if "post" in operations]
    assert sorted(posts) == sorted(VALID)
    for path in posts:
        body = document["paths"][path]["post"]["requestBody"]
        assert body["required"] is True
        ref = body["content"]["application/json"]["schema"]["$ref"]
        assert ref.startswith("#/components/schemas/") and ref.rsplit("/", 1)[1] in document["components"]["schemas"]


@pytest.mark.parametrize("path", VALID)
def test_declared_schema_matches_what_the_route_takes(app, document, path):
    validator = body_validator(document, path)
    with_extra = {**VALID[path], "x_unknown_field": {"a": 1}}
    validator.validate(with_extra)  # extra fields allowed, as the route allows them
    assert request(app, "POST", path, with_extra).status_code == 200
    assert not validator.is_valid(INVALID[path])
    assert request(app, "POST", path, INVALID[path]).status_code == 400
