"""The engine client: the one thread that touches an :class:`EngineCore`, for every front end.

The core is not thread-safe, so the server and the TUI hand :class:`Submission` objects to
:meth:`EngineClient.submit`; aborts, shutdown and :meth:`EngineClient.call` share that inbox. Between
steps the thread drains it, admits while fewer than ``max_concurrency`` run (:class:`QueueFullError` past
``max_concurrency + max_queue``, atomic with the engine's view), steps, and hands chunks to each ``sink``.
A failed step ends the running requests (:class:`Interrupted`) and the thread goes on; an error outside a
step tells every waiting request before the thread ends. Front ends override the ``on_*`` hooks (run on
the engine thread) for their own bookkeeping.
"""

from __future__ import annotations

import functools
import logging
import queue
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Callable

from llmsys.engine.core import EngineCore, TokenConstraint
from llmsys.engine.embedding import Pooling
from llmsys.engine.outputs import StreamChunk
from llmsys.engine.sampling import SamplingParams
from llmsys.kernels.common.errors import LLMSysError
from llmsys.kernels.common.memory import release_free_heap

log = logging.getLogger("llmsys.engine.client")


class QueueFullError(Exception):
    """Every slot and queue place is taken; the caller should retry later."""


class ServiceUnavailableError(Exception):
    """The client cannot take or finish the request: shutting down, or the engine thread stopped."""

    def __init__(self, message: str, code: str):
        super().__init__(message)
        self.code = code


@dataclass(frozen=True)
class Interrupted:
    """The client ended a request itself (shutdown, an engine failure): its final chunk, and why."""

    chunk: StreamChunk
    code: str  # "server_shutdown" | "engine_error"
    message: str


@dataclass(frozen=True)
class EngineHealth:
    alive: bool  # the engine thread runs
    fatal: str | None  # why it stopped, when it stopped on an error
    stopping: bool  # shutdown requested
    step_s: float | None  # how long the step now running has taken (None between steps)
    loop_age_s: float  # since the loop last went round (it wakes at least every 0.5 s when idle)
    running: int
    queued: int


# What a sink receives: a chunk, the client's own end of the request, or why it never started.
Outcome = StreamChunk | Interrupted | Exception


@dataclass
class Submission:
    """One engine request and where its news goes.

    ``sink(index, outcome)`` is called on the engine thread, so it must only hand the outcome
    over (to an asyncio queue, a UI message); ``index`` is the caller's own numbering (the
    choice index of an HTTP request with ``n`` > 1 or a batch of prompts). The last call for a
    request is a finished chunk, an :class:`Interrupted` or an exception.
    """

    request_id: str
    index: int
    prompt_ids: list[int]
    params: SamplingParams
    sink: Callable[[int, Outcome], None]
    constraint: TokenConstraint | None = None
    sample_index: int = 0  # which of the prompt's params.n completions (chooses the generator)
    arrival: float = field(default_factory=time.perf_counter)
    last_token: float | None = None
    finished: bool = False
    interrupt: tuple[str, str] | None = None  # (code, message) once the client decided to end it
    pooling: Pooling | None = None  # an embedding request: its final chunk carries the pooled vector
    group: _Group | None = None  # the inputs of one embedding call share one running-or-queued place


@dataclass
class _Group:
    """Submissions that count as one place against ``max_concurrency + max_queue``: an embedding call's
    inputs (a retriever sends hundreds at once; each is one prefill). The place is freed with the last."""

    left: int


class EngineClient(threading.Thread):
    """Owns the core on a daemon thread. Pass ``core``, or ``load`` to build it on the thread
    itself (a slow load then shows progress and its failure goes to :meth:`on_load_failed`)."""

    owner = "the server"  # who is shutting down / to restart, in the one-line errors

    def __init__(self, core: EngineCore | None = None, max_concurrency: int = 1, max_queue: int = 0, *,
                 load: Callable[[], EngineCore] | None = None):
        super().__init__(name="llmsys-engine", daemon=True)
        if (core is None) == (load is None):
            raise ValueError("EngineClient takes a core or a load function, not both or neither")
        self.core = core
        self._load_core = load
        self._max_concurrency = max(1, max_concurrency)
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

    @property
    def max_concurrency(self) -> int:
        cap = self.core.config.max_num_seqs if self.core is not None else self._max_concurrency
        return min(self._max_concurrency, cap)

    # -- hooks (the engine thread) ------------------------------------------------
    def on_ready(self) -> None:
        """The core is there (loaded by ``load`` or given); the loop starts next."""

    def on_load_failed(self, e: Exception) -> None:
        """``load`` raised; the thread ends and every submission is refused."""

    def on_tokens(self, sub: Submission, chunk: StreamChunk, now: float, ttft: float | None, itl: float | None) -> None:
        """A chunk with tokens for ``sub`` (``ttft`` on its first, else ``itl``: seconds per token)."""

    def on_finished(self, sub: Submission, chunk: StreamChunk, now: float) -> None:
        """``sub``'s final chunk, before its sink gets it."""

    def on_step(self, seconds: float) -> None:
        """After each ``core.step()``: how long it took."""

    def on_tick(self) -> None:
        """Once per loop round (at least every 0.5 s while idle), after the step."""

    def describe_failure(self, e: BaseException) -> str:
        """The one line a fatal error is reported as (the server hides file paths from clients)."""
        return f"{type(e).__name__}: {e}".splitlines()[0]

    # -- called from front ends (any thread) --------------------------------------
    def submit(self, subs: list[Submission]) -> None:
        """Queue all of ``subs`` or none (raises :class:`QueueFullError` or
        :class:`ServiceUnavailableError`)."""
        places = len({id(s.group) if s.group is not None else id(s) for s in subs})
        with self._lock:
            if self._fatal is not None or not self.is_alive():
                raise ServiceUnavailableError(f"the engine thread stopped ({self._fatal or 'exited'}); "
                                              f"restart {self.owner}", "engine_stopped")
            if self._stopping.is_set():
                raise ServiceUnavailableError(f"{self._shutdown_phrase}; retry against another instance or later",
                                              "server_shutdown")
            if self._in_system + places > self.max_concurrency + self.max_queue:
                raise QueueFullError(
                    f"{self._in_system} requests are running or queued (limit "
                    f"{self.max_concurrency} running + {self.max_queue} queued)"
                )
            self._in_system += places
        for s in subs:
            self._inbox.put(("add", s))

    def embed(self, request_id: str, prompts: list[list[int]], pooling: Pooling,
              sink: Callable[[int, Outcome], None]) -> list[Submission]:
        """Queue one embedding per prompt (ids ``{request_id}-{k}``, sink index ``k``), as one place in the
        queue; each is batched by the scheduler with everything else and its final chunk carries
        ``embedding``. Returns the submissions (to abort); raises as :meth:`submit`."""
        group = _Group(len(prompts))
        subs = [Submission(f"{request_id}-{k}", k, ids, SamplingParams(max_tokens=1), sink, pooling=pooling,
                           group=group) for k, ids in enumerate(prompts)]
        self.submit(subs)
        return subs

    def abort(self, request_id: str) -> None:
        """End a request; its sink still gets a final chunk (``finish_reason`` "abort")."""
        self._inbox.put(("abort", request_id))

    def call(self, fn: Callable[[], Any]) -> None:
        """Run ``fn`` on the engine thread between steps (where reading the core is safe);
        an exception in it is logged, never fatal."""
        self._inbox.put(("call", fn))

    def begin_shutdown(self, grace_s: float) -> None:
        """Refuse new requests now, end the queued ones, let running ones finish for ``grace_s``."""
        self._stopping.set()
        self._inbox.put(("shutdown", time.monotonic() + max(0.0, grace_s)))

    def stop(self, timeout: float = 10.0) -> None:
        """Abort whatever is left and end the thread."""
        self._stopping.set()
        self._inbox.put(("stop", None))
        if self.is_alive() and threading.current_thread() is not self:
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

    @property
    def _shutdown_phrase(self) -> str:
        return f"{self.owner} is shutting down"

    # -- the engine thread --------------------------------------------------------
    def run(self) -> None:
        if self.core is None:
            try:
                self.core = self._load_core()
            except Exception as e:  # noqa: BLE001 - reported by the hook; nothing may be submitted
                self._fatal = self.describe_failure(e)
                self._guarded("reporting the failed load", functools.partial(self.on_load_failed, e))
                return
        try:
            self.on_ready()
            release_free_heap()  # what loading and start-up freed: RSS starts as the memory report plus the runtime
            self._loop()
        except BaseException as e:  # a bug outside the guarded step: tell every request, then end
            log.exception("the engine thread failed")
            self._fatal = self.describe_failure(e)
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
                if not self.core.has_unfinished() and not self._waiting:
                    # idle now: the steps' freed activations go back to the system (glibc keeps them
                    # otherwise), so RSS is the memory report's resident bytes plus the runtime again
                    release_free_heap()
            self._guarded("the tick hook", self.on_tick)
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
            elapsed = time.monotonic() - self._step_start
            self._step_start = None
        self._guarded("the step hook", lambda: self.on_step(elapsed))
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
    def _guarded(what: str, fn: Callable[[], Any]) -> None:
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
            elif kind == "call":
                self._guarded("a call on the engine thread", arg)
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
                self._send(s, _abort_chunk(s))  # never started: its sink still hears the end
                break

    def _begin_shutdown(self, deadline: float) -> None:
        self._deadline = deadline
        while self._waiting:
            sub = self._waiting.popleft()
            self._finish(sub)
            self._send(sub, ServiceUnavailableError(f"{self._shutdown_phrase}; the request was queued and did not start",
                                                    "server_shutdown"))

    def _end_overdue(self) -> None:
        """After the shutdown grace period, end every running request (its final chunk says why)."""
        if self._deadline is None or time.monotonic() < self._deadline:
            return
        for rid, sub in list(self._active.items()):
            if sub.interrupt is None:
                sub.interrupt = ("server_shutdown", f"{self._shutdown_phrase}; the request was cut at the grace period")
                self._guarded("aborting a request", lambda rid=rid: self.core.abort(rid))

    def _admit(self) -> None:
        while self._waiting and len(self._active) < self.max_concurrency:
            sub = self._waiting.popleft()
            try:
                self.core.add_request(sub.prompt_ids, sub.params, sub.request_id, constraint=sub.constraint,
                                      sample_index=sub.sample_index, pooling=sub.pooling)
            except Exception as e:  # LLMSysError (context full, bad params) or a bug
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
            self.on_tokens(sub, ch, now, ttft, itl)
        if ch.finished:
            del self._active[ch.request_id]
            self.on_finished(sub, ch, now)
            self._finish(sub)
            if sub.interrupt is not None:
                self._send(sub, Interrupted(ch, *sub.interrupt))
                return
        self._send(sub, ch)

    def _finish(self, sub: Submission) -> None:
        if not sub.finished:
            sub.finished = True
            if sub.group is not None:
                sub.group.left -= 1
                if sub.group.left:
                    return
            with self._lock:
                self._in_system -= 1

    @staticmethod
    def _send(sub: Submission, item: Outcome) -> None:
        try:
            sub.sink(sub.index, item)
        except Exception:  # a front end's sink must not stop the engine
            log.exception("delivering to request %s failed", sub.request_id)

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
        err = ServiceUnavailableError(f"the engine thread stopped ({why}); restart {self.owner}", "engine_stopped")
        for sub in list(self._waiting) + list(self._active.values()):
            self._finish(sub)
            self._send(sub, Interrupted(_abort_chunk(sub), "engine_error", str(err)) if sub.last_token else err)
        self._waiting.clear()
        self._active.clear()

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
        self._guarded("the tick hook", self.on_tick)


def _abort_chunk(sub: Submission) -> StreamChunk:
    return StreamChunk(sub.request_id, "", [], finish_reason="abort")
