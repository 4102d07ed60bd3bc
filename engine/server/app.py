"""The FastAPI app: OpenAI-compatible routes, auth, limits, metrics.

Handlers only validate, enqueue and relay: tokenizing and chat-template
rendering run on the state's preparation thread, the model on the engine
thread (:mod:`llmsys.engine.server.worker`), so the event loop stays free for
every other stream and ``/health``. Every error leaves as an OpenAI-style
``{"error": {"message", "type", "param", "code"}}`` body.

It is safe on a desktop by default: only loopback names and IP literals are
accepted as ``Host`` (a web page cannot reach it through DNS rebinding), a
browser ``Origin`` other than the server's own is refused unless
``--cors-origin`` lists it, and with an API key the docs and schema need it too.
"""

from __future__ import annotations

import asyncio
import hmac
import ipaddress
import logging
import time
from contextlib import asynccontextmanager
from typing import Any
from urllib.parse import urlsplit

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from llmsys.kernels.common.errors import ContextOverflowError, LLMSysError, TokenizerError
from llmsys.engine.sampling import SamplingParams
from llmsys.offload.kv_policy import KVPolicy
from llmsys.engine.grammar import GrammarSpec
from llmsys.engine.server.completions import (
    BoundedStream,
    Job,
    Shape,
    grammar_constraints,
    chat_logprobs,
    collect,
    completion_logprobs,
    finish_details,
    new_id,
    stream_events,
    timings_dict,
)
from llmsys.engine.server.embeddings import check_dimensions, embedding_inputs, encode_vector, run_embeddings
from llmsys.engine.server.ollama import OLLAMA_ENDPOINTS, add_ollama_routes
from llmsys.engine.server.openapi import ServerAPI
from llmsys.engine.server import request_log
from llmsys.engine.server.prepare import Preparer
from llmsys.engine.server.protocol import (
    MAX_PROMPTS,
    APIError,
    ChatCompletionRequest,
    CompletionRequest,
    EmbeddingRequest,
    OffLoopRoute,
    stop_list,
    unsupported_field,
    validation_message,
)
from llmsys.engine.server.tools import ToolChoiceError, ToolPlan, chat_messages, plan_tools, template_messages
from llmsys.engine.server.models import available, bare
from llmsys.engine.server.state import ServerState

log = logging.getLogger("llmsys.server")

_ENDPOINTS = {"/v1/chat/completions", "/v1/completions", "/v1/embeddings", "/v1/models", "/health", "/metrics",
              *OLLAMA_ENDPOINTS}
_KEYED_DOCS = ("/docs", "/redoc", "/openapi.json")  # need the API key too when one is set


def host_allowed(host: str | None, allowed: tuple[str, ...]) -> bool:
    """Is ``host`` (a Host header, port included) a name this server answers to?

    Loopback names and IP literals always are (an IP literal cannot be rebound to
    another address); other names only when ``allowed`` lists them (``*``: any).
    A request without Host (HTTP/1.0 tools) is not a browser's and passes.
    """
    if host is None or "*" in allowed:
        return True
    name = host.strip().lower()
    if name.startswith("["):
        name = name[1:name.find("]")] if "]" in name else name[1:]
    elif name.count(":") == 1:
        name = name.rsplit(":", 1)[0]
    if name == "localhost" or name.endswith(".localhost"):
        return True
    try:
        ipaddress.ip_address(name)
        return True
    except ValueError:
        return name in {a.lower() for a in allowed}


def origin_allowed(origin: str | None, host: str | None, cors: tuple[str, ...]) -> bool:
    """A browser names the page that sends a request in ``Origin``; only the server's own
    pages (``/docs``) and the ``--cors-origin`` list may drive it. Non-browser clients send none."""
    if origin is None or "*" in cors or origin in cors:
        return True
    return host is not None and urlsplit(origin).netloc.lower() == host.strip().lower()


class GuardMiddleware:
    """Pure ASGI (so it sees the raw body stream): Host and Origin checks (403),
    request-size limit (413), body deadline (408), API key on ``/v1`` and the
    docs (401), and the per-endpoint request counter."""

    def __init__(self, app: Any, state: ServerState):
        self.app = app
        self.state = state

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        path = scope.get("path", "")
        endpoint = path if path in _ENDPOINTS else "other"
        status_box = {"status": 500}
        record, record_token = request_log.begin(scope)  # the request's log line, written when it ends
        models_token = self.state.begin_request()  # the models it uses stay loaded until it ends

        async def send_counted(msg: dict) -> None:
            if msg["type"] == "http.response.start":
                status_box["status"] = msg["status"]
            elif msg["type"] == "http.response.body":
                more = msg.get("more_body", False)
                record.stream = record.stream or more
                record.complete = not more
            await send(msg)

        try:
            err = self._check(scope)
            if err is not None:
                return await _send_error(send_counted, err)
            # Read the whole body first (it is small by construction): a body
            # over the limit is refused before any handler sees it, whether or
            # not the client sent Content-Length.
            limit = self.state.settings.max_body_bytes
            body, more = [], scope.get("method") in ("POST", "PUT", "PATCH", "DELETE")  # Ollama deletes with a body
            seen = 0
            stall = self.state.settings.body_timeout_s
            whole = self.state.settings.body_deadline_s
            deadline = time.monotonic() + whole
            while more:
                # A client that announces more than it sends, or trickles it, must not hold the
                # connection forever: each read has the stall limit, the whole body the deadline.
                left = deadline - time.monotonic()
                try:
                    msg = await asyncio.wait_for(receive(), max(0.0, min(stall, left)))
                except asyncio.TimeoutError:
                    if left <= stall:
                        limit, why = "body_deadline", (f"the request body did not arrive within {whole:g} s ({seen} "
                                                       "bytes came); send it faster (or raise the server's "
                                                       "--body-deadline)")
                    else:
                        limit, why = "body_stall", (f"the request body stalled: nothing arrived for {stall:g} s "
                                                    "(is Content-Length larger than the body?)")
                    self.state.metrics.count_limit(limit)
                    log.info("closed a slow request body from %s: %s", _client(scope), why)
                    return await _send_error(send_counted, APIError(
                        408, why, code="request_timeout", headers={"Connection": "close"}))
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
            used = self.state.end_request(models_token)
            record.model = record.model or used  # the model the request resolved to (state.use), never a default
            request_log.end(record, record_token, status_box["status"])

    def _check(self, scope: dict) -> APIError | None:
        headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope.get("headers", [])}
        settings = self.state.settings
        host = headers.get("host")
        if not host_allowed(host, settings.allowed_hosts):
            return APIError(403, f"Host {host!r} is not one this server answers to (a web page may be trying "
                                 "to reach it through DNS rebinding); to serve that name, restart with "
                                 f"--allowed-hosts {host.rsplit(':', 1)[0] if host else 'NAME'}",
                            type="permission_error", code="host_not_allowed")
        origin = headers.get("origin")
        if not origin_allowed(origin, host, settings.cors_origins):
            return APIError(403, f"requests from the web page at {origin!r} are refused; to let that page use "
                                 f"the API, restart with --cors-origin {origin}",
                            type="permission_error", code="origin_not_allowed")
        limit = settings.max_body_bytes
        length = headers.get("content-length")
        if length is not None and length.isdigit() and int(length) > limit:
            return _too_large(limit)
        key = settings.api_key
        path = scope.get("path", "")
        keyed = path.startswith(("/v1", "/api/")) or path in _KEYED_DOCS
        if key and keyed and scope.get("method") != "OPTIONS":  # CORS preflights carry no credentials
            auth = headers.get("authorization", "")
            given = auth[7:].strip() if auth.lower().startswith("bearer ") else ""
            if not given or not hmac.compare_digest(given.encode(), key.encode()):
                what = "missing" if not given else "incorrect"
                return APIError(401, f"{what} API key: send 'Authorization: Bearer <key>' with the server's --api-key",
                                code="invalid_api_key")
        return None


def _client(scope: dict) -> str:
    c = scope.get("client")
    return f"{c[0]}:{c[1]}" if c else "a client"


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
    code = "chat_template_error" if isinstance(e, TokenizerError) else None
    return APIError(400, str(e).splitlines()[0] if str(e) else type(e).__name__, code=code)


def create_app(state: ServerState) -> ServerAPI:
    @asynccontextmanager
    async def lifespan(app: FastAPI):
        yield
        state.close()  # after uvicorn drained in-flight requests: abort the rest, stop the thread

    app = ServerAPI(state, title="llmsys", version="0.1", description="OpenAI-compatible local LLM server",
                    lifespan=lifespan)
    app.router.route_class = OffLoopRoute  # large bodies are parsed on the preparation thread
    if state.settings.cors_origins:
        from starlette.middleware.cors import CORSMiddleware

        app.add_middleware(CORSMiddleware, allow_origins=list(state.settings.cors_origins),
                           allow_methods=["GET", "POST", "OPTIONS"], allow_headers=["*"])
    app.add_middleware(GuardMiddleware, state=state)  # outermost: Host, Origin, size and key first

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
        # The framework's own 404/405 (a 405 keeps its Allow header)
        return _error_response(APIError(e.status_code, str(e.detail), type="invalid_request_error",
                                        headers=dict(e.headers or {})))

    @app.exception_handler(Exception)
    async def _internal(request: Request, e: Exception) -> JSONResponse:
        log.exception("unhandled error")
        return _error_response(APIError(500, f"internal error: {e}", type="server_error"))

    prep = Preparer(state)
    need_ready = prep.need_ready

    @app.get("/health")
    async def health() -> JSONResponse:
        """200 only while the engine thread runs and its current step is younger than the stall limit.

        ``degraded`` lists the offload parts off after an I/O failure (the KV cold tier, the swap space;
        ``EngineCore.degraded``): the server still answers (200), slower or failing only the requests
        that need them, and each line says why and when it retries."""
        if not state.ready:
            body = {"status": "error", "reason": state.load_error} if state.load_error else {"status": "loading"}
            return JSONResponse(body, status_code=503)
        if state.worker is None:  # no model loaded (yet): requests load what they name
            return JSONResponse({"status": "ok", "models": 0}, status_code=200)
        h = state.worker.health()
        step = None if h.step_s is None else round(h.step_s, 3)
        body = {"status": "ok", "running": h.running, "queued": h.queued, "step_s": step,
                "loop_age_s": round(h.loop_age_s, 3), "degraded": state.worker.core.degraded()}
        stall = state.settings.stall_timeout_s
        if not h.alive:
            body.update(status="error", reason=f"the engine thread stopped ({h.fatal or 'exited'})")
        elif max(h.step_s or 0.0, h.loop_age_s) > stall:
            body.update(status="stuck", reason=f"one engine step has run for more than {stall:g} s")
        elif h.stopping:
            body.update(status="shutting_down")
        return JSONResponse(body, status_code=200 if body["status"] == "ok" else 503)

    @app.get("/metrics", response_class=PlainTextResponse)
    async def metrics() -> PlainTextResponse:
        return PlainTextResponse(state.metrics.render(), media_type="text/plain; version=0.0.4")

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        """What a request may name: the loaded models first, then those on disk (loaded on first use)."""
        need_ready()
        data = []
        for m in await asyncio.to_thread(available, state.models):
            slot = state.models.find(m.name) if m.loaded else None
            item = {"id": m.name, "object": "model", "created": int(m.modified), "owned_by": "llmsys",
                    "loaded": m.loaded}
            if slot is not None and slot.llm is not None:
                item["max_model_len"] = slot.llm.max_model_len
            data.append(item)
        return {"object": "list", "data": data}

    def sampling(req: Any, max_tokens: int | None, logprobs: int | None, policy: KVPolicy | None,
                 prediction: list[int] | None = None) -> SamplingParams:
        return prep.sampling(
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
            logit_bias={int(k): v for k, v in (req.logit_bias or {}).items()},
            prediction=tuple(prediction or ()),
            spec_tokens=req.spec_tokens,
        )

    def check_model(model: str | None) -> None:
        """The request's ``model`` must be one this server serves (its name, ``name:latest``,
        or a --model-alias); None means the served one."""
        slot = state.slot
        if model and (slot is None or not slot.answers_to(model)):
            raise APIError(404, f"the model '{model}' does not exist on this server; GET /v1/models lists "
                                "those it can load (--model-alias adds names)",
                           type="invalid_request_error", param="model", code="model_not_found")

    def check_common(req: Any) -> None:
        """What every generating request is refused for before any work (unsupported fields, model, logit_bias)."""
        err = unsupported_field(req)
        if err is not None:
            raise err
        check_model(req.model)
        ids = {k: v for k in ("user", "safety_identifier", "prompt_cache_key") if (v := getattr(req, k)) is not None}
        if ids:  # identifiers change no output; they are kept in the server's log, as their owners expect
            log.info("request identifiers: %s", ", ".join(f"{k}={v!r}" for k, v in ids.items()))
        if req.logit_bias:
            vocab = state.llm.loaded.args.vocab_size
            bad = next((k for k in req.logit_bias if int(k) >= vocab), None)
            if bad is not None:
                raise APIError(400, f"logit_bias names token id {bad}, outside the vocabulary (0..{vocab - 1})",
                               param="logit_bias", code="invalid_logit_bias")

    def response_grammar(req: Any) -> GrammarSpec | None:
        f = req.response_format
        if f is None or f.type == "text":
            return None
        if f.type == "json_object":
            return GrammarSpec.json()
        if f.type == "json_schema":
            return GrammarSpec.json(f.json_schema.schema_)
        if f.type == "regex":
            return GrammarSpec("regex", f.regex)
        return GrammarSpec(f.syntax, f.grammar)

    async def constraints(prompts: list[list[int]], params: SamplingParams, spec: GrammarSpec | None, field: str):
        if spec is not None and params.min_tokens:
            raise APIError(400, f"min_tokens cannot be combined with {field}: the format decides where the output "
                                "ends", param="min_tokens", code="conflicting_parameters")
        return await state.off_loop(grammar_constraints, state, prompts, params, spec, field)

    async def run(request: Request, req: Any, chat: bool, prompts: list[list[int]], params: SamplingParams,
                  logprobs: int | None, cons: list | None, tools: ToolPlan | None = None,
                  echo: list[str] | None = None):
        resp_id = new_id("chatcmpl" if chat else "cmpl")
        job = Job(state, resp_id, prompts, params, cons)
        shape = Shape(chat, tools, echo)
        if req.stream:
            include_usage = bool(req.stream_options and req.stream_options.include_usage)
            if not await job.start(request.is_disconnected):  # headers wait for the first news
                return JSONResponse({}, status_code=499)  # the client left; nobody reads this
            return BoundedStream(
                stream_events(job, state, resp_id, shape, include_usage, logprobs),
                state.settings.send_timeout_s,
                job.out.qsize,
                state.metrics,
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
            finish = r["finish"] or "abort"
            c: dict[str, Any] = {"index": i, "logprobs": lp, "finish_reason": finish}
            details = finish_details(r["finish"], r["timings"], state.llm.max_model_len, job.evicts)
            if details is not None:
                c["finish_details"] = details
            if chat:
                content, calls = shape.split(r["text"])
                c["message"] = {"role": "assistant", "content": content if content or not calls else None}
                if calls:
                    c["message"]["tool_calls"] = [call.openai() for call in calls]
                    c["finish_reason"] = "tool_calls"
            else:
                c["text"] = (echo[i // params.n] if echo else "") + r["text"]
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

    @app.get("/v1/models/{model_id:path}")
    async def model_info(model_id: str) -> dict[str, Any]:
        need_ready()
        slot = state.models.find(model_id)
        if slot is None:  # not loaded: listed ones answer without a load
            listed = {bare(m.name) for m in await asyncio.to_thread(available, state.models)}
            if bare(model_id) not in listed:
                check_model(model_id)
            return {"id": model_id, "object": "model", "created": state.created, "owned_by": "llmsys",
                    "loaded": False}
        return {"id": model_id, "object": "model", "created": state.created, "owned_by": "llmsys",
                "max_model_len": slot.llm.max_model_len, "loaded": True}

    @app.post("/v1/chat/completions")
    async def chat_completions(req: ChatCompletionRequest, request: Request):
        need_ready()
        await state.use(req.model)
        check_common(req)
        policy = prep.kv_policy(req.kv_policy)
        tools = [{"name": t.function.name, "description": t.function.description,
                  "parameters": t.function.parameters} for t in req.tools or []]
        plan = None
        if tools:
            choice = req.tool_choice or "auto"
            choice = choice if isinstance(choice, str) else choice.function.name
            vocab = await state.off_loop(state.grammar_vocab)
            tok = state.llm.tokenizer
            try:
                plan = plan_tools(tok.chat_template_source(tools=True), tools, choice, req.parallel_tool_calls,
                                  vocab.special_token)
            except ToolChoiceError as e:
                raise APIError(400, str(e), param=e.param, code="invalid_tools") from None
        elif req.tool_choice not in (None, "none", "auto"):
            raise APIError(400, "tool_choice asks for a tool call but the request has no tools", param="tool_choice",
                           code="invalid_tools")
        spec = response_grammar(req)
        if plan is not None and plan.grammar is not None and (spec is None or plan.grammar.free_text == "never"):
            if spec is not None:
                raise APIError(400, "response_format and a required or named tool_choice both decide the output's "
                                    "form; send one of them", param="response_format", code="conflicting_parameters")
            spec = plan.grammar
        template_tools = [{"type": "function", "function": {k: v for k, v in t.items() if v is not None}}
                          for t in tools] or None
        messages, template_tools = await state.off_loop(chat_messages, state.llm.tokenizer,  # tools in the template
                                                        template_messages(req.messages), template_tools,
                                                        req.parallel_tool_calls)  # or in the generic format
        ids = await state.off_loop(prep.chat_ids, messages, "messages", policy, template_tools)
        predicted = None
        if req.prediction is not None:  # tokenized on the preparation thread, as the prompt
            predicted = await state.off_loop(prep.encode_text, req.prediction.text, "prediction")
        top = None
        if req.logprobs:
            top = req.top_logprobs or 0
        max_tokens = req.max_completion_tokens or req.max_tokens
        params = sampling(req, max_tokens, top, policy, predicted)
        field = "response_format"
        if plan is not None and spec is not None and spec is plan.grammar:
            field = "tool_choice" if spec.free_text == "never" else "tools"
        cons = await constraints([ids], params, spec, field)
        return await run(request, req, True, [ids], params, top, cons, plan if plan and plan.fmt else None)

    @app.post("/v1/completions")
    async def completions(req: CompletionRequest, request: Request):
        need_ready()
        await state.use(req.model)
        check_common(req)
        if req.best_of is not None and req.best_of != req.n:
            raise APIError(400, f"best_of={req.best_of} with n={req.n}: this server returns every completion it "
                                "generates and does not rerank; ask for n completions instead",
                           param="best_of", code="unsupported_parameter")
        if req.echo and req.logprobs is not None:
            raise APIError(400, "echo with logprobs would need the prompt's logprobs, which this server does not "
                                "compute; drop one of them", param="echo", code="unsupported_parameter")
        p = req.prompt
        if isinstance(p, str):
            raw: list = [p]
        elif p and all(isinstance(x, int) for x in p):
            raw = [p]
        else:
            raw = list(p)
        if len(raw) * req.n > MAX_PROMPTS:
            raise APIError(400, f"{len(raw)} prompts x n={req.n} is more than {MAX_PROMPTS} completions per request",
                           param="n", code="too_many_choices")
        policy = prep.kv_policy(req.kv_policy)

        def prepare() -> list[list[int]]:
            prompts = []
            for x in raw:
                if isinstance(x, str):
                    prompts.append(prep.encode(x, "prompt", policy))
                else:
                    prep.check_prompt(list(x), "prompt", policy)
                    prompts.append(list(x))
            return prompts

        prompts = await state.off_loop(prepare)
        echo = None
        if req.echo:
            tok = state.llm.tokenizer
            echo = [x if isinstance(x, str) else tok.decode(x) for x in raw]
        max_tokens = 16 if req.max_tokens is None else req.max_tokens
        params = sampling(req, max_tokens, req.logprobs, policy)
        cons = await constraints(prompts, params, response_grammar(req), "response_format")
        return await run(request, req, False, prompts, params, req.logprobs, cons, echo=echo)

    @app.post("/v1/embeddings")
    async def embeddings(req: EmbeddingRequest, request: Request):
        """One vector per input, pooled as the model says (``LLM.pooling``); an input longer than the
        context is a 400 naming both lengths (``dimensions`` keeps the first values, normalized again)."""
        need_ready()
        await state.use(req.model)
        check_model(req.model)
        if req.user is not None:
            log.info("request identifiers: user=%r", req.user)
        check_dimensions(state, req.dimensions)
        x = req.input
        raw: list = [x] if isinstance(x, str) or (x and isinstance(x[0], int)) else list(x)
        prompts = await state.off_loop(embedding_inputs, prep, raw, "input", False)
        out = await run_embeddings(state, prompts, None, req.dimensions, request.is_disconnected)
        if out is None:
            return JSONResponse({}, status_code=499)  # the client left; nobody reads this
        return JSONResponse({
            "object": "list",
            "data": [{"object": "embedding", "index": i, "embedding": encode_vector(v, req.encoding_format)}
                     for i, v in enumerate(out.vectors)],
            "model": state.model_name,
            "usage": {"prompt_tokens": out.prompt_tokens, "total_tokens": out.prompt_tokens},
        })

    add_ollama_routes(app, state, prep)  # Ollama's API (/api/...) on the same engine
    return app
