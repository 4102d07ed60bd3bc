"""The server's Prometheus metrics, through ``prometheus_client``.

Each :class:`Metrics` owns its :class:`CollectorRegistry` (never the global one), so two servers in one
process never share a count. On it: the library's counters and histograms (updated by the HTTP handlers
and the engine thread; ``_created`` samples left out so names stay as they were); a collector of the
engine's state that reads, for each loaded model, the immutable snapshot its engine thread replaces
after each step (:class:`EngineMetrics`), so no HTTP thread touches an engine core; and the process
and platform collectors. Every per-engine series carries ``model="<served id>"`` (a server holds
several models, and one model's pool must not overwrite another's), and a model's series go when it
unloads. :func:`parse_metrics` reads the text back.
"""

from __future__ import annotations

import dataclasses
import threading
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from prometheus_client import (
    CONTENT_TYPE_PLAIN_0_0_4,
    CollectorRegistry,
    Counter,
    Histogram,
    PlatformCollector,
    ProcessCollector,
    generate_latest,
)
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, InfoMetricFamily, Metric
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.registry import Collector

if TYPE_CHECKING:
    from llmsys.engine.core import EngineCore, MemoryReport
    from llmsys.engine.kv_disk import KVDiskReport
    from llmsys.offload.experts import ExpertReport

# Latency buckets in seconds: sub-millisecond decode steps up to slow prefills.
LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)

# What ``render()`` writes: the library's text format 0.0.4 (what its own HTTP handlers pair it with).
CONTENT_TYPE = CONTENT_TYPE_PLAIN_0_0_4


@dataclass(frozen=True)
class EngineGauges:
    """The engine's state at its last step (replaced whole, never changed in place)."""

    queue_depth: int = 0
    running: int = 0
    kv_blocks_used: dict[str, int] = field(default_factory=dict)  # tier -> blocks (pool and cold tier)
    kv_blocks_total: int = 0
    kv_blocks_cached: int = 0
    kv_cold_blocks_total: int = 0  # cold KV tier (llmsys.offload.kv_tier); 0 = none
    swap: dict[str, Any] = field(default_factory=dict)  # tier, used, swap_outs, recomputes; {} = swap off
    # Bytes per tier (EngineCore.memory_report()); empty until the first report.
    weights: dict[str, int] = field(default_factory=dict)
    kv_total: dict[str, int] = field(default_factory=dict)  # reserved (MemoryReport.kv_total)
    kv_used: dict[str, int] = field(default_factory=dict)  # live requests' blocks
    kv_resident: dict[str, int] = field(default_factory=dict)  # the pool's pages backed by memory
    kv_in_use: dict[str, int] = field(default_factory=dict)  # live + cached prefixes
    resident: dict[str, int] = field(default_factory=dict)  # MemoryReport.resident: weights + KV + buffers
    staging: dict[str, int] = field(default_factory=dict)
    swap_total: dict[str, int] = field(default_factory=dict)
    swap_used: dict[str, int] = field(default_factory=dict)
    experts: ExpertReport | None = None  # MoE experts kept apart from their layers (offload/experts.py)
    kv_disk: KVDiskReport | None = None  # the prefix cache's disk tier (engine/kv_disk.py); None: off
    # Fixed once the model is loaded (set_placement).
    budgets: dict[str, int] = field(default_factory=dict)  # tier -> bytes llmsys may use there
    layers: tuple[tuple[str, bool], ...] = ()  # per layer: (tier holding its weights, streamed per step)


def memory_budgets(core: EngineCore) -> dict[str, int]:
    """Bytes llmsys may use per tier, for the tiers that have a budget: the offload plan's budgets
    (``--gpu-mem`` / ``--cpu-mem``, or what was free at load minus a margin) when the engine runs
    one, else the flags alone (an engine loaded without a plan has no other budget)."""
    plan = getattr(core.offload, "plan", None)
    b = getattr(plan, "budgets", None)
    gpu, cpu = (b.gpu, b.cpu) if b is not None else (core.config.gpu_mem, core.config.cpu_mem)
    return {t: int(v) for t, v in (("gpu", gpu), ("cpu", cpu)) if v is not None}


def layer_placement(core: EngineCore) -> tuple[tuple[str, bool], ...]:
    """Per layer: the tier holding its weights and whether it is streamed each step (the offload
    plan's layers; a layer it does not list, or every layer without a runtime, is resident where
    the model runs)."""
    home = "gpu" if core.loaded.device.type == "cuda" else "cpu"
    plan = getattr(core.offload, "plan", None)
    planned = tuple((p.tier, p.kind in ("cpu->gpu", "disk")) for p in plan.layers) if plan is not None else ()
    return planned + ((home, False),) * max(int(core.loaded.args.num_hidden_layers) - len(planned), 0)


class _Instruments(Collector):
    """The library's counters and histograms, less their ``_created`` samples."""

    def __init__(self, instruments: Sequence[Any]):
        self._instruments = tuple(instruments)

    def describe(self) -> Iterable[Metric]:
        return [fam for m in self._instruments for fam in m.describe()]

    def collect(self) -> Iterable[Metric]:
        for m in self._instruments:
            for fam in m.collect():  # fresh objects each scrape: trimming them changes nothing else
                fam.samples = [s for s in fam.samples if not s.name.endswith("_created")]
                yield fam


class _Families:
    """One family per metric name with every engine's samples in it (a scrape may name a family once);
    ``model`` first among the labels, left out for an engine without a name (a bare :class:`Metrics`)."""

    def __init__(self) -> None:
        self._fams: dict[str, Metric] = {}

    def add(self, kind: type, name: str, help_: str, model: str, value: Any, /, **labels: str) -> None:
        fam = self._fams.get(name)
        if fam is None:
            names = (["model"] if model else []) + list(labels)
            fam = self._fams[name] = kind(name, help_, labels=names)
        fam.add_metric(([model] if model else []) + list(labels.values()), value)

    def per_tier(self, name: str, help_: str, model: str, values: dict[str, int]) -> None:
        for tier, v in sorted(values.items()):
            self.add(GaugeMetricFamily, name, help_, model, v, tier=tier)

    def __iter__(self) -> Iterator[Metric]:
        return iter(self._fams.values())


class _EngineCollector(Collector):
    """Gauges (and the swap, expert and disk-tier counters) from each engine's latest :class:`EngineGauges`."""

    def __init__(self, metrics: Metrics):
        self._metrics = metrics

    def collect(self) -> Iterator[Metric]:
        out = _Families()
        for em in self._metrics.engines():
            _engine_samples(out, em.model, em.engine)  # one read of each: a consistent snapshot
        yield from out


def _engine_samples(out: _Families, model: str, g: EngineGauges) -> None:
    G, C = GaugeMetricFamily, CounterMetricFamily
    out.add(G, "llmsys_kv_blocks_cached", "Free KV blocks still holding a reusable prompt prefix.", model,
            g.kv_blocks_cached)
    out.add(G, "llmsys_queue_depth", "Requests waiting (server queue + engine waiting).", model, g.queue_depth)
    out.add(G, "llmsys_requests_running", "Requests being decoded.", model, g.running)
    out.add(G, "llmsys_kv_blocks_total", "KV blocks in the pool.", model, g.kv_blocks_total)
    if g.kv_cold_blocks_total:
        out.add(G, "llmsys_kv_cold_blocks_total", "KV blocks of the cold tier (offloaded beyond the pool).", model,
                g.kv_cold_blocks_total)
    out.per_tier("llmsys_kv_blocks_used", "KV blocks in use, per memory tier (pool and cold tier).", model,
                 g.kv_blocks_used)
    sw = g.swap
    if sw:
        out.per_tier("llmsys_kv_swap_blocks_used", "Swap-space blocks holding preempted requests' KV.", model,
                     {sw["tier"]: sw["used"]})
        help_ = "Preempted requests, by what happened to their KV."
        out.add(C, "llmsys_kv_preemptions", help_, model, sw["swap_outs"], kind="swap")
        out.add(C, "llmsys_kv_preemptions", help_, model, sw["recomputes"], kind="recompute")
    for name, help_, values in (
        ("llmsys_weight_bytes", "Model weight bytes per memory tier (disk: streamed from the offload folder).",
         g.weights),
        ("llmsys_memory_resident_bytes", "Bytes llmsys's own buffers hold per memory tier: weights, the KV "
         "pool's resident pages, staging and swap buffers (the process's RSS is this plus the runtime).",
         g.resident),
        ("llmsys_kv_bytes_reserved", "Bytes reserved for KV per memory tier (pool and cold tier); a CPU pool's "
         "pages are backed only once written.", g.kv_total),
        ("llmsys_kv_bytes_resident", "Bytes of the KV pool backed by memory per tier (pages up to the highest "
         "block ever written).", g.kv_resident),
        ("llmsys_kv_bytes_in_use", "Bytes of KV blocks holding tokens per memory tier: live requests' and "
         "cached prompt prefixes'.", g.kv_in_use),
        ("llmsys_kv_bytes_total", "Same as llmsys_kv_bytes_reserved (the older name).", g.kv_total),
        ("llmsys_kv_bytes_used", "Bytes of KV blocks live requests hold per memory tier.", g.kv_used),
        ("llmsys_staging_bytes", "Offload ring / staging buffer bytes per memory tier.", g.staging),
        ("llmsys_kv_swap_bytes_total", "Swap space for preempted requests' KV, per memory tier.", g.swap_total),
        ("llmsys_kv_swap_bytes_used", "Bytes of swapped-out KV blocks per memory tier.", g.swap_used),
        ("llmsys_memory_budget_bytes", "Bytes llmsys may use per memory tier (--gpu-mem / --cpu-mem or the "
         "offload plan's); tiers without a budget are absent.", g.budgets),
    ):
        out.per_tier(name, help_, model, values)
    ex = g.experts
    if ex is not None:
        out.add(G, "llmsys_expert_bytes", "MoE expert weight bytes kept apart from their layers, per tier "
                "(disk: read on demand into the expert cache).", model, ex.expert_bytes, tier=ex.tier)
        out.add(G, "llmsys_expert_cache_bytes", "RAM expert cache: bytes holding an expert now.", model, ex.cache_bytes)
        out.add(G, "llmsys_expert_cache_capacity_bytes", "RAM expert cache size.", model, ex.cache_capacity)
        out.add(C, "llmsys_expert_cache_hits", "Routed experts found in the cache.", model, ex.hits)
        out.add(C, "llmsys_expert_cache_misses", "Routed experts read from disk.", model, ex.misses)
        out.add(C, "llmsys_expert_read_bytes", "Expert bytes read from disk.", model, ex.bytes_read)
        out.add(C, "llmsys_expert_pregate_hits", "Routed experts that the pre-gating guess (the next router run on "
                "the layer before's input) named.", model, ex.guess_hits)
        out.add(C, "llmsys_expert_pregate_chosen", "Routed experts of layers that had a pre-gating guess.", model,
                ex.guess_chosen)
        out.add(C, "llmsys_expert_prefetch_reads", "Experts read ahead on a pre-gating guess.", model, ex.ahead_reads)
        out.add(C, "llmsys_expert_prefetch_used", "Experts read ahead that their layer routed to.", model,
                ex.ahead_used)
        out.add(C, "llmsys_expert_prefetch_bytes", "Expert bytes read ahead on a pre-gating guess.", model,
                ex.ahead_bytes)
        out.add(G, "llmsys_expert_prefetch_unused_bytes", "Expert bytes read ahead and never routed to.", model,
                ex.ahead_unused_bytes)
    if g.kv_disk is not None:
        _kv_disk_samples(out, model, g.kv_disk)
    for i, (tier, streamed) in enumerate(g.layers):
        out.add(InfoMetricFamily, "llmsys_layer", "Where each decoder layer's weights live (streamed: copied to "
                "the compute tier each step).", model, {"tier": tier, "streamed": "true" if streamed else "false"},
                layer=str(i))


def _kv_disk_samples(out: _Families, model: str, d: KVDiskReport) -> None:
    """The prefix cache's disk tier: its bytes, its limit, whether it is on, and its counters (in blocks)."""
    s = d.stats
    out.add(GaugeMetricFamily, "llmsys_kv_disk_bytes", "Bytes of KV block files in the disk tier's folder "
            "(--kv-disk).", model, s.bytes_on_disk)
    out.add(GaugeMetricFamily, "llmsys_kv_disk_limit_bytes", "The disk tier's size limit (--kv-disk).", model, d.limit)
    out.add(GaugeMetricFamily, "llmsys_kv_disk_enabled", "1 while the disk tier works; 0 after a disk failure "
            "turned it off.", model, 1 if d.enabled else 0)
    for name, help_, v in (
        ("llmsys_kv_disk_hit_blocks", "KV blocks read back from disk instead of computed.", s.hits),
        ("llmsys_kv_disk_misses", "Prompts that looked on disk past the pool's prefix and found nothing.", s.misses),
        ("llmsys_kv_disk_corrupt_blocks", "Block files found torn or corrupt (deleted and computed).", s.corrupt),
        ("llmsys_kv_disk_written_blocks", "KV blocks written to disk.", s.written),
        ("llmsys_kv_disk_dropped_blocks", "KV blocks not written (the write queue was full).", s.dropped),
        ("llmsys_kv_disk_evicted_blocks", "Block files deleted to stay within --kv-disk.", s.evicted),
    ):
        out.add(CounterMetricFamily, name, help_, model, v)


class EngineMetrics:
    """One engine's gauges, replaced whole by its engine thread (:class:`EngineGauges`); ``model`` is
    the served id its series are labelled with ("" until the server names it: no label)."""

    def __init__(self, model: str = "") -> None:
        self.model = model
        self.engine = EngineGauges()

    def set_gauges(self, queue_depth: int, running: int, kv_used: dict[str, int], kv_total: int,
                   swap: dict[str, int] | None = None, kv_cached: int = 0, kv_cold_total: int = 0) -> None:
        """``swap``: swap space counters (``llmsys.offload.kv_swap``), None when swap is off;
        ``kv_cached``: free blocks still holding a reusable prompt prefix; ``kv_used`` counts hot
        blocks under the pool's tier and cold ones (``kv_cold_total`` of them) under theirs."""
        self.engine = dataclasses.replace(
            self.engine, queue_depth=queue_depth, running=running, kv_blocks_used=dict(kv_used),
            kv_blocks_total=kv_total, kv_blocks_cached=kv_cached, kv_cold_blocks_total=kv_cold_total,
            swap=dict(swap) if swap else {})

    def set_memory(self, rep: MemoryReport) -> None:
        """Bytes per tier from the engine's own accounting (``EngineCore.memory_report()``)."""
        self.engine = dataclasses.replace(
            self.engine, weights=dict(rep.weights), kv_total=dict(rep.kv_total), kv_used=dict(rep.kv_used),
            kv_resident=dict(rep.kv_resident), kv_in_use=rep.kv_in_use, resident=rep.resident,
            staging=dict(rep.staging), swap_total=dict(rep.kv_swap_total), swap_used=dict(rep.kv_swap_used),
            experts=rep.experts)
        if rep.kv_disk is not None:
            self.engine = dataclasses.replace(self.engine, kv_disk=rep.kv_disk)

    @property
    def has_placement(self) -> bool:
        return bool(self.engine.layers)

    def set_placement(self, budgets: dict[str, int], layers: Sequence[tuple[str, bool]]) -> None:
        """What does not change once the model is loaded: budgets per tier, each layer's tier."""
        self.engine = dataclasses.replace(self.engine, budgets=dict(budgets), layers=tuple(layers))


class Metrics:
    """Counters, gauges and histograms of one server process, on a registry of its own."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        self._engines: list[EngineMetrics] = []  # one per loaded model (replaced whole: scrapes read a copy)
        self._lock = threading.Lock()
        self.requests = Counter("llmsys_requests", "HTTP requests by endpoint and status code.",
                                ["endpoint", "status"], registry=None)
        self.finished = Counter("llmsys_request_finished", "Engine requests finished, by reason.", ["reason"],
                                registry=None)
        self.prompt_tokens = Counter("llmsys_prompt_tokens", "Prompt tokens of finished requests.", registry=None)
        self.generation_tokens = Counter("llmsys_generation_tokens", "Tokens generated.", registry=None)
        self.evicted_tokens = Counter("llmsys_kv_evicted_tokens", "KV tokens evicted by the KV policy.", registry=None)
        self.cached_tokens = Counter("llmsys_prefix_cache_hit_tokens",
                                     "Prompt tokens whose KV came from the prefix cache.", registry=None)
        self.draft_tokens = Counter("llmsys_spec_draft_tokens",
                                    "Speculative decoding: draft tokens the model verified.", registry=None)
        self.accepted_draft_tokens = Counter("llmsys_spec_accepted_tokens",
                                             "Speculative decoding: draft tokens the model kept.", registry=None)
        self.ttft = Histogram("llmsys_time_to_first_token_seconds", "Request arrival to first generated token.",
                              buckets=LATENCY_BUCKETS, registry=None)
        self.itl = Histogram("llmsys_inter_token_latency_seconds", "Time between consecutive tokens of a request.",
                             buckets=LATENCY_BUCKETS, registry=None)
        self.e2e = Histogram("llmsys_e2e_request_latency_seconds", "Request arrival to finish.",
                             buckets=LATENCY_BUCKETS, registry=None)
        self.limit_hits = Counter("llmsys_limit_hits", "Connections and requests cut by a client limit, by limit: "
                                  "max_connections, max_connections_per_client (refused), body_deadline, body_stall "
                                  "(408), send_timeout, unsent_backlog (a stream to a client that stopped reading).",
                                  ["limit"], registry=None)
        self.registry.register(_Instruments([self.requests, self.finished, self.prompt_tokens, self.generation_tokens,
                                             self.evicted_tokens, self.cached_tokens, self.draft_tokens,
                                             self.accepted_draft_tokens, self.limit_hits]))
        self.registry.register(_EngineCollector(self))
        self.registry.register(_Instruments([self.ttft, self.itl, self.e2e]))
        ProcessCollector(registry=self.registry)
        PlatformCollector(registry=self.registry)

    # -- HTTP handlers (any thread) ------------------------------------------
    def count_request(self, endpoint: str, status: int) -> None:
        self.requests.labels(endpoint, str(status)).inc()

    def count_limit(self, limit: str) -> None:
        """One connection or request cut by a client limit (see ``llmsys_limit_hits``)."""
        self.limit_hits.labels(limit).inc()

    # -- the engine thread ---------------------------------------------------
    def on_tokens(self, n: int, ttft: float | None, itl: float | None) -> None:
        self.generation_tokens.inc(n)
        if ttft is not None:
            self.ttft.observe(ttft)
        if itl is not None:
            self.itl.observe(itl)

    def on_finish(self, reason: str, prompt_tokens: int, evicted: int, e2e: float, cached: int = 0,
                  drafted: int = 0, accepted: int = 0) -> None:
        self.finished.labels(reason).inc()
        self.draft_tokens.inc(drafted)
        self.accepted_draft_tokens.inc(accepted)
        self.prompt_tokens.inc(prompt_tokens)
        self.evicted_tokens.inc(evicted)
        self.cached_tokens.inc(cached)
        self.e2e.observe(e2e)

    # -- the engines (one per loaded model) -------------------------------------
    def add_engine(self, model: str = "") -> EngineMetrics:
        """A new engine's gauges, exported (labelled ``model``) until :meth:`remove_engine`."""
        em = EngineMetrics(model)
        with self._lock:
            self._engines = [*self._engines, em]
        return em

    def remove_engine(self, em: EngineMetrics) -> None:
        """An engine stopped (its model unloaded): its series go from the next scrape."""
        with self._lock:
            self._engines = [e for e in self._engines if e is not em]

    def engines(self) -> list[EngineMetrics]:
        return self._engines

    # -- /metrics --------------------------------------------------------------
    def render(self) -> str:
        """The text exposition (format 0.0.4, :data:`CONTENT_TYPE`)."""
        return generate_latest(self.registry).decode("utf-8")


def _label_value(v: str) -> str:
    return v.replace("\\", r"\\").replace("\n", r"\n").replace('"', r"\"")


def parse_metrics(text: str, model: str | None = None) -> dict[str, float]:
    """``{'name{k="v",...}': value}`` from exposition text (tests, the benchmark): labels in the
    order the text gives them, every sample (``_bucket``, ``_sum``, ``_count`` of a histogram).
    One model's view: ``model`` keeps that model's per-engine series (and every series without a
    ``model`` label) with the label left out of the keys; without ``model``, a text that names one
    model only is read as that model's (the keys a one-model server always had), several keep it."""
    fams = list(text_string_to_metric_families(text))
    if model is None:
        seen = {s.labels["model"] for fam in fams for s in fam.samples if "model" in s.labels}
        model = next(iter(seen)) if len(seen) == 1 else None
    out: dict[str, float] = {}
    for fam in fams:
        for s in fam.samples:
            labels = dict(s.labels)
            if model is not None and "model" in labels:
                if labels.pop("model") != model:
                    continue
            text_labels = ",".join(f'{k}="{_label_value(v)}"' for k, v in labels.items())
            out[f"{s.name}{{{text_labels}}}" if text_labels else s.name] = float(s.value)
    return out
