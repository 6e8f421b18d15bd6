"""OpenAI's published OpenAPI document (the schemas tallow's tests need: tests/data/openai_openapi,
MIT license) as jsonschema validators: `validate("Response", body)`.

The document is OpenAPI 3.1 (JSON Schema 2020-12); a 3.0-style `nullable: true` where one is left
is read as allowing null. `discriminator` is OpenAPI's hint and not checked; every oneOf member
pins its `type`, so the union still picks exactly one."""

from __future__ import annotations

import json
from functools import cache
from pathlib import Path

from jsonschema import Draft202012Validator

_DOC = Path(__file__).parent / "data" / "openai_openapi" / "schemas.json"


def _nullable(x):
    if isinstance(x, list):
        return [_nullable(v) for v in x]
    if not isinstance(x, dict):
        return x
    out = {k: _nullable(v) for k, v in x.items() if k != "nullable"}
    if x.get("nullable") is True:
        if isinstance(out.get("type"), str):
            out["type"] = [out["type"], "null"]
            if "enum" in out:
                out["enum"] = [*out["enum"], None]
        elif "type" not in out:
            out = {"anyOf": [out, {"type": "null"}]}
    return out


@cache
def _document() -> dict:
    doc = json.loads(_DOC.read_text())
    return {"components": _nullable(doc["components"])}


@cache
def validator(name: str) -> Draft202012Validator:
    return Draft202012Validator({**_document(), "$ref": f"#/components/schemas/{name}"})


COUNT = {"validated": 0}


def validate(name: str, obj) -> None:
    """Assert that `obj` conforms to the schema `name`, listing every violation."""
    errors = sorted(validator(name).iter_errors(obj), key=lambda e: list(e.absolute_path))
    COUNT["validated"] += 1
    assert not errors, f"{name}: " + "; ".join(
        f"{'/'.join(map(str, e.absolute_path))}: {e.message[:300]}" for e in errors[:5])


@cache
def _event_schemas() -> dict[str, str]:
    """Responses stream event type -> the name of its schema (the members of ResponseStreamEvent)."""
    schemas = _document()["components"]["schemas"]
    out = {}
    for member in schemas["ResponseStreamEvent"].get("anyOf") or schemas["ResponseStreamEvent"]["oneOf"]:
        name = member["$ref"].split("/")[-1]
        for event_type in schemas[name]["properties"]["type"].get("enum", []):
            out[event_type] = name
    return out


def validate_event(event: dict) -> None:
    """A Responses stream event against the schema of its type (an unknown type fails)."""
    name = _event_schemas().get(event["type"])
    assert name is not None, f"{event['type']} is not a Responses stream event"
    validate(name, event)
