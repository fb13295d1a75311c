"""The request bodies in the OpenAPI document (/openapi.json, and the /docs page drawn from it), for client
generators. The endpoints read their JSON bodies themselves (request_bodies.py: a size limit, OpenAI's error
shape), so FastAPI sees no body parameter and would describe none: each POST route's `openapi_extra` names its
body's model instead, and the document gets those models' JSON schemas, with the models they nest, under
components/schemas."""

from typing import Any

from fastapi import FastAPI
from pydantic import BaseModel
from pydantic.json_schema import models_json_schema

REF = "#/components/schemas/{model}"


class RequestBodies:
    """`app`'s JSON request bodies: `of(Model)` is a route's `openapi_extra`; `app.openapi()` adds their schemas."""

    def __init__(self, app: FastAPI) -> None:
        self.app = app
        self.models: dict[str, type[BaseModel]] = {}
        self.fastapi_openapi = app.openapi
        app.openapi = self.openapi  # FastAPI's way to extend the document: it calls `app.openapi()`

    def of(self, model: type[BaseModel]) -> dict[str, Any]:
        """The route's body is a JSON `model` (a name in components/schemas)."""
        self.models[model.__name__] = model
        return {"requestBody": {"required": True, "content": {
            "application/json": {"schema": {"$ref": REF.format(model=model.__name__)}}}}}

    def openapi(self) -> dict[str, Any]:
        """FastAPI's document with the bodies' schemas, built on the first call and then kept (as FastAPI's is).
        The models' schemas come from one pydantic pass, so two nested models of one name get distinct ones."""
        if self.app.openapi_schema is None:
            document = self.fastapi_openapi()
            _, schemas = models_json_schema([(m, "validation") for m in self.models.values()], ref_template=REF)
            document.setdefault("components", {}).setdefault("schemas", {}).update(schemas["$defs"])
        return self.app.openapi_schema
