"""The published OpenAPI schema, made to say what the server does.

FastAPI's generated schema promises 422 for a bad body (this server answers
400, OpenAI's status), declares only JSON for endpoints that stream
``text/event-stream``, and cannot know the loaded model's vocabulary. Schema
fuzzers (and client generators) take the schema at its word, so it is patched
once here: every status a route can answer, both media types where ``stream``
chooses, the token-id range once the model is loaded, and the 400 codes the
schema itself cannot express (:data:`SEMANTIC_CODES`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi

from llmsys.engine.server.protocol import SEMANTIC_CODES

if TYPE_CHECKING:
    from llmsys.engine.server.state import ServerState

_ERROR_SCHEMA = {
    "type": "object",
    "required": ["error"],
    "properties": {"error": {
        "type": "object",
        "required": ["message", "type"],
        "properties": {
            "message": {"type": "string"},
            "type": {"type": "string"},
            "param": {"type": ["string", "null"]},
            "code": {"type": ["string", "null"]},
        },
    }},
}

_WHY = {
    "400": "the body breaks the schema, or (code in " + ", ".join(SEMANTIC_CODES) + ") a limit of the loaded model",
    "401": "missing or wrong API key (servers started with one)",
    "403": "a Host or browser Origin this server does not serve (--allowed-hosts, --cors-origin)",
    "404": "no such route or model",
    "405": "method not allowed (the Allow header lists the allowed ones)",
    "408": "the request body did not arrive in time",
    "413": "the body is larger than --max-body",
    "429": "every running and queued place is taken; retry after Retry-After",
    "503": "the model is loading, the server is shutting down, or the engine thread stopped",
}
_GENERATING = ("/v1/chat/completions", "/v1/completions")
_QUEUED = (*_GENERATING, "/v1/embeddings")  # requests that take a queue place and name a model


def _error(status: str) -> dict[str, Any]:
    return {"description": _WHY[status], "content": {"application/json": {"schema": {"$ref": "#/components/schemas/Error"}}}}


def _cap_token_ids(node: Any, vocab: int) -> None:
    """Every ``{"type": "integer", "minimum": 0}`` under the prompt is a token id: cap it at the vocabulary."""
    if isinstance(node, dict):
        if node.get("type") == "integer" and node.get("minimum") == 0:
            node["maximum"] = vocab - 1
        for v in node.values():
            _cap_token_ids(v, vocab)
    elif isinstance(node, list):
        for v in node:
            _cap_token_ids(v, vocab)


def build_schema(app: FastAPI, state: ServerState) -> dict[str, Any]:
    schema = get_openapi(title=app.title, version=app.version, description=app.description, routes=app.routes)
    schema.setdefault("components", {}).setdefault("schemas", {})["Error"] = _ERROR_SCHEMA
    for path, ops in schema.get("paths", {}).items():
        for method, op in ops.items():
            responses = op.setdefault("responses", {})
            responses.pop("422", None)
            statuses = ["403", "503"]
            if method == "post":
                statuses += ["400", "408", "413"]
            if path.startswith("/v1"):
                statuses.append("401")
            if path in _QUEUED or path.startswith("/v1/models/"):
                statuses.append("404")  # a model name this server does not serve
            if path in _QUEUED:
                statuses.append("429")
            if path in _GENERATING:
                ok = responses.setdefault("200", {"description": "Successful Response"})
                ok["content"] = {"application/json": {"schema": {}},
                                 "text/event-stream": {"schema": {}}}
            for st in statuses:
                responses.setdefault(st, _error(st))
    if state.ready:
        schemas = schema["components"]["schemas"]
        prompt = schemas.get("CompletionRequest", {}).get("properties", {}).get("prompt")
        _cap_token_ids(prompt, state.llm.loaded.args.vocab_size)
        emb = schemas.get("EmbeddingRequest", {}).get("properties", {})
        _cap_token_ids(emb.get("input"), state.llm.loaded.args.vocab_size)
        for branch in emb.get("dimensions", {}).get("anyOf", []):  # at most the model's embedding size
            if branch.get("type") == "integer":
                branch["maximum"] = state.llm.loaded.args.hidden_size
        for name in ("CompletionRequest", "ChatCompletionRequest", "EmbeddingRequest"):  # names this server answers to
            props = schemas.get(name, {}).get("properties", {})
            if "model" in props:
                props["model"] = {"anyOf": [{"type": "string", "enum": sorted(state.model_names())}, {"type": "null"}],
                                  "title": "Model", "description": "the served model (GET /v1/models), or null"}
    return schema


class ServerAPI(FastAPI):
    """The FastAPI app, serving :func:`build_schema` at ``/openapi.json`` (cached once the
    model is loaded; before that the token-id range is unknown and it is rebuilt per request)."""

    def __init__(self, state: ServerState, **kwargs: Any):
        super().__init__(**kwargs)
        self.llmsys_state = state

    def openapi(self) -> dict[str, Any]:
        if self.openapi_schema is not None:
            return self.openapi_schema
        schema = build_schema(self, self.llmsys_state)
        if self.llmsys_state.ready:
            self.openapi_schema = schema
        return schema
