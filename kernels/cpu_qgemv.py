"""CPU GEMVs on quantized weights with x quantized to int8 ("a8"), the bf16 / float32 GEMVs, the bf16 GEMM and
the fused decode layers and stack (``a8_gemv.c``, ``dense_gemv.c``, ``fused_layer.c``, ``decode_stack.c``).

At M = 1 torch's ``_weight_int8pack_mm`` / ``_weight_int4pack_mm_for_cpu`` read weights far below memory
speed; these read each weight byte once at memory speed. The ``*_def`` functions are the torch definitions,
equal to the C kernels bit for bit (tests/test_cpu_qgemv.py). a8 (``int8_gemv_a8``, ``int4_gemv_a8``: every
row of a quantized layer, prompt and decode): x to int8 per 32 columns (:func:`quantize_a8`), exact integer
dots per block, then ``f += float(S_b) * d_b`` (int8; ``bf16(f * scale)`` at the end) or ``f += float(S_b -
zero * sum(codes_b)) * (scale * d_b)`` (int4) in block order, like llama.cpp's q8_0 activations (AVX512-VNNI:
``vpdpbusd``, the same bits), at the price of x's int8 rounding (benchmarks/bench_a8_quality.py). bf16 /
float32: 16 float32 lanes in order, then the lanes' tree. Each output depends only on its row of x and its
weight row: batch-invariant at any M, N and thread count. Without the C kernels :func:`available` is False.
"""

from __future__ import annotations

import ctypes
import enum
from dataclasses import dataclass

import torch

from llmsys.kernels import _cbuild
from llmsys.kernels.cpu_decode import lane_sum
from llmsys.kernels.cpu_int4 import CPU_BLOCK_N, check_int4_layout, unpack_cpu_int4

_SOURCE = _cbuild.KERNELS  # the one kernel library (every module's functions)
_P, _I, _C = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int
_SIGNATURES = {
    "llmsys_qgemv_int8_a8": [_P, _I, _P, _P, _P, _I, _I, _I, _I, _C],
    "llmsys_qgemv_int8g_a8": [_P, _I, _P, _P, _P, _I, _I, _I, _I, _C],
    "llmsys_qgemv_int8h_a8": [_P, _I, _P, _P, _P, _P, _I, _I, _I, _I, _C],
    "llmsys_qgemv_int8o_a8": [_P, _I, _P, _P, _P, _P, _I, _I, _I, _I, _C],
    "llmsys_qgemv_int4_a8": [_P, _I, _P, _P, _I, _I, _C, _P, _I, _I, _P, _I, _I, _I, _I, _I, _I, _C],
    "llmsys_qgemv_int4o_a8": [_P, _I, _P, _P, _I, _I, _C, _P, _I, _I, _P, _I, _I, _P, _I, _I, _I, _I, _I, _I, _C],
    "llmsys_qgemv_int4k_a8": [_P, _I, _P, _P, _P, _P, _P, _I, _P, _I, _I, _I, _I, _I, _C],
    # the a8 GEMVs and the bf16 GEMV with ``io`` last (_io_flags: float32 x, float32 out)
    "llmsys_qgemv_int8_a8_io": [_P, _I, _P, _P, _P, _I, _I, _I, _I, _C, _C],
    "llmsys_qgemv_int8g_a8_io": [_P, _I, _P, _P, _P, _I, _I, _I, _I, _C, _C],
    "llmsys_qgemv_int8h_a8_io": [_P, _I, _P, _P, _P, _P, _I, _I, _I, _I, _C, _C],
    "llmsys_qgemv_int8o_a8_io": [_P, _I, _P, _P, _P, _P, _I, _I, _I, _I, _C, _C],
    "llmsys_qgemv_int4_a8_io": [_P, _I, _P, _P, _I, _I, _C, _P, _I, _I, _P, _I, _I, _I, _I, _I, _I, _C, _C],
    "llmsys_qgemv_int4o_a8_io": [_P, _I, _P, _P, _I, _I, _C, _P, _I, _I, _P, _I, _I, _P, _I, _I, _I, _I, _I, _I, _C, _C],
    "llmsys_qgemv_int4k_a8_io": [_P, _I, _P, _P, _P, _P, _P, _I, _P, _I, _I, _I, _I, _I, _C, _C],
    "llmsys_gemv_bf16_io": [_P, _I, _P, _I, _P, _I, _I, _I, _I, _C, _C],
    "llmsys_gemv_bf16": [_P, _I, _P, _I, _P, _I, _I, _I, _I, _C],
    "llmsys_gemm_bf16": [_P, _I, _P, _I, _P, _P, _I, _I, _I, _I, _C],
    "llmsys_gemm_bf16_native": [],
    "llmsys_gemv_f32": [_P, _I, _P, _I, _P, _I, _I, _I, _I, _C],
    "llmsys_layer_attn_in": [_P, _P, _P, _P, _P, _I, _C],
    "llmsys_layer_mlp": [_P, _P, _P, _P, _P, _I, _C],
    "llmsys_layer_post_attn": [_P, _P, _P, _P, _P, _I, _C],
    "llmsys_decode_stack": [_P, _P, _P, _P, _I, _C],
}
A8_BLOCK = 32  # columns of x per int8 block in the a8 GEMVs
_IO_X_F32, _IO_OUT_F32 = 1, 2  # gemv_common.h's io flags
_OUT_DTYPES = (torch.bfloat16, torch.float32)


def _io_flags(op: str, x: torch.Tensor, out_dtype: torch.dtype, x_f32: bool = True) -> int:
    """The ``io`` argument of the ``*_io`` C entry points: x float32 (where ``x_f32``: the a8 GEMVs quantize it
    as it is) and out float32, unrounded (the LM head's logits), else bf16."""
    if out_dtype not in _OUT_DTYPES:
        raise ValueError(f"{op}: out_dtype must be torch.bfloat16 or torch.float32, got {out_dtype}")
    return (_IO_X_F32 if x_f32 and x.dtype == torch.float32 else 0) | (_IO_OUT_F32 if out_dtype == torch.float32 else 0)


def _out(f: torch.Tensor, out_dtype: torch.dtype) -> torch.Tensor:
    """A definition's float32 sums as the kernel leaves them: rounded once to bf16, or float32 as summed."""
    return f if out_dtype == torch.float32 else f.to(torch.bfloat16)
class ScaleKind(enum.IntEnum):
    """How int4 group scales are stored (``enum scale_kind`` in gemv_common.h): read in place, never copied."""

    BF16 = 0
    F32 = 1
    F16 = 2


_SCALE_KINDS = {torch.bfloat16: ScaleKind.BF16, torch.float32: ScaleKind.F32, torch.float16: ScaleKind.F16}


_KERNEL = _cbuild.Kernel(_SOURCE, _SIGNATURES)  # loaded (built if need be) at the CPU's ISA level, once per process
kernel_status = _KERNEL.status  # "ok: <path>" when the C kernel is loaded, else why not
available = _KERNEL.available


# ------------------------------------------------------------------ definitions


def quantize_a8(x: torch.Tensor, kp: int | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``x [M, K]`` -> the a8 GEMVs' int8 blocks: codes ``[M, nb, 32]`` int8, scales ``d [M, nb]`` float32 and
    code sums ``[M, nb]`` int64, over ``kp`` columns (default K rounded up to 32; zero past K).

    Per block: ``d = amax|x| / 127``, ``codes = round-half-even(x * (1 / d))`` (0 where d is 0; NaN x
    count as 0 in amax and give code 0), as ``a8_gemv.c``'s ``a8_quantize``.
    """
    m, k = x.shape
    kp = kp or -(-k // A8_BLOCK) * A8_BLOCK
    xb = torch.nn.functional.pad(x.float(), (0, kp - k)).view(m, -1, A8_BLOCK)  # [M, nb, 32]
    ax = xb.abs()
    d = torch.where(ax.isnan(), 0.0, ax).amax(-1) / 127.0  # [M, nb]
    inv = torch.where(d != 0, 1.0 / d, 0.0)
    r = torch.round(xb * inv[..., None]).clamp(-127, 127)
    q = torch.where(r.isnan(), 0.0, r).to(torch.int8)
    return q, d, q.long().sum(-1)


def _block_dots(qx: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """codes ``[M, nb, 32]`` and integer weights ``[N, nb * 32]`` -> exact sums ``[M, N, nb]`` (int64)."""
    wb = w.long().view(w.shape[0], -1, A8_BLOCK)  # [N, nb, 32]
    return torch.einsum("mbc,nbc->mnb", qx.long(), wb)


def int8_a8_def(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor,
                out_dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """``x [M, K]`` bf16 (or float32), ``qweight int8 [N, K]``, ``scales [N]`` bf16 ``-> [M, N]`` bf16 (or float32,
    unrounded: ``out_dtype``), :func:`int8_gemv_a8`'s bits.

    ``out = bf16(f * scale)``, ``f`` summing ``float(S_b) * d_b`` over x's 32-column blocks in order
    (``S_b`` the block's exact integer dot product, products rounded, then added).
    """
    qx, d, _ = quantize_a8(x)
    w = torch.nn.functional.pad(qweight, (0, qx.shape[1] * A8_BLOCK - qweight.shape[1]))
    s = _block_dots(qx, w)  # [M, N, nb]
    f = torch.zeros(s.shape[:2])
    for b in range(s.shape[2]):
        f = f + s[..., b].float() * d[:, None, b]
    return _out(f * scales.float(), out_dtype)


def int8g_a8_def(x: torch.Tensor, qweight: torch.Tensor, block_scales: torch.Tensor,
                 offsets: torch.Tensor | None = None, super_scales: torch.Tensor | None = None,
                 out_dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """``x [M, K]`` bf16, ``qweight int8 [N, K]``, ``block_scales`` fp16 ``[nb, N]`` (a scale per 32 columns,
    group-major: GGUF Q8_0's) ``-> [M, N]`` bf16, :func:`int8g_gemv_a8`'s bits. Or GGUF Q6_K's scales as stored:
    ``block_scales`` int8 ``[K / 16, N]`` and ``super_scales`` fp16 ``[K / 256, N]``, a scale per 16 columns
    ``h = d * sc`` (float32, K a multiple of 256).

    ``out = bf16(f)``, ``f`` summing ``float(S_b) * (scale_b * d_b)`` over x's 32-column blocks in order,
    as the int4 a8 GEMV does with its group scales; with a scale per 16 columns each block adds
    ``float(S_lo) * (h_2b * d_b) + float(S_hi) * (h_2b+1 * d_b)`` (its two halves' exact dots).
    With ``offsets`` (float32 ``[K / 32, N]`` beside float32 scales of that shape, ``w = q * scale + offset``:
    GGUF Q5_K) each block adds ``float(S_b) * (scale_b * d_b) + float(sum(codes_b)) * (offset_b * d_b)``.
    """
    qx, d, sx = quantize_a8(x)
    w = torch.nn.functional.pad(qweight, (0, qx.shape[1] * A8_BLOCK - qweight.shape[1]))
    bs = block_scales.float()  # [nb, N] or [2 nb, N]
    if offsets is not None:
        s = _block_dots(qx, w)  # [M, N, nb]
        f = torch.zeros(s.shape[:2])
        for b in range(s.shape[2]):
            f = f + (s[..., b].float() * (bs[None, b, :] * d[:, b, None])
                     + sx[:, b, None].float() * (offsets[None, b, :].float() * d[:, b, None]))
        return _out(f, out_dtype)
    if super_scales is not None:  # halves: 16-column blocks of codes against each half of x's block
        bs = super_scales.float().repeat_interleave(16, 0) * bs  # [K / 16, N] float32: d * sc
        wh = w.long().view(w.shape[0], -1, 2, A8_BLOCK // 2)  # [N, nb, 2, 16]
        sh = torch.einsum("mbhc,nbhc->mnbh", qx.long().view(qx.shape[0], -1, 2, A8_BLOCK // 2), wh)
        f = torch.zeros(sh.shape[:2])
        for b in range(sh.shape[2]):
            f = f + (sh[..., b, 0].float() * (bs[None, 2 * b, :] * d[:, b, None])
                     + sh[..., b, 1].float() * (bs[None, 2 * b + 1, :] * d[:, b, None]))
        return _out(f, out_dtype)
    s = _block_dots(qx, w)  # [M, N, nb]
    f = torch.zeros(s.shape[:2])
    for b in range(s.shape[2]):
        f = f + s[..., b].float() * (bs[None, b, :] * d[:, b, None])
    return _out(f, out_dtype)


def int4_a8_def(x: torch.Tensor, packed: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor,
                group_size: int, offsets: torch.Tensor | None = None,
                out_dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """``x [M, K]`` bf16 (or float32) and an int4 weight in the CPU int4 tiling (``cpu_int4.pack_cpu_int4``:
    ``packed`` uint8 ``[Np/64, Kp, 32]`` bytes, ``scales [N, G]`` of any float dtype or torch's
    ``scales_zeros [G, Np, 2]``, ``zeros uint8 [N, G]``, ``Kp = G * group_size``) ``-> [M, N]`` bf16,
    :func:`int4_gemv_a8`'s bits.

    ``out = bf16(f)``, ``f`` summing ``float(S_b - zero_g * sum(codes_b)) * (scale_g * d_b)`` over x's
    32-column blocks in order (``S_b`` exact; ``g`` the block's group). With ``offsets`` (float32
    ``[N, G]``, ``w = scale * q + offset``: GGUF Q4_K / Q4_1) the zeros are not read and each block adds
    ``float(S_b) * (scale_g * d_b) + float(sum(codes_b)) * (offset_g * d_b)``.
    """
    n, n_groups = zeros.shape
    kp = n_groups * group_size
    np_ = -(-n // CPU_BLOCK_N) * CPU_BLOCK_N
    sc = _scales_2d(scales, n).float()
    q = unpack_cpu_int4(packed, np_, kp)[:n]  # [N, Kp] codes
    qx, d, sx = quantize_a8(x, kp)
    s = _block_dots(qx, q)  # [M, N, nb]
    per_g = group_size // A8_BLOCK
    f = torch.zeros(s.shape[:2])
    for b in range(s.shape[2]):
        g = b // per_g
        if offsets is not None:
            f = f + (s[..., b].float() * (sc[None, :, g] * d[:, b, None])
                     + sx[:, b, None].float() * (offsets[None, :, g].float() * d[:, b, None]))
            continue
        t = s[..., b] - zeros[:, g].long()[None, :] * sx[:, b, None]  # exact
        f = f + t.float() * (sc[None, :, g] * d[:, b, None])
    return _out(f, out_dtype)


def bf16_gemv_def(x: torch.Tensor, weight: torch.Tensor, out_dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """``x [M, K]`` and ``weight [N, K]`` bf16 ``-> [M, N]`` bf16, :func:`bf16_gemv`'s bits: each dot in
    16 float32 lanes in order, then the lanes' tree (``cpu_decode.lane_sum``), rounded once (float32
    ``out_dtype``: not rounded)."""
    return _out(lane_sum(x.float()[:, None, :], weight.float()[None, :, :]), out_dtype)


def f32_gemv_def(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """``x [M, K]`` and ``weight [N, K]`` float32 ``-> [M, N]`` float32, :func:`f32_gemv`'s bits: each dot in
    16 float32 lanes in order (each product rounded, then added), then the lanes' tree (``cpu_decode.lane_sum``)."""
    return lane_sum(x[:, None, :], weight[None, :, :])


def _scales_2d(scales: torch.Tensor, n: int) -> torch.Tensor:
    """``scales [N, G]``, or the ``[N, G]`` view of torch's ``scales_zeros [G, Np, 2]``."""
    return scales[:, :n, 0].t() if scales.dim() == 3 else scales


# ------------------------------------------------------------------ kernels


def _dname(dtype: torch.dtype) -> str:
    return "bf16" if dtype == torch.bfloat16 else "float32"


def _check_x(op: str, x: torch.Tensor, k: int, f32: bool = False) -> None:
    """x [M, k] on the CPU with unit column stride, bf16 (or float32 where ``f32``: the a8 GEMVs), else ValueError."""
    if (x.dtype != torch.bfloat16 and not (f32 and x.dtype == torch.float32)) or x.dim() != 2 or x.shape[1] != k \
            or x.stride(1) != 1 or x.device.type != "cpu":
        what = "bf16 or float32" if f32 else "bf16"
        raise ValueError(f"{op}: x must be a CPU {what} [M, {k}] tensor with unit column stride, "
                         f"got {x.dtype} {tuple(x.shape)} strides {x.stride()}")


def bf16_gemv(x: torch.Tensor, weight: torch.Tensor, *, out_dtype: torch.dtype = torch.bfloat16, check: bool = True,
              lib=None) -> torch.Tensor:
    """``x [M, K]`` bf16 times a plain bf16 ``weight [N, K]`` (unit column stride) ``-> [M, N]`` bf16, as
    :func:`bf16_gemv_def`: the decode GEMV of bf16 layers (``cpu_linear``); ``out_dtype`` float32: the sums
    unrounded (a bf16 LM head's logits, any M). ``check`` and ``lib`` as :func:`int8_gemv_a8`."""
    if out_dtype == torch.bfloat16:
        return _plain_gemv("bf16_gemv", "llmsys_gemv_bf16", torch.bfloat16, x, weight, check, lib)
    io = _io_flags("bf16_gemv", x, out_dtype, x_f32=False)
    n, k = weight.shape
    if check:
        _check_plain("bf16_gemv", torch.bfloat16, "bfloat16", x, weight)
    m = x.shape[0]
    out = torch.empty(m, n, dtype=out_dtype)
    rc = (lib or _KERNEL.lib()).llmsys_gemv_bf16_io(x.data_ptr(), x.stride(0), weight.data_ptr(), weight.stride(0),
                                                    out.data_ptr(), n, m, n, k, torch.get_num_threads(), io)
    if rc:
        raise RuntimeError(f"bf16_gemv: the C kernel failed (code {rc}) on M={m} N={n} K={k}")
    return out


def bf16_gemm_native(lib=None) -> bool:
    """Whether the kernel is built with AVX2 + FMA, where :func:`bf16_gemm` runs (else it is not built)."""
    lib = lib or _KERNEL.lib()
    return lib is not None and bool(lib.llmsys_gemm_bf16_native())


def bf16_gemm_def(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """:func:`bf16_gemm` in torch ops: ``c = fma(x[:, k], w[:, k], c)`` in float32 for k in order, then
    ``bf16(c + bias)``. The FMA is emulated in float64, where a product of two bf16 values is exact and the
    sum rounds once before the rounding to float32 (a double rounding can differ from the FMA's single one
    only when the float64 sum lands on a float32 tie: ~2^-29 of the time). One step per column: for tests."""
    xd, wd = x.double(), weight.double()
    c = torch.zeros(x.shape[0], weight.shape[0], dtype=torch.float32)  # [M, N]
    for i in range(x.shape[1]):
        c = (xd[:, i : i + 1] * wd[:, i] + c.double()).float()
    if bias is not None:
        c = c + bias.float()
    return c.to(torch.bfloat16)


def bf16_gemm(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, *, check: bool = True,
              lib=None) -> torch.Tensor:
    """``x [M, K]`` bf16 times a plain bf16 ``weight [N, K]`` (+ ``bias [N]`` bf16), both with unit column
    stride, ``-> [M, N]`` bf16: each output one float32 FMA chain over k in order, plus the bias, rounded
    once (dense_gemv.c). A row's bits do not depend on the other rows, the threads or a row chunk of the
    weight. The prompt GEMM of bf16 layers where oneDNN has no bf16 (``cpu_linear``); needs
    :func:`bf16_gemm_native`. ``check`` and ``lib`` as :func:`int8_gemv_a8`."""
    n, k = weight.shape
    if check:
        _check_plain("bf16_gemm", torch.bfloat16, "bfloat16", x, weight)
        if bias is not None and (bias.dtype != torch.bfloat16 or tuple(bias.shape) != (n,) or not bias.is_contiguous()):
            raise ValueError(f"bf16_gemm: bias must be a contiguous bfloat16 [{n}] tensor, got {bias.dtype} "
                             f"{tuple(bias.shape)}")
    m = x.shape[0]
    out = torch.empty(m, n, dtype=torch.bfloat16)
    rc = (lib or _KERNEL.lib()).llmsys_gemm_bf16(x.data_ptr(), x.stride(0), weight.data_ptr(), weight.stride(0),
                                                 None if bias is None else bias.data_ptr(), out.data_ptr(), n, m, n,
                                                 k, torch.get_num_threads())
    if rc:
        raise RuntimeError(f"bf16_gemm: the C kernel failed (code {rc}) on M={m} N={n} K={k}"
                           + (" (bad arguments, or not an AVX2 + FMA build: see bf16_gemm_native)" if rc == 1 else ""))
    return out


def f32_gemv(x: torch.Tensor, weight: torch.Tensor, *, check: bool = True, lib=None) -> torch.Tensor:
    """``x [M, K]`` float32 (unit column stride) times a plain float32 ``weight [N, K]`` (unit column stride)
    ``-> [M, N]`` float32, as :func:`f32_gemv_def`: the decode GEMV of small float32 layers (``cpu_linear``).
    ``check`` and ``lib`` as :func:`int8_gemv_a8`."""
    return _plain_gemv("f32_gemv", "llmsys_gemv_f32", torch.float32, x, weight, check, lib)


def _check_plain(op: str, dtype: torch.dtype, dname: str, x: torch.Tensor, weight: torch.Tensor) -> None:
    """x [M, K] and weight [N, K]: CPU tensors of ``dtype`` (called ``dname``) with unit column stride, or a
    one-line error."""
    n, k = weight.shape
    for name, t, shape in (("x", x, (x.shape[0], k)), ("weight", weight, (n, k))):
        if t.dtype != dtype or t.dim() != 2 or tuple(t.shape) != shape or t.stride(1) != 1 or t.device.type != "cpu":
            raise ValueError(f"{op}: {name} must be a CPU {dname} [{shape[0]}, {k}] tensor with unit "
                             f"column stride, got {t.dtype} {tuple(t.shape)} strides {t.stride()}")


def _plain_gemv(op: str, symbol: str, dtype: torch.dtype, x: torch.Tensor, weight: torch.Tensor, check: bool,
                lib) -> torch.Tensor:
    """:func:`bf16_gemv` / :func:`f32_gemv`: x and weight of ``dtype``, out of ``dtype``."""
    n, k = weight.shape
    if check:
        _check_plain(op, dtype, _dname(dtype), x, weight)
    m = x.shape[0]
    out = torch.empty(m, n, dtype=dtype)
    rc = getattr(lib or _KERNEL.lib(), symbol)(x.data_ptr(), x.stride(0), weight.data_ptr(), weight.stride(0),
                                                out.data_ptr(), n, m, n, k, torch.get_num_threads())
    if rc:
        raise RuntimeError(f"{op}: the C kernel failed (code {rc}) on M={m} N={n} K={k}")
    return out


def int8_gemv_a8(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, *,
                 out_dtype: torch.dtype = torch.bfloat16, check: bool = True, lib=None) -> torch.Tensor:
    """``x [M, K]`` bf16 or float32 (quantized as it is; unit column stride) times the int8 weight
    ``qweight [N, K] * scales [N, None]`` (int8 and bf16, contiguous) with x quantized to int8 per 32 columns
    ``-> [M, N]`` bf16 (:func:`int8_a8_def`'s bits): the GEMV of int8 layers; ``out_dtype`` float32 leaves
    the sums unrounded (the LM head's logits).

    Needs the C kernel (callers check :func:`available`). ``check=False`` skips the checks for callers that
    validated their tensors once (a layer's own buffers); ``lib``: another build, for tests.
    """
    op = "int8_gemv_a8"
    n, k = qweight.shape
    io = _io_flags(op, x, out_dtype)
    if check:
        _check_x(op, x, k, f32=True)
        if qweight.dtype != torch.int8 or not qweight.is_contiguous() or scales.dtype != torch.bfloat16 \
                or tuple(scales.shape) != (n,) or not scales.is_contiguous():
            raise ValueError(f"{op}: qweight must be contiguous int8 [N, K] and scales contiguous bf16 [N], "
                             f"got {qweight.dtype} {tuple(qweight.shape)}, {scales.dtype} {tuple(scales.shape)}")
    m = x.shape[0]
    out = torch.empty(m, n, dtype=out_dtype)
    rc = (lib or _KERNEL.lib()).llmsys_qgemv_int8_a8_io(x.data_ptr(), x.stride(0), qweight.data_ptr(),
                                                        scales.data_ptr(), out.data_ptr(), n, m, n, k,
                                                        torch.get_num_threads(), io)
    if rc:
        raise RuntimeError(f"{op}: the C kernel failed (code {rc}) on M={m} N={n} K={k}")
    return out


def int8g_gemv_a8(x: torch.Tensor, qweight: torch.Tensor, block_scales: torch.Tensor, *,
                  offsets: torch.Tensor | None = None, super_scales: torch.Tensor | None = None,
                  out_dtype: torch.dtype = torch.bfloat16, check: bool = True, lib=None) -> torch.Tensor:
    """``x [M, K]`` bf16 times the int8 weight ``qweight [N, K]`` with a scale per 32 columns, ``block_scales``
    fp16 ``[ceil(K / 32), N]`` contiguous (group-major, so a block's scales for a run of rows are one vector
    load), x quantized to int8 per 32 columns (:func:`int8g_a8_def`'s bits): GGUF Q8_0 layers' GEMV, the
    arithmetic of llama.cpp's q8_0 x q8_0 dot. Or GGUF Q6_K's codes minus 32 with its scales as stored: int8
    ``block_scales [K / 16, N]`` and fp16 ``super_scales [K / 256, N]`` contiguous, K a multiple of 256. Or float32 scales and
    ``offsets`` per 32 columns, ``[K / 32, N]`` contiguous, K a multiple of 32 (GGUF Q5_K's 5-bit codes, ``d * sc``
    and ``-(dmin * m)``). x bf16 or float32, ``out_dtype`` as :func:`int8_gemv_a8`; ``check`` and ``lib`` as
    :func:`int8_gemv_a8`."""
    n, k = qweight.shape
    io = _io_flags("int8g_gemv_a8", x, out_dtype)
    if offsets is not None:
        if check:
            _check_x("int8g_gemv_a8", x, k, f32=True)
            want = (k // A8_BLOCK, n)
            if qweight.dtype != torch.int8 or not qweight.is_contiguous() or k % A8_BLOCK or any(
                    t.dtype != torch.float32 or tuple(t.shape) != want or not t.is_contiguous()
                    for t in (block_scales, offsets)):
                raise ValueError(f"int8g_gemv_a8: with offsets, qweight must be contiguous int8 [N, K] (K a multiple "
                                 f"of 32) and block_scales, offsets contiguous float32 {list(want)}")
        m = x.shape[0]
        out = torch.empty(m, n, dtype=out_dtype)
        rc = (lib or _KERNEL.lib()).llmsys_qgemv_int8o_a8_io(
            x.data_ptr(), x.stride(0), qweight.data_ptr(), block_scales.data_ptr(), offsets.data_ptr(),
            out.data_ptr(), n, m, n, k, torch.get_num_threads(), io)
        if rc:
            raise RuntimeError(f"int8g_gemv_a8: the C kernel failed (code {rc}) on M={m} N={n} K={k}")
        return out
    halves = super_scales is not None
    if check:
        _check_x("int8g_gemv_a8", x, k, f32=True)
        ok = qweight.dtype == torch.int8 and qweight.is_contiguous() and block_scales.is_contiguous()
        if halves:
            ok = ok and k % 256 == 0 and block_scales.dtype == torch.int8 and tuple(block_scales.shape) == (
                k // 16, n) and super_scales.dtype == torch.float16 and super_scales.is_contiguous() and tuple(
                super_scales.shape) == (k // 256, n)
        else:
            ok = ok and block_scales.dtype == torch.float16 and tuple(block_scales.shape) == (-(-k // A8_BLOCK), n)
        if not ok:
            raise ValueError(f"int8g_gemv_a8: qweight must be contiguous int8 [N, K] and block_scales contiguous "
                             f"fp16 [ceil(K/32), N], or int8 [K/16, N] with fp16 super_scales [K/256, N] (K a "
                             f"multiple of 256), got {qweight.dtype} {tuple(qweight.shape)}, {block_scales.dtype} "
                             f"{tuple(block_scales.shape)}")
    m = x.shape[0]
    out = torch.empty(m, n, dtype=out_dtype)
    lib = lib or _KERNEL.lib()
    if halves:
        rc = lib.llmsys_qgemv_int8h_a8_io(x.data_ptr(), x.stride(0), qweight.data_ptr(), block_scales.data_ptr(),
                                          super_scales.data_ptr(), out.data_ptr(), n, m, n, k, torch.get_num_threads(),
                                          io)
    else:
        rc = lib.llmsys_qgemv_int8g_a8_io(x.data_ptr(), x.stride(0), qweight.data_ptr(), block_scales.data_ptr(),
                                          out.data_ptr(), n, m, n, k, torch.get_num_threads(), io)
    if rc:
        raise RuntimeError(f"int8g_gemv_a8: the C kernel failed (code {rc}) on M={m} N={n} K={k}")
    return out


def check_int4(x: torch.Tensor, packed: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor,
               group_size: int, op: str = "int4_gemv_a8", x_f32: bool = True) -> None:
    """Raise ``ValueError`` (naming ``op``) unless the arguments fit :func:`int4_gemv_a8`."""
    if zeros.dim() != 2 or zeros.dtype != torch.uint8:
        raise ValueError(f"{op}: zeros must be a uint8 [N, G] tensor, got {zeros.dtype} {tuple(zeros.shape)}")
    n, n_groups = zeros.shape
    k = x.shape[-1]
    _check_x(op, x, k, f32=x_f32)
    if scales.dim() == 3 and (scales.shape[0] != n_groups or scales.shape[1] < n or scales.shape[2] != 2):
        raise ValueError(f"{op}: scales_zeros must be [G, >= N, 2] = [{n_groups}, >= {n}, 2], "
                         f"got {tuple(scales.shape)}")
    check_int4_layout(op, packed, _scales_2d(scales, n), n, n_groups, k, group_size)


def int4_gemv_a8(x: torch.Tensor, packed: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor,
                 group_size: int, *, offsets: torch.Tensor | None = None, out_dtype: torch.dtype = torch.bfloat16,
                 check: bool = True, lib=None) -> torch.Tensor:
    """``x [M, K]`` times an int4 weight in the CPU int4 tiling ``-> [M, N]`` with x quantized to int8 per 32
    columns (:func:`int4_a8_def`'s bits): the GEMV of int4 layers.

    ``scales [N, G]`` of any strides, any float dtype (bf16, fp16, fp32 read as they are), or torch's
    ``scales_zeros [G, Np, 2]`` itself (the scale at ``[g, n, 0]``, read in place); ``zeros`` uint8 ``[N, G]``
    of any strides (group-major, ``zeros_gm.t()``, is the fast one); K within the last group of
    ``Kp = G * group_size``; ``offsets``: float32 ``[N, G]`` of any strides (group-major is the fast one),
    ``w = scale * q + offset`` with the zeros not read. x bf16 or float32, ``out_dtype``, ``check`` and
    ``lib`` as :func:`int8_gemv_a8`."""
    if offsets is None:
        return _int4("llmsys_qgemv_int4_a8", x, packed, scales, zeros, group_size, check, lib, out_dtype=out_dtype)
    if check and (offsets.dtype != torch.float32 or tuple(offsets.shape) != tuple(zeros.shape)):
        raise ValueError(f"int4_gemv_a8: offsets must be float32 {tuple(zeros.shape)}, "
                         f"got {offsets.dtype} {tuple(offsets.shape)}")
    return _int4("llmsys_qgemv_int4o_a8", x, packed, scales, zeros, group_size, check, lib, offsets, out_dtype)


def _int4(symbol: str, x: torch.Tensor, packed: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor,
          group_size: int, check: bool, lib, offsets: torch.Tensor | None = None,
          out_dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    op = "int4_gemv_a8"
    io = _io_flags(op, x, out_dtype)
    if check:
        check_int4(x, packed, scales, zeros, group_size, op=op)  # group sizes 32/64/128: whole a8 blocks
    if scales.dtype not in _SCALE_KINDS:
        scales = _scales_2d(scales, zeros.shape[0]).float()  # as the definition reads them
    n, n_groups = zeros.shape
    m, k = x.shape
    s_n, s_g = (scales.stride(1), scales.stride(0)) if scales.dim() == 3 else scales.stride()
    out = torch.empty(m, n, dtype=out_dtype)
    offs = () if offsets is None else (offsets.data_ptr(), offsets.stride(0), offsets.stride(1))
    args = (x.data_ptr(), x.stride(0), packed.data_ptr(), scales.data_ptr(), s_n, s_g, _SCALE_KINDS[scales.dtype],
            zeros.data_ptr(), zeros.stride(0), zeros.stride(1), *offs, out.data_ptr(), n,
            m, n, n_groups * group_size, k, group_size, torch.get_num_threads())
    rc = getattr(lib or _KERNEL.lib(), symbol + "_io")(*args, io)
    if rc:
        raise RuntimeError(f"{op}: the C kernel failed (code {rc}) on M={m} N={n} K={k} group={group_size}")
    return out


# ------------------------------------------------------------------ fused a8 decode layers


class WeightKind(enum.IntEnum):
    """The weight formats the fused layer kernels read (``enum weight_kind`` in fused_layer.h)."""

    INT8 = 0  # int8 codes [N, K], bf16 row scales [N]
    INT4 = 1  # int4 codes in the CPU tiling, group scales and zeros (or offsets, or Q4_K's stored scales)
    BF16 = 2  # plain bf16 [N, K]
    INT8_BLOCK = 3  # int8 codes, fp16 scales per 32 columns (GGUF Q8_0)
    INT8_Q6K = 4  # int8 codes, GGUF Q6_K's stored scales (int8 per 16 columns times fp16 per 256)
    INT8_Q5K = 5  # int8 codes, float32 scales and offsets per 32 columns (GGUF Q5_K)
    F32 = 6  # plain float32 [N, K] (float32 activations)


class DecodeWeight(ctypes.Structure):
    """One weight as the fused layer kernels read it (``llmsys_qw`` in fused_layer.h): raw pointers
    into the layer's buffers, which the caller keeps alive for the call. Built by the quantized
    layers (``Int8Linear.decode_weight``, ``Int4Linear.decode_weight``) through :func:`int8_decode_weight` /
    :func:`int4_decode_weight`, and for plain bf16 / float32 weights by ``cpu_linear.decode_weight``.
    ``kind`` is a :class:`WeightKind`, ``scale_kind`` a :class:`ScaleKind` (ctypes keeps them as integers:
    compare with the enums); fields not named at construction are 0 / NULL."""

    _fields_ = [("kind", _I), ("n", _I), ("k", _I), ("kp", _I), ("gs", _I), ("q", _P), ("scales", _P),
                ("s_n", _I), ("s_g", _I), ("scale_kind", _I), ("zeros", _P), ("z_n", _I), ("z_g", _I),
                ("bias", _P), ("offs", _P), ("o_n", _I), ("o_g", _I),
                ("ksc", _P), ("km", _P), ("kd", _P), ("kdm", _P), ("k_n", _I)]


def int8_decode_weight(qweight: torch.Tensor, scales: torch.Tensor, bias: torch.Tensor | None) -> DecodeWeight:
    """:func:`int8_gemv_a8`'s weight (contiguous int8 ``[N, K]``, bf16 ``[N]``) plus a bf16 ``bias [N]`` or None."""
    n, k = qweight.shape
    return DecodeWeight(kind=WeightKind.INT8, n=n, k=k, kp=k, q=qweight.data_ptr(), scales=scales.data_ptr(),
                        bias=None if bias is None else bias.data_ptr())


def int8g_decode_weight(qweight: torch.Tensor, block_scales: torch.Tensor, bias: torch.Tensor | None,
                        offsets: torch.Tensor | None = None, super_scales: torch.Tensor | None = None) -> DecodeWeight:
    """:func:`int8g_gemv_a8`'s weight (contiguous int8 ``[N, K]`` with fp16 ``[nb, N]`` scales, Q6_K's int8
    ``[K / 16, N]`` and ``super_scales``, or float32 scales and ``offsets`` ``[K / 32, N]``) plus a bf16
    ``bias [N]`` or None."""
    n, k = qweight.shape
    b = None if bias is None else bias.data_ptr()
    common = dict(n=n, k=k, kp=k, q=qweight.data_ptr(), s_g=block_scales.stride(0), bias=b)
    if super_scales is not None:  # Q6_K's stored scales in the ksc / kd fields
        return DecodeWeight(kind=WeightKind.INT8_Q6K, ksc=block_scales.data_ptr(), kd=super_scales.data_ptr(),
                            **common)
    if offsets is not None:
        return DecodeWeight(kind=WeightKind.INT8_Q5K, scales=block_scales.data_ptr(), scale_kind=ScaleKind.F32,
                            offs=offsets.data_ptr(), o_g=offsets.stride(0), **common)
    return DecodeWeight(kind=WeightKind.INT8_BLOCK, scales=block_scales.data_ptr(), scale_kind=ScaleKind.F16, **common)


def bf16_decode_weight(weight: torch.Tensor, bias: torch.Tensor | None) -> DecodeWeight:
    """:func:`bf16_gemv`'s weight (bf16 ``[N, K]``, unit column stride) plus a bf16 ``bias [N]`` or None."""
    n, k = weight.shape
    return DecodeWeight(kind=WeightKind.BF16, n=n, k=k, kp=weight.stride(0), q=weight.data_ptr(),
                        bias=None if bias is None else bias.data_ptr())


def f32_decode_weight(weight: torch.Tensor, bias: torch.Tensor | None) -> DecodeWeight:
    """:func:`f32_gemv`'s weight (float32 ``[N, K]``, unit column stride) plus a float32 ``bias [N]`` or None."""
    n, k = weight.shape
    return DecodeWeight(kind=WeightKind.F32, n=n, k=k, kp=weight.stride(0), q=weight.data_ptr(),
                        bias=None if bias is None else bias.data_ptr())


@dataclass(frozen=True)
class KScales:
    """GGUF Q4_K's scales as the file stores them, group-major (``[groups, N]`` rows contiguous over N):
    6-bit ``sc`` and ``m`` per 32 columns (uint8 ``[G, N]``) and fp16 ``d``, ``dmin`` per 256 (``[G / 8, N]``);
    ``scale = d * sc``, ``offset = -(dmin * m)`` in float32 (0.58 bytes a weight with the codes, where float32
    scales and offsets take 0.75)."""

    sc: torch.Tensor  # uint8 [G, N]
    m: torch.Tensor  # uint8 [G, N]
    d: torch.Tensor  # float16 [G / 8, N]
    dmin: torch.Tensor  # float16 [G / 8, N]

    def scales(self) -> torch.Tensor:
        """float32 ``[N, G]``: ``d * sc`` (the product llama.cpp's dequantization rounds)."""
        return (self.d.float().repeat_interleave(8, 0) * self.sc.float()).t()

    def offsets(self) -> torch.Tensor:
        """float32 ``[N, G]``: ``-(dmin * m)``."""
        return (-(self.dmin.float().repeat_interleave(8, 0) * self.m.float())).t()

    def rows(self, ids: torch.Tensor) -> "KScales":
        return KScales(self.sc[:, ids], self.m[:, ids], self.d[:, ids], self.dmin[:, ids])

    def pointers(self) -> tuple[int, int, int, int, int]:
        return (self.sc.data_ptr(), self.m.data_ptr(), self.d.data_ptr(), self.dmin.data_ptr(), self.sc.stride(0))


def int4k_gemv_a8(x: torch.Tensor, packed: torch.Tensor, ks: KScales, k: int, *,
                  out_dtype: torch.dtype = torch.bfloat16, check: bool = True, lib=None) -> torch.Tensor:
    """:func:`int4_gemv_a8` with Q4_K's scales as stored (``ks``; group 32, ``k`` input features, whole
    256-column super-blocks): the bits of :func:`int4_a8_def` given ``ks.scales()`` and ``offsets=ks.offsets()``.
    x bf16 or float32 and ``out_dtype`` as :func:`int8_gemv_a8`. ``check=False`` skips the check of ``x`` for
    callers that made it (the C kernel still checks the shapes)."""
    n, kp = ks.sc.shape[1], ks.sc.shape[0] * 32
    io = _io_flags("int4_gemv_a8", x, out_dtype)
    if check:
        _check_x("int4_gemv_a8", x, k, f32=True)
    m = x.shape[0]
    out = torch.empty(m, n, dtype=out_dtype)
    rc = (lib or _KERNEL.lib()).llmsys_qgemv_int4k_a8_io(x.data_ptr(), x.stride(0), packed.data_ptr(), *ks.pointers(),
                                                          out.data_ptr(), n, m, n, kp, k, torch.get_num_threads(), io)
    if rc:
        raise RuntimeError(f"int4_gemv_a8: the C kernel failed (code {rc}) on M={m} N={n} K={k} (Q4_K scales)")
    return out


def int4_decode_weight(packed: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, group_size: int, k: int,
                bias: torch.Tensor | None, offsets: torch.Tensor | None = None) -> DecodeWeight | None:
    """:func:`int4_gemv_a8`'s weight (its arguments, ``k`` the input features, ``offsets`` or None) plus a
    bf16 ``bias [N]`` or None; None when the scales are of a dtype the kernel does not read in place."""
    if scales.dtype not in _SCALE_KINDS:
        return None
    n, n_groups = zeros.shape
    s_n, s_g = (scales.stride(1), scales.stride(0)) if scales.dim() == 3 else scales.stride()
    o = {} if offsets is None else dict(offs=offsets.data_ptr(), o_n=offsets.stride(0), o_g=offsets.stride(1))
    return DecodeWeight(kind=WeightKind.INT4, n=n, k=k, kp=n_groups * group_size, gs=group_size, q=packed.data_ptr(),
                        scales=scales.data_ptr(), s_n=s_n, s_g=s_g, scale_kind=_SCALE_KINDS[scales.dtype],
                        zeros=zeros.data_ptr(), z_n=zeros.stride(0), z_g=zeros.stride(1),
                        bias=None if bias is None else bias.data_ptr(), **o)


def int4k_decode_weight(packed: torch.Tensor, ks: KScales, k: int, bias: torch.Tensor | None) -> DecodeWeight:
    """:func:`int4k_gemv_a8`'s weight plus a bf16 ``bias [N]`` or None."""
    n, kp = ks.sc.shape[1], ks.sc.shape[0] * 32
    sc, m, d, dmin, k_n = ks.pointers()
    return DecodeWeight(kind=WeightKind.INT4, n=n, k=k, kp=kp, gs=32, q=packed.data_ptr(),
                        bias=None if bias is None else bias.data_ptr(), ksc=sc, km=m, kd=d, kdm=dmin, k_n=k_n)


class _LayerArgs(ctypes.Structure):
    """``llmsys_layer`` in fused_layer.h."""

    _fields_ = [("ln1", _P), ("ln2", _P), ("eps1", ctypes.c_float), ("eps2", ctypes.c_float), ("d", _I),
                ("k_o", _I), ("qkv", _P), ("n_qkv", _I), ("o", _P), ("gu", _P), ("n_gu", _I), ("down", _P),
                ("f32", _I)]


@dataclass(frozen=True)
class DecodeLayer:
    """One decoder layer's fixed arguments for the fused a8 kernels (:func:`decode_layer_args`): raw pointers into
    its weights and norm weights, valid while those stay where they are (the caller checks:
    ``DecoderLayer.decode_layer``). One struct, so the kernels take 7 ctypes arguments a call, not 14 plus
    per-call arrays, whose Python was a large share of a decode layer (docs/benchmarks.md)."""

    args: _LayerArgs
    arrays: tuple[ctypes.Array, ...]  # the llmsys_qw arrays args points into (kept alive here)
    d: int  # hidden size
    qkv_rows: int  # q | k | v output columns
    k_o: int  # o_proj's input columns
    dtype: torch.dtype  # of the activations (and norm weights): bf16, or float32 for float32 weights

    def describe(self) -> str:
        a = self.args
        mlp = (f"gate|up {[w.n for w in self.arrays[2]]} rows, down {self.arrays[3][0].n}x{self.arrays[3][0].k}"
               if len(self.arrays[3]) else "experts apart (an MoE layer)")
        return (f"D={self.d}, q|k|v {[w.n for w in self.arrays[0]]} rows, o_proj {self.arrays[1][0].n}x{self.k_o}, "
                f"{mlp} ({a.n_qkv} + 1 + {a.n_gu} + {len(self.arrays[3])} weights)")


def decode_layer_args(qkv: list[DecodeWeight], o_proj: DecodeWeight, gate_up: list[DecodeWeight],
                      down: DecodeWeight | None, ln1: torch.Tensor, eps1: float, ln2: torch.Tensor,
                      eps2: float) -> DecodeLayer:
    """The :class:`DecodeLayer` of a layer's weights (q|k|v and gate|up: 1-4 weights each whose outputs lie
    side by side, one fused weight or several) and its two RMSNorm weights (``[D]``, contiguous): bf16 norms
    with a8 / bf16 weights, float32 norms with float32 weights (a float32 layer: float32 activations).
    An MoE layer's: no gate|up (``[]``) nor down (None); its experts run in their own call (:func:`layer_post_attn`
    ends where they start)."""
    moe = not gate_up and down is None
    if not (1 <= len(qkv) <= 4 and (moe or 1 <= len(gate_up) <= 4)) or (down is None) != moe:
        raise ValueError(f"decode_layer_args: q|k|v and gate|up take 1-4 weights each, got {len(qkv)} and "
                         f"{len(gate_up)} (an MoE layer: no gate|up nor down)")
    d = qkv[0].k
    ws = [*qkv, o_proj, *gate_up, *([] if moe else [down])]
    f32 = ws[0].kind == WeightKind.F32
    if any((w.kind == WeightKind.F32) != f32 for w in ws):
        raise ValueError("decode_layer_args: float32 weights cannot be mixed with bf16 or quantized ones in a layer")
    dtype = torch.float32 if f32 else torch.bfloat16
    for name, t in (("ln1", ln1), ("ln2", ln2)):
        if t.dtype != dtype or tuple(t.shape) != (d,) or not t.is_contiguous() or t.device.type != "cpu":
            raise ValueError(f"decode_layer_args: {name} must be a contiguous CPU {_dname(dtype)} [{d}] tensor, "
                             f"got {t.dtype} {tuple(t.shape)} on {t.device}")
    arrays = ((DecodeWeight * len(qkv))(*qkv), (DecodeWeight * 1)(o_proj), (DecodeWeight * len(gate_up))(*gate_up),
              (DecodeWeight * (0 if moe else 1))(*([] if moe else [down])))
    args = _LayerArgs(ln1.data_ptr(), ln2.data_ptr(), eps1, eps2, d, o_proj.k, ctypes.addressof(arrays[0]),
                      len(qkv), ctypes.addressof(arrays[1]), None if moe else ctypes.addressof(arrays[2]),
                      len(gate_up), None if moe else ctypes.addressof(arrays[3]), int(f32))
    return DecodeLayer(args, arrays, d, sum(w.n for w in qkv), o_proj.k, dtype)


def _check_rows(op: str, x: torch.Tensor, d: int, dtype: torch.dtype, m: int | None = None) -> None:
    if x.dtype != dtype or x.dim() != 2 or not x.is_contiguous() or x.device.type != "cpu" \
            or x.shape[1] != d or (m is not None and x.shape[0] != m):
        raise ValueError(f"{op}: expected a contiguous CPU {_dname(dtype)} [{m or 'M'}, {d}] tensor, "
                         f"got {x.dtype} {tuple(x.shape)} on {x.device}")


def layer_attn_in(layer: DecodeLayer, x: torch.Tensor, residual: torch.Tensor | None, *,
               check: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """A decode layer's input RMSNorm and q|k|v projection in one C call.

    ``x [M, D]`` bf16, or float32 for a float32 layer (the previous layer's MLP output, or the embeddings with ``residual`` None),
    ``residual [M, D]`` ``-> (out [M, q|k|v rows] = rms_norm(x + residual) times the q|k|v weights side
    by side (+ bias), x + residual)``: the bits of ``cpu_decode.rms_norm`` then each layer's
    :func:`int8_gemv_a8` / :func:`int4_gemv_a8` plus ``bf16(y + bias)``. ``check=False``: the caller
    guarantees contiguous bf16 ``[M, D]`` inputs (the decoder's own activations).
    """
    m = x.shape[0]
    if check:
        _check_rows("layer_attn_in", x, layer.d, layer.dtype)
        if residual is not None:
            _check_rows("layer_attn_in", residual, layer.d, layer.dtype, m)
    out = torch.empty(m, layer.qkv_rows, dtype=layer.dtype)
    new_res = x if residual is None else torch.empty_like(x)
    rc = _KERNEL.lib().llmsys_layer_attn_in(ctypes.byref(layer.args), x.data_ptr(),
                                         None if residual is None else residual.data_ptr(), out.data_ptr(),
                                         new_res.data_ptr(), m, torch.get_num_threads())
    if rc:
        raise ValueError(f"layer_attn_in: the C kernel rejected the layer (code {rc}; 2: out of memory): "
                         f"{layer.describe()}")
    return out, new_res


def layer_post_attn(layer: DecodeLayer, o: torch.Tensor, residual: torch.Tensor, *,
                    check: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """An MoE layer's attention output to its MoE block's input in one C call: ``o [M, Hq D]``, ``residual [M, D]``
    ``-> (rms_norm(a + residual), a + residual)`` with ``a`` o_proj's output: :func:`layer_mlp`'s first half, the
    same bits. ``check`` as :func:`layer_attn_in`."""
    m = o.shape[0]
    if check:
        _check_rows("layer_post_attn", o, layer.k_o, layer.dtype)
        _check_rows("layer_post_attn", residual, layer.d, layer.dtype, m)
    xn, new_res = torch.empty(m, layer.d, dtype=layer.dtype), torch.empty(m, layer.d, dtype=layer.dtype)
    rc = _KERNEL.lib().llmsys_layer_post_attn(ctypes.byref(layer.args), o.data_ptr(), residual.data_ptr(),
                                              xn.data_ptr(), new_res.data_ptr(), m, torch.get_num_threads())
    if rc:
        raise ValueError(f"layer_post_attn: the C kernel rejected the layer (code {rc}; 2: out of memory): "
                         f"{layer.describe()}")
    return xn, new_res


def layer_mlp(layer: DecodeLayer, o: torch.Tensor, residual: torch.Tensor, *,
           check: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """A decode layer from its attention output to its MLP output in one C call.

    ``o [M, Hq D]`` (attention heads side by side) and ``residual [M, D]`` bf16 ``-> (down(silu(gate(x)) *
    up(x)), a + residual)`` with ``a`` o_proj's output and ``x = rms_norm(a + residual)``: the bits of
    the layers' a8 GEMVs, ``cpu_decode.rms_norm`` and ``cpu_decode.silu_mul``. ``check`` as
    :func:`layer_attn_in`.
    """
    m = o.shape[0]
    if check:
        _check_rows("layer_mlp", o, layer.k_o, layer.dtype)
        _check_rows("layer_mlp", residual, layer.d, layer.dtype, m)
    out, new_res = torch.empty(m, layer.d, dtype=layer.dtype), torch.empty(m, layer.d, dtype=layer.dtype)
    rc = _KERNEL.lib().llmsys_layer_mlp(ctypes.byref(layer.args), o.data_ptr(), residual.data_ptr(), out.data_ptr(),
                                     new_res.data_ptr(), m, torch.get_num_threads())
    if rc:
        raise ValueError(f"layer_mlp: the C kernel rejected the layer (code {rc}; 2: out of memory): "
                         f"{layer.describe()}")
    return out, new_res


class _StackLayer(ctypes.Structure):
    """``llmsys_stack_layer`` in decode_stack.c."""

    _fields_ = [("layer", _P), ("k_pool", _P), ("v_pool", _P), ("table", _I), ("tables", _I), ("hq", _I), ("hk", _I),
                ("hd", _I), ("scale", ctypes.c_float)]


class _Stack(ctypes.Structure):
    """``llmsys_stack`` in decode_stack.c."""

    _fields_ = [("layers", _P), ("n_layers", _I), ("positions", _P), ("slot_mapping", _P), ("n_slots", _I),
                ("cache", _P), ("max_pos", _I), ("gather_slots", _P), ("lens", _P), ("l_max", _I)]


@dataclass(frozen=True)
class StackLayer:
    """One layer of a :class:`DecodeStack`: its fused arguments, K/V pools ``[n_slots, Hk, D]`` of its dtype (contiguous),
    heads, head dim and softmax scale; ``table`` of ``tables``: the RoPE table it rotates with (the tables lie
    one after the other in the cache, ``Attention.rope_positions``)."""

    layer: DecodeLayer
    k_pool: torch.Tensor
    v_pool: torch.Tensor
    hq: int
    hk: int
    hd: int
    scale: float
    table: int = 0
    tables: int = 1


@dataclass(frozen=True)
class DecodeStack:
    """Every decoder layer of a decode step in one C call (:func:`decode_stack`): the layers' fixed
    arguments, built once per bound weights and pools (``DecoderModel.decode_stack``)."""

    layers: tuple[StackLayer, ...]
    array: ctypes.Array  # the llmsys_stack_layer array
    dtype: torch.dtype  # of the activations and pools


def decode_stack_args(layers: list[StackLayer]) -> DecodeStack:
    """The :class:`DecodeStack` of ``layers`` (each a fused layer whose attention is RoPE over its whole head,
    the K/V store and plain decode attention: no window, soft cap or sinks)."""
    if not layers:
        raise ValueError("decode_stack_args: no layers")
    d, dtype = layers[0].layer.d, layers[0].layer.dtype
    for i, s in enumerate(layers):
        for name, t in (("k_pool", s.k_pool), ("v_pool", s.v_pool)):
            if t.dtype != dtype or t.dim() != 3 or tuple(t.shape[1:]) != (s.hk, s.hd) or not t.is_contiguous():
                raise ValueError(f"decode_stack_args: layer {i}'s {name} must be a contiguous {_dname(dtype)} [slots, {s.hk}, "
                                 f"{s.hd}] tensor, got {t.dtype} {tuple(t.shape)}")
        if s.layer.d != d or s.layer.dtype != dtype or s.layer.k_o != s.hq * s.hd \
                or s.layer.qkv_rows != (s.hq + 2 * s.hk) * s.hd:
            raise ValueError(f"decode_stack_args: layer {i} ({s.layer.describe()}) does not fit {s.hq} query and "
                             f"{s.hk} K/V heads of {s.hd} in a hidden size of {d}")
    array = (_StackLayer * len(layers))(*(
        _StackLayer(ctypes.addressof(s.layer.args), s.k_pool.data_ptr(), s.v_pool.data_ptr(), s.table, s.tables, s.hq,
                    s.hk, s.hd, s.scale) for s in layers))
    return DecodeStack(tuple(layers), array, dtype)


def decode_stack(stack: DecodeStack, h: torch.Tensor, positions: torch.Tensor, rope_cache: torch.Tensor,
                 slot_mapping: torch.Tensor, gather_slots: torch.Tensor, lens: torch.Tensor
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """A decode step through every layer of ``stack`` in one C call: ``h [M, D]`` of the stack's dtype (the embeddings) ``->
    (the last layer's MLP output, its residual)``, each ``[M, D]``; the bits of the layers' fused calls around
    ``cpu_decode.rope_store_attend`` one after the other (K/V written to each layer's pools at
    ``slot_mapping [M]``; ``positions [M]`` rows of ``rope_cache``'s first table, each layer's table's rows
    found by the C code as ``Attention.rope_positions`` finds them; ``gather_slots [M, L]`` and
    ``lens [M]`` the step's decode plan, int64). The caller's own validated tensors, as for
    ``rope_store_attend``; ``h`` contiguous."""
    m, d = h.shape
    args = _Stack(ctypes.addressof(stack.array), len(stack.layers), positions.data_ptr(),
                  slot_mapping.data_ptr(), stack.layers[0].k_pool.shape[0], rope_cache.data_ptr(), rope_cache.shape[0],
                  gather_slots.data_ptr(), lens.data_ptr(), gather_slots.shape[1])
    out, res = torch.empty(m, d, dtype=stack.dtype), torch.empty(m, d, dtype=stack.dtype)
    rc = _KERNEL.lib().llmsys_decode_stack(ctypes.byref(args), h.data_ptr(), out.data_ptr(), res.data_ptr(), m,
                                           torch.get_num_threads())
    if rc:
        where = f" at layer {rc // 100 - 1} (attention code {rc % 100})" if rc >= 100 else ""
        raise ValueError(f"decode_stack: the C kernel rejected the step{where} (code {rc}; 2: out of memory)")
    return out, res
