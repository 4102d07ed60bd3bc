"""The chat's engine thread: :class:`~llmsys.engine.client.EngineClient` posting Textual messages.

The client (the same one the server uses) owns the thread, the core, admission, aborts and
errors; this module turns the app's jobs into its calls and its outcomes into Textual messages
(``post_message`` is thread-safe). It loads the model on the engine thread (a failure becomes
a notice), allows one reply at a time, posts text at most ``text_hz`` times a second, and while
generating posts a :class:`TierSnapshot` ``refresh_hz`` times a second, timing itself so the cost
of the live panel can be checked against the decode speed.

The screen shares the process, and the GIL, with the decode loop: each frame Textual draws
holds the GIL for milliseconds, and every GIL hand-over makes the engine thread wait (on two
cores with two compute threads it also takes a core from them). So the rates are low, and a
snapshot carries the text that is waiting, so that the screen draws both in one frame.
``benchmarks/chat_vs_run.py`` compares the app's decode speed with ``llmsys run``'s.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Callable

from llmsys.engine.client import EngineClient, Interrupted, Outcome, Submission
from llmsys.engine.core import EngineCore
from llmsys.engine.outputs import StreamChunk
from llmsys.engine.sampling import SamplingParams
from llmsys.kernels.common.errors import LLMSysError
from llmsys.tui.info import weight_format
from llmsys.tui.messages import (
    EngineFailed,
    EngineReady,
    GenerationDone,
    GenerationFailed,
    ModelInfo,
    SnapshotUpdated,
    TokensReceived,
)
from llmsys.tui.snapshot import PerfStats, TierSnapshot, default_budgets, snapshot_from_engine
from llmsys.tui.status_line import stored_weights


@dataclass(frozen=True)
class Generate:
    """Generate a reply: ``messages`` go through the chat template, ``text`` is a raw completion prompt."""

    gen_id: int
    params: SamplingParams
    messages: list[dict[str, str]] | None = None
    text: str | None = None


@dataclass(frozen=True)
class Abort:
    gen_id: int


@dataclass(frozen=True)
class Refresh:
    """Post a fresh snapshot now (the app asks after /reset, on demand in tests).

    ``forget_context``: the conversation was cleared, so no tokens are in context.
    """

    forget_context: bool = False


@dataclass
class WorkerCosts:
    """Seconds spent by the engine thread, to measure the panel's overhead."""

    decode_s: float = 0.0  # inside core.step() while generating
    snapshot_s: float = 0.0  # building snapshots
    snapshots: int = 0
    tokens: int = 0
    history: list[float] = field(default_factory=list)


def error_line(e: BaseException) -> str:
    """One readable line for a notice (never a traceback)."""
    msg = str(e).strip().splitlines()[0] if str(e).strip() else ""
    if isinstance(e, LLMSysError):
        return msg or type(e).__name__
    return f"{type(e).__name__}: {msg}" if msg else type(e).__name__


def reply_speed(timings: Any, n_out: int, elapsed_s: float) -> float | None:
    """A finished reply's decode speed in tokens/s: the engine's own timing when
    it has one (prefill excluded), else tokens over wall time; None for no tokens."""
    if timings is not None and timings.generated_tokens > 1 and timings.decode_s > 0:
        return float(timings.decode_tok_s)
    return n_out / elapsed_s if n_out and elapsed_s > 0 else None


def model_info(llm: Any) -> ModelInfo:
    loaded = llm.loaded
    name = str(getattr(loaded, "path", llm.config.model)).rstrip("/").split("/")[-1]
    return ModelInfo(
        name=name,
        dtype=str(loaded.dtype).replace("torch.", ""),
        quant=llm.config.quant.name,
        device=str(loaded.device),
        weight_format=weight_format(loaded.path, getattr(loaded, "stored_formats", None)),
        n_layers=int(loaded.args.num_hidden_layers),
        max_len=int(llm.max_model_len),
        is_chat=llm.tokenizer.chat_template is not None,
        stored_as=stored_weights(getattr(loaded, "stored_formats", None), llm.config.quant.name,
                                 str(loaded.dtype).replace("torch.", "")),
    )


@dataclass
class _Reply:
    """The reply in flight (touched on the engine thread only)."""

    gen_id: int
    request_id: str
    n_prompt: int
    t_submit: float
    last_snap: float
    last_text: float = 0.0
    pending_text: list[str] = field(default_factory=list)
    pending_n: int = 0
    window_tokens: int = 0
    n_out: int = 0


class EngineWorker(EngineClient):
    """Owns the LLM on the engine client's thread; ``post`` receives every message it emits."""

    owner = "the chat"

    def __init__(
        self,
        load: Callable[[], Any],
        post: Callable[[Any], Any],
        refresh_hz: float = 4.0,
        history: int = 48,
        text_hz: float = 8.0,
    ):
        super().__init__(load=self._load_engine, max_concurrency=1, max_queue=0)  # one reply at a time
        self._load_llm = load
        self._post = post
        self._interval = 1.0 / refresh_hz if refresh_hz > 0 else float("inf")
        # Text is posted at most text_hz times a second: every post wakes the UI
        # thread, and a busy UI thread holds the GIL the decode loop needs.
        self._text_interval = 1.0 / text_hz if text_hz > 0 else 0.0
        self._history: deque[float] = deque(maxlen=history)
        self._ttft: float | None = None
        # The speed the panel shows: the live window while a reply streams, then
        # that reply's decode speed, kept until the next reply starts.
        self._tok_s: float | None = None
        self._context: int | None = None
        self._evicted = 0
        self._reply: _Reply | None = None
        self._info: ModelInfo | None = None
        self.llm: Any = None
        self.budgets: dict[str, int | None] = {}
        self.costs = WorkerCosts()

    # -- called from the UI thread ------------------------------------------
    def ask(self, job: Generate | Abort | Refresh) -> None:
        if isinstance(job, Abort):
            self.abort(_request_id(job.gen_id))
        elif isinstance(job, Generate):
            self.call(lambda: self._start(job))
        else:
            self.call(lambda: self._refresh(job))

    @property
    def alive(self) -> bool:
        return self.is_alive()

    # -- the engine thread ---------------------------------------------------
    def _load_engine(self) -> EngineCore:
        self.llm = self._load_llm()
        self.budgets = default_budgets(self.llm.config, self.llm.loaded.device)
        self._info = model_info(self.llm)
        return self.llm.core

    def on_ready(self) -> None:
        self._post(EngineReady(self._info, self._snapshot(False)))

    def on_load_failed(self, e: Exception) -> None:
        self._post(EngineFailed(error_line(e)))  # shown as a notice; the app stays usable

    def _snapshot(self, generating: bool) -> TierSnapshot:
        t0 = time.perf_counter()
        perf = PerfStats(
            tok_s=self._tok_s,
            tok_s_history=tuple(self._history),
            ttft_s=self._ttft,
            tokens_in_context=self._context,
            evicted_tokens=self._evicted,
            generating=generating,
        )
        snap = snapshot_from_engine(self.llm, self.budgets, perf)
        self.costs.snapshot_s += time.perf_counter() - t0
        self.costs.snapshots += 1
        return snap

    def _refresh(self, job: Refresh) -> None:
        if job.forget_context:
            self._context = 0
        self._post(SnapshotUpdated(self._snapshot(self._reply is not None)))

    def _encode(self, job: Generate) -> list[int]:
        tok = self.llm.tokenizer
        if job.messages is not None:
            return tok.encode_chat(job.messages)
        return self.llm.encode(job.text or "")

    def _start(self, job: Generate) -> None:
        if self._reply is not None:  # one at a time: refuse politely
            self._post(GenerationFailed(job.gen_id, "a reply is still being generated; press Esc to stop it first"))
            return
        try:
            ids = self._encode(job)
            sub = Submission(_request_id(job.gen_id), job.gen_id, ids, job.params, self._deliver)
            now = time.perf_counter()
            self._reply = _Reply(job.gen_id, sub.request_id, len(ids), now, now)
            self.submit([sub])
        except Exception as e:  # noqa: BLE001 - context full, bad params, the thread gone: a notice
            self._reply = None
            self._post(GenerationFailed(job.gen_id, error_line(e)))
            return
        self._context = len(ids)
        self._ttft = None
        self._tok_s = None

    def on_step(self, seconds: float) -> None:
        if self._reply is not None:
            self.costs.decode_s += seconds

    def on_tick(self) -> None:
        r = self._reply
        now = time.perf_counter()
        if r is not None and now - r.last_snap >= self._interval:
            self._tok_s = r.window_tokens / (now - r.last_snap)
            self._history.append(self._tok_s)
            r.window_tokens = 0
            r.last_snap = now
            if r.pending_n:  # with the snapshot, so the screen draws both in one frame
                self._flush_text(r, now)
            self._post(SnapshotUpdated(self._snapshot(True)))

    def _flush_text(self, r: _Reply, now: float) -> None:
        self._post(TokensReceived(r.gen_id, "".join(r.pending_text), r.pending_n))
        r.pending_text, r.pending_n, r.last_text = [], 0, now

    def _deliver(self, gen_id: int, item: Outcome) -> None:
        r = self._reply
        if r is None or r.gen_id != gen_id:
            return
        if not isinstance(item, StreamChunk):  # refused at admission (context full), or ended by the client
            self._reply = None
            why = item.message if isinstance(item, Interrupted) else error_line(item)
            self._post(GenerationFailed(gen_id, why))
            self._post(SnapshotUpdated(self._snapshot(False)))
            return
        now = time.perf_counter()
        n = len(item.token_ids)
        if n and self._ttft is None:
            self._ttft = now - r.t_submit
        r.n_out += n
        r.window_tokens += n
        self._context = r.n_prompt + r.n_out
        r.pending_text.append(item.text)
        r.pending_n += n
        if r.pending_n and (item.finished or now - r.last_text >= self._text_interval):
            self._flush_text(r, now)
        if item.finished:
            self._done(r, item)

    def _done(self, r: _Reply, final: StreamChunk) -> None:
        self._reply = None
        self.costs.tokens += r.n_out
        usage, timings = final.usage, final.timings
        if usage is not None:
            self._evicted += usage.evicted_tokens
        self._tok_s = reply_speed(timings, r.n_out, time.perf_counter() - r.t_submit)
        self._post(SnapshotUpdated(self._snapshot(False)))
        self._post(
            GenerationDone(
                gen_id=r.gen_id,
                finish_reason=final.finish_reason or "stop",
                prompt_tokens=r.n_prompt,
                completion_tokens=r.n_out,
                ttft_s=self._ttft,
                decode_tok_s=timings.decode_tok_s if timings is not None else None,
            )
        )


def _request_id(gen_id: int) -> str:
    return f"chat-{gen_id}"
