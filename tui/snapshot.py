"""What the memory panel shows, as plain frozen dataclasses.

The panel never reads the engine itself: the engine thread (chat) or the
metrics poller (monitor) fills a :class:`TierSnapshot` and hands it over. That
keeps the UI thread away from the (not thread-safe) engine core and lets the
same widgets show a local engine or a remote ``llmsys serve``.

Placement plans and streaming statistics come from the offload package, which
is still growing: they are read by duck typing (``getattr``) so that a missing
attribute degrades to "all layers resident on <device>" instead of failing.
"""

from __future__ import annotations

import shutil
from dataclasses import dataclass, field
from typing import Any

import psutil

TIERS = ("gpu", "cpu", "disk")
TIER_LABELS = {"gpu": "GPU", "cpu": "CPU", "disk": "disk"}


@dataclass(frozen=True)
class TierUsage:
    """Bytes on one memory tier, split the way the bar draws them."""

    tier: str  # "gpu" | "cpu" | "disk"
    budget: int | None  # bytes this tier may use (None: unknown / tier absent)
    weights: int = 0  # model weights resident on this tier
    kv_reserved: int = 0  # KV pool allocated on this tier (address space for a CPU pool: MemoryReport)
    kv_used: int = 0  # bytes of KV blocks holding tokens: live requests and cached prefixes (<= kv_resident)
    workspace: int = 0  # activations / staging buffers
    kv_blocks_used: int = 0
    kv_blocks_total: int = 0
    kv_resident: int = 0  # bytes of the pool backed by memory (<= kv_reserved)

    @property
    def used(self) -> int:
        """Bytes this tier holds now: weights, the KV pool's resident pages, workspace (the
        reservation's untouched pages hold nothing until written)."""
        return self.weights + self.kv_resident + self.workspace

    @property
    def present(self) -> bool:
        return self.budget is not None or self.used > 0


@dataclass(frozen=True)
class ExpertUsage:
    """MoE experts kept apart from their layers (``memory_report().experts`` or the server's
    ``llmsys_expert_*`` metrics): where they live and how the RAM expert cache is doing."""

    tier: str  # "disk" (read on demand into the cache) | "cpu" (resident, computed on the CPU)
    expert_bytes: int
    cache_bytes: int = 0  # slots holding an expert now
    cache_capacity: int = 0
    hits: int = 0
    misses: int = 0

    @property
    def hit_rate(self) -> float | None:
        return self.hits / (self.hits + self.misses) if self.hits + self.misses else None


@dataclass(frozen=True)
class TierSnapshot:
    """One moment of the engine's memory and speed, ready to draw."""

    tiers: tuple[TierUsage, ...]
    layer_tiers: tuple[str, ...] = ()  # tier holding each layer's weights
    layer_streamed: tuple[bool, ...] = ()  # True: layer is copied to the compute tier per step
    plan_phrase: str = ""  # "layers 0-11 GPU, 12-31 CPU->GPU streamed"
    tokens_in_context: int | None = None
    context_budget: int | None = None
    evicted_tokens: int | None = None
    kv_policy: str | None = None
    tok_s: float | None = None  # latest decode speed
    tok_s_history: tuple[float, ...] = ()  # for the sparkline, oldest first
    ttft_s: float | None = None
    transfer_wait_share: float | None = None  # share of step time waiting for weight copies
    generating: bool = False
    source: str = "engine"  # "engine" (local) | "server" (read from /metrics)
    # Server-only (``llmsys monitor``); None for a local engine.
    requests_running: int | None = None
    requests_waiting: int | None = None
    per_request_tok_s: float | None = None
    experts: ExpertUsage | None = None  # None: no MoE experts kept apart from their layers
    extra: dict[str, Any] = field(default_factory=dict, compare=False, hash=False)

    def tier(self, name: str) -> TierUsage:
        for t in self.tiers:
            if t.tier == name:
                return t
        return TierUsage(name, None)

    @property
    def kv_blocks_used(self) -> int:
        return sum(t.kv_blocks_used for t in self.tiers)

    @property
    def kv_blocks_total(self) -> int:
        return sum(t.kv_blocks_total for t in self.tiers)


def device_tier(device: Any) -> str:
    """The tier name of a torch device (or device string)."""
    kind = getattr(device, "type", str(device)).split(":")[0]
    return "gpu" if kind == "cuda" else "cpu"


def default_budgets(config: Any, device: Any) -> dict[str, int | None]:
    """Budget per tier: the user's ``--gpu-mem/--cpu-mem`` or what the machine has.

    Measured once when the engine loads (not on every refresh): asking CUDA or
    the OS for totals is cheap but not free, and totals do not move.
    """
    gpu = getattr(config, "gpu_mem", None)
    if gpu is None and device_tier(device) == "gpu":
        try:
            import torch

            gpu = int(torch.cuda.mem_get_info(device)[1])
        except Exception:  # noqa: BLE001 - a budget we cannot read shows as n/a
            gpu = None
    cpu = getattr(config, "cpu_mem", None) or int(psutil.virtual_memory().total)
    disk = None
    offload_dir = getattr(config, "offload_dir", None)
    if offload_dir:
        try:
            disk = int(shutil.disk_usage(offload_dir).total)
        except OSError:
            disk = None
    return {"gpu": gpu, "cpu": cpu, "disk": disk}


def _layer_placement(plan: Any, n_layers: int, home: str) -> tuple[tuple[str, ...], tuple[bool, ...]]:
    """Per-layer tier and streamed flag from an offload plan (duck-typed)."""
    if plan is None:
        return (home,) * n_layers, (False,) * n_layers
    tiers = getattr(plan, "layer_tiers", None)
    streamed = getattr(plan, "layer_streamed", None)
    layers = getattr(plan, "layers", None)
    if tiers is None and layers is not None:
        tiers = [getattr(x, "tier", home) for x in layers]
        # offload.plan.Placement: kind "gpu" | "cpu" | "cpu->gpu" | "disk"
        streamed = [bool(getattr(x, "streamed", getattr(x, "kind", "") in ("cpu->gpu", "disk"))) for x in layers]
    if tiers is None:
        return (home,) * n_layers, (False,) * n_layers
    tiers = tuple(str(t).lower() for t in tiers)
    if streamed is None:
        streamed = [t != home for t in tiers]
    return tiers, tuple(bool(s) for s in streamed)


def plan_phrase(layer_tiers: tuple[str, ...], layer_streamed: tuple[bool, ...], home: str) -> str:
    """One phrase for the status line: 'layers 0-11 GPU, 12-31 CPU->GPU streamed'."""
    n = len(layer_tiers)
    if n == 0:
        return "no layers"
    if all(t == home for t in layer_tiers) and not any(layer_streamed):
        return f"all {n} layers resident on {TIER_LABELS.get(home, home)}"
    runs: list[tuple[int, int, str, bool]] = []
    for i, (t, s) in enumerate(zip(layer_tiers, layer_streamed)):
        if runs and runs[-1][2] == t and runs[-1][3] == s:
            runs[-1] = (runs[-1][0], i, t, s)
        else:
            runs.append((i, i, t, s))
    parts = []
    for a, b, t, s in runs:
        span = f"{a}" if a == b else f"{a}-{b}"
        where = TIER_LABELS.get(t, t)
        if s:
            where = f"{where}->{TIER_LABELS.get(home, home)} streamed"
        parts.append(f"{span} {where}")
    return "layers " + ", ".join(parts)


@dataclass(frozen=True)
class PerfStats:
    """Speed figures the engine thread measures itself."""

    tok_s: float | None = None
    tok_s_history: tuple[float, ...] = ()
    ttft_s: float | None = None
    tokens_in_context: int | None = None
    evicted_tokens: int = 0
    generating: bool = False


def snapshot_from_engine(llm: Any, budgets: dict[str, int | None], perf: PerfStats = PerfStats()) -> TierSnapshot:
    """Fill a snapshot from ``llm.memory_report()`` (+ ``llm.plan`` when present).

    Call it on the thread that owns the engine core.
    """
    rep = llm.memory_report()
    home = device_tier(llm.loaded.device)
    plan = getattr(llm, "plan", None)
    # the engine's own staging buffers (what /metrics and /api/ps count too); the plan's estimate of
    # staging + activation scratch only for a report that has none to say
    workspace = dict(getattr(rep, "staging", None) or getattr(rep, "workspace", None) or {})
    if not hasattr(rep, "staging") and plan is not None:
        for part in (getattr(plan, "staging", None) or {}, getattr(plan, "activations", None) or {}):
            for t, n in part.items():
                workspace[t] = workspace.get(t, 0) + int(n)
    blocks_by_tier = getattr(rep, "kv_blocks_by_tier", None)
    kv_tiers = [t for t, n in rep.kv_total.items() if n]
    tiers = []
    for name in TIERS:
        if blocks_by_tier is not None:
            used_b, total_b = blocks_by_tier.get(name, (0, 0))
        elif name == (kv_tiers[0] if kv_tiers else home):
            used_b, total_b = rep.kv_blocks_used, rep.kv_blocks_total
        else:
            used_b, total_b = 0, 0
        tiers.append(
            TierUsage(
                tier=name,
                budget=budgets.get(name),
                weights=int(rep.weights.get(name, 0)),
                kv_reserved=int(rep.kv_total.get(name, 0)),
                kv_used=int(rep.kv_in_use.get(name, 0)),
                workspace=int(workspace.get(name, 0)),
                kv_blocks_used=int(used_b),
                kv_blocks_total=int(total_b),
                kv_resident=int(rep.kv_resident.get(name, 0)),
            )
        )
    n_layers = int(llm.loaded.args.num_hidden_layers)
    layer_tiers, streamed = _layer_placement(plan, n_layers, home)
    phrase = plan.describe() if plan is not None and callable(getattr(plan, "describe", None)) else plan_phrase(layer_tiers, streamed, home)
    stats = getattr(llm, "stream_stats", None) or getattr(plan, "stats", None)
    wait_share = None
    if stats is not None:
        wait, total = getattr(stats, "wait_s", None), getattr(stats, "total_s", None)
        if wait is not None and total:
            wait_share = float(wait) / float(total)
    evicted = perf.evicted_tokens + int(getattr(rep, "evicted_tokens", 0) or 0)
    ex = getattr(rep, "experts", None)
    experts = None if ex is None else ExpertUsage(ex.tier, ex.expert_bytes, ex.cache_bytes, ex.cache_capacity,
                                                  ex.hits, ex.misses)
    return TierSnapshot(
        tiers=tuple(tiers),
        layer_tiers=layer_tiers,
        layer_streamed=streamed,
        plan_phrase=phrase,
        tokens_in_context=perf.tokens_in_context,
        context_budget=int(llm.max_model_len),
        evicted_tokens=evicted,
        kv_policy=llm.config.kv_policy.text,
        tok_s=perf.tok_s,
        tok_s_history=perf.tok_s_history,
        ttft_s=perf.ttft_s,
        transfer_wait_share=wait_share,
        generating=perf.generating,
        experts=experts,
    )
