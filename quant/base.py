"""Shared plumbing for quantized linear layers.

Every quantized layer stores its weight in some compact form and exposes the
same surface as ``nn.Linear`` where the model code touches it (``forward``,
``in_features``, ``out_features``, ``bias``) plus ``nbytes()`` so memory
budgets can be checked, ``dequantize()`` as the plain-torch reference, and
``from_float``/``from_quantized`` constructors. Keeping this surface identical
lets ``swap_linears`` and the loader treat every format alike.
"""

from __future__ import annotations

import enum
from collections import Counter
from dataclasses import dataclass

import torch
from torch import nn

from llmsys.kernels import DecodeWeight
from llmsys.kernels.common.errors import CheckpointError

# Without the C kernels: the most rows torch's packed int8 op runs (more dequantize + GEMM).
# Measured on AVX-512 (Qwen2.5-0.5B MLP up-proj, 896x4864): at M=16 int8-packed 2.4 ms vs
# dequant 3.8 ms, at M=128 15 ms vs 8 ms. Also the most rows int8's fused decode layers take.
PACKED_MAX_ROWS = 32
# Float32 bytes of weight rows dequantized at a time by the reference LM head (QuantLinear.logits' fallback).
LOGITS_CHUNK_BYTES = 16 << 20
# Float32 bytes of one row chunk while quantizing (quantize_rows): bounds the quantizers'
# full-size temporaries, so the largest tensor no longer sets the load-time peak.
QUANT_CHUNK_BYTES = 16 << 20


def quantize_rows(weight: torch.Tensor, fn, chunk_bytes: int | None = None) -> tuple[torch.Tensor, ...]:
    """``fn(rows) -> (tensors with rows first)`` applied to row chunks of ``weight [N, K]``, concatenated.

    Why: the quantizers compute in float32 with several full-size temporaries; a
    151936x896 bf16 embedding/LM head (259 MiB) peaked at +1.6 GB while quantized whole,
    more than the whole bf16 model it was loaded from. Formats whose rows are quantized
    independently (int8, int4, fp8) give the same tensors chunk by chunk (tested).
    """
    n, k = weight.shape
    step = max(1, (chunk_bytes or QUANT_CHUNK_BYTES) // (4 * max(k, 1)))
    if step >= n:
        return fn(weight)
    first = fn(weight[:step])
    outs = tuple(torch.empty((n, *t.shape[1:]), dtype=t.dtype, device=t.device) for t in first)
    for r in range(0, n, step):
        part = first if r == 0 else fn(weight[r : r + step])
        for out, t in zip(outs, part):
            out[r : r + step] = t
        del part
    return outs


class KernelFamily(enum.Enum):
    """The matmul code a quantized layer runs; its value is the name reports print.

    Where a family names two kernels (torch's packed int8 op), the layer picks between them per
    call by the number of rows of x. The C families run **every** row of x, prompt and decode,
    through the "a8" kernels (x quantized to int8 per 32 columns, exact integer dot products:
    ``kernels.cpu_qgemv``), whose bits for a row depend on that row and the weight alone. Why one
    arithmetic for all rows: a row's bits then never depend on what else is in its step (a short
    prompt alone or beside a long one, a decode row beside a prompt chunk), how a prompt is chunked,
    or whether a sequence was preempted and recomputed, so answers are the same at any batch and
    memory budget. With an exact bf16-x path for prefill and a8 for decode-sized calls, a 17-token
    prompt's log-probabilities moved by up to 0.19 when a 90-token prompt shared its step.
    """

    C_INT4 = "C int4 a8"  # every row: int4_gemv_a8
    TORCH_INT4_DENSE = "torch int4 dequant + bf16 GEMM"  # CPU tiling, no C kernels: every batch
    TRITON_W4A16 = "Triton w4a16"
    C_INT8 = "C int8 a8"  # every row: int8_gemv_a8
    C_INT8_BLOCK = "C int8:g32 a8"  # every row: int8g_gemv_a8 (GGUF Q8_0 kept as stored)
    TORCH_INT8_PACKED = "torch int8pack_mm, dequant + bf16 GEMM prefill"  # no C kernels
    TRITON_W8A16 = "Triton w8a16"
    FP8_SCALED_MM = "torch _scaled_mm fp8 W8A8"
    BITSANDBYTES_NF4 = "bitsandbytes nf4"
    TORCH_DEQUANT = "torch dequant + F.linear"


@dataclass(frozen=True)
class MatmulKernel:
    """A layer's kernel choice, made once when the layer is built and kept (``QuantLinear.kernel``).

    ``level``: the ISA level the C kernels run at (C families only), e.g. "x86-64-v3".
    """

    family: KernelFamily
    level: str | None = None

    @property
    def name(self) -> str:
        """``"C int4 a8 x86-64-v3"``: what ``memory_report()`` and ``llmsys bench --verbose`` print."""
        return self.family.value if self.level is None else f"{self.family.value} {self.level}"


TORCH_DEQUANT = MatmulKernel(KernelFamily.TORCH_DEQUANT)


class QuantLinear(nn.Module):
    """Base class: ``forward(x [..., K]) -> [..., N]`` from a compact weight.

    ``kernel`` says which matmul code runs; each format chooses it in its constructor from the
    device its tensors are on, its layout and the C kernels' availability, never per call.
    """

    in_features: int
    out_features: int

    def __init__(self, in_features: int, out_features: int, bias: torch.Tensor | None,
                 kernel: MatmulKernel = TORCH_DEQUANT) -> None:
        super().__init__()
        self.in_features = int(in_features)
        self.out_features = int(out_features)
        self._kernel = kernel
        # Bias is tiny; keep it in the model's float dtype.
        self.register_buffer("bias", None if bias is None else bias.detach().clone())

    @property
    def kernel(self) -> MatmulKernel:
        return self._kernel

    # --- to be provided by subclasses ---------------------------------------
    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The float weight this layer represents, ``[N, K]`` (reference path)."""
        raise NotImplementedError

    def _matmul(self, x2: torch.Tensor) -> torch.Tensor:
        """``x2 [M, K] -> [M, N]`` in ``x2.dtype``; bias is added by ``forward``."""
        return x2 @ self.dequantize(x2.dtype).t()

    @classmethod
    def cat_rows(cls, layers: list["QuantLinear"]) -> "QuantLinear | None":
        """One layer whose outputs are ``layers``' outputs side by side (their rows in order), or None.

        For fusing q|k|v and gate|up into one matmul (``DecoderModel.fuse_projections``).
        A format returns a layer only where each output equals the separate layer's bit
        for bit (its kernels compute every output row alone); the default cannot.
        """
        return None

    # The most rows of x the fused decode layers take for this format (its PACKED_MAX_ROWS); 0: never.
    DECODE_MAX_ROWS = 0

    def decode_weight(self) -> DecodeWeight | None:
        """This layer's weight for the fused decode layer kernels (``kernels.layer_attn_in``,
        ``kernels.layer_mlp``) when its own forward on a bf16 input of up to :attr:`DECODE_MAX_ROWS` rows runs
        the a8 GEMV (and adds a bf16 bias), so the fused call gives its bits; None otherwise (the default).
        Asked once, when the engine's decode plan is built (``engine/models/decode_plan.py``)."""
        return None

    def _int8_decode_weight(self, family: KernelFamily, tensors: tuple[torch.Tensor, ...], build) -> DecodeWeight | None:
        """The int8 formats' ``decode_weight``: ``build(*tensors, bias)`` when this layer's kernel is ``family`` and
        its bias (if any) is bf16 -- what the fused decode layers add -- else None."""
        bias = self._buffers["bias"]
        if self._kernel.family is not family or (bias is not None and bias.dtype != torch.bfloat16):
            return None
        return build(*tensors, bias)

    def _a8_input(self, x2: torch.Tensor) -> torch.Tensor:
        """``x2 [M, K]`` as the C a8 GEMVs take it: bf16 (float32 inputs cast), unit column stride, K checked."""
        xb = x2 if x2.dtype == torch.bfloat16 else x2.to(torch.bfloat16)
        if xb.stride(-1) != 1:
            xb = xb.contiguous()
        if xb.shape[1] != self.in_features:
            raise ValueError(f"{type(self).__name__}: input has {xb.shape[1]} features, expected {self.in_features}")
        return xb

    def _a8_f32_input(self, x2: torch.Tensor) -> torch.Tensor:
        """``x2 [M, K]`` as the C a8 GEMVs take an LM head's input: float32 as it is (quantized per 32 columns
        from its own value, as llama.cpp quantizes its float32 activations), unit column stride, K checked."""
        xf = x2.float()
        if xf.stride(-1) != 1:
            xf = xf.contiguous()
        if xf.shape[1] != self.in_features:
            raise ValueError(f"{type(self).__name__}: input has {xf.shape[1]} features, expected {self.in_features}")
        return xf

    def rows(self, ids: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """Dequantized weight rows ``ids [M] -> [M, K]`` (an embedding lookup).

        Subclasses gather only the requested rows; this fallback dequantizes
        the whole matrix and is only used by formats without a row path.
        """
        return self.dequantize(dtype)[ids]

    # --- shared -------------------------------------------------------------
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        lead = x.shape[:-1]
        x2 = x.reshape(-1, x.shape[-1])  # [M, K]
        y = self._matmul(x2)  # [M, N]
        if self.bias is not None:
            y = y + self.bias.to(y.dtype)
        return y.reshape(*lead, self.out_features)

    def logits(self, x: torch.Tensor) -> torch.Tensor:
        """This layer as the LM head: ``x [..., K]`` (float32, the final norm's output) ``-> [..., N]`` float32
        logits as summed (plus the bias), never rounded to bf16.

        Why: bf16 logits have gaps that are multiples of 2^-3 near 10, so argmax ties everywhere and the
        sampler sees a coarse distribution; an upcast of :meth:`forward`'s bf16 output restores nothing.
        """
        lead = x.shape[:-1]
        y = self._logits(x.reshape(-1, x.shape[-1]))  # [M, N] float32
        if self.bias is not None:
            y = y + self.bias.float()
        return y.reshape(*lead, self.out_features)

    def _logits(self, x2: torch.Tensor) -> torch.Tensor:
        """``x2 [M, K] -> [M, N]`` float32 sums; formats whose kernel writes float32 override this."""
        return self._dequant_logits(x2)

    def _logit_rows(self):
        """``ids [R] -> [R, K]``: the float32 weight rows the reference head multiplies (default :meth:`rows`)."""
        return lambda ids: self.rows(ids, torch.float32)

    def _dequant_logits(self, x2: torch.Tensor) -> torch.Tensor:
        """``x2 [M, K]`` times the float32 dequantized weight (:meth:`_logit_rows`), in row chunks of at most
        :data:`LOGITS_CHUNK_BYTES` (a 151936-row head dequantized whole is 0.5 GB) ``-> [M, N]`` float32: the
        reference head."""
        rows = self._logit_rows()
        xf = x2.float()
        n, k = self.out_features, self.in_features
        step = max(1, LOGITS_CHUNK_BYTES // (4 * k))
        out = torch.empty(xf.shape[0], n, dtype=torch.float32, device=xf.device)
        for r0 in range(0, n, step):
            ids = torch.arange(r0, min(n, r0 + step), device=xf.device)
            out[:, r0 : r0 + ids.numel()] = xf @ rows(ids).t()
        return out

    def nbytes(self) -> int:
        """Bytes held by this layer: every persistent buffer, incl. scales/zeros/bias (a non-persistent one is
        a view that holds nothing of its own, e.g. ``Int4Linear``'s stride-0 zeros beside float offsets)."""
        skip = self._non_persistent_buffers_set
        return sum(b.numel() * b.element_size() for name, b in self.named_buffers(recurse=False) if name not in skip)

    def extra_repr(self) -> str:
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, "
            f"bias={self.bias is not None}, nbytes={self.nbytes()}, kernel={self.kernel.name!r}"
        )


def rows_joinable(cls: type, layers: list[QuantLinear]) -> tuple[bool, torch.Tensor | None]:
    """For ``cat_rows`` of per-row formats: (are ``layers`` all ``cls`` of one input width, all with a bias
    or none?, their biases concatenated or None)."""
    first = layers[0]
    if any(type(m) is not cls or m.in_features != first.in_features or (m.bias is None) != (first.bias is None)
           for m in layers):
        return False, None
    return True, torch.cat([m.bias for m in layers]) if first.bias is not None else None


def kernel_counts(model: nn.Module) -> dict[str, int]:
    """``{kernel name: number of quantized layers running it}`` over ``model`` (each module once)."""
    return dict(Counter(m.kernel.name for m in model.modules() if isinstance(m, QuantLinear)))


def require(tensors: dict[str, torch.Tensor], names: tuple[str, ...], fmt: str) -> list[torch.Tensor]:
    """Fetch required entries of a saved quantized state, or raise CheckpointError."""
    missing = [n for n in names if n not in tensors]
    if missing:
        raise CheckpointError(
            f"{fmt} quantized state is missing {', '.join(missing)} (has {', '.join(sorted(tensors))}); "
            "re-export the checkpoint with llmsys or load the float weights and quantize at load time"
        )
    return [tensors[n] for n in names]


def check_weight(weight: torch.Tensor, bias: torch.Tensor | None) -> None:
    """Reject shapes that cannot be a linear weight (a loader bug or bad file)."""
    if weight.dim() != 2 or not weight.is_floating_point():
        raise CheckpointError(
            f"cannot quantize a {weight.dtype} tensor of shape {tuple(weight.shape)}: "
            "expected a 2-D float linear weight [out_features, in_features]"
        )
    if bias is not None and tuple(bias.shape) != (weight.shape[0],):
        raise CheckpointError(
            f"bias of shape {tuple(bias.shape)} does not match weight {tuple(weight.shape)}"
        )
