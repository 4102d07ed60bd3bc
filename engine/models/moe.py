"""The mixture-of-experts block a sparse layer runs in place of its MLP (Qwen2-MoE, Qwen3-MoE, Mixtral, gpt-oss).

A router (``gate``) scores the experts; each token runs its top ``k`` SwiGLU experts, summed with the
routing weights (Qwen2-MoE adds a sigmoid-gated shared expert). :func:`route` follows transformers
exactly: a float32 softmax over all experts, ``topk``, optional renormalisation, weights rounded to the
model dtype (Qwen) or kept in float32 (Mixtral); gpt-oss's biased router takes the top ``k`` logits first,
then a softmax over those. Where the engine's decode plan allows it, every routed expert of the step runs in one
C call (``kernels.moe_experts``: resident experts, or those an expert source holds in its cache); otherwise tokens
are grouped by expert (one GEMM per active expert, ``index_select``). Either way each ``(token, slot)`` row is
written once and a token's ``k`` rows are summed at the end in slot order, as transformers' ``grouped_mm`` path
sums them: the same bits. Experts are the engine's ``MLP`` modules (quantized
and prepacked like any projection); the router and the shared expert's gate are :class:`FloatLinear`,
which quantization passes by (an int4 router would pick other experts). ``base`` builds the experts and
hands them in, so this module does not import it.
"""

from __future__ import annotations

from typing import Any, Callable, Optional

import torch
import torch.nn.functional as F
from torch import nn

from llmsys import kernels
from llmsys.kernels.common.protocols import ExpertSource


class FloatLinear(nn.Module):
    """``x @ weight.T (+ bias)`` with the weight kept in the model's float dtype (never quantized nor packed)."""

    def __init__(self, in_features: int, out_features: int, bias: bool = False):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(out_features, in_features))
        self.bias = nn.Parameter(torch.empty(out_features)) if bias else None  # gpt-oss's router

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [T, K] -> [T, N]
        return F.linear(x, self.weight, self.bias)


def route(logits: torch.Tensor, k: int, normalize: bool, float_weights: bool,
          topk_first: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """Router logits ``[T, E]`` -> (weights ``[T, k]``, experts ``[T, k]`` int64), as transformers' routers do.

    Softmax over all experts in float32, the top ``k`` probabilities (``torch.topk``: descending, ties to
    the lower index), renormalised to sum 1 when ``normalize``; then rounded to the logits' dtype unless
    ``float_weights`` (Mixtral's router leaves them float32; Qwen2/3-MoE's cast them back).
    ``topk_first`` (gpt-oss's ``GptOssTopKRouter``): the top ``k`` logits, then a softmax over just those in
    the logits' dtype (the same choice; weights that equal the renormalised ones up to rounding).
    """
    if topk_first:
        top, experts = torch.topk(logits, k, dim=-1)  # [T, k]
        return torch.softmax(top, dim=-1, dtype=top.dtype), experts
    probs = torch.softmax(logits, dim=-1, dtype=torch.float32)  # [T, E]
    top, experts = torch.topk(probs, k, dim=-1)  # [T, k]
    if normalize:
        top = top / top.sum(dim=-1, keepdim=True)
    return (top if float_weights else top.to(logits.dtype)), experts


class MoE(nn.Module):
    """Router + ``num_experts`` experts (+ an optional sigmoid-gated shared expert): ``[T, hidden] -> [T, hidden]``."""

    def __init__(self, a: Any, expert: Callable[[int], nn.Module]):
        """``a``: the model's ``TransformerArgs``; ``expert(intermediate)``: a new SwiGLU MLP of that width."""
        super().__init__()
        self.top_k, self.normalize, self.float_weights = a.num_experts_per_tok, a.norm_topk_prob, a.router_float_weights
        self.topk_first = a.router_topk_first
        # the router (HF: mlp.gate; gpt-oss: mlp.router, with a bias)
        self.gate = FloatLinear(a.hidden_size, a.num_experts, a.router_bias)
        self.experts = nn.ModuleList(expert(a.moe_intermediate_size) for _ in range(a.num_experts))
        shared = a.shared_expert_intermediate_size
        self.shared_expert = expert(shared) if shared else None
        self.shared_expert_gate = FloatLinear(a.hidden_size, 1) if shared else None
        # The grouped expert kernel's arguments (every routed expert in one C call), set once by the engine's decode
        # plan when every expert is resident with a C GEMV (engine/models/decode_plan.py); None: expert by expert.
        self.grouped: kernels.MoEExperts | None = None
        # Experts bound by an expert source (on disk, read into the cache): the grouped kernel's arguments for the
        # ids bound at the moment (engine/models/decode_plan.py held_plan), or None: expert by expert.
        self.held_args: Optional[Callable[[list[int], ExpertSource], Optional[kernels.MoEExperts]]] = None

    def forward(self, x: torch.Tensor, decode: bool = False, experts: ExpertSource | None = None) -> torch.Tensor:
        """``x [T, hidden]`` -> ``[T, hidden]``. ``decode``: the experts' projections run without module
        dispatch (as ``MLP.forward``; calibration hooks see prompt steps). ``experts``: where the experts' weights
        are when they are not resident with the layer (``llmsys.offload.experts``, handed in by the offload
        runtime): only the experts the router chose are asked for, and they compute on its device."""
        T, H = x.shape
        k = self.top_k
        weights, chosen = route(self.gate(x), k, self.normalize, self.float_weights, self.topk_first)  # [T, k] each
        if experts is not None:
            experts.prefetch_next(x)  # a disk source may start reading the next layer's likely experts
        if not torch.is_grad_enabled():
            g = self.grouped
            if g is not None and experts is None and x.dtype is g.dtype:
                return self._shared(x, self._grouped(g, x, chosen, weights, decode), decode)
            if self.held_args is not None and experts is not None and experts.device == x.device:
                h = self._grouped_held(x, chosen, weights, experts, decode)
                if h is not None:
                    return self._shared(x, h, decode)
        flat = chosen.reshape(-1)  # [T k]: row r is token r // k's slot r % k
        order = torch.argsort(flat, stable=True)  # rows grouped by expert, each group in token order
        counts = torch.bincount(flat, minlength=len(self.experts)).tolist()
        w = weights.reshape(-1, 1)  # [T k, 1]
        xe = x
        if experts is not None and experts.device != x.device:  # --cpu-moe: the rows go to the experts
            xe, order, w = x.to(experts.device), order.to(experts.device), w.to(experts.device)
        out = xe.new_empty(T * k, H, dtype=torch.promote_types(x.dtype, w.dtype))  # [T k, H] weighted outputs
        starts, start = {}, 0
        for e, n in enumerate(counts):
            if n:
                starts[e] = start
                start += n
        active = list(starts)
        # Each (token, slot) row is written once, so the order the experts run in changes no bit.
        for e in (experts.each(active) if experts is not None else active):
            rows = order[starts[e] : starts[e] + counts[e]]  # [n]
            y = self.experts[e].forward(xe.index_select(0, rows // k), decode)  # [n, H]: one GEMM per projection
            out.index_copy_(0, rows, y * w.index_select(0, rows))
        h = out.view(T, k, H).sum(dim=1).to(device=x.device, dtype=x.dtype)  # [T, H]
        return self._shared(x, h, decode)

    def _grouped(self, g: kernels.MoEExperts, x: torch.Tensor, chosen: torch.Tensor, weights: torch.Tensor,
                 decode: bool, held: ExpertSource | None = None) -> torch.Tensor:
        """Every routed expert in one C call (``kernels.moe_experts``) -> ``[T, H]``, the per-expert path's bits.
        ``held``: the source holding the experts (bound on demand for the left-over ones)."""
        h, rows, counts = kernels.moe_experts(g, x, chosen, weights)
        if h is None:  # a long prompt's expert with more rows than the C GEMV's bits hold for
            h = self._left_over(x, chosen, weights, rows, counts, g.max_rows, decode, held)
        return h

    def _grouped_held(self, x: torch.Tensor, chosen: torch.Tensor, weights: torch.Tensor, experts: ExpertSource,
                      decode: bool) -> torch.Tensor | None:
        """:meth:`_grouped` over experts an expert source holds all at once (``each(..., hold=True)``: reads of the
        missing ones in flight together); None when they do not fit its cache or their formats have no C kernel
        (the caller goes expert by expert)."""
        active = torch.unique(chosen).tolist()  # [n] ascending
        if not experts.holds(len(active)):
            return None
        held = experts.each(active, hold=True)
        try:
            for _ in active:
                next(held)
            g = self.held_args(active, experts)
            if g is None or x.dtype is not g.dtype:
                self.held_args = None  # formats without a C decode weight: expert by expert from now on
                return None
            return self._grouped(g, x, chosen, weights, decode, experts)
        finally:
            held.close()  # the experts released (any bound for a left-over one unbound)

    def _shared(self, x: torch.Tensor, h: torch.Tensor, decode: bool) -> torch.Tensor:
        """``h`` plus Qwen2-MoE's sigmoid-gated shared expert of ``x`` (``[T, H]`` each)."""
        if self.shared_expert is not None:
            h = h + torch.sigmoid(self.shared_expert_gate(x)) * self.shared_expert.forward(x, decode)
        return h

    def _left_over(self, x: torch.Tensor, chosen: torch.Tensor, weights: torch.Tensor, rows: torch.Tensor,
                   counts: torch.Tensor, max_rows: int, decode: bool, held: ExpertSource | None) -> torch.Tensor:
        """The grouped kernel's left-over experts (more than ``max_rows`` rows) by their own forward, their products
        into ``rows [T k, H]`` beside the kernel's, then the per-expert path's sum -> ``[T, H]``."""
        T, k = chosen.shape
        flat = chosen.reshape(-1)  # [T k]
        w = weights.reshape(-1, 1)  # [T k, 1]
        for e in (counts > max_rows).nonzero().flatten().tolist():
            if held is not None:
                held.bind(e)
            r = (flat == e).nonzero().flatten()  # [n]: its rows, in token order
            y = self.experts[e].forward(x.index_select(0, r // k), decode)  # [n, H]
            rows.index_copy_(0, r, y * w.index_select(0, r))
        return rows.view(T, k, -1).sum(dim=1).to(x.dtype)
