"""The FastAPI app: OpenAI-compatible routes, auth, limits, metrics.

Handlers only validate, tokenize, enqueue and relay: the model runs on the
engine thread (:mod:`llmsys.engine.server.worker`). Every error leaves as an
OpenAI-style ``{"error": {"message", "type", "param", "code"}}`` body.
"""

from __future__ import annotations

import hmac
import logging
import time
from contextlib import asynccontextmanager
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from llmsys.kernels.common.errors import ContextOverflowError, LLMSysError
from llmsys.engine.sampling import SamplingParams
from llmsys.offload.kv_policy import KVPolicy
from llmsys.engine.server.completions import (
    Job,
    chat_logprobs,
    collect,
    completion_logprobs,
    finish_details,
    new_id,
    stream_events,
    timings_dict,
)
from llmsys.engine.server.protocol import (
    APIError,
    ChatCompletionRequest,
    CompletionRequest,
    stop_list,
    validation_message,
)
from llmsys.engine.server.state import ServerState

log = logging.getLogger("llmsys.server")

_ENDPOINTS = {"/v1/chat/completions", "/v1/completions", "/v1/models", "/health", "/metrics"}


class GuardMiddleware:
    """Pure ASGI (so it sees the raw body stream): request-size limit (413),
    API key on ``/v1`` (401), and the per-endpoint request counter."""

    def __init__(self, app: Any, state: ServerState):
        self.app = app
        self.state = state

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        path = scope.get("path", "")
        endpoint = path if path in _ENDPOINTS else "other"
        status_box = {"status": 500}

        async def send_counted(msg: dict) -> None:
            if msg["type"] == "http.response.start":
                status_box["status"] = msg["status"]
            await send(msg)

        try:
            err = self._check(scope)
            if err is not None:
                return await _send_error(send_counted, err)
            # Read the whole body first (it is small by construction): a body
            # over the limit is refused before any handler sees it, whether or
            # not the client sent Content-Length.
            limit = self.state.settings.max_body_bytes
            body, more = [], scope.get("method") in ("POST", "PUT", "PATCH")
            seen = 0
            while more:
                msg = await receive()
                if msg["type"] != "http.request":
                    return  # client went away while sending
                body.append(msg.get("body", b""))
                seen += len(body[-1])
                more = msg.get("more_body", False)
                if seen > limit:
                    return await _send_error(send_counted, _too_large(limit))
            replay = [{"type": "http.request", "body": b"".join(body), "more_body": False}]

            async def replay_receive() -> dict:
                return replay.pop() if replay else await receive()

            await self.app(scope, replay_receive, send_counted)
        finally:
            self.state.metrics.count_request(endpoint, status_box["status"])

    def _check(self, scope: dict) -> APIError | None:
        headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope.get("headers", [])}
        limit = self.state.settings.max_body_bytes
        length = headers.get("content-length")
        if length is not None and length.isdigit() and int(length) > limit:
            return _too_large(limit)
        key = self.state.settings.api_key
        if key and scope.get("path", "").startswith("/v1"):
            auth = headers.get("authorization", "")
            given = auth[7:].strip() if auth.lower().startswith("bearer ") else ""
            if not given or not hmac.compare_digest(given.encode(), key.encode()):
                what = "missing" if not given else "incorrect"
                return APIError(401, f"{what} API key: send 'Authorization: Bearer <key>' with the server's --api-key",
                                code="invalid_api_key")
        return None


def _too_large(limit: int) -> APIError:
    return APIError(413, f"request body is larger than the server's limit of {limit} bytes", code="request_too_large")


async def _send_error(send: Any, err: APIError) -> None:
    resp = JSONResponse(err.body(), status_code=err.status, headers=err.headers)
    await resp({"type": "http"}, None, send)


def _error_response(err: APIError) -> JSONResponse:
    return JSONResponse(err.body(), status_code=err.status, headers=err.headers)


def _engine_error(e: LLMSysError) -> APIError:
    if isinstance(e, ContextOverflowError):
        return APIError(400, str(e), param="messages", code="context_length_exceeded",
                        n_prompt_tokens=e.n_prompt_tokens, n_ctx=e.n_ctx)
    return APIError(400, str(e).splitlines()[0] if str(e) else type(e).__name__)


def create_app(state: ServerState) -> FastAPI:
    @asynccontextmanager
    async def lifespan(app: FastAPI):
        yield
        state.close()  # after uvicorn drained in-flight requests: abort the rest, stop the thread

    app = FastAPI(title="llmsys", version="0.1", description="OpenAI-compatible local LLM server", lifespan=lifespan)
    app.add_middleware(GuardMiddleware, state=state)

    @app.exception_handler(APIError)
    async def _api_error(request: Request, e: APIError) -> JSONResponse:
        return _error_response(e)

    @app.exception_handler(RequestValidationError)
    async def _validation(request: Request, e: RequestValidationError) -> JSONResponse:
        msg, param = validation_message(list(e.errors()))
        return _error_response(APIError(400, msg, param=param))

    @app.exception_handler(LLMSysError)
    async def _llmsys(request: Request, e: LLMSysError) -> JSONResponse:
        return _error_response(_engine_error(e))

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, e: StarletteHTTPException) -> JSONResponse:
        return _error_response(APIError(e.status_code, str(e.detail), type="invalid_request_error"))

    @app.exception_handler(Exception)
    async def _internal(request: Request, e: Exception) -> JSONResponse:
        log.exception("unhandled error")
        return _error_response(APIError(500, f"internal error: {e}", type="server_error"))

    def need_ready() -> None:
        if state.load_error:
            raise APIError(503, f"model failed to load: {state.load_error}", type="server_error")
        if not state.ready:
            raise APIError(503, "the model is still loading; retry shortly", type="server_error",
                           code="model_loading", headers={"Retry-After": "1"})

    @app.get("/health")
    async def health() -> JSONResponse:
        if not state.ready:
            return JSONResponse({"status": "error" if state.load_error else "loading"}, status_code=503)
        return JSONResponse({"status": "ok"})

    @app.get("/metrics", response_class=PlainTextResponse)
    async def metrics() -> PlainTextResponse:
        return PlainTextResponse(state.metrics.render(), media_type="text/plain; version=0.0.4")

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        need_ready()
        return {"object": "list", "data": [{
            "id": state.model_name, "object": "model", "created": state.created, "owned_by": "llmsys",
            "max_model_len": state.llm.max_model_len,
        }]}

    def kv_policy(req: Any) -> KVPolicy | None:
        """The request's ``kv_policy`` checked against this engine (400 naming the problem), or None."""
        if req.kv_policy is None:
            return None
        try:
            return state.llm.core.kv_policy.resolve(req.kv_policy)
        except LLMSysError as e:
            raise APIError(400, str(e), param="kv_policy", code="invalid_kv_policy") from None

    def check_prompt(ids: list[int], field: str, policy: KVPolicy | None) -> None:
        max_len = state.llm.max_model_len
        slides = (policy or state.llm.core.kv_policy.policy).allows_long_prompts  # the window slides in prefill
        if len(ids) >= max_len and not slides:
            raise APIError(
                400,
                f"this model's context holds {max_len} tokens but the prompt has {len(ids)}; "
                "shorten the prompt (or restart the server with a larger --max-model-len)",
                param=field, code="context_length_exceeded", n_prompt_tokens=len(ids), n_ctx=max_len,
            )
        if not ids:
            raise APIError(400, "the prompt is empty (it encodes to no tokens)", param=field)
        vocab = state.llm.loaded.args.vocab_size
        bad = next((t for t in ids if not 0 <= t < vocab), None)
        if bad is not None:
            raise APIError(400, f"prompt token id {bad} is outside the vocabulary (0..{vocab - 1})", param=field)

    def sampling(req: Any, max_tokens: int | None, logprobs: int | None, policy: KVPolicy | None) -> SamplingParams:
        try:
            return SamplingParams(
                max_tokens=max_tokens,
                temperature=1.0 if req.temperature is None else req.temperature,
                top_p=1.0 if req.top_p is None else req.top_p,
                top_k=req.top_k or 0,
                min_p=req.min_p or 0.0,
                repetition_penalty=req.repetition_penalty or 1.0,
                presence_penalty=req.presence_penalty,
                frequency_penalty=req.frequency_penalty,
                seed=req.seed,
                stop=stop_list(req.stop),
                ignore_eos=req.ignore_eos,
                logprobs=logprobs,
                min_tokens=req.min_tokens,
                n=req.n,
                kv_policy=policy,
            )
        except LLMSysError as e:
            raise APIError(400, str(e)) from None

    async def run(request: Request, req: Any, chat: bool, prompts: list[list[int]], params: SamplingParams,
                  logprobs: int | None):
        json_mode = req.response_format is not None and req.response_format.type == "json_object"
        if json_mode:
            from starlette.concurrency import run_in_threadpool

            await run_in_threadpool(state.json_vocab)  # first use builds the token trie
        resp_id = new_id("chatcmpl" if chat else "cmpl")
        job = Job(state, resp_id, prompts, params, json_mode)
        if req.stream:
            include_usage = bool(req.stream_options and req.stream_options.include_usage)
            return StreamingResponse(
                stream_events(job, state, resp_id, chat, include_usage, logprobs),
                media_type="text/event-stream",
                headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
            )
        try:
            results = await collect(job, request.is_disconnected)
        finally:
            job.abort_rest()
        choices = []
        for i, r in enumerate(results):
            lp = None
            if logprobs is not None:
                lp = chat_logprobs(state, r["lps"], logprobs) if chat else completion_logprobs(state, r["lps"], 0)[0]
            c: dict[str, Any] = {"index": i, "logprobs": lp, "finish_reason": r["finish"] or "abort"}
            details = finish_details(r["finish"], r["timings"], state.llm.max_model_len, job.evicts)
            if details is not None:
                c["finish_details"] = details
            if chat:
                c["message"] = {"role": "assistant", "content": r["text"]}
            else:
                c["text"] = r["text"]
            choices.append(c)
        return JSONResponse({
            "id": resp_id,
            "object": "chat.completion" if chat else "text_completion",
            "created": int(time.time()),
            "model": state.model_name,
            "choices": choices,
            "usage": job.usage(sum(r["n"] for r in results)),
            "timings": timings_dict([r["timings"] for r in results]),
        })

    @app.post("/v1/chat/completions")
    async def chat_completions(req: ChatCompletionRequest, request: Request):
        need_ready()
        tok = state.llm.tokenizer
        if tok.chat_template is None:
            raise APIError(400, f"model '{state.model_name}' has no chat template (it is a base model); "
                                "use /v1/completions with a plain prompt", param="messages", code="no_chat_template")
        messages = [{"role": m.role if m.role != "developer" else "system", "content": m.text()} for m in req.messages]
        ids = tok.encode_chat(messages)
        policy = kv_policy(req)
        check_prompt(ids, "messages", policy)
        top = None
        if req.logprobs:
            top = req.top_logprobs or 0
        max_tokens = req.max_completion_tokens or req.max_tokens
        return await run(request, req, True, [ids], sampling(req, max_tokens, top, policy), top)

    @app.post("/v1/completions")
    async def completions(req: CompletionRequest, request: Request):
        need_ready()
        p = req.prompt
        if isinstance(p, str):
            raw: list = [p]
        elif p and all(isinstance(x, int) for x in p):
            raw = [p]
        else:
            raw = list(p)
        if not raw:
            raise APIError(400, "'prompt' is an empty list", param="prompt")
        if len(raw) * req.n > 64:
            raise APIError(400, f"{len(raw)} prompts x n={req.n} is more than 64 completions per request", param="n")
        prompts = [state.llm.tokenizer.encode(x) if isinstance(x, str) else list(x) for x in raw]
        policy = kv_policy(req)
        for ids in prompts:
            check_prompt(ids, "prompt", policy)
        max_tokens = 16 if req.max_tokens is None else req.max_tokens
        return await run(request, req, False, prompts, sampling(req, max_tokens, req.logprobs, policy), req.logprobs)

    return app
