"""Typed results every front end consumes (stdout, TUI, SSE, bench)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from llmsys.engine.sampling import TokenLogprobs

if TYPE_CHECKING:
    import torch


@dataclass
class Usage:
    prompt_tokens: int = 0
    completion_tokens: int = 0
    evicted_tokens: int = 0  # KV tokens dropped by an eviction policy
    cached_tokens: int = 0  # prompt tokens whose KV came from the prefix cache (not computed)
    draft_tokens: int = 0  # speculative decoding: drafts the target verified
    accepted_draft_tokens: int = 0  # of those, the ones kept (part of completion_tokens)

    @property
    def total_tokens(self) -> int:
        return self.prompt_tokens + self.completion_tokens


@dataclass
class Timings:
    """Seconds measured inside the engine (tokenization excluded)."""

    ttft_s: float = 0.0  # arrival -> first token sampled
    prefill_s: float = 0.0  # first scheduled -> prompt fully processed
    decode_s: float = 0.0  # first token -> last token
    total_s: float = 0.0
    prompt_tokens: int = 0
    generated_tokens: int = 0

    @property
    def prompt_tok_s(self) -> float:
        return self.prompt_tokens / self.prefill_s if self.prefill_s > 0 else 0.0

    @property
    def decode_tok_s(self) -> float:
        # The first token comes out of prefill; decode speed counts the rest.
        n = self.generated_tokens - 1
        return n / self.decode_s if n > 0 and self.decode_s > 0 else 0.0


# StreamChunk.error_code of a request ended with finish_reason "error": the engine could not go on with it
# (its KV, a failed step), or its output constraint reached a dead end (the request's own format).
REQUEST_FAILED = "request_failed"
CONSTRAINT_FAILED = "constraint_failed"


@dataclass
class StreamChunk:
    """One step's news for one request."""

    request_id: str
    text: str  # new text since the last chunk (stop strings never included)
    token_ids: list[int]  # new tokens since the last chunk
    logprobs: list[TokenLogprobs] = field(default_factory=list)
    finish_reason: str | None = None  # "stop" | "length" | "abort" | "error" when finished
    usage: Usage | None = None  # on the final chunk
    timings: Timings | None = None  # on the final chunk
    # With finish_reason "error": one line saying why this request (and only it) could not go on,
    # e.g. its KV no longer fits once the KV offload tier's disk filled up (engine.scheduler).
    error: str | None = None
    # With finish_reason "error": "constraint_failed" when the request's output constraint reached a dead end
    # (the request's own format: not worth a retry), else "request_failed" (engine.core)
    error_code: str | None = None
    # An embedding request's final chunk (llmsys.engine.embedding): the pooled vector [hidden] float32
    embedding: torch.Tensor | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestOutput:
    """A finished request: one completion of one prompt.

    ``index`` is which of the prompt's ``SamplingParams.n`` completions this is
    (``LLM.generate`` returns the ``n`` of each prompt next to each other).
    """

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    text: str
    token_ids: list[int]
    finish_reason: str
    usage: Usage
    timings: Timings
    logprobs: list[TokenLogprobs] = field(default_factory=list)
    index: int = 0  # which of the prompt's n completions
    error: str | None = None  # finish_reason "error": the final chunk's one-line reason
