"""OpenAI wire format: request models (pydantic, so /openapi.json is real)
and the error type every handler raises.

Why pydantic models with tight bounds instead of ``dict`` bodies: FastAPI
publishes them as the OpenAPI schema (which the schema fuzzer in the tests
drives), and a wrong type or out-of-range value is rejected before any engine
work with a 400 naming the field. Unknown fields are ignored (the official
client and other tools send extras), the way OpenAI-compatible servers do.
"""

from __future__ import annotations

from typing import Any, Literal, Union

from pydantic import BaseModel, ConfigDict, Field

from llmsys.engine.sampling import MAX_LOGPROBS

MAX_N = 16  # choices per request
MAX_STOP = 4  # stop sequences per request (OpenAI's limit)
SEED_MIN, SEED_MAX = -(2**63), 2**64 - 1  # what torch.Generator.manual_seed takes


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


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="ignore")
    include_usage: bool = False


class ResponseFormat(BaseModel):
    model_config = ConfigDict(extra="ignore")
    type: Literal["text", "json_object"] = "text"


class TextPart(BaseModel):
    model_config = ConfigDict(extra="ignore")
    type: Literal["text"] = "text"
    text: str


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore")
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

    model_config = ConfigDict(extra="ignore")

    model: str | None = None
    max_tokens: int | None = Field(None, ge=1, description="tokens to generate at most")
    temperature: float | None = Field(None, ge=0.0, le=2.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    n: int = Field(1, ge=1, le=MAX_N)
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: Union[str, list[str], None] = Field(None)
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
        None, max_length=200,
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


class CompletionRequest(_Common):
    prompt: Union[str, list[str], list[int], list[list[int]]]
    logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    response_format: ResponseFormat | None = None


def stop_list(stop: str | list[str] | None) -> tuple[str, ...]:
    if stop is None:
        return ()
    items = [stop] if isinstance(stop, str) else list(stop)
    if len(items) > MAX_STOP:
        raise APIError(400, f"'stop' has {len(items)} sequences; at most {MAX_STOP} are allowed", param="stop")
    if any(not s for s in items):
        raise APIError(400, "'stop' sequences must be non-empty strings", param="stop")
    return tuple(items)


def validation_message(errors: list[dict[str, Any]]) -> tuple[str, str | None]:
    """One line naming the first offending field (from pydantic's errors)."""
    if not errors:
        return "invalid request body", None
    e = errors[0]
    if e.get("type") == "json_invalid":
        return f"request body is not valid JSON: {e.get('ctx', {}).get('error', e.get('msg'))}", None
    loc = [str(x) for x in e.get("loc", ()) if x != "body"]
    param = ".".join(loc) or None
    if e.get("type") == "missing":
        return f"missing required field '{param}'", param
    where = f"'{param}'" if param else "request body"
    return f"invalid value for {where}: {e.get('msg', 'invalid')}", param
