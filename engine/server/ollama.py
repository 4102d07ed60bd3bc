"""Ollama's API (``/api/...``) beside the OpenAI one, so the ``ollama`` client and the apps on it work.

Chat and generate (NDJSON streams; ``"stream": false``: one object), tags, show, ps, version and ``/``;
embeddings (``/api/embed``, the legacy ``/api/embeddings``: engine/server/embeddings.py); model management
loads models on demand (engine/server/models.py: keep_alive, ``/api/ps``, ``/api/pull``, ``/api/delete``;
push, create and copy answer 501). Requests share ``/v1``'s :class:`Preparer` and :class:`Job`
(both APIs batch together); only the wire differs: errors are ``{"error": ...}`` (``"code"`` for
:data:`SEMANTIC_CODES`; the guard middleware's 401/403/408/413 keep OpenAI's shape), a body is JSON
whatever its ``Content-Type``, and sampling defaults are Ollama's (temperature 0.8, top_k 40, top_p 0.9)
unless ``generation_config.json`` samples. Every option and field is honoured or refused with a 400
naming it (``unsupported_parameter``), never ignored: the table is docs/usage.md's "Ollama API". Beyond
it: ``num_predict`` -1 / 0 runs until EOS or a full context (EOS only under a sliding ``--kv-policy``),
``num_ctx`` bounds the request, ``repeat_penalty`` covers prompt + output, and an empty prompt or no
messages is Ollama's load ping (``done_reason`` "load").
"""

from __future__ import annotations

import asyncio
import functools
import hashlib
import json
import logging
import math
import time
from collections.abc import AsyncIterator, Callable
from datetime import datetime, timezone
from typing import Annotated, Any, ClassVar, Literal

import torch
from fastapi import APIRouter, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from pydantic import BaseModel, ConfigDict, Field, model_validator
from starlette.exceptions import HTTPException as StarletteHTTPException

from llmsys.engine.outputs import StreamChunk, Timings
from llmsys.engine.sampling import MAX_LOGPROBS, SamplingParams
from llmsys.engine.grammar import GrammarSpec
from llmsys.engine.server.completions import BoundedStream, Job, ending_error, grammar_constraints, new_id
from llmsys.engine.server.tools import ToolCall, ToolChoiceError, ToolPlan, ToolStream, chat_messages, plan_tools
from llmsys.engine.server.embeddings import Embedded, check_dimensions, embedding_inputs, run_embeddings
from llmsys.engine.server.prepare import Preparer
from llmsys.engine.server.protocol import (
    MAX_EMBEDDING_INPUTS,
    MAX_MESSAGES,
    MAX_TOOLS,
    SEED_MAX,
    SEED_MIN,
    APIError,
    OffLoopRoute,
    Tool,
    sampling_field,
    redact_paths,
    sampling_check,
    validation_message,
)
from llmsys.engine.server.models import available, bare, parse_keep_alive, weights_on_disk
from llmsys.engine.server.state import ServerState
from llmsys.kernels.common.errors import ContextOverflowError, LLMSysError, TokenizerError

log = logging.getLogger("llmsys.server")

# The Ollama release whose request and response fields this module follows; clients gate
# features on /api/version (logprobs on /api/chat and /api/generate arrived in 0.12).
OLLAMA_VERSION = "0.12.0"
# Every path this module serves (the request counter in app.py labels them by path).
OLLAMA_ENDPOINTS = ("/", "/api/chat", "/api/generate", "/api/tags", "/api/show", "/api/ps", "/api/version",
                    "/api/embed", "/api/embeddings", "/api/pull", "/api/push", "/api/create", "/api/copy",
                    "/api/delete")
# Ollama's sampling defaults, used where the checkpoint's generation_config.json has none.
OLLAMA_DEFAULTS = {"temperature": 0.8, "top_k": 40, "top_p": 0.9, "min_p": 0.0, "repeat_penalty": 1.0}
EXPIRES_NEVER = "2318-01-01T00:00:00Z"  # /api/ps: the model stays loaded (Ollama's "forever" is this far out)
MAX_STOP = 16
NDJSON = "application/x-ndjson"


# -- request models ------------------------------------------------------------------
# Strict like protocol.py's (a "10" for an integer is a 400, as the schema says), with
# integral floats taken as ints (JSON Schema's integer includes 1.0).


def _integral(v: Any) -> Any:
    if type(v) is float and v.is_integer():
        return int(v)
    if type(v) is list:
        return [_integral(x) for x in v]
    return v


class _Model(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)
    INT_FIELDS: ClassVar[tuple[str, ...]] = ()

    @model_validator(mode="before")
    @classmethod
    def _integral_ints(cls, data: Any) -> Any:
        if isinstance(data, dict) and cls.INT_FIELDS:
            return {k: _integral(v) if k in cls.INT_FIELDS else v for k, v in data.items()}
        return data


# Request fields that hold sampling knobs: the engine's one check (engine.sampling.SAMPLING_LIMITS).
_TopK = sampling_field("top_k", int | None)
_MinP = sampling_field("min_p", float | None)
_Temperature = sampling_field("temperature", float | None)
_RepeatPenalty = sampling_field("repeat_penalty", float | None, "repetition_penalty")
_PresencePenalty = sampling_field("presence_penalty", float | None)
_FrequencyPenalty = sampling_field("frequency_penalty", float | None)


class OllamaOptions(_Model):
    """Ollama's ``options`` (Modelfile parameters). An option Ollama does not know is a 400,
    as is a value llmsys cannot honour (the table: docs/usage.md, "Ollama API")."""

    model_config = ConfigDict(extra="forbid", strict=True)
    INT_FIELDS: ClassVar[tuple[str, ...]] = ("num_ctx", "num_batch", "num_gpu", "main_gpu", "num_thread", "num_keep",
                                             "seed", "num_predict", "top_k", "repeat_last_n", "mirostat")

    # load-time settings
    numa: bool | None = None
    num_ctx: int | None = Field(None, ge=1, le=2**31 - 1)
    num_batch: int | None = Field(None, ge=1, le=2**31 - 1)
    num_gpu: int | None = Field(None, ge=-1, le=2**31 - 1)
    main_gpu: int | None = Field(None, ge=0, le=2**31 - 1)
    low_vram: bool | None = None
    f16_kv: bool | None = None
    logits_all: bool | None = None
    vocab_only: bool | None = None
    use_mmap: bool | None = None
    use_mlock: bool | None = None
    embedding_only: bool | None = None
    num_thread: int | None = Field(None, ge=0, le=2**31 - 1)
    # runtime
    num_keep: int | None = Field(None, ge=-1, le=2**31 - 1)
    seed: int | None = Field(None, ge=SEED_MIN, le=SEED_MAX)
    num_predict: int | None = Field(None, ge=-2, le=SEED_MAX)
    top_k: _TopK = None
    # 0 is llama.cpp's "the most likely token" (sent to the engine as top_k 1), else the engine's range
    top_p: Annotated[float | None, sampling_check("top_p", allow=(0.0,)),
                     Field(json_schema_extra={"minimum": 0.0, "maximum": 1.0})] = None
    min_p: _MinP = None
    typical_p: float | None = Field(None, ge=0.0, le=1.0)
    tfs_z: float | None = Field(None, ge=0.0, allow_inf_nan=False)
    repeat_last_n: int | None = Field(None, ge=-1, le=2**31 - 1)
    temperature: _Temperature = None
    repeat_penalty: _RepeatPenalty = None
    presence_penalty: _PresencePenalty = None
    frequency_penalty: _FrequencyPenalty = None
    mirostat: int | None = Field(None, ge=0, le=2)
    mirostat_tau: float | None = Field(None, allow_inf_nan=False)  # used by mirostat only: any value with it off
    mirostat_eta: float | None = Field(None, allow_inf_nan=False)
    penalize_newline: bool | None = None
    stop: list[Annotated[str, Field(min_length=1)]] | None = Field(None, max_length=MAX_STOP)
    # llmsys extension: Ollama's API has no tool_choice, and its clients pass options through as given
    tool_choice: str | None = Field(None, min_length=1, max_length=256, description=(
        "llmsys extension: none, auto (Ollama's behaviour, the default), required, or a function's name (that call)"))


class OllamaFunctionCall(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)
    name: str = Field(..., max_length=256)
    arguments: dict[str, Any] = Field(default_factory=dict)


class OllamaToolCall(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)
    function: OllamaFunctionCall


class OllamaMessage(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)
    role: Literal["system", "user", "assistant", "tool"]
    content: str | None = None
    images: list[str] | None = Field(None, description="only empty: the served models are text-only")
    thinking: str | None = None
    tool_calls: list[OllamaToolCall] | None = None
    tool_name: str | None = Field(None, max_length=256)


# Go's durations ("5m", "1h30m": a unit on every part), or a bare number of seconds, either signed
_KEEP_ALIVE = r"^-?(([0-9]+(\.[0-9]+)?(ns|us|µs|ms|s|m|h))+|[0-9]+(\.[0-9]+)?)$"
# The one keep_alive field of every request that names a model (Ollama's semantics).
_KeepAlive = Annotated[
    float | Annotated[str, Field(max_length=64, pattern=_KEEP_ALIVE)] | None,
    Field(description="how long the model stays loaded after this request: a duration ('5m'), seconds, "
                      "0 unloads it after the request, negative keeps it"),
]
# format: "" (none), "json", or a JSON schema; tools: Ollama's function tools (OpenAI's shape).
_Format = Literal["", "json"] | dict[str, Any] | None


class _Generating(_Model):
    model: str = Field(..., min_length=1, max_length=512)
    stream: bool | None = Field(None, description="default true: NDJSON, one object per line")
    options: OllamaOptions | None = None
    format: _Format = Field(None, description="\"json\" (any JSON object) or a JSON schema the output matches")
    keep_alive: _KeepAlive = None
    think: bool | Literal["low", "medium", "high"] | None = Field(
        None, description="only false: no separate thinking output")
    logprobs: bool | None = None
    top_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)


class OllamaChatRequest(_Generating):
    INT_FIELDS: ClassVar[tuple[str, ...]] = ("top_logprobs",)
    messages: list[OllamaMessage] = Field(default_factory=list, max_length=MAX_MESSAGES, description="none: load the model, answer done")
    tools: list[Tool] | None = Field(None, max_length=MAX_TOOLS, description="functions the model may call "
                                     "(as tool_choice auto: calls parsed out of its output)")


class OllamaGenerateRequest(_Generating):
    INT_FIELDS: ClassVar[tuple[str, ...]] = ("top_logprobs", "context")
    prompt: str | None = Field(None, description="empty: load the model, answer done")
    suffix: str | None = Field(None, description="only empty: no fill-in-the-middle")
    system: str | None = None
    template: str | None = Field(None, description="only empty: the model's own chat template is used")
    context: list[Annotated[int, Field(ge=0)]] | None = Field(None, description="the context a previous response "
                                                                                "returned: the prompt's prefix")
    raw: bool | None = None
    images: list[str] | None = Field(None, description="only empty: the served models are text-only")


class OllamaEmbedRequest(_Model):
    """``/api/embed``: one vector per input, normalized; ``truncate`` (default true) cuts an input to the context."""

    INT_FIELDS: ClassVar[tuple[str, ...]] = ("dimensions",)
    model: str = Field(..., min_length=1, max_length=512)
    input: str | Annotated[list[str], Field(max_length=MAX_EMBEDDING_INPUTS)] = Field(
        "", description="empty: load the model, answer no embeddings")
    truncate: bool = Field(True, description="false: an input longer than the context is a 400")
    dimensions: int | None = Field(None, ge=1, description="keep the first that many values, normalized again")
    options: OllamaOptions | None = None
    keep_alive: _KeepAlive = None


class OllamaEmbeddingsRequest(_Model):
    """The legacy ``/api/embeddings``: one prompt, its vector not normalized (as Ollama)."""

    model: str = Field(..., min_length=1, max_length=512)
    prompt: str = Field("", description="empty: load the model, answer an empty embedding")
    options: OllamaOptions | None = None
    keep_alive: _KeepAlive = None


class OllamaShowRequest(_Model):
    model: str = Field(..., min_length=1, max_length=512)
    verbose: bool | None = None

    @model_validator(mode="before")
    @classmethod
    def _legacy_name(cls, data: Any) -> Any:
        if isinstance(data, dict) and "model" not in data and isinstance(data.get("name"), str):
            return {**data, "model": data["name"]}  # older clients send "name"
        return data


class OllamaPullRequest(OllamaShowRequest):
    """``/api/pull``: a catalog name or alias, or ``org/repo[@revision]``."""

    stream: bool | None = Field(None, description="default true: one progress object per line")
    insecure: bool | None = Field(None, description="accepted; downloads use the Hub's HTTPS endpoint")


# -- errors, in Ollama's shape -----------------------------------------------------------

_ERROR_SCHEMA = {
    "type": "object",
    "required": ["error"],
    "properties": {
        # Ollama's shape is a string; the guard middleware's 401/403/408/413 keep the OpenAI object.
        "error": {"anyOf": [{"type": "string"}, {"type": "object"}]},
        "code": {"type": "string", "description": "on a 400 that is a limit of the loaded model (SEMANTIC_CODES)"},
    },
}
_WHY = {
    400: "the body breaks the schema, or (with a code) a limit of the loaded model or an option it cannot honour",
    401: "missing or wrong API key (servers started with one)",
    403: "a Host or browser Origin this server does not serve",
    404: "no such model: not on disk, in the catalog or the Ollama store (pull it first)",
    408: "the request body did not arrive in time",
    413: "the body is larger than --max-body",
    429: "every running and queued place is taken; retry after Retry-After",
    503: "the model is loading, the server is shutting down, or the engine thread stopped",
}


def _responses(*statuses: int, generating: bool = False) -> dict[int | str, dict[str, Any]]:
    out: dict[int | str, dict[str, Any]] = {
        st: {"description": _WHY[st], "content": {"application/json": {"schema": _ERROR_SCHEMA}}} for st in statuses}
    if generating:
        out[200] = {"description": "NDJSON (one object per line, the last with done: true) unless stream is false",
                    "content": {NDJSON: {"schema": {}}, "application/json": {"schema": {}}}}
    return out


def _error(status: int, message: str, code: str | None = None, headers: dict[str, str] | None = None) -> JSONResponse:
    body: dict[str, Any] = {"error": redact_paths(message)}
    if code is not None:
        body["code"] = code
    return JSONResponse(body, status_code=status, headers=headers)


def _validation_error(e: RequestValidationError) -> JSONResponse:
    errors = list(e.errors())
    first = errors[0] if errors else {}
    loc = [str(x) for x in first.get("loc", ()) if x != "body"]
    if first.get("type") == "extra_forbidden" and len(loc) == 2 and loc[0] == "options":
        return _error(400, f"unknown option '{loc[1]}': Ollama has no such option (see /docs for the options "
                           "llmsys implements)")
    return _error(400, validation_message(errors)[0])


def _as_error(e: Exception) -> JSONResponse:
    if isinstance(e, APIError):
        return _error(e.status, e.message, e.code, e.headers)
    if isinstance(e, RequestValidationError):
        return _validation_error(e)
    if isinstance(e, ContextOverflowError):
        return _error(400, str(e), "context_length_exceeded")
    if isinstance(e, LLMSysError):
        msg = str(e).splitlines()[0] if str(e) else type(e).__name__
        return _error(400, msg, "chat_template_error" if isinstance(e, TokenizerError) else None)
    if isinstance(e, StarletteHTTPException):
        return _error(e.status_code, str(e.detail), headers=dict(e.headers or {}))
    log.exception("unhandled error in an Ollama route")
    return _error(500, f"internal error: {e}")


def _is_json(content_type: str | None) -> bool:
    media = (content_type or "").split(";")[0].strip().lower()
    return media == "application/json" or (media.startswith("application/") and media.endswith("+json"))


class _OllamaRoute(OffLoopRoute):
    """Every error of an /api route leaves in Ollama's shape, and a POST body is JSON whatever
    its Content-Type (see the module docstring)."""

    def get_route_handler(self) -> Callable[[Request], Any]:
        handler = super().get_route_handler()

        async def route(request: Request) -> Response:
            if request.method == "POST" and not _is_json(request.headers.get("content-type")):
                headers = [(k, v) for k, v in request.scope["headers"] if k.lower() != b"content-type"]
                request = Request({**request.scope, "headers": headers + [(b"content-type", b"application/json")]},
                                  request.receive)
            try:
                return await handler(request)
            except Exception as e:  # noqa: BLE001 -- every error is answered in Ollama's shape
                return _as_error(e)

        return route


def _unsupported(field: str, why: str) -> APIError:
    return APIError(400, f"'{field}' is not supported by this server: {why}", param=field,
                    code="unsupported_parameter")


def _format_grammar(fmt: Any) -> GrammarSpec | None:
    """Ollama's ``format``: "json" (any JSON object) or a JSON schema, through the same grammar
    machinery as ``response_format`` (llmsys.engine.grammar)."""
    if not fmt:
        return None
    return GrammarSpec.json() if fmt == "json" else GrammarSpec.json(fmt)


# -- the loaded model, as Ollama describes one ---------------------------------------------


def _now() -> str:
    return datetime.now(timezone.utc).isoformat().replace("+00:00", "Z")


def _param_count(a: Any) -> int:
    """Parameters of the architecture (from its shape, whatever the weights' storage)."""
    hd, h, kv = a.head_dim, a.hidden_size, a.num_key_value_heads
    attn = h * a.num_attention_heads * hd * 2 + h * kv * hd * 2
    if a.attention_bias:
        attn += (a.num_attention_heads + 2 * kv) * hd
    if a.qk_norm:
        attn += 2 * hd
    layer = attn + 3 * h * a.intermediate_size + 2 * h
    embed = a.vocab_size * h
    return embed * (1 if a.tie_word_embeddings else 2) + a.num_hidden_layers * layer + h


def _human(n: int) -> str:
    """Ollama's parameter_size style: 8.0B, 494.03M, 260K."""
    if n >= 1e9:
        return f"{n / 1e9:.1f}B"
    if n >= 1e6:
        return f"{n / 1e6:.2f}M"
    return f"{round(n / 1e3)}K"


def _quant_level(llm: Any) -> str:
    """What the weights are stored as: --quant's name, a GGUF's main block format, else the dtype."""
    q = llm.config.quant
    if q.method != "none":
        return q.name
    formats = llm.loaded.stored_formats  # {"Q4_0 (168)": "...", "Q8_0 (1)": "..."}
    if formats:
        def count(k: str) -> int:
            tail = k.rsplit("(", 1)[-1].rstrip(")")
            return int(tail) if tail.isdigit() else 0
        return max(formats, key=count).split(" (")[0]
    names = {"torch.float32": "F32", "torch.float16": "F16", "torch.bfloat16": "BF16"}
    return names.get(str(llm.loaded.dtype), str(llm.loaded.dtype).replace("torch.", "").upper())


def _model_format(path: Any) -> str:
    from llmsys.engine.loader.detect import ModelFormat, detect_model

    fmt = detect_model(path).format
    return "safetensors" if fmt is ModelFormat.HF else fmt.value


def _defaults(generation_config: dict[str, Any]) -> dict[str, float]:
    """Sampling defaults: the checkpoint's generation_config.json when it samples, else Ollama's."""
    d = dict(OLLAMA_DEFAULTS)
    g = generation_config or {}
    if g.get("do_sample") is True:
        for ours, theirs in (("temperature", "temperature"), ("top_k", "top_k"), ("top_p", "top_p"),
                             ("min_p", "min_p"), ("repeat_penalty", "repetition_penalty")):
            v = g.get(theirs)
            if isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v):
                d[ours] = v
    return d


def _lp(v: float) -> float:
    return v if math.isfinite(v) else -9999.0  # JSON has no -inf (a token a constraint forbids)


def _penalised(rep: float, presence: float, frequency: float) -> bool:
    return rep != 1.0 or presence != 0.0 or frequency != 0.0


# -- the routes ------------------------------------------------------------------------------


class _Ollama:
    """The handlers' shared work, for one server's state."""

    def __init__(self, state: ServerState, prep: Preparer):
        self.state = state
        self.prep = prep
        self._facts: dict[str, Any] | None = None
        self._defaults: dict[str, float] | None = None

    # -- names and model facts
    @staticmethod
    def _bare(name: str) -> str:
        name = name.removeprefix("ollama:")  # a model served from Ollama's store keeps its Ollama name
        return name.removesuffix(":latest")

    def display_name(self) -> str:
        bare = self._bare(self.state.model_name)
        return bare if ":" in bare else f"{bare}:latest"

    def check_model(self, name: str) -> None:
        """The served model answers to its name, its --model-alias names, each with ``:latest``
        or without; any other is a 404."""
        slot = self.state.slot
        if slot is None or not slot.answers_to(name):
            raise APIError(404, f"model '{name}' not found (GET /api/tags lists those this server can load)",
                           code="model_not_found")

    def facts(self) -> dict[str, Any]:
        """What /api/show and /api/ps say about the request's model (computed once per model: it reads files)."""
        return self.state.per_model("ollama_facts", self._facts_now)

    def _facts_now(self) -> dict[str, Any]:
        if True:
            state = self.state
            llm = state.llm
            ld = llm.loaded
            path = ld.path
            try:
                mtime = path.stat().st_mtime
            except OSError:
                mtime = state.created
            return {
                "modified_at": datetime.fromtimestamp(mtime, timezone.utc).isoformat().replace("+00:00", "Z"),
                "digest": hashlib.sha256(f"{path.resolve()}\n{state.model_name}".encode()).hexdigest(),
                "n_params": _param_count(ld.args),
                "details": {"parent_model": "", "format": _model_format(path), "family": ld.family,
                            "families": [ld.family], "parameter_size": _human(_param_count(ld.args)),
                            "quantization_level": _quant_level(llm)},
            }

    def defaults(self) -> dict[str, float]:
        llm = self.state.llm
        return self.state.per_model("ollama_defaults", lambda: _defaults(llm.loaded.generation_config))

    def sizes(self) -> tuple[int, int, int]:
        """(weight bytes, resident bytes, bytes on the GPU): ``MemoryReport.resident`` (weights, the KV
        pool's pages backed by memory, buffers; not its untouched reservation) from the engine
        thread's last memory report (/metrics' snapshot), or one taken now before the first."""
        worker = self.state.worker
        snap = worker.last_report if worker is not None else None  # this model's engine thread's last report
        w, res = (snap.weights, snap.resident) if snap is not None and snap.weights else (None, None)
        if w is None:
            rep = self.state.llm.core.memory_report()
            w, res = rep.weights, rep.resident
        return sum(w.values()), sum(res.values()), res.get("gpu", 0)

    # -- the request checks
    def begin(self, req: OllamaChatRequest | OllamaGenerateRequest) -> None:
        """Readiness, the model name, and the fields and options llmsys cannot honour."""
        self.prep.need_ready()
        self.check_model(req.model)
        if req.think not in (None, False):
            raise _unsupported("think", "the served model has no separate thinking output here; omit think or "
                                        "send false")
        if req.options is not None:
            self.check_options(req.options)
            if not isinstance(req, OllamaChatRequest) and req.options.tool_choice not in (None, "auto", "none"):
                raise APIError(400, "options.tool_choice asks for a tool call but only /api/chat takes tools",
                               param="options.tool_choice", code="invalid_tools")

    def check_options(self, o: OllamaOptions) -> None:
        llm = self.state.llm
        max_len = llm.max_model_len
        if o.num_ctx is not None and o.num_ctx > max_len:
            raise _unsupported("options.num_ctx", f"{o.num_ctx} is more than this server's context of {max_len} "
                                                  f"tokens; send at most {max_len} (or restart the server with a "
                                                  "larger --max-model-len, up to the model's limit)")
        only_false = {
            "numa": "NUMA placement is not a setting here",
            "low_vram": "there is no low-VRAM mode; the placement is set when the server starts (--gpu-mem)",
            "logits_all": "only the sampled positions' logits are computed",
            "vocab_only": "the server loads the whole model",
            "embedding_only": "the model is loaded for generation and embeddings both",
            "use_mlock": "the weights are not mlock()ed",
            "use_mmap": "the weights are read into memory llmsys owns, not memory-mapped",
        }
        for name, why in only_false.items():
            if getattr(o, name):
                raise _unsupported(f"options.{name}", f"{why}; send false or omit it")
        device = llm.loaded.device
        kv16 = llm.core.kv.spec.dtype in (torch.float16, torch.bfloat16)
        if o.f16_kv is not None and o.f16_kv != kv16:
            raise _unsupported("options.f16_kv", f"the KV cache is {str(llm.core.kv.spec.dtype).replace('torch.', '')} "
                                                 f"(set when the server starts: --kv-dtype); send {str(kv16).lower()} "
                                                 "or omit it")
        n_layers = llm.loaded.args.num_hidden_layers
        if o.num_gpu is not None and o.num_gpu != -1:
            if device.type != "cuda":
                ok, loaded = o.num_gpu == 0, "0 (the model runs on the CPU)"
            elif llm.offload is not None:
                ok, loaded = False, "a placement planned when the server started (--gpu-mem)"
            else:
                ok, loaded = o.num_gpu >= n_layers, f"all {n_layers} layers"
            if not ok:
                raise _unsupported("options.num_gpu", f"the layers on the GPU are {loaded}; send that, -1 or "
                                                      "omit it")
        if o.main_gpu is not None and o.main_gpu != (device.index or 0):
            raise _unsupported("options.main_gpu", f"the model is on {device}; send {device.index or 0} or omit it")
        threads = llm.threads.threads
        if o.num_thread is not None and o.num_thread not in (0, threads):
            raise _unsupported("options.num_thread", f"the engine runs {threads} threads (--threads when the server "
                                                     f"starts); send {threads}, 0 or omit it")
        batch = llm.config.max_num_batched_tokens
        if o.num_batch is not None and o.num_batch != batch:
            raise _unsupported("options.num_batch", f"the engine takes {batch} tokens per step (--max-batched-tokens "
                                                    f"when the server starts); send {batch} or omit it")
        for name, off in (("typical_p", 1.0), ("tfs_z", 1.0), ("mirostat", 0)):
            v = getattr(o, name)
            if v is not None and v != off:
                raise _unsupported(f"options.{name}", f"this sampler is not implemented; send {off} (off) or omit it "
                                                      "(top_p, top_k and min_p are)")
        if o.num_keep is not None and llm.core.kv_policy.resolve(None).evicts:
            raise _unsupported("options.num_keep", "the server's --kv-policy evicts by its own rule (sink:N keeps "
                                                   "the first N tokens); omit num_keep")
        d = self.defaults()
        rep = d["repeat_penalty"] if o.repeat_penalty is None else o.repeat_penalty
        on = _penalised(rep, o.presence_penalty or 0.0, o.frequency_penalty or 0.0)
        n = o.repeat_last_n
        if on and n is not None and n not in (-1, 0) and n < max_len:
            raise _unsupported("options.repeat_last_n", f"the penalties cover the whole context, not the last {n} "
                                                        "tokens; send -1 (the whole context), 0 (penalties off) or "
                                                        "omit it")
        if on and n != 0 and o.penalize_newline is False:
            raise _unsupported("options.penalize_newline", "a newline is penalised like any token; send true or "
                                                           "omit it")

    def sampling(self, o: OllamaOptions | None, n_prompt: int, top: int | None) -> SamplingParams:
        o = o or OllamaOptions()
        d = self.defaults()

        def pick(v: Any, name: str) -> Any:
            return d[name] if v is None else v

        top_k, top_p = pick(o.top_k, "top_k"), pick(o.top_p, "top_p")
        if top_p == 0:
            top_k, top_p = 1, 1.0  # llama.cpp's top_p 0 keeps one token: the most likely
        rep = pick(o.repeat_penalty, "repeat_penalty")
        presence, frequency = o.presence_penalty or 0.0, o.frequency_penalty or 0.0
        if o.repeat_last_n == 0:  # llama.cpp: 0 turns the penalties off
            rep, presence, frequency = 1.0, 0.0, 0.0
        return self.prep.sampling(
            max_tokens=self.max_tokens(o, n_prompt),
            temperature=pick(o.temperature, "temperature"),
            top_p=top_p,
            top_k=int(top_k),
            min_p=pick(o.min_p, "min_p"),
            repetition_penalty=rep,
            presence_penalty=presence,
            frequency_penalty=frequency,
            seed=None if o.seed in (None, -1) else o.seed,
            stop=tuple(o.stop or ()),
            logprobs=top,
        )

    def max_tokens(self, o: OllamaOptions, n_prompt: int) -> int | None:
        """num_predict under num_ctx (see the module docstring)."""
        if o.num_ctx is not None and n_prompt >= o.num_ctx:
            raise APIError(400, f"the prompt has {n_prompt} tokens but options.num_ctx is {o.num_ctx}; shorten "
                                "the prompt or raise num_ctx", param="options.num_ctx", code="context_length_exceeded",
                           n_prompt_tokens=n_prompt, n_ctx=o.num_ctx)
        room = (o.num_ctx or self.state.llm.max_model_len) - n_prompt
        n = o.num_predict
        if n is None or n in (0, -1):
            return room if o.num_ctx is not None else None
        if n == -2:
            return room if room >= 1 else None
        return n if o.num_ctx is None else min(n, room)

    # -- prompts (CPU work: run through state.off_loop)
    def chat_ids(self, req: OllamaChatRequest) -> list[int]:
        messages = []
        for m in req.messages:
            d: dict[str, Any] = {"role": m.role, "content": m.content or ""}
            if m.thinking:
                d["thinking"] = m.thinking
            if m.tool_calls:
                d["tool_calls"] = [{"type": "function", "function": {"name": c.function.name,
                                                                     "arguments": c.function.arguments}}
                                   for c in m.tool_calls]
            if m.tool_name:
                d["name"] = m.tool_name
            messages.append(d)
        tools = [t.model_dump(exclude_none=True) for t in req.tools or []] or None
        messages, tools = chat_messages(self.state.llm.tokenizer, messages, tools, True)  # or the generic format
        return self.prep.chat_ids(messages, "messages", None, tools)

    def generate_ids(self, req: OllamaGenerateRequest) -> list[int]:
        """The prompt wrapped in the chat template (with ``system``) unless ``raw`` or the model
        has none, after ``context`` (the ids a previous response returned)."""
        tok = self.state.llm.tokenizer
        ctx = list(req.context or [])
        prompt = req.prompt or ""
        if req.raw or tok.chat_template is None:
            if req.system:
                raise APIError(400, f"model '{self.state.model_name}' has no chat template to put 'system' in; "
                                    "write it into the prompt", param="system", code="no_chat_template")
            ids = self.prep.encode(prompt, "prompt", None, add_special_tokens=not ctx)
        else:
            messages = ([{"role": "system", "content": req.system}] if req.system else []) + [
                {"role": "user", "content": prompt}]
            ids = self.prep.chat_ids(messages, "prompt", None)
            if ctx and ids and ids[0] == tok.bos_token_id:
                ids = ids[1:]  # the template's BOS begins the context already
        if ctx:
            ids = ctx + ids
            self.prep.check_prompt(ids, "context", None)
        return ids

    # -- responses
    def logprobs(self, lps: list, top: int) -> list[dict[str, Any]]:
        def entry(tid: int, v: float) -> dict[str, Any]:
            s = self.state.token_text(tid)
            return {"token": s, "logprob": _lp(v), "bytes": list(s.encode("utf-8"))}

        return [{**entry(lp.token_id, lp.logprob), "top_logprobs": [entry(t, v) for t, v in lp.top[:top]]}
                for lp in lps]

    @staticmethod
    def head(req: Any, chat: bool, text: str, done: bool, calls: list[ToolCall] | None = None) -> dict[str, Any]:
        d: dict[str, Any] = {"model": req.model, "created_at": _now()}
        if chat:
            d["message"] = {"role": "assistant", "content": text}
            if calls:  # Ollama's shape: arguments as an object, no ids
                d["message"]["tool_calls"] = [{"function": {"name": c.name, "arguments": json.loads(c.arguments)}}
                                              for c in calls]
        else:
            d["response"] = text
        d["done"] = done
        return d

    def final(self, req: Any, chat: bool, text: str, ch: StreamChunk | None, ids: list[int], gen: list[int],
              t0: float, context: bool) -> dict[str, Any]:
        d = self.head(req, chat, text, True)
        t = (ch.timings if ch is not None else None) or Timings()

        def ns(s: float, n: int) -> int:  # at least 1 ns when there was work, so rates stay finite
            return max(int(s * 1e9), 1 if n else 0)

        d.update({
            "done_reason": (ch.finish_reason if ch is not None else None) or "stop",
            "total_duration": int((time.perf_counter() - t0) * 1e9),
            "load_duration": int(self.state.load_seconds() * 1e9),  # this request waited for its model's load
            "prompt_eval_count": len(ids),
            "prompt_eval_duration": ns(t.prefill_s, len(ids)),
            "eval_count": len(gen),
            "eval_duration": ns(t.decode_s, len(gen)),
        })
        if context:
            d["context"] = ids + gen
        return d

    def plan(self, req: OllamaChatRequest) -> ToolPlan | None:
        """Tools as ``tool_choice: auto`` (Ollama's behaviour: calls parsed out of the output) unless
        ``options.tool_choice`` asks for none, any call (``required``) or one function's."""
        choice = (req.options.tool_choice if req.options is not None else None) or "auto"
        if not req.tools:
            if choice not in ("auto", "none"):
                raise APIError(400, "options.tool_choice asks for a tool call but the request has no tools",
                               param="options.tool_choice", code="invalid_tools")
            return None
        tools = [{"name": t.function.name, "description": t.function.description,
                  "parameters": t.function.parameters} for t in req.tools]
        vocab = self.state.grammar_vocab()
        try:
            return plan_tools(self.state.llm.tokenizer.chat_template_source(tools=True), tools, choice, True,
                              vocab.special_token)
        except ToolChoiceError as e:
            param = "options.tool_choice" if e.param == "tool_choice" else e.param
            raise APIError(400, str(e), param=param, code="invalid_tools") from None

    async def run(self, request: Request, req: Any, chat: bool, ids: list[int], params: SamplingParams,
                  top: int | None, t0: float, context: bool, plan: ToolPlan | None = None) -> Response:
        spec = _format_grammar(req.format)
        if spec is not None and params.min_tokens:
            raise _unsupported("format", "min_tokens cannot be combined with a format")
        field = "format"
        if plan is not None and plan.grammar is not None:  # a required or named call, or a generic-format one
            if spec is None:
                spec, field = plan.grammar, "options.tool_choice" if plan.grammar.free_text == "never" else "tools"
            elif plan.grammar.free_text == "never":
                raise APIError(400, "format and a required or named options.tool_choice both decide the output's "
                                    "form; send one of them", param="format", code="conflicting_parameters")
        cons = await self.state.off_loop(grammar_constraints, self.state, [ids], params, spec, field)
        job = Job(self.state, new_id("ollama"), [ids], params, cons)
        if req.stream is not False:
            if not await job.start(request.is_disconnected):  # headers wait for the first news
                return JSONResponse({}, status_code=499)  # the client left; nobody reads this
            return BoundedStream(self.stream(job, req, chat, ids, top, t0, context, plan),
                                 self.state.settings.send_timeout_s, job.out.qsize, self.state.metrics,
                                 media_type=NDJSON,
                                 headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        text, gen, lps, last = [], [], [], None
        try:
            async for idx, ch in job.items(request.is_disconnected):
                if ch.finished and (err := ending_error(job, idx, ch)) is not None:
                    raise err
                text.append(ch.text)
                gen.extend(ch.token_ids)
                lps.extend(ch.logprobs)
                if ch.finished:
                    last = ch
        finally:
            job.abort_rest()
        content, calls = "".join(text), []
        if plan is not None and plan.fmt is not None:
            content, calls = plan.fmt.parse(content)
        body = self.final(req, chat, content, last, ids, gen, t0, context)
        if calls:
            body["message"]["tool_calls"] = self.head(req, chat, "", True, calls)["message"]["tool_calls"]
        if top is not None:
            body["logprobs"] = self.logprobs(lps, top)
        return JSONResponse(body)

    async def stream(self, job: Job, req: Any, chat: bool, ids: list[int], top: int | None, t0: float,
                     context: bool, plan: ToolPlan | None = None) -> AsyncIterator[str]:
        """NDJSON lines; ``finally`` aborts what is unfinished, which is how a client that
        disconnects frees its KV blocks. An error after the headers is a last ``{"error"}`` line."""
        gen: list[int] = []
        try:
            try:
                splitter = ToolStream(plan.fmt) if plan is not None and plan.fmt is not None else None
                async for idx, ch in job.items():
                    gen.extend(ch.token_ids)
                    lps = self.logprobs(ch.logprobs, top) if top is not None and ch.logprobs else None
                    text, calls = ch.text, []
                    if splitter is not None:
                        text, calls = splitter.feed(ch.text)
                        if ch.finished:
                            rest, late = splitter.finish()
                            text, calls = text + rest, calls + late
                    if text or lps or calls:
                        piece = self.head(req, chat, text, False, calls)
                        if lps:
                            piece["logprobs"] = lps
                        yield _line(piece)
                    if ch.finished:
                        err = ending_error(job, idx, ch)
                        if err is not None:
                            yield _line({"error": err.message})
                        else:
                            yield _line(self.final(req, chat, "", ch, ids, gen, t0, context))
                        return
            except Exception as e:
                if not isinstance(e, (APIError, LLMSysError)):
                    log.exception("an Ollama stream failed")
                yield _line({"error": e.message if isinstance(e, APIError) else redact_paths(str(e) or type(e).__name__)})
        finally:
            job.abort_rest()

    def ping(self, req: Any, chat: bool) -> JSONResponse:
        """Ollama's "load the model": the model is loaded (:meth:`ServerState.use` did it), so done at once."""
        return JSONResponse({**self.head(req, chat, "", True), "done_reason": "load",
                             "load_duration": int(self.state.load_seconds() * 1e9)})

    def unload(self, req: Any, chat: bool) -> JSONResponse:
        """Ollama's "unload the model": an empty request with keep_alive 0 (its requests in flight finish first)."""
        self.state.models.unload(req.model)
        return JSONResponse({**self.head(req, chat, "", True), "done_reason": "unload"})


PULL_PROGRESS_S = 0.5  # a progress line at least this often while a pull downloads


async def pull_model(name: str, stream: bool) -> Response:
    """``/api/pull``: what :func:`llmsys.engine.hub.download` fetches for ``name`` (``llmsys pull``'s logic), as
    Ollama's progress lines; bytes counted in the destination folder while it downloads."""
    from llmsys.engine import hub, names

    def plan() -> tuple[Any, Any, str, dict[str, int]]:
        found = names.resolve(name)
        d = found.download() if found.needs_pull else None
        if d is None:
            return found, None, "", {}
        sha, files = hub.plan_download(d)
        return found, d, sha, files

    try:
        found, d, sha, files = await asyncio.to_thread(plan)
    except OSError as e:  # a name no file system takes
        return _error(404, f"model '{name[:80]}' not found ({e.strerror or e})", code="model_not_found")
    except LLMSysError as e:
        status = 404 if type(e).__name__ == "ModelNotFoundError" else 400
        return _error(status, redact_paths(str(e).splitlines()[0]))
    total = sum(files.values())

    async def lines() -> AsyncIterator[dict[str, Any]]:
        yield {"status": "pulling manifest"}
        if d is not None:
            digest = f"sha256:{hashlib.sha256(f'{d.repo}@{sha}'.encode()).hexdigest()}"
            fut = asyncio.get_running_loop().run_in_executor(None, functools.partial(hub.download, d, progress=False))
            while True:
                done, _ = await asyncio.wait({fut}, timeout=PULL_PROGRESS_S)
                got = total if done else min(total, _bytes_under(d.dest))
                yield {"status": f"pulling {d.repo}@{sha[:12]}", "digest": digest, "total": total, "completed": got}
                if done:
                    break
            try:
                fut.result()
            except Exception as e:  # noqa: BLE001 - the error line, as Ollama's client expects
                yield {"error": redact_paths(str(e).splitlines()[0] if str(e) else type(e).__name__)}
                return
            yield {"status": "verifying sha256 digest"}
            yield {"status": "writing manifest"}
        yield {"status": "success"}

    if not stream:
        last: dict[str, Any] = {}
        async for obj in lines():
            last = obj
        return JSONResponse(last, status_code=500 if "error" in last else 200)

    async def body() -> AsyncIterator[str]:
        async for obj in lines():
            yield _line(obj)

    return StreamingResponse(body(), media_type="application/x-ndjson")


def _bytes_under(folder: Any) -> int:
    try:
        return sum(p.stat().st_size for p in folder.rglob("*") if p.is_file())
    except OSError:
        return 0


def delete_model(state: ServerState, name: str) -> None:
    """``/api/delete``: a catalog model or Hub repo pulled into $LLMSYS_HOME/models loses its folder (an idle
    loaded copy is unloaded first); anything else (a path, the Ollama store, a folder outside) is refused."""
    import shutil

    from llmsys.engine import names
    from llmsys.kernels.common.errors import ModelNotFoundError
    from llmsys.kernels.common.paths import llmsys_home

    try:
        found = names.resolve(name)
    except OSError as e:
        raise APIError(404, f"model '{name[:80]}' not found ({e.strerror or e})", code="model_not_found") from None
    except ModelNotFoundError as e:
        raise APIError(404, f"model '{name}' not found: {e}", code="model_not_found") from None
    if found.kind not in (names.NameKind.CATALOG, names.NameKind.HUB) or found.path is None:
        raise APIError(400, f"model '{name}' was not pulled into $LLMSYS_HOME ({found.kind.value}); this server "
                            "deletes only what it or `llmsys pull` downloaded", code="not_deletable")
    if found.needs_pull or not found.path.exists():
        raise APIError(404, f"model '{name}' is not downloaded", code="model_not_found")
    root = (llmsys_home() / "models").resolve()
    path = found.path.resolve()
    if path == root or not path.is_relative_to(root):
        raise APIError(400, f"model '{name}' lives outside $LLMSYS_HOME/models; not deleting it", code="not_deletable")
    if not state.models.drop(str(path)):
        raise APIError(409, f"model '{name}' is answering requests; delete it when they end", code="model_busy")
    shutil.rmtree(path)
    log.info("deleted %s (%s)", found.name, path.name)


def _keep_alive(req: Any) -> Any:
    """The request's keep_alive in seconds (None: for ever), or ``...`` when it gives none (the server's default)."""
    if req.keep_alive is None:
        return ...
    try:
        return parse_keep_alive(req.keep_alive)
    except LLMSysError as e:
        raise APIError(400, str(e), param="keep_alive", code="invalid_keep_alive") from None


def _iso(t: float) -> str:
    return datetime.fromtimestamp(t, timezone.utc).isoformat().replace("+00:00", "Z")


def _line(obj: Any) -> str:
    return json.dumps(obj, separators=(",", ":"), ensure_ascii=False) + "\n"


def add_ollama_routes(app: FastAPI, state: ServerState, prep: Preparer | None = None) -> None:
    """Register Ollama's API on ``app`` (see the module docstring)."""
    api = _Ollama(state, prep or Preparer(state))
    router = APIRouter(route_class=_OllamaRoute, tags=["ollama"])
    gen_errors = _responses(400, 401, 403, 404, 408, 413, 429, 503, generating=True)

    def top_of(req: Any) -> int | None:
        return (req.top_logprobs or 0) if req.logprobs else None

    @router.post("/api/chat", responses=gen_errors)
    async def chat(req: OllamaChatRequest, request: Request):
        """The next assistant message of a conversation (Ollama's chat API)."""
        t0 = time.perf_counter()
        keep = _keep_alive(req)
        api.prep.need_ready()
        if not req.messages and keep == 0:
            return api.unload(req, chat=True)
        await state.use(req.model, keep)
        api.begin(req)
        for i, m in enumerate(req.messages):
            if m.images:
                raise _unsupported(f"messages.{i}.images", "the served model is text-only")
        if not req.messages:
            return api.ping(req, chat=True)
        ids = await state.off_loop(api.chat_ids, req)
        top = top_of(req)
        params = api.sampling(req.options, len(ids), top)
        plan = await state.off_loop(api.plan, req)
        return await api.run(request, req, True, ids, params, top, t0, context=False, plan=plan)

    @router.post("/api/generate", responses=gen_errors)
    async def generate(req: OllamaGenerateRequest, request: Request):
        """A completion of ``prompt``, in the chat template unless ``raw`` (Ollama's generate API)."""
        t0 = time.perf_counter()
        keep = _keep_alive(req)
        api.prep.need_ready()
        if not req.prompt and keep == 0:
            return api.unload(req, chat=False)
        await state.use(req.model, keep)
        api.begin(req)
        if req.suffix:
            raise _unsupported("suffix", "insertion (fill in the middle) is not implemented; send the prefix as "
                                         "the prompt")
        if req.template:
            raise _unsupported("template", "llmsys renders the model's own (Jinja) chat template, not Go "
                                           "templates; send raw: true with the prompt already formatted")
        if req.images:
            raise _unsupported("images", "the served model is text-only")
        if req.raw and req.system:
            raise APIError(400, "'system' goes into the chat template, which raw: true skips; write it into the "
                                "prompt", param="system", code="conflicting_parameters")
        if not req.prompt:
            return api.ping(req, chat=False)
        ids = await state.off_loop(api.generate_ids, req)
        top = top_of(req)
        params = api.sampling(req.options, len(ids), top)
        return await api.run(request, req, False, ids, params, top, t0, context=not req.raw)

    @router.get("/api/tags", responses=_responses(401, 403, 503))
    async def tags() -> dict[str, Any]:
        """The models a request can name: loaded, the catalog's downloaded ones, the Ollama store's."""
        api.prep.need_ready()
        out = []
        for m in await asyncio.to_thread(available, state.models):
            name = m.name if ":" in bare(m.name) else f"{bare(m.name)}:latest"
            item = {"name": name, "model": name, "modified_at": _iso(m.modified), "size": m.size,
                    "digest": hashlib.sha256(f"{m.path}\n{m.name}".encode()).hexdigest(),
                    "details": {"parent_model": "", "format": _model_format(m.path) if m.path else "",
                                "family": "", "families": [], "parameter_size": "", "quantization_level": ""}}
            slot = state.models.find(m.name) if m.loaded else None
            if slot is not None and slot.llm is not None:  # loaded: what its engine knows
                state.select(slot)
                facts = await state.off_loop(api.facts)
                weights, _, _ = await state.off_loop(api.sizes)
                item.update(modified_at=facts["modified_at"], size=weights, digest=facts["digest"],
                            details=facts["details"])
            out.append(item)
        return {"models": out}

    @router.post("/api/show", responses=_responses(400, 401, 403, 404, 408, 413, 503))
    async def show(req: OllamaShowRequest) -> dict[str, Any]:
        """The model's details, chat template, default parameters and architecture."""
        api.prep.need_ready()
        await state.use(req.model)
        api.check_model(req.model)
        facts = await state.off_loop(api.facts)
        llm = state.llm
        a = llm.loaded.args
        arch = llm.loaded.family
        tok = llm.tokenizer
        max_len = llm.max_model_len
        info: dict[str, Any] = {
            "general.architecture": arch,
            "general.parameter_count": facts["n_params"],
            f"{arch}.context_length": max_len,  # what this server serves (num_ctx up to it)
            f"{arch}.embedding_length": a.hidden_size,
            f"{arch}.block_count": a.num_hidden_layers,
            f"{arch}.feed_forward_length": a.intermediate_size,
            f"{arch}.attention.head_count": a.num_attention_heads,
            f"{arch}.attention.head_count_kv": a.num_key_value_heads,
            f"{arch}.attention.key_length": a.head_dim,
            f"{arch}.attention.layer_norm_rms_epsilon": a.rms_norm_eps,
            f"{arch}.rope.freq_base": a.rope_theta,
            f"{arch}.vocab_size": a.vocab_size,
            "tokenizer.ggml.bos_token_id": tok.bos_token_id,
            "tokenizer.ggml.eos_token_id": list(llm.core.eos_token_ids),
            "llmsys.trained_context_length": a.max_position_embeddings,
            "llmsys.device": str(llm.loaded.device),
        }
        if req.verbose:
            info["tokenizer.ggml.tokens"] = tok.convert_ids_to_tokens(list(range(tok.vocab_size)))
        d = api.defaults()
        params = {"num_ctx": max_len, "temperature": d["temperature"], "top_k": d["top_k"], "top_p": d["top_p"]}
        if d["min_p"]:
            params["min_p"] = d["min_p"]
        if d["repeat_penalty"] != 1.0:
            params["repeat_penalty"] = d["repeat_penalty"]
        template = tok.chat_template or ""
        modelfile = [f"# Modelfile generated by llmsys for '{api.display_name()}' (an llmsys server, not Ollama)",
                     f"FROM {llm.loaded.path}"]
        if template:
            modelfile.append("# TEMPLATE is the model's Jinja chat template (llmsys renders Jinja, Ollama Go "
                             "templates)")
            modelfile.append(f'TEMPLATE """{template}"""')
        modelfile += [f"PARAMETER {k} {v}" for k, v in params.items()]
        return {
            "license": "",
            "modelfile": "\n".join(modelfile) + "\n",
            "parameters": "\n".join(f"{k:<30} {v}" for k, v in params.items()),
            "template": template,
            "details": facts["details"],
            "model_info": info,
            # Ollama's capability names: "tools" with any chat template (its own call format or the generic one)
            "capabilities": ["completion"] + (["tools"] if tok.chat_template_source(tools=True) else []),
            "modified_at": facts["modified_at"],
        }

    @router.get("/api/ps", responses=_responses(401, 403, 503))
    async def ps() -> dict[str, Any]:
        """The loaded models, their true resident sizes (memory reports) and when each unloads."""
        api.prep.need_ready()
        out = []
        for slot in sorted(state.models.loaded(), key=lambda s: -s.last_used):
            llm = slot.llm
            if llm is None:
                continue
            state.select(slot)
            facts = await state.off_loop(api.facts)
            exp = slot.expires_at()
            name = api.display_name()
            out.append({"name": name, "model": name, "size": slot.resident(), "digest": facts["digest"],
                        "details": facts["details"], "expires_at": EXPIRES_NEVER if exp is None else _iso(exp),
                        "size_vram": slot.resident_vram(), "context_length": llm.max_model_len,
                        "busy": slot.busy(), "loads": slot.loads})
        return {"models": out}

    @router.get("/api/version", responses=_responses(401, 403))
    async def version() -> dict[str, str]:
        """The Ollama API version these routes follow."""
        return {"version": OLLAMA_VERSION}

    @router.api_route("/", methods=["GET", "HEAD"], response_class=PlainTextResponse, responses=_responses(403))
    async def root() -> PlainTextResponse:
        """Ollama clients probe this."""
        return PlainTextResponse("Ollama is running")

    emb_errors = _responses(400, 401, 403, 404, 408, 413, 429, 503)

    async def embed_inputs(req: Any, inputs: list[str], truncate: bool, normalize: bool, dimensions: int | None,
                           request: Request) -> Embedded | None:
        api.prep.need_ready()
        await state.use(req.model, _keep_alive(req))
        api.check_model(req.model)
        if req.options is not None:
            api.check_options(req.options)
        check_dimensions(state, dimensions)
        num_ctx = req.options.num_ctx if req.options is not None else None
        prompts = await state.off_loop(embedding_inputs, api.prep, inputs, "input", truncate, num_ctx)
        return await run_embeddings(state, prompts, normalize, dimensions, request.is_disconnected)

    @router.post("/api/embed", responses=emb_errors)
    async def embed(req: OllamaEmbedRequest, request: Request):
        """Embeddings of ``input`` (Ollama's embed API): pooled as the model says, L2-normalized."""
        t0 = time.perf_counter()
        inputs = ([req.input] if req.input else []) if isinstance(req.input, str) else list(req.input)  # "": a ping
        if not inputs:
            api.prep.need_ready()
            await state.use(req.model, _keep_alive(req))
            api.check_model(req.model)
            return {"model": api.display_name(), "embeddings": []}
        out = await embed_inputs(req, inputs, req.truncate, True, req.dimensions, request)
        if out is None:
            return JSONResponse({}, status_code=499)  # the client left; nobody reads this
        return {"model": api.display_name(), "embeddings": [v.tolist() for v in out.vectors],
                "total_duration": int((time.perf_counter() - t0) * 1e9), "load_duration": 0,
                "prompt_eval_count": out.prompt_tokens}

    @router.post("/api/embeddings", responses=emb_errors)
    async def embeddings(req: OllamaEmbeddingsRequest, request: Request):
        """The legacy embeddings API: one prompt's vector, not normalized (as Ollama), cut to the context."""
        if not req.prompt:
            api.prep.need_ready()
            await state.use(req.model, _keep_alive(req))
            api.check_model(req.model)
            return {"embedding": []}
        out = await embed_inputs(req, [req.prompt], True, False, None, request)
        if out is None:
            return JSONResponse({}, status_code=499)
        return {"embedding": out.vectors[0].tolist()}

    @router.post("/api/pull", responses=_responses(400, 401, 403, 404))
    async def pull(req: OllamaPullRequest):
        """Download a catalog model or a Hugging Face repo into $LLMSYS_HOME, with Ollama's progress lines
        (``{status, digest, total, completed}``; ``stream: false``: the last one)."""
        return await pull_model(req.model, req.stream is not False)

    @router.delete("/api/delete", responses=_responses(400, 401, 403, 404))
    async def delete(req: OllamaShowRequest) -> Response:
        """Remove a pulled model's files from $LLMSYS_HOME (never anything outside it); unloaded first."""
        await asyncio.to_thread(delete_model, state, req.model)
        return Response(status_code=200)

    @router.post("/api/push", include_in_schema=False)
    @router.post("/api/create", include_in_schema=False)
    @router.post("/api/copy", include_in_schema=False)
    async def manage() -> JSONResponse:
        return _error(501, "models are not pushed, created or copied through this server (`llmsys pull NAME` "
                           "downloads one; a request that names a model loads it)")

    app.include_router(router)
