"""GPTQ calibration for one linear layer, into the canonical int4 layout (Frantar et al., 2022).

Columns of ``W [N, K]`` are quantized one at a time, each rounding error spread over the columns left,
weighted by the inverse Hessian ``H = 2 X^T X / n``, in lazy blocks so most work is a GEMM. Departures
from the reference: group statistics come from the error-updated columns of the current block (the
reference reads stale ones for a group starting mid-block), and the scale is rounded to bf16 before
quantizing, so the stored tensors reproduce the grid exactly.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from llmsys.kernels.common.errors import InvalidParameterError
from llmsys.quant.int4 import GROUP_SIZES, Int4Linear, bf16_ceil, pack_int4, unpack_int4


def hessian_from_inputs(x: torch.Tensor) -> torch.Tensor:
    """``X [n_samples, K] -> H [K, K] = 2 X^T X / n`` in fp32."""
    xf = x.reshape(-1, x.shape[-1]).float()
    return 2.0 * (xf.t() @ xf) / xf.shape[0]


def _group_params(w: torch.Tensor, mse: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """Asymmetric 4-bit params for a slab ``w [N, g]``: (scale bf16-rounded fp32 [N], zero [N]).

    ``mse``: shrink the [min, max] range by the factor (1.0, 0.95, ... 0.70) that
    minimizes the group's squared rounding error, per row (GPTQ's ``mse``
    option): clipping a few outliers buys a finer grid for the rest.
    """
    wmin0 = w.amin(dim=1).clamp(max=0.0)
    wmax0 = w.amax(dim=1).clamp(min=0.0)
    best = None
    for p in (1.0, 0.95, 0.9, 0.85, 0.8, 0.75, 0.7) if mse else (1.0,):
        wmin, wmax = wmin0 * p, wmax0 * p
        scale = bf16_ceil((wmax - wmin).clamp_min(1e-8) / 15).float()
        zero = torch.round(-wmin / scale).clamp_(0, 15)
        if not mse:
            return scale, zero
        q = (torch.round(w / scale[:, None]) + zero[:, None]).clamp_(0, 15)
        err = ((q - zero[:, None]) * scale[:, None] - w).pow(2).sum(dim=1)  # [N]
        if best is None:
            best = [err, scale, zero]
        else:
            better = err < best[0]
            best = [torch.where(better, err, best[0]), torch.where(better, scale, best[1]),
                    torch.where(better, zero, best[2])]
    return best[1], best[2]


def gptq_quantize(weight: torch.Tensor, H: torch.Tensor, group_size: int = 64,
                  damp: float = 0.01, block_size: int = 128, act_order: bool = False,
                  mse: bool = False) -> dict[str, torch.Tensor]:
    """GPTQ-quantize ``weight [N, K]`` given ``H [K, K]``.

    Returns canonical int4 tensors ``{"qweight" uint8 [N, Kp/2], "scales" bf16
    [N, G], "zeros" bf16 [N, G]}`` (feed to ``Int4Linear.from_quantized`` with
    ``in_features=K``). ``damp`` is the fraction of mean(diag H) added to the
    diagonal for a stable Cholesky. ``act_order`` quantizes columns in order
    of decreasing ``diag(H)`` (the most active inputs first, while the most
    columns remain to absorb their error); the columns are *stored* in that
    order with groups contiguous, and ``"perm" int32 [K]`` is returned for
    :class:`~llmsys.quant.int4.Int4Linear` (stored column j = input ``perm[j]``).
    ``mse`` picks each group's range by error search (:func:`_group_params`).
    """
    if act_order:
        perm = torch.argsort(torch.diag(H), descending=True, stable=True)
        out = gptq_quantize(weight[:, perm], H[perm][:, perm], group_size, damp, block_size, False, mse)
        out["perm"] = perm.to(torch.int32)
        return out
    if group_size not in GROUP_SIZES:
        raise InvalidParameterError(f"GPTQ group size must be one of {GROUP_SIZES}, got {group_size}")
    n, k = weight.shape
    if tuple(H.shape) != (k, k):
        raise InvalidParameterError(f"Hessian shape {tuple(H.shape)} does not match weight K={k}")
    g = group_size
    kp = -(-k // g) * g
    block_size = max(g, (block_size // g) * g)  # groups never straddle a block
    W = F.pad(weight.float(), (0, kp - k)).clone()  # [N, Kp]
    Hp = torch.zeros(kp, kp, dtype=torch.float32, device=weight.device)
    Hp[:k, :k] = H.float()
    dead = torch.diag(Hp) == 0  # unused inputs (and K padding): any value works
    Hp[dead, dead] = 1.0
    W[:, dead] = 0.0
    Hp += damp * torch.mean(torch.diag(Hp)) * torch.eye(kp, device=Hp.device)
    L = torch.linalg.cholesky(Hp)
    Hinv = torch.linalg.cholesky(torch.cholesky_inverse(L), upper=True)  # upper Cholesky of H^-1

    Q = torch.zeros(n, kp, dtype=torch.uint8, device=weight.device)
    scales = torch.zeros(n, kp // g, dtype=torch.float32, device=weight.device)
    zeros = torch.zeros_like(scales)
    for i1 in range(0, kp, block_size):
        i2 = min(i1 + block_size, kp)
        W1 = W[:, i1:i2].clone()  # [N, B]
        Err1 = torch.zeros_like(W1)
        Hinv1 = Hinv[i1:i2, i1:i2]
        for i in range(i2 - i1):
            col = i1 + i
            if col % g == 0:
                s, z = _group_params(W1[:, i:i + g], mse)
                scales[:, col // g], zeros[:, col // g] = s, z
            w = W1[:, i]
            q = (torch.round(w / s) + z).clamp_(0, 15)
            Q[:, col] = q.to(torch.uint8)
            err = (w - (q - z) * s) / Hinv1[i, i]
            W1[:, i:] -= err[:, None] * Hinv1[i, i:][None, :]
            Err1[:, i] = err
        W[:, i2:] -= Err1 @ Hinv[i1:i2, i2:]
    return {"qweight": pack_int4(Q), "scales": scales.to(torch.bfloat16), "zeros": zeros.to(torch.bfloat16)}


def gptq_linear(weight: torch.Tensor, bias: torch.Tensor | None, x: torch.Tensor,
                group_size: int = 64, damp: float = 0.01) -> Int4Linear:
    """Calibrate on inputs ``x [n_samples, K]`` and build the :class:`Int4Linear`."""
    t = gptq_quantize(weight, hessian_from_inputs(x), group_size, damp)
    if bias is not None:
        t["bias"] = bias
    return Int4Linear.from_quantized(t, in_features=weight.shape[1])


class TunableInt4:
    """A trainable view of an :class:`Int4Linear`, for refining GPTQ's output end to end.

    ``W = (clamp(round(q + v), 0, 15) - z) * s0 * exp(log_s)`` with the integer
    codes ``q``, zero points ``z`` and scales ``s0`` from GPTQ. Two things are
    learned (AutoRound / OmniQuant-style): ``log_s [N, G]`` (Adam) and rounding
    offsets ``v [N, G, g]`` in [-1, 1] (signed gradient steps through a
    straight-through round), so a code can move one step where that lowers the
    *model's* loss rather than one layer's squared error. Zero points stay
    integers, so the result keeps the fast packed CPU layout.
    """

    def __init__(self, lin: Int4Linear) -> None:
        t = lin.canonical_tensors()
        self.lin = lin
        self.n, self.k, g = lin.out_features, lin.in_features, lin.group_size
        # [N, G, g] codes, stored order; uint8, not float: refining Qwen2.5-0.5B holds 494M of them
        self.q = unpack_int4(t["qweight"]).to(torch.uint8).view(self.n, -1, g)
        self.z = t["zeros"].float()[..., None]  # [N, G, 1]
        self.s0 = t["scales"].float()  # [N, G]
        self.log_s = torch.zeros_like(self.s0, requires_grad=True)
        self.v = torch.zeros(self.q.shape, requires_grad=True)
        self.inv = None if lin.perm is None else lin.perm.long()
        self.pos = None if lin.perm is None else torch.argsort(self.inv)  # input i is stored column pos[i]
        # AWQ scale kept in the layer (None when folded away); a clone, as it may be an inference tensor
        self.input_scale = None if lin.input_scale is None else lin.input_scale.clone()

    def codes(self) -> torch.Tensor:
        """``[N, G, g]`` integer codes (as float) with the straight-through rounding."""
        return self._codes(self.q, self.v)

    @staticmethod
    def _codes(q: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        c = q.float() + v
        return (c + (torch.round(c) - c).detach()).clamp(0, 15)

    def _dense(self, q, v, z, s0, log_s) -> torch.Tensor:  # the formula on [n, G, g] rows -> [n, K]
        return _TunableWeight.apply(v, log_s, q, z, s0, self.k, self.inv, self.pos, self.input_scale)

    def weight(self) -> torch.Tensor:
        """Differentiable dense ``[N, K]`` weight in input-feature order."""
        return self._dense(self.q, self.v, self.z, self.s0, self.log_s)

    def weight_rows(self, rows: torch.Tensor) -> torch.Tensor:
        """``weight()[rows]`` built from those rows only: ``[T] -> [T, K]`` (a tied embedding's lookup)."""
        return self._dense(self.q[rows], self.v[rows], self.z[rows], self.s0[rows], self.log_s[rows])

    @torch.no_grad()
    def round_step(self, lr: float) -> None:
        """Signed-gradient step on the rounding offsets (AutoRound's update)."""
        if self.v.grad is not None:
            self.v -= lr * self.v.grad.sign()
            self.v.clamp_(-1.0, 1.0)
            self.v.grad = None

    @torch.no_grad()
    def to_linear(self) -> Int4Linear:
        """The refined layer: new codes and bf16 scales, same zeros / permutation / bias."""
        t = {
            "qweight": pack_int4(self.codes().reshape(self.n, -1).to(torch.uint8)),
            "scales": (self.s0 * self.log_s.exp()).to(torch.bfloat16),
            "zeros": self.z[..., 0].to(torch.bfloat16),
        }
        if self.lin.perm is not None:
            t["perm"] = self.lin.perm
        if self.input_scale is not None:
            t["input_scale"] = self.input_scale
        if self.lin.bias is not None:
            t["bias"] = self.lin.bias
        return Int4Linear.from_quantized(t, in_features=self.k)


@torch.no_grad()
def round_steps(tunables: list[TunableInt4], lr: float) -> None:
    """:meth:`TunableInt4.round_step` for many layers at once (four ``torch._foreach`` calls, not four ops a layer)."""
    live = [t for t in tunables if t.v.grad is not None]
    if not live:
        return
    vs = [t.v for t in live]
    signs = torch._foreach_sign([t.v.grad for t in live])
    torch._foreach_add_(vs, signs, alpha=-lr)
    torch._foreach_clamp_min_(vs, -1.0)
    torch._foreach_clamp_max_(vs, 1.0)
    for t in live:
        t.v.grad = None


class _TunableWeight(torch.autograd.Function):
    """:class:`TunableInt4`'s weight ``(clamp(round(q + v), 0, 15) - z) * s0 * exp(log_s)`` (columns to
    input order, times an AWQ input scale) with its gradients written out.

    The same gradients as autograd through the formula with a straight-through round (the clamp's
    gradient passes where the rounded code is in [0, 15]; :meth:`TunableInt4.codes`), up to float
    summation order. By hand because autograd recorded ~10 ops a layer plus the column permutation's
    scatter and kept the code and scale temporaries (a large share of a refinement step:
    docs/benchmarks.md); here the forward keeps only its inputs and the backward recomputes the codes:
    the checkpointed version's memory, a third of its ops.
    """

    @staticmethod
    def forward(ctx, v, log_s, q, z, s0, k, inv, pos, input_scale):
        n = q.shape[0]
        scale = s0 * log_s.exp()  # [n, G]
        w = q.float().add_(v).round_().clamp_(0, 15).sub_(z).mul_(scale[..., None]).reshape(n, -1)[:, :k]
        if inv is not None:
            w = w.index_select(1, pos)  # input i is stored column pos[i]
        if input_scale is not None:
            w = w * input_scale
        ctx.save_for_backward(v, log_s, q, z, s0, inv, input_scale)
        ctx.k = k
        return w

    @staticmethod
    def backward(ctx, gw):  # gw [n, K] input order -> (dv [n, G, g], dlog_s [n, G])
        v, log_s, q, z, s0, inv, input_scale = ctx.saved_tensors
        n, groups, g = q.shape
        if input_scale is not None:
            gw = gw * input_scale
        gs = gw.new_zeros(n, groups * g)
        gs[:, : ctx.k] = gw if inv is None else gw.index_select(1, inv)  # stored column j is input inv[j]
        gs = gs.view(n, groups, g)
        c = q.float().add_(v).round_()
        inside = (c >= 0) & (c <= 15)
        scale = s0 * log_s.exp()
        dv = (gs * scale[..., None]).mul_(inside)
        dlog_s = (gs * c.clamp_(0, 15).sub_(z)).sum(-1).mul_(scale)
        return dv, dlog_s, None, None, None, None, None, None, None

