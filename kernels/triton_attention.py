"""Triton paged decode attention (split-K flash-decoding).

One query token per sequence leaves a GPU idle on long contexts, so each context is split into fixed
partitions (grid B x Hk x partitions), each writing an unnormalised partial (acc, max m, sum l) that a
second kernel combines by log-sum-exp; empty partitions do no work. One program serves a KV head's
``Hq / Hk`` query heads (scores a [heads, tokens] tl.dot, heads padded to 16, head_dim to >= 16). int8 KV:
codes [num_blocks, block_size, Hk, D], one float32 scale per (block, slot, head), K scales applied to
score columns and V scales to probabilities, so codes enter tl.dot unscaled. Requested scores are the
scaled logits [B, Hq, max_blocks*block_size]; ``ops.py`` normalises them with the returned log-sum-exp.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _decode_partition_kernel(
    q_ptr, kc_ptr, vc_ptr, ks_ptr, vs_ptr, bt_ptr, lens_ptr,
    acc_ptr, m_ptr, l_ptr, logits_ptr,  # partials [B, Hq, NP, D] / [B, Hq, NP]
    scale,
    stride_qb, stride_qh,
    s_cb, s_co, s_ch,  # K/V cache strides (block, slot, head); head dim unit stride
    s_sb, s_so,  # int8 scale strides (block, slot); head unit stride
    stride_bt,
    HQ, D, BLOCK_SIZE, NUM_PARTS, CAP,
    GROUP: tl.constexpr, BLOCK_G: tl.constexpr, BLOCK_D: tl.constexpr,
    BLOCK_T: tl.constexpr, PARTITION: tl.constexpr,
    QUANT: tl.constexpr, STORE_LOGITS: tl.constexpr, PRECISION: tl.constexpr,
):
    b = tl.program_id(0).to(tl.int64)
    kvh = tl.program_id(1).to(tl.int64)
    part = tl.program_id(2)
    length = tl.load(lens_ptr + b)
    start = part * PARTITION
    end = tl.minimum(start + PARTITION, length)

    g = tl.arange(0, BLOCK_G)
    gmask = g < GROUP
    heads = kvh * GROUP + g  # [BG] query heads of this KV head
    d = tl.arange(0, BLOCK_D)
    dmask = d < D
    q = tl.load(q_ptr + b * stride_qb + heads[:, None] * stride_qh + d[None, :],
                mask=gmask[:, None] & dmask[None, :], other=0.0)  # [BG, BD]

    m_i = tl.full([BLOCK_G], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_G], dtype=tl.float32)
    acc = tl.zeros([BLOCK_G, BLOCK_D], dtype=tl.float32)
    for t0 in range(start, end, BLOCK_T):
        t = t0 + tl.arange(0, BLOCK_T)
        tmask = t < end
        blk = tl.load(bt_ptr + b * stride_bt + t // BLOCK_SIZE, mask=tmask, other=0).to(tl.int64)
        off = t % BLOCK_SIZE
        row = blk * s_cb + off * s_co + kvh * s_ch  # [BT] offset of (token, head)
        kv_mask = tmask[:, None] & dmask[None, :]
        k = tl.load(kc_ptr + row[:, None] + d[None, :], mask=kv_mask, other=0.0)  # [BT, BD]
        s = tl.dot(q, tl.trans(k.to(q.dtype)), input_precision=PRECISION)  # [BG, BT]
        if QUANT:
            k_sc = tl.load(ks_ptr + blk * s_sb + off * s_so + kvh, mask=tmask, other=0.0)
            s = s * k_sc[None, :]
        s = tl.where(tmask[None, :], s * scale, float("-inf"))
        if STORE_LOGITS:
            tl.store(logits_ptr + (b * HQ + heads[:, None]) * CAP + t[None, :], s,
                     mask=gmask[:, None] & tmask[None, :])
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        alpha = tl.exp(m_i - m_new)
        p = tl.exp(s - m_new[:, None])  # [BG, BT]
        l_i = l_i * alpha + tl.sum(p, axis=1)
        v = tl.load(vc_ptr + row[:, None] + d[None, :], mask=kv_mask, other=0.0)  # [BT, BD]
        if QUANT:
            v_sc = tl.load(vs_ptr + blk * s_sb + off * s_so + kvh, mask=tmask, other=0.0)
            p = p * v_sc[None, :]
            v = v.to(q.dtype)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
        m_i = m_new

    idx = (b * HQ + heads) * NUM_PARTS + part  # [BG]
    tl.store(m_ptr + idx, m_i, mask=gmask)
    tl.store(l_ptr + idx, l_i, mask=gmask)
    tl.store(acc_ptr + idx[:, None] * D + d[None, :], acc, mask=gmask[:, None] & dmask[None, :])


@triton.jit
def _decode_reduce_kernel(
    acc_ptr, m_ptr, l_ptr, lens_ptr, out_ptr, lse_ptr,
    stride_ob, stride_oh,
    HQ, D, NUM_PARTS,
    PARTITION: tl.constexpr, BLOCK_P: tl.constexpr, BLOCK_D: tl.constexpr,
):
    b = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1).to(tl.int64)
    length = tl.load(lens_ptr + b)
    n_valid = (length + PARTITION - 1) // PARTITION
    p = tl.arange(0, BLOCK_P)
    pmask = p < n_valid
    base = (b * HQ + h) * NUM_PARTS
    m = tl.load(m_ptr + base + p, mask=pmask, other=float("-inf"))
    l = tl.load(l_ptr + base + p, mask=pmask, other=0.0)
    m_max = tl.max(m, axis=0)
    m_max = tl.where(m_max == float("-inf"), 0.0, m_max)  # empty sequence: all zero
    w = tl.where(pmask, tl.exp(m - m_max), 0.0)  # [BP] rescale each partial
    total = tl.sum(w * l, axis=0)
    d = tl.arange(0, BLOCK_D)
    dmask = d < D
    acc = tl.load(acc_ptr + (base + p[:, None]) * D + d[None, :],
                  mask=pmask[:, None] & dmask[None, :], other=0.0)  # [BP, BD]
    out = tl.sum(acc * w[:, None], axis=0) / tl.where(total > 0, total, 1.0)
    tl.store(out_ptr + b * stride_ob + h * stride_oh + d, out.to(out_ptr.dtype.element_ty), mask=dmask)
    tl.store(lse_ptr + b * HQ + h, m_max + tl.log(total))


def paged_decode_attention(
    q, k_cache, v_cache, block_tables, context_lens, scale: float,
    k_scale, v_scale, store_logits: bool, partition_size: int,
):
    """Returns (out [B, Hq, D], lse [B, Hq] f32, logits [B, Hq, CAP] f32 | None)."""
    bsz, hq, d = q.shape
    block_size, hk = k_cache.shape[1], k_cache.shape[2]
    cap = block_tables.shape[1] * block_size
    num_parts = max(1, triton.cdiv(cap, partition_size))
    dev = q.device
    out = torch.empty((bsz, hq, d), dtype=q.dtype, device=dev)
    lse = torch.empty((bsz, hq), dtype=torch.float32, device=dev)
    logits = torch.empty((bsz, hq, cap), dtype=torch.float32, device=dev) if store_logits else None
    if bsz == 0:
        return out, lse, logits
    part_acc = torch.empty((bsz, hq, num_parts, d), dtype=torch.float32, device=dev)
    part_m = torch.empty((bsz, hq, num_parts), dtype=torch.float32, device=dev)
    part_l = torch.empty((bsz, hq, num_parts), dtype=torch.float32, device=dev)
    quant = k_cache.dtype == torch.int8
    ks = k_scale if quant else part_m  # placeholders are never read
    vs = v_scale if quant else part_m
    group = hq // hk
    block_d = max(16, triton.next_power_of_2(d))
    _decode_partition_kernel[(bsz, hk, num_parts)](
        q, k_cache, v_cache, ks, vs, block_tables, context_lens,
        part_acc, part_m, part_l, logits if logits is not None else part_m,
        float(scale),
        q.stride(0), q.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        ks.stride(0), ks.stride(1) if quant else 0,
        block_tables.stride(0),
        hq, d, block_size, num_parts, cap,
        GROUP=group, BLOCK_G=max(16, triton.next_power_of_2(group)), BLOCK_D=block_d,
        BLOCK_T=min(64, partition_size), PARTITION=partition_size,
        QUANT=quant, STORE_LOGITS=store_logits,
        PRECISION="ieee" if q.dtype == torch.float32 else "tf32",
    )
    _decode_reduce_kernel[(bsz, hq)](
        part_acc, part_m, part_l, context_lens, out, lse,
        out.stride(0), out.stride(1),
        hq, d, num_parts,
        PARTITION=partition_size, BLOCK_P=triton.next_power_of_2(num_parts), BLOCK_D=block_d,
    )
    return out, lse, logits
