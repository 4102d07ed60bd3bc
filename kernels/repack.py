"""GGUF Q4_K / Q6_K / Q4_0 / Q8_0 blocks written straight into the run-time layouts (``repack.c``), in one pass.

Why: an expert read from a GGUF file at run time is rebuilt from its stored blocks each time it is read, and
the torch definition of that rebuild (``engine/loader/gguf_io.py``'s block parsers, then ``Int4Linear``'s CPU
tiling) makes many passes over temporaries: the rebuild, not the read, was what a missed expert cost. These
write the same bytes; each returns False when the C library is not loaded (the caller keeps the torch path).
"""

from __future__ import annotations

import ctypes

import torch

from llmsys.kernels import _cbuild
from llmsys.kernels.cpu_int4 import CPU_BLOCK_N

_P, _I = ctypes.c_void_p, ctypes.c_int64
_SIGNATURES = {
    "llmsys_repack_q4k": [_P, _I, _I, _I, _P, _P, _P, _P, _P],
    "llmsys_repack_q6k": [_P, _I, _I, _P, _P, _P],
    "llmsys_repack_q4_0": [_P, _I, _I, _I, _P, _P],
    "llmsys_repack_q8_0": [_P, _I, _I, _P, _P],
}
_KERNEL = _cbuild.Kernel(_cbuild.KERNELS, _SIGNATURES)  # the one kernel library, loaded once per process
Q4K_BLOCK, Q6K_BLOCK = 144, 210  # bytes of one super-block of 256 weights
Q4_0_BLOCK, Q8_0_BLOCK = 18, 34  # bytes of one block of 32 weights


def _check(op: str, name: str, t: torch.Tensor, dtype: torch.dtype, shape: tuple[int, ...]) -> None:
    if t.dtype != dtype or tuple(t.shape) != shape or not t.is_contiguous() or t.device.type != "cpu":
        raise ValueError(f"{op}: {name} must be a contiguous CPU {dtype} tensor of shape {shape}, "
                         f"got {t.dtype} {tuple(t.shape)} (contiguous: {t.is_contiguous()})")


def _run(op: str, src: torch.Tensor, n: int, k: int, *outs: int) -> bool:
    """``llmsys_<op>(src, n, k, *outs)`` when the C kernel is loaded (True), False without it; a refusal is an error."""
    lib = _KERNEL.lib()
    if lib is None:
        return False
    if getattr(lib, f"llmsys_{op}")(src.data_ptr(), n, k, *outs):
        raise ValueError(f"{op}: the C kernel refused N={n}, K={k}")
    return True


def repack_q4k(src: torch.Tensor, n: int, k: int, packed: torch.Tensor, sc: torch.Tensor, m: torch.Tensor,
               d: torch.Tensor, dmin: torch.Tensor) -> bool:
    """Q4_K blocks ``src uint8 [N * K / 256 * 144]`` -> the CPU int4 tiling ``packed uint8 [Np, K/2]`` (Np: N
    rounded up to 64, padded rows code 8) and the scales as stored, group-major: ``sc``, ``m`` uint8 ``[K/32, N]``,
    ``d``, ``dmin`` fp16 ``[K/256, N]`` (``Int4Linear``'s ``packed``, ``k_sc``, ``k_m``, ``k_d``, ``k_dmin``)."""
    op = "repack_q4k"
    if k % 256:
        raise ValueError(f"{op}: K={k} is not a multiple of 256 (whole Q4_K super-blocks)")
    np_ = -(-n // CPU_BLOCK_N) * CPU_BLOCK_N
    _check(op, "src", src, torch.uint8, (n * k // 256 * Q4K_BLOCK,))
    _check(op, "packed", packed, torch.uint8, (np_, k // 2))
    for name, t, dt, rows in (("sc", sc, torch.uint8, k // 32), ("m", m, torch.uint8, k // 32),
                              ("d", d, torch.float16, k // 256), ("dmin", dmin, torch.float16, k // 256)):
        _check(op, name, t, dt, (rows, n))
    return _run(op, src, n, k, np_, packed.data_ptr(), sc.data_ptr(), m.data_ptr(), d.data_ptr(),
                dmin.data_ptr())


def repack_q6k(src: torch.Tensor, n: int, k: int, q: torch.Tensor, sc: torch.Tensor, d: torch.Tensor) -> bool:
    """Q6_K blocks ``src uint8 [N * K / 256 * 210]`` -> codes minus 32 ``q int8 [N, K]``, the int8 scales per 16
    columns ``sc [K/16, N]`` and fp16 ``d [K/256, N]``, group-major (``Int8BlockLinear``'s ``qweight``,
    ``block_scales``, ``super_scales``)."""
    op = "repack_q6k"
    if k % 256:
        raise ValueError(f"{op}: K={k} is not a multiple of 256 (whole Q6_K super-blocks)")
    _check(op, "src", src, torch.uint8, (n * k // 256 * Q6K_BLOCK,))
    _check(op, "q", q, torch.int8, (n, k))
    _check(op, "sc", sc, torch.int8, (k // 16, n))
    _check(op, "d", d, torch.float16, (k // 256, n))
    return _run(op, src, n, k, q.data_ptr(), sc.data_ptr(), d.data_ptr())


def repack_q4_0(src: torch.Tensor, n: int, k: int, packed: torch.Tensor, d: torch.Tensor) -> bool:
    """Q4_0 blocks ``src uint8 [N * K / 32 * 18]`` -> the CPU int4 tiling ``packed uint8 [Np, K/2]`` (as
    :func:`repack_q4k`) and the blocks' fp16 scales group-major ``d [K/32, N]`` (``Int4Linear``'s ``packed`` and the
    storage of its ``scales_orig``)."""
    op = "repack_q4_0"
    if k % 32:
        raise ValueError(f"{op}: K={k} is not a multiple of 32 (whole Q4_0 blocks)")
    np_ = -(-n // CPU_BLOCK_N) * CPU_BLOCK_N
    _check(op, "src", src, torch.uint8, (n * k // 32 * Q4_0_BLOCK,))
    _check(op, "packed", packed, torch.uint8, (np_, k // 2))
    _check(op, "d", d, torch.float16, (k // 32, n))
    return _run(op, src, n, k, np_, packed.data_ptr(), d.data_ptr())


def repack_q8_0(src: torch.Tensor, n: int, k: int, q: torch.Tensor, d: torch.Tensor) -> bool:
    """Q8_0 blocks ``src uint8 [N * K / 32 * 34]`` -> the codes ``q int8 [N, K]`` and the fp16 scales group-major
    ``d [K/32, N]`` (``Int8BlockLinear``'s ``qweight`` and ``block_scales``)."""
    op = "repack_q8_0"
    if k % 32:
        raise ValueError(f"{op}: K={k} is not a multiple of 32 (whole Q8_0 blocks)")
    _check(op, "src", src, torch.uint8, (n * k // 32 * Q8_0_BLOCK,))
    _check(op, "q", q, torch.int8, (n, k))
    _check(op, "d", d, torch.float16, (k // 32, n))
    return _run(op, src, n, k, q.data_ptr(), d.data_ptr())


def available() -> bool:
    return _KERNEL.available()
