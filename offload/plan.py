"""The placement planner: where each layer lives and where it is computed.

``Placement.kind``: ``gpu`` (resident, computed there), ``cpu`` (in RAM, computed by the CPU; every
resident layer on a CPU-only machine), ``cpu->gpu`` (pinned RAM, copied to the GPU every step), ``disk``
(read every step into a ring of buffers). A sparse layer's experts may live apart (``Placement.experts``:
``disk`` with a RAM cache, :class:`ExpertPlan`; ``cpu`` for ``--cpu-moe``); a token computes ``k / E`` of
their bytes (:meth:`UnitShape.compute_bytes`). With prefetch a step takes about ``max(sum(compute),
sum(disk reads), sum(h2d copies))``, a layer's compute ``max(bytes / memory bandwidth, flops / peak)``.
The planner counts layers per kind, picks the fastest plan within every budget, and spreads the kinds
evenly so resident layers' compute overlaps the streamed ones' reads.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from llmsys.offload.bandwidth import Bandwidths, FormatCost, KernelCosts
from llmsys.kernels.common.units import format_bytes
from llmsys.offload.budgets import Budgets

KINDS = ("gpu", "cpu", "cpu->gpu", "disk")
RING_SLOTS = 2  # staging buffers per link: one being filled, one being computed
STREAM_LATENCY_S = 50e-6  # per streamed unit: thread hand-off, sync


@dataclass(frozen=True)
class UnitShape:
    """One placeable piece of the model."""

    name: str  # "layers.3", "embed", "lm_head", "embed+lm_head" (tied)
    kind: str  # "layer" | "embed" | "head"
    nbytes: int  # weight bytes as stored at run time (dtype / quantized format)
    params: int  # weights of the unit (2 * params flops/token, less the experts a token skips); 0 for a gather
    # A sparse layer's routed experts (included in nbytes / params): E experts, k used per token.
    expert_bytes: int = 0
    expert_params: int = 0
    num_experts: int = 0
    top_k: int = 0
    # The experts' bytes as the checkpoint stores them, where a read of them from disk takes another number of
    # bytes than they hold at run time (a GGUF's blocks; F16 for a float32 engine); 0: expert_bytes.
    expert_stored_bytes: int = 0
    # An embedding kept quantized (a GGUF's codes and scales): no row layout to read its tokens' rows from, so on
    # disk the runtime streams the whole table around each lookup (offload.runtime: _whole_unit).
    whole_reads: bool = False
    # The stored formats of the unit's matrices, (format, share of ``params``): "bfloat16", "int8", "int4+offset"
    # ... (offload.kernel_probe.BUILDERS names); () = the model dtype's. What the calibrated costs are keyed by.
    formats: tuple[tuple[str, float], ...] = ()

    def expert_frac(self, tokens: int) -> float:
        """The expected share of the experts a step of ``tokens`` tokens uses (uniform routing): ``1 - (1 - k/E)^T``."""
        if not self.num_experts:
            return 1.0
        return 1.0 - (1.0 - self.top_k / self.num_experts) ** max(tokens, 1)

    def compute_bytes(self, tokens: int) -> int:
        """Weight bytes a step of ``tokens`` tokens reads from memory: the experts its tokens chose only."""
        return self.nbytes - self.expert_bytes + int(self.expert_bytes * self.expert_frac(tokens))

    @property
    def token_params(self) -> int:
        """Weights one token multiplies: the non-expert ones and ``k`` of the ``E`` experts."""
        if not self.num_experts:
            return self.params
        return self.params - self.expert_params + self.expert_params * self.top_k // self.num_experts

    @property
    def bytes_per_expert(self) -> int:
        return self.expert_bytes // max(self.num_experts, 1)

    @property
    def stored_bytes_per_expert(self) -> int:
        """Bytes a read of one expert takes from disk."""
        return (self.expert_stored_bytes or self.expert_bytes) // max(self.num_experts, 1)


@dataclass(frozen=True)
class ModelShape:
    """What the planner needs to know about a model (built from the meta model)."""

    layers: tuple[UnitShape, ...]
    embed: UnitShape | None  # None when tied to the LM head
    head: UnitShape
    hidden: int
    intermediate: int
    vocab: int
    kv_bytes_per_token_layer: float  # K + V bytes of one token in one layer (int4 KV's stats: fractional)
    dtype: torch.dtype

    @property
    def weight_bytes(self) -> int:
        return sum(u.nbytes for u in self.layers) + self.head.nbytes + (self.embed.nbytes if self.embed else 0)

    @property
    def tied(self) -> bool:
        return self.embed is None

    @property
    def sparse(self) -> tuple[int, ...]:
        """Indices of the layers with routed experts."""
        return tuple(i for i, u in enumerate(self.layers) if u.num_experts)


@dataclass(frozen=True)
class Workload:
    """What the plan is optimized for."""

    batch: int = 1
    prompt_len: int = 128
    output_len: int = 128
    kv_tokens: int = 4096  # KV pool capacity (tokens, all sequences)
    kv_cold_tokens: int = 0  # cold KV tier beyond the pool (llmsys.offload.kv_tier; not in the cost model)
    max_batched_tokens: int = 512  # prefill chunk


@dataclass(frozen=True)
class Placement:
    name: str
    kind: str  # one of KINDS
    compute: str  # "gpu" | "cpu"
    nbytes: int
    ms: float  # predicted ms of this unit per decode step
    bound: str  # what bounds it: "compute", "disk", "h2d", "memory"
    # Where a sparse layer's routed experts live when not with the layer: "" (with it), "disk" (read on
    # demand into the RAM expert cache), "cpu" (--cpu-moe: CPU RAM, computed there). nbytes includes them.
    experts: str = ""
    expert_bytes: int = 0
    expert_disk_bytes: int = 0  # experts on disk: their bytes as the file stores them (0: expert_bytes)

    def bytes_by_tier(self) -> dict[str, int]:
        """This unit's weight bytes per tier (a layer's experts may live in another; on disk as stored)."""
        if not self.experts:
            return {self.tier: self.nbytes}
        out = {self.tier: self.nbytes - self.expert_bytes}
        moved = (self.expert_disk_bytes or self.expert_bytes) if self.experts == "disk" else self.expert_bytes
        out[self.experts] = out.get(self.experts, 0) + moved
        return out

    @property
    def tier(self) -> str:
        return {"gpu": "gpu", "cpu": "cpu", "cpu->gpu": "cpu", "disk": "disk"}[self.kind]


@dataclass(frozen=True)
class ExpertPlan:
    """Where sparse layers' experts live when apart from their layers, and what that costs per token."""

    tier: str  # "disk" (read on demand into the RAM cache) | "cpu" (--cpu-moe: resident, computed by the CPU)
    layers: tuple[int, ...]  # the sparse layers placed so
    num_experts: int
    top_k: int
    bytes_per_expert: int
    cache_bytes: int = 0  # the RAM expert cache (disk tier): the CPU budget left after everything else
    batch: int = 1  # sequences per decode step the estimate is for
    policy: str = "lfu"  # the cache's eviction ("lfu" | "lru": offload/experts.py says why LFU is the default)
    # bytes a read of one expert takes from disk, where the file stores them in another form than a cache slot
    # holds (a GGUF's blocks: read as stored, repacked in the slot); 0: bytes_per_expert
    stored_bytes_per_expert: int = 0
    # pre-gating (disk tier): each sparse layer guesses the next one's experts and reads them ahead (offload/experts.py)
    prefetch: bool = True

    @property
    def expert_bytes(self) -> int:
        """The experts' bytes as they are held at run time (cache slots, CPU RAM)."""
        return len(self.layers) * self.num_experts * self.bytes_per_expert

    @property
    def read_bytes_per_expert(self) -> int:
        return self.stored_bytes_per_expert or self.bytes_per_expert

    @property
    def stored_expert_bytes(self) -> int:
        """The experts' bytes on disk, as the file stores them."""
        return len(self.layers) * self.num_experts * self.read_bytes_per_expert

    @property
    def active_bytes_per_token(self) -> int:
        """Expert bytes one token computes: ``k / E`` of them."""
        return len(self.layers) * self.top_k * self.bytes_per_expert

    @property
    def hit_rate(self) -> float:
        """Expected cache hits: with independent uniform routing an expert is cached with probability
        ``cache / expert bytes`` (skewed routers do better; ``benchmarks/bench_moe.py`` measures both)."""
        if self.tier != "disk":
            return 1.0
        return min(1.0, self.cache_bytes / max(self.expert_bytes, 1))

    def distinct(self, tokens: int) -> float:
        """Expected experts a layer runs for ``tokens`` tokens."""
        return self.num_experts * (1.0 - (1.0 - self.top_k / max(self.num_experts, 1)) ** max(tokens, 1))

    def read_bytes(self, tokens: int) -> int:
        """Expected disk bytes of a step of ``tokens`` tokens: the chosen experts that miss the cache."""
        if self.tier != "disk":
            return 0
        return int(len(self.layers) * self.distinct(tokens) * self.read_bytes_per_expert * (1.0 - self.hit_rate))

    @property
    def read_bytes_per_token(self) -> int:
        """Expected disk bytes per decoded token (a batch shares the experts its tokens have in common)."""
        return self.read_bytes(self.batch) // max(self.batch, 1)


@dataclass(frozen=True)
class Plan:
    """The chosen placement: data the engine, TUI and bench read."""

    layers: tuple[Placement, ...]
    embed: Placement | None  # None when tied (the head placement covers it)
    head: Placement
    head_chunk_rows: int  # LM head rows per streamed chunk (vocab rows)
    kv_tier: str  # "gpu" | "cpu"
    kv_bytes: int
    staging: dict[str, int]  # tier -> bytes of ring / staging buffers
    activations: dict[str, int]  # tier -> estimated activation scratch
    budgets: Budgets
    bandwidths: Bandwidths
    workload: Workload
    decode_ms: float  # predicted ms per decode step (one token per sequence)
    prefill_ms: float  # predicted ms for the workload's prompt(s)
    bound: str  # resource that bounds a decode step
    resources_ms: dict[str, float]  # resource -> busy ms per decode step
    reasons: tuple[str, ...] = ()
    alternatives: tuple[tuple[str, float], ...] = ()  # (description, decode ms) of other feasible plans
    min_cpu_bytes: int = 0  # smallest --cpu-mem that could run at all
    experts: ExpertPlan | None = None  # sparse layers' experts kept apart from their layers (None: with them)

    @property
    def kv_cold_tier(self) -> str:
        """Where the cold KV tier lives: pinned CPU RAM beside a GPU pool, else the offload folder."""
        return "cpu" if self.kv_tier == "gpu" else "disk"

    @property
    def kv_cold_bytes(self) -> int:
        return self.workload.kv_cold_tokens * self.kv_bytes // max(self.workload.kv_tokens, 1)

    @property
    def units(self) -> tuple[Placement, ...]:
        return self.layers + ((self.embed,) if self.embed else ()) + (self.head,)

    def bytes_in(self, tier: str) -> int:
        """Weight bytes resident in (or, for disk, read from) ``tier``."""
        return sum(u.bytes_by_tier().get(tier, 0) for u in self.units)

    @property
    def expert_cache_bytes(self) -> int:
        return self.experts.cache_bytes if self.experts is not None and self.experts.tier == "disk" else 0

    def used(self, tier: str) -> int:
        """Everything the plan allocates on ``tier`` (the number checked against the budget)."""
        kv = self.kv_bytes if self.kv_tier == tier else 0
        cache = self.expert_cache_bytes if tier == "cpu" else 0
        return self.bytes_in(tier) + kv + self.staging.get(tier, 0) + self.activations.get(tier, 0) + cache

    @property
    def streamed_bytes_per_step(self) -> int:
        return sum(u.nbytes for u in self.units if u.kind in ("disk", "cpu->gpu") and u is not self.embed)

    @property
    def disk_bytes_per_step(self) -> int:
        """Disk bytes of a decode step: streamed units whole, plus the experts expected to miss the cache."""
        experts = self.experts.read_bytes(self.workload.batch) if self.experts is not None else 0
        return sum(u.nbytes for u in self.units if u.kind == "disk" and u is not self.embed) + experts

    @property
    def tok_s(self) -> float:
        return 1000.0 * self.workload.batch / max(self.decode_ms, 1e-9)

    @property
    def needs_streaming(self) -> bool:
        return any(u.kind in ("disk", "cpu->gpu") for u in self.units) or any(p.experts for p in self.layers)

    def layer_kinds(self) -> list[str]:
        return [p.kind for p in self.layers]


# -- cost model ---------------------------------------------------------------


@dataclass
class _Cost:
    compute: float = 0.0
    disk: float = 0.0
    h2d: float = 0.0
    per_unit: dict[str, tuple[float, str]] = field(default_factory=dict)

    @property
    def total(self) -> float:
        return max(self.compute, self.disk, self.h2d)

    @property
    def bound(self) -> str:
        r = {"compute": self.compute, "disk read": self.disk, "host-to-device": self.h2d}
        return max(r, key=r.get)


def _unit_cost(u: UnitShape, kind: str, tokens: int, ctx: int, shape: ModelShape, bw: Bandwidths,
               compute_dev: str, experts: str = "", hit: float = 0.0) -> tuple[float, float, float]:
    """(compute s, disk s, h2d s) of one unit for one step of ``tokens`` tokens.

    ``experts``: where a sparse layer's experts live when apart from it ("disk": the chosen ones missing
    the cache, ``1 - hit`` of them, are read; "cpu": computed by the CPU beside a GPU layer)."""
    if u.kind == "embed":
        # A gather of `tokens` rows; from disk it is one small read per row.
        row = u.nbytes // max(shape.vocab, 1)
        if kind == "disk" and u.whole_reads:
            return 0.0, u.nbytes / (bw.disk_read_gbps * 1e9), 0.0
        if kind == "disk":
            return 0.0, tokens * (row / (bw.disk_read_gbps * 1e9) + 20e-6), 0.0
        return 0.0, 0.0, 0.0
    mem_bw = (bw.gpu_mem_gbps or 1000.0) * 1e9 if compute_dev == "gpu" else bw.mem_gbps * 1e9
    flops = bw.gpu_flops(shape.dtype) if compute_dev == "gpu" else bw.cpu_flops(shape.dtype)
    kv_read = shape.kv_bytes_per_token_layer * ctx * min(tokens, shape.vocab) if u.kind == "layer" else 0
    moved = u.nbytes - (u.expert_bytes if experts else 0)  # what streams / copies with the layer
    used = u.compute_bytes(tokens)  # a sparse layer reads only the experts its tokens chose
    disk = moved / (bw.disk_read_gbps * 1e9) if kind == "disk" else 0.0
    if experts == "cpu" and compute_dev == "gpu":  # --cpu-moe: the experts' GEMMs on the CPU
        ex = used - (u.nbytes - u.expert_bytes)
        used -= ex
        cpu_p = (u.token_params - (u.params - u.expert_params)) * tokens
        extra = max(ex / (bw.mem_gbps * 1e9), 2.0 * cpu_p / bw.cpu_flops(shape.dtype))
    else:
        extra = 0.0
    weights = _kernel_s(u, tokens, used, shape, bw) if compute_dev == "cpu" else None
    if weights is None:  # no calibrated figure: the roofline of the measured bandwidth and GEMM peak
        weights = max(used / mem_bw, 2.0 * u.token_params * tokens / flops)
    compute = weights + kv_read / mem_bw + extra
    if experts == "disk":
        distinct = u.num_experts * u.expert_frac(tokens)
        disk += distinct * u.stored_bytes_per_expert * (1.0 - hit) / (bw.disk_read_gbps * 1e9)
    h2d = moved / ((bw.h2d_gbps or 16.0) * 1e9) if (kind == "cpu->gpu" or (kind == "disk" and compute_dev == "gpu")) else 0.0
    if kind in ("disk", "cpu->gpu"):
        compute += STREAM_LATENCY_S
    return compute, disk, h2d


def dtype_format(dtype: torch.dtype) -> str:
    """A dense weight's format name: its dtype's (``"bfloat16"``)."""
    return str(dtype).removeprefix("torch.")


def unit_formats(u: UnitShape, shape: ModelShape) -> tuple[tuple[str, float], ...]:
    """``u``'s (format, share of its weights), the model dtype's when it names none."""
    return u.formats or ((dtype_format(shape.dtype), 1.0),)


def _kernel_s(u: UnitShape, tokens: int, used: int, shape: ModelShape, bw: Bandwidths) -> float | None:
    """Seconds the CPU's matmul kernels take over ``u``'s weights for ``tokens`` rows, from the kernel probe's
    figure for each of its formats (``bw.kernels``): the one-row pass over the bytes ``used`` (never faster
    than RAM delivers them) plus what the further rows add. None where a format has no figure."""
    kc = bw.kernels
    if kc is None or not u.params:
        return None
    read_w = u.params * used / max(u.nbytes, 1)  # weights the step reads (a sparse layer: its tokens' experts)
    read = rows = 0.0
    for fmt, share in unit_formats(u, shape):
        c = kc.cost(fmt)
        if c is None:
            return None
        read += c.read_s(share * read_w)
        rows += c.rows_s(share * u.token_params, tokens)
    return max(read, used / (bw.mem_gbps * 1e9)) + rows


@dataclass(frozen=True)
class Calibration:
    """Where a plan's CPU compute figures come from: each stored format of the model and its probed kernel
    cost (``bw.kernels``), or None where the roofline (RAM bandwidth, GEMM peak) stands in."""

    formats: tuple[tuple[str, FormatCost | None], ...]
    kernels: KernelCosts | None

    @property
    def calibrated(self) -> bool:
        return self.kernels is not None and all(c is not None for _, c in self.formats)


def calibration_of(shape: ModelShape, bw: Bandwidths) -> Calibration:
    """The formats of ``shape``'s matrices (layers and LM head) and the figures the planner costs them with."""
    names: dict[str, None] = {}
    for u in (*shape.layers, shape.head):
        for fmt, _ in unit_formats(u, shape):
            names[fmt] = None
    kc = bw.kernels
    return Calibration(tuple((f, kc.cost(f) if kc is not None else None) for f in names), kc)


def _step_cost(shape: ModelShape, kinds: list[str], embed_kind: str | None, head_kind: str, tokens: int, ctx: int,
               bw: Bandwidths, gpu: bool, experts: ExpertPlan | None = None) -> _Cost:
    c = _Cost()
    items = list(zip(shape.layers, kinds)) + ([(shape.embed, embed_kind)] if shape.embed else []) + [(shape.head, head_kind)]
    placed = set(experts.layers) if experts is not None else set()
    for j, (u, kind) in enumerate(items):
        dev = "cpu" if (kind == "cpu" or not gpu) else "gpu"
        if u.kind == "embed" and kind == "cpu":
            dev = "cpu"
        ex = experts.tier if (j in placed and u.kind == "layer") else ""
        comp, disk, h2d = _unit_cost(u, kind, tokens, ctx, shape, bw, dev, ex, experts.hit_rate if ex else 0.0)
        c.compute += comp
        c.disk += disk
        c.h2d += h2d
        parts = {"compute": comp, "disk": disk, "h2d": h2d}
        b = max(parts, key=parts.get)
        if b == "compute" and comp and kind in ("gpu", "cpu"):
            b = "memory" if u.nbytes / ((bw.gpu_mem_gbps or 1000) * 1e9 if dev == "gpu" else bw.mem_gbps * 1e9) >= comp * 0.5 else "compute"
        c.per_unit[u.name] = (max(parts.values()), b)
    return c


def spread(counts: dict[str, int]) -> list[str]:
    """Interleave kinds evenly: 2 x 'cpu' + 4 x 'disk' -> disk cpu disk disk cpu disk."""
    slots: list[tuple[float, int, str]] = []
    order = {k: i for i, k in enumerate(KINDS)}
    for kind, c in counts.items():
        n = sum(counts.values())
        for j in range(c):
            slots.append(((j + 0.5) * n / c, order[kind], kind))
    return [k for _, _, k in sorted(slots)]


def activation_bytes(shape: ModelShape, max_batched_tokens: int, max_seqs: int) -> int:
    """Scratch for one step: hidden states, MLP intermediates, logits (float32) + sampling copies."""
    elt = torch.tensor([], dtype=shape.dtype).element_size()
    per_tok = (6 * shape.hidden + 3 * shape.intermediate) * max(elt, 4)
    return max_batched_tokens * per_tok + max_seqs * shape.vocab * 4 * 3


def head_chunk_rows(shape: ModelShape) -> int:
    """Rows of a streamed LM-head chunk: about one layer's bytes (so one ring serves both)."""
    layer = max((u.nbytes for u in shape.layers), default=shape.head.nbytes)
    row = max(shape.head.nbytes // max(shape.vocab, 1), 1)
    rows = max(layer // row, 1)
    if rows >= 256:
        rows -= rows % 256
    return min(rows, shape.vocab)


def plan_placement(shape: ModelShape, budgets: Budgets, bw: Bandwidths, workload: Workload,
                   max_seqs: int | None = None, force: dict[str, int] | None = None, cpu_moe: int = 0) -> Plan:
    """The fastest feasible placement (or the one ``force`` = kind -> layer count asks for).

    Sparse layers: on a CPU engine the experts may stay on disk, read on demand into a RAM cache
    (chosen when that beats streaming layers whole; ``force["experts"] = "disk"`` asks for it and
    ``force["expert_cache"]`` caps the cache's bytes). ``cpu_moe`` (``--n-cpu-moe``; -1 all): the experts
    of the first ``cpu_moe`` sparse layers stay in CPU RAM, computed by the CPU; the rest of those
    layers is resident (GPU or CPU), never streamed.

    Raises ``BudgetError`` (with the minimum that would work) when nothing fits.
    """
    gpu = budgets.has_gpu
    n = len(shape.layers)
    force = dict(force or {})
    want_experts = force.pop("experts", None)
    cache_cap = force.pop("expert_cache", None)
    policy = str(force.pop("expert_policy", "lfu"))
    prefetch = bool(force.pop("expert_prefetch", True))
    sparse = shape.sparse
    moe_cpu = tuple(sparse if cpu_moe < 0 else sparse[:cpu_moe]) if cpu_moe else ()
    fixed_cpu = sum(shape.layers[i].expert_bytes for i in moe_cpu)  # --cpu-moe experts: CPU RAM whatever the kinds
    cpu_ep = (ExpertPlan("cpu", moe_cpu, shape.layers[moe_cpu[0]].num_experts, shape.layers[moe_cpu[0]].top_k,
                         shape.layers[moe_cpu[0]].bytes_per_expert, 0, workload.batch) if moe_cpu else None)
    layer_bytes = max((u.nbytes - (u.expert_bytes if i in moe_cpu else 0) for i, u in enumerate(shape.layers)),
                      default=0)
    rows = head_chunk_rows(shape)
    chunk_bytes = rows * max(shape.head.nbytes // max(shape.vocab, 1), 1)
    kv_bytes = math.ceil(workload.kv_tokens * shape.kv_bytes_per_token_layer * n)
    act = activation_bytes(shape, workload.max_batched_tokens, max_seqs or workload.batch)
    ctx = workload.prompt_len + workload.output_len // 2
    layer_kinds = ("gpu", "cpu", "cpu->gpu", "disk") if gpu else ("cpu", "disk")
    embed_kinds = ((("gpu", "cpu", "disk") if gpu else ("cpu", "disk")) if shape.embed else (None,))
    head_kinds = ("gpu", "cpu", "cpu->gpu", "disk") if gpu else ("cpu", "disk")

    best: tuple[float, dict] | None = None
    feasible: list[tuple[str, float]] = []
    min_cpu = None

    def consider(counts: dict[str, int], ek: str | None, hk: str) -> None:
        nonlocal best, min_cpu
        if moe_cpu and (counts.get("disk") or counts.get("cpu->gpu")):
            return  # --cpu-moe layers are resident (their experts in CPU RAM, the rest on the compute device)
        kinds = [k for k, c in counts.items() for _ in range(c)]  # spread() only for the winner
        tiers = {"gpu": 0, "cpu": fixed_cpu}
        for k, c in counts.items():
            if k == "gpu":
                tiers["gpu"] += c * layer_bytes
            elif k in ("cpu", "cpu->gpu"):
                tiers["cpu"] += c * layer_bytes
        for u, k in ((shape.embed, ek), (shape.head, hk)):
            if u is None:
                continue
            if k == "gpu":
                tiers["gpu"] += u.nbytes
            elif k in ("cpu", "cpu->gpu"):
                tiers["cpu"] += u.nbytes
        disk_units = [k for k in kinds + [hk] if k == "disk"]
        stream_units = [k for k in kinds + [hk] if k in ("disk", "cpu->gpu")]
        big = max(layer_bytes if any(k in ("disk", "cpu->gpu") for k in kinds) else 0,
                  chunk_bytes if hk in ("disk", "cpu->gpu") else 0)
        staging = {"cpu": RING_SLOTS * big if disk_units else 0,
                   "gpu": RING_SLOTS * big if (gpu and stream_units) else 0}
        kv_tier = "gpu" if gpu and counts.get("cpu", 0) < n else "cpu"
        acts = {"cpu": act if not gpu else act // 4, "gpu": act if gpu else 0}
        need = {t: tiers[t] + staging[t] + acts[t] + (kv_bytes if kv_tier == t else 0) for t in tiers}
        if min_cpu is None or need["cpu"] < min_cpu:
            min_cpu = need["cpu"]
        if need["cpu"] > budgets.cpu or (gpu and need["gpu"] > (budgets.gpu or 0)):
            return
        dec = fast_cost(counts, ek, hk, workload.batch, ctx)
        pre = fast_cost(counts, ek, hk, min(pre_tokens, workload.max_batched_tokens), workload.prompt_len // 2)
        total = steps * pre + workload.output_len * dec
        desc = ", ".join(f"{c} {k}" for k, c in counts.items() if c) + f"; head {hk}" + (f"; embed {ek}" if ek else "")
        feasible.append((desc, dec * 1000))
        if best is None or total < best[0] - 1e-12:
            best = (total, dict(kinds=kinds, ek=ek, hk=hk, staging=staging, kv_tier=kv_tier, acts=acts, counts=counts,
                                experts=cpu_ep))

    pre_tokens = workload.batch * workload.prompt_len
    steps = math.ceil(pre_tokens / workload.max_batched_tokens)
    memo: dict[tuple, tuple[float, float, float]] = {}

    def unit_cost(u: UnitShape, kind: str, tokens: int, c: int) -> tuple[float, float, float]:
        key = (u.kind, u.nbytes, u.params, kind, tokens, c)
        got = memo.get(key)
        if got is None:
            dev = "cpu" if (kind == "cpu" or not gpu) else "gpu"
            got = memo[key] = _unit_cost(u, kind, tokens, c, shape, bw, dev)
        return got

    rep = max(shape.layers, key=lambda u: u.nbytes) if shape.layers else None
    moe_rep = shape.layers[moe_cpu[0]] if moe_cpu else None
    if moe_rep is not None:  # --cpu-moe: a layer's own compute without its experts, plus theirs on the CPU
        rep = UnitShape(moe_rep.name, "layer", moe_rep.nbytes - moe_rep.expert_bytes, moe_rep.params - moe_rep.expert_params,
                        formats=moe_rep.formats)

    def fast_cost(counts: dict[str, int], ek: str | None, hk: str, tokens: int, c: int) -> float:
        comp = disk = h2d = 0.0
        if moe_rep is not None:
            r = moe_rep
            ex_p = r.expert_params * r.top_k / max(r.num_experts, 1) * tokens
            comp += len(moe_cpu) * max(r.expert_bytes * r.expert_frac(tokens) / (bw.mem_gbps * 1e9),
                                       2.0 * ex_p / bw.cpu_flops(shape.dtype))
        for k, cnt in counts.items():
            a, b, d = unit_cost(rep, k, tokens, c)
            comp, disk, h2d = comp + cnt * a, disk + cnt * b, h2d + cnt * d
        for u, k in ((shape.embed, ek), (shape.head, hk)):
            if u is not None:
                a, b, d = unit_cost(u, k, tokens, c)
                comp, disk, h2d = comp + a, disk + b, h2d + d
        return max(comp, disk, h2d)

    if force.get("head"):
        head_kinds = (force["head"],)
    if force.get("embed") and shape.embed is not None:
        embed_kinds = (force["embed"],)
    layer_force = {k: int(force[k]) for k in layer_kinds if force.get(k)}
    for ek in embed_kinds:
        for hk in head_kinds:
            if want_experts == "disk":
                break  # only the experts-on-disk placement below
            if layer_force:
                consider(layer_force, ek, hk)
                continue
            if not gpu:
                for c in range(n + 1):
                    consider({"cpu": c, "disk": n - c}, ek, hk)
                continue
            for g in range(n + 1):  # pragma: no cover - GPU planning is exercised in unit tests with fake budgets
                for c in range(n - g + 1):
                    r = n - g - c
                    for s in (r, r // 2, 0):
                        consider({"gpu": g, "cpu": c, "cpu->gpu": s, "disk": r - s}, ek, hk)

    # Sparse layers on a CPU engine: every non-expert weight resident, the experts on disk, read on demand
    # into a RAM cache of what the budget leaves (offload/experts.py). Chosen when it beats streaming
    # layers whole (those read every expert each step) or when asked for.
    streams = best is not None and any(k == "disk" for k in best[1]["kinds"])
    if sparse and not gpu and not moe_cpu and not layer_force and (want_experts == "disk" or (best is None or streams)):
        first = shape.layers[sparse[0]]
        bpe = max(shape.layers[i].bytes_per_expert for i in sparse)  # a cache slot
        spe = max(shape.layers[i].stored_bytes_per_expert for i in sparse)  # a read from disk
        total_e = sum(shape.layers[i].expert_bytes for i in sparse)
        resident = sum(u.nbytes - u.expert_bytes for u in shape.layers)
        for ek in embed_kinds:
            for hk in head_kinds:
                cpu = resident + sum(u.nbytes for u, k in ((shape.embed, ek), (shape.head, hk)) if u is not None and k == "cpu")
                ring = RING_SLOTS * chunk_bytes if hk == "disk" else 0
                need = cpu + ring + act + kv_bytes
                min_cpu = min(min_cpu if min_cpu is not None else need + bpe, need + bpe)
                cache = min(budgets.cpu - need, total_e, int(cache_cap) if cache_cap else total_e)
                cache -= cache % max(bpe, 1)
                if cache < bpe:
                    continue
                ep = ExpertPlan("disk", sparse, first.num_experts, first.top_k, bpe, cache, workload.batch, policy,
                                spe if spe != bpe else 0, prefetch)
                dec = _step_cost(shape, ["cpu"] * n, ek, hk, workload.batch, ctx, bw, False, ep).total
                pre = _step_cost(shape, ["cpu"] * n, ek, hk, min(pre_tokens, workload.max_batched_tokens),
                                 workload.prompt_len // 2, bw, False, ep).total
                total = steps * pre + workload.output_len * dec
                desc = f"{n} cpu, experts on disk ({format_bytes(cache)} cache); head {hk}" + (f"; embed {ek}" if ek else "")
                feasible.append((desc, dec * 1000))
                if best is None or total < best[0] - 1e-12:  # (asked for: the layer-wise search found none)
                    best = (total, dict(kinds=["cpu"] * n, ek=ek, hk=hk, staging={"cpu": ring, "gpu": 0},
                                        kv_tier="cpu", acts={"cpu": act, "gpu": 0}, counts={"cpu": n}, experts=ep))

    if best is None:
        from llmsys.kernels.common.errors import BudgetError

        if budgets.cpu_explicit or budgets.gpu_explicit:
            what = "--cpu-mem" if not gpu else "--gpu-mem/--cpu-mem"
            what, fix = f"{what} {format_bytes(budgets.cpu)}", "raise the budget or shrink "
        else:  # no flag set the budget: it is the RAM free now, and the flags that sized the need are the fix
            what, fix = f"the free CPU RAM ({format_bytes(budgets.cpu)})", "free memory or shrink "
        if act > kv_bytes:
            fix += "the step's activations (--max-num-seqs, --max-num-batched-tokens)"
        else:
            fix += "the KV pool (--kv-cache-tokens, --max-model-len)"
        raise BudgetError(
            f"{what} is too small to run even one layer at a time: this model needs at least "
            f"{format_bytes(min_cpu or 0)} of CPU RAM (2 staging buffers of {format_bytes(max(layer_bytes, chunk_bytes))}, "
            f"KV pool {format_bytes(kv_bytes)}, activations {format_bytes(act)}); {fix}"
        )
    _, b = best
    b["kinds"] = spread(b["counts"])
    ep = b.get("experts")
    dec = _step_cost(shape, b["kinds"], b["ek"], b["hk"], workload.batch, ctx, bw, gpu, ep)
    b["pre"] = _step_cost(shape, b["kinds"], b["ek"], b["hk"], min(pre_tokens, workload.max_batched_tokens),
                          workload.prompt_len // 2, bw, gpu, ep)
    b["steps"] = steps
    gpu_dev = lambda k: "cpu" if (k == "cpu" or not gpu) else "gpu"  # noqa: E731
    placed = set(ep.layers) if ep is not None else set()
    layers = tuple(
        Placement(u.name, k, gpu_dev(k), u.nbytes, dec.per_unit[u.name][0] * 1000, dec.per_unit[u.name][1],
                  experts=ep.tier if i in placed else "", expert_bytes=u.expert_bytes if i in placed else 0,
                  expert_disk_bytes=u.expert_stored_bytes if i in placed and ep.tier == "disk" else 0)
        for i, (u, k) in enumerate(zip(shape.layers, b["kinds"]))
    )
    embed = None
    if shape.embed is not None:
        ms, bound = dec.per_unit[shape.embed.name]
        embed = Placement(shape.embed.name, b["ek"], "cpu" if b["ek"] in ("cpu", "disk") else "gpu", shape.embed.nbytes, ms * 1000, bound)
    ms, bound = dec.per_unit[shape.head.name]
    head = Placement(shape.head.name, b["hk"], gpu_dev(b["hk"]), shape.head.nbytes, ms * 1000, bound)
    plan = Plan(
        layers=layers, embed=embed, head=head, head_chunk_rows=rows, kv_tier=b["kv_tier"], kv_bytes=kv_bytes,
        staging={k: v for k, v in b["staging"].items() if v}, activations={k: v for k, v in b["acts"].items() if v},
        budgets=budgets, bandwidths=bw, workload=workload, decode_ms=dec.total * 1000,
        prefill_ms=b["steps"] * b["pre"].total * 1000, bound=dec.bound,
        resources_ms={"compute": dec.compute * 1000, "disk read": dec.disk * 1000, "host-to-device": dec.h2d * 1000},
        alternatives=tuple(sorted(set(feasible), key=lambda x: x[1])[:8]), min_cpu_bytes=min_cpu or 0,
        experts=ep,
    )
    return _with_reasons(plan, shape)


def _with_reasons(plan: Plan, shape: ModelShape) -> Plan:
    from dataclasses import replace

    from llmsys.offload.report import explain_lines

    return replace(plan, reasons=tuple(explain_lines(plan, shape)))


@dataclass(frozen=True)
class ExpertBytes:
    """One sparse layer's experts as a checkpoint holds them: bytes of one expert at run time (a cache slot, CPU
    RAM) and as stored (what reading it from disk takes: a GGUF's Q4_K blocks, read as stored, repacked)."""

    layer: int
    run_bytes: int
    stored_bytes: int


@dataclass(frozen=True)
class WeightBytes:
    """Run-time bytes per weight of the matrices, per part of the model: a checkpoint whose parts are
    stored in different formats (a GGUF: int4 codes kept in the layers, a Q8_0 embedding dequantized).
    ``experts``: the sparse layers' experts counted exactly (``layers`` is then the other matrices' figure)."""

    layers: float
    embed: float
    head: float
    experts: tuple[ExpertBytes, ...] = ()
    # Each part's stored formats, (format, share of its weights) (:attr:`UnitShape.formats`); () = the dtype's.
    layer_formats: tuple[tuple[str, float], ...] = ()
    embed_formats: tuple[tuple[str, float], ...] = ()
    head_formats: tuple[tuple[str, float], ...] = ()


def model_shape(
    layers: list[torch.nn.Module],
    embed: torch.nn.Module,
    head: torch.nn.Module,
    tied: bool,
    dtype: torch.dtype,
    kv_bytes_per_token_layer: float,
    bytes_per_weight: float | WeightBytes | None = None,
    weight_format: str | None = None,
) -> ModelShape:
    """Describe a (meta-device) model for the planner.

    ``bytes_per_weight`` overrides the element size of 2-D weights (a
    quantized format: int4 with scales ~0.56; or per part, :class:`WeightBytes`);
    1-D tensors keep ``dtype``. ``weight_format``: the stored format of every matrix
    (a ``--quant`` method's, e.g. ``"int4"``) where ``bytes_per_weight`` names none per part.
    """
    elt = torch.tensor([], dtype=dtype).element_size()
    per = bytes_per_weight if isinstance(bytes_per_weight, WeightBytes) else None
    every = ((weight_format, 1.0),) if weight_format else ()
    fmts = {"layers": per.layer_formats or every, "embed": per.embed_formats or every,
            "head": per.head_formats or every} if per is not None else dict.fromkeys(("layers", "embed", "head"), every)

    def size(mod: torch.nn.Module, part: str = "layers") -> tuple[int, int]:
        bpw = getattr(per, part) if per is not None else (bytes_per_weight or elt)
        nbytes = params = 0
        for t in list(mod.parameters()) + list(mod.buffers()):
            if t.dim() >= 2:
                params += t.numel()
                nbytes += int(t.numel() * bpw)
            else:
                nbytes += t.numel() * (elt if t.is_floating_point() else t.element_size())
        return nbytes, params

    exact = {x.layer: x for x in per.experts} if per is not None else {}
    lus = []
    for i, layer in enumerate(layers):
        nb, p = size(layer)
        moe = getattr(layer, "mlp", None)
        experts = getattr(moe, "experts", None)  # a sparse layer's MoE block (engine/models/moe.py), duck-typed
        if isinstance(experts, torch.nn.ModuleList) and len(experts):
            sizes = [size(e) for e in experts]
            eb, stored = sum(b for b, _ in sizes), 0
            if i in exact:  # the file's own figures: run-time bytes per expert, and as stored
                nb += len(experts) * exact[i].run_bytes - eb
                eb, stored = len(experts) * exact[i].run_bytes, len(experts) * exact[i].stored_bytes
            lus.append(UnitShape(f"layers.{i}", "layer", nb, p, eb, sum(q for _, q in sizes), len(experts),
                                 int(moe.top_k), stored, formats=fmts["layers"]))
        else:
            lus.append(UnitShape(f"layers.{i}", "layer", nb, p, formats=fmts["layers"]))
    e_nb, _ = size(embed, "embed")
    vocab, hidden = embed.weight.shape
    if tied:
        head_u = UnitShape("embed+lm_head", "head", e_nb, vocab * hidden, formats=fmts["embed"])
        embed_u = None
    else:
        h_nb, h_p = size(head, "head")
        head_u = UnitShape("lm_head", "head", h_nb, h_p, formats=fmts["head"])
        float_table = e_nb == vocab * hidden * torch.tensor([], dtype=dtype).element_size()
        embed_u = UnitShape("embed", "embed", e_nb, 0, whole_reads=not float_table, formats=fmts["embed"])
    inter = 0
    for m in layers[0].modules() if layers else ():
        if hasattr(m, "up_proj"):
            inter = m.up_proj.weight.shape[0] if hasattr(m.up_proj, "weight") else 0
    return ModelShape(tuple(lus), embed_u, head_u, hidden, inter or 4 * hidden, vocab, kv_bytes_per_token_layer, dtype)


def describe_budgets(b: Budgets) -> str:
    gpu = f"gpu {format_bytes(b.gpu)}" if b.gpu is not None else "no gpu"
    folder = str(b.offload_dir) if b.offload_dir else "(checkpoint / scratch)"
    return f"cpu {format_bytes(b.cpu)}{'' if b.cpu_explicit else ' (free)'}, {gpu}, offload dir {folder}"
