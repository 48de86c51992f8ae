"""OpenAPI 3.1 document generated from the declared routes and their pydantic models.

pydantic emits JSON Schema 2020-12, which is what OpenAPI 3.1 uses, so component schemas are
taken as they are; this module only assembles paths, parameters and responses.
"""

from __future__ import annotations

import re
from typing import Any

from pydantic import BaseModel
from pydantic.json_schema import models_json_schema

from agentic_sandbox.broker.http.routing import RouteSpec

_PARAM_RE = re.compile(r"{([^}:]+)(?::[^}]*)?}")

PROBLEM_SCHEMA: dict[str, Any] = {
    "type": "object",
    "description": "RFC 7807 problem details",
    "required": ["type", "title", "status", "detail"],
    "properties": {
        "type": {"type": "string"},
        "title": {"type": "string"},
        "status": {"type": "integer"},
        "detail": {"type": "string"},
        "code": {"type": "string"},
        "instance": {"type": "string"},
        "request_id": {"type": "string"},
        "errors": {
            "type": "array",
            "items": {
                "type": "object",
                "properties": {
                    "field": {"type": "string"},
                    "message": {"type": "string"},
                    "type": {"type": "string"},
                },
            },
        },
    },
}


def openapi_path(path: str) -> str:
    """aiohttp `{name:regex}` → OpenAPI `{name}`."""
    return _PARAM_RE.sub(lambda m: "{" + m.group(1) + "}", path)


def _problem(desc: str) -> dict[str, Any]:
    return {
        "description": desc,
        "content": {
            "application/problem+json": {"schema": {"$ref": "#/components/schemas/Problem"}}
        },
    }


def build_openapi(
    specs: list[RouteSpec], *, title: str, version: str, server_url: str
) -> dict[str, Any]:
    # Why it is built this way:
    # - Every schema comes from the same pydantic models the router validates with (one
    #   `models_json_schema` call over all of them, so shared sub-models get one `$ref` name
    #   and never two diverging copies): the document cannot drift from what is enforced.
    # - The error responses are derived from what the route declares, in the order the
    #   router checks them (parse 400/422/413/415, then auth 401/403/429, then 404 for a
    #   path id), because each one is something the plumbing really answers for that route;
    #   a route's own `responses` only add to them (`setdefault`) and never hide one.
    # - Paths and schemas are sorted so the document is byte-stable: a diff of it in review
    #   shows API changes, not dict order.
    models: set[type[BaseModel]] = set()
    for spec in specs:
        for m in (spec.body, spec.response, spec.query):
            if m is not None:
                models.add(m)
    ordered = sorted(models, key=lambda m: m.__name__)
    _, defs = models_json_schema(
        [(m, "validation") for m in ordered], ref_template="#/components/schemas/{model}"
    )
    schemas: dict[str, Any] = dict(defs.get("$defs", {}))
    schemas["Problem"] = PROBLEM_SCHEMA

    paths: dict[str, dict[str, Any]] = {}
    for spec in specs:
        path = openapi_path(spec.path)
        op: dict[str, Any] = {
            "operationId": f"{spec.tag}_{spec.name}",
            "summary": spec.summary,
            "tags": [spec.tag],
        }
        if spec.description:
            op["description"] = spec.description
        if spec.deprecated:
            op["deprecated"] = True
        params: list[dict[str, Any]] = [
            {"name": name, "in": "path", "required": True, "schema": {"type": "string"}}
            for name in _PARAM_RE.findall(spec.path)
        ]
        if spec.query is not None:
            qschema = spec.query.model_json_schema(ref_template="#/components/schemas/{model}")
            required = set(qschema.get("required", []))
            for name, prop in qschema.get("properties", {}).items():
                param: dict[str, Any] = {
                    "name": name,
                    "in": "query",
                    "required": name in required,
                    "schema": prop,
                }
                if "description" in prop:
                    param["description"] = prop["description"]
                params.append(param)
        if params:
            op["parameters"] = params
        if spec.body is not None:
            op["requestBody"] = {
                "required": True,
                "content": {
                    "application/json": {
                        "schema": {"$ref": f"#/components/schemas/{spec.body.__name__}"}
                    }
                },
            }
        responses: dict[str, Any] = {}
        if spec.websocket:
            responses["101"] = {"description": "WebSocket upgrade (subprotocol sandbox.pty.v1)"}
        elif spec.response is not None:
            responses[str(spec.status)] = {
                "description": spec.summary,
                "content": {
                    "application/json": {
                        "schema": {"$ref": f"#/components/schemas/{spec.response.__name__}"}
                    }
                },
            }
        elif spec.content_type is not None:
            responses[str(spec.status)] = {
                "description": spec.summary,
                "content": {spec.content_type: {"schema": {"type": "string"}}},
            }
        else:
            responses["204" if spec.status in (200, 204) else str(spec.status)] = {
                "description": spec.summary
            }
        if spec.body is not None or spec.query is not None:
            responses["400"] = _problem("malformed request")
            responses["422"] = _problem("invalid input; `errors` names each bad field")
        if spec.body is not None:
            responses["413"] = _problem("body larger than the configured limit")
            responses["415"] = _problem("body is not JSON")
        if spec.role is not None:
            responses["401"] = _problem("missing or invalid token")
            responses["403"] = _problem("role or scope not allowed")
            responses["429"] = _problem("rate limit or quota exceeded")
            op["security"] = [{"bearer": []}, {"cookie": []}]
            op["x-minimum-role"] = spec.role.value  # viewer < operator < admin
        else:
            op["security"] = []
        if "{" in spec.path:
            responses["404"] = _problem("unknown, or not visible to this caller")
        for status, desc in spec.responses.items():
            if status < 400 and spec.response is not None:
                responses.setdefault(
                    str(status),
                    {
                        "description": desc,
                        "content": {
                            "application/json": {
                                "schema": {"$ref": f"#/components/schemas/{spec.response.__name__}"}
                            }
                        },
                    },
                )
            else:
                responses.setdefault(str(status), _problem(desc))
        op["responses"] = responses
        paths.setdefault(path, {})[spec.method.lower()] = op

    return {
        "openapi": "3.1.0",
        "info": {
            "title": title,
            "version": version,
            "description": "Admin (/api/v2/admin), observability (/api/v1/events) and the "
            "deprecated v1 task API of agentic-sandbox. Errors are RFC 7807 problem+json.",
        },
        "servers": [{"url": server_url}],
        "paths": dict(sorted(paths.items())),
        "components": {
            "schemas": dict(sorted(schemas.items())),
            "securitySchemes": {
                "bearer": {"type": "http", "scheme": "bearer", "description": "operator token"},
                "cookie": {
                    "type": "apiKey",
                    "in": "cookie",
                    "name": "sbx_session",
                    "description": "dashboard session; mutations need the X-CSRF-Token header",
                },
            },
        },
    }
