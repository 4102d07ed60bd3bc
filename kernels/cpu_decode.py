"""CPU RMSNorm, silu * mul, RoPE and decode attention on bfloat16 or float32 rows: one C call each (``cpu_decode.c``).

Each replaces a handful of small torch ops whose dispatch dominated a decode step outside the GEMVs
(docs/benchmarks.md). Every CPU bf16 / float32 computation of these ops goes through here
(``kernels.rms_norm``, ``kernels.rope``, the decoder's norms and MLP, the CPU attention backend) and the
fused decode layers run the same row code, so resident, streamed and fused paths give the same bits.
The ``*_def`` functions are the torch definitions: RMSNorm and RoPE bit for bit, silu * mul and the
attention up to the C exp (``cpu_ops.h``, the same bits on every ISA build) against ``torch.exp``
(tests/test_cpu_decode.py). Without the C kernel (no compiler, ``LLMSYS_NO_CKERNELS=1``) they run instead.
"""

from __future__ import annotations

import ctypes

import torch

from llmsys.kernels import _cbuild

LANES = 16  # float32 accumulator lanes of the C reductions
_SOURCE = _cbuild.KERNELS  # the one kernel library (every module's functions)
_P, _I, _F = ctypes.c_void_p, ctypes.c_int64, ctypes.c_float
_SIGNATURES = {
    "llmsys_rms_norm": [_P, _P, _P, _P, _P, _I, _I, _F, ctypes.c_int, ctypes.c_int],
    "llmsys_silu_mul": [_P, _I, _P, _I, _P, _I, _I, ctypes.c_int, ctypes.c_int],
    "llmsys_clamped_swiglu": [_P, _I, _P, _I, _P, _I, _I, _F, _F, ctypes.c_int, ctypes.c_int],
    "llmsys_rope": [_P, _I, _P, _I, _P, _P, _P, _P, _I, _I, _I, _I, _I, ctypes.c_int],
    "llmsys_rope_store": [_P, _I, _P, _I, _P, _I, _P, _P, _P, _P, _I, _P, _P, _I, _I, _I, _I, _I, ctypes.c_int],
    "llmsys_decode_attention": [_P, _P, _P, _P, _P, _F, _P, _I, _I, _I, _I, _I, ctypes.c_int, ctypes.c_int],
    "llmsys_rows_attention": [_P, _P, _P, _P, _P, _P, _P, _F, _P, _I, _I, _I, _I, _I, ctypes.c_int, ctypes.c_int],
    "llmsys_rope_store_attend_bf16": [_P, _I, _P, _P, _P, _I, _P, _P, _I, _I, _I, _I, _I, _P, _P, _I, _F, _P,
                                      ctypes.c_int],
    "llmsys_rope_store_attend_f32": [_P, _I, _P, _P, _P, _I, _P, _P, _I, _I, _I, _I, _I, _P, _P, _I, _F, _P,
                                     ctypes.c_int],
}
DTYPES = (torch.bfloat16, torch.float32)  # the activations' dtypes the kernels take


_KERNEL = _cbuild.Kernel(_SOURCE, _SIGNATURES)  # loaded (built if need be) at the CPU's ISA level, once per process
kernel_status = _KERNEL.status  # "ok: <path>" when the C kernel is loaded, else why not
available = _KERNEL.available


def applies(x: torch.Tensor, *others: torch.Tensor | None) -> bool:
    """Do this module's kernels handle ``x`` (a CPU bfloat16 or float32 tensor) and ``others`` (the op's
    other inputs)? Not when autograd must record the op (the C kernels have no backward: quantization's
    refinement trains through the float32 decoder)."""
    return (x.dtype in DTYPES and x.device.type == "cpu"
            and not (torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in (x, *others))))


# ------------------------------------------------------------------ definitions


def lane_sum(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:  # [..., n] f32 x2 -> [...]
    """``sum(x * y)`` over the last dim in the C kernels' order (16 lanes in order, then a tree)."""
    n = x.shape[-1]
    pad = -n % LANES
    if pad:
        x = torch.nn.functional.pad(x, (0, pad))
        y = torch.nn.functional.pad(y, (0, pad))
    xs, ys = x.unflatten(-1, (-1, LANES)), y.unflatten(-1, (-1, LANES))
    acc = torch.zeros(xs.shape[:-2] + (LANES,), dtype=torch.float32)
    for c in range(xs.shape[-2]):
        acc = acc + xs[..., c, :] * ys[..., c, :]
    while acc.shape[-1] > 1:
        w = acc.shape[-1] // 2
        acc = acc[..., :w] + acc[..., w:]
    return acc[..., 0]


def rms_norm_def(x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None):
    """The C RMSNorm in torch ops: HF's roundings (none for float32), the sum of squares in lane order."""
    dt = x.dtype
    h = x if residual is None else (x.float() + residual.float()).to(dt)
    hf = h.float()
    ms = lane_sum(hf, hf) / hf.shape[-1]
    # the C's correctly rounded float sqrtf and 1.0f / s, through double (exact once rounded: 53 >= 2 * 24 + 2);
    # torch's float32 sqrt and scalar-over-tensor division were an ulp off for a few rows on AVX-512
    s = torch.sqrt((ms + torch.tensor(eps, dtype=torch.float32)).double()).float()
    r = (1.0 / s.double()).float()
    out = (weight.float() * (hf * r.unsqueeze(-1)).to(dt).float()).to(dt)
    return out if residual is None else (out, h)


def silu_mul_def(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """The C silu * mul in torch ops (``torch.exp`` for ``cpu_ops.h``'s exp): ``bf16(bf16(g / (1 + exp(-g))) * u)``
    (float32: no roundings)."""
    g = gate.float()
    s = (g / (1.0 + torch.exp(-g))).to(gate.dtype)
    return (s.float() * up.float()).to(gate.dtype)


def clamped_swiglu_def(gate: torch.Tensor, up: torch.Tensor, alpha: float, limit: float) -> torch.Tensor:
    """The C clamped SwiGLU in torch ops (``torch.exp`` in the sigmoid for ``cpu_ops.h``'s exp): gpt-oss's
    ``(clamp(up) + 1) * (g * sigmoid(g * alpha))`` with ``g = min(gate, limit)``, rounded to the dtype after each op."""
    g = gate.clamp(max=limit)
    return (up.clamp(min=-limit, max=limit) + 1) * (g * torch.sigmoid(g * alpha))


def decode_attention_def(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, lens: torch.Tensor,
                         scale: float) -> torch.Tensor:
    """The C decode attention in torch ops (``torch.exp`` for ``cpu_ops.h``'s exp): ``q [B, Hq, D]``, ``k, v [B, L, Hk, D]``."""
    B, Hq, D = q.shape
    Hk = k.shape[2]
    out = torch.empty(B, Hq, D, dtype=q.dtype)
    for b in range(B):
        n = int(lens[b])
        kb = k[b, :n].float().transpose(0, 1).repeat_interleave(Hq // Hk, dim=0)  # [Hq, n, D]
        vb = v[b, :n].float().transpose(0, 1).repeat_interleave(Hq // Hk, dim=0)
        s = lane_sum(q[b].float().unsqueeze(1).expand(-1, n, -1), kb) * scale  # [Hq, n]
        e = torch.exp(s - s.max(dim=-1, keepdim=True).values)
        z = torch.zeros(Hq)
        for i in range(n):
            z = z + e[:, i]
        p = e / z.unsqueeze(-1)
        acc = torch.zeros(Hq, D)
        for i in range(n):
            acc = acc + p[:, i : i + 1] * vb[:, i]
        out[b] = acc.to(q.dtype)
    return out


# ------------------------------------------------------------------ kernels


def _ptr(t: torch.Tensor | None) -> int | None:
    return None if t is None else t.data_ptr()


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None):
    """``x [..., D]`` bf16 or float32 contiguous, ``weight [D]`` and ``residual`` (like x) of its dtype:
    as :func:`rms_norm_def`."""
    lib = _KERNEL.lib()
    if lib is None:
        return rms_norm_def(x, weight, eps, residual)
    d = x.shape[-1]
    out = torch.empty_like(x)
    new_res = None if residual is None else torch.empty_like(x)
    rc = lib.llmsys_rms_norm(x.data_ptr(), _ptr(residual), weight.data_ptr(), out.data_ptr(), _ptr(new_res),
                             x.numel() // d, d, eps, int(x.dtype == torch.float32), torch.get_num_threads())
    if rc:
        raise RuntimeError(f"rms_norm: the C kernel rejected D={d}")
    return out if residual is None else (out, new_res)


def _glu_rows(op: str, gate: torch.Tensor, up: torch.Tensor) -> tuple[int, int]:
    """``(T, I)`` of a gate|up pair the C activation rows take (one bf16 or float32 dtype, unit column stride)."""
    if up.shape != gate.shape or gate.dim() != 2 or gate.stride(1) != 1 or up.stride(1) != 1 \
            or gate.dtype not in DTYPES or up.dtype != gate.dtype:
        raise ValueError(f"{op}: gate and up must be bf16 or float32 [T, I] of one dtype with unit column "
                         f"stride, got {gate.dtype} {tuple(gate.shape)}, {up.dtype} {tuple(up.shape)}")
    return gate.shape[0], gate.shape[1]


def silu_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """SwiGLU's ``silu(gate) * up``: ``[T, I]`` bf16 or float32 each (rows may be strided, e.g. the halves of one
    gate|up output) ``-> [T, I]`` contiguous, as :func:`silu_mul_def` (up to the exp). Why C: the fused
    a8 decode layers (``cpu_qgemv.mlp_a8``) compute it with the same row code, so a layer run op by op
    and fused agree bit for bit; torch's bf16 ``F.silu`` rounds its exp differently."""
    lib = _KERNEL.lib()
    if lib is None:
        return silu_mul_def(gate, up)
    t, inter = _glu_rows("silu_mul", gate, up)
    y = torch.empty(t, inter, dtype=gate.dtype)
    if lib.llmsys_silu_mul(gate.data_ptr(), gate.stride(0), up.data_ptr(), up.stride(0), y.data_ptr(), t, inter,
                           int(gate.dtype == torch.float32), torch.get_num_threads()):
        raise ValueError(f"silu_mul: the C kernel rejected I={inter} with row strides {gate.stride(0)}, {up.stride(0)}")
    return y


def clamped_swiglu(gate: torch.Tensor, up: torch.Tensor, alpha: float, limit: float) -> torch.Tensor:
    """gpt-oss's expert activation ``[T, I], [T, I] -> [T, I]`` contiguous (bf16 or float32 of one dtype, unit
    column stride): transformers' bf16 torch ops in their order (``engine.models.base.clamped_swiglu``) with
    ``cpu_ops.h``'s exp in the sigmoid. Why C: the grouped expert kernel computes it with the same row code, so
    gpt-oss's experts give the same bits one by one or grouped."""
    lib = _KERNEL.lib()
    if lib is None:
        return clamped_swiglu_def(gate, up, alpha, limit)
    t, inter = _glu_rows("clamped_swiglu", gate, up)
    y = torch.empty(t, inter, dtype=gate.dtype)
    if lib.llmsys_clamped_swiglu(gate.data_ptr(), gate.stride(0), up.data_ptr(), up.stride(0),
                                                y.data_ptr(), t, inter, alpha, limit,
                                                int(gate.dtype == torch.float32), torch.get_num_threads()):
        raise ValueError(f"clamped_swiglu: the C kernel rejected I={inter} with row strides {gate.stride(0)}, "
                         f"{up.stride(0)}")
    return y


def rope(q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor, cos_sin_cache: torch.Tensor):
    """``q [T, Hq, D]``, ``k [T, Hk, D]`` bf16 or float32 (one dtype; rows may be strided) -> new contiguous (q, k).

    Bit for bit ``kernels.reference.rope_ref``; positions must lie in the cache.
    """
    lib = _KERNEL.lib()
    if lib is None:
        from llmsys.kernels.reference import rope_ref

        return rope_ref(q, k, positions, cos_sin_cache)
    T, hq, d = q.shape
    hk = k.shape[1]
    for t in (q, k):
        if t.stride(2) != 1 or t.stride(1) != d:
            raise ValueError(f"rope: heads of q and k must be contiguous, got strides {t.stride()}")
    qo, ko = torch.empty(T, hq, d, dtype=q.dtype), torch.empty(T, hk, d, dtype=k.dtype)
    if k.dtype != q.dtype:
        raise ValueError(f"rope: q and k must share a dtype, got {q.dtype} and {k.dtype}")
    rc = lib.llmsys_rope(q.data_ptr(), q.stride(0), k.data_ptr(), k.stride(0), qo.data_ptr(), ko.data_ptr(),
                         positions.data_ptr(), cos_sin_cache.data_ptr(), cos_sin_cache.shape[0], T, hq, hk, d,
                         int(q.dtype == torch.float32))
    if rc == 2:
        raise ValueError(f"rope: a position lies outside the cos/sin cache (0..{cos_sin_cache.shape[0] - 1})")
    if rc:
        raise ValueError(f"rope: head_dim must be even, got {d}")
    return qo, ko


def rope_store(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, positions: torch.Tensor,
               cos_sin_cache: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor,
               slots: torch.Tensor) -> torch.Tensor:
    """:func:`rope` with k and v stored into the pools (``[num_slots, Hk, D]``) at ``slots [T]`` -> roped q.

    The same bits as ``rope`` then ``kernels.kv_store``; slot -1 skips a token.
    Needs the C kernel (callers check :func:`available`).
    """
    lib = _KERNEL.lib()
    T, hq, d = q.shape
    hk = k.shape[1]
    for t in (q, k, v):
        if t.stride(2) != 1 or t.stride(1) != d:
            raise ValueError(f"rope_store: heads of q, k and v must be contiguous, got strides {t.stride()}")
    qo = torch.empty(T, hq, d, dtype=q.dtype)
    if not (q.dtype == k.dtype == v.dtype == k_pool.dtype == v_pool.dtype):
        raise ValueError(f"rope_store: q, k, v and the pools must share a dtype, got {q.dtype}, {k.dtype}, "
                         f"{v.dtype}, {k_pool.dtype}, {v_pool.dtype}")
    rc = lib.llmsys_rope_store(
        q.data_ptr(), q.stride(0), k.data_ptr(), k.stride(0), v.data_ptr(), v.stride(0), qo.data_ptr(),
        k_pool.data_ptr(), v_pool.data_ptr(), slots.data_ptr(), k_pool.shape[0], positions.data_ptr(),
        cos_sin_cache.data_ptr(), cos_sin_cache.shape[0], T, hq, hk, d, int(q.dtype == torch.float32))
    if rc:
        raise ValueError(f"rope_store: odd head_dim {d}, or a position or slot outside its table (code {rc})")
    return qo


def _by_slot(k: torch.Tensor, v: torch.Tensor, slots: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """The pools ``[num_slots, Hk, D]`` gathered by ``slots [S, L]`` into ``[S, L, Hk, D]`` (the definitions'
    layout); ``k, v`` as they are when ``slots`` is None."""
    if slots is None:
        return k, v
    return tuple(c.view(-1, c.shape[-2], c.shape[-1])[slots.view(-1)].view(*slots.shape, *c.shape[-2:])
                 for c in (k, v))


def decode_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, lens: torch.Tensor,
                     scale: float, slots: torch.Tensor | None = None) -> torch.Tensor:
    """One query per sequence over its context: ``q [B, Hq, D]``; ``k, v [B, L, Hk, D]`` gathered rows,
    or with ``slots [B, L]`` (int64, padding any valid slot) the pools ``[num_slots, Hk, D]`` themselves;
    all bf16 or all float32, contiguous; ``lens [B]`` int64 (1..L) -> ``[B, Hq, D]`` in q's dtype
    (as :func:`decode_attention_def`)."""
    lib = _KERNEL.lib()
    if lib is None:
        k, v = _by_slot(k, v, slots)
        return decode_attention_def(q, k, v, lens, scale)
    B, hq, d = q.shape
    L = k.shape[1] if slots is None else slots.shape[1]
    hk = k.shape[-2]
    if not (q.dtype == k.dtype == v.dtype) or q.dtype not in (torch.bfloat16, torch.float32):
        raise ValueError(f"decode_attention: q, k, v must all be bfloat16 or all float32, got {q.dtype}, {k.dtype}, {v.dtype}")
    out = torch.empty(B, hq, d, dtype=q.dtype)
    rc = lib.llmsys_decode_attention(q.data_ptr(), k.data_ptr(), v.data_ptr(), _ptr(slots), lens.data_ptr(), scale,
                                     out.data_ptr(), B, L, hq, hk, d, int(q.dtype == torch.float32),
                                     torch.get_num_threads())
    if rc:
        raise ValueError(f"decode_attention: bad shapes (Hq={hq}, Hk={hk}, D={d}) or lengths outside 1..{L}")
    return out


def rows_attention_def(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, seq: torch.Tensor, first: torch.Tensor,
                       lens: torch.Tensor, scale: float) -> torch.Tensor:
    """:func:`rows_attention` in torch ops: row ``t`` is :func:`decode_attention_def` of ``q[t]`` over keys
    ``first[t] .. lens[t] - 1`` of sequence ``seq[t]`` (``k, v [S, L, Hk, D]`` gathered)."""
    out = torch.empty_like(q)
    for t in range(q.shape[0]):
        s, f, n = int(seq[t]), int(first[t]), int(lens[t])
        out[t] = decode_attention_def(q[t : t + 1], k[s : s + 1, f:n], v[s : s + 1, f:n],
                                      torch.tensor([n - f]), scale)[0]
    return out


def rows_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, seq: torch.Tensor, lens: torch.Tensor,
                   scale: float, first: torch.Tensor | None = None, slots: torch.Tensor | None = None) -> torch.Tensor:
    """Tokens of any sequences, each as a decode step at its own position: ``q [T, Hq, D]``; ``k, v [S, L, Hk, D]``
    gathered, or with ``slots [S, L]`` the pools ``[num_slots, Hk, D]``; ``seq [T]`` each token's sequence,
    ``lens [T]`` its context length, ``first [T]`` its first key (a sliding window; None: 0), all int64
    -> ``[T, Hq, D]`` with the bits :func:`decode_attention` gives that token alone.

    Why: prompt attention by SDPA blocks its sums by the chunk's and the context's sizes, so a prompt token's
    bits changed with the chunking, a prefix-cache hit or (through them) the batch; this way every token of a
    prompt, a chunk or a decode step runs one arithmetic, a function of its query and its keys only."""
    first = torch.zeros_like(lens) if first is None else first
    lib = _KERNEL.lib()
    if lib is None:
        k, v = _by_slot(k, v, slots)
        return rows_attention_def(q, k, v, seq, first, lens, scale)
    T, hq, d = q.shape
    L = k.shape[1] if slots is None else slots.shape[1]
    hk = k.shape[-2]
    if not (q.dtype == k.dtype == v.dtype) or q.dtype not in (torch.bfloat16, torch.float32):
        raise ValueError(f"rows_attention: q, k, v must all be bfloat16 or all float32, got {q.dtype}, {k.dtype}, {v.dtype}")
    out = torch.empty(T, hq, d, dtype=q.dtype)
    rc = lib.llmsys_rows_attention(q.data_ptr(), k.data_ptr(), v.data_ptr(), _ptr(slots), seq.data_ptr(),
                                   first.data_ptr(), lens.data_ptr(), scale, out.data_ptr(), T, L, hq, hk, d,
                                   int(q.dtype == torch.float32), torch.get_num_threads())
    if rc == 3:
        raise MemoryError(f"rows_attention: no memory for the scratch of {T} tokens over up to {L} keys")
    if rc:
        raise ValueError(f"rows_attention: bad shapes (Hq={hq}, Hk={hk}, D={d}) or key ranges outside 0..{L}")
    return out


def rope_store_attend(qkv: torch.Tensor, hq: int, hk: int, positions: torch.Tensor, cos_sin_cache: torch.Tensor,
                      k_pool: torch.Tensor, v_pool: torch.Tensor, slots: torch.Tensor, lens: torch.Tensor,
                      scale: float, gather_slots: torch.Tensor) -> torch.Tensor:
    """A decode step's attention from its q|k|v projection in one C call: ``qkv [T, (Hq + 2 Hk) D]`` bf16 or
    float32 as the pools (unit column stride) -> :func:`rope_store` (k, v into the pools ``[num_slots, Hk, D]`` at ``slots [T]``)
    then :func:`decode_attention` (``gather_slots [T, L]``, ``lens [T]``) ``-> [T, Hq * D]``, their bits.
    Needs the C kernel (callers check :func:`available`); the pools, slots and lengths are the caller's
    own validated tensors (the CPU attention backend's)."""
    t = qkv.shape[0]
    d = qkv.shape[1] // (hq + 2 * hk)
    out = torch.empty(t, hq * d, dtype=qkv.dtype)
    lib = _KERNEL.lib()
    fn = lib.llmsys_rope_store_attend_f32 if qkv.dtype == torch.float32 else lib.llmsys_rope_store_attend_bf16
    rc = fn(
        qkv.data_ptr(), qkv.stride(0), k_pool.data_ptr(), v_pool.data_ptr(), slots.data_ptr(), k_pool.shape[0],
        positions.data_ptr(), cos_sin_cache.data_ptr(), cos_sin_cache.shape[0], t, hq, hk, d,
        gather_slots.data_ptr(), lens.data_ptr(), gather_slots.shape[1], scale, out.data_ptr(),
        torch.get_num_threads())
    if rc:
        raise ValueError(f"rope_store_attend: odd head_dim {d}, a position or slot outside its table, or lengths "
                         f"outside 1..{gather_slots.shape[1]} (code {rc})")
    return out
