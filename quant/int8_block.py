"""Int8 weights with a scale per block of input columns: GGUF Q8_0, Q6_K and Q5_K, kept as stored.

``Int8Linear``'s one scale per row cannot state Q8_0's ``w = q * d`` (one fp16 ``d`` per 32 weights) and
bf16 doubles the memory; kept as stored the codes cost the file's bytes and the C a8 GEMV
(``kernels.cpu_qgemv.int8g_gemv_a8``: ``f += S_b * (d_w * d_x)``) runs llama.cpp's q8_0 x q8_0 arithmetic.
Layout (``W [N, K]``): ``qweight int8 [N, K]``, ``block_scales fp16 [ceil(K / 32), N]`` group-major (one
vector load a block), ``w[n, k] = qweight[n, k] * block_scales[k // 32, n]``. Q6_K: codes ``q - 32``,
``block_scales int8 [K / 16, N]`` (``sc``), ``super_scales fp16 [K / 256, N]`` (``d``), ``w = qweight *
(d * sc)`` with ``d * sc`` the float32 product llama.cpp rounds (1.07 bytes a weight; the file 0.82).
Q5_K: float32 ``block_scales`` and ``offsets [K / 32, N]``, ``w = qweight * scale + offset`` (1.25 bytes;
the file 0.69).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from llmsys.kernels import DecodeWeight, int8g_decode_weight, int8g_gemv_a8, quant_matmul_support
from llmsys.kernels.common.errors import CheckpointError
from llmsys.quant.base import (
    PACKED_MAX_ROWS,
    TORCH_DEQUANT,
    KernelFamily,
    MatmulKernel,
    QuantLinear,
    require,
    rows_joinable,
)
from llmsys.quant.int4 import DEQUANT_CHUNK_BYTES

BLOCK = 32  # input columns per scale (fp16 scales: GGUF Q8_0, Q5_0, --quant int8:g32)
HALF_BLOCK = 16  # input columns per scale of GGUF Q6_K


def int8_block_kernel(device: torch.device) -> MatmulKernel:
    """The C a8 GEMV on a CPU where it is loaded (every row), else dequantize + ``F.linear``."""
    if device.type == "cpu":
        c = quant_matmul_support()
        if c.available:
            return MatmulKernel(KernelFamily.C_INT8_BLOCK, c.level)
    return TORCH_DEQUANT


def quantize_int8_block(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``weight [N, K] -> (q int8 [N, K], block_scales fp16 [nb, N])``, Q8_0's rule: ``d = amax / 127`` per
    32 columns (rounded to fp16), ``q = round(w / d)``. For tests and ``--quant`` of such files."""
    n, k = weight.shape
    nb = -(-k // BLOCK)
    w = F.pad(weight.float(), (0, nb * BLOCK - k)).view(n, nb, BLOCK)
    d = (w.abs().amax(-1) / 127.0).half()  # [N, nb]
    inv = torch.where(d.float() != 0, 1.0 / d.float(), 0.0)
    q = torch.round(w * inv[..., None]).clamp_(-127, 127).to(torch.int8).view(n, -1)[:, :k]
    return q.contiguous(), d.t().contiguous()


class Int8BlockLinear(QuantLinear):
    """``qweight int8 [N, K]`` and ``block_scales fp16 [nb, N]`` (module docstring). On a CPU with the C
    kernels every row of x runs ``int8g_gemv_a8`` (bf16 activations; float32 inputs are cast and cast
    back), so a row's bits never depend on its batch; elsewhere the weight is dequantized in row chunks."""

    FORMAT = "int8:g32"

    def __init__(self, qweight: torch.Tensor, block_scales: torch.Tensor, bias: torch.Tensor | None,
                 offsets: torch.Tensor | None = None, super_scales: torch.Tensor | None = None) -> None:
        n, k = qweight.shape
        # Q6_K: int8 sc per 16 columns with fp16 d per 256 (super_scales), K a multiple of 256; Q5_K: float32
        # scales and offsets per 32, K a multiple of 32; else fp16 scales per 32 (Q8_0, Q5_0, int8:g32)
        block = HALF_BLOCK if super_scales is not None else BLOCK
        nb = -(-k // block)
        if super_scales is not None:
            ok = block_scales.dtype == torch.int8 and super_scales.dtype == torch.float16 and k % 256 == 0 \
                and tuple(super_scales.shape) == (k // 256, n) and offsets is None
            what = "int8 scales per 16 columns and fp16 super_scales per 256, K a multiple of 256"
        elif offsets is not None:
            ok = block_scales.dtype == offsets.dtype == torch.float32 and tuple(offsets.shape) == (nb, n) \
                and k % BLOCK == 0
            what = "float32 scales and offsets, one per 32 columns, K a multiple of 32"
        else:
            ok = block_scales.dtype.is_floating_point
            what = "fp16 scales, one per 32 columns"
        if qweight.dtype != torch.int8 or tuple(block_scales.shape) != (nb, n) or not ok:
            raise CheckpointError(f"int8 block tensors disagree: qweight {qweight.dtype} {tuple(qweight.shape)}, "
                                  f"block_scales {tuple(block_scales.shape)}; expected int8 [N, K] and [{nb}, {n}] "
                                  f"({what})")
        super().__init__(k, n, bias, int8_block_kernel(qweight.device))
        self.block = block  # input columns per scale
        self.register_buffer("qweight", qweight.contiguous())  # [N, K]
        keep = super_scales is not None or offsets is not None  # else fp16, as the kernel reads them
        self.register_buffer("block_scales", (block_scales if keep else block_scales.to(torch.float16)).contiguous())
        self.register_buffer("offsets", None if offsets is None else offsets.contiguous())  # [nb, N]
        self.register_buffer("super_scales", None if super_scales is None else super_scales.contiguous())

    @classmethod
    def from_float(cls, weight: torch.Tensor, bias: torch.Tensor | None = None, spec=None) -> "Int8BlockLinear":
        q, d = quantize_int8_block(weight)
        return cls(q, d, bias)

    @classmethod
    def from_quantized(cls, tensors: dict[str, torch.Tensor]) -> "Int8BlockLinear":
        qweight, block_scales = require(tensors, ("qweight", "block_scales"), cls.FORMAT)
        return cls(qweight, block_scales, tensors.get("bias"), tensors.get("offsets"), tensors.get("super_scales"))

    @classmethod
    def cat_rows(cls, layers: list[QuantLinear]) -> "Int8BlockLinear | None":
        """Rows side by side (q|k|v, gate|up): each output row is computed from its own codes and scales."""
        ok, bias = rows_joinable(cls, layers)
        if not ok or len({(m.block_scales.dtype, m.offsets is None, m.super_scales is None) for m in layers}) > 1:
            return None

        def side_by_side(name: str) -> torch.Tensor | None:  # group-major [.., N] tensors: along dim 1
            return None if getattr(layers[0], name) is None else torch.cat([getattr(m, name) for m in layers], dim=1)

        return cls(torch.cat([m.qweight for m in layers]), side_by_side("block_scales"), bias, side_by_side("offsets"),
                   side_by_side("super_scales"))

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        return self.rows(torch.arange(self.out_features), dtype)

    def rows(self, ids: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """Rows ``ids [M] -> [M, K]``: ``q * d`` exactly in float32, then ``dtype``."""
        ids = ids.long()
        s = self.block_scales[:, ids].t().float()  # [M, nb]
        if self.super_scales is not None:  # Q6_K: d * sc, d per 256 columns = per 16 of its scales
            s = self.super_scales[:, ids].t().float().repeat_interleave(16, dim=1) * s
        s = s.repeat_interleave(self.block, dim=1)[:, : self.in_features]  # [M, K]
        if self.offsets is not None:  # q * scale + offset, GGUF's float32 order
            o = self.offsets[:, ids].t().repeat_interleave(self.block, dim=1)[:, : self.in_features]
            return (self.qweight[ids].float() * s + o).to(dtype)
        return (self.qweight[ids].float() * s).to(dtype)

    DECODE_MAX_ROWS = PACKED_MAX_ROWS

    def decode_weight(self) -> DecodeWeight | None:
        """The C a8 weight when :meth:`_matmul` on bf16 inputs runs ``int8g_gemv_a8``."""
        buf = self._buffers
        tensors = (buf["qweight"], buf["block_scales"], buf["offsets"], buf["super_scales"])
        return self._int8_decode_weight(KernelFamily.C_INT8_BLOCK, tensors,
                                        lambda q, bs, o, ss, bias: int8g_decode_weight(q, bs, bias, o, ss))

    def _logits(self, x2: torch.Tensor) -> torch.Tensor:
        """The LM head's float32 logits: the a8 GEMV on float32 x writing its float32 sums (GGUF Q8_0 / Q6_K /
        Q5_K heads kept as stored: llama.cpp's q8_0 activations and dot, unrounded), else the reference."""
        buf = self._buffers
        if self._kernel.family is KernelFamily.C_INT8_BLOCK:
            return int8g_gemv_a8(self._a8_f32_input(x2), buf["qweight"], buf["block_scales"], offsets=buf["offsets"],
                                 super_scales=buf["super_scales"], out_dtype=torch.float32, check=False)  # [M, N]
        return self._dequant_logits(x2)

    def _matmul(self, x2: torch.Tensor) -> torch.Tensor:
        buf = self._buffers
        if self._kernel.family is KernelFamily.C_INT8_BLOCK and x2.dtype in (torch.bfloat16, torch.float32):
            y = int8g_gemv_a8(self._a8_input(x2), buf["qweight"], buf["block_scales"], offsets=buf["offsets"],
                              super_scales=buf["super_scales"], check=False)  # [M, N]
            return y if x2.dtype == torch.bfloat16 else y.to(x2.dtype)
        # Without the C kernel: the dequantized weight in row chunks (a 151936-row LM head stays small).
        n, k = self.out_features, self.in_features
        step = max(1, DEQUANT_CHUNK_BYTES // (4 * k))
        if step >= n:
            return F.linear(x2, self.dequantize(x2.dtype))
        out = torch.empty(x2.shape[0], n, dtype=x2.dtype)
        for r0 in range(0, n, step):
            ids = torch.arange(r0, min(n, r0 + step))
            out[:, r0 : r0 + ids.numel()] = F.linear(x2, self.rows(ids, x2.dtype))
        return out
