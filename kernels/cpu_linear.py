"""Dense linear layers on CPU: pick the GEMM library by shape.

Measured on this project's CI CPU (AMD EPYC, torch 2.13, 1 thread, see
docs/benchmarks.md): for float32 with more than one row, MKL's sgemm takes a
slow path (a 49152x576 LM head costs 2.5x more at M=2..8 than at M=1), while
oneDNN's matmul stays near the M=1 cost. Batched decode and prefill therefore
go through oneDNN; a single row (decode at batch 1) stays on MKL's GEMV, which
is the faster one there. Other dtypes and devices use ``F.linear`` unchanged.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def _onednn_available() -> bool:
    return torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise")


_ONEDNN = _onednn_available()  # a fact about this torch build, never mutated


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``F.linear`` with a faster CPU GEMM choice for float32 batches.

    x: [M, K] (or [..., K]); weight: [N, K]; returns [..., N].
    """
    if (
        _ONEDNN
        and x.device.type == "cpu"
        and x.dtype == torch.float32
        and weight.dtype == torch.float32
        and x.dim() == 2
        and x.shape[0] > 1
        and x.is_contiguous()
        and weight.is_contiguous()
        and not torch.is_grad_enabled()
    ):
        return torch.ops.mkldnn._linear_pointwise(x, weight, bias, "none", [], "")
    return F.linear(x, weight, bias)
