"""The router's OpenAPI document, with the request bodies its routes parse themselves.

The OpenAI routes read their body by hand (a size limit first, then one error shape for
every problem, see ``app._parse``), so FastAPI cannot see their models; this puts each
one's JSON schema (from the same pydantic models, the one source of truth) into the
document, so clients, gateways and API fuzzers see what the router takes.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi
from pydantic import BaseModel

REF = "#/components/schemas/{model}"


def document_bodies(app: FastAPI, bodies: Mapping[tuple[str, str], type[BaseModel]]) -> None:
    """Serve an OpenAPI document whose ``(method, path)`` operations take ``bodies``."""

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            doc = get_openapi(title=app.title, version=app.version, routes=app.routes)
            schemas = doc.setdefault("components", {}).setdefault("schemas", {})
            for (method, path), model in bodies.items():
                schema = model.model_json_schema(ref_template=REF)
                schemas.update(schema.pop("$defs", {}))
                schemas[model.__name__] = schema
                doc["paths"][path][method]["requestBody"] = {
                    "required": True,
                    "content": {
                        "application/json": {"schema": {"$ref": REF.format(model=model.__name__)}}
                    },
                }
            app.openapi_schema = doc
        return app.openapi_schema

    app.openapi = openapi  # type: ignore[method-assign]
