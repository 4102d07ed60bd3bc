"""The one call the engine makes before loading: shape -> plan -> runtime.

It reads the meta-device model the loader built (no weights yet) by duck
typing (``model.model.layers``, ``model.model.embed_tokens``,
``model.lm_head``, ``model.args``) so offload stays below the engine in the
import order.
"""

from __future__ import annotations

from typing import Any, Callable

import torch
from torch import nn

from llmsys.offload.bandwidth import Bandwidths, measure_bandwidths
from llmsys.offload.budgets import Budgets
from llmsys.offload.plan import ModelShape, Plan, WeightBytes, Workload, model_shape, plan_placement
from llmsys.offload.runtime import Locate, OffloadRuntime
from llmsys.quant.kv_paged import kv_layer_bytes_per_token

# Approximate stored bytes per weight of each quantized format (scales included),
# used to plan before the layers are quantized. Actual bytes are measured after.
QUANT_BYTES_PER_WEIGHT: dict[str, float] = {"int8": 1.03, "fp8": 1.03, "int4": 0.5625, "nf4": 0.5625, "awq": 0.5625, "gptq": 0.5625}
# The stored format each method's layers run (offload.kernel_probe's names: what the calibrated costs are keyed by).
QUANT_FORMATS: dict[str, str] = {"int8": "int8", "fp8": "fp8", "int4": "int4", "nf4": "nf4", "awq": "int4", "gptq": "int4"}


def kv_bytes_per_token_layer(args: Any, dtype: torch.dtype, kv_dtype: str = "auto", block_size: int = 16) -> float:
    """K+V bytes of one token in one layer of the pool ``--kv-dtype`` makes (the engine's own formula)."""
    return kv_layer_bytes_per_token(args.num_key_value_heads, args.head_dim, dtype, kv_dtype, block_size)


def shape_of(model: nn.Module, dtype: torch.dtype, quant: str = "none",
             bytes_per_weight: WeightBytes | None = None, kv_dtype: str = "auto", block_size: int = 16) -> ModelShape:
    """The planner's view of a meta model; ``bytes_per_weight`` (a matrix's run-time bytes per weight, e.g. a
    GGUF's mix of kept and dequantized formats) overrides the ``quant`` method's typical figure; ``kv_dtype``
    and ``block_size`` are the KV pool's (``--kv-dtype``, ``--block-size``)."""
    a = model.args
    return model_shape(
        list(model.model.layers), model.model.embed_tokens, model.lm_head, bool(a.tie_word_embeddings), dtype,
        kv_bytes_per_token_layer(a, dtype, kv_dtype, block_size),
        bytes_per_weight or QUANT_BYTES_PER_WEIGHT.get(quant), QUANT_FORMATS.get(quant),
    )


def kv_tokens_within(budget: int, tokens_for: Callable[[int], int], wanted: int, floor: int) -> int:
    """KV pool tokens under an explicit budget: at most an eighth of it, at least ``floor`` tokens.
    ``tokens_for(bytes)``: the tokens of KV those bytes hold (sliding layers kept in rings cost less
    per token than the others: the engine's ``KVCost.tokens_within``)."""
    return max(min(wanted, tokens_for(budget // 8)), min(floor, wanted))


def plan_for(model: nn.Module, dtype: torch.dtype, budgets: Budgets, workload: Workload, quant: str = "none",
             bandwidths: Bandwidths | None = None, max_seqs: int | None = None,
             force: dict[str, int] | None = None, bytes_per_weight: WeightBytes | None = None,
             cpu_moe: int = 0, kv_dtype: str = "auto", block_size: int = 16) -> tuple[Plan, ModelShape]:
    shape = shape_of(model, dtype, quant, bytes_per_weight, kv_dtype, block_size)
    bw = bandwidths or measure_bandwidths(probe_dir=budgets.offload_dir)
    return plan_placement(shape, budgets, bw, workload, max_seqs=max_seqs, force=force, cpu_moe=cpu_moe), shape


def make_runtime(model: nn.Module, locate: Locate, dtype: torch.dtype, device: torch.device, plan: Plan,
                 quant: str = "none", drop_cache: bool = True) -> OffloadRuntime:
    """The runtime that carries ``plan`` out; ``prepare`` has seen every checkpoint name."""
    rt = OffloadRuntime(plan, device, dtype, locate, quantized=quant not in ("none", "", None), drop_cache=drop_cache)
    rt.prepare([n for n, _ in model.named_parameters(remove_duplicate=False)])
    return rt


def runtime_needed(plan: Plan, device: torch.device) -> bool:
    """Does carrying out the plan need hooks (anything streamed or computed off the main device)?"""
    if plan.needs_streaming:  # (experts kept apart from their layers included)
        return True
    return device.type == "cuda" and any(p.kind != "gpu" for p in plan.units)
