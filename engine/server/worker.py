"""The engine thread: the only thread that touches the :class:`EngineCore`.

HTTP handlers never call the core (it is not thread-safe). They build
:class:`Submission` objects and hand them over through a thread-safe inbox;
aborts (client gone) travel the same way. The worker drains the inbox between
steps, admits waiting submissions while fewer than ``max_concurrency`` run,
calls ``core.step()`` -- which batches every running request together
(continuous batching) -- and relays each chunk to the owning handler's
asyncio queue with ``loop.call_soon_threadsafe``.

Admission control is here too, so it is atomic with the engine's view: a
submission is refused (:class:`QueueFullError`, HTTP 429) when running +
queued would exceed ``max_concurrency + max_queue``.

Every path of the thread is guarded: an exception in one step fails the
running requests (each gets a final chunk saying why) and the thread goes on;
an exception anywhere else is logged and, if it escapes the loop, every
request still waiting is told before the thread ends, so no handler waits on
a queue nobody fills. :meth:`EngineWorker.health` is what ``/health`` reports:
whether the thread runs, and how long the current step has taken.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any

from llmsys.engine.core import EngineCore, TokenConstraint
from llmsys.kernels.common.errors import LLMSysError
from llmsys.engine.outputs import StreamChunk
from llmsys.engine.sampling import SamplingParams
from llmsys.engine.server.metrics import Metrics, layer_placement, memory_budgets
from llmsys.engine.server.protocol import redact_paths

log = logging.getLogger("llmsys.server")


class QueueFullError(Exception):
    """Every slot and queue place is taken; the client should retry later."""


class ServiceUnavailableError(Exception):
    """The server cannot take or finish the request: shutting down, or the engine thread stopped (HTTP 503)."""

    def __init__(self, message: str, code: str):
        super().__init__(message)
        self.code = code


@dataclass(frozen=True)
class Interrupted:
    """The server ended a request itself (shutdown, an engine failure): its final chunk, and why."""

    chunk: StreamChunk
    code: str  # "server_shutdown" | "engine_error"
    message: str


@dataclass(frozen=True)
class EngineHealth:
    alive: bool  # the engine thread runs
    fatal: str | None  # why it stopped, when it stopped on an error
    stopping: bool  # SIGTERM received
    step_s: float | None  # how long the step now running has taken (None between steps)
    loop_age_s: float  # since the loop last went round (it wakes at least every 0.5 s when idle)
    running: int
    queued: int


@dataclass
class Submission:
    """One engine request and where its chunks go.

    ``index`` is the choice index within the HTTP request (``n`` > 1, or a
    batch of prompts); items put on ``out`` are ``(index, StreamChunk)``,
    ``(index, Interrupted)`` or ``(index, Exception)``.
    """

    request_id: str
    index: int
    prompt_ids: list[int]
    params: SamplingParams
    loop: asyncio.AbstractEventLoop
    out: asyncio.Queue
    constraint: TokenConstraint | None = None
    sample_index: int = 0  # which of the prompt's params.n completions (chooses the generator)
    arrival: float = field(default_factory=time.perf_counter)
    last_token: float | None = None
    finished: bool = False
    interrupt: tuple[str, str] | None = None  # (code, message) once the server decided to end it


_SHUTDOWN = "the server is shutting down"


class EngineWorker(threading.Thread):
    def __init__(self, core: EngineCore, metrics: Metrics, max_concurrency: int, max_queue: int):
        super().__init__(name="llmsys-engine", daemon=True)
        self.core = core
        self.metrics = metrics
        self.max_concurrency = max(1, min(max_concurrency, core.config.max_num_seqs))
        self.max_queue = max(0, max_queue)
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()
        self._lock = threading.Lock()  # guards _in_system
        self._in_system = 0  # submitted and not yet finished (queued + running)
        self._waiting: deque[Submission] = deque()  # accepted, not yet in the core
        self._active: dict[str, Submission] = {}  # in the core
        self._stopping = threading.Event()
        self._deadline: float | None = None  # shutdown: running requests end at this monotonic time
        self._beat = time.monotonic()
        self._step_start: float | None = None
        self._fatal: str | None = None

    # -- called from HTTP handlers (any thread) -------------------------------
    def submit(self, subs: list[Submission]) -> None:
        """Queue all of ``subs`` or none (raises :class:`QueueFullError` or
        :class:`ServiceUnavailableError`)."""
        with self._lock:
            if self._fatal is not None or not self.is_alive():
                raise ServiceUnavailableError(f"the engine thread stopped ({self._fatal or 'exited'}); "
                                              "restart the server", "engine_stopped")
            if self._stopping.is_set():
                raise ServiceUnavailableError(f"{_SHUTDOWN}; retry against another instance or later",
                                              "server_shutdown")
            if self._in_system + len(subs) > self.max_concurrency + self.max_queue:
                raise QueueFullError(
                    f"{self._in_system} requests are running or queued (limit "
                    f"{self.max_concurrency} running + {self.max_queue} queued)"
                )
            self._in_system += len(subs)
        for s in subs:
            self._inbox.put(("add", s))

    def abort(self, request_id: str) -> None:
        self._inbox.put(("abort", request_id))

    def begin_shutdown(self, grace_s: float) -> None:
        """Refuse new requests now, end the queued ones (503), let running ones finish for ``grace_s``."""
        self._stopping.set()
        self._inbox.put(("shutdown", time.monotonic() + max(0.0, grace_s)))

    def stop(self, timeout: float = 10.0) -> None:
        """Abort whatever is left and end the thread."""
        self._stopping.set()
        self._inbox.put(("stop", None))
        if self.is_alive():
            self.join(timeout)

    def health(self) -> EngineHealth:
        now = time.monotonic()
        start = self._step_start
        return EngineHealth(alive=self.is_alive(), fatal=self._fatal, stopping=self._stopping.is_set(),
                            step_s=None if start is None else now - start, loop_age_s=now - self._beat,
                            running=len(self._active), queued=len(self._waiting))

    @property
    def failure(self) -> str | None:
        """Why the thread is gone (None while it runs)."""
        if self.is_alive():
            return None
        return self._fatal or "exited"

    # -- the engine thread ----------------------------------------------------
    def run(self) -> None:
        try:
            self._loop()
        except BaseException as e:  # a bug outside the guarded step: tell every request, then end
            log.exception("the engine thread failed")
            self._fatal = redact_paths(f"{type(e).__name__}: {e}".splitlines()[0])  # /health shows it to clients
            self._fail_everyone(self._fatal)

    def _loop(self) -> None:
        while True:
            self._beat = time.monotonic()
            idle = not self._waiting and not self.core.has_unfinished()
            if not self._drain(block=idle):
                break
            self._end_overdue()
            self._admit()
            if self.core.has_unfinished():
                self._step()
            self._guarded("updating the gauges", self._update_gauges)
        self._shutdown()

    def _step(self) -> None:
        self._step_start = time.monotonic()
        try:
            chunks = self.core.step()
        except Exception as e:  # an engine bug: fail the running requests, keep serving
            log.exception("engine step failed")
            self._fail_all(e)
            chunks = []
        finally:
            self._step_start = None
        now = time.perf_counter()
        for ch in chunks:
            try:
                self._relay(ch, now)
            except Exception as e:
                log.exception("relaying a chunk failed")
                sub = self._active.pop(ch.request_id, None)
                if sub is not None:
                    self._finish(sub)
                    self._send(sub, Interrupted(_abort_chunk(sub), "engine_error", f"engine error: {e}"))

    @staticmethod
    def _guarded(what: str, fn: Any) -> None:
        try:
            fn()
        except Exception:
            log.exception("%s failed", what)

    def _drain(self, block: bool) -> bool:
        """Apply inbox commands; False when told to stop."""
        try:
            item = self._inbox.get(timeout=0.5) if block else self._inbox.get_nowait()
        except queue.Empty:
            return True
        while True:
            kind, arg = item
            if kind == "stop":
                return False
            if kind == "add":
                self._waiting.append(arg)
            elif kind == "abort":
                self._guarded("aborting a request", lambda rid=arg: self._abort(rid))
            elif kind == "shutdown":
                self._begin_shutdown(arg)
            try:
                item = self._inbox.get_nowait()
            except queue.Empty:
                return True

    def _abort(self, request_id: str) -> None:
        sub = self._active.get(request_id)
        if sub is not None:
            self.core.abort(request_id)  # frees the KV blocks now; the abort chunk comes from step()
            return
        for s in self._waiting:
            if s.request_id == request_id:
                self._waiting.remove(s)
                self._finish(s)
                break

    def _begin_shutdown(self, deadline: float) -> None:
        self._deadline = deadline
        while self._waiting:
            sub = self._waiting.popleft()
            self._finish(sub)
            self._send(sub, ServiceUnavailableError(f"{_SHUTDOWN}; the request was queued and did not start",
                                                    "server_shutdown"))

    def _end_overdue(self) -> None:
        """After the shutdown grace period, end every running request (its final chunk says why)."""
        if self._deadline is None or time.monotonic() < self._deadline:
            return
        for rid, sub in list(self._active.items()):
            if sub.interrupt is None:
                sub.interrupt = ("server_shutdown", f"{_SHUTDOWN}; the request was cut at the grace period")
                self._guarded("aborting a request", lambda rid=rid: self.core.abort(rid))

    def _admit(self) -> None:
        while self._waiting and len(self._active) < self.max_concurrency:
            sub = self._waiting.popleft()
            try:
                self.core.add_request(sub.prompt_ids, sub.params, sub.request_id, constraint=sub.constraint,
                                      sample_index=sub.sample_index)
            except Exception as e:  # LLMSysError (validated earlier, so rare) or a bug
                self._finish(sub)
                self._send(sub, e)
                continue
            sub.arrival = min(sub.arrival, time.perf_counter())
            self._active[sub.request_id] = sub

    def _relay(self, ch: StreamChunk, now: float) -> None:
        sub = self._active.get(ch.request_id)
        if sub is None:
            return
        if ch.token_ids:
            ttft = itl = None
            if sub.last_token is None:
                ttft = now - sub.arrival
            else:
                itl = (now - sub.last_token) / len(ch.token_ids)
            sub.last_token = now
            self.metrics.on_tokens(len(ch.token_ids), ttft, itl)
        if ch.finished:
            del self._active[ch.request_id]
            u = ch.usage
            self.metrics.on_finish(
                ch.finish_reason or "stop", u.prompt_tokens if u else 0, u.evicted_tokens if u else 0, now - sub.arrival,
                u.cached_tokens if u else 0, u.draft_tokens if u else 0, u.accepted_draft_tokens if u else 0,
            )
            self._finish(sub)
            if sub.interrupt is not None:
                self._send(sub, Interrupted(ch, *sub.interrupt))
                return
        self._send(sub, ch)

    def _finish(self, sub: Submission) -> None:
        if not sub.finished:
            sub.finished = True
            with self._lock:
                self._in_system -= 1

    @staticmethod
    def _send(sub: Submission, item: Any) -> None:
        try:
            sub.loop.call_soon_threadsafe(sub.out.put_nowait, (sub.index, item))
        except RuntimeError:  # the handler's loop is closed (server stopping)
            pass

    def _fail_all(self, e: Exception) -> None:
        """A step raised: end every running request with a final chunk naming the error."""
        message = str(e).splitlines()[0] if isinstance(e, LLMSysError) and str(e) else f"engine error: {e}"
        for rid, sub in list(self._active.items()):
            self._guarded("aborting a request", lambda rid=rid: self.core.abort(rid))
            self._finish(sub)
            self._send(sub, Interrupted(_abort_chunk(sub), "engine_error", message))
        self._active.clear()
        try:
            self.core.step()  # flush the abort chunks
        except Exception:
            log.exception("engine step failed while aborting")

    def _fail_everyone(self, why: str) -> None:
        """The thread is ending on an error: nobody may wait for it (inbox, queue, running)."""
        while True:
            try:
                kind, arg = self._inbox.get_nowait()
            except queue.Empty:
                break
            if kind == "add":
                self._waiting.append(arg)
        err = ServiceUnavailableError(f"the engine thread stopped ({why}); restart the server", "engine_stopped")
        for sub in list(self._waiting) + list(self._active.values()):
            self._finish(sub)
            self._send(sub, Interrupted(_abort_chunk(sub), "engine_error", str(err)) if sub.last_token else err)
        self._waiting.clear()
        self._active.clear()

    def _update_gauges(self) -> None:
        rep = self.core.memory_report()
        tiers = {t: 0 for t in rep.kv_total} or {"cpu": 0}
        first = next(iter(tiers))
        tiers[first] = rep.kv_blocks_used  # the pool (hot blocks) lives on one tier
        if rep.kv_cold_blocks_total:  # a cold KV tier (llmsys.offload.kv_tier): 'disk' for a CPU pool
            tiers[self.core.tier.tier] += rep.kv_cold_blocks_used
        sched = self.core.scheduler
        sw = self.core.swap
        swap = None if sw is None else {"tier": sw.tier, "used": sw.num_used, "swap_outs": sw.stats.swap_outs,
                                        "recomputes": sw.stats.recomputes}
        self.metrics.set_gauges(len(self._waiting) + len(sched.waiting), len(sched.running), tiers,
                                rep.kv_blocks_total, swap, self.core.allocator.num_cached, rep.kv_cold_blocks_total)
        self.metrics.set_memory(rep)
        if not self.metrics.has_placement:  # fixed once loaded: read the plan and flags once
            self.metrics.set_placement(memory_budgets(self.core), layer_placement(self.core))

    def _shutdown(self) -> None:
        self._begin_shutdown(time.monotonic())  # the grace period is over: end everything now
        self._end_overdue()
        now = time.perf_counter()
        try:
            for ch in self.core.step():
                self._relay(ch, now)
        except Exception:
            log.exception("engine step failed during shutdown")
            self._fail_everyone("it failed while shutting down")
        self._guarded("updating the gauges", self._update_gauges)


def _abort_chunk(sub: Submission) -> StreamChunk:
    return StreamChunk(sub.request_id, "", [], finish_reason="abort")
