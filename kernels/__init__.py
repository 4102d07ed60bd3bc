"""Kernels for the decode path: Triton on CUDA, plain torch everywhere else.

Import the public ops from here (``from llmsys.kernels import rms_norm``), or
the validating wrappers from ``llmsys.kernels.ops``; nothing outside this
package imports a private module (``cpu_*``, ``_cbuild``, ``reference``,
``triton_*``; ``tests/test_layering.py`` checks it) or triton. See ``README.md`` for the layering
rules, the tensor layouts (paged KV cache, int8 KV, int4 weights) and what each
op computes.

The names below are imported on first use (PEP 562 ``__getattr__``): importing the package, or
``llmsys.kernels.common`` (errors, units, paths, which every layer and the CLI's first line need),
must not import torch and every kernel module, so ``llmsys --version`` and ``--help`` start at once.
"""

from __future__ import annotations

import importlib
from types import MappingProxyType
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from llmsys.kernels._backend import interpreter_enabled, triton_available
    from llmsys.kernels.cpu_attention import (
        ColdBlocks,
        GatherPlan,
        attend_gathered,
        make_gather_plan,
        paged_attention_gathered,
        paged_attention_gathered_scores,
        windowed,
    )
    # The CPU backend's fused bf16 decode ops, unvalidated (the backend checks once per engine
    # that shapes and dtypes fit; kernels.ops wraps the validated forms).
    from llmsys.kernels.cpu_decode import applies as cpu_fused_applies
    from llmsys.kernels.cpu_decode import available as cpu_fused_available
    from llmsys.kernels.cpu_decode import decode_attention as cpu_fused_decode_attention
    from llmsys.kernels.cpu_decode import rms_norm as cpu_fused_rms_norm
    from llmsys.kernels.cpu_decode import rope_store as cpu_fused_rope_store
    from llmsys.kernels.cpu_decode import rope_store_attend as cpu_fused_rope_store_attend
    from llmsys.kernels.cpu_decode import clamped_swiglu as cpu_fused_clamped_swiglu
    from llmsys.kernels.cpu_decode import silu_mul as cpu_fused_silu_mul
    from llmsys.kernels.cpu_int4 import Scratch as Int4Scratch
    from llmsys.kernels.cpu_int4 import CPU_BLOCK_N as CPU_INT4_BLOCK_N
    from llmsys.kernels.cpu_int4 import dequant_cpu_int4, pack_cpu_int4, transpose_bf16, unpack_cpu_int4
    from llmsys.kernels.cpu_linear import (BF16_UPCAST_MIN_ROWS, LinearKernel, decode_weight, fusable, linear,
                                         linear_kernel, linear_logits, mm_bf16, packable, prepack, run_linear)
    from llmsys.kernels.ops import (
        DEFAULT_PARTITION_SIZE,
        DecodeAttentionResult,
        kv_store,
        paged_decode_attention,
        paged_prefill_attention,
        rms_norm,
        rope,
        silu_mul,
        w4a16_matmul,
        w8a16_matmul,
    )
    # An MoE layer's routed experts in one C call (the grouped expert kernel).
    from llmsys.kernels.cpu_moe import MoEExperts, moe_experts, moe_experts_args
    # The CPU decode GEMVs and the fused decode layers (two C calls per decoder layer around attention).
    from llmsys.kernels.cpu_qgemv import (
        DecodeLayer,
        DecodeStack,
        DecodeWeight,
        KScales,
        ScaleKind,
        StackLayer,
        WeightKind,
        decode_layer_args,
        decode_stack,
        decode_stack_args,
        int4_decode_weight,
        int4k_decode_weight,
        int4k_gemv_a8,
        int4_gemv_a8,
        int8_decode_weight,
        int8g_decode_weight,
        int8g_gemv_a8,
        int8_gemv_a8,
        layer_attn_in,
        layer_mlp,
        layer_post_attn,
    )
    from llmsys.kernels.cpu_report import CpuKernels, QuantMatmulSupport, cpu_kernels, quant_matmul_support
    from llmsys.kernels.reference import dequant_int4, pack_int4, quantize_int8_ref, softmax_with_sinks, unpack_int4
    from llmsys.kernels.repack import repack_q4_0, repack_q4k, repack_q6k, repack_q8_0
    from llmsys.kernels.rope_cache import build_rope_cache, rope_attention_factor, rope_inv_freq, rope_type

# name -> (module of this package, its name there)
_EXPORTS = MappingProxyType({
    "interpreter_enabled": ("_backend", "interpreter_enabled"),
    "triton_available": ("_backend", "triton_available"),
    "ColdBlocks": ("cpu_attention", "ColdBlocks"),
    "GatherPlan": ("cpu_attention", "GatherPlan"),
    "attend_gathered": ("cpu_attention", "attend_gathered"),
    "make_gather_plan": ("cpu_attention", "make_gather_plan"),
    "paged_attention_gathered": ("cpu_attention", "paged_attention_gathered"),
    "paged_attention_gathered_scores": ("cpu_attention", "paged_attention_gathered_scores"),
    "windowed": ("cpu_attention", "windowed"),
    "cpu_fused_applies": ("cpu_decode", "applies"),
    "cpu_fused_available": ("cpu_decode", "available"),
    "cpu_fused_decode_attention": ("cpu_decode", "decode_attention"),
    "cpu_fused_rms_norm": ("cpu_decode", "rms_norm"),
    "cpu_fused_rope_store": ("cpu_decode", "rope_store"),
    "cpu_fused_rope_store_attend": ("cpu_decode", "rope_store_attend"),
    "cpu_fused_clamped_swiglu": ("cpu_decode", "clamped_swiglu"),
    "cpu_fused_silu_mul": ("cpu_decode", "silu_mul"),
    "Int4Scratch": ("cpu_int4", "Scratch"),
    "CPU_INT4_BLOCK_N": ("cpu_int4", "CPU_BLOCK_N"),
    "dequant_cpu_int4": ("cpu_int4", "dequant_cpu_int4"),
    "pack_cpu_int4": ("cpu_int4", "pack_cpu_int4"),
    "transpose_bf16": ("cpu_int4", "transpose_bf16"),
    "unpack_cpu_int4": ("cpu_int4", "unpack_cpu_int4"),
    "BF16_UPCAST_MIN_ROWS": ("cpu_linear", "BF16_UPCAST_MIN_ROWS"),
    "LinearKernel": ("cpu_linear", "LinearKernel"),
    "decode_weight": ("cpu_linear", "decode_weight"),
    "fusable": ("cpu_linear", "fusable"),
    "linear": ("cpu_linear", "linear"),
    "linear_kernel": ("cpu_linear", "linear_kernel"),
    "linear_logits": ("cpu_linear", "linear_logits"),
    "mm_bf16": ("cpu_linear", "mm_bf16"),
    "packable": ("cpu_linear", "packable"),
    "prepack": ("cpu_linear", "prepack"),
    "run_linear": ("cpu_linear", "run_linear"),
    "DEFAULT_PARTITION_SIZE": ("ops", "DEFAULT_PARTITION_SIZE"),
    "DecodeAttentionResult": ("ops", "DecodeAttentionResult"),
    "kv_store": ("ops", "kv_store"),
    "paged_decode_attention": ("ops", "paged_decode_attention"),
    "paged_prefill_attention": ("ops", "paged_prefill_attention"),
    "rms_norm": ("ops", "rms_norm"),
    "rope": ("ops", "rope"),
    "silu_mul": ("ops", "silu_mul"),
    "w4a16_matmul": ("ops", "w4a16_matmul"),
    "w8a16_matmul": ("ops", "w8a16_matmul"),
    "MoEExperts": ("cpu_moe", "MoEExperts"),
    "moe_experts": ("cpu_moe", "moe_experts"),
    "moe_experts_args": ("cpu_moe", "moe_experts_args"),
    "DecodeLayer": ("cpu_qgemv", "DecodeLayer"),
    "DecodeStack": ("cpu_qgemv", "DecodeStack"),
    "DecodeWeight": ("cpu_qgemv", "DecodeWeight"),
    "KScales": ("cpu_qgemv", "KScales"),
    "ScaleKind": ("cpu_qgemv", "ScaleKind"),
    "StackLayer": ("cpu_qgemv", "StackLayer"),
    "WeightKind": ("cpu_qgemv", "WeightKind"),
    "decode_layer_args": ("cpu_qgemv", "decode_layer_args"),
    "decode_stack": ("cpu_qgemv", "decode_stack"),
    "decode_stack_args": ("cpu_qgemv", "decode_stack_args"),
    "int4_decode_weight": ("cpu_qgemv", "int4_decode_weight"),
    "int4k_decode_weight": ("cpu_qgemv", "int4k_decode_weight"),
    "int4k_gemv_a8": ("cpu_qgemv", "int4k_gemv_a8"),
    "int4_gemv_a8": ("cpu_qgemv", "int4_gemv_a8"),
    "int8_decode_weight": ("cpu_qgemv", "int8_decode_weight"),
    "int8g_decode_weight": ("cpu_qgemv", "int8g_decode_weight"),
    "int8g_gemv_a8": ("cpu_qgemv", "int8g_gemv_a8"),
    "int8_gemv_a8": ("cpu_qgemv", "int8_gemv_a8"),
    "layer_attn_in": ("cpu_qgemv", "layer_attn_in"),
    "layer_mlp": ("cpu_qgemv", "layer_mlp"),
    "layer_post_attn": ("cpu_qgemv", "layer_post_attn"),
    "CpuKernels": ("cpu_report", "CpuKernels"),
    "QuantMatmulSupport": ("cpu_report", "QuantMatmulSupport"),
    "cpu_kernels": ("cpu_report", "cpu_kernels"),
    "quant_matmul_support": ("cpu_report", "quant_matmul_support"),
    "dequant_int4": ("reference", "dequant_int4"),
    "pack_int4": ("reference", "pack_int4"),
    "quantize_int8_ref": ("reference", "quantize_int8_ref"),
    "softmax_with_sinks": ("reference", "softmax_with_sinks"),
    "unpack_int4": ("reference", "unpack_int4"),
    "repack_q4k": ("repack", "repack_q4k"),
    "repack_q6k": ("repack", "repack_q6k"),
    "repack_q4_0": ("repack", "repack_q4_0"),
    "repack_q8_0": ("repack", "repack_q8_0"),
    "build_rope_cache": ("rope_cache", "build_rope_cache"),
    "rope_attention_factor": ("rope_cache", "rope_attention_factor"),
    "rope_inv_freq": ("rope_cache", "rope_inv_freq"),
    "rope_type": ("rope_cache", "rope_type"),
})

__all__ = [
    "BF16_UPCAST_MIN_ROWS",
    "DecodeLayer",
    "MoEExperts",
    "moe_experts",
    "moe_experts_args",
    "DecodeStack",
    "StackLayer",
    "decode_stack",
    "decode_stack_args",
    "decode_weight",
    "DecodeWeight",
    "WeightKind",
    "ScaleKind",
    "layer_attn_in",
    "decode_layer_args",
    "layer_mlp",
    "layer_post_attn",
    "int4_decode_weight",
    "int4k_decode_weight",
    "int4k_gemv_a8",
    "KScales",
    "int8_decode_weight",
    "int8g_decode_weight",
    "int8g_gemv_a8",
    "cpu_fused_clamped_swiglu",
    "cpu_fused_silu_mul",
    "cpu_fused_rope_store_attend",
    "ColdBlocks",
    "GatherPlan",
    "Int4Scratch",
    "attend_gathered",
    "cpu_fused_applies",
    "cpu_fused_available",
    "cpu_fused_decode_attention",
    "cpu_fused_rms_norm",
    "cpu_fused_rope_store",
    "fusable",
    "make_gather_plan",
    "paged_attention_gathered",
    "paged_attention_gathered_scores",
    "CPU_INT4_BLOCK_N",
    "CpuKernels",
    "QuantMatmulSupport",
    "cpu_kernels",
    "int4_gemv_a8",
    "int8_gemv_a8",
    "mm_bf16",
    "quant_matmul_support",
    "DEFAULT_PARTITION_SIZE",
    "DecodeAttentionResult",
    "build_rope_cache",
    "dequant_cpu_int4",
    "dequant_int4",
    "interpreter_enabled",
    "kv_store",
    "linear",
    "LinearKernel",
    "linear_kernel",
    "run_linear",
    "linear_logits",
    "packable",
    "prepack",
    "pack_cpu_int4",
    "pack_int4",
    "paged_decode_attention",
    "paged_prefill_attention",
    "quantize_int8_ref",
    "repack_q4k",
    "repack_q6k",
    "repack_q4_0",
    "repack_q8_0",
    "rms_norm",
    "rope",
    "rope_attention_factor",
    "rope_inv_freq",
    "rope_type",
    "windowed",
    "silu_mul",
    "softmax_with_sinks",
    "transpose_bf16",
    "triton_available",
    "unpack_cpu_int4",
    "unpack_int4",
    "w4a16_matmul",
    "w8a16_matmul",
]


def __getattr__(name: str) -> Any:
    where = _EXPORTS.get(name)
    if where is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f"{__name__}.{where[0]}"), where[1])
    globals()[name] = value  # later lookups are plain attribute reads (some sit on the decode path)
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__})
