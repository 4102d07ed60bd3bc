"""Prometheus text exposition, written by hand (no client library needed).

The engine thread and the HTTP handlers both update these, so every update
and the rendering take one lock; updates are a few additions each.
"""

from __future__ import annotations

import bisect
import threading
from dataclasses import dataclass, field

# Latency buckets in seconds: sub-millisecond decode steps up to slow prefills.
LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)


@dataclass
class Histogram:
    buckets: tuple[float, ...] = LATENCY_BUCKETS
    counts: list[int] = field(default_factory=list)  # per bucket (not cumulative), + the +Inf one
    total: float = 0.0
    n: int = 0

    def __post_init__(self) -> None:
        self.counts = [0] * (len(self.buckets) + 1)

    def observe(self, v: float) -> None:
        self.counts[bisect.bisect_left(self.buckets, v)] += 1
        self.total += v
        self.n += 1

    def render(self, name: str) -> list[str]:
        out, acc = [], 0
        for le, c in zip(self.buckets, self.counts):
            acc += c
            out.append(f'{name}_bucket{{le="{le}"}} {acc}')
        out.append(f'{name}_bucket{{le="+Inf"}} {self.n}')
        out.append(f"{name}_sum {self.total}")
        out.append(f"{name}_count {self.n}")
        return out


class Metrics:
    """Counters, gauges and histograms of one server process."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.requests: dict[tuple[str, int], int] = {}  # (endpoint, status) -> count
        self.prompt_tokens = 0
        self.generation_tokens = 0
        self.finished: dict[str, int] = {}  # finish reason -> count
        self.evicted_tokens = 0
        self.cached_tokens = 0
        self.kv_blocks_cached = 0
        self.ttft = Histogram()
        self.itl = Histogram()
        self.e2e = Histogram()
        self.queue_depth = 0
        self.running = 0
        self.kv_blocks_used: dict[str, int] = {}
        self.kv_blocks_total = 0
        self.kv_cold_blocks_total = 0  # cold KV tier (llmsys.offload.kv_tier); 0 = none
        self.swap: dict[str, int] = {}  # swap space: tier, used blocks, swap_outs, recomputes

    def count_request(self, endpoint: str, status: int) -> None:
        with self._lock:
            key = (endpoint, status)
            self.requests[key] = self.requests.get(key, 0) + 1

    def on_tokens(self, n: int, ttft: float | None, itl: float | None) -> None:
        with self._lock:
            self.generation_tokens += n
            if ttft is not None:
                self.ttft.observe(ttft)
            if itl is not None:
                self.itl.observe(itl)

    def on_finish(self, reason: str, prompt_tokens: int, evicted: int, e2e: float, cached: int = 0) -> None:
        with self._lock:
            self.finished[reason] = self.finished.get(reason, 0) + 1
            self.prompt_tokens += prompt_tokens
            self.evicted_tokens += evicted
            self.cached_tokens += cached
            self.e2e.observe(e2e)

    def set_gauges(self, queue_depth: int, running: int, kv_used: dict[str, int], kv_total: int,
                   swap: dict[str, int] | None = None, kv_cached: int = 0, kv_cold_total: int = 0) -> None:
        """``swap``: swap space counters (``llmsys.offload.kv_swap``), None when swap is off;
        ``kv_cached``: free blocks still holding a reusable prompt prefix; ``kv_used`` counts hot
        blocks under the pool's tier and cold ones (``kv_cold_total`` of them) under theirs."""
        with self._lock:
            self.kv_blocks_cached = kv_cached
            self.queue_depth = queue_depth
            self.running = running
            self.kv_blocks_used = dict(kv_used)
            self.kv_blocks_total = kv_total
            self.kv_cold_blocks_total = kv_cold_total
            self.swap = dict(swap) if swap else {}

    def render(self) -> str:
        with self._lock:
            lines = [
                "# HELP llmsys_requests_total HTTP requests by endpoint and status code.",
                "# TYPE llmsys_requests_total counter",
            ]
            for (ep, st), c in sorted(self.requests.items()):
                lines.append(f'llmsys_requests_total{{endpoint="{ep}",status="{st}"}} {c}')
            lines += [
                "# HELP llmsys_request_finished_total Engine requests finished, by reason.",
                "# TYPE llmsys_request_finished_total counter",
            ]
            for r, c in sorted(self.finished.items()):
                lines.append(f'llmsys_request_finished_total{{reason="{r}"}} {c}')
            for name, kind, help_, val in (
                ("llmsys_prompt_tokens_total", "counter", "Prompt tokens of finished requests.", self.prompt_tokens),
                ("llmsys_generation_tokens_total", "counter", "Tokens generated.", self.generation_tokens),
                ("llmsys_kv_evicted_tokens_total", "counter", "KV tokens evicted by the KV policy.", self.evicted_tokens),
                ("llmsys_prefix_cache_hit_tokens_total", "counter", "Prompt tokens whose KV came from the prefix cache.",
                 self.cached_tokens),
                ("llmsys_kv_blocks_cached", "gauge", "Free KV blocks still holding a reusable prompt prefix.",
                 self.kv_blocks_cached),
                ("llmsys_queue_depth", "gauge", "Requests waiting (server queue + engine waiting).", self.queue_depth),
                ("llmsys_requests_running", "gauge", "Requests being decoded.", self.running),
                ("llmsys_kv_blocks_total", "gauge", "KV blocks in the pool.", self.kv_blocks_total),
            ):
                lines += [f"# HELP {name} {help_}", f"# TYPE {name} {kind}", f"{name} {val}"]
            if self.kv_cold_blocks_total:
                lines += ["# HELP llmsys_kv_cold_blocks_total KV blocks of the cold tier (offloaded beyond the pool).",
                          "# TYPE llmsys_kv_cold_blocks_total gauge", f"llmsys_kv_cold_blocks_total {self.kv_cold_blocks_total}"]
            lines += ["# HELP llmsys_kv_blocks_used KV blocks in use, per memory tier (pool and cold tier).",
                      "# TYPE llmsys_kv_blocks_used gauge"]
            for tier, v in sorted(self.kv_blocks_used.items()):
                lines.append(f'llmsys_kv_blocks_used{{tier="{tier}"}} {v}')
            sw = self.swap
            if sw:
                lines += ["# HELP llmsys_kv_swap_blocks_used Swap-space blocks holding preempted requests' KV.",
                          "# TYPE llmsys_kv_swap_blocks_used gauge",
                          f'llmsys_kv_swap_blocks_used{{tier="{sw["tier"]}"}} {sw["used"]}',
                          "# HELP llmsys_kv_preemptions_total Preempted requests, by what happened to their KV.",
                          "# TYPE llmsys_kv_preemptions_total counter",
                          f'llmsys_kv_preemptions_total{{kind="swap"}} {sw["swap_outs"]}',
                          f'llmsys_kv_preemptions_total{{kind="recompute"}} {sw["recomputes"]}']
            for name, help_, h in (
                ("llmsys_time_to_first_token_seconds", "Request arrival to first generated token.", self.ttft),
                ("llmsys_inter_token_latency_seconds", "Time between consecutive tokens of a request.", self.itl),
                ("llmsys_e2e_request_latency_seconds", "Request arrival to finish.", self.e2e),
            ):
                lines += [f"# HELP {name} {help_}", f"# TYPE {name} histogram"] + h.render(name)
        return "\n".join(lines) + "\n"


def parse_metrics(text: str) -> dict[str, float]:
    """``{"name{labels}": value}`` from exposition text (tests, the benchmark)."""
    out: dict[str, float] = {}
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        key, _, val = line.rpartition(" ")
        out[key] = float(val)
    return out
