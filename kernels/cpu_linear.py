"""Dense linear layers on CPU: pick the GEMM library by shape.

Measured on this project's CI CPU (AMD EPYC, torch 2.13, 1 thread): for
float32 with more than one row, MKL's sgemm (what ``F.linear`` calls) takes a
slow path (a 49152x576 LM head costs 2.5x more at M=2..8 than at M=1), while
oneDNN's matmul stays near the M=1 cost. At M=1 the two are within 5% on
large weights, but oneDNN's fixed cost per call (~30 us) dominates on tiny
ones (stories260k's 64x64 projections). So float32 batches (M > 1) on weights
of at least 64K elements go through oneDNN; everything else, and other
dtypes and devices, use ``F.linear``.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def _onednn_available() -> bool:
    return torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise")


_ONEDNN = _onednn_available()  # a fact about this torch build, never mutated
_ONEDNN_MIN_WEIGHT = 1 << 16  # elements; below this oneDNN's per-call cost dominates


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
        and weight.numel() >= _ONEDNN_MIN_WEIGHT
        and x.is_contiguous()
        and weight.is_contiguous()
        and not torch.is_grad_enabled()
    ):
        return torch.ops.mkldnn._linear_pointwise(x, weight, bias, "none", [], "")
    return F.linear(x, weight, bias)
