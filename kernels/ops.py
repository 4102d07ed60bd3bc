"""Public, dispatching wrappers for the decode-path kernels.

Each wrapper validates its inputs (``ValueError`` with the op and argument
named), then runs the Triton kernel for CUDA tensors when Triton imports, or
the plain-torch reference otherwise. ``impl`` overrides that choice:
``"reference"`` always runs torch, ``"triton"`` forces the kernel (CUDA, or CPU
tensors under ``TRITON_INTERPRET=1``, which is how the tests check kernels
without a GPU).
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F

from llmsys.kernels import cpu_decode
from llmsys.kernels import reference as ref
from llmsys.kernels._backend import Impl, triton_module, use_triton
from llmsys.kernels._validate import (
    FLOAT_DTYPES,
    check,
    check_int8_scales,
    check_kv_cache,
    fail,
)

DEFAULT_PARTITION_SIZE = 512  # tokens per split-K partition in decode attention


class DecodeAttentionResult(NamedTuple):
    """``paged_decode_attention(..., return_scores=True)``: unpacks as a 3-tuple."""

    out: torch.Tensor  # [B, Hq, D] q.dtype
    token_mass: torch.Tensor  # [B, Hk, max_blocks * block_size] f32, 0 past each length
    block_max: torch.Tensor  # [B, Hk, max_blocks] f32: max token_mass within each block


# ------------------------------------------------------------------ elementwise


def rms_norm(
    x: torch.Tensor,  # [..., D]
    weight: torch.Tensor,  # [D]
    eps: float = 1e-6,
    residual: torch.Tensor | None = None,  # [..., D], same dtype as x
    *,
    impl: Impl = "auto",
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """HF LlamaRMSNorm in float32, output in ``x.dtype``.

    With ``residual``: returns ``(rmsnorm(x + residual), x + residual)`` (the
    fused pre-norm residual add); inputs are not modified.
    """
    op = "rms_norm"
    check(op, "x", x, dtypes=FLOAT_DTYPES, contiguous=True)
    if x.dim() < 1 or x.shape[-1] == 0:
        fail(op, f"x must have a non-empty last dim, got shape {tuple(x.shape)}")
    d = x.shape[-1]
    check(op, "weight", weight, shape=(d,), dtypes=FLOAT_DTYPES, device=x.device, contiguous=True)
    if residual is not None:
        check(op, "residual", residual, shape=tuple(x.shape), dtypes=(x.dtype,),
              device=x.device, contiguous=True)
    if not use_triton(impl, x.device, op):
        if (impl == "auto" and cpu_decode.applies(x, weight, residual) and weight.dtype == x.dtype
                and cpu_decode.available()):
            return cpu_decode.rms_norm(x, weight, eps, residual)  # one C call, HF's roundings (the fused layers' bits)
        if impl == "auto" and x.dtype == torch.float32 and weight.dtype == torch.float32:
            # without the C kernel: torch's fused rms_norm is the same math when
            # nothing is rounded to a narrower dtype in between (~3x fewer ops).
            h = x if residual is None else x + residual
            out = F.rms_norm(h, (d,), weight, eps)
            return out if residual is None else (out, h)
        return ref.rms_norm_ref(x, weight, eps, residual)
    res2d = residual.reshape(-1, d) if residual is not None else None
    result = triton_module("triton_elementwise").rms_norm(x.reshape(-1, d), weight, eps, res2d)
    if residual is None:
        return result.view(x.shape)
    return result[0].view(x.shape), result[1].view(x.shape)


def rope(
    q: torch.Tensor,  # [T, Hq, D]
    k: torch.Tensor,  # [T, Hk, D]
    positions: torch.Tensor,  # [T] int64
    cos_sin_cache: torch.Tensor,  # [max_pos, D] float32 (cos | sin), see build_rope_cache
    *,
    impl: Impl = "auto",
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotate-half rotary embedding; returns new contiguous (q, k), inputs untouched."""
    op = "rope"
    check(op, "q", q, ndim=3, dtypes=FLOAT_DTYPES, unit_last_stride=True)
    t, _, d = q.shape
    if d % 2:
        fail(op, f"head_dim must be even, got {d}")
    check(op, "k", k, ndim=3, shape=(t, None, d), dtypes=FLOAT_DTYPES, device=q.device,
          unit_last_stride=True)
    check(op, "positions", positions, shape=(t,), dtypes=(torch.int64,), device=q.device,
          contiguous=True)
    check(op, "cos_sin_cache", cos_sin_cache, ndim=2, shape=(None, d), dtypes=(torch.float32,),
          device=q.device, contiguous=True)
    if not use_triton(impl, q.device, op):
        if (impl == "auto" and cpu_decode.applies(q, k) and k.dtype == q.dtype and cpu_decode.available()
                and q.stride(1) == d and k.stride(1) == d):
            return cpu_decode.rope(q, k, positions, cos_sin_cache)  # the reference's bits in one C call
        return ref.rope_ref(q, k, positions, cos_sin_cache)
    return triton_module("triton_elementwise").rope(q, k, positions, cos_sin_cache)


def silu_mul(x: torch.Tensor, *, impl: Impl = "auto") -> torch.Tensor:
    """[..., 2I] -> [..., I]: ``silu(x[..., :I]) * x[..., I:]`` (gate first, then up)."""
    op = "silu_mul"
    check(op, "x", x, dtypes=FLOAT_DTYPES, contiguous=True)
    if x.dim() < 1 or x.shape[-1] % 2:
        fail(op, f"x last dim must be even (gate | up), got shape {tuple(x.shape)}")
    if impl == "auto" and cpu_decode.applies(x) and cpu_decode.available():
        x2 = x.reshape(-1, x.shape[-1])
        inter = x.shape[-1] // 2
        return cpu_decode.silu_mul(x2[:, :inter], x2[:, inter:]).view(*x.shape[:-1], inter)  # the C row code
    if not use_triton(impl, x.device, op):
        return ref.silu_mul_ref(x)
    out = triton_module("triton_elementwise").silu_mul(x.reshape(-1, x.shape[-1]))
    return out.view(*x.shape[:-1], x.shape[-1] // 2)


# -------------------------------------------------------- weight-only matmuls


def w8a16_matmul(
    x: torch.Tensor,  # [M, K] float
    qweight: torch.Tensor,  # [N, K] int8
    scales: torch.Tensor,  # [N] float (per output channel)
    *,
    impl: Impl = "auto",
) -> torch.Tensor:  # [M, N] x.dtype
    """``x @ (qweight * scales[:, None]).T``, float32 accumulation."""
    op = "w8a16_matmul"
    check(op, "x", x, ndim=2, dtypes=FLOAT_DTYPES, unit_last_stride=True)
    check(op, "qweight", qweight, ndim=2, shape=(None, x.shape[1]), dtypes=(torch.int8,),
          device=x.device, contiguous=True)
    check(op, "scales", scales, shape=(qweight.shape[0],), dtypes=FLOAT_DTYPES,
          device=x.device, contiguous=True)
    if not use_triton(impl, x.device, op):
        return ref.w8a16_matmul_ref(x, qweight, scales)
    return triton_module("triton_quant_matmul").w8a16_matmul(x, qweight, scales)


def w4a16_matmul(
    x: torch.Tensor,  # [M, K] float, K <= Kp
    qweight: torch.Tensor,  # [N, Kp // 2] uint8, low nibble = even k
    scales: torch.Tensor,  # [N, G] float, Kp = G * group_size
    zeros: torch.Tensor,  # [N, G] float (zero points in code units)
    group_size: int,
    *,
    impl: Impl = "auto",
) -> torch.Tensor:  # [M, N] x.dtype
    """Grouped asymmetric int4: w = (q - zeros[n, k // gs]) * scales[n, k // gs].

    ``x`` with K < Kp is treated as zero-padded to Kp (the padded weight
    columns then contribute nothing).
    """
    op = "w4a16_matmul"
    check(op, "x", x, ndim=2, dtypes=FLOAT_DTYPES, unit_last_stride=True)
    check(op, "qweight", qweight, ndim=2, dtypes=(torch.uint8,), device=x.device, contiguous=True)
    n, kp = qweight.shape[0], qweight.shape[1] * 2
    if not isinstance(group_size, int) or group_size <= 0 or group_size % 2:
        fail(op, f"group_size must be a positive even int, got {group_size!r}")
    if kp % group_size:
        fail(op, f"padded K ({kp} = 2 * qweight.shape[1]) must be a multiple of group_size {group_size}")
    groups = kp // group_size
    check(op, "scales", scales, shape=(n, groups), dtypes=FLOAT_DTYPES, device=x.device,
          contiguous=True)
    check(op, "zeros", zeros, shape=(n, groups), dtypes=FLOAT_DTYPES, device=x.device,
          contiguous=True)
    if x.shape[1] > kp:
        fail(op, f"x has K={x.shape[1]} but qweight holds only Kp={kp} columns")
    if not use_triton(impl, x.device, op):
        return ref.w4a16_matmul_ref(x, qweight, scales, zeros, group_size)
    return triton_module("triton_quant_matmul").w4a16_matmul(x, qweight, scales, zeros, group_size)


# ------------------------------------------------------------ paged KV cache


def kv_store(
    k: torch.Tensor,  # [T, Hk, D]
    v: torch.Tensor,  # [T, Hk, D]
    k_cache: torch.Tensor,  # [num_blocks, block_size, Hk, D]
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,  # [T] int64: block * block_size + offset, -1 = skip
    k_scale: torch.Tensor | None = None,  # [num_blocks, block_size, Hk] f32, int8 caches only
    v_scale: torch.Tensor | None = None,
    *,
    impl: Impl = "auto",
) -> None:
    """Write new tokens' K/V into their cache slots in place.

    int8 caches quantize on write: per (token, head) symmetric absmax,
    ``scale = amax / 127``, ``code = floor(x / scale + 0.5)``.
    """
    op = "kv_store"
    check(op, "k", k, ndim=3, dtypes=FLOAT_DTYPES, unit_last_stride=True)
    _, hk, d = check_kv_cache(op, k_cache, v_cache, k.device)
    t = k.shape[0]
    check(op, "k", k, shape=(t, hk, d))
    check(op, "v", v, shape=(t, hk, d), dtypes=(k.dtype,), device=k.device, unit_last_stride=True)
    check(op, "slot_mapping", slot_mapping, shape=(t,), dtypes=(torch.int64,), device=k.device,
          contiguous=True)
    if k_cache.dtype != torch.int8 and k.dtype != k_cache.dtype:
        fail(op, f"k dtype {k.dtype} differs from cache dtype {k_cache.dtype}")
    check_int8_scales(op, k_cache, k_scale, "k_scale")
    check_int8_scales(op, v_cache, v_scale, "v_scale")
    if not use_triton(impl, k.device, op):
        if k_cache.dtype != torch.int8 and impl == "auto" and t and int(slot_mapping.min()) >= 0:
            # CPU fast path: one index_copy_ per cache into its flat slot view
            # (the reference's 2-D advanced indexing costs ~2x on decode steps).
            k_cache.view(-1, hk, d).index_copy_(0, slot_mapping, k.to(k_cache.dtype))
            v_cache.view(-1, hk, d).index_copy_(0, slot_mapping, v.to(v_cache.dtype))
            return
        ref.kv_store_ref(k, v, k_cache, v_cache, slot_mapping, k_scale, v_scale)
        return
    triton_module("triton_elementwise").kv_store(k, v, k_cache, v_cache, slot_mapping, k_scale, v_scale)


def _check_paged(op, q, k_cache, v_cache, block_tables, context_lens, k_scale, v_scale):
    """Shared checks of the two attention wrappers -> (Hk, D)."""
    check(op, "q", q, ndim=3, dtypes=FLOAT_DTYPES, unit_last_stride=True)
    _, hk, d = check_kv_cache(op, k_cache, v_cache, q.device)
    if q.shape[2] != d:
        fail(op, f"q head_dim {q.shape[2]} != cache head_dim {d}")
    if hk == 0 or q.shape[1] % hk:
        fail(op, f"query heads ({q.shape[1]}) must be a multiple of KV heads ({hk})")
    if k_cache.dtype != torch.int8 and k_cache.dtype != q.dtype:
        fail(op, f"cache dtype {k_cache.dtype} must equal q dtype {q.dtype} (or be int8)")
    check_int8_scales(op, k_cache, k_scale, "k_scale")
    check_int8_scales(op, v_cache, v_scale, "v_scale")
    check(op, "block_tables", block_tables, ndim=2, dtypes=(torch.int32,), device=q.device,
          contiguous=True)
    check(op, "context_lens", context_lens, shape=(block_tables.shape[0],), dtypes=(torch.int32,),
          device=q.device, contiguous=True)
    return hk, d


def paged_decode_attention(
    q: torch.Tensor,  # [B, Hq, D]: one new token per sequence
    k_cache: torch.Tensor,  # [num_blocks, block_size, Hk, D] float or int8
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,  # [B, max_blocks] int32 physical block ids
    context_lens: torch.Tensor,  # [B] int32 tokens in the cache (incl. the new one)
    scale: float,
    k_scale: torch.Tensor | None = None,  # [num_blocks, block_size, Hk] f32 for int8
    v_scale: torch.Tensor | None = None,
    return_scores: bool = False,
    *,
    partition_size: int | None = None,
    impl: Impl = "auto",
    window: int | None = None,
    softcap: float | None = None,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor | DecodeAttentionResult:
    """Decode attention over a paged KV cache (GQA, variable lengths, split-K).

    With ``return_scores`` returns :class:`DecodeAttentionResult`: per-token
    probability mass summed over each KV head's query heads (for H2O) and its
    per-block max (for Quest-style block selection). ``context_lens`` must not
    exceed ``max_blocks * block_size`` (not checked on CUDA: it would sync).
    ``window`` (only the last ``window`` keys: sliding-window layers),
    ``softcap`` (logits ``cap * tanh(logits / cap)``: Gemma 2) and ``sinks``
    (``[Hq]`` float, one more logit per head in the softmax's denominator whose
    column is dropped: gpt-oss) run the torch reference: the Triton kernel has
    none of them yet (correct on CUDA, not fast).
    """
    op = "paged_decode_attention"
    hk, _ = _check_paged(op, q, k_cache, v_cache, block_tables, context_lens, k_scale, v_scale)
    _check_sinks(op, sinks, q)
    if q.shape[0] != block_tables.shape[0]:
        fail(op, f"q has {q.shape[0]} sequences but block_tables has {block_tables.shape[0]}")
    part = DEFAULT_PARTITION_SIZE if partition_size is None else partition_size
    if part < 16 or part & (part - 1):
        fail(op, f"partition_size must be a power of two >= 16, got {part}")
    block_size = k_cache.shape[1]
    if not use_triton(impl, q.device, op) or window is not None or softcap is not None or sinks is not None:
        cap = block_tables.shape[1] * block_size
        if context_lens.numel() and int(context_lens.max()) > cap:
            fail(op, f"a context length exceeds the block table capacity ({cap} tokens)")
        result = ref.paged_decode_attention_ref(
            q, k_cache, v_cache, block_tables, context_lens, scale, k_scale, v_scale, return_scores, window, softcap,
            sinks,
        )
        return DecodeAttentionResult(*result) if return_scores else result
    out, lse, logits = triton_module("triton_attention").paged_decode_attention(
        q, k_cache, v_cache, block_tables, context_lens, scale, k_scale, v_scale,
        return_scores, part,
    )
    if not return_scores:
        return out
    mass = _token_mass(logits, lse, context_lens, hk)
    return DecodeAttentionResult(out, mass, ref.block_max_from_token_mass(mass, block_size))


def _check_sinks(op: str, sinks: torch.Tensor | None, q: torch.Tensor) -> None:
    """Attention sinks are one float logit per query head, on q's device."""
    if sinks is not None:
        check(op, "sinks", sinks, shape=(q.shape[1],), dtypes=FLOAT_DTYPES, device=q.device)


def _token_mass(logits: torch.Tensor, lse: torch.Tensor, lens: torch.Tensor, hk: int) -> torch.Tensor:
    """logits [B, Hq, C], lse [B, Hq] -> probability mass [B, Hk, C], 0 past lengths."""
    b, hq, cap = logits.shape
    valid = torch.arange(cap, device=logits.device)[None, :] < lens[:, None].long()  # [B, C]
    probs = torch.exp(logits - lse[:, :, None])
    probs = torch.where(valid[:, None, :], probs, torch.zeros((), device=logits.device))
    return probs.view(b, hk, hq // hk, cap).sum(dim=2)


def paged_prefill_attention(
    q: torch.Tensor,  # [T, Hq, D]: new tokens of all sequences, concatenated
    k_cache: torch.Tensor,  # [num_blocks, block_size, Hk, D], new tokens already stored
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,  # [B, max_blocks] int32
    context_lens: torch.Tensor,  # [B] int32: cached prefix + new tokens
    query_start_loc: torch.Tensor,  # [B + 1] int32/int64: new tokens of seq b are q[s[b]:s[b+1]]
    scale: float,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
    *,
    impl: Impl = "auto",
    window: int | None = None,
    softcap: float | None = None,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:  # [T, Hq, D]
    """Causal attention of new tokens over cached prefix + themselves (``window``, ``softcap``, ``sinks``: as
    in :func:`paged_decode_attention`).

    Torch only for now (gather + ``scaled_dot_product_attention`` per
    sequence, on whatever device the tensors live); ``impl='triton'`` raises.
    """
    op = "paged_prefill_attention"
    _check_paged(op, q, k_cache, v_cache, block_tables, context_lens, k_scale, v_scale)
    check(op, "query_start_loc", query_start_loc, shape=(block_tables.shape[0] + 1,),
          dtypes=(torch.int32, torch.int64), device=q.device)
    _check_sinks(op, sinks, q)
    if impl == "triton":
        fail(op, "there is no Triton prefill kernel yet; use impl='auto' or 'reference'")
    use_triton(impl, q.device, op)  # validates the impl string
    starts = query_start_loc.long()
    qlens = starts[1:] - starts[:-1]
    if int(starts[0]) != 0 or int(starts[-1]) != q.shape[0] or bool((qlens < 0).any()):
        fail(op, f"query_start_loc must rise from 0 to T={q.shape[0]}")
    if bool((qlens > context_lens.long()).any()):
        fail(op, "a sequence has more new tokens than its context length")
    return ref.paged_prefill_attention_ref(
        q, k_cache, v_cache, block_tables, context_lens, query_start_loc, scale, k_scale, v_scale, window, softcap,
        sinks,
    )
