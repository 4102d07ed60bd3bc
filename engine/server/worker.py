"""The server's engine thread: :class:`~llmsys.engine.client.EngineClient` plus the metrics.

HTTP handlers never call the core; they build :class:`Submission` objects whose sink is their
asyncio queue (:func:`asyncio_sink`) and hand them to the client, which owns the thread,
admission, streaming, aborts and errors for every front end. What the server adds here: the
Prometheus counters and gauges, fed from the client's hooks on the engine thread, and file
paths cut from the fatal error that ``/health`` shows to clients.
"""

from __future__ import annotations

import asyncio
from typing import Callable

from llmsys.engine.client import (  # noqa: F401 - the server's names for the client's types
    EngineClient,
    EngineHealth,
    Interrupted,
    Outcome,
    QueueFullError,
    ServiceUnavailableError,
    Submission,
)
from llmsys.engine.core import EngineCore
from llmsys.engine.outputs import StreamChunk
from llmsys.engine.server.metrics import Metrics, layer_placement, memory_budgets
from llmsys.engine.server.protocol import redact_paths


def asyncio_sink(loop: asyncio.AbstractEventLoop, out: asyncio.Queue) -> Callable[[int, Outcome], None]:
    """A sink that puts ``(index, outcome)`` on a handler's queue from the engine thread."""

    def sink(index: int, item: Outcome) -> None:
        try:
            loop.call_soon_threadsafe(out.put_nowait, (index, item))
        except RuntimeError:  # the handler's loop is closed (server stopping)
            pass

    return sink


class EngineWorker(EngineClient):
    def __init__(self, core: EngineCore, metrics: Metrics, max_concurrency: int, max_queue: int, model: str = ""):
        super().__init__(core, max_concurrency, max_queue)
        self.metrics = metrics
        self.gauges = metrics.add_engine(model)  # this model's series on /metrics, until stop()
        self.last_report = None  # the latest MemoryReport (registry: true resident sizes, /api/ps)
        self._update_gauges()  # /metrics says the memory before the first request (the thread is not started yet)

    @property
    def in_flight(self) -> int:
        """Requests submitted and not yet finished (an idle model can be unloaded)."""
        with self._lock:
            return self._in_system

    def stop(self, timeout: float = 10.0) -> None:
        super().stop(timeout)
        self.metrics.remove_engine(self.gauges)  # unloaded: its series go

    def describe_failure(self, e: BaseException) -> str:
        return redact_paths(super().describe_failure(e))  # /health shows it to clients

    def on_tokens(self, sub: Submission, chunk: StreamChunk, now: float, ttft: float | None, itl: float | None) -> None:
        self.metrics.on_tokens(len(chunk.token_ids), ttft, itl)

    def on_finished(self, sub: Submission, chunk: StreamChunk, now: float) -> None:
        u = chunk.usage
        self.metrics.on_finish(
            chunk.finish_reason or "stop", u.prompt_tokens if u else 0, u.evicted_tokens if u else 0, now - sub.arrival,
            u.cached_tokens if u else 0, u.draft_tokens if u else 0, u.accepted_draft_tokens if u else 0,
        )

    def on_tick(self) -> None:
        self._update_gauges()

    def _update_gauges(self) -> None:
        rep = self.last_report = self.core.memory_report()
        tiers = {t: 0 for t in rep.kv_total} or {"cpu": 0}
        first = next(iter(tiers))
        tiers[first] = rep.kv_blocks_used  # the pool (hot blocks) lives on one tier
        if rep.kv_cold_blocks_total:  # a cold KV tier (llmsys.offload.kv_tier): 'disk' for a CPU pool
            tiers[self.core.tier.tier] += rep.kv_cold_blocks_used
        sched = self.core.scheduler
        sw = self.core.swap
        swap = None if sw is None else {"tier": sw.tier, "used": sw.num_used, "swap_outs": sw.stats.swap_outs,
                                        "recomputes": sw.stats.recomputes}
        g = self.gauges
        g.set_gauges(len(self._waiting) + len(sched.waiting), len(sched.running), tiers,
                     rep.kv_blocks_total, swap, self.core.allocator.num_cached, rep.kv_cold_blocks_total)
        g.set_memory(rep)
        if not g.has_placement:  # fixed once loaded: read the plan and flags once
            g.set_placement(memory_budgets(self.core), layer_placement(self.core))
