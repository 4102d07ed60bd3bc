"""Read a running ``llmsys serve`` through its Prometheus ``/metrics`` text.

The monitor deliberately does not import the server package: it reads the text
with ``prometheus_client``'s parser and looks metrics up by name, so a metric
the server does not (yet) export simply shows as n/a instead of breaking the
panel.
"""

from __future__ import annotations

import urllib.request
from collections import deque
from dataclasses import dataclass

from prometheus_client.parser import text_string_to_metric_families

from llmsys.tui.snapshot import TIERS, ExpertUsage, TierSnapshot, TierUsage, plan_phrase

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

    def by_label(self, name: str, label: str, largest: bool = False) -> dict[str, float]:
        """Values per ``label``, summed over the other labels (a server with several models labels
        each engine's series ``model``: their bytes add up), or the ``largest`` (a per-model budget
        is one budget, not one each)."""
        out: dict[str, float] = {}
        for labels, v in self.values.get(name, {}).items():
            d = dict(labels)
            if label in d:
                k = d[label]
                out[k] = max(out.get(k, v), v) if largest else out.get(k, 0.0) + v
        return out

    def models(self) -> list[str]:
        """The served ids the per-engine series name (none: a one-model server from before the label)."""
        return sorted({v for series in self.values.values() for labels in series for k, v in labels if k == "model"})


def parse_prometheus(text: str) -> Samples:
    """Parse Prometheus text exposition with the library's parser. A line it refuses ends its
    parse, so then the lines are read one at a time and the ones it refuses are skipped."""
    values: dict[str, dict[Labels, float]] = {}

    def add(chunk: str) -> None:
        for fam in text_string_to_metric_families(chunk):
            for s in fam.samples:
                values.setdefault(s.name, {})[tuple(sorted(s.labels.items()))] = float(s.value)

    try:
        add(text)
    except ValueError:
        for line in text.splitlines():
            try:
                add(line + "\n")
            except ValueError:
                continue
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


def layer_placement(s: Samples, model: str | None = None) -> tuple[tuple[str, ...], tuple[bool, ...]]:
    """Each layer's tier and streamed flag from ``llmsys_layer_info{layer,tier,streamed}`` (none: ``((), ())``),
    of one model: ``model``, else the first the server names (one panel shows one model's layers)."""
    infos = list(s.values.get("llmsys_layer_info", {}))
    named = sorted({dict(labels)["model"] for labels in infos if "model" in dict(labels)})
    pick = model if model is not None else (named[0] if named else None)
    layers: dict[int, tuple[str, bool]] = {}
    for labels in infos:
        d = dict(labels)
        if d.get("model", pick) != pick:
            continue
        try:
            layers[int(d["layer"])] = (d.get("tier", "?"), d.get("streamed") == "true")
        except (KeyError, ValueError):
            continue
    ordered = [layers[i] for i in sorted(layers)]
    return tuple(t for t, _ in ordered), tuple(st for _, st in ordered)


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
        kv_bytes = s.by_label("llmsys_kv_bytes_reserved", "tier") or s.by_label("llmsys_kv_bytes_total", "tier")
        kv_used_bytes = s.by_label("llmsys_kv_bytes_in_use", "tier") or s.by_label("llmsys_kv_bytes_used", "tier")
        # a server from before the resident gauge: its reservation was all it said
        kv_resident = s.by_label("llmsys_kv_bytes_resident", "tier") or kv_bytes
        budgets = s.by_label("llmsys_memory_budget_bytes", "tier", largest=True)
        staging = s.by_label("llmsys_staging_bytes", "tier")
        tiers = tuple(
            TierUsage(
                tier=t,
                budget=int(budgets[t]) if t in budgets else None,
                weights=int(weights.get(t, 0)),
                kv_reserved=int(kv_bytes.get(t, 0)),
                kv_used=int(kv_used_bytes.get(t, 0)),
                workspace=int(staging.get(t, 0)),
                kv_blocks_used=int(used.get(t, 0)),
                kv_blocks_total=int(total.get(t, 0)),
                kv_resident=int(kv_resident.get(t, 0)),
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
        layer_tiers, streamed = layer_placement(s)
        home = "gpu" if weights_on_gpu(s) else "cpu"
        expert_bytes = s.by_label("llmsys_expert_bytes", "tier")
        experts = None
        if expert_bytes:
            tier, nbytes = next(iter(expert_bytes.items()))
            experts = ExpertUsage(tier, int(nbytes), int(s.get("llmsys_expert_cache_bytes") or 0),
                                  int(s.get("llmsys_expert_cache_capacity_bytes") or 0),
                                  int(s.get("llmsys_expert_cache_hits_total") or 0),
                                  int(s.get("llmsys_expert_cache_misses_total") or 0))
        return TierSnapshot(
            tiers=tiers,
            layer_tiers=layer_tiers,
            layer_streamed=streamed,
            plan_phrase=plan_phrase(layer_tiers, streamed, home) if layer_tiers else "placement not exported by the server",
            evicted_tokens=int(evicted) if evicted is not None else None,
            tok_s=tok_s,
            tok_s_history=tuple(self._history),
            ttft_s=ttft,
            generating=bool(running),
            source="server",
            requests_running=int(running) if running is not None else None,
            requests_waiting=int(waiting) if waiting is not None else None,
            per_request_tok_s=per_req,
            experts=experts,
            extra={"prompt_tokens_total": s.get("llmsys_prompt_tokens_total"), "generation_tokens_total": gen},
        )
