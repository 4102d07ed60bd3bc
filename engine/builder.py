"""Building an engine from an :class:`EngineConfig`, in named steps: each takes what the previous ones
returned and sets nothing on objects built earlier.

1. :func:`resolve`: model path, device and dtype, each once; budgets checked (:func:`check_budgets`).
2. ``open_checkpoint`` (loader): the model's skeleton on the meta device.
3. :func:`place`: the offload plan and runtime (``None``: all resident), the KV size a budget allows;
   ``--max-model-len`` and KV sizes past the model or their tier are refused here (:func:`context_limit`,
   :func:`check_kv_room`), before any weight is read.
4. ``materialize_checkpoint`` (loader): the weights, placed as planned.
5. :func:`prepare`: offload hooks, then CPU prepacking (a tied embedding served from the file) or ``never_pack``.
6. :func:`size_kv_pool`: the pool spec and per-request context limit (checked again: llama2.c files
   load in one go, always resident, and skip steps 2-4).
7. ``EngineCore``, given all of the above.
"""

from __future__ import annotations

import tempfile
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from llmsys.engine.config import EngineConfig, check_kv_dtype
from llmsys.kernels.common.errors import BudgetError, InvalidParameterError
from llmsys.engine.kv_cache import KVCacheSpec, blocks_needed
from llmsys.engine.sliding_kv import KVCost, SlidingKVSpec, kv_cost, plan_sliding_kv
from llmsys.engine.loader.common import Checkpoint, LoadedModel, resolve_device, resolve_dtype
from llmsys.kernels.common.units import format_bytes
from llmsys.offload.budgets import Budgets, SpaceAsk, check_room, ram_available, resolve_budgets

if TYPE_CHECKING:
    from llmsys.offload.plan import Plan
    from llmsys.offload.runtime import OffloadRuntime


@dataclass(frozen=True)
class Resolved:
    """The config with its ``auto`` choices made: the one device and dtype every later step uses."""

    config: EngineConfig
    path: Path
    device: torch.device
    dtype: torch.dtype


@dataclass(frozen=True)
class Placement:
    """Where the weights go (``plan``, data the TUI and bench show) and who moves them."""

    plan: Plan | None  # None: not planned (llama2.c, stored-quantized checkpoints)
    runtime: OffloadRuntime | None  # None: every weight resident on the device
    kv_cache_tokens: int | None  # the pool size an explicit budget allows (None: the config's / free memory)


def resolve(config: EngineConfig) -> Resolved:
    dev = resolve_device(config.device)
    check_budgets(config, dev)
    return Resolved(config, _resolve_path(config.model), dev, resolve_dtype(config.dtype, dev))


def check_budgets(config: EngineConfig, device: torch.device) -> None:
    """Budgets the machine cannot honour, refused before anything loads: a GPU budget for an engine
    on the CPU (there is no such tier to plan for), a RAM budget past the RAM available (the plan
    would keep weights resident that do not fit). ``llmsys plan`` plans for what-if budgets and
    does not come here."""
    if config.gpu_mem is not None and device.type != "cuda":
        why = "no CUDA device is available" if not torch.cuda.is_available() else f"--device {config.device}"
        raise InvalidParameterError(
            f"--gpu-mem {format_bytes(config.gpu_mem)}: this engine runs on the CPU ({why}), so there is no GPU "
            "budget to set; drop --gpu-mem (--cpu-mem sets the RAM budget)")
    if config.cpu_mem is not None and config.cpu_mem > (avail := ram_available()):
        raise BudgetError(
            f"--cpu-mem {format_bytes(config.cpu_mem)} is more than the {format_bytes(avail)} of RAM available; "
            "lower --cpu-mem, or leave it unset (the default is what is free now)")
    if config.gpu_mem is not None:  # pragma: no cover - no GPU here
        total = torch.cuda.get_device_properties(device).total_memory
        if config.gpu_mem > total:
            raise BudgetError(f"--gpu-mem {format_bytes(config.gpu_mem)} is more than the GPU's "
                              f"{format_bytes(total)}; lower --gpu-mem, or leave it unset")


def _resolve_path(model: str) -> Path:
    p = Path(model).expanduser()
    if p.exists():
        return p
    from llmsys.engine.catalog import resolve_model

    return resolve_model(model)


def model_context(args: Any) -> tuple[int, str]:
    """The most positions the model is made for, and what says so (for the error).

    ``max_position_embeddings``; a ``linear`` RoPE scaling that left it at the
    original context (older HF configs, GGUF files) stretches it ``factor``
    times (llama3 / freq_factors configs already state the stretched length);
    a sliding window the engine does not slide (Mistral's ``max_context``)
    caps it, as does a config whose length already counts its linear factor
    (Gemma 3's ``max_context``).
    """
    limit, what = args.max_position_embeddings, "max_position_embeddings"
    scaling = args.rope_scaling or {}
    if scaling.get("rope_type", scaling.get("type")) == "linear" and scaling.get("factor"):
        base = scaling.get("original_max_position_embeddings", limit)
        if int(base * float(scaling["factor"])) > limit:
            limit, what = int(base * float(scaling["factor"])), f"{base} x its linear RoPE factor {scaling['factor']}"
    cap = getattr(args, "max_context", None)  # Mistral: its window; Gemma 3: the stated (already stretched) context
    if cap is not None and cap < limit:
        limit, what = cap, "max_position_embeddings" if cap == args.max_position_embeddings else "its sliding window"
    return limit, what


def context_limit(args: Any, config: EngineConfig) -> int:
    """Prompt + output tokens per request: the model's context (:func:`model_context`), or
    ``max_model_len``, which may not reach past it (the RoPE table, the KV pool sized for
    ``max_num_seqs`` full contexts and the model's quality all stop there)."""
    limit, what = model_context(args)
    asked = config.max_model_len
    if asked is not None and asked > limit:
        raise InvalidParameterError(
            f"--max-model-len {asked} is past this model's {limit} positions ({what}); "
            f"use at most --max-model-len {limit}, or leave it unset")
    return asked or limit


def kv_probe(args: Any, config: EngineConfig, dtype: torch.dtype) -> KVCacheSpec:
    """A one-block KV spec of the model's shape in the configured format: its bytes per token."""
    check_kv_dtype(config.kv_dtype, args.head_dim)
    return KVCacheSpec(args.num_hidden_layers, 1, config.block_size, args.num_key_value_heads, args.head_dim, dtype,
                       config.kv_dtype)


def kv_cost_of(args: Any, config: EngineConfig, max_len: int, per_layer: float,
             sliding: SlidingKVSpec | None = None) -> KVCost:
    """What ``tokens`` of KV cost with this config: every layer per token, but sliding layers in rings
    (``plan_sliding_kv``, unless given) at most their rings' positions."""
    sliding = sliding if sliding is not None else plan_sliding_kv(args, config, max_len)
    return kv_cost(per_layer, args.num_hidden_layers, sliding, config.block_size, config.max_num_seqs)


def kv_room_asks(args: Any, config: EngineConfig, device: torch.device, dtype: torch.dtype) -> list[SpaceAsk]:
    """What the stated KV sizes will fill, per tier: the pool (RAM, for a CPU pool), the cold tier
    (disk in the offload folder for a CPU pool, plus its staging buffers in RAM; pinned RAM for a
    GPU pool) and the swap space (disk for a CPU pool, RAM for a GPU pool). Sizes left to the
    engine are not listed: it sizes those from what is free."""
    probe = kv_probe(args, config, dtype)
    per_tok, bs, gpu = probe.bytes_per_token, config.block_size, device.type == "cuda"
    folder = Path(config.offload_dir).expanduser() if config.offload_dir else Path(tempfile.gettempdir())
    asks = []
    if config.kv_cache_tokens is not None and not gpu:
        cost = kv_cost_of(args, config, context_limit(args, config), probe.layer_bytes_per_token)  # rings: less
        asks.append(SpaceAsk(f"--kv-cache-tokens {config.kv_cache_tokens}",
                             cost.nbytes((blocks_needed(config.kv_cache_tokens, bs) + 1) * bs), "cpu",
                             "lower --kv-cache-tokens (--kv-dtype int8 shrinks it), or leave it unset"))
    cold = config.offload_tokens(per_tok)
    if cold > 0:
        flag = f"--kv-offload-tokens {config.kv_offload_tokens}"
        cold_bytes = blocks_needed(cold, bs) * bs * per_tok
        staging = 2 * cold_bytes // args.num_hidden_layers  # two layers' worth of every cold block (kv_tier)
        fix = "lower --kv-offload-tokens"
        if gpu:  # pragma: no cover - no GPU here
            asks.append(SpaceAsk(flag, cold_bytes + staging, "cpu", fix))
        else:
            asks.append(SpaceAsk(flag, cold_bytes, "disk", f"{fix}, or pass --offload-dir on a disk with room", folder))
            asks.append(SpaceAsk(f"{flag} (its staging buffers)", staging, "cpu", fix))
    if config.swap_space and config.kv_dtype == "auto":  # quantized pools never swap (offload.kv_swap)
        flag, fix = f"--swap-space {format_bytes(config.swap_space)}", "lower --swap-space (0 = recompute instead)"
        if gpu:  # pragma: no cover - no GPU here
            asks.append(SpaceAsk(flag, config.swap_space, "cpu", fix))
        else:
            asks.append(SpaceAsk(flag, config.swap_space, "disk", f"{fix}, or pass --offload-dir on a disk with room",
                                 folder))
    return asks


def check_kv_room(args: Any, config: EngineConfig, device: torch.device, dtype: torch.dtype) -> None:
    """Refuse stated KV sizes their tiers cannot hold, before the pool, tier or swap space exists."""
    check_room(kv_room_asks(args, config, device, dtype))


KV_FULL_CONTEXTS = 4  # full contexts a default pool holds (fewer with --max-num-seqs below it): Ollama's parallel 4


def kv_pool_tokens(max_len: int, config: EngineConfig, cost: KVCost, budgets: Budgets) -> int:
    """The KV pool's tokens: ``--kv-cache-tokens`` when given, else one full context (``max_len``)
    for each sequence that runs at once, at most :data:`KV_FULL_CONTEXTS` of them, capped by the
    budget: an eighth of an explicit ``--gpu-mem`` / ``--cpu-mem`` (at least 512 tokens or a
    context), else a quarter of what is free (``budgets``: free memory less a margin). Sliding
    layers kept in rings count at their ring size (``cost``).

    Why not ``max_num_seqs`` full contexts: 32 contexts of an 8k model is a quarter of RAM's worth of
    blocks that a chat never writes, and every view then showed the reservation as the pool; the
    scheduler admits ``max_num_seqs`` shorter sequences into the same pool and preempts when they
    outgrow it. The one function the engine (:func:`place`, :func:`size_kv_pool`) and
    ``llmsys plan`` size the pool with, so the plan shows the pool the engine makes."""
    if config.kv_cache_tokens is not None:
        return config.kv_cache_tokens
    from llmsys.offload.prepare import kv_tokens_within

    wanted = max_len * min(config.max_num_seqs, KV_FULL_CONTEXTS)
    if budgets.cpu_explicit or budgets.gpu_explicit:
        budget = budgets.gpu if budgets.gpu_explicit else budgets.cpu
        return kv_tokens_within(budget, cost.tokens_within, wanted, min(max_len, 512))
    free = budgets.gpu if budgets.gpu is not None else budgets.cpu
    return min(wanted, max(cost.tokens_within(free // 4), 1))


def planned_kv(args: Any, config: EngineConfig, dtype: torch.dtype, budgets: Budgets) -> tuple[int, int]:
    """``(pool tokens, the planner's KV tokens)`` for this config: :func:`kv_pool_tokens` of the
    engine's context (:func:`context_limit`), and the pool's bytes (scratch block included) as the
    every-layer tokens the offload planner counts (ring layers' smaller share as fewer tokens)."""
    max_len = context_limit(args, config)
    probe = kv_probe(args, config, dtype)  # the pool's own bytes per token, in --kv-dtype
    cost = kv_cost_of(args, config, max_len, probe.layer_bytes_per_token)
    tokens = kv_pool_tokens(max_len, config, cost, budgets)
    slots = (blocks_needed(tokens, config.block_size) + 1) * config.block_size  # whole blocks + the scratch block
    return tokens, int(-(-cost.nbytes(slots) // probe.bytes_per_token))


def place(r: Resolved, ck: Checkpoint) -> Placement:
    """Plan placement on the meta model (budgets -> plan) before any weight is read."""
    from llmsys.offload.plan import Workload
    from llmsys.offload.prepare import make_runtime, plan_for, runtime_needed

    c = r.config
    a = ck.model.args
    check_kv_room(a, c, r.device, r.dtype)
    budgets = resolve_budgets(c.gpu_mem, c.cpu_mem, c.offload_dir, r.device)
    tokens, kv_tokens = planned_kv(a, c, r.dtype, budgets)
    fitted = tokens if c.kv_cache_tokens is None and (budgets.cpu_explicit or budgets.gpu_explicit) else None
    per_tok = kv_probe(a, c, r.dtype).bytes_per_token
    # A speculating engine's decode step verifies up to spec_tokens drafts per sequence: the plan's
    # compute/transfer overlap is for that many rows (the weights are still read once per step).
    rows = c.plan_batch * (1 + c.spec_tokens if c.spec is not None else 1)
    work = Workload(batch=rows, kv_tokens=kv_tokens,
                    max_batched_tokens=c.max_num_batched_tokens, kv_cold_tokens=c.offload_tokens(per_tok))
    # A GGUF loaded as stored mixes kept codes (int4, int8) and dequantized matrices: the planner gets their mix.
    bpw = ck.index.weight_bytes(r.dtype) if ck.is_gguf and c.quant.method == "none" else None
    if c.cpu_moe and not a.num_experts:
        raise InvalidParameterError(f"--n-cpu-moe {c.cpu_moe}: this model has no mixture-of-experts layers; "
                                    "drop --cpu-moe / --n-cpu-moe")
    plan, _ = plan_for(ck.model, r.dtype, budgets, work, c.quant.method, max_seqs=c.max_num_seqs, force=c.placement,
                       bytes_per_weight=bpw, cpu_moe=c.cpu_moe, kv_dtype=c.kv_dtype, block_size=c.block_size)
    runtime = None
    if runtime_needed(plan, r.device):
        runtime = make_runtime(ck.model, ck.locate, r.dtype, r.device, plan, c.quant.method,
                               drop_cache=not c.keep_page_cache)
    return Placement(plan, runtime, fitted)


def prepare(loaded: LoadedModel, config: EngineConfig, runtime: OffloadRuntime | None) -> None:
    """The model passes after loading (in place, in this order; each keeps the model's bits)."""
    model = loaded.model
    if runtime is not None:
        runtime.install(model)  # streamed layers: weights bound per step
    if loaded.device.type != "cpu":
        return
    if config.prepack:
        # Resident CPU weights in oneDNN's blocked layout: faster GEMV, same bits as
        # streamed layers (kernels.cpu_linear). Streamed layers hold no real weight
        # here (the offload runtime binds one per step), so they are skipped.
        model.prepack_linears()
    else:
        # Tools that read or rewrite .weight (`llmsys quantize`): nothing is packed,
        # and no layer packs on the fly either.
        model.never_pack()


def size_kv_pool(loaded: LoadedModel, config: EngineConfig) -> tuple[KVCacheSpec, int]:
    """Choose the KV pool size and the per-request context limit.

    The context limit is the model's trained context (or ``max_model_len``).
    The pool holds :func:`kv_pool_tokens` tokens (``kv_cache_tokens`` when given,
    else full contexts within the memory free now). A cold tier
    (``kv_offload_tokens``) adds to what one request may hold: the context
    limit is then at most hot plus cold tokens.
    """
    a = loaded.args
    max_len = context_limit(a, config)
    if max_len < 2:
        raise InvalidParameterError(f"max_model_len must be >= 2, got {max_len}")
    check_kv_room(a, config, loaded.device, loaded.dtype)
    kv_dtype = config.kv_dtype
    probe = kv_probe(a, config, loaded.dtype)
    cold = config.offload_tokens(probe.bytes_per_token)
    sliding = plan_sliding_kv(a, config, max_len, say=True)
    cost = kv_cost_of(a, config, max_len, probe.layer_bytes_per_token, sliding)
    budgets = resolve_budgets(config.gpu_mem, config.cpu_mem, config.offload_dir, loaded.device)  # free now
    tokens = kv_pool_tokens(max_len, config, cost, budgets)
    max_len = min(max_len, tokens + cold)
    bs = config.block_size
    num_blocks = blocks_needed(tokens, bs) + 1  # + the reserved scratch block
    if sliding is not None:  # the rings never hold more than the block tables (+ the ring pool's scratch block)
        sliding = replace(sliding, num_blocks=blocks_needed(min(tokens, cost.ring_tokens), bs) + 1)
    spec = KVCacheSpec(a.num_hidden_layers, num_blocks, bs, a.num_key_value_heads, a.head_dim, loaded.dtype, kv_dtype,
                       sliding)
    return spec, max_len
