"""Int8 weights with a scale per 32 input columns: GGUF Q8_0, kept as stored.

Why a second int8 layout beside ``Int8Linear``'s one scale per row: Q8_0 files (and the Q8_0 token
embeddings of most Q4_0 / Q4_K_M files) store ``w = q * d`` with one fp16 ``d`` per 32 weights.
A per-row scale cannot represent that; dequantizing to bf16 doubles the memory. Kept as stored the
codes cost 1 byte per weight plus 2 bytes per 32, exactly the file's bytes, and the C a8 GEMV
(``kernels.cpu_qgemv.int8g_gemv_a8``: x quantized to int8 per 32 columns, an exact integer dot per
block, ``f += S_b * (d_w * d_x)``) runs the arithmetic of llama.cpp's own q8_0 x q8_0 dot product.

Layout (what ``state_dict()`` holds; ``W`` is ``[N, K]``): ``qweight int8 [N, K]``,
``block_scales fp16 [ceil(K / 32), N]``, group-major (a block's scales for a run of rows are one
vector load in the kernel), ``w[n, k] = qweight[n, k] * block_scales[k // 32, n]``.

GGUF Q6_K (6-bit codes with an int8 scale per 16 weights times an fp16 ``d`` per 256: the type
llama.cpp's Q4_K_M files hold their output head, often the embedding, and half the ``attn_v`` /
``ffn_down`` matrices in) is the same layout with a scale per 16 columns: codes ``q - 32`` and
``block_scales float32 [K / 16, N]`` holding ``d * sc`` (the product llama.cpp's dequantization
rounds to float32), ``w[n, k] = qweight[n, k] * block_scales[k // 16, n]``: 1.25 bytes a weight
(the file's 0.82, bf16's 2), the a8 GEMV taking each block of x's two halves' dots apart.

GGUF Q5_K (5-bit codes, per 32 weights a scale ``d * sc`` and a minimum ``dmin * m``, like Q4_K) is the
layout with float32 ``block_scales`` and ``offsets [K / 32, N]``: ``w = qweight * scale + offset``
(1.25 bytes a weight; the file's 0.69).
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
HALF_BLOCK = 16  # input columns per scale with float32 scales (GGUF Q6_K)


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
                 offsets: torch.Tensor | None = None) -> None:
        n, k = qweight.shape
        # float32 scales: one per 16 columns (Q6_K), or with offsets one per 32 (Q5_K), K a multiple of 32;
        # else fp16 ones per 32 (Q8_0)
        floats = block_scales.dtype == torch.float32
        block = HALF_BLOCK if floats and offsets is None else BLOCK
        nb = -(-k // block)
        if qweight.dtype != torch.int8 or tuple(block_scales.shape) != (nb, n) or (floats and k % BLOCK) or (
                offsets is not None and (not floats or offsets.dtype != torch.float32
                                         or tuple(offsets.shape) != (nb, n))):
            what = ("float32 scales and offsets, one per 32 columns" if offsets is not None else
                    "float32 scales, one per 16 columns" if floats else "fp16 scales, one per 32 columns")
            what += ", K a multiple of 32" if floats else ""
            raise CheckpointError(f"int8 block tensors disagree: qweight {qweight.dtype} {tuple(qweight.shape)}, "
                                  f"block_scales {tuple(block_scales.shape)}; expected int8 [N, K] and [{nb}, {n}] "
                                  f"({what})")
        super().__init__(k, n, bias, int8_block_kernel(qweight.device))
        self.block = block  # input columns per scale
        self.register_buffer("qweight", qweight.contiguous())  # [N, K]
        self.register_buffer("block_scales", (block_scales if floats else block_scales.to(torch.float16)).contiguous())
        self.register_buffer("offsets", None if offsets is None else offsets.contiguous())  # [nb, N]

    @classmethod
    def from_float(cls, weight: torch.Tensor, bias: torch.Tensor | None = None, spec=None) -> "Int8BlockLinear":
        q, d = quantize_int8_block(weight)
        return cls(q, d, bias)

    @classmethod
    def from_quantized(cls, tensors: dict[str, torch.Tensor]) -> "Int8BlockLinear":
        qweight, block_scales = require(tensors, ("qweight", "block_scales"), cls.FORMAT)
        return cls(qweight, block_scales, tensors.get("bias"), tensors.get("offsets"))

    @classmethod
    def cat_rows(cls, layers: list[QuantLinear]) -> "Int8BlockLinear | None":
        """Rows side by side (q|k|v, gate|up): each output row is computed from its own codes and scales."""
        ok, bias = rows_joinable(cls, layers)
        if not ok or len({(m.block, m.block_scales.dtype, m.offsets is None) for m in layers}) > 1:
            return None
        offsets = None if layers[0].offsets is None else torch.cat([m.offsets for m in layers], dim=1)
        return cls(torch.cat([m.qweight for m in layers]), torch.cat([m.block_scales for m in layers], dim=1), bias,
                   offsets)

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        return self.rows(torch.arange(self.out_features), dtype)

    def rows(self, ids: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """Rows ``ids [M] -> [M, K]``: ``q * d`` exactly in float32, then ``dtype``."""
        ids = ids.long()
        s = self.block_scales[:, ids].t().float().repeat_interleave(self.block, dim=1)[:, : self.in_features]  # [M, K]
        if self.offsets is not None:  # q * scale + offset, GGUF's float32 order
            o = self.offsets[:, ids].t().repeat_interleave(self.block, dim=1)[:, : self.in_features]
            return (self.qweight[ids].float() * s + o).to(dtype)
        return (self.qweight[ids].float() * s).to(dtype)

    DECODE_MAX_ROWS = PACKED_MAX_ROWS

    def decode_weight(self) -> DecodeWeight | None:
        """The C a8 weight when :meth:`_matmul` on bf16 inputs runs ``int8g_gemv_a8``."""
        buf = self._buffers
        if buf["offsets"] is None:
            return self._int8_decode_weight(KernelFamily.C_INT8_BLOCK, (buf["qweight"], buf["block_scales"]),
                                            int8g_decode_weight)
        return self._int8_decode_weight(KernelFamily.C_INT8_BLOCK, (buf["qweight"], buf["block_scales"], buf["offsets"]),
                                        lambda q, bs, o, bias: int8g_decode_weight(q, bs, bias, o))

    def _matmul(self, x2: torch.Tensor) -> torch.Tensor:
        buf = self._buffers
        if self._kernel.family is KernelFamily.C_INT8_BLOCK and x2.dtype in (torch.bfloat16, torch.float32):
            y = int8g_gemv_a8(self._a8_input(x2), buf["qweight"], buf["block_scales"], offsets=buf["offsets"],
                              check=False)  # [M, N]
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
