"""One log line per request: route, model, status, tokens, time to first token, duration.

:class:`GuardMiddleware` opens a :class:`RequestRecord` for every HTTP request and writes its
line when the response is over (for a stream: when the last chunk went out, or the client
left, which the line says). The generation's figures come from the request's
:class:`~llmsys.engine.server.completions.Job`, which finds the record through a context
variable: the handler, its stream and the job run in the middleware's task or in tasks made
from it, so each sees its own request's record and no route has to pass it along.
"""

from __future__ import annotations

import contextvars
import logging
import time
from dataclasses import dataclass, field
from typing import Any

from llmsys.engine.outputs import StreamChunk

log = logging.getLogger("llmsys.server")

QUIET_PATHS = ("/health", "/metrics")  # polled by monitors: logged at debug only

_current: contextvars.ContextVar[RequestRecord | None] = contextvars.ContextVar("llmsys_request", default=None)


@dataclass
class RequestRecord:
    """What one request did; filled by the middleware and the generation it ran."""

    method: str
    path: str
    client: str
    started: float = field(default_factory=time.monotonic)
    model: str | None = None
    prompt_tokens: int = 0
    generated_tokens: int = 0
    cached_tokens: int = 0
    first_token_at: float | None = None
    stream: bool = False  # the response body came in several parts
    complete: bool = False  # the last part of the body was sent
    disconnected: bool = False  # the client left before the generation ended

    def on_prompts(self, prompts: list[list[int]]) -> None:
        self.prompt_tokens += sum(len(p) for p in prompts)

    def on_chunk(self, chunk: StreamChunk, first_of_prompt: bool) -> None:
        """A chunk the client is given; ``first_of_prompt``: the first of its prompt's ``n``
        samples (they share the prompt, so its cached tokens count once)."""
        if chunk.token_ids and self.first_token_at is None:
            self.first_token_at = time.monotonic()
        self.generated_tokens += len(chunk.token_ids)
        if first_of_prompt and chunk.usage is not None:
            self.cached_tokens += chunk.usage.cached_tokens

    @property
    def generated(self) -> bool:
        return self.prompt_tokens > 0

    def line(self, status: int, now: float | None = None) -> str:
        """``POST /v1/chat/completions 200 model=M prompt=37 (cached 0) generated=128 ttft=88 ms 1.93 s``."""
        now = time.monotonic() if now is None else now
        parts = [f"{self.method} {self.path} {status}"]
        if self.model:
            parts.append(f"model={self.model}")
        if self.generated:
            cached = f" (cached {self.cached_tokens})" if self.cached_tokens else ""
            parts.append(f"prompt={self.prompt_tokens}{cached} generated={self.generated_tokens}")
            if self.first_token_at is not None:
                parts.append(f"ttft={(self.first_token_at - self.started) * 1000:.0f} ms")
        parts.append(f"{now - self.started:.3f} s")
        if self.stream:
            parts.append("stream")
        if self.disconnected:
            parts.append("ended early: the client disconnected")
        elif self.stream and not self.complete:
            parts.append("ended before its last chunk: the client disconnected or stopped reading")
        parts.append(f"from {self.client}")
        return " ".join(parts)


def begin(scope: dict[str, Any]) -> tuple[RequestRecord, contextvars.Token]:
    c = scope.get("client")
    rec = RequestRecord(scope.get("method", "?"), scope.get("path", ""), f"{c[0]}:{c[1]}" if c else "-")
    return rec, _current.set(rec)


def current() -> RequestRecord | None:
    """The record of the request this task serves (None outside a request, e.g. in tests)."""
    return _current.get()


def end(rec: RequestRecord, token: contextvars.Token, status: int) -> None:
    _current.reset(token)
    level = logging.DEBUG if rec.path in QUIET_PATHS else logging.INFO
    if log.isEnabledFor(level):
        log.log(level, "%s", rec.line(status))
