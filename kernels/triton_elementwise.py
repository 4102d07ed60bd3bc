"""Triton kernels for the row-wise ops of a decoder layer.

RMSNorm (optionally fused with the residual add), rotary embedding, SiLU-gate
and the paged KV-cache store. They are memory bound, so each program handles
one row (token) and keeps the whole row in registers: one read, one write.

Launchers take tensors already validated and shaped by ``ops.py``; they are
not public. Imported lazily (this module imports triton unconditionally).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

# ------------------------------------------------------------------ RMSNorm


@triton.jit
def _rms_norm_kernel(
    x_ptr, res_ptr, w_ptr, out_ptr, res_out_ptr,  # x/res/out: [R, D]; w: [D]
    D, eps,
    HAS_RESIDUAL: tl.constexpr, BLOCK_D: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK_D)
    mask = cols < D
    x = tl.load(x_ptr + row * D + cols, mask=mask, other=0.0)
    if HAS_RESIDUAL:
        r = tl.load(res_ptr + row * D + cols, mask=mask, other=0.0)
        # Round the sum to the model dtype, as HF's ``residual + hidden`` does.
        x = (x.to(tl.float32) + r.to(tl.float32)).to(res_out_ptr.dtype.element_ty)
        tl.store(res_out_ptr + row * D + cols, x, mask=mask)
    xf = x.to(tl.float32)
    var = tl.sum(xf * xf, axis=0) / D
    rstd = 1.0 / tl.sqrt(var + eps)
    normed = (xf * rstd).to(out_ptr.dtype.element_ty).to(tl.float32)
    w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * D + cols, (normed * w).to(out_ptr.dtype.element_ty), mask=mask)


def rms_norm(x2d: torch.Tensor, weight: torch.Tensor, eps: float, residual2d: torch.Tensor | None):
    """x2d, residual2d: contiguous [R, D]; returns out [R, D] (and new residual)."""
    rows, d = x2d.shape
    out = torch.empty_like(x2d)
    res_out = torch.empty_like(x2d) if residual2d is not None else out
    if rows > 0:
        _rms_norm_kernel[(rows,)](
            x2d, residual2d if residual2d is not None else x2d, weight, out, res_out,
            d, float(eps),
            HAS_RESIDUAL=residual2d is not None, BLOCK_D=triton.next_power_of_2(d),
        )
    return out if residual2d is None else (out, res_out)


# --------------------------------------------------------------------- RoPE


@triton.jit
def _rotate_heads(src, dst, stride_h, H, HALF, cos, sin, d, dmask, BLOCK_H: tl.constexpr):
    """Rotate-half one token's ``H`` heads: src rows strided, dst contiguous."""
    h = tl.arange(0, BLOCK_H)
    mask = (h < H)[:, None] & dmask[None, :]
    src_ptr = src + h[:, None] * stride_h + d[None, :]
    x1 = tl.load(src_ptr, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(src_ptr + HALF, mask=mask, other=0.0).to(tl.float32)
    dst_ptr = dst + h[:, None] * (2 * HALF) + d[None, :]
    tl.store(dst_ptr, (x1 * cos - x2 * sin).to(dst.dtype.element_ty), mask=mask)
    tl.store(dst_ptr + HALF, (x2 * cos + x1 * sin).to(dst.dtype.element_ty), mask=mask)


@triton.jit
def _rope_kernel(
    q_ptr, k_ptr, qo_ptr, ko_ptr, pos_ptr, cache_ptr,
    stride_qt, stride_qh, stride_kt, stride_kh, stride_cache,
    HQ, HK, HALF,
    BLOCK_HQ: tl.constexpr, BLOCK_HK: tl.constexpr, BLOCK_HALF: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64)
    pos = tl.load(pos_ptr + t)
    d = tl.arange(0, BLOCK_HALF)
    dmask = d < HALF
    cos = tl.load(cache_ptr + pos * stride_cache + d, mask=dmask, other=0.0)[None, :]
    sin = tl.load(cache_ptr + pos * stride_cache + HALF + d, mask=dmask, other=0.0)[None, :]
    _rotate_heads(q_ptr + t * stride_qt, qo_ptr + t * HQ * 2 * HALF, stride_qh, HQ, HALF,
                  cos, sin, d, dmask, BLOCK_HQ)
    _rotate_heads(k_ptr + t * stride_kt, ko_ptr + t * HK * 2 * HALF, stride_kh, HK, HALF,
                  cos, sin, d, dmask, BLOCK_HK)


def rope(q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor, cache: torch.Tensor):
    """q [T, Hq, D], k [T, Hk, D] (last dim unit stride) -> new contiguous (q, k)."""
    t, hq, d = q.shape
    hk = k.shape[1]
    q_out = torch.empty((t, hq, d), dtype=q.dtype, device=q.device)
    k_out = torch.empty((t, hk, d), dtype=k.dtype, device=k.device)
    if t > 0:
        _rope_kernel[(t,)](
            q, k, q_out, k_out, positions, cache,
            q.stride(0), q.stride(1), k.stride(0), k.stride(1), cache.stride(0),
            hq, hk, d // 2,
            BLOCK_HQ=triton.next_power_of_2(hq), BLOCK_HK=triton.next_power_of_2(hk),
            BLOCK_HALF=triton.next_power_of_2(d // 2),
        )
    return q_out, k_out


# ----------------------------------------------------------------- SiLU-mul


@triton.jit
def _silu_mul_kernel(x_ptr, out_ptr, INTER, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < INTER
    gate = tl.load(x_ptr + row * 2 * INTER + cols, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(x_ptr + row * 2 * INTER + INTER + cols, mask=mask, other=0.0).to(tl.float32)
    # Round silu(gate) to the model dtype before the multiply, like HF's LlamaMLP.
    act = (gate / (1.0 + tl.exp(-gate))).to(out_ptr.dtype.element_ty).to(tl.float32)
    tl.store(out_ptr + row * INTER + cols, (act * up).to(out_ptr.dtype.element_ty), mask=mask)


def silu_mul(x2d: torch.Tensor) -> torch.Tensor:
    """x2d contiguous [R, 2I] -> [R, I]."""
    rows, two_i = x2d.shape
    inter = two_i // 2
    out = torch.empty((rows, inter), dtype=x2d.dtype, device=x2d.device)
    block = min(1024, triton.next_power_of_2(max(inter, 1)))
    if rows > 0 and inter > 0:
        _silu_mul_kernel[(rows, triton.cdiv(inter, block))](x2d, out, inter, BLOCK=block)
    return out


# ----------------------------------------------------------------- KV store


@triton.jit
def _store_one(src, cache, scale_ptr, block, off, h, d, mask, keep,
               s_cb, s_co, s_ch, s_sb, s_so, QUANT: tl.constexpr):
    """mask: [BLOCK_D] head-dim lanes of a kept token; keep: scalar."""
    x = tl.load(src + d, mask=mask, other=0.0)
    dst = cache + block * s_cb + off * s_co + h * s_ch + d
    if QUANT:
        # Same float32 steps as reference.quantize_int8_ref, so codes match.
        xf = x.to(tl.float32)
        scale = tl.max(tl.abs(xf), axis=0) / 127.0
        safe = tl.where(scale > 0, scale, 1.0)
        q = tl.floor(xf / safe + 0.5)
        q = tl.minimum(tl.maximum(q, -127.0), 127.0)
        tl.store(dst, q.to(tl.int8), mask=mask)
        tl.store(scale_ptr + block * s_sb + off * s_so + h, scale, mask=keep)
    else:
        tl.store(dst, x.to(cache.dtype.element_ty), mask=mask)


@triton.jit
def _kv_store_kernel(
    k_ptr, v_ptr, kc_ptr, vc_ptr, ks_ptr, vs_ptr, slot_ptr,
    s_kt, s_kh, s_vt, s_vh,
    s_cb, s_co, s_ch,  # cache strides (block, offset, head); head dim unit stride
    s_sb, s_so,  # scale strides (block, offset); head unit stride
    BLOCK_SIZE, D,
    QUANT: tl.constexpr, BLOCK_D: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1).to(tl.int64)
    slot = tl.load(slot_ptr + t)
    keep = slot >= 0
    safe_slot = tl.maximum(slot, 0)  # masked anyway; keeps the addresses in range
    block = safe_slot // BLOCK_SIZE
    off = safe_slot % BLOCK_SIZE
    d = tl.arange(0, BLOCK_D)
    # Broadcast ``keep`` explicitly: the interpreter rejects block & scalar masks.
    mask = (d < D) & ((d * 0 + slot) >= 0)
    _store_one(k_ptr + t * s_kt + h * s_kh, kc_ptr, ks_ptr, block, off, h, d, mask, keep,
               s_cb, s_co, s_ch, s_sb, s_so, QUANT)
    _store_one(v_ptr + t * s_vt + h * s_vh, vc_ptr, vs_ptr, block, off, h, d, mask, keep,
               s_cb, s_co, s_ch, s_sb, s_so, QUANT)


def kv_store(k, v, k_cache, v_cache, slot_mapping, k_scale, v_scale) -> None:
    """k, v [T, Hk, D] (last dim unit stride); caches contiguous; in place."""
    t, hk, d = k.shape
    quant = k_cache.dtype == torch.int8
    if t == 0:
        return
    ks = k_scale if quant else k_cache
    vs = v_scale if quant else v_cache
    _kv_store_kernel[(t, hk)](
        k, v, k_cache, v_cache, ks, vs, slot_mapping,
        k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        ks.stride(0), ks.stride(1),
        k_cache.shape[1], d,
        QUANT=quant, BLOCK_D=triton.next_power_of_2(d),
    )
