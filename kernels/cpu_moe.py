"""An MoE layer's routed experts in one C call (``moe_experts.c``): the grouped expert kernel.

``engine/models/moe.py`` routes (the router stays the model's float ``F.linear``, so the choice of experts is
transformers'), then hands every token's chosen experts and weights to :func:`moe_experts`, which runs every
routed expert's gate|up, SwiGLU, down and the weighted sum with the fused decode layers' GEMV items: the bits of
the per-expert path, without its Python, dispatch and thread fork per expert and projection. The arguments are
built once per bound weights (:func:`moe_experts_args`, by the engine's decode plan).
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass

import torch

from llmsys.kernels import _cbuild
from llmsys.kernels.cpu_qgemv import DecodeWeight, WeightKind

_P, _I, _C = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int
_SIGNATURES = {"llmsys_moe_experts": [_P, _P, _I, _P, _I, _P, _C, _P, _P, _P, _C]}
_KERNEL = _cbuild.Kernel(_cbuild.KERNELS, _SIGNATURES)
MAX_EXPERTS = 1024  # moe_experts.c's MOE_MAX_EXPERTS


class _MoEArgs(ctypes.Structure):
    """``llmsys_moe`` in fused_layer.h."""

    _fields_ = [("gu", _P), ("n_gu", _I), ("down", _P), ("n_experts", _I), ("d", _I), ("inter", _I), ("act", _I),
                ("f32", _I), ("max_rows", _I), ("alpha", ctypes.c_float), ("limit", ctypes.c_float)]


@dataclass(frozen=True)
class MoEExperts:
    """One MoE layer's experts as the grouped kernel reads them: raw pointers into their weights, valid while
    those stay where they are (the decode plan holds them and is rebuilt when weights move)."""

    args: _MoEArgs
    arrays: tuple[ctypes.Array, ...]  # the llmsys_qw arrays args points into (kept alive here)
    n_experts: int
    d: int  # hidden size
    max_rows: int  # an expert with more rows of a step runs its own forward (the caller's)
    dtype: torch.dtype  # the activations': bf16, or float32 for float32 weights


def moe_experts_args(gate_up: list[list[DecodeWeight]], down: list[DecodeWeight], max_rows: int,
                     clamped: tuple[float, float] | None = None) -> MoEExperts:
    """The :class:`MoEExperts` of ``E`` experts: ``gate_up[e]`` expert e's 1-4 gate|up weights (outputs side by
    side: gate's ``I`` rows then up's), ``down[e]`` its down weight; every expert in the same formats and shapes.
    ``max_rows``: the most rows an expert's weights give the C GEMV's bits for (their ``DECODE_MAX_ROWS``).
    ``clamped``: gpt-oss's ``(alpha, limit)`` (its clamped SwiGLU); None: SwiGLU."""
    e = len(down)
    if not 1 <= e <= MAX_EXPERTS or len(gate_up) != e or any(len(g) != len(gate_up[0]) for g in gate_up) \
            or not 1 <= len(gate_up[0]) <= 4:
        raise ValueError(f"moe_experts_args: 1-{MAX_EXPERTS} experts of 1-4 gate|up weights each and one down "
                         f"weight, got {e} down and {[len(g) for g in gate_up][:4]}... gate|up")
    f32 = down[0].kind == WeightKind.F32
    if any((w.kind == WeightKind.F32) != f32 for w in (*down, *(w for g in gate_up for w in g))):
        raise ValueError("moe_experts_args: float32 expert weights cannot be mixed with bf16 or quantized ones")
    flat = [w for g in gate_up for w in g]
    arrays = ((DecodeWeight * len(flat))(*flat), (DecodeWeight * e)(*down))
    inter = down[0].k
    alpha, limit = clamped or (0.0, 0.0)
    args = _MoEArgs(ctypes.addressof(arrays[0]), len(gate_up[0]), ctypes.addressof(arrays[1]), e, down[0].n, inter,
                    int(clamped is not None), int(f32), max_rows, alpha, limit)
    return MoEExperts(args, arrays, e, down[0].n, max_rows, torch.float32 if f32 else torch.bfloat16)


def moe_experts(m: MoEExperts, x: torch.Tensor, chosen: torch.Tensor, weights: torch.Tensor, *, lib=None
                ) -> tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor | None]:
    """Every token's routed experts: ``x [T, D]`` (``m.dtype``, contiguous), ``chosen [T, k]`` int64 and
    ``weights [T, k]`` (bf16, or float32) from ``moe.route`` -> ``(out, rows, counts)``.

    ``out [T, D]``: ``sum_j y_j * w_j`` in ``x``'s dtype, as ``MoE.forward``'s per-expert path sums it; None when
    an expert had more than ``m.max_rows`` rows (only possible for ``T > m.max_rows``): then ``rows [T k, D]``
    (the products' dtype) holds every other expert's products and ``counts [E]`` each expert's rows, and the
    caller runs the left-over experts and sums. ``rows`` and ``counts`` are None when ``T <= m.max_rows``.
    ``lib``: another build of the kernel library (tests of other ISA levels); None: the one this CPU loads.
    """
    t, k = chosen.shape
    if x.dtype != m.dtype or x.dim() != 2 or x.shape != (t, m.d) or not x.is_contiguous():
        raise ValueError(f"moe_experts: x must be a contiguous {m.dtype} [{t}, {m.d}] tensor, got {x.dtype} "
                         f"{tuple(x.shape)}")
    w = weights if weights.is_contiguous() else weights.contiguous()
    w_f32 = w.dtype == torch.float32
    if w.dtype not in (torch.bfloat16, torch.float32):
        raise ValueError(f"moe_experts: routing weights must be bfloat16 or float32, got {w.dtype}")
    ids = chosen if chosen.dtype == torch.int64 and chosen.is_contiguous() else chosen.long().contiguous()
    out = torch.empty(t, m.d, dtype=x.dtype)
    rows = counts = None
    if t > m.max_rows:
        rows = torch.empty(t * k, m.d, dtype=torch.float32 if (w_f32 or x.dtype == torch.float32) else x.dtype)
        counts = torch.empty(m.n_experts, dtype=torch.int64)
    rc = (lib or _KERNEL.lib()).llmsys_moe_experts(
        ctypes.byref(m.args), x.data_ptr(), t, ids.data_ptr(), k, w.data_ptr(), int(w_f32),
        None if rows is None else rows.data_ptr(), out.data_ptr(), None if counts is None else counts.data_ptr(),
        torch.get_num_threads())
    if rc > 0:
        raise ValueError(f"moe_experts: the C kernel rejected the layer (code {rc}; 2: out of memory): "
                         f"{m.n_experts} experts, D={m.d}, x {x.dtype} {tuple(x.shape)}, k={k}")
    return (out if rc == 0 else None), rows, counts


available = _KERNEL.available
