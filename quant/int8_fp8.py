"""8-bit weight formats: symmetric int8 (W8A16) and FP8 e4m3, per output channel.

Both store one scale per output row, so a row's dequantized weight is
``q[n, :] * scales[n]``. Per-channel (not per-group) keeps the overhead at
2-4 bytes per row and is what the fused kernels (``torch._weight_int8pack_mm``
on CPU, ``torch._scaled_mm`` on FP8 GPUs) consume directly.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from llmsys.kernels import CPU_INT4_BLOCK_N as CPU_BLOCK_N
from llmsys.kernels import DecodeWeight, int8_decode_weight, int8_gemv_a8, linear, mm_bf16, quant_matmul_support, transpose_bf16, w8a16_matmul
from llmsys.quant.base import (
    PACKED_MAX_ROWS,
    TORCH_DEQUANT,
    KernelFamily,
    MatmulKernel,
    QuantLinear,
    check_weight,
    quantize_rows,
    require,
    rows_joinable,
)
from llmsys.quant.int4 import DEQUANT_CHUNK_BYTES, bf16_ceil

INT8_MAX = 127
FP8_MAX = 448.0  # largest finite float8_e4m3fn


def quantize_int8(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric per-row int8: ``weight [N, K] -> (q int8 [N, K], scales bf16 [N])``.

    The scale is rounded to bf16 *before* computing q, so the stored
    (bf16) scale is exactly the one q was computed against: the only error is
    rounding to the int8 grid, |w - q*s| <= s/2 with s = amax/127. Row chunks of
    bounded size (:func:`quantize_rows`).
    """
    return quantize_rows(weight, _quantize_int8_rows)


def _quantize_int8_rows(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    w = weight.float()
    amax = w.abs().amax(dim=1).clamp_min(1e-8)  # [N]
    scales = bf16_ceil(amax / INT8_MAX)  # [N], >= amax/127 so nothing clips
    q = torch.round(w / scales.float()[:, None]).clamp_(-INT8_MAX, INT8_MAX).to(torch.int8)
    return q, scales


class _PerRowLinear(QuantLinear):
    """Shared plumbing of the per-row formats: ``w[n, :] = q[n, :] * scales[n]``.

    Subclasses set ``FORMAT``, ``quantize`` (float weight -> codes, scales)
    and store their tensors in ``__init__``; loading, dequantizing and row
    lookups are the same for both.
    """

    FORMAT = ""

    @staticmethod
    def quantize(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        raise NotImplementedError

    @classmethod
    def from_float(cls, weight: torch.Tensor, bias: torch.Tensor | None = None, spec=None):
        check_weight(weight, bias)
        q, s = cls.quantize(weight)
        return cls(q, s, bias)

    @classmethod
    def from_quantized(cls, tensors: dict[str, torch.Tensor]):
        qweight, scales = require(tensors, ("qweight", "scales"), cls.FORMAT)
        return cls(qweight, scales, tensors.get("bias"))

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        return (self.qweight.float() * self.scales.float()[:, None]).to(dtype)  # [N, K]

    def rows(self, ids: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        return (self.qweight[ids].float() * self.scales[ids].float()[:, None]).to(dtype)  # [M, K]


def int8_kernel(device: torch.device) -> MatmulKernel:
    """The kernel family of an int8 layer on ``device``: Triton on CUDA; on the CPU the C a8 GEMV
    where it is loaded (every row), else torch's packed op up to :data:`PACKED_MAX_ROWS` rows;
    dequantize + ``F.linear`` anywhere else."""
    if device.type == "cuda":
        return MatmulKernel(KernelFamily.TRITON_W8A16)
    if device.type != "cpu":
        return TORCH_DEQUANT
    c = quant_matmul_support()
    if not c.available:
        return MatmulKernel(KernelFamily.TORCH_INT8_PACKED)
    return MatmulKernel(KernelFamily.C_INT8, c.level)


class Int8Linear(_PerRowLinear):
    """W8A16 linear: ``qweight int8 [N, K]``, ``scales bf16 [N]``; w = q * scale.

    CPU: every row of a bf16 or float32 input, prompt or decode, runs the C a8 GEMV
    ``kernels.cpu_qgemv.int8_gemv_a8`` (x to int8 per 32 columns, exact integer dots), so a row's bits never
    depend on its batch (``KernelFamily``); float32 inputs go through bf16 and back. Without the C kernel, up
    to PACKED_MAX_ROWS rows run ``torch._weight_int8pack_mm`` and more dequantize and GEMM
    (``_dequant_matmul``), except that torch's packed op crashes (SIGSEGV, torch 2.13 CPU) on bf16 inputs when
    K % 16 != 0, so float32 inputs of such layers keep the dequant path. The family is chosen once
    (:func:`int8_kernel`, kept in ``kernel``); the rows and dtype of x pick within it.
    """

    def __init__(self, qweight: torch.Tensor, scales: torch.Tensor, bias: torch.Tensor | None) -> None:
        n, k = qweight.shape
        super().__init__(k, n, bias, int8_kernel(qweight.device))
        self.register_buffer("qweight", qweight.to(torch.int8).contiguous())  # [N, K]
        self.register_buffer("scales", scales.reshape(n).to(torch.bfloat16).contiguous())  # [N]

    FORMAT = "int8"
    quantize = staticmethod(quantize_int8)

    @classmethod
    def cat_rows(cls, layers: list[QuantLinear]) -> "Int8Linear | None":
        """Rows concatenated: every kernel here (the C GEMV, the weight-first GEMM, dequantize +
        GEMM) computes each output row from its own codes and scale alone."""
        ok, bias = rows_joinable(cls, layers)
        if not ok:
            return None
        return cls(torch.cat([m.qweight for m in layers]), torch.cat([m.scales for m in layers]), bias)

    DECODE_MAX_ROWS = PACKED_MAX_ROWS

    def decode_weight(self) -> DecodeWeight | None:
        """The C a8 weight when :meth:`_matmul` on decode-sized bf16 inputs runs ``int8_gemv_a8``."""
        buf = self._buffers
        return self._int8_decode_weight(KernelFamily.C_INT8, (buf["qweight"], buf["scales"]), int8_decode_weight)

    def _logits(self, x2: torch.Tensor) -> torch.Tensor:
        """The LM head's float32 logits: the C a8 GEMV on float32 x writing float32 sums, or the Triton kernel on
        float32 x (float32 accumulation and output), else the reference."""
        buf = self._buffers
        family = self._kernel.family
        if family is KernelFamily.C_INT8:
            return int8_gemv_a8(self._a8_f32_input(x2), buf["qweight"], buf["scales"], out_dtype=torch.float32,
                                check=False)  # [M, N]
        if family is KernelFamily.TRITON_W8A16:
            return w8a16_matmul(x2.float().contiguous(), buf["qweight"], buf["scales"])
        return self._dequant_logits(x2)

    def _matmul(self, x2: torch.Tensor) -> torch.Tensor:
        buf = self._buffers  # read directly: nn.Module.__getattr__ costs ~1 us a buffer on the decode path
        family = self._kernel.family
        if family is KernelFamily.TRITON_W8A16:
            return w8a16_matmul(x2.contiguous(), buf["qweight"], buf["scales"])
        if family is KernelFamily.TORCH_DEQUANT:
            return F.linear(x2, self.qweight.to(x2.dtype)) * self.scales.to(x2.dtype)
        bf16 = x2.dtype == torch.bfloat16
        if family is KernelFamily.C_INT8 and (bf16 or x2.dtype == torch.float32):  # every row: the a8 GEMV
            y = int8_gemv_a8(self._a8_input(x2), buf["qweight"], buf["scales"], check=False)  # [M, N]; checked in __init__
            return y if bf16 else y.to(x2.dtype)
        if (family is KernelFamily.TORCH_INT8_PACKED and x2.shape[0] <= PACKED_MAX_ROWS
                and (bf16 or x2.dtype == torch.float32) and self.in_features % 16 == 0):
            xb = x2 if bf16 else x2.to(torch.bfloat16)
            y = torch._weight_int8pack_mm(xb.contiguous(), buf["qweight"], buf["scales"])
            return y.to(x2.dtype)
        if bf16:
            return self._dequant_matmul(x2)
        return F.linear(x2, self.qweight.to(x2.dtype)) * self.scales.to(x2.dtype)

    def _dequant_matmul(self, xb: torch.Tensor) -> torch.Tensor:
        """``xb`` bf16 ``[M, K]`` (prefill) ``-> bf16(bf16(xb @ q^T) * scales)`` ``[M, N]``, q exact in bf16.

        As ``Int4Linear._dequant_matmul``: the weight goes first, ``(q @ xb^T)^T``, because
        oneDNN reads its first operand in place and reorders the second on every call
        (``F.linear(xb, q)`` reordered the whole weight each time); weights above
        ``DEQUANT_CHUNK_BYTES`` as bf16 are converted and multiplied in row chunks
        (``cpu_linear.mm_bf16``: float32 sgemm where oneDNN has no bf16).
        """
        q, scales = self._buffers["qweight"], self._buffers["scales"]
        n, k = q.shape
        step = max(CPU_BLOCK_N, DEQUANT_CHUNK_BYTES // (2 * k) // CPU_BLOCK_N * CPU_BLOCK_N)
        xt = xb.t()
        if step >= n:
            yt = mm_bf16(q.to(torch.bfloat16), xt)  # [N, M]
        else:
            yt = torch.empty(n, xb.shape[0], dtype=torch.bfloat16)
            for r0 in range(0, n, step):
                mm_bf16(q[r0 : r0 + step].to(torch.bfloat16), xt, out=yt[r0 : r0 + step])
        return transpose_bf16(yt) * scales  # [M, N]


def quantize_fp8(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-row FP8 e4m3: ``weight [N, K] -> (q float8_e4m3fn [N, K], scales fp32 [N])``.

    The scale maps each row's absmax to 448 (e4m3's largest finite value);
    e4m3 has 3 mantissa bits, so the relative error per element is <= 2^-4
    for normal values. Row chunks of bounded size (:func:`quantize_rows`).
    """
    return quantize_rows(weight, _quantize_fp8_rows)


def _quantize_fp8_rows(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    w = weight.float()
    amax = w.abs().amax(dim=1).clamp_min(1e-12)  # [N]
    scales = amax / FP8_MAX  # [N]
    q = (w / scales[:, None]).clamp_(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    return q, scales


def fp8_gemm_supported(device: torch.device) -> bool:
    """True on CUDA GPUs with FP8 tensor cores (compute capability >= 8.9)."""
    if device.type != "cuda" or not torch.cuda.is_available():
        return False
    return torch.cuda.get_device_capability(device) >= (8, 9)


class FP8Linear(_PerRowLinear):
    """FP8 e4m3 weights with per-row fp32 scales; w = q.float() * scale.

    On FP8 GPUs (sm >= 8.9) the activations are quantized per token to e4m3
    as well and ``torch._scaled_mm`` runs the GEMM with row-wise scales (W8A8,
    the usual FP8 inference recipe). Elsewhere: dequantize + GEMM in the input
    dtype, which keeps W8A16 numerics. The choice is made once, from the device and shape
    (``kernel``).
    """

    def __init__(self, qweight: torch.Tensor, scales: torch.Tensor, bias: torch.Tensor | None) -> None:
        n, k = qweight.shape
        scaled_mm = fp8_gemm_supported(qweight.device) and k % 16 == 0 and n % 16 == 0
        super().__init__(k, n, bias, MatmulKernel(KernelFamily.FP8_SCALED_MM) if scaled_mm else TORCH_DEQUANT)
        self.register_buffer("qweight", qweight.to(torch.float8_e4m3fn).contiguous())  # [N, K]
        self.register_buffer("scales", scales.reshape(n).float().contiguous())  # [N]

    FORMAT = "fp8"
    quantize = staticmethod(quantize_fp8)

    def _logits(self, x2: torch.Tensor) -> torch.Tensor:
        """The LM head's float32 logits: ``_scaled_mm`` with a float32 output on FP8 GPUs, else the reference."""
        if self._kernel.family is KernelFamily.FP8_SCALED_MM:
            xf = x2.float()
            sa = (xf.abs().amax(dim=1, keepdim=True).clamp_min(1e-12) / FP8_MAX)  # [M, 1]
            xq = (xf / sa).clamp_(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)  # [M, K]
            return torch._scaled_mm(xq, self.qweight.t(), scale_a=sa, scale_b=self.scales[None, :],
                                    out_dtype=torch.float32)  # [M, N]
        return self._dequant_logits(x2)

    def _matmul(self, x2: torch.Tensor) -> torch.Tensor:
        if self._kernel.family is KernelFamily.FP8_SCALED_MM:
            xf = x2.float()
            sa = (xf.abs().amax(dim=1, keepdim=True).clamp_min(1e-12) / FP8_MAX)  # [M, 1]
            xq = (xf / sa).clamp_(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)  # [M, K]
            out_dtype = x2.dtype if x2.dtype in (torch.bfloat16, torch.float16) else torch.bfloat16
            y = torch._scaled_mm(
                xq, self.qweight.t(), scale_a=sa, scale_b=self.scales[None, :], out_dtype=out_dtype
            )  # [M, N]; row-wise scaling needs scale_a [M,1], scale_b [1,N] fp32
            return y.to(x2.dtype)
        return linear(x2, self.qweight.to(x2.dtype), packed_when_resident=False) * self.scales.to(x2.dtype)
