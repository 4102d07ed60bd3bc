"""Read a running ``llmsys serve`` through its Prometheus ``/metrics`` text.

The monitor deliberately does not import the server package: it parses the
text format generically, so a metric the server does not (yet) export simply
shows as n/a instead of breaking the panel.
"""

from __future__ import annotations

import re
import urllib.request
from collections import deque
from dataclasses import dataclass

from llmsys.tui.snapshot import TIERS, TierSnapshot, TierUsage

_LINE = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{[^}]*\})?\s+(\S+)")
_LABEL = re.compile(r'([a-zA-Z_][a-zA-Z0-9_]*)\s*=\s*"((?:[^"\\]|\\.)*)"')

Labels = tuple[tuple[str, str], ...]


@dataclass(frozen=True)
class Samples:
    """Parsed metrics: name -> {sorted labels -> value}."""

    values: dict[str, dict[Labels, float]]

    def get(self, name: str, **labels: str) -> float | None:
        """The sample with exactly these labels, or the sum over all label sets
        when none are given (``llmsys_requests_running`` with or without labels)."""
        series = self.values.get(name)
        if not series:
            return None
        if labels:
            return series.get(tuple(sorted(labels.items())))
        return sum(series.values())

    def by_label(self, name: str, label: str) -> dict[str, float]:
        out: dict[str, float] = {}
        for labels, v in self.values.get(name, {}).items():
            d = dict(labels)
            if label in d:
                out[d[label]] = out.get(d[label], 0.0) + v
        return out


def parse_prometheus(text: str) -> Samples:
    """Parse Prometheus text exposition (comments, labels, NaN/Inf, timestamps)."""
    values: dict[str, dict[Labels, float]] = {}
    for line in text.splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        m = _LINE.match(line)
        if not m:
            continue
        name, raw_labels, raw_value = m.groups()
        try:
            value = float(raw_value)
        except ValueError:
            continue
        labels: Labels = tuple(sorted((k, v.replace('\\"', '"').replace("\\\\", "\\")) for k, v in _LABEL.findall(raw_labels or "")))
        values.setdefault(name, {})[labels] = value
    return Samples(values)


def fetch_metrics(url: str, timeout: float = 2.0) -> Samples:
    """GET ``URL/metrics`` (or URL itself when it already ends in /metrics)."""
    url = url.rstrip("/")
    if not url.endswith("/metrics"):
        url += "/metrics"
    with urllib.request.urlopen(url, timeout=timeout) as r:  # noqa: S310 - user-given URL, http(s) only
        return parse_prometheus(r.read().decode("utf-8", "replace"))


def weights_on_gpu(s: Samples) -> bool:
    return bool(s.by_label("llmsys_weight_bytes", "tier").get("gpu"))


class MetricsTracker:
    """Turns successive scrapes into rates (tokens/s) and a snapshot."""

    def __init__(self, history: int = 60):
        self._prev: tuple[float, float | None] | None = None  # (time, generation_tokens_total)
        self._history: deque[float] = deque(maxlen=history)

    def update(self, s: Samples, now: float) -> TierSnapshot:
        gen = s.get("llmsys_generation_tokens_total")
        tok_s = None
        if gen is not None and self._prev is not None and self._prev[1] is not None and now > self._prev[0]:
            tok_s = max(gen - self._prev[1], 0.0) / (now - self._prev[0])
            self._history.append(tok_s)
        self._prev = (now, gen)
        used = s.by_label("llmsys_kv_blocks_used", "tier")
        total = s.by_label("llmsys_kv_blocks_total", "tier")
        if not total and s.get("llmsys_kv_blocks_total") is not None:
            # an untiered pool size: it lives where the used blocks are reported
            home = next(iter(used), "gpu" if weights_on_gpu(s) else "cpu")
            total = {home: s.get("llmsys_kv_blocks_total") or 0.0}
        weights = s.by_label("llmsys_weight_bytes", "tier")
        kv_bytes = s.by_label("llmsys_kv_bytes_total", "tier")
        kv_used_bytes = s.by_label("llmsys_kv_bytes_used", "tier")
        budgets = s.by_label("llmsys_memory_budget_bytes", "tier")
        tiers = tuple(
            TierUsage(
                tier=t,
                budget=int(budgets[t]) if t in budgets else None,
                weights=int(weights.get(t, 0)),
                kv_reserved=int(kv_bytes.get(t, 0)),
                kv_used=int(kv_used_bytes.get(t, 0)),
                kv_blocks_used=int(used.get(t, 0)),
                kv_blocks_total=int(total.get(t, 0)),
            )
            for t in TIERS
        )
        running = s.get("llmsys_requests_running")
        waiting = s.get("llmsys_requests_waiting")
        if waiting is None:
            waiting = s.get("llmsys_queue_depth")
        ttft_sum = s.get("llmsys_time_to_first_token_seconds_sum")
        ttft_n = s.get("llmsys_time_to_first_token_seconds_count")
        ttft = ttft_sum / ttft_n if ttft_sum is not None and ttft_n else None
        evicted = s.get("llmsys_kv_evicted_tokens_total")
        per_req = tok_s / running if tok_s is not None and running else None
        return TierSnapshot(
            tiers=tiers,
            plan_phrase="placement not exported by the server",
            evicted_tokens=int(evicted) if evicted is not None else None,
            tok_s=tok_s,
            tok_s_history=tuple(self._history),
            ttft_s=ttft,
            generating=bool(running),
            source="server",
            requests_running=int(running) if running is not None else None,
            requests_waiting=int(waiting) if waiting is not None else None,
            per_request_tok_s=per_req,
            extra={"prompt_tokens_total": s.get("llmsys_prompt_tokens_total"), "generation_tokens_total": gen},
        )
