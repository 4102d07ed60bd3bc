"""AWQ calibration for int4 weights: activation-aware per-input-channel scaling (Lin et al., 2023).

Scaling column k of ``W [N, K]`` up by ``s_k`` (and the input down by ``1/s_k``) gives channels with large
activations a finer grid. Per layer group (the linears reading one input) ``s = mean|x|^alpha``
(normalised so ``sqrt(max(s) * min(s)) = 1``) is searched over an ``alpha`` grid for the least output error
``sum_i ||X W_i^T - (X / s) Q(W_i s)^T||^2``; ``alpha = 0`` is RTN, so the search never loses to it. Each
row's groups may then clip their range (``clip``). Output error of a weight error ``D`` is
``sum((D @ H) * D)`` with ``H = X^T X / n``: exact over every calibration token. The ``1/s`` goes into
the op producing the input where one exists, else ``Int4Linear.input_scale``; that wiring is
``llmsys.engine.quantize.awq_calibrate``, this module works on tensors.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from llmsys.kernels.common.errors import InvalidParameterError
from llmsys.quant.int4 import GROUP_SIZES, bf16_ceil, pack_int4

ALPHA_GRID = 20  # alphas 0, 1/20, ..., 19/20 (AWQ's n_grid)
CLIP_GRID = 20  # clip ratios 1, 0.975, ..., 0.525 (AWQ: max_shrink 0.5, n_grid 20)
CLIP_MAX_SHRINK = 0.5


def _grid_params(w: torch.Tensor, g: int, ratio: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """Scales (bf16-rounded, fp32) and zeros ``[N, G]`` of ``w [N, G, g]`` with the range shrunk by ``ratio``."""
    wmin = w.amin(dim=2).clamp(max=0.0)
    wmax = w.amax(dim=2).clamp(min=0.0)
    if ratio is not None:
        wmin, wmax = wmin * ratio, wmax * ratio
    scales = bf16_ceil((wmax - wmin).clamp_min(1e-8) / 15).float()
    zeros = torch.round(-wmin / scales).clamp_(0, 15)
    return scales, zeros


def _padded(weight: torch.Tensor, g: int) -> torch.Tensor:
    n, k = weight.shape
    n_groups = -(-k // g)
    return F.pad(weight.float(), (0, n_groups * g - k)).view(n, n_groups, g)


def fake_quant(weight: torch.Tensor, group_size: int, ratio: torch.Tensor | None = None) -> torch.Tensor:
    """The dequantized int4 weight ``[N, K]`` (float32) that :func:`quantize_int4_clipped` stores."""
    n, k = weight.shape
    w = _padded(weight, group_size)
    s, z = _grid_params(w, group_size, ratio)
    q = (torch.round(w / s[..., None]) + z[..., None]).clamp_(0, 15)
    return ((q - z[..., None]) * s[..., None]).reshape(n, -1)[:, :k]


def quantize_int4_clipped(weight: torch.Tensor, group_size: int = 64,
                          ratio: torch.Tensor | None = None) -> dict[str, torch.Tensor]:
    """Round-to-nearest int4 with each group's range ``[min(w,0), max(w,0)]`` scaled by ``ratio [N, G]``.

    ``ratio=None`` (or all ones) is exactly :func:`~llmsys.quant.int4.quantize_int4`.
    Returns canonical tensors ``{"qweight", "scales" bf16, "zeros" bf16}``.
    """
    if group_size not in GROUP_SIZES:
        raise InvalidParameterError(f"AWQ group size must be one of {GROUP_SIZES}, got {group_size}")
    n, _ = weight.shape
    w = _padded(weight, group_size)
    s, z = _grid_params(w, group_size, ratio)
    q = (torch.round(w / s[..., None]) + z[..., None]).clamp_(0, 15)
    return {"qweight": pack_int4(q.view(n, -1)), "scales": s.to(torch.bfloat16), "zeros": z.to(torch.bfloat16)}


def output_error(d: torch.Tensor, h: torch.Tensor) -> float:
    """``mean_x ||x D^T||^2 = sum((D @ H) * D)`` for a weight error ``d [N, K]`` and ``H = X^T X / n``."""
    return float(((d @ h) * d).sum())


def search_scale(weights: list[torch.Tensor], x_absmean: torch.Tensor, h: torch.Tensor, group_size: int,
                 grid: int = ALPHA_GRID) -> tuple[torch.Tensor, list[float]]:
    """AWQ's scale search for linears that share one input: ``-> (s [K] float32, error per alpha)``.

    weights: the ``[N_i, K]`` float weights; x_absmean: ``mean|x| [K]`` over the
    calibration tokens; h: ``X^T X / n [K, K]``. The returned ``s`` multiplies
    the weights' columns (``W * s``) and divides the input (``x / s``).
    """
    xs = x_absmean.float().clamp(min=1e-4)
    ws = [w.float() for w in weights]
    hf = h.float()
    errors: list[float] = []
    best, best_s = None, None
    for i in range(grid):
        s = xs.pow(i / grid)
        s = s / (s.max() * s.min()).sqrt()
        err = sum(output_error(w - fake_quant(w * s, group_size) / s, hf) for w in ws)
        errors.append(err)
        if best is None or err < best:
            best, best_s = err, s
    return best_s, errors


def search_clip(weight: torch.Tensor, h: torch.Tensor, group_size: int, grid: int = CLIP_GRID,
                max_shrink: float = CLIP_MAX_SHRINK) -> torch.Tensor:
    """Per (row, group) range ratio ``[N, G]`` that minimizes that group's output error.

    Each group's error uses the diagonal block of ``h`` for its columns (the
    cross-group terms are ignored, as in AWQ's clip search).
    """
    n, k = weight.shape
    g = group_size
    n_groups = -(-k // g)
    kp = n_groups * g
    hp = torch.zeros(kp, kp, dtype=torch.float32, device=h.device)
    hp[:k, :k] = h.float()
    hb = torch.stack([hp[j * g:(j + 1) * g, j * g:(j + 1) * g] for j in range(n_groups)])  # [G, g, g]
    w = _padded(weight, g)  # [N, G, g]
    best_err = torch.full((n, n_groups), float("inf"), device=weight.device)
    best = torch.ones(n, n_groups, device=weight.device)
    for i in range(int(grid * max_shrink)):
        r = torch.full((n, n_groups), 1.0 - i / grid, device=weight.device)
        s, z = _grid_params(w, g, r)
        q = (torch.round(w / s[..., None]) + z[..., None]).clamp_(0, 15)
        d = w - (q - z[..., None]) * s[..., None]  # [N, G, g]
        err = torch.einsum("ngi,gij,ngj->ng", d, hb, d)
        better = err < best_err
        best_err = torch.where(better, err, best_err)
        best = torch.where(better, r, best)
    return best
