"""Dense linear layers on CPU: pick the GEMM library by shape.

float32 weights of at least 64K elements go through oneDNN (MKL's sgemm, ``F.linear``'s, takes a slow path
at M = 2..8; oneDNN's fixed per-call cost only hurts tiny weights), prepacked once into its blocked layout
when resident (:func:`prepack`, faster at every M); a packed resident layer and the same layer streamed
plain give the same bits. Smaller float32 weights and every bf16 weight (never packed) run the C GEMVs
(``cpu_qgemv.f32_gemv`` / ``bf16_gemv``: 16 float32 lanes per output, then a tree; prompts in batch
tiles), whose bits the fused decode layers give, so a row never depends on its batch, chunk or a
prefix-cache hit (``tests/test_batch_invariance.py``); the price is prompt speed where oneDNN has AMX.
Without the C kernel, and for weights the GEMV does not take: torch's bf16 linear, or float32 sgemm on
upcast chunks. Other dtypes and devices use ``F.linear``. Figures: docs/benchmarks.md.
"""

from __future__ import annotations

import enum

import torch
import torch.nn.functional as F

from llmsys.kernels import cpu_qgemv
from llmsys.kernels.cpu_int4 import transpose_bf16


def _onednn_available() -> bool:
    return torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise")


_ONEDNN = _onednn_available()  # a fact about this torch build, never mutated
_ONEDNN_MIN_WEIGHT = 1 << 16  # elements; below this oneDNN's per-call cost dominates


def _onednn_bf16() -> bool:
    return _ONEDNN and bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())


_ONEDNN_BF16 = _onednn_bf16()  # oneDNN runs (and prepacks) bf16 on this CPU; a fact, never mutated
# Only float32 is prepacked: bf16 weights stay plain everywhere, so the C bf16 GEMV (and the fused decode
# layers) can read them.
_PACKABLE = (torch.float32,)
# Rows of x up to which the fused decode layers take a batch (DecoderModel.DECODE_MAX_ROWS), and from which a
# bf16 matmul the C GEMV cannot run (no C kernel, a float32 bias) takes a GEMM (oneDNN's, or the upcast sgemm).
BF16_UPCAST_MIN_ROWS = 12
_UPCAST_CHUNK_BYTES = 4 << 20  # float32 bytes of weight upcast at a time (1024-4096 rows: the same speed)
# oneDNN's batch-size hint picks the blocking. 16 rather than 1 (1 blocks like the
# plain oneDNN call): over the 210 SmolLM2-135M layer matrices in float32, M = 16
# runs ~1.4x faster than plain oneDNN and M = 1 is no slower
# (`python benchmarks/bench_gemv.py`, 2 threads). A hint-16 float32 weight gives other bits at
# M = 1 than the plain oneDNN call, which is why `linear` packs plain float32
# weights on the fly (see there).
_PACK_HINT = 16


def packable(weight: torch.Tensor, numel: int | None = None) -> bool:
    """Is ``weight`` [N, K] one that :func:`prepack` would pack (and that then pays)?

    ``numel``: judge the size as if the weight had this many elements (a row chunk
    of a bigger matrix, see ``linear(rows_of=...)``).
    """
    return (
        _ONEDNN
        and weight.device.type == "cpu"
        and weight.dtype in _PACKABLE
        and weight.dim() == 2
        and (weight.numel() if numel is None else numel) >= _ONEDNN_MIN_WEIGHT
        and weight.is_contiguous()
        and not weight.is_mkldnn
    )


def fusable(weight: torch.Tensor) -> bool:
    """Does ``linear`` take the same GEMM for ``weight`` [N, K] alone as for a row concatenation that
    holds it (so a fused q|k|v or gate|up gives each part's bits)? Packable weights do; so does any
    CPU bf16 weight (the C GEMV, oneDNN's bf16 GEMM or the upcast sgemm, by M alone)."""
    if packable(weight):
        return True
    return (weight.dtype == torch.bfloat16 and weight.device.type == "cpu"
            and weight.dim() == 2 and weight.is_contiguous() and not weight.is_mkldnn)


def prepack(weight: torch.Tensor) -> torch.Tensor | None:
    """oneDNN's blocked copy of ``weight`` [N, K] (an opaque tensor), or None when not packable.

    The caller replaces its weight with the result, so memory does not grow.
    """
    if not packable(weight):
        return None
    return torch.ops.mkldnn._reorder_linear_weight(weight.detach(), _PACK_HINT)


class LinearKernel(enum.Enum):
    """What runs a dense layer's matmul, chosen from its weight once (:func:`linear_kernel`)."""

    ONEDNN_PACKED = "oneDNN, prepacked weight"
    ONEDNN_REPACK = "oneDNN, plain float32 weight packed per call (a streamed layer of a packed model)"
    ONEDNN_PLAIN = "oneDNN, plain float32 weight (a layer never packed)"
    BF16_GEMV = "C bf16 GEMV, every batch"
    BF16_GEMM = "torch bf16 matmul; from 12 rows oneDNN's bf16 GEMM or float32 sgemm on upcast chunks"
    F32_GEMV = "C float32 GEMV, every batch"
    TORCH = "F.linear"


def linear_kernel(weight: torch.Tensor, bias: torch.Tensor | None = None, *, rows_of: int | None = None,
                  packed_when_resident: bool = True) -> LinearKernel:
    """The kernel :func:`run_linear` runs for ``weight [N, K]`` (plain or packed): a fact of the weight, so a
    resident layer's is decided once (``engine/models/decode_plan.py``).

    ``packed_when_resident``: this layer's weight is prepacked when resident (every packable layer; a head tied
    to the embedding only when the embedding rows can be read from the checkpoint,
    ``DecoderModel.prepack_linears``). A plain float32 weight of such a layer -- streamed from disk, or in an
    engine that does not prepack -- is packed per call, so it gives the same bits as the resident packed
    layer: the identical-answers-at-any-budget guarantee (the reorder costs a copy of the weight per call,
    noise next to the disk read it follows). bfloat16 needs none of this (never packed): every batch runs the
    C bf16 GEMV (module doc).

    ``rows_of``: ``weight`` is a row chunk of a matrix with this many rows (an LM head streamed in chunks);
    the choice follows the whole matrix, and oneDNN's per-row results do not depend on the chunking (tested).
    """
    if weight.is_mkldnn:
        return LinearKernel.ONEDNN_PACKED
    if weight.dtype == torch.float32 and packable(weight, rows_of * weight.shape[1] if rows_of else None):
        return LinearKernel.ONEDNN_REPACK if packed_when_resident else LinearKernel.ONEDNN_PLAIN
    if weight.dtype == torch.bfloat16 and weight.device.type == "cpu" and weight.dim() == 2:
        return LinearKernel.BF16_GEMV if bf16_gemv_applies(weight, bias) else LinearKernel.BF16_GEMM
    if f32_gemv_applies(weight, bias) and (rows_of is None or rows_of * weight.shape[1] < _ONEDNN_MIN_WEIGHT):
        return LinearKernel.F32_GEMV  # a weight too small to pack (a streamed chunk: the whole matrix is)
    return LinearKernel.TORCH


def run_linear(kernel: LinearKernel, x: torch.Tensor, weight: torch.Tensor,
               bias: torch.Tensor | None = None) -> torch.Tensor:
    """``x [..., K]`` times ``weight [N, K]`` (plus bias) ``-> [..., N]`` by ``kernel`` (:func:`linear_kernel`'s
    answer for this weight). Autograd (quantization's refinement trains through the float32 decoder) and an
    input of another dtype take ``F.linear``: the C kernels record no graph."""
    if kernel is LinearKernel.ONEDNN_PACKED:  # only oneDNN can read a packed weight
        x2 = x.reshape(-1, x.shape[-1]) if x.dim() != 2 else x
        out = _onednn_rows(x2.contiguous(), weight, bias)
        return out if x.dim() == 2 else out.view(*x.shape[:-1], out.shape[-1])
    if kernel is LinearKernel.TORCH or torch.is_grad_enabled() or x.dtype != weight.dtype:
        return F.linear(x, weight, bias)
    if kernel is LinearKernel.BF16_GEMV:  # every row count: a row's bits never depend on its batch (module doc)
        return _gemv(cpu_qgemv.bf16_gemv, x, weight, bias)
    if kernel is LinearKernel.F32_GEMV:
        return _gemv(cpu_qgemv.f32_gemv, x, weight, bias)
    if kernel is LinearKernel.BF16_GEMM:
        if x.numel() >= BF16_UPCAST_MIN_ROWS * x.shape[-1]:
            # no C kernel (or a float32 bias): oneDNN's bf16 GEMM where it has one, else the upcast sgemm
            return F.linear(x, weight, bias) if _ONEDNN_BF16 else _bf16_upcast(x, weight, bias)
        return F.linear(x, weight, bias)
    if x.dim() != 2 or not x.is_contiguous():  # ONEDNN_REPACK / ONEDNN_PLAIN take 2-D contiguous batches
        return F.linear(x, weight, bias)
    if kernel is LinearKernel.ONEDNN_REPACK:
        weight = torch.ops.mkldnn._reorder_linear_weight(weight, _PACK_HINT)
    return _onednn_rows(x, weight, bias)


def linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    *,
    rows_of: int | None = None,
    packed_when_resident: bool = True,
) -> torch.Tensor:
    """``F.linear`` with the CPU GEMM :func:`linear_kernel` picks for ``weight``, for callers whose weight changes
    from call to call (an LM head streamed in chunks); a model's layers pick theirs once
    (``Linear.kernel``). x: [M, K] (or [..., K]); weight: [N, K] (plain or from :func:`prepack`); returns [..., N]."""
    kernel = linear_kernel(weight, bias, rows_of=rows_of, packed_when_resident=packed_when_resident)
    return run_linear(kernel, x, weight, bias)


def _onednn_rows(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """oneDNN's float32 GEMM of ``x [M, K]`` on a packed ``weight`` ``-> [M, N]``, a single row run as two.

    Why: oneDNN takes another kernel at M = 1 whose sums differ in the last bit from its GEMM's for K of about
    1,500 and more (a 896x4864 weight, AVX-512), while its GEMM rows agree for M = 2 to 2,048 (tested); the
    second row costs nothing next to reading the weight."""
    if x.shape[0] != 1:
        return torch.ops.mkldnn._linear_pointwise(x, weight, bias, "none", [], "")
    return torch.ops.mkldnn._linear_pointwise(x.expand(2, -1).contiguous(), weight, bias, "none", [], "")[:1]


def linear_logits(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    *,
    rows_of: int | None = None,
    packed_when_resident: bool = True,
) -> torch.Tensor:
    """An LM head on a plain or packed ``weight [N, K]``: ``x [M, K]`` (float32, the final norm's output)
    ``-> [M, N]`` float32 logits as summed, never rounded to the weight's dtype.

    Why: bf16 logits have gaps that are multiples of 2^-3 near 10, so argmax ties everywhere and the
    sampler sees a coarse distribution; an upcast after that rounding restores nothing.

    float32 weights: :func:`linear` on float32 x (its GEMM choice, packing and ``rows_of``, so a streamed
    chunk gives the resident head's bits). bf16 weights on the CPU: x rounded to bf16 (the kernel multiplies
    bf16 pairs, each product exact in float32) and the C bf16 GEMV writing its float32 sums, for every row
    count: a row's logits do not depend on its batch, so a prompt's scoring and its decode steps agree.
    Without the C kernel, and for other dtypes: float32 sgemm on weight chunks upcast. CUDA: the GEMM with a
    float32 output.
    """
    x2 = x.reshape(-1, x.shape[-1])  # [M, K]
    if weight.is_mkldnn or weight.dtype == torch.float32:
        y = linear(x2.float().contiguous(), weight, bias, rows_of=rows_of, packed_when_resident=packed_when_resident)
    elif weight.device.type == "cuda":
        y = torch.mm(x2.to(weight.dtype), weight.t(), out_dtype=torch.float32)  # [M, N]
        if bias is not None:
            y = y + bias.float()
    else:
        if weight.dtype == torch.bfloat16 and bf16_gemv_applies(weight, bias):
            xb = x2.to(torch.bfloat16)
            y = cpu_qgemv.bf16_gemv(xb if xb.stride(-1) == 1 else xb.contiguous(), weight, out_dtype=torch.float32,
                                    check=False)
        else:
            y = _mm_upcast(weight, x2.float().t()).t()  # [M, N]
        if bias is not None:
            y = y + bias.float()
    return y if x.dim() == 2 else y.view(*x.shape[:-1], y.shape[-1])


def _gemv(fn, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """``fn`` (the C bf16 or float32 GEMV) on ``x [..., K]`` rows, then ``y + bias`` in the dtype."""
    x2 = x.reshape(-1, x.shape[-1])
    x2 = x2 if x2.stride(-1) == 1 else x2.contiguous()
    y = fn(x2, weight, check=False)
    if bias is not None:
        y = y + bias
    return y if x.dim() == 2 else y.view(*x.shape[:-1], y.shape[-1])


def bf16_gemv_applies(weight: torch.Tensor, bias: torch.Tensor | None) -> bool:
    """Does :func:`linear` run every batch on ``weight`` through
    the C bf16 GEMV (``cpu_qgemv.bf16_gemv``; then ``bf16(y + bias)``)? For plain
    CPU bf16 weights with unit column stride and a bf16 bias or none, when the C kernel is built."""
    return (weight.dtype == torch.bfloat16 and weight.device.type == "cpu"
            and weight.dim() == 2 and weight.stride(1) == 1 and not weight.is_mkldnn
            and (bias is None or bias.dtype == torch.bfloat16) and cpu_qgemv.available())


def bf16_gemm_applies(weight: torch.Tensor, bias: torch.Tensor | None) -> bool:
    """Does :func:`mm_bf16` (the quantized layers' dequantized prompt GEMM) run on ``weight`` through the C
    bf16 GEMM (``cpu_qgemv.bf16_gemm``)? Where oneDNN has no bf16, for plain CPU bf16 weights with unit column
    stride and a bf16 bias or none, when the C kernel is built with AVX2 + FMA."""
    return (not _ONEDNN_BF16 and weight.dtype == torch.bfloat16 and weight.device.type == "cpu"
            and weight.dim() == 2 and weight.stride(1) == 1 and not weight.is_mkldnn
            and (bias is None or (bias.dtype == torch.bfloat16 and bias.is_contiguous()))
            and cpu_qgemv.bf16_gemm_native())


def f32_gemv_applies(weight: torch.Tensor, bias: torch.Tensor | None) -> bool:
    """Does :func:`linear` run every float32 batch on ``weight``
    through the C float32 GEMV (``cpu_qgemv.f32_gemv``; then ``y + bias``)? For plain CPU float32 weights
    that :func:`packable` turns down for size (oneDNN takes the rest, packed), with unit column stride and
    a float32 bias or none, when the C kernel is built."""
    return (weight.dtype == torch.float32 and weight.device.type == "cpu"
            and weight.dim() == 2 and weight.stride(1) == 1 and not weight.is_mkldnn
            and weight.numel() < _ONEDNN_MIN_WEIGHT
            and (bias is None or bias.dtype == torch.float32) and cpu_qgemv.available())


def decode_weight(weight: torch.Tensor, bias: torch.Tensor | None) -> cpu_qgemv.DecodeWeight | None:
    """The fused decode layers' weight for a plain layer whose decode batches :func:`linear` runs through
    a C GEMV (:func:`bf16_gemv_applies`, :func:`f32_gemv_applies`), else None."""
    if bf16_gemv_applies(weight, bias):
        return cpu_qgemv.bf16_decode_weight(weight, bias)
    if f32_gemv_applies(weight, bias):
        return cpu_qgemv.f32_decode_weight(weight, bias)
    return None


def mm_bf16(a: torch.Tensor, b: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """``a [N, K] @ b [K, M]`` for bf16 CPU tensors ``-> [N, M]`` bf16 (into ``out`` if given): torch's
    bf16 GEMM where oneDNN runs bf16, else the C bf16 GEMM (``b``'s transpose with unit column stride:
    the quantized layers' ``x^T``), else float32 sgemm rounded once (faster than torch's: docs/benchmarks.md)."""
    if _ONEDNN_BF16:
        return torch.mm(a, b, out=out)
    if b.stride(0) == 1 and bf16_gemm_applies(a, None):
        r = cpu_qgemv.bf16_gemm(b.t(), a, check=False).t()  # [N, M]
        return r.contiguous() if out is None else out.copy_(r)
    r = _mm_upcast(a, b.float())
    if out is None:
        return r.to(torch.bfloat16)
    return out.copy_(r)


def _mm_upcast(a: torch.Tensor, bf: torch.Tensor) -> torch.Tensor:
    """``a [N, K]`` bf16 times ``bf [K, M]`` float32 ``-> [N, M]`` float32, ``a`` upcast a few hundred rows at
    a time (the float32 chunk stays in L2; a whole-matrix upcast paid page faults for a fresh buffer). The
    weight goes first: faster than ``F.linear(x, w_chunk)`` pieces joined by ``cat`` (docs/benchmarks.md)."""
    n, k = a.shape
    step = max(64, _UPCAST_CHUNK_BYTES // (4 * k))
    out = torch.empty(n, bf.shape[1], dtype=torch.float32)
    for r0 in range(0, n, step):
        torch.mm(a[r0 : r0 + step].float(), bf, out=out[r0 : r0 + step])
    return out


def _bf16_upcast(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """``x [..., K]`` bf16 times ``weight [N, K]`` bf16 by float32 sgemm on row chunks of the weight
    ``-> [..., N]`` bf16 (each output rounded once from its float32 sum plus bias)."""
    xf = x.reshape(-1, x.shape[-1]).float()
    yt = _mm_upcast(weight, xf.t())  # [N, M] float32
    if bias is not None:
        yt += bias.float()[:, None]
    return transpose_bf16(yt.to(torch.bfloat16)).view(*x.shape[:-1], weight.shape[0])
