"""Plain-torch reference implementations of every kernel.

Each function here is the *definition* of what its Triton twin must compute:
written for obviousness, not speed (Python loops over sequences are fine).
They also serve as the CPU path of the public wrappers in ``ops.py``. Inputs
are assumed already validated by those wrappers.

Numerics: everything is computed in float32 and cast to the input dtype once
at the end, except where Hugging Face Llama rounds to the model dtype in the
middle (RMSNorm before the weight multiply, SiLU before the gate multiply); we
round at the same places so bf16 outputs match HF.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

# ----------------------------------------------------------------- elementwise


def rms_norm_ref(
    x: torch.Tensor,  # [..., D]
    weight: torch.Tensor,  # [D]
    eps: float,
    residual: torch.Tensor | None = None,  # [..., D]
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """HF ``LlamaRMSNorm``; with ``residual``: (rmsnorm(x + residual), x + residual)."""
    dtype = x.dtype
    new_residual = None
    if residual is not None:
        x = x + residual  # in the model dtype, as HF's ``residual + hidden``
        new_residual = x
    xf = x.float()
    normed = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    out = (weight * normed.to(dtype)).to(dtype)
    return out if new_residual is None else (out, new_residual)


def rope_ref(
    q: torch.Tensor,  # [T, Hq, D]
    k: torch.Tensor,  # [T, Hk, D]
    positions: torch.Tensor,  # [T] int64
    cos_sin_cache: torch.Tensor,  # [max_pos, D]: cos | sin, float32
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotate-half (NeoX / HF Llama) rotary embedding, computed in float32.

    ``out = x * [cos, cos] + [x2, x1] * [-sin, sin]``: per element the same
    two products and one add/subtract as ``x1*cos - x2*sin | x2*cos + x1*sin``
    (``a - b`` is exactly ``a + (-b)``), in four ops per tensor instead of
    ten -- the decode step of a small model is bound by op count.
    """
    half = q.shape[-1] // 2
    cs = cos_sin_cache.index_select(0, positions)  # [T, D] float32: cos | sin
    cos, sin = cs[:, :half], cs[:, half:]
    cos2 = torch.cat([cos, cos], dim=-1).unsqueeze(1)  # [T, 1, D]
    sin2 = torch.cat([-sin, sin], dim=-1).unsqueeze(1)  # [T, 1, D]

    def rotate(x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        swapped = torch.cat([xf[..., half:], xf[..., :half]], dim=-1)  # [x2, x1]
        return (xf * cos2 + swapped * sin2).to(x.dtype)

    return rotate(q), rotate(k)


def silu_mul_ref(x: torch.Tensor) -> torch.Tensor:  # [..., 2I] -> [..., I]
    """``silu(gate) * up`` with gate the first half, rounded like HF's LlamaMLP."""
    inter = x.shape[-1] // 2
    return F.silu(x[..., :inter]) * x[..., inter:]


# ------------------------------------------------------- weight-only matmuls


def w8a16_matmul_ref(
    x: torch.Tensor,  # [M, K] float
    qweight: torch.Tensor,  # [N, K] int8
    scales: torch.Tensor,  # [N]
) -> torch.Tensor:  # [M, N] x.dtype
    """``x @ (q * scale[n]).T`` accumulated in float32."""
    w = qweight.float() * scales.float()[:, None]  # [N, K]
    return (x.float() @ w.t()).to(x.dtype)


def pack_int4(q: torch.Tensor) -> torch.Tensor:
    """[N, Kp] integer values in 0..15 -> [N, Kp/2] uint8; low nibble = even k."""
    q = q.to(torch.uint8)
    return (q[:, 0::2] | (q[:, 1::2] << 4)).contiguous()


def unpack_int4(qweight: torch.Tensor) -> torch.Tensor:
    """[N, Kp/2] uint8 -> [N, Kp] uint8 values 0..15 (inverse of ``pack_int4``)."""
    lo = qweight & 0xF
    hi = qweight >> 4
    return torch.stack([lo, hi], dim=-1).reshape(qweight.shape[0], -1)


def dequant_int4(
    qweight: torch.Tensor,  # [N, Kp/2] uint8
    scales: torch.Tensor,  # [N, G]
    zeros: torch.Tensor,  # [N, G] float
    group_size: int,
) -> torch.Tensor:  # [N, Kp] float32
    """w[n, k] = (q[n, k] - zeros[n, k // gs]) * scales[n, k // gs]."""
    q = unpack_int4(qweight).float()  # [N, Kp]
    g = torch.arange(q.shape[1], device=q.device) // group_size  # [Kp]
    return (q - zeros.float()[:, g]) * scales.float()[:, g]


def w4a16_matmul_ref(
    x: torch.Tensor,  # [M, K]
    qweight: torch.Tensor,  # [N, Kp/2] uint8
    scales: torch.Tensor,  # [N, G]
    zeros: torch.Tensor,  # [N, G]
    group_size: int,
) -> torch.Tensor:  # [M, N] x.dtype
    w = dequant_int4(qweight, scales, zeros, group_size)  # [N, Kp]
    xf = F.pad(x.float(), (0, w.shape[1] - x.shape[1]))  # zero-pad K -> Kp
    return (xf @ w.t()).to(x.dtype)


# ------------------------------------------------------------ paged KV cache


def quantize_int8_ref(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric absmax int8 over the last dim: ([..., D] int8, [...] float32 scale).

    ``q = floor(x / scale + 0.5)`` with ``scale = amax / 127``; an all-zero
    vector gets scale 0 and codes 0. The Triton store kernel uses the same
    float32 operations so codes match bit for bit.
    """
    xf = x.float()
    scale = xf.abs().amax(dim=-1) / 127.0  # [...]
    safe = torch.where(scale > 0, scale, torch.ones_like(scale))
    q = torch.floor(xf / safe[..., None] + 0.5).clamp(-127, 127).to(torch.int8)
    return q, scale


def kv_store_ref(
    k: torch.Tensor,  # [T, Hk, D]
    v: torch.Tensor,  # [T, Hk, D]
    k_cache: torch.Tensor,  # [num_blocks, block_size, Hk, D]
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,  # [T] int64, -1 = skip
    k_scale: torch.Tensor | None = None,  # [num_blocks, block_size, Hk] f32 (int8 cache)
    v_scale: torch.Tensor | None = None,
) -> None:
    """Write each token's K/V to ``slot = block * block_size + offset`` in place."""
    block_size = k_cache.shape[1]
    keep = slot_mapping >= 0
    slots = slot_mapping[keep]
    blocks, offs = slots // block_size, slots % block_size
    for src, cache, scale in ((k[keep], k_cache, k_scale), (v[keep], v_cache, v_scale)):
        if cache.dtype == torch.int8:
            q, s = quantize_int8_ref(src)
            cache[blocks, offs] = q
            scale[blocks, offs] = s
        else:
            cache[blocks, offs] = src.to(cache.dtype)


def gather_kv_ref(
    cache: torch.Tensor,  # [num_blocks, block_size, Hk, D]
    block_table: torch.Tensor,  # [max_blocks] int32, one sequence
    length: int,
    scale: torch.Tensor | None = None,  # [num_blocks, block_size, Hk] for int8
) -> torch.Tensor:  # [length, Hk, D] float32
    """Un-page one sequence's first ``length`` tokens (dequantized to float32)."""
    block_size = cache.shape[1]
    t = torch.arange(length, device=cache.device)
    blocks = block_table.long()[t // block_size]
    offs = t % block_size
    out = cache[blocks, offs].float()
    if scale is not None:
        out = out * scale[blocks, offs].float()[..., None]
    return out


def softmax_with_sinks(logits: torch.Tensor, sinks: torch.Tensor | None) -> torch.Tensor:
    """``softmax(logits)`` over the last dim (keys), with attention sinks (gpt-oss) when given.

    A sink is one learned logit per query head that joins each row's softmax denominator and has no
    value: the probabilities are ``softmax([logits, sink])`` with the sink's column dropped, so a row's
    mass sums to less than 1 (transformers' ``eager_attention_forward`` of GptOss). ``sinks`` must
    broadcast against ``logits[..., :1]`` (the head on its axis of ``logits``); it is used in float32.
    """
    if sinks is None:
        return torch.softmax(logits, dim=-1)
    col = sinks.to(device=logits.device, dtype=logits.dtype).expand(*logits.shape[:-1], 1)
    return torch.softmax(torch.cat([logits, col], dim=-1), dim=-1)[..., :-1]


def block_max_from_token_mass(token_mass: torch.Tensor, block_size: int) -> torch.Tensor:
    """[B, Hk, max_blocks * block_size] -> [B, Hk, max_blocks]: max per KV block."""
    b, h, c = token_mass.shape
    return token_mass.view(b, h, c // block_size, block_size).amax(dim=-1)


def paged_decode_attention_ref(
    q: torch.Tensor,  # [B, Hq, D]
    k_cache: torch.Tensor,  # [num_blocks, block_size, Hk, D]
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,  # [B, max_blocks] int32
    context_lens: torch.Tensor,  # [B] int32
    scale: float,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
    return_scores: bool = False,
    window: int | None = None,
    softcap: float | None = None,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """One query token per sequence against its paged K/V (dense softmax).

    ``window``: only the last ``window`` keys (sliding-window layers); ``softcap``: logits
    ``cap * tanh(logits / cap)`` before the softmax (Gemma 2); ``sinks`` ``[Hq]``: one more logit per
    head in each softmax's denominator (:func:`softmax_with_sinks`: gpt-oss).

    Returns ``out [B, Hq, D]``; with ``return_scores`` also
    ``token_mass [B, Hk, max_blocks*block_size]`` (softmax probability summed
    over the query heads sharing each KV head, 0 past the length) and
    ``block_max [B, Hk, max_blocks]``.
    """
    bsz, hq, d = q.shape
    block_size, hk = k_cache.shape[1], k_cache.shape[2]
    group = hq // hk
    cap = block_tables.shape[1] * block_size
    out = torch.zeros(bsz, hq, d, dtype=torch.float32, device=q.device)
    mass = torch.zeros(bsz, hk, cap, dtype=torch.float32, device=q.device)
    for b in range(bsz):
        length = int(context_lens[b])
        if length == 0:
            continue
        keys = gather_kv_ref(k_cache, block_tables[b], length, k_scale)  # [L, Hk, D]
        vals = gather_kv_ref(v_cache, block_tables[b], length, v_scale)
        keys = keys.repeat_interleave(group, dim=1)  # [L, Hq, D]
        vals = vals.repeat_interleave(group, dim=1)
        logits = torch.einsum("hd,lhd->hl", q[b].float(), keys) * scale  # [Hq, L]
        if softcap is not None:
            logits = torch.tanh(logits / softcap) * softcap
        if window is not None and length > window:
            logits[:, : length - window] = float("-inf")
        probs = softmax_with_sinks(logits, None if sinks is None else sinks.view(hq, 1))
        out[b] = torch.einsum("hl,lhd->hd", probs, vals)
        mass[b, :, :length] = probs.view(hk, group, length).sum(dim=1)
    out = out.to(q.dtype)
    if not return_scores:
        return out
    return out, mass, block_max_from_token_mass(mass, block_size)


def paged_prefill_attention_ref(
    q: torch.Tensor,  # [T, Hq, D] new tokens of all sequences, concatenated
    k_cache: torch.Tensor,  # [num_blocks, block_size, Hk, D] (new tokens already stored)
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,  # [B, max_blocks] int32
    context_lens: torch.Tensor,  # [B] int32: cached prefix + new tokens
    query_start_loc: torch.Tensor,  # [B + 1] int32/int64 cumulative query lengths
    scale: float,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
    window: int | None = None,
    softcap: float | None = None,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:  # [T, Hq, D]
    """Causal attention of each sequence's new tokens over its whole context.

    The new tokens are the last ``query_len`` positions of the context, so
    query ``i`` (0-based within the sequence) sits at absolute position
    ``context_len - query_len + i`` and sees keys ``0..that position`` (with
    ``window``, only those above ``position - window``); ``softcap`` and ``sinks`` as in
    :func:`paged_decode_attention_ref`.
    """
    hq, hk = q.shape[1], k_cache.shape[2]
    group = hq // hk
    out = torch.empty_like(q)
    for b in range(block_tables.shape[0]):
        start, end = int(query_start_loc[b]), int(query_start_loc[b + 1])
        qlen, length = end - start, int(context_lens[b])
        if qlen == 0:
            continue
        keys = gather_kv_ref(k_cache, block_tables[b], length, k_scale)
        vals = gather_kv_ref(v_cache, block_tables[b], length, v_scale)
        keys = keys.repeat_interleave(group, dim=1).transpose(0, 1)  # [Hq, L, D]
        vals = vals.repeat_interleave(group, dim=1).transpose(0, 1)
        qb = q[start:end].float().transpose(0, 1)  # [Hq, Lq, D]
        qpos = torch.arange(length - qlen, length, device=q.device)  # [Lq]
        kpos = torch.arange(length, device=q.device)[None, :]
        mask = kpos <= qpos[:, None]  # [Lq, L]
        if window is not None:
            mask &= kpos > qpos[:, None] - window
        if softcap is None and sinks is None:
            o = F.scaled_dot_product_attention(qb, keys, vals, attn_mask=mask, scale=scale)
        else:
            logits = torch.matmul(qb, keys.transpose(-1, -2)) * scale  # [Hq, Lq, L]
            if softcap is not None:
                logits = torch.tanh(logits / softcap) * softcap
            head_sinks = None if sinks is None else sinks.view(hq, 1, 1)
            o = torch.matmul(softmax_with_sinks(logits.masked_fill(~mask, float("-inf")), head_sinks), vals)
        out[start:end] = o.transpose(0, 1).to(q.dtype)
    return out
