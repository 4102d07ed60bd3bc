"""Triton weight-only quantized matmuls (int8 and int4 weights, float activations, float32 accumulation).

Decode (M <= 8) is a memory-bound GEMV where tl.dot (16 rows) cannot help: one program per (row m, N
strip), m fastest so programs sharing a weight strip meet in L2, dequantizing in registers. Prefill
(M > 8) is a tiled tl.dot GEMM dequantizing each [BLOCK_K, BLOCK_N] tile to the activation dtype.
int4 layout (shared with llmsys.quant): qweight uint8 [N, Kp/2], low nibble even k, high nibble odd k,
Kp = G * group_size, w[n, k] = (q - zeros[n, k // gs]) * scales[n, k // gs]; K < Kp reads as zero-padded.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

GEMV_MAX_M = 8


def _precision(dtype: torch.dtype) -> str:
    # float32 activations: exact fp32 products (no TF32 rounding) to match torch.
    return "ieee" if dtype == torch.float32 else "tf32"


# -------------------------------------------------------------------- int8


@triton.jit
def _w8_gemv_kernel(
    x_ptr, w_ptr, s_ptr, out_ptr,  # x [M, K], w [N, K] int8, s [N], out [M, N]
    N, K, stride_xm, stride_wn, stride_om,
    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):
    m = tl.program_id(0).to(tl.int64)
    n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    nmask = n < N
    acc = tl.zeros([BLOCK_N], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k = k0 + tl.arange(0, BLOCK_K)
        kmask = k < K
        x = tl.load(x_ptr + m * stride_xm + k, mask=kmask, other=0.0).to(tl.float32)
        w = tl.load(w_ptr + n[:, None].to(tl.int64) * stride_wn + k[None, :],
                    mask=nmask[:, None] & kmask[None, :], other=0).to(tl.float32)
        acc += tl.sum(w * x[None, :], axis=1)
    s = tl.load(s_ptr + n, mask=nmask, other=0.0).to(tl.float32)
    tl.store(out_ptr + m * stride_om + n, (acc * s).to(out_ptr.dtype.element_ty), mask=nmask)


@triton.jit
def _w8_gemm_kernel(
    x_ptr, w_ptr, s_ptr, out_ptr,
    M, N, K, stride_xm, stride_wn, stride_om,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    PRECISION: tl.constexpr,
):
    rm = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    mmask, nmask = rm < M, rn < N
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        rk = k0 + tl.arange(0, BLOCK_K)
        kmask = rk < K
        x = tl.load(x_ptr + rm[:, None].to(tl.int64) * stride_xm + rk[None, :],
                    mask=mmask[:, None] & kmask[None, :], other=0.0)  # [BM, BK]
        w = tl.load(w_ptr + rn[None, :].to(tl.int64) * stride_wn + rk[:, None],
                    mask=nmask[None, :] & kmask[:, None], other=0)  # [BK, BN] int8
        acc = tl.dot(x, w.to(x.dtype), acc, input_precision=PRECISION)
    s = tl.load(s_ptr + rn, mask=nmask, other=0.0).to(tl.float32)
    out = (acc * s[None, :]).to(out_ptr.dtype.element_ty)
    tl.store(out_ptr + rm[:, None].to(tl.int64) * stride_om + rn[None, :], out,
             mask=mmask[:, None] & nmask[None, :])


def w8a16_matmul(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor,
                 force: str | None = None) -> torch.Tensor:
    """x [M, K] (unit stride in K), qweight [N, K] int8 contiguous, scales [N]."""
    m, k = x.shape
    n = qweight.shape[0]
    out = torch.empty((m, n), dtype=x.dtype, device=x.device)
    if m == 0 or n == 0:
        return out
    if (force or ("gemv" if m <= GEMV_MAX_M else "gemm")) == "gemv":
        block_n = 64
        _w8_gemv_kernel[(m, triton.cdiv(n, block_n))](
            x, qweight, scales, out, n, k, x.stride(0), qweight.stride(0), out.stride(0),
            BLOCK_N=block_n, BLOCK_K=128,
        )
    else:
        bm, bn, bk = 32, 64, 64
        _w8_gemm_kernel[(triton.cdiv(m, bm), triton.cdiv(n, bn))](
            x, qweight, scales, out, m, n, k, x.stride(0), qweight.stride(0), out.stride(0),
            BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, PRECISION=_precision(x.dtype),
        )
    return out


# -------------------------------------------------------------------- int4


@triton.jit
def _dequant_int4(w_ptr, s_ptr, z_ptr, n, k, mask, stride_wn, stride_sn, GROUP):
    """Dequantize codes at broadcast index grids ``n``, ``k`` to float32."""
    byte = tl.load(w_ptr + n * stride_wn + k // 2, mask=mask, other=0).to(tl.int32)
    q = (byte >> ((k & 1) * 4)) & 0xF  # low nibble = even k, high nibble = odd k
    g = k // GROUP
    s = tl.load(s_ptr + n * stride_sn + g, mask=mask, other=0.0).to(tl.float32)
    z = tl.load(z_ptr + n * stride_sn + g, mask=mask, other=0.0).to(tl.float32)
    return (q.to(tl.float32) - z) * s


@triton.jit
def _w4_gemv_kernel(
    x_ptr, w_ptr, s_ptr, z_ptr, out_ptr,  # x [M, K], w [N, KP/2] u8, s/z [N, G]
    N, K, KP, GROUP, stride_xm, stride_wn, stride_sn, stride_om,
    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):
    m = tl.program_id(0).to(tl.int64)
    n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    nmask = n < N
    acc = tl.zeros([BLOCK_N], dtype=tl.float32)
    for k0 in range(0, KP, BLOCK_K):
        k = k0 + tl.arange(0, BLOCK_K)
        x = tl.load(x_ptr + m * stride_xm + k, mask=k < K, other=0.0).to(tl.float32)
        w = _dequant_int4(w_ptr, s_ptr, z_ptr, n[:, None].to(tl.int64), k[None, :],
                          nmask[:, None] & (k < KP)[None, :], stride_wn, stride_sn, GROUP)
        acc += tl.sum(w * x[None, :], axis=1)
    tl.store(out_ptr + m * stride_om + n, acc.to(out_ptr.dtype.element_ty), mask=nmask)


@triton.jit
def _w4_gemm_kernel(
    x_ptr, w_ptr, s_ptr, z_ptr, out_ptr,
    M, N, K, KP, GROUP, stride_xm, stride_wn, stride_sn, stride_om,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    PRECISION: tl.constexpr,
):
    rm = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    mmask, nmask = rm < M, rn < N
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, KP, BLOCK_K):
        rk = k0 + tl.arange(0, BLOCK_K)
        x = tl.load(x_ptr + rm[:, None].to(tl.int64) * stride_xm + rk[None, :],
                    mask=mmask[:, None] & (rk < K)[None, :], other=0.0)  # [BM, BK]
        w = _dequant_int4(w_ptr, s_ptr, z_ptr, rn[None, :].to(tl.int64), rk[:, None],
                          nmask[None, :] & (rk < KP)[:, None], stride_wn, stride_sn, GROUP)
        acc = tl.dot(x, w.to(x.dtype), acc, input_precision=PRECISION)  # w: [BK, BN]
    tl.store(out_ptr + rm[:, None].to(tl.int64) * stride_om + rn[None, :],
             acc.to(out_ptr.dtype.element_ty), mask=mmask[:, None] & nmask[None, :])


def w4a16_matmul(x, qweight, scales, zeros, group_size: int, force: str | None = None):
    """x [M, K]; qweight [N, Kp/2] u8; scales/zeros [N, G] contiguous."""
    m, k = x.shape
    n, kp = qweight.shape[0], qweight.shape[1] * 2
    out = torch.empty((m, n), dtype=x.dtype, device=x.device)
    if m == 0 or n == 0:
        return out
    args = (x, qweight, scales, zeros, out)
    if (force or ("gemv" if m <= GEMV_MAX_M else "gemm")) == "gemv":
        block_n = 64
        _w4_gemv_kernel[(m, triton.cdiv(n, block_n))](
            *args, n, k, kp, group_size, x.stride(0), qweight.stride(0), scales.stride(0),
            out.stride(0), BLOCK_N=block_n, BLOCK_K=128,
        )
    else:
        bm, bn, bk = 32, 64, 64
        _w4_gemm_kernel[(triton.cdiv(m, bm), triton.cdiv(n, bn))](
            *args, m, n, k, kp, group_size, x.stride(0), qweight.stride(0), scales.stride(0),
            out.stride(0), BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, PRECISION=_precision(x.dtype),
        )
    return out
