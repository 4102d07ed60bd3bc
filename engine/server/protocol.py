"""OpenAI wire format: request models (pydantic, so /openapi.json is real)
and the error type every handler raises.

Why pydantic models with tight bounds instead of ``dict`` bodies: FastAPI
publishes them as the OpenAPI schema (which the schema fuzzer in the tests
drives), and a wrong type or out-of-range value is rejected before any engine
work with a 400 naming the field. The models are strict (``"max_tokens": "10"``
or ``"stream": "yes"`` is a 400, as the published types say), so the spec is
what the server enforces; what no static schema can say (a prompt longer than
this model's context, a conversation the model's chat template rejects) is a
400 with one of :data:`SEMANTIC_CODES`. Unknown fields are ignored (the
official client and other tools send extras), the way OpenAI-compatible
servers do.
"""

from __future__ import annotations

import json
import re
from typing import Annotated, Any, Callable, Literal, Union

import numpy as np
from fastapi import Request
from fastapi.exceptions import RequestValidationError
from fastapi.routing import APIRoute
from pydantic import AfterValidator, BaseModel, ConfigDict, Field, ValidationError, WithJsonSchema, model_validator
from pydantic_core import PydanticCustomError

from llmsys.engine.sampling import MAX_LOGPROBS, SAMPLING_LIMITS, check_sampling
from llmsys.kernels.common.errors import LLMSysError

MAX_N = 16  # choices per request
MAX_STOP = 4  # stop sequences per request (OpenAI's limit)
MAX_PROMPTS = 64  # prompts per /v1/completions request (and completions: prompts x n)
MAX_TOOLS = 128  # tools per request (OpenAI's limit), and tool calls per message
MAX_GRAMMAR_CHARS = 64 * 1024  # a regex or grammar in response_format
MAX_LOGIT_BIAS = 300  # logit_bias entries (OpenAI's limit)
MAX_MESSAGES = 4096  # messages per chat request: pydantic stops at the bound, so 100k of them cost nothing
# Bodies this large are parsed and validated on the preparation thread, not the event loop
# (json.loads of 4 MB is ~40 ms, validating 100k messages ~0.3 s: every stream would stall).
OFF_LOOP_BODY_BYTES = 64 * 1024
# JSON values one body may hold (or twice --max-prompt-tokens, if more), counted before parsing:
# json.loads holds the GIL for its whole run (0.14 s for 1.3M token ids on a busy 2-core VM, during
# which the event loop cannot run even from another thread), so a body is parsed only when small.
MAX_JSON_VALUES = 256 * 1024

# 400 codes for limits that depend on the loaded model or on two fields together,
# which the OpenAPI schema cannot state; every other 400 means the body broke the schema.
SEMANTIC_CODES = (
    "context_length_exceeded",  # the prompt's tokens do not fit this model's context
    "prompt_too_long",  # a prompt over the server's --max-prompt-tokens, whatever the KV policy
    "no_chat_template",  # a base model has no chat template to render messages with
    "chat_template_error",  # the model's template rejected or could not render the conversation
    "too_many_choices",  # prompts x n over MAX_PROMPTS
    "conflicting_parameters",  # min_tokens > max_tokens
    "invalid_kv_policy",  # a well-formed kv_policy this engine cannot run (its pool, its block size)
    "invalid_prompt",  # text that encodes to no tokens, or token ids outside the vocabulary
    "invalid_grammar",  # a response_format / tool schema the grammar engine cannot use, or too long for max_tokens
    "invalid_tools",  # a tool_choice naming none of the tools, or asking for a call with no tools
    "invalid_logit_bias",  # a logit_bias token id outside this model's vocabulary
    "unsupported_parameter",  # an OpenAI field this server does not implement, set to a value that needs it
    "embeddings_unsupported",  # the model's embedding config asks for a step llmsys does not run (a Dense module)
)
# The characters of --kv-policy syntax; which words and numbers make a policy is the
# parser's (its 400s name the problem, code invalid_kv_policy).
KV_POLICY_PATTERN = r"^[A-Za-z0-9:.,; ]*$"
# torch.Generator takes -2**63..2**64-1, but a JSON number past 2**53 may arrive as a float that
# rounds across the bound (1.8446744073709552e19 is 2**64), so the published range is the exact one.
SEED_MIN, SEED_MAX = -(2**53 - 1), 2**53 - 1


# An absolute file path inside a message (not a URL's path: no "scheme:" or host before it).
_ABS_PATH = re.compile(r"(?<![\w:/.~-])/(?:[^\s/'\"`,;()<>\[\]{}]+/)+[^\s/'\"`,;()<>\[\]{}]*")
_ROUTES = ("/v1/", "/api/", "/docs", "/health", "/metrics")


def redact_paths(text: str) -> str:
    """``text`` with every absolute file path cut to its last component: an error a client
    sees names the model or file (``model.gguf``), never where the server keeps it (a path
    tells an attacker the layout and user names). The API's own routes are kept."""
    def short(m: re.Match[str]) -> str:
        path = m.group(0)
        if path.startswith(_ROUTES):
            return path
        return path.rstrip("/").rsplit("/", 1)[-1] or path

    return _ABS_PATH.sub(short, text) if "/" in text else text


class APIError(Exception):
    """An error answered as ``{"error": {...}}`` with an HTTP status.

    ``extra`` fields land inside the error object (context overflow adds
    ``n_prompt_tokens`` and ``n_ctx``, as llama.cpp's server does).
    """

    def __init__(
        self,
        status: int,
        message: str,
        type: str = "invalid_request_error",
        param: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
        **extra: Any,
    ):
        message = redact_paths(message)
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type
        self.param = param
        self.code = code
        self.headers = headers or {}
        self.extra = extra

    def body(self) -> dict[str, Any]:
        err = {"message": self.message, "type": self.type, "param": self.param, "code": self.code}
        err.update(self.extra)
        return {"error": err}


_STRICT = ConfigDict(extra="ignore", strict=True)


def _integral(v: Any) -> Any:
    """JSON Schema's ``integer`` includes ``1.0``; strict pydantic would refuse it, so an integral
    float becomes its int, also inside lists (``"10"`` and ``true`` stay refused)."""
    if type(v) is float and v.is_integer():
        return int(v)
    if type(v) is list:
        return [_integral(x) for x in v]
    return v


_INT_FIELDS = ("max_tokens", "n", "seed", "top_k", "min_tokens", "max_completion_tokens", "top_logprobs", "best_of",
               "logprobs", "prompt", "spec_tokens")


class StreamOptions(BaseModel):
    model_config = _STRICT
    include_usage: bool = False


class TextFormat(BaseModel):
    model_config = _STRICT
    type: Literal["text"]


class JsonObjectFormat(BaseModel):
    model_config = _STRICT
    type: Literal["json_object"]


class JsonSchemaSpec(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True, populate_by_name=True)
    name: str = Field("response", max_length=64)
    description: str | None = None
    schema_: dict[str, Any] | None = Field(None, alias="schema", description="a JSON Schema; none: any JSON object")
    strict: bool | None = None


class JsonSchemaFormat(BaseModel):
    model_config = _STRICT
    type: Literal["json_schema"]
    json_schema: JsonSchemaSpec


class RegexFormat(BaseModel):
    """llmsys extension: the whole output matches this regex."""

    model_config = _STRICT
    type: Literal["regex"]
    regex: str = Field(..., min_length=1, max_length=MAX_GRAMMAR_CHARS)


class GrammarFormat(BaseModel):
    """llmsys extension: the output is a sentence of this grammar (Lark syntax as llguidance
    reads it, or llama.cpp's GBNF)."""

    model_config = _STRICT
    type: Literal["grammar"]
    grammar: str = Field(..., min_length=1, max_length=MAX_GRAMMAR_CHARS)
    syntax: Literal["lark", "gbnf"] = "lark"


ResponseFormat = Annotated[
    Union[TextFormat, JsonObjectFormat, JsonSchemaFormat, RegexFormat, GrammarFormat],
    Field(discriminator="type"),
]


class TextPart(BaseModel):
    model_config = _STRICT
    type: Literal["text"] = "text"
    text: str


class FunctionCall(BaseModel):
    model_config = _STRICT
    name: str = Field(..., max_length=64)
    arguments: str = Field(..., description="the arguments as JSON text, as the model wrote them")


class ToolCallIn(BaseModel):
    """An earlier assistant turn's tool call, sent back in the conversation."""

    model_config = _STRICT
    id: str = Field(..., max_length=128)
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(BaseModel):
    model_config = _STRICT
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: Union[str, list[TextPart], None] = None
    name: str | None = None
    tool_calls: list[ToolCallIn] | None = Field(None, max_length=MAX_TOOLS)
    tool_call_id: str | None = Field(None, max_length=128)

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(p.text for p in self.content)


class FunctionDef(BaseModel):
    model_config = _STRICT
    name: str = Field(..., pattern=r"^[A-Za-z0-9_-]{1,64}$")
    description: str | None = None
    parameters: dict[str, Any] | None = Field(None, description="a JSON Schema of the arguments object")
    strict: bool | None = None


class Tool(BaseModel):
    model_config = _STRICT
    type: Literal["function"]
    function: FunctionDef


class NamedFunction(BaseModel):
    model_config = _STRICT
    name: str = Field(..., pattern=r"^[A-Za-z0-9_-]{1,64}$")


class NamedToolChoice(BaseModel):
    model_config = _STRICT
    type: Literal["function"]
    function: NamedFunction


_BiasKey = Annotated[str, Field(pattern=r"^[0-9]{1,9}$")]
_Bias = Annotated[float, Field(ge=-100.0, le=100.0)]
# pydantic publishes the key pattern as patternProperties but not that other keys are refused.
_LogitBias = Annotated[dict[_BiasKey, _Bias], WithJsonSchema({
    "type": "object", "maxProperties": MAX_LOGIT_BIAS, "additionalProperties": False,
    "patternProperties": {r"^[0-9]{1,9}$": {"type": "number", "minimum": -100.0, "maximum": 100.0}}})]


def sampling_check(name: str, as_name: str | None = None, allow: tuple[Any, ...] = ()) -> AfterValidator:
    """The engine's own check of sampling knob ``name`` (``engine.sampling.check_sampling``) on a request
    field, so a server refuses a value with the words the CLI and ``LLM.generate`` use (one table of limits,
    not a second set of pydantic bounds). ``as_name``: the engine's name where the API's differs;
    ``allow``: values the API itself translates before the engine sees them."""

    def check(v: Any) -> Any:
        if v is None or v in allow:
            return v
        try:
            return check_sampling(as_name or name, v)
        except LLMSysError as e:
            raise PydanticCustomError("sampling_limit", str(e).replace("{", "{{").replace("}", "}}")) from None

    return AfterValidator(check)


def sampling_schema(name: str) -> dict[str, Any]:
    """The JSON-schema bounds of sampling knob ``name`` (for /docs), from the same table."""
    lim = SAMPLING_LIMITS[name]
    out: dict[str, Any] = {"exclusiveMinimum" if lim.lo_open else "minimum": lim.lo}
    if lim.hi != float("inf"):
        out["maximum"] = lim.hi
    return out


def sampling_field(name: str, kind: Any, as_name: str | None = None) -> Any:
    """A request field holding sampling knob ``name`` (the engine's ``as_name``): its type, the engine's
    check, its schema bounds."""
    return Annotated[kind, sampling_check(name, as_name), Field(json_schema_extra=sampling_schema(as_name or name))]


# Request fields that hold sampling knobs: the engine's one check (engine.sampling.SAMPLING_LIMITS).
_Temperature = sampling_field("temperature", float | None)
_TopP = sampling_field("top_p", float | None)
_PresencePenalty = sampling_field("presence_penalty", float)
_FrequencyPenalty = sampling_field("frequency_penalty", float)
_TopK = sampling_field("top_k", int | None)
_MinP = sampling_field("min_p", float | None)
_RepetitionPenalty = sampling_field("repetition_penalty", float | None)


class _Common(BaseModel):
    """Fields both completion endpoints share (OpenAI names, plus a few
    vLLM-style extensions: top_k, min_p, repetition_penalty, ignore_eos, min_tokens,
    and llmsys's kv_policy)."""

    model_config = _STRICT

    @model_validator(mode="before")
    @classmethod
    def _integral_ints(cls, data: Any) -> Any:
        if isinstance(data, dict):
            return {k: _integral(v) if k in _INT_FIELDS else v for k, v in data.items()}
        return data

    model: str | None = None
    max_tokens: int | None = Field(None, ge=1, description="tokens to generate at most")
    temperature: _Temperature = None
    top_p: _TopP = None
    n: int = Field(1, ge=1, le=MAX_N)
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: Union[Annotated[str, Field(min_length=1)], Annotated[list[Annotated[str, Field(min_length=1)]],
                                                                Field(max_length=MAX_STOP)], None] = Field(None)
    seed: int | None = Field(None, ge=SEED_MIN, le=SEED_MAX)
    presence_penalty: _PresencePenalty = 0.0
    frequency_penalty: _FrequencyPenalty = 0.0
    user: str | None = Field(None, max_length=256, description="an end-user id; OpenAI uses it for abuse monitoring, it "
                                                               "changes no output (llmsys logs it with the request)")
    safety_identifier: str | None = Field(None, max_length=256, description="OpenAI's newer name for user; logged")
    prompt_cache_key: str | None = Field(None, max_length=256, description="OpenAI's cache-routing hint; llmsys "
                                         "reuses any cached prompt prefix by itself, the key is logged")
    logit_bias: _LogitBias | None = Field(
        None, max_length=MAX_LOGIT_BIAS, description="token id -> bias added to its logit before sampling "
                                                     "(-100 bans the token, 100 forces it)")
    # OpenAI fields llmsys does not implement: accepted only at the value that asks for nothing
    # (else a 400 with code unsupported_parameter naming the field; see UNSUPPORTED).
    store: bool | None = None
    metadata: dict[str, str] | None = None
    service_tier: str | None = None
    top_k: _TopK = None
    min_p: _MinP = None
    repetition_penalty: _RepetitionPenalty = None
    ignore_eos: bool = False
    min_tokens: int = Field(0, ge=0)
    spec_tokens: int | None = Field(
        None, ge=0, le=16, description="llmsys extension: speculative drafts verified per step at most for this "
                                       "request (0: none; default: the server's --spec-tokens, 8 with a prediction)")
    kv_policy: str | None = Field(
        None, max_length=200, pattern=KV_POLICY_PATTERN,
        description="llmsys extension: this request's KV eviction policy, in --kv-policy syntax: full, window:N, "
                    "sink:S,window:N, h2o:H,recent:R or snapkv:N (budgets in tokens, or sizes like 64KiB). "
                    "Default: the server's --kv-policy. quest:K is engine-wide (server flag only).",
        examples=["sink:4,window:252"],
    )


class PredictionPart(BaseModel):
    model_config = _STRICT
    type: Literal["text"]
    text: str


class Prediction(BaseModel):
    """OpenAI's predicted output: ``{"type": "content", "content": str | [{"type": "text", "text": str}]}``."""

    model_config = _STRICT
    type: Literal["content"]
    content: Union[str, list[PredictionPart]]

    @property
    def text(self) -> str:
        return self.content if isinstance(self.content, str) else "".join(p.text for p in self.content)


class ChatCompletionRequest(_Common):
    messages: list[ChatMessage] = Field(..., min_length=1, max_length=MAX_MESSAGES)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    response_format: ResponseFormat | None = None
    tools: list[Tool] | None = Field(None, max_length=MAX_TOOLS)
    tool_choice: Union[Literal["none", "auto", "required"], NamedToolChoice, None] = None
    parallel_tool_calls: bool = True
    functions: list[dict[str, Any]] | None = None
    function_call: Union[str, dict[str, Any], None] = None
    audio: dict[str, Any] | None = None
    modalities: list[str] | None = None
    prediction: Prediction | None = Field(
        None, description="the expected output (e.g. the file being edited): its spans become speculative drafts "
                          "the model verifies, so a close prediction answers in fewer steps; the answer is the same")
    web_search_options: dict[str, Any] | None = None
    reasoning_effort: str | None = None
    verbosity: str | None = None


_TokenIds = Annotated[list[Annotated[int, Field(ge=0)]], Field(min_length=1)]


class CompletionRequest(_Common):
    prompt: Union[
        str,
        Annotated[list[str], Field(min_length=1, max_length=MAX_PROMPTS)],
        _TokenIds,
        Annotated[list[_TokenIds], Field(min_length=1, max_length=MAX_PROMPTS)],
    ]
    logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    response_format: ResponseFormat | None = None
    echo: bool = Field(False, description="put the prompt before the completion in its text")
    suffix: str | None = Field(None, description="text after the completion (insertion); only empty or null here")
    best_of: int | None = Field(None, ge=1, le=MAX_N, description="only equal to n here (no server-side reranking)")


MAX_EMBEDDING_INPUTS = 2048  # inputs per embeddings request (OpenAI's limit); they take one queue place


class EmbeddingRequest(BaseModel):
    """OpenAI's ``/v1/embeddings``: a text, texts, token ids or lists of token ids."""

    model_config = _STRICT

    @model_validator(mode="before")
    @classmethod
    def _integral_ints(cls, data: Any) -> Any:
        if isinstance(data, dict):
            return {k: _integral(v) if k in ("input", "dimensions") else v for k, v in data.items()}
        return data

    model: str | None = None
    input: Union[
        str,
        Annotated[list[str], Field(min_length=1, max_length=MAX_EMBEDDING_INPUTS)],
        _TokenIds,
        Annotated[list[_TokenIds], Field(min_length=1, max_length=MAX_EMBEDDING_INPUTS)],
    ]
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: int | None = Field(None, ge=1, description="keep the first that many values (Matryoshka models), "
                                                             "normalized again")
    user: str | None = Field(None, max_length=256, description="an end-user id; kept in the server's log")


# Fields accepted only at the value that asks for nothing: field -> (is that value?, what to do instead).
UNSUPPORTED: dict[str, tuple[Any, str]] = {
    "store": (lambda v: not v, "llmsys stores no completions"),
    "metadata": (lambda v: not v, "metadata belongs to stored completions, which llmsys does not keep"),
    "service_tier": (lambda v: v in ("auto", "default"), "one local engine has one tier: use 'auto' or omit it"),
    "functions": (lambda v: not v, "the legacy functions field is not served: send tools"),
    "function_call": (lambda v: v in ("none", "auto"), "the legacy function_call field is not served: send tool_choice"),
    "audio": (lambda v: not v, "this is a text model: no audio output"),
    "modalities": (lambda v: list(v) == ["text"], "this is a text model: modalities can only be ['text']"),
    "web_search_options": (lambda v: not v, "the server has no web search"),
    "reasoning_effort": (lambda v: False, "the served model has no reasoning-effort setting; omit it"),
    "verbosity": (lambda v: v == "medium", "the served model has no verbosity setting; omit it"),
    "suffix": (lambda v: not v, "insertion (fill in the middle) is not implemented; send the prefix as the prompt"),
}


def prompt_over_limit(n: int, limit: int, field: str, at_least: bool = False) -> APIError:
    """The 400 for a prompt over --max-prompt-tokens (held whatever the KV policy)."""
    return APIError(400, f"the prompt has {'at least ' if at_least else ''}{n} tokens, more than this server's "
                         f"limit of {limit} per prompt (--max-prompt-tokens); shorten the prompt",
                    param=field, code="prompt_too_long", n_prompt_tokens=n, max_prompt_tokens=limit)


def parse_body(model: type[BaseModel], body: bytes, prompt_limit: int | None) -> BaseModel:
    """A JSON body as ``model``, for the preparation thread (see :class:`OffLoopRoute`).

    Token-id lists (``prompt``, Ollama's ``context``) longer than ``prompt_limit`` are
    refused by their length before pydantic walks a million integers. Errors are the ones
    FastAPI raises itself, so the app answers them the same way."""
    cap = max(MAX_JSON_VALUES, 2 * (prompt_limit or 0))
    if count_json_values(body) > cap:
        raise APIError(413, f"the request body holds more than {cap} JSON values (this server's limit: "
                            f"{MAX_JSON_VALUES}, or twice --max-prompt-tokens); send fewer token ids or messages",
                       code="request_too_large")
    try:
        data = json.loads(body)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        pos = e.pos if isinstance(e, json.JSONDecodeError) else e.start
        why = e.msg if isinstance(e, json.JSONDecodeError) else str(e)
        raise RequestValidationError([{"type": "json_invalid", "loc": ("body", pos), "msg": "JSON decode error",
                                       "input": {}, "ctx": {"error": why}}]) from None
    if prompt_limit is not None and isinstance(data, dict):
        for field in ("prompt", "context"):
            v = data.get(field)
            lists = [v] if isinstance(v, list) and v and not isinstance(v[0], list) else v
            for ids in lists if isinstance(lists, list) else ():
                if isinstance(ids, list) and len(ids) > prompt_limit:
                    raise prompt_over_limit(len(ids), prompt_limit, field)
    try:
        return model.model_validate(data)
    except ValidationError as e:
        raise RequestValidationError([{**err, "loc": ("body", *err["loc"])}
                                      for err in e.errors(include_url=False)]) from None


def count_json_values(body: bytes) -> int:
    """About how many values the JSON text ``body`` holds (one per ``,`` ``:`` ``[`` outside
    strings, plus one), counted without parsing.

    numpy passes over the bytes (a few ms for 4 MB, the GIL released inside them), where
    ``json.loads`` would hold the GIL for its whole run. Malformed text gets some count;
    ``json.loads`` says what is wrong with it afterwards."""
    a = np.frombuffer(body, dtype=np.uint8)
    if a.size == 0:
        return 0
    quote = a == 0x22
    if body.find(b"\\") >= 0:  # a quote after an odd run of backslashes is inside its string
        idx = np.arange(a.size, dtype=np.int64)
        last_other = np.maximum.accumulate(np.where(a != 0x5C, idx, -1))
        run = idx - last_other  # backslashes ending at each position
        escaped = np.zeros(a.size, dtype=bool)
        escaped[1:] = run[:-1] % 2 == 1
        quote &= ~escaped
    inside = np.bitwise_xor.accumulate(quote.view(np.uint8)).view(bool)  # a closing quote counts as inside: no matter
    structural = (a == 0x2C) | (a == 0x3A) | (a == 0x5B)
    return 1 + int(np.count_nonzero(structural & ~inside))


def _is_json(content_type: str | None) -> bool:
    media = (content_type or "").split(";")[0].strip().lower()
    return media == "application/json" or (media.startswith("application/") and media.endswith("+json"))


class OffLoopRoute(APIRoute):
    """A route whose large JSON body (over :data:`OFF_LOOP_BODY_BYTES`) is parsed and validated
    on the server's preparation thread: FastAPI would do both on the event loop, where four
    multi-megabyte requests stall every stream and ``/health`` for seconds. The validated model
    is handed to FastAPI as the request's parsed JSON, which it accepts without a second pass."""

    def get_route_handler(self) -> Callable[[Request], Any]:
        handler = super().get_route_handler()
        field = self.body_field
        model = getattr(field.field_info, "annotation", None) if field is not None else None
        if not (isinstance(model, type) and issubclass(model, BaseModel)):
            return handler

        async def route(request: Request) -> Any:
            if request.method == "POST" and _is_json(request.headers.get("content-type")):
                body = await request.body()
                state = getattr(request.app, "llmsys_state", None)
                if len(body) > OFF_LOOP_BODY_BYTES and state is not None:
                    limit = state.prompt_limit() if state.ready else None
                    request._json = await state.off_loop(parse_body, model, body, limit)
            return await handler(request)

        return route


def unsupported_field(req: BaseModel) -> APIError | None:
    """A 400 for the first field of :data:`UNSUPPORTED` set to a value that asks for something."""
    for name, (harmless, why) in UNSUPPORTED.items():
        v = getattr(req, name, None)
        if v is not None and not harmless(v):
            return APIError(400, f"'{name}' is not supported by this server: {why}", param=name,
                            code="unsupported_parameter")
    return None


def stop_list(stop: str | list[str] | None) -> tuple[str, ...]:
    """The schema bounds count and length; this only normalises the shape."""
    if stop is None:
        return ()
    return (stop,) if isinstance(stop, str) else tuple(stop)


_UNION_TAG = re.compile(r"^(str|int|float|bool|none|constrained-\w+|function-\w+|\w*\[.*\])$")


def validation_message(errors: list[dict[str, Any]]) -> tuple[str, str | None]:
    """One line naming the first offending field (from pydantic's errors).

    A field with several accepted shapes (``prompt``, ``stop``, ``content``)
    fails once per shape; pydantic tags those locations with the shape
    (``'list[str]'``), which is noise to a client, so they are dropped and the
    message says no accepted shape matched.
    """
    if not errors:
        return "invalid request body", None
    e = errors[0]
    if e.get("type") == "json_invalid":
        return f"request body is not valid JSON: {e.get('ctx', {}).get('error', e.get('msg'))}", None
    raw = [x for x in e.get("loc", ()) if x != "body"]
    loc = [str(x) for x in raw if not (isinstance(x, str) and _UNION_TAG.match(x))]
    param = ".".join(loc) or None
    if e.get("type") == "missing":
        if param is None:
            return "the request body is empty; send a JSON object", None
        return f"missing required field '{param}'", param
    where = f"'{param}'" if param else "request body"
    if len(loc) < len(raw):  # a union: report the shape that came closest, else that none matched
        field = raw[0]
        same = [x for x in errors if [y for y in x.get("loc", ()) if y != "body"][:1] == [field]]
        close = [x for x in same if not str(x.get("type", "")).endswith("_type")]
        if close:
            return f"invalid value for '{field}': {close[0].get('msg', 'invalid')}", str(field)
        if len(same) > 1:
            return f"invalid value for '{field}': it matches none of the accepted forms (see /docs)", str(field)
    return f"invalid value for {where}: {e.get('msg', 'invalid')}", param
