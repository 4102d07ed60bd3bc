"""The engine thread: the only code that touches ``llm.core``.

The engine core is not thread-safe and a decode step can take a while, so the
UI never calls it. The app puts jobs (generate, abort, stop) on a queue; this
thread loads the model, runs the steps, and posts results back as Textual
messages (``post_message`` is thread-safe). While generating it also builds a
:class:`TierSnapshot` a few times per second, timing itself so the cost of the
live panel can be checked against the decode speed.
"""

from __future__ import annotations

import queue
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Callable

from llmsys.kernels.common.errors import LLMSysError
from llmsys.engine.sampling import SamplingParams
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


@dataclass(frozen=True)
class _Stop:
    pass


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
    )


class EngineWorker:
    """Owns the LLM on a daemon thread; ``post`` receives every message it emits."""

    def __init__(
        self,
        load: Callable[[], Any],
        post: Callable[[Any], Any],
        refresh_hz: float = 4.0,
        history: int = 48,
        text_hz: float = 20.0,
    ):
        self._load = load
        self._post = post
        self._interval = 1.0 / refresh_hz if refresh_hz > 0 else float("inf")
        # Text is posted at most text_hz times a second: every post wakes the UI
        # thread, and a busy UI thread holds the GIL the decode loop needs.
        self._text_interval = 1.0 / text_hz if text_hz > 0 else 0.0
        self._jobs: queue.Queue = queue.Queue()
        self._thread = threading.Thread(target=self._run, name="llmsys-engine", daemon=True)
        self._history: deque[float] = deque(maxlen=history)
        self._ttft: float | None = None
        # The speed the panel shows: the live window while a reply streams, then
        # that reply's decode speed, kept until the next reply starts.
        self._tok_s: float | None = None
        self._context: int | None = None
        self._evicted = 0
        self.llm: Any = None
        self.budgets: dict[str, int | None] = {}
        self.costs = WorkerCosts()

    # -- called from the UI thread ------------------------------------------
    def start(self) -> None:
        self._thread.start()

    def submit(self, job: Generate | Abort | Refresh) -> None:
        self._jobs.put(job)

    def stop(self, timeout: float = 10.0) -> None:
        """Abort what is running, leave the core clean, end the thread."""
        self._jobs.put(_Stop())
        if self._thread.is_alive() and threading.current_thread() is not self._thread:
            self._thread.join(timeout)

    @property
    def alive(self) -> bool:
        return self._thread.is_alive()

    # -- the engine thread ---------------------------------------------------
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

    def _run(self) -> None:
        try:
            self.llm = self._load()
            self.budgets = default_budgets(self.llm.config, self.llm.loaded.device)
            info = model_info(self.llm)
        except Exception as e:  # noqa: BLE001 - shown as a notice; the app stays usable
            self._post(EngineFailed(error_line(e)))
            self._drain_until_stop()
            return
        self._post(EngineReady(info, self._snapshot(False)))
        while True:
            job = self._jobs.get()
            if isinstance(job, _Stop):
                return
            if isinstance(job, Refresh):
                if job.forget_context:
                    self._context = 0
                self._post(SnapshotUpdated(self._snapshot(False)))
            elif isinstance(job, Generate):
                if not self._generate(job):
                    return

    def _drain_until_stop(self) -> None:
        while not isinstance(self._jobs.get(), _Stop):
            pass

    def _encode(self, job: Generate) -> list[int]:
        tok = self.llm.tokenizer
        if job.messages is not None:
            return tok.encode_chat(job.messages)
        return self.llm.encode(job.text or "")

    def _generate(self, job: Generate) -> bool:
        """Run one request to its end; False when a stop was requested meanwhile."""
        core = self.llm.core
        try:
            ids = self._encode(job)
            rid = core.add_request(ids, job.params)
        except Exception as e:  # noqa: BLE001 - context full, bad params: a notice
            self._post(GenerationFailed(job.gen_id, error_line(e)))
            return True
        n_prompt = len(ids)
        self._context = n_prompt
        self._ttft = None
        self._tok_s = None
        t_submit = time.perf_counter()
        last_snap = t_submit
        last_text = 0.0
        pending_text: list[str] = []
        pending_n = 0
        window_tokens = 0
        n_out = 0
        keep_running = True
        final = None
        try:
            while final is None:
                while True:  # apply every pending job before the next step
                    try:
                        j = self._jobs.get_nowait()
                    except queue.Empty:
                        break
                    if isinstance(j, _Stop):
                        keep_running = False
                        core.abort(rid)
                    elif isinstance(j, Abort) and j.gen_id == job.gen_id:
                        core.abort(rid)
                    elif isinstance(j, Generate):  # one at a time: refuse politely
                        self._post(GenerationFailed(j.gen_id, "a reply is still being generated; press Esc to stop it first"))
                t0 = time.perf_counter()
                chunks = core.step()
                t1 = time.perf_counter()
                self.costs.decode_s += t1 - t0
                for ch in chunks:
                    if ch.request_id != rid:
                        continue
                    if ch.token_ids and self._ttft is None:
                        self._ttft = t1 - t_submit
                    n = len(ch.token_ids)
                    n_out += n
                    window_tokens += n
                    self._context = n_prompt + n_out
                    pending_text.append(ch.text)
                    pending_n += n
                    if ch.finished:
                        final = ch
                if pending_n and (final is not None or t1 - last_text >= self._text_interval):
                    self._post(TokensReceived(job.gen_id, "".join(pending_text), pending_n))
                    pending_text, pending_n, last_text = [], 0, t1
                if final is None and t1 - last_snap >= self._interval:  # (a finished request's blocks are already freed)
                    self._tok_s = window_tokens / (t1 - last_snap)
                    self._history.append(self._tok_s)
                    window_tokens = 0
                    last_snap = t1
                    self._post(SnapshotUpdated(self._snapshot(True)))
        except Exception as e:  # noqa: BLE001 - e.g. out of memory mid-step
            core.abort(rid)
            core.step()
            self._post(GenerationFailed(job.gen_id, error_line(e)))
            self._post(SnapshotUpdated(self._snapshot(False)))
            return keep_running
        self.costs.tokens += n_out
        usage, timings = final.usage, final.timings
        if usage is not None:
            self._evicted += usage.evicted_tokens
        self._tok_s = reply_speed(timings, n_out, time.perf_counter() - t_submit)
        self._post(SnapshotUpdated(self._snapshot(False)))
        self._post(
            GenerationDone(
                gen_id=job.gen_id,
                finish_reason=final.finish_reason or "stop",
                prompt_tokens=n_prompt,
                completion_tokens=n_out,
                ttft_s=self._ttft,
                decode_tok_s=timings.decode_tok_s if timings is not None else None,
            )
        )
        return keep_running
