"""NF4 (QLoRA NormalFloat4) weights, bitsandbytes-compatible, in plain torch.

Ours because bitsandbytes' CPU 4-bit GEMM fetches a kernel from the Hub or falls back to a path no
faster; layout and arithmetic follow bitsandbytes exactly (``tests/test_quant_nf4.py`` compares against
``quantize_4bit`` when installed, and on CUDA the layer calls ``bitsandbytes.matmul_4bit`` as is). For
``[N, K]`` flattened, block 64: ``qweight uint8 [ceil(numel/2)]`` (element 2i high nibble, 2i+1 low,
indexing :data:`NF4_CODE`), ``absmax fp32 [ceil(numel/64)]``, ``w = NF4_CODE[q] * absmax[i // 64]``.
Double quantization: ``absmax[i] = DYN[absmax_q[i]] * absmax2[i // 256] + absmax_offset``
(``absmax_q uint8``, :func:`dynamic_map`; ``absmax2 fp32 [ceil(nblocks/256)]``, ``absmax_offset fp32 []``).
"""

from __future__ import annotations

import torch

from llmsys.kernels import linear
from llmsys.quant.base import TORCH_DEQUANT, KernelFamily, MatmulKernel, QuantLinear, check_weight, require

NF4_BLOCK = 64
DQ_BLOCK = 256

# QLoRA's 16 NormalFloat4 values (quantiles of N(0,1), scaled to [-1, 1]).
NF4_VALUES = (
    -1.0, -0.6961928009986877, -0.5250730514526367, -0.39491748809814453,
    -0.28444138169288635, -0.18477343022823334, -0.09105003625154495, 0.0,
    0.07958029955625534, 0.16093020141124725, 0.24611230194568634, 0.33791524171829224,
    0.44070982933044434, 0.5626170039176941, 0.7229568362236023, 1.0,
)


def nf4_code() -> torch.Tensor:
    """The NF4 code book, fp32 [16], ascending."""
    return torch.tensor(NF4_VALUES, dtype=torch.float32)


def dynamic_map(max_exponent_bits: int = 7, total_bits: int = 8) -> torch.Tensor:
    """bitsandbytes' signed 8-bit dynamic-exponent map, fp32 [256], ascending.

    Used to store the NF4 absmax values in 8 bits (double quantization): its
    values are dense near 0 and span 1e-6..1, like the centred absmax values.
    """
    data: list[float] = []
    non_sign_bits = total_bits - 1
    additional_items = 2 ** (non_sign_bits - max_exponent_bits) - 1
    for i in range(max_exponent_bits):
        fraction_items = int(2 ** (i + non_sign_bits - max_exponent_bits) + 1)
        boundaries = torch.linspace(0.1, 1, fraction_items, dtype=torch.float32)
        means = (boundaries[:-1] + boundaries[1:]) / 2.0
        data += ((10 ** (-(max_exponent_bits - 1) + i)) * means).tolist()
        data += (-(10 ** (-(max_exponent_bits - 1) + i)) * means).tolist()
    if additional_items > 0:
        boundaries = torch.linspace(0.1, 1, additional_items + 1, dtype=torch.float32)
        means = (boundaries[:-1] + boundaries[1:]) / 2.0
        data += ((10 ** (-(max_exponent_bits - 1) + i)) * means).tolist()
        data += (-(10 ** (-(max_exponent_bits - 1) + i)) * means).tolist()
    data += [0.0, 1.0]
    data += [0.0] * (2**total_bits - len(data))
    data.sort()
    return torch.tensor(data, dtype=torch.float32)


def _nearest_code(x: torch.Tensor, code: torch.Tensor) -> torch.Tensor:
    """Index of the nearest value in the ascending ``code`` for each element of x."""
    mids = (code[1:] + code[:-1]) / 2  # [C-1]
    return torch.bucketize(x, mids, right=False)


def _blockwise_absmax(flat: torch.Tensor, block: int) -> torch.Tensor:
    """absmax over consecutive blocks of a 1-D tensor (last block may be partial)."""
    n = flat.numel()
    nblocks = -(-n // block)
    padded = torch.nn.functional.pad(flat.abs(), (0, nblocks * block - n))
    return padded.view(nblocks, block).amax(dim=1)


def quantize_nf4(weight: torch.Tensor, double_quant: bool = False) -> dict[str, torch.Tensor]:
    """Quantize ``[N, K]`` to the NF4 tensors described in the module docstring."""
    flat = weight.float().reshape(-1)  # [numel]
    numel = flat.numel()
    absmax = _blockwise_absmax(flat, NF4_BLOCK)  # [nblocks]
    nblocks = absmax.numel()
    safe = absmax.clamp_min(1e-12)
    scaled = torch.nn.functional.pad(flat, (0, nblocks * NF4_BLOCK - numel)).view(nblocks, NF4_BLOCK)
    scaled = (scaled / safe[:, None]).reshape(-1)[:numel]
    q = _nearest_code(scaled, nf4_code()).to(torch.uint8)  # [numel]
    if numel % 2:
        q = torch.nn.functional.pad(q, (0, 1))
    out = {"qweight": ((q[0::2] << 4) | q[1::2]).contiguous()}
    if not double_quant:
        out["absmax"] = absmax
        return out
    offset = absmax.mean()
    centred = absmax - offset  # [nblocks]
    absmax2 = _blockwise_absmax(centred, DQ_BLOCK)  # [nb2]
    nb2 = absmax2.numel()
    c = torch.nn.functional.pad(centred, (0, nb2 * DQ_BLOCK - nblocks)).view(nb2, DQ_BLOCK)
    c = (c / absmax2.clamp_min(1e-12)[:, None]).reshape(-1)[:nblocks]
    out["absmax_q"] = _nearest_code(c, dynamic_map()).to(torch.uint8)
    out["absmax2"] = absmax2
    out["absmax_offset"] = offset.reshape(())
    return out


def nf4_absmax(tensors: dict[str, torch.Tensor]) -> torch.Tensor:
    """The fp32 per-block absmax, undoing double quantization if present."""
    if "absmax" in tensors:
        return tensors["absmax"].float()
    aq, a2, off = tensors["absmax_q"], tensors["absmax2"].float(), tensors["absmax_offset"].float()
    dyn = dynamic_map().to(a2.device)
    idx = torch.arange(aq.numel(), device=aq.device) // DQ_BLOCK
    return dyn[aq.long()] * a2[idx] + off


def dequantize_nf4(tensors: dict[str, torch.Tensor], shape: tuple[int, int],
                   dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Reference NF4 dequantization -> ``[N, K]``."""
    numel = shape[0] * shape[1]
    p = tensors["qweight"]
    q = torch.stack([p >> 4, p & 15], dim=-1).reshape(-1)[:numel]  # [numel]
    absmax = nf4_absmax(tensors)  # [nblocks]
    code = nf4_code().to(p.device)
    idx = torch.arange(numel, device=p.device) // NF4_BLOCK
    return (code[q.long()] * absmax[idx]).view(shape).to(dtype)


class NF4Linear(QuantLinear):
    """NF4 linear (block 64, optional double-quantized absmax): ``bitsandbytes.matmul_4bit`` on
    CUDA where bitsandbytes is installed, else dequant + GEMM (chosen once, ``kernel``)."""

    def __init__(self, tensors: dict[str, torch.Tensor], in_features: int, out_features: int,
                 bias: torch.Tensor | None = None) -> None:
        on_cuda = tensors["qweight"].device.type == "cuda" if "qweight" in tensors else False
        bnb = on_cuda and _bitsandbytes() is not None
        super().__init__(in_features, out_features, bias,
                         MatmulKernel(KernelFamily.BITSANDBYTES_NF4) if bnb else TORCH_DEQUANT)
        self.double_quant = "absmax_q" in tensors
        names = ("qweight", "absmax_q", "absmax2", "absmax_offset") if self.double_quant else ("qweight", "absmax")
        for name, t in zip(names, require(tensors, names, "nf4")):
            self.register_buffer(name, t.contiguous())

    def _stored(self) -> dict[str, torch.Tensor]:
        return {k: v for k, v in self._buffers.items() if v is not None and k != "bias"}

    @classmethod
    def from_float(cls, weight: torch.Tensor, bias: torch.Tensor | None = None, spec=None) -> "NF4Linear":
        check_weight(weight, bias)
        dq = bool(spec is not None and spec.double_quant)
        return cls(quantize_nf4(weight, dq), weight.shape[1], weight.shape[0], bias)

    @classmethod
    def from_quantized(cls, tensors: dict[str, torch.Tensor], in_features: int, out_features: int) -> "NF4Linear":
        stored = {k: v for k, v in tensors.items() if k != "bias"}
        return cls(stored, in_features, out_features, tensors.get("bias"))

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        n, k = self.out_features, self.in_features
        numel = n * k
        p = self.qweight
        # One lookup per *byte* (256-entry table of value pairs, high nibble
        # first) through F.embedding: ~9x faster on CPU than unpacking nibbles
        # and gathering with int64 indices.
        code = nf4_code().to(device=p.device)
        lut = torch.stack([code.repeat_interleave(16), code.repeat(16)], dim=1).to(dtype)  # [256, 2]
        w = torch.nn.functional.embedding(p.to(torch.int32), lut).reshape(-1)[:numel]  # [numel]
        # Double-quantized absmax is expanded per call (numel/64 values, cheap)
        # rather than cached, so the layer really holds ~4.13 bits/weight.
        absmax = nf4_absmax(self._stored()).to(dtype)  # [nblocks]
        full = (numel // NF4_BLOCK) * NF4_BLOCK
        w[:full].view(-1, NF4_BLOCK).mul_(absmax[: full // NF4_BLOCK, None])
        if full < numel:
            w[full:].mul_(absmax[-1])
        return w.view(n, k)

    def rows(self, ids: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        k = self.in_features
        idx = ids.long()[:, None] * k + torch.arange(k, device=ids.device)  # [M, K] flat element index
        byte = self.qweight[idx // 2]
        q = torch.where(idx % 2 == 0, byte >> 4, byte & 15)  # element 2i in the high nibble
        absmax = nf4_absmax(self._stored())  # [nblocks]
        return (nf4_code().to(byte.device)[q.long()] * absmax[idx // NF4_BLOCK]).to(dtype)

    def _matmul(self, x2: torch.Tensor) -> torch.Tensor:
        if self._kernel.family is KernelFamily.BITSANDBYTES_NF4:
            return self.matmul_bitsandbytes(x2)
        return linear(x2, self.dequantize(x2.dtype), packed_when_resident=False)  # CPU bf16: kernels.cpu_linear

    def matmul_bitsandbytes(self, x2: torch.Tensor) -> torch.Tensor:
        """``x2 [M, K] -> [M, N]`` through ``bitsandbytes.matmul_4bit`` on this layer's own tensors
        (the same layout, no copy): the CUDA path; callable on any device bitsandbytes supports."""
        bnb = _bitsandbytes()
        if bnb is None:
            raise RuntimeError("NF4Linear.matmul_bitsandbytes: bitsandbytes is not installed (pip install bitsandbytes)")
        from bitsandbytes.functional import QuantState

        shape = torch.Size((self.out_features, self.in_features))
        code = nf4_code().to(self.qweight.device)
        if self.double_quant:
            nested = QuantState(absmax=self.absmax2.float(), code=dynamic_map().to(self.qweight.device),
                                blocksize=DQ_BLOCK, dtype=torch.float32)
            state = QuantState(absmax=self.absmax_q, shape=shape, code=code, blocksize=NF4_BLOCK, quant_type="nf4",
                               dtype=x2.dtype, offset=self.absmax_offset.float(), state2=nested)
        else:
            state = QuantState(absmax=self.absmax.float(), shape=shape, code=code, blocksize=NF4_BLOCK,
                               quant_type="nf4", dtype=x2.dtype)
        return bnb.matmul_4bit(x2, self.qweight.view(-1, 1).t(), quant_state=state)


def _bitsandbytes():
    """The bitsandbytes module, or None when it is not installed (or fails to import)."""
    try:
        import bitsandbytes
    except Exception:  # noqa: BLE001 - a broken optional install must not break NF4 itself
        return None
    return bitsandbytes
