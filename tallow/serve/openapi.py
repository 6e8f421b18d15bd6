"""/openapi.json with the request bodies the routes read.

The POST routes take the raw body (`Request`) and parse it in the planning thread
(plan.parse_request), so FastAPI cannot see their models: this adds each route's requestBody,
a $ref to its pydantic model's JSON schema (validation mode, by alias) under
components.schemas. The models ignore unknown fields, so the schemas allow them too.
"""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi
from pydantic import BaseModel
from pydantic.json_schema import models_json_schema

REF = "#/components/schemas/{model}"


def declare_request_bodies(app: FastAPI, bodies: dict[str, type[BaseModel]]) -> None:
    """Make app.openapi() declare `bodies` ({POST path: model}) as the routes' JSON bodies."""

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is not None:
            return app.openapi_schema
        schema = get_openapi(title=app.title, version=app.version, routes=app.routes)
        models = list(dict.fromkeys(bodies.values()))
        refs, definitions = models_json_schema([(m, "validation") for m in models], ref_template=REF)
        components = schema.setdefault("components", {}).setdefault("schemas", {})
        components.update(definitions.get("$defs", {}))
        for path, model in bodies.items():
            operation = schema.get("paths", {}).get(path, {}).get("post")
            if operation is not None:
                operation["requestBody"] = {"required": True, "content": {
                    "application/json": {"schema": refs[(model, "validation")]}}}
        app.openapi_schema = schema
        return schema

    app.openapi = openapi
