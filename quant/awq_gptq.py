"""Convert pre-quantized AWQ / GPTQ int4 checkpoints into the canonical int4 layout.

Both store 4-bit q and zeros and fp16 ``scales [K/g, N]`` with ``w = (q - zero) * scale``; only packing differs.
AWQ GEMM: ``qweight int32 [K, N/8]``, word (k, c) holds n = 8c + AWQ_ORDER[i] at bits 4i..4i+3
(``AWQ_ORDER = [0, 2, 4, 6, 1, 3, 5, 7]``); ``qzeros int32 [K/g, N/8]`` the same.
GPTQ: ``qweight int32 [K/8, N]``, word (r, n) holds k = 8r + i at bits 4i..; ``qzeros int32 [K/g, N/8]``
holds n = 8c + i, storing ``zero - 1`` in v1 (added back without wrapping, as the reference kernels do:
a stored 15 is zero 16; ``gptq_v2``: ``zero_offset=0``); ``g_idx int32 [K]`` maps input rows to groups.
Act-order (non-monotonic ``g_idx``): inputs are permuted (``perm = argsort(g_idx, stable)``, every group
contiguous, exactly g rows each) and :class:`~llmsys.quant.int4.Int4Linear` gathers ``x[..., perm]``.
"""

from __future__ import annotations

import torch

from llmsys.kernels.common.errors import CheckpointError
from llmsys.quant.int4 import pack_int4

AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)  # nibble i of a word holds column AWQ_ORDER[i]
_SHIFTS = torch.arange(8, dtype=torch.int32) * 4


def _unpack_words(words: torch.Tensor) -> torch.Tensor:
    """``int32 [..., W] -> int32 [..., W, 8]``: nibble i (bits 4i..4i+3) at index i."""
    return (words.to(torch.int32)[..., None] >> _SHIFTS.to(words.device)) & 15


def _unpack_awq_cols(words: torch.Tensor) -> torch.Tensor:
    """AWQ column-packed ``int32 [R, N/8] -> int32 [R, N]`` in natural column order."""
    nib = _unpack_words(words)  # [R, N/8, 8], nibble i = column AWQ_ORDER[i]
    out = torch.empty_like(nib)
    out[..., list(AWQ_ORDER)] = nib
    return out.reshape(words.shape[0], -1)


def _group_size(k: int, n_groups: int, fmt: str) -> int:
    if n_groups <= 0 or k % n_groups:
        raise CheckpointError(f"{fmt}: {k} input features do not split into {n_groups} groups")
    g = k // n_groups
    if g not in (32, 64, 128):
        raise CheckpointError(f"{fmt}: group size {g} unsupported (llmsys int4 handles 32, 64, 128)")
    return g


def awq_to_canonical(qweight: torch.Tensor, qzeros: torch.Tensor, scales: torch.Tensor) -> dict[str, torch.Tensor]:
    """AWQ GEMM tensors -> canonical ``{"qweight" uint8 [N, K/2], "scales" [N, G], "zeros" [N, G]}``."""
    k, n8 = qweight.shape
    n = n8 * 8
    n_groups = scales.shape[0]
    if tuple(scales.shape) != (n_groups, n) or tuple(qzeros.shape) != (n_groups, n8):
        raise CheckpointError(
            f"AWQ tensors disagree: qweight {tuple(qweight.shape)}, qzeros {tuple(qzeros.shape)}, "
            f"scales {tuple(scales.shape)}; expected [K, N/8], [K/g, N/8], [K/g, N]"
        )
    _group_size(k, n_groups, "AWQ")
    q = _unpack_awq_cols(qweight)  # [K, N]
    zeros = _unpack_awq_cols(qzeros)  # [G, N]
    return {
        "qweight": pack_int4(q.t()),  # [N, K/2]
        "scales": scales.t().contiguous(),  # [N, G]
        "zeros": zeros.t().to(scales.dtype).contiguous(),  # [N, G]
    }


def gptq_to_canonical(qweight: torch.Tensor, qzeros: torch.Tensor, scales: torch.Tensor,
                      g_idx: torch.Tensor | None = None, zero_offset: int = 1) -> dict[str, torch.Tensor]:
    """GPTQ tensors -> canonical int4 dict, plus ``"perm" int32 [K]`` for act-order.

    ``zero_offset`` is 1 for v1 ``gptq`` checkpoints (the default, and what
    AutoGPTQ writes), 0 for ``gptq_v2``.
    """
    k8, n = qweight.shape
    k = k8 * 8
    n_groups = scales.shape[0]
    if tuple(scales.shape) != (n_groups, n) or tuple(qzeros.shape) != (n_groups, n // 8):
        raise CheckpointError(
            f"GPTQ tensors disagree: qweight {tuple(qweight.shape)}, qzeros {tuple(qzeros.shape)}, "
            f"scales {tuple(scales.shape)}; expected [K/8, N], [K/g, N/8], [K/g, N]"
        )
    g = _group_size(k, n_groups, "GPTQ")
    q = _unpack_words(qweight).permute(0, 2, 1).reshape(k, n)  # [K, N]: row 8r+i from nibble i
    zeros = _unpack_words(qzeros).reshape(n_groups, n) + zero_offset  # [G, N]
    out = {"scales": scales.t().contiguous(), "zeros": zeros.t().to(scales.dtype).contiguous()}
    perm = None
    if g_idx is not None:
        g_idx = g_idx.to(torch.int64)
        if not torch.equal(g_idx, torch.arange(k, device=g_idx.device) // g):
            counts = torch.bincount(g_idx, minlength=n_groups)
            if g_idx.numel() != k or counts.numel() != n_groups or not torch.all(counts == g):
                raise CheckpointError(
                    f"GPTQ g_idx does not give every one of the {n_groups} groups exactly {g} rows; "
                    "this act-order layout is not supported, re-quantize the model"
                )
            perm = torch.argsort(g_idx, stable=True)  # stored column j <- input feature perm[j]
            q = q[perm]
    out["qweight"] = pack_int4(q.t())  # [N, K/2]
    if perm is not None:
        out["perm"] = perm.to(torch.int32)
    return out
