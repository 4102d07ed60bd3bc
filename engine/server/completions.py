"""From a validated request to OpenAI-shaped JSON or SSE.

A :class:`Job` is one HTTP request: ``len(prompts) * params.n`` engine
requests submitted together (so they batch), one asyncio queue their chunks
arrive on, and ``abort_rest`` to cancel whatever has not finished (client
gone, error). Choice ``k`` is prompt ``k // n``, completion ``k % n``; the
engine derives completion ``i``'s generator from the seed (``sample_index``).
"""

from __future__ import annotations

import asyncio
import json
import logging
import math
import time
import uuid
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, AsyncIterator, Callable, Sequence

from fastapi.responses import StreamingResponse

from llmsys.engine.core import TokenConstraint
from llmsys.engine.outputs import CONSTRAINT_FAILED, StreamChunk, Timings
from llmsys.engine.sampling import SamplingParams
from llmsys.engine.server import request_log
from llmsys.engine.server.metrics import Metrics
from llmsys.engine.server.protocol import APIError
from llmsys.engine.server.state import ServerState
from llmsys.engine.server.tools import ToolCall, ToolPlan, ToolStream
from llmsys.engine.server.worker import Interrupted, QueueFullError, ServiceUnavailableError, Submission, asyncio_sink
from llmsys.kernels.common.errors import InvalidParameterError

if TYPE_CHECKING:
    from llmsys.engine.embedding import Pooling
    from llmsys.engine.grammar import GrammarConstraint, GrammarOrText, GrammarSpec

log = logging.getLogger("llmsys.server")
LIVENESS_POLL_S = 0.5  # how often a waiting handler checks that its client and the engine thread are there


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:24]}"


def grammar_constraints(state: ServerState, prompts: list[list[int]], params: SamplingParams,
                        spec: GrammarSpec | None, field: str = "response_format"
                        ) -> list[GrammarConstraint | GrammarOrText] | None:
    """One constraint per completion (prompt-major, as :class:`Job` numbers them), each with
    the token budget it must close its document in: ``max_tokens``, else the context room.
    CPU work (compiling the grammar): run it on the preparation thread. A grammar llguidance
    rejects, or a budget below the format's shortest output, is a 400 naming the field (a grammar
    beside free text, ``spec.free_text``, only the first: the budget leaves the free text)."""
    if spec is None:
        return None
    from llmsys.engine.grammar import GrammarConstraint, GrammarOrText

    make = GrammarConstraint if spec.free_text == "never" else GrammarOrText  # beside a plain answer
    vocab = state.grammar_vocab()
    max_len = state.llm.max_model_len
    evicts = state.llm.core.kv_policy.resolve(params.kv_policy).evicts
    out = []
    for ids in prompts:
        room = max_len if evicts else max_len - len(ids)
        budget = min(room, params.max_tokens) if params.max_tokens is not None else room
        for _ in range(params.n):
            try:
                out.append(make(vocab, spec, budget))
            except InvalidParameterError as e:
                why = str(e)
                if params.max_tokens is None or room < params.max_tokens:
                    why += f" (the prompt leaves room for {room} tokens in this model's {max_len}-token context)"
                raise APIError(400, why, param=field, code="invalid_grammar") from None
    return out


class Job:
    def __init__(
        self,
        state: ServerState,
        resp_id: str,
        prompts: list[list[int]],
        params: SamplingParams,
        constraints: Sequence[TokenConstraint] | None = None,
        pooling: Pooling | None = None,
    ):
        """``constraints``: one per completion (:func:`grammar_constraints`), or None. ``pooling``: an
        embedding job instead (one embedding per prompt, ``EngineClient.embed``; ``params`` unused)."""
        self.state = state
        self.prompts = prompts
        self.n = n = params.n
        self.record = request_log.current()  # the request's log line counts this job's tokens
        if self.record is not None:
            self.record.on_prompts(prompts)
        self.out: asyncio.Queue = asyncio.Queue()
        sink = asyncio_sink(asyncio.get_running_loop(), self.out)
        # An evicting KV policy (the request's, else the server's) slides past the context.
        self.evicts = state.llm.core.kv_policy.resolve(params.kv_policy).evicts
        self.subs: list[Submission] = []
        for ids in prompts if pooling is None else ():
            for j in range(n):
                k = len(self.subs)
                constraint = constraints[k] if constraints is not None else None  # follows one token stream
                self.subs.append(Submission(f"{resp_id}-{k}", k, ids, params, sink, constraint, sample_index=j))
        try:
            if pooling is not None:
                self.subs = state.worker.embed(resp_id, prompts, pooling, sink)
            else:
                state.worker.submit(self.subs)
        except QueueFullError as e:
            raise APIError(429, f"server busy: {e}; retry later", type="rate_limit_error",
                           code="queue_full", headers={"Retry-After": "1"}) from None
        except ServiceUnavailableError as e:
            raise _unavailable(e) from None
        self.done: set[int] = set()
        self.interrupted: dict[int, Interrupted] = {}  # choices the server ended itself, and why
        self._pending: list[tuple[int, Any]] = []  # an item taken by start(), handed out first
        self._checked = time.monotonic()  # when the client and the engine thread were last checked
        self.cached_tokens = 0  # prompt tokens served from the prefix cache, over every choice
        self.evicted_tokens = 0  # KV tokens the eviction policy dropped, over every choice
        self.draft_tokens = self.accepted_draft_tokens = 0  # speculative decoding, over every choice

    async def _next(self, is_disconnected: Callable[[], Any] | None) -> tuple[int, Any] | None:
        """The next item, or None when the client left. Every LIVENESS_POLL_S it also asks
        whether the client is still there (chunks keep coming while it generates, so a check
        only on a quiet queue would never run) and whether the engine thread is, so that a
        dead thread becomes a 503 instead of a handler waiting forever."""
        if self._pending:
            return self._pending.pop()
        while True:
            now = time.monotonic()
            if now - self._checked >= LIVENESS_POLL_S:
                self._checked = now
                if is_disconnected is not None and await is_disconnected():
                    if self.record is not None:
                        self.record.disconnected = True
                    self.abort_rest()
                    return None
                failure = self.state.worker.failure
                if failure is not None:
                    self.abort_rest()
                    raise APIError(503, f"the engine thread stopped ({failure}); restart the server",
                                   type="server_error", code="engine_stopped") from None
            try:
                return await asyncio.wait_for(self.out.get(), timeout=LIVENESS_POLL_S)
            except asyncio.TimeoutError:
                continue

    async def start(self, is_disconnected: Callable[[], Any]) -> bool:
        """Wait for the first news before a streaming response sends its headers, so a
        request that never starts (queued at shutdown, refused by the engine) gets a real
        HTTP status. False when the client left first."""
        item = await self._next(is_disconnected)
        if item is None:
            return False
        idx, what = item
        if isinstance(what, Exception) or (isinstance(what, Interrupted) and not what.chunk.token_ids
                                           and len(self.subs) == 1):
            self.done.add(idx)
            self.abort_rest()
            raise _as_api_error(what)
        self._pending.append(item)
        return True

    async def items(self, is_disconnected: Callable[[], Any] | None = None) -> AsyncIterator[tuple[int, StreamChunk]]:
        """Chunks as they come, until every engine request finished."""
        while len(self.done) < len(self.subs):
            got = await self._next(is_disconnected)
            if got is None:
                return
            idx, item = got
            if isinstance(item, Exception):
                self.done.add(idx)
                self.abort_rest()
                raise _as_api_error(item)
            if isinstance(item, Interrupted):
                self.interrupted[idx] = item
                item = item.chunk
            if item.finished:
                self.done.add(idx)
                if item.usage is not None and idx % self.n == 0:  # one prompt's n samples share it
                    self.cached_tokens += item.usage.cached_tokens
                if item.usage is not None:
                    self.evicted_tokens += item.usage.evicted_tokens
                    self.draft_tokens += item.usage.draft_tokens
                    self.accepted_draft_tokens += item.usage.accepted_draft_tokens
            if self.record is not None:
                self.record.on_chunk(item, idx % self.n == 0)
            yield idx, item

    def abort_rest(self) -> None:
        for s in self.subs:
            if s.index not in self.done:
                self.state.worker.abort(s.request_id)
                self.done.add(s.index)

    def usage(self, completion_tokens: int) -> dict[str, Any]:
        p = sum(len(ids) for ids in self.prompts)
        return {"prompt_tokens": p, "completion_tokens": completion_tokens, "total_tokens": p + completion_tokens,
                "prompt_tokens_details": {"cached_tokens": self.cached_tokens},
                # OpenAI's fields for predicted outputs, here the speculative drafts the model verified
                "completion_tokens_details": {
                    "accepted_prediction_tokens": self.accepted_draft_tokens,
                    "rejected_prediction_tokens": self.draft_tokens - self.accepted_draft_tokens},
                "evicted_tokens": self.evicted_tokens}  # llmsys extension: the KV policy's evictions


def _unavailable(e: ServiceUnavailableError) -> APIError:
    return APIError(503, str(e), type="server_error", code=e.code, headers={"Retry-After": "1"})


def _as_api_error(item: Exception | Interrupted) -> Exception:
    """What a handler raises for an item that ends its request before any output."""
    if isinstance(item, Interrupted):
        return APIError(503, item.message, type="server_error", code=item.code)
    if isinstance(item, ServiceUnavailableError):
        return _unavailable(item)
    return item  # APIError / LLMSysError: the app's handlers answer them


def ending_error(job: Job, idx: int, ch: StreamChunk) -> APIError | None:
    """Why a finished choice did not end normally: the server ended it (shutdown, an
    engine failure), or the engine could not go on with it alone (finish_reason
    "error", e.g. its KV fits neither the pool nor a failing offload tier: 503, worth a retry), or the request's
    output constraint reached a dead end (422: the same request would end the same way). None otherwise."""
    it = job.interrupted.get(idx)
    if it is not None:
        return APIError(503, it.message, type="server_error", code=it.code)
    if ch.finish_reason == "error" and ch.error_code == CONSTRAINT_FAILED:  # the request's own format: no retry
        return APIError(422, ch.error or "the output constraint reached a dead end", code=CONSTRAINT_FAILED)
    if ch.finish_reason == "error":
        return APIError(503, ch.error or "the engine could not continue this request", type="server_error",
                        code="request_failed")
    return None


def timings_dict(ts: list[Timings]) -> dict[str, float]:
    """llama.cpp-style ``timings``: prompt/generation speed and TTFT (ms)."""
    ts = [t for t in ts if t is not None] or [Timings()]
    prompt_n = sum(t.prompt_tokens for t in ts)
    prompt_s = max(t.prefill_s for t in ts)
    gen_n = sum(t.generated_tokens for t in ts)
    dec_s = max(t.decode_s for t in ts)
    dec_n = sum(max(t.generated_tokens - 1, 0) for t in ts)
    return {
        "prompt_n": prompt_n,
        "prompt_ms": prompt_s * 1000,
        "prompt_per_second": prompt_n / prompt_s if prompt_s > 0 else 0.0,
        "predicted_n": gen_n,
        "predicted_ms": dec_s * 1000,
        "predicted_per_second": dec_n / dec_s if dec_s > 0 else 0.0,
        "ttft_ms": min(t.ttft_s for t in ts) * 1000,
    }


def finish_details(reason: str | None, timings: Timings | None, n_ctx: int, evicts: bool = False) -> dict[str, Any] | None:
    """Say so when the context, not ``max_tokens``, ended a choice (``finish_reason`` is
    ``length`` either way): never a silent truncation. None otherwise, and None under an
    evicting KV policy (``evicts``), which slides past the context instead."""
    if reason != "length" or timings is None or evicts:
        return None
    n = timings.prompt_tokens + timings.generated_tokens
    if n < n_ctx:
        return None
    return {
        "type": "context_full", "n_tokens": n, "n_ctx": n_ctx,
        "message": f"the context is full ({n} of {n_ctx} tokens); start the server with a larger --max-model-len "
                   "(up to the model's limit) or --kv-policy sink:4,window:N to continue past it",
    }


# -- logprobs in both wire shapes ------------------------------------------------
# Under a grammar (response_format, tool_choice) the logits of forbidden tokens are -inf before the logprobs are
# taken (they describe the constrained distribution); JSON has no -inf, so
# such values go out as -9999.0, the floor OpenAI's API uses.


def _lp(v: float) -> float:
    return v if math.isfinite(v) else -9999.0



def chat_logprobs(state: ServerState, lps: list, top: int) -> dict[str, Any]:
    def entry(tid: int, lp: float) -> dict[str, Any]:
        s = state.token_text(tid)
        return {"token": s, "logprob": _lp(lp), "bytes": list(s.encode("utf-8"))}

    content = []
    for lp in lps:
        e = entry(lp.token_id, lp.logprob)
        e["top_logprobs"] = [entry(t, v) for t, v in lp.top[:top]]
        content.append(e)
    return {"content": content}


def completion_logprobs(state: ServerState, lps: list, offset: int) -> tuple[dict[str, Any], int]:
    tokens, token_lps, tops, offsets = [], [], [], []
    for lp in lps:
        s = state.token_text(lp.token_id)
        tokens.append(s)
        token_lps.append(_lp(lp.logprob))
        tops.append({state.token_text(t): _lp(v) for t, v in lp.top})
        offsets.append(offset)
        offset += len(s)
    return {"tokens": tokens, "token_logprobs": token_lps, "top_logprobs": tops, "text_offset": offsets}, offset


# -- responses ---------------------------------------------------------------------


async def collect(job: Job, is_disconnected: Callable[[], Any]) -> list[dict[str, Any]]:
    """Run a non-streaming job; per choice: text, tokens, logprobs, finish, timings."""
    res = [{"text": [], "n": 0, "lps": [], "finish": None, "timings": None} for _ in job.subs]
    async for idx, ch in job.items(is_disconnected):
        if ch.finished and (err := ending_error(job, idx, ch)) is not None:
            job.abort_rest()  # no partial 200: the client is told why
            raise err
        r = res[idx]
        r["text"].append(ch.text)
        r["n"] += len(ch.token_ids)
        r["lps"].extend(ch.logprobs)
        if ch.finished:
            r["finish"] = ch.finish_reason
            r["timings"] = ch.timings
    for r in res:
        r["text"] = "".join(r["text"])
    return res


@dataclass(frozen=True)
class Shape:
    """How choices are written back: chat or text completion, tool calls parsed out of the
    text (``tools``, None: plain content), the prompt echoed before a completion (``echo``,
    one text per prompt)."""

    chat: bool
    tools: ToolPlan | None = None
    echo: list[str] | None = None

    def split(self, text: str) -> tuple[str, list[ToolCall]]:
        """A finished chat output's (content, tool calls)."""
        if self.tools is None or self.tools.fmt is None:
            return text, []
        content, calls = self.tools.fmt.parse(text)
        return content, calls if self.tools.parallel else calls[:1]

    def stream(self) -> ToolStream | None:
        return ToolStream(self.tools.fmt) if self.tools is not None and self.tools.fmt is not None else None


MAX_UNSENT_CHUNKS = 1024  # engine chunks a stream may have waiting behind a send that does not complete


class BoundedStream(StreamingResponse):
    """A streaming response that gives up on a client that stops reading.

    Once the socket buffers fill, sending a chunk waits for the client, while the engine goes on
    decoding into the job's queue: a client that never reads would hold its slot to ``max_tokens``.
    A send that has not completed after ``send_timeout_s``, or while ``backlog()`` (the chunks the
    engine has queued for this stream) passes :data:`MAX_UNSENT_CHUNKS`, ends the stream: the body
    generator is closed (its ``finally`` aborts the job, freeing the slot), the connection dropped
    without flushing, one line logged. The server's protocol puts the transport in the scope
    (``llmsys.transport``) for the drop."""

    def __init__(self, content: AsyncIterator[str], send_timeout_s: float, backlog: Callable[[], int] | None = None,
                 metrics: Metrics | None = None, **kwargs: Any):
        super().__init__(content, **kwargs)
        self.send_timeout_s = send_timeout_s
        self.backlog = backlog or (lambda: 0)
        self.metrics = metrics
        self._transport: Any = None
        self._client: Any = None

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        self._transport = scope.get("llmsys.transport")
        self._client = scope.get("client")
        await super().__call__(scope, receive, send)

    async def stream_response(self, send: Any) -> None:
        async def bounded_send(msg: dict) -> None:
            task = asyncio.ensure_future(send(msg))
            t0 = time.monotonic()
            while True:
                done, _ = await asyncio.wait({task}, timeout=min(0.25, self.send_timeout_s))
                if done:
                    return task.result()
                waited = time.monotonic() - t0
                if waited >= self.send_timeout_s or self.backlog() > MAX_UNSENT_CHUNKS:
                    task.cancel()
                    raise _ClientStalled(waited, self.backlog())

        try:
            await super().stream_response(bounded_send)
        except _ClientStalled as e:
            who = f"{self._client[0]}:{self._client[1]}" if self._client else "a client"
            log.warning("stream to %s aborted: the client read nothing for %.1f s while %d chunks waited "
                        "(--send-timeout %g s, at most %d chunks); its slot is freed", who, e.waited, e.backlog,
                        self.send_timeout_s, MAX_UNSENT_CHUNKS)
            if self.metrics is not None:
                self.metrics.count_limit("send_timeout" if e.waited >= self.send_timeout_s else "unsent_backlog")
            await self.body_iterator.aclose()  # the generator's finally aborts the job
            if self._transport is not None:
                self._transport.abort()  # close() would wait to flush to a reader that never reads
                await asyncio.sleep(0)  # let connection_lost mark the cycle disconnected first


class _ClientStalled(Exception):
    def __init__(self, waited: float, backlog: int):
        super().__init__(f"stalled {waited:.1f} s, {backlog} chunks")
        self.waited, self.backlog = waited, backlog


def sse(obj: Any) -> str:
    return f"data: {json.dumps(obj, separators=(',', ':'))}\n\n"


async def stream_events(
    job: Job,
    state: ServerState,
    resp_id: str,
    shape: Shape,
    include_usage: bool,
    logprobs: int | None,
) -> AsyncIterator[str]:
    """SSE frames of a streaming job; ``finally`` aborts what is unfinished,
    which is how a client that disconnects frees its KV blocks."""
    chat = shape.chat
    created = int(time.time())
    obj = "chat.completion.chunk" if chat else "text_completion"
    base = {"id": resp_id, "object": obj, "created": created, "model": state.model_name}
    offsets = [0] * len(job.subs)
    n_out = 0
    timings: list[Timings] = []
    splitters = [shape.stream() for _ in job.subs]  # per choice: tool calls out of the text, or None
    n_calls = [0] * len(job.subs)
    try:
        if chat:
            for i in range(len(job.subs)):
                yield sse({**base, "choices": [{"index": i, "delta": {"role": "assistant", "content": ""},
                                                "logprobs": None, "finish_reason": None}]})
        elif shape.echo:
            for i in range(len(job.subs)):
                text = shape.echo[i // job.n]
                offsets[i] = len(text)
                yield sse({**base, "choices": [{"index": i, "text": text, "logprobs": None, "finish_reason": None}]})
        try:
            async for idx, ch in job.items():
                n_out += len(ch.token_ids)
                if ch.timings is not None:
                    timings.append(ch.timings)
                text, calls = ch.text, []
                sp = splitters[idx]
                if sp is not None:
                    text, calls = sp.feed(ch.text)
                    if ch.finished:
                        rest, late = sp.finish()
                        text, calls = text + rest, calls + late
                    if not shape.tools.parallel:
                        calls = calls[:max(0, 1 - n_calls[idx])]
                if not (text or calls or ch.finished or (logprobs is not None and ch.logprobs)):
                    continue
                lp = None
                if logprobs is not None and ch.logprobs:
                    if chat:
                        lp = chat_logprobs(state, ch.logprobs, logprobs)
                    else:
                        lp, offsets[idx] = completion_logprobs(state, ch.logprobs, offsets[idx])
                finish = ch.finish_reason
                if finish is not None and (n_calls[idx] or calls):
                    finish = "tool_calls"
                choice: dict[str, Any] = {"index": idx, "logprobs": lp, "finish_reason": finish}
                details = finish_details(ch.finish_reason, ch.timings, state.llm.max_model_len, job.evicts)
                if details is not None:
                    choice["finish_details"] = details
                if chat:
                    delta: dict[str, Any] = {"content": text} if text else {}
                    if calls:
                        delta["tool_calls"] = [c.openai(n_calls[idx] + k) for k, c in enumerate(calls)]
                        n_calls[idx] += len(calls)
                    choice["delta"] = delta
                else:
                    choice["text"] = text
                frame = {**base, "choices": [choice]}
                if ch.finished and (err := ending_error(job, idx, ch)) is not None:
                    frame["error"] = err.body()["error"]  # the final chunk says why it ended early
                if ch.finished and len(job.done) == len(job.subs):
                    frame["timings"] = timings_dict(timings)
                    if chat and (template := state.llm.tokenizer.default_chat_template) is not None:
                        frame["chat_template"] = template.label  # llmsys extension: `llmsys run`'s stats line
                yield sse(frame)
        except Exception as e:  # mid-stream: headers are sent, so report in-band
            err = e if isinstance(e, APIError) else APIError(500, str(e), type="server_error")
            if not isinstance(e, APIError):
                log.exception("a stream failed")
            yield sse(err.body())
        if include_usage:
            yield sse({**base, "choices": [], "usage": job.usage(n_out), "timings": timings_dict(timings)})
        yield "data: [DONE]\n\n"
    finally:
        job.abort_rest()
