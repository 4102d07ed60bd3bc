"""CPU int4: dequantize int4 weights held in the CPU tiling to bfloat16 in one pass.

For prefill, torch's ``_weight_int4pack_mm_for_cpu`` and a torch-op dequantization both lose to bf16;
:func:`dequant_cpu_int4` (``cpu_int4.c``) writes the bf16 weight fast enough that the prefill GEMM runs
at bf16 speed (docs/benchmarks.md). Built per ISA level (``_cbuild``), on torch's OpenMP threads; without
it :func:`dequant_cpu_int4_ref` (the torch definition) runs, bit-identical (``tests/test_cpu_int4.py``).
Layout (:func:`pack_cpu_int4`, the same on every CPU; N padded to 64): bytes ``[Np/64, Kp, 32]``, byte
``(b, k, j)`` holding row ``64b+j`` (low nibble) and row ``64b+32+j`` (high nibble) at column k.
"""

from __future__ import annotations

import ctypes

import torch

from llmsys.kernels import _cbuild

CPU_BLOCK_N = 64  # the CPU int4 layout tiles rows in blocks of 64
_SOURCE = _cbuild.KERNELS  # the one kernel library (every module's functions)
_ARGTYPES = [
    ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64, ctypes.c_int,  # packed, scales, strides, f32?
    ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64,  # zeros, out, ldo
    ctypes.c_int64, ctypes.c_int64, ctypes.c_int64, ctypes.c_int64, ctypes.c_int,  # N, Kp, K, group, threads
]
_SIGNATURES = {
    "llmsys_int4_cpu_dequant": _ARGTYPES,
    "llmsys_u16_transpose": [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64, ctypes.c_int],
}
_KERNEL = _cbuild.Kernel(_SOURCE, _SIGNATURES)  # loaded (built if need be) at the CPU's ISA level, once per process
kernel_status = _KERNEL.status  # "ok: <path>" when the C kernel is loaded, else why the torch path runs


def pack_cpu_int4(q: torch.Tensor) -> torch.Tensor:
    """Codes ``q [N, Kp]`` (0..15, N a multiple of 64) in llmsys's CPU int4 tiling ``-> uint8 [N, Kp/2]``.

    Bytes form ``[N/64, Kp, 32]``; byte (b, k, j) holds row 64b+j in its low nibble and
    row 64b+32+j in its high nibble, at column k: the 32 bytes of a column give 64 rows'
    codes, which is what the C kernels read. Why our own and not torch's
    ``_convert_weight_to_int4pack_for_cpu``: torch tiles by its own ISA dispatch (64-row
    blocks on AVX-512, 32-row on AVX2, adjacent pairs elsewhere), so its bytes mean
    different codes on different CPUs. This one is plain torch and the same everywhere.
    """
    n, kp = q.shape
    t = q.to(torch.uint8).view(n // CPU_BLOCK_N, CPU_BLOCK_N, kp).transpose(1, 2)  # [N/64, Kp, 64]
    half = CPU_BLOCK_N // 2
    return (t[..., :half] | (t[..., half:] << 4)).reshape(n, kp // 2)


def unpack_cpu_int4(packed: torch.Tensor, n: int, kp: int) -> torch.Tensor:
    """Invert :func:`pack_cpu_int4` (N a multiple of 64): ``-> q uint8 [N, Kp]``."""
    p = packed.reshape(n // CPU_BLOCK_N, kp, CPU_BLOCK_N // 2)
    q = torch.cat([p & 15, p >> 4], dim=2)  # [N/64, Kp, 64]
    return q.permute(0, 2, 1).reshape(n, kp)  # [N, Kp] uint8


def dequant_cpu_int4_ref(packed: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor,
                         in_features: int, group_size: int, rows: tuple[int, int] | None = None) -> torch.Tensor:
    """Plain-torch definition of :func:`dequant_cpu_int4` (same arguments, same bits)."""
    n, n_groups = zeros.shape
    kp = n_groups * group_size
    r0, r1 = rows or (0, n)
    b0, b1 = r0 // CPU_BLOCK_N, -(-r1 // CPU_BLOCK_N)  # the 64-row tiles holding rows r0..r1-1
    p = packed.reshape(-1, CPU_BLOCK_N * kp // 2)[b0:b1]
    q = unpack_cpu_int4(p, (b1 - b0) * CPU_BLOCK_N, kp)[: r1 - r0].float().view(r1 - r0, n_groups, group_size)
    w = (q - zeros[r0:r1].float()[..., None]) * scales[r0:r1].float()[..., None]  # the canonical int4 formula
    return w.reshape(r1 - r0, kp)[:, :in_features].to(torch.bfloat16)


def check_int4_layout(op: str, packed: torch.Tensor, scales: torch.Tensor, n: int, n_groups: int, k: int,
                      group_size: int) -> None:
    """``ValueError`` naming ``op`` unless ``packed`` is the CPU int4 tiling of N rows (padded to 64)
    by ``Kp = n_groups * group_size`` columns, ``scales`` a float ``[N, G]``, and ``k`` (the input
    width) lies within the last group of Kp. Shared by the kernels that read this layout."""
    kp = n_groups * group_size
    padded = -(-n // CPU_BLOCK_N) * CPU_BLOCK_N
    if packed.dtype != torch.uint8 or packed.numel() != padded * kp // 2 or not packed.is_contiguous():
        raise ValueError(f"{op}: packed must be contiguous uint8 with {padded * kp // 2} bytes "
                         f"(N={n} padded to {padded}, Kp={kp}), got {packed.dtype} {tuple(packed.shape)}")
    if tuple(scales.shape) != (n, n_groups) or not scales.is_floating_point():
        raise ValueError(f"{op}: scales must be float [N, G] = {(n, n_groups)}, "
                         f"got {scales.dtype} {tuple(scales.shape)}")
    if group_size % 32 or group_size > 128 or not kp - group_size < k <= kp:
        raise ValueError(f"{op}: group_size {group_size} (32, 64 or 128) and K={k} "
                         f"(within the last group of Kp={kp}) do not fit")


def dequant_cpu_int4(packed: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor,
                     in_features: int, group_size: int, rows: tuple[int, int] | None = None,
                     *, impl: str = "auto", out: torch.Tensor | None = None) -> torch.Tensor:
    """``w[n, k] = bf16((q[n, k] - zeros[n, g]) * scales[n, g])``, g = k // group_size: ``-> [N, K]`` bf16.

    packed: uint8, the CPU int4 tiling (:func:`pack_cpu_int4`) of ``[Np, Kp]`` codes (Np = N rounded
    up to 64, Kp = G * group_size); scales: ``[N, G]`` of any strides (e.g. a
    view into ``scales_zeros``), any float dtype; zeros: uint8 ``[N, G]``
    integer zero points. ``rows=(r0, r1)``: only rows r0..r1-1 (r0 a multiple
    of 64), ``-> [r1 - r0, K]``. ``out``: a contiguous bf16 ``[r1 - r0, K]`` tensor
    to write into (the C kernel; see :class:`Scratch`), instead of a new one. ``impl``: "auto" (C kernel when built, else
    torch), "reference" (torch), "c" (the C kernel; ``RuntimeError`` if unavailable).
    """
    op = "dequant_cpu_int4"
    if impl not in ("auto", "reference", "c"):
        raise ValueError(f"{op}: impl must be 'auto', 'reference' or 'c', got {impl!r}")
    if zeros.dim() != 2 or zeros.dtype != torch.uint8 or not zeros.is_contiguous():
        raise ValueError(f"{op}: zeros must be a contiguous uint8 [N, G] tensor, "
                         f"got {zeros.dtype} {tuple(zeros.shape)}")
    n, n_groups = zeros.shape
    check_int4_layout(op, packed, scales, n, n_groups, in_features, group_size)
    r0, r1 = rows or (0, n)
    if r0 % CPU_BLOCK_N or not 0 <= r0 < r1 <= n:
        raise ValueError(f"{op}: rows {rows} must satisfy 0 <= r0 < r1 <= N={n} with r0 a multiple of {CPU_BLOCK_N}")
    if any(t.device.type != "cpu" for t in (packed, scales, zeros)):
        raise ValueError(f"{op}: CPU tensors only")
    lib = None if impl == "reference" else _KERNEL.lib()
    if lib is None:
        if impl == "c":
            raise RuntimeError(f"{op}: the C kernel is unavailable ({kernel_status()})")
        return dequant_cpu_int4_ref(packed, scales, zeros, in_features, group_size, rows)
    if out is not None and (out.dtype != torch.bfloat16 or tuple(out.shape) != (r1 - r0, in_features)
                            or not out.is_contiguous()):
        raise ValueError(f"{op}: out must be a contiguous bf16 [{r1 - r0}, {in_features}] tensor, "
                         f"got {out.dtype} {tuple(out.shape)}")
    return run_kernel(lib, packed, scales, zeros, in_features, group_size, (r0, r1), out)


class Scratch:
    """A reusable bf16 buffer for dequantized weights, shared by the layers of one model.

    A fresh multi-MiB tensor per prefill GEMM is fresh memory from the OS each time (glibc maps and unmaps
    big allocations), and zeroing its pages cost a sizeable share of dequantize + GEMM (docs/benchmarks.md).
    The buffer grows to the largest request and stays; one engine thread uses it at a time.
    """

    def __init__(self) -> None:
        self._buf = torch.empty(0, dtype=torch.bfloat16)

    def take(self, rows: int, cols: int) -> torch.Tensor:
        """A contiguous ``[rows, cols]`` bf16 view of the buffer (its contents are garbage)."""
        if self._buf.numel() < rows * cols:
            self._buf = torch.empty(rows * cols, dtype=torch.bfloat16)
        return self._buf[: rows * cols].view(rows, cols)

    @property
    def nbytes(self) -> int:
        return self._buf.numel() * 2


def transpose_bf16(x: torch.Tensor) -> torch.Tensor:
    """``x.t().contiguous()`` for a contiguous 2-D 16-bit CPU tensor; with the C kernel, faster than torch's copy."""
    lib = _KERNEL.lib()
    if (lib is None or x.dim() != 2 or x.element_size() != 2 or not x.is_contiguous() or x.device.type != "cpu"
            or x.numel() == 0):
        return x.t().contiguous()
    out = torch.empty(x.shape[1], x.shape[0], dtype=x.dtype)
    lib.llmsys_u16_transpose(x.data_ptr(), out.data_ptr(), x.shape[0], x.shape[1], torch.get_num_threads())
    return out


def run_kernel(lib: ctypes.CDLL, packed: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor,
               in_features: int, group_size: int, rows: tuple[int, int] | None = None,
               out: torch.Tensor | None = None) -> torch.Tensor:
    """Call a loaded kernel on checked arguments (see :func:`dequant_cpu_int4`)."""
    n, n_groups = zeros.shape
    kp = n_groups * group_size
    r0, r1 = rows or (0, n)
    if scales.dtype not in (torch.bfloat16, torch.float32):
        scales = scales.float()  # fp16 checkpoint scales: exact in float32
    if out is None:
        out = torch.empty(r1 - r0, in_features, dtype=torch.bfloat16)
    rc = lib.llmsys_int4_cpu_dequant(
        packed.data_ptr() + r0 * kp // 2, scales.data_ptr() + r0 * scales.stride(0) * scales.element_size(),
        scales.stride(0), scales.stride(1), int(scales.dtype == torch.float32),
        zeros.data_ptr() + r0 * n_groups, out.data_ptr(), in_features,
        r1 - r0, kp, in_features, group_size, torch.get_num_threads(),
    )
    if rc:  # dequant_cpu_int4's argument checks make this unreachable
        raise RuntimeError(f"dequant_cpu_int4: kernel rejected N={n} Kp={kp} K={in_features} group={group_size}")
    return out
