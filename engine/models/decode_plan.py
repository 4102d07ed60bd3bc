"""The CPU decode plan: which kernel each projection, norm, MLP and layer runs, decided once at engine build.

A small model's decode step is ~30 layers of tens of microseconds, and asking per call which kernel applies
cost as much Python as the kernels take. :func:`build_decode_plan` (after loading, packing and fusing) plans
from what never changes; a step asks only its own facts (rows, autograd, ``GatherPlan.one_call``)::

    per module     Linear.kernel: LinearKernel    RMSNorm.c_rows    MLP.c_glu      (plan_kernels)
    per MoE block  MoE.grouped: kernels.MoEExperts | None (resident experts), MoE.held_args (held by their source)
    per layer      DecoderLayer.decode: LayerPlan | None -> kernels.DecodeLayer: 2 C calls around attention
                   (an MoE layer's: attention's 2, then the router and the grouped experts' 1)
    per model      DecoderModel.decode_plan: DecodePlan -> stack: kernels.DecodeStack | None: 1 C call a step

No fused plan (op by op, the same bits) for a projection without a C decode GEMV, a Gemma MLP, an MoE block
whose experts run one by one, or weights bound per step (``LayerRunner.rebinds``); no stack with an MoE layer. Replacing a planned layer's weights or modules needs
:func:`clear_decode_plan` or a rebuild (a stale plan holds its tensors: old weights, never freed memory).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from llmsys import kernels
from llmsys.engine.attention import AttentionBackend, BackendDecorator, CpuBackend
from llmsys.engine.models.base import MLP, DecoderLayer, DecoderModel, Linear, RMSNorm
from llmsys.engine.models.moe import MoE
from llmsys.kernels.common.protocols import ExpertSource, LayerRunner
from llmsys.quant.base import QuantLinear


@dataclass(frozen=True)
class LayerPlan:
    """One decoder layer's fused decode kernels (``kernels.layer_attn_in`` / ``kernels.layer_mlp``)."""

    fused: kernels.DecodeLayer
    max_rows: int  # the most rows every projection's C GEMV takes (the formats' PACKED_MAX_ROWS)
    dtype: torch.dtype  # the activations' (bf16, or float32 for float32 weights)
    holds: tuple[torch.Tensor, ...]  # every tensor ``fused`` points into, kept alive with the plan
    moe: bool = False  # an MoE layer: attention fused, then its block's grouped experts (``MoE.grouped``)


@dataclass(frozen=True)
class DecodePlan:
    """The model's decode kernels: per layer (None: op by op) and, when every layer fuses with the CPU
    backend's one-call attention, the whole decoder as one C call (``stack``) over ``backend``'s pools."""

    layers: tuple[LayerPlan | None, ...]
    stack: kernels.DecodeStack | None
    backend: AttentionBackend  # the backend whose pools the stack writes
    dtype: torch.dtype | None  # the stack's activations
    max_rows: int  # the stack's most rows


def layer_plan(layer: DecoderLayer, dtype: torch.dtype) -> LayerPlan | None:
    """``layer``'s fused decode arguments for ``dtype`` activations when every projection runs a C decode GEMV
    (int8 / int4 a8, the C bf16 GEMV, the C float32 GEMV on small plain weights; each ``decode_weight``) and the
    layer is Llama's shape (one norm before attention and the MLP each, SwiGLU), else None."""
    if dtype not in (torch.bfloat16, torch.float32):
        return None
    at, mlp = layer.self_attn, layer.mlp
    ln1, ln2 = layer.input_layernorm, layer.post_attention_layernorm
    moe = isinstance(mlp, MoE)
    if moe and mlp.grouped is None and mlp.held_args is None:
        return None  # experts expert by expert: op by op
    if not moe and (type(mlp) is not MLP or not mlp.silu):
        return None  # (GeGLU, gpt-oss's clamped SwiGLU in a dense MLP: the C layer runs SwiGLU)
    if layer.pre_feedforward_layernorm is not None or ln1.offset:
        return None
    if ln1.weight.dtype != dtype or ln2.weight.dtype != dtype or ln1.weight.device.type != "cpu":
        return None
    if not ln1.weight.is_contiguous() or not ln2.weight.is_contiguous():
        return None
    qkv = [at.qkv_proj] if at.qkv_proj is not None else [at.q_proj, at.k_proj, at.v_proj]
    gu = [] if moe else [mlp.gate_up_proj] if mlp.gate_up_proj is not None else [mlp.gate_proj, mlp.up_proj]
    mods = [*qkv, at.o_proj, *gu, *([] if moe else [mlp.down_proj])]
    if not all(isinstance(m, (QuantLinear, Linear)) for m in mods):
        return None
    ws = [m.decode_weight() for m in mods]
    if any(w is None for w in ws) or any((w.kind == kernels.WeightKind.F32) != (dtype == torch.float32) for w in ws):
        return None  # (float32 activations read float32 weights only; bf16 ones the rest)
    n = len(qkv)
    gu_ws, down_w = ([], None) if moe else (ws[n + 1 : -1], ws[-1])
    fused = kernels.decode_layer_args(ws[:n], ws[n], gu_ws, down_w, ln1.weight, ln1.eps, ln2.weight, ln2.eps)
    holds = tuple(t for m in (*mods, ln1, ln2) for t in (*m._parameters.values(), *m._buffers.values())
                  if t is not None)
    return LayerPlan(fused, min(m.DECODE_MAX_ROWS for m in mods), dtype, holds, moe)


def _expert_modules(ex: torch.nn.Module) -> list[torch.nn.Module] | None:
    """An expert's gate|up projections then its down projection when it is a SwiGLU MLP (or gpt-oss's clamped one)
    whose activation runs the C row code and whose projections may run a C decode GEMV; else None (GeGLU)."""
    if type(ex) is not MLP or not ex.c_glu:
        return None
    mods = [*([ex.gate_up_proj] if ex.gate_up_proj is not None else [ex.gate_proj, ex.up_proj]), ex.down_proj]
    return mods if all(isinstance(m, (QuantLinear, Linear)) for m in mods) else None


def _expert_weights(mods: list[torch.nn.Module], dtype: torch.dtype) -> list[kernels.DecodeWeight] | None:
    """The C decode weights of an expert's projections as they are bound now, or None (no C GEMV for them)."""
    ws = [m.decode_weight() for m in mods]
    if any(w is None for w in ws) or any((w.kind == kernels.WeightKind.F32) != (dtype == torch.float32) for w in ws):
        return None
    return ws


def _one_format(ws: list[list[kernels.DecodeWeight]]) -> bool:
    """Are these experts' weights (each expert's list) all of one format and shape (what the kernel takes)?"""
    return len({tuple((w.kind, w.n, w.k) for w in e) for e in ws}) == 1


def moe_plan(moe: MoE, dtype: torch.dtype) -> kernels.MoEExperts | None:
    """The grouped expert kernel's arguments for ``moe`` on ``dtype`` activations when every expert is resident with
    a C decode GEMV per projection and the C row activation (what the per-expert path then computes: the same
    bits), all experts in one format; else None (expert by expert, or :func:`held_plan`)."""
    if dtype not in (torch.bfloat16, torch.float32) or not kernels.cpu_fused_available():
        return None
    ws, rows = [], []
    for ex in moe.experts:
        mods = _expert_modules(ex)
        if mods is None or any(t.device.type != "cpu" for m in mods for t in (*m.parameters(), *m.buffers())):
            return None  # (experts on disk or on another device: their source binds them)
        w = _expert_weights(mods, dtype)
        if w is None:
            return None
        ws.append(w)
        rows.append(min(m.DECODE_MAX_ROWS for m in mods))
    if not _one_format(ws) or min(rows) < 1:
        return None  # experts in several formats: expert by expert
    return kernels.moe_experts_args([w[:-1] for w in ws], [w[-1] for w in ws], min(rows), moe.experts[0].swiglu)


@dataclass
class HeldExperts:
    """``MoE.held_args`` for experts an expert source holds (``each(..., hold=True)``: slots of the RAM expert
    cache): the grouped kernel's arguments with the entries of the ids held now. An expert's decode weights are
    made once per place its weights are held in (``ExpertSource.where``: binding its module costs more than its
    GEMVs), and its module is bound only then."""

    experts: list[torch.nn.Module]
    dtype: torch.dtype
    max_rows: int
    clamped: tuple[float, float] | None
    bound: dict[int, tuple[int, list[kernels.DecodeWeight]]] = field(default_factory=dict)  # id -> (where, weights)
    args: kernels.MoEExperts | None = None

    def __call__(self, ids: list[int], source: ExpertSource) -> kernels.MoEExperts | None:
        ws = []
        for e in ids:
            where = source.where(e)
            got = self.bound.get(e)
            if got is None or got[0] != where:
                source.bind(e)
                w = _expert_weights(_expert_modules(self.experts[e]), self.dtype)
                if w is None:
                    return None
                got = self.bound[e] = (where, w)
            ws.append(got[1])
        if self.args is None:  # every entry the first expert's until its own is held (the kernel reads routed ids only)
            n = len(self.experts)
            self.args = kernels.moe_experts_args([ws[0][:-1]] * n, [ws[0][-1]] * n, self.max_rows, self.clamped)
        gu, down = self.args.arrays
        n_gu = len(ws[0]) - 1
        if not _one_format([*ws, [*gu[:n_gu], down[0]]]):
            return None
        for e, w in zip(ids, ws):
            for j in range(n_gu):
                gu[e * n_gu + j] = w[j]
            down[e] = w[-1]
        return self.args


def held_plan(moe: MoE, dtype: torch.dtype) -> HeldExperts | None:
    """:class:`HeldExperts` for ``moe`` when its experts' modules may run the grouped kernel once bound, else None."""
    if dtype not in (torch.bfloat16, torch.float32) or not kernels.cpu_fused_available():
        return None
    mods = [_expert_modules(ex) for ex in moe.experts]
    if any(m is None for m in mods):
        return None
    rows = min(m.DECODE_MAX_ROWS for ms in mods for m in ms)
    return HeldExperts(list(moe.experts), dtype, rows, moe.experts[0].swiglu) if rows >= 1 else None


def build_decode_plan(model: DecoderModel, attn: AttentionBackend, layers: LayerRunner | None = None
                      ) -> DecodePlan | None:
    """The plan of ``model`` over ``attn``'s pool, set on the model and its layers (and returned); None (and the
    op-by-op forward everywhere) off the CPU or without the C kernels. ``layers``: the offload runtime, whose
    streamed layers get no plan."""
    clear_decode_plan(model)
    dtype = model.model.norm.weight.dtype
    if model.model.norm.weight.device.type != "cpu" or not kernels.cpu_fused_available():
        return None
    plan_kernels(model, dtype)
    plans: list[LayerPlan | None] = []
    for i, layer in enumerate(model.model.layers):
        if isinstance(layer.mlp, MoE):
            layer.mlp.grouped = None if layers is not None and layers.rebinds(i) else moe_plan(layer.mlp, dtype)
            layer.mlp.held_args = held_plan(layer.mlp, dtype) if layer.mlp.grouped is None else None
        lp = None if layers is not None and layers.rebinds(i) else layer_plan(layer, dtype)
        layer.decode = lp
        plans.append(lp)
    while isinstance(attn, BackendDecorator):  # a KV policy's: the stack runs on steps it steps aside from
        attn = attn.inner
    stack, pools = None, attn.decode_pools() if isinstance(attn, CpuBackend) else None
    if layers is None and pools is not None and pools[0][0].dtype == dtype and all(
            p is not None and not p.moe for p in plans) and all(
            _one_call_attention(layer) for layer in model.model.layers):
        stack = kernels.decode_stack_args([
            kernels.StackLayer(p.fused, *pools[layer.self_attn.index], layer.self_attn.n_heads, layer.self_attn.n_kv,
                               layer.self_attn.head_dim, layer.self_attn.scale, layer.self_attn.rope_table,
                               layer.self_attn.rope_tables)
            for p, layer in zip(plans, model.model.layers)])
    rows = min((p.max_rows for p in plans if p is not None), default=0)
    plan = DecodePlan(tuple(plans), stack, attn, dtype if stack is not None else None, rows)
    model.decode_plan = plan
    return plan


def plan_kernels(model: DecoderModel, dtype: torch.dtype) -> None:
    """Each resident dense projection's matmul kernel (``Linear.kernel``), and whether each resident norm and each
    SwiGLU (on ``dtype`` activations) runs the C row code. The offload runtime's streamed weights are meta
    placeholders here, bound per step in a dtype the runtime converts to: their ops keep choosing per call."""
    rows = (torch.bfloat16, torch.float32)
    for mod in model.modules():
        if type(mod) is Linear and mod.weight is not None and mod.weight.device.type == "cpu":
            mod.kernel = kernels.linear_kernel(mod.weight, mod.bias, packed_when_resident=mod.packed_when_resident)
        elif type(mod) is RMSNorm:
            w = mod.weight
            mod.c_rows = not mod.offset and w.dtype in rows and w.device.type == "cpu" and w.is_contiguous()
        elif type(mod) is MLP:
            mod.c_glu = (mod.silu or mod.swiglu is not None) and dtype in rows and _on_cpu(mod)


def clear_decode_plan(model: DecoderModel) -> None:
    """Drop the fused layers and the stack (every layer op by op, each op by its planned kernel: the same bits):
    before a planned layer's weights or modules are replaced (quantization's calibration swaps them)."""
    model.decode_plan = None
    for layer in model.model.layers:
        layer.decode = None
        if isinstance(layer.mlp, MoE):
            layer.mlp.grouped = layer.mlp.held_args = None


def _on_cpu(mod: torch.nn.Module) -> bool:
    t = next((t for t in (*mod.parameters(), *mod.buffers())), None)
    return t is not None and t.device.type in ("cpu", "meta")


def _one_call_attention(layer: DecoderLayer) -> bool:
    """Does the layer's attention run as the CPU backend's one C call (RoPE over whole heads, the K/V store,
    plain decode attention: no q/k norms, window, soft cap or sinks)?"""
    at = layer.self_attn
    return (at.q_norm is None and at.rotary_dim == at.head_dim and at.window is None and at.softcap is None
            and at.sinks is None)
