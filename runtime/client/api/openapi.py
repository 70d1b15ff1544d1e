"""The API's OpenAPI 3.1 document (``GET /openapi.json``), built from the pydantic models.

The handlers read their bodies themselves (strict parsing with OpenAI-style errors:
:func:`eaas.runtime.client.api.protocol.parse`), so FastAPI sees no body parameter: the request
bodies are added here from the request models (:data:`REQUEST_BODIES`), with every route's
documented answers (:func:`route_doc`: its 200 model and the error statuses it can give, each
:class:`~.bodies.ErrorResponse`). Operation ids are unique (``HEAD /health`` is its own
operation). ``bearerAuth`` marks the routes that need the API key when one is set.
"""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi
from pydantic import BaseModel

from eaas.runtime.client.api.bodies import ErrorResponse
from eaas.runtime.client.api.guard import needs_key
from eaas.runtime.client.api.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    TokenizeRequest,
)

#: path -> the model of its JSON request body
REQUEST_BODIES: dict[str, type[BaseModel]] = {
    "/v1/completions": CompletionRequest,
    "/v1/chat/completions": ChatCompletionRequest,
    "/tokenize": TokenizeRequest,
    "/detokenize": DetokenizeRequest,
}

_ERROR_TEXT = {
    400: "Invalid request (the error's param names the field)",
    401: "Missing or wrong API key (when the server has keys)",
    404: "Unknown model",
    413: "Request body over --max-request-body",
    415: "Content-Type is not application/json",
    500: "Internal error (the server keeps serving)",
    503: "No live replica for a needed expert, or the client is shutting down (retryable)",
}


def route_doc(
    operation_id: str,
    model: type[BaseModel] | None,
    errors: tuple[int, ...],
    stream: bool = False,
) -> dict[str, Any]:
    """Keyword arguments of a route decorator: its ``operation_id``, its 200 answer (``model``;
    with ``stream``, also ``text/event-stream``), its error answers (``errors``, plus 500)."""
    responses: dict[int | str, dict[str, Any]] = {}
    ok: dict[str, Any] = {"description": "Successful response"}
    if model is not None:
        ok["model"] = model
    if stream:
        ok["content"] = {
            # before OpenAPI 3.2's itemSchema, an event stream's `schema` describes one event
            # (the fields of the SSE format, html.spec.whatwg.org "Server-sent events")
            "text/event-stream": {"schema": SSE_EVENT_SCHEMA}
        }
    responses[200] = ok
    for status in (*errors, 500):
        responses[status] = {"model": ErrorResponse, "description": _ERROR_TEXT[status]}
    return {"operation_id": operation_id, "responses": responses, "response_model": None}


#: One server-sent event of a streamed answer: ``data`` is a JSON chunk of the route's stream
#: type (``*.chunk`` objects), ``[DONE]`` in the last event.
SSE_EVENT_SCHEMA: dict[str, Any] = {
    "type": "object",
    "description": "One server-sent event: data is a JSON chunk, data: [DONE] last",
    "properties": {
        "data": {"type": "string"},
        "event": {"type": "string"},
        "id": {"type": "string"},
        "retry": {"type": "integer"},
    },
    "required": ["data"],
}


def _add_model(components: dict[str, Any], model: type[BaseModel]) -> dict[str, str]:
    """Put ``model``'s JSON schema (and the models it uses) into ``components``; its ``$ref``."""
    schema = model.model_json_schema(ref_template="#/components/schemas/{model}")
    for name, sub in schema.pop("$defs", {}).items():
        components.setdefault(name, sub)
    components[model.__name__] = schema
    return {"$ref": f"#/components/schemas/{model.__name__}"}


def build_openapi(app: FastAPI) -> dict[str, Any]:
    """The OpenAPI document of ``app`` with the request bodies and the key's security scheme."""
    doc = get_openapi(
        title=app.title,
        version=app.version,
        description=app.description,
        routes=app.routes,
    )
    components = doc.setdefault("components", {})
    schemas = components.setdefault("schemas", {})
    components["securitySchemes"] = {
        "bearerAuth": {
            "type": "http",
            "scheme": "bearer",
            "description": "One of the keys of --api-key / EAAS_API_KEY (when set)",
        }
    }
    error_ref = _add_model(schemas, ErrorResponse)
    for path, ops in doc.get("paths", {}).items():
        for method, op in ops.items():
            model = REQUEST_BODIES.get(path)
            if method == "post" and model is not None:
                op["requestBody"] = {
                    "required": True,
                    "content": {"application/json": {"schema": _add_model(schemas, model)}},
                }
            if needs_key(path):
                op["security"] = [{}, {"bearerAuth": []}]  # no key needed unless keys are set
            answers = op.setdefault("responses", {})
            answers.pop("422", None)  # FastAPI's own validation answer: ours is a 400
            if not any(str(code)[0] in "45" for code in answers):  # /routing-table (push token)
                for rng in ("4XX", "5XX"):
                    answers[rng] = {
                        "description": "Refused (OpenAI-style error object)",
                        "content": {"application/json": {"schema": error_ref}},
                    }
    for unused in ("HTTPValidationError", "ValidationError"):
        schemas.pop(unused, None)
    return doc


def install_openapi(app: FastAPI) -> None:
    """Serve :func:`build_openapi` (built once, on the first ``GET /openapi.json``)."""

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            app.openapi_schema = build_openapi(app)
        return app.openapi_schema

    app.openapi = openapi  # type: ignore[method-assign]
