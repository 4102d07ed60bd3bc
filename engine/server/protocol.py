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

import re
from typing import Annotated, Any, Literal, Union

from pydantic import BaseModel, ConfigDict, Field, model_validator

from llmsys.engine.sampling import MAX_LOGPROBS

MAX_N = 16  # choices per request
MAX_STOP = 4  # stop sequences per request (OpenAI's limit)
MAX_PROMPTS = 64  # prompts per /v1/completions request (and completions: prompts x n)

# 400 codes for limits that depend on the loaded model or on two fields together,
# which the OpenAPI schema cannot state; every other 400 means the body broke the schema.
SEMANTIC_CODES = (
    "context_length_exceeded",  # the prompt's tokens do not fit this model's context
    "no_chat_template",  # a base model has no chat template to render messages with
    "chat_template_error",  # the model's template rejected or could not render the conversation
    "too_many_choices",  # prompts x n over MAX_PROMPTS
    "conflicting_parameters",  # min_tokens > max_tokens
    "invalid_kv_policy",  # a well-formed kv_policy this engine cannot run (its pool, its block size)
    "invalid_prompt",  # text that encodes to no tokens, or token ids outside the vocabulary
)
# The characters of --kv-policy syntax; which words and numbers make a policy is the
# parser's (its 400s name the problem, code invalid_kv_policy).
KV_POLICY_PATTERN = r"^[A-Za-z0-9:.,; ]*$"
# torch.Generator takes -2**63..2**64-1, but a JSON number past 2**53 may arrive as a float that
# rounds across the bound (1.8446744073709552e19 is 2**64), so the published range is the exact one.
SEED_MIN, SEED_MAX = -(2**53 - 1), 2**53 - 1


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


_INT_FIELDS = ("max_tokens", "n", "seed", "top_k", "min_tokens", "max_completion_tokens", "top_logprobs",
               "logprobs", "prompt")


class StreamOptions(BaseModel):
    model_config = _STRICT
    include_usage: bool = False


class ResponseFormat(BaseModel):
    model_config = _STRICT
    type: Literal["text", "json_object"] = "text"


class TextPart(BaseModel):
    model_config = _STRICT
    type: Literal["text"] = "text"
    text: str


class ChatMessage(BaseModel):
    model_config = _STRICT
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: Union[str, list[TextPart], None] = None
    name: str | None = None

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(p.text for p in self.content)


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
    temperature: float | None = Field(None, ge=0.0, le=2.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    n: int = Field(1, ge=1, le=MAX_N)
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: Union[Annotated[str, Field(min_length=1)], Annotated[list[Annotated[str, Field(min_length=1)]],
                                                                Field(max_length=MAX_STOP)], None] = Field(None)
    seed: int | None = Field(None, ge=SEED_MIN, le=SEED_MAX)
    presence_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    frequency_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    user: str | None = None
    top_k: int | None = Field(None, ge=-1)
    min_p: float | None = Field(None, ge=0.0, le=1.0)
    repetition_penalty: float | None = Field(None, gt=0.0, le=10.0)
    ignore_eos: bool = False
    min_tokens: int = Field(0, ge=0)
    kv_policy: str | None = Field(
        None, max_length=200, pattern=KV_POLICY_PATTERN,
        description="llmsys extension: this request's KV eviction policy, in --kv-policy syntax: full, window:N, "
                    "sink:S,window:N, h2o:H,recent:R or snapkv:N (budgets in tokens, or sizes like 64KiB). "
                    "Default: the server's --kv-policy. quest:K is engine-wide (server flag only).",
        examples=["sink:4,window:252"],
    )


class ChatCompletionRequest(_Common):
    messages: list[ChatMessage] = Field(..., min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    response_format: ResponseFormat | None = None


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
