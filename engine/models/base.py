"""The decoder shared by every supported architecture.

Llama, Mistral, Qwen2, Qwen3, Phi-3, Gemma 2/3 and the MoE families (Qwen2-MoE, Qwen3-MoE, Mixtral,
gpt-oss) differ only in switches (biases, q/k norms, head_dim, RoPE scaling and partial rotary, tied
embeddings, fused q|k|v and gate|up checkpoints, Gemma's ``1 + w`` norms, GeGLU, scaled embeddings,
soft-capped logits, sliding windows with their own RoPE table, experts in place of the MLP, gpt-oss's
sinks, biases and clamped SwiGLU), so one decoder implements them and each family module maps its HF
config onto :class:`TransformerArgs`. A batch's tokens are packed into one ``[T, ...]`` tensor; attention
gets the per-sequence layout from :class:`~llmsys.engine.attention.AttentionMetadata`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F
from torch import nn

from llmsys import kernels
from llmsys.engine.attention import AttentionBackend, AttentionMetadata
from llmsys.engine.models.moe import MoE
from llmsys.kernels.common.errors import UnsupportedModelError
from llmsys.kernels.common.protocols import ExpertSource, LayerRunner
from llmsys.quant.base import QuantLinear

if TYPE_CHECKING:
    from llmsys.engine.models.decode_plan import DecodePlan, LayerPlan


@dataclass
class TransformerArgs:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: dict[str, Any] | None = None
    max_position_embeddings: int = 2048
    tie_word_embeddings: bool = False
    attention_bias: bool = False  # bias on q/k/v projections (Qwen2)
    qk_norm: bool = False  # RMSNorm per head on q and k (Qwen3, Gemma 3)
    bos_token_id: int | None = None
    eos_token_id: list[int] = field(default_factory=list)
    hidden_act: str = "silu"  # the MLP gate's activation: silu (SwiGLU) or gelu_pytorch_tanh (GeGLU: Gemma)
    partial_rotary_factor: float = 1.0  # the part of each head RoPE rotates (Phi-4-mini: 0.75)
    fused_qkv: bool = False  # the checkpoint stores q|k|v as one qkv_proj (Phi-3): built and kept fused
    fused_gate_up: bool = False  # ... and gate|up as one gate_up_proj
    sliding_window: int | None = None  # a sliding layer's keys: fewer than this many positions behind each query
    # Per layer "sliding_attention" or "full_attention" (Gemma 2/3); None: every layer slides when sliding_window
    # is set (Phi-3, Mistral).
    layer_types: tuple[str, ...] | None = None
    local_rope_theta: float | None = None  # Gemma 3: the sliding layers' RoPE base (their own table, unscaled)
    query_pre_attn_scalar: float | None = None  # Gemma: attention scale query_pre_attn_scalar ** -0.5, not head_dim's
    attn_logit_softcapping: float | None = None  # Gemma 2: attention logits cap * tanh(logits / cap)
    final_logit_softcapping: float | None = None  # Gemma 2: the LM head's logits likewise
    norm_offset: bool = False  # Gemma: RMSNorm weights are stored as w and scale by (1 + w), in float32
    sandwich_norms: bool = False  # Gemma 2/3: norms on both sides of attention and of the MLP
    embed_scale: bool = False  # Gemma: embeddings times sqrt(hidden_size) (rounded to the model dtype)
    # Mixture of experts (Qwen2-MoE, Qwen3-MoE, Mixtral; engine/models/moe.py): a sparse layer's MLP is a router
    # over num_experts SwiGLU experts of moe_intermediate_size, each token run through its top num_experts_per_tok.
    num_experts: int = 0  # 0: every layer dense
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    norm_topk_prob: bool = False  # the top-k probabilities renormalised to sum 1 (Qwen3-MoE's, Mixtral's)
    # Mixtral: routing weights stay float32 (transformers' MixtralTopKRouter never casts them back), so experts'
    # outputs are weighted and summed in float32; Qwen's are rounded to the model dtype first.
    router_float_weights: bool = False
    shared_expert_intermediate_size: int = 0  # Qwen2-MoE: an always-run expert, sigmoid-gated per token (0: none)
    sparse_layers: tuple[int, ...] | None = None  # the layers with an MoE block (None: all, when num_experts)
    # How a checkpoint's fused expert tensors lie (engine/loader/experts.py): "rows" ([E, 2 I, H] gate rows
    # then up rows, [E, H, I]: transformers' Qwen/Mixtral layout) or "gpt_oss" (x @ W, gate/up interleaved).
    experts_layout: str = "rows"
    router_bias: bool = False  # gpt-oss: the router is a linear layer with a bias
    # gpt-oss: top-k of the router's logits, then a softmax over those k (in the logits' dtype), where the
    # others take the softmax over all experts first (moe.route).
    router_topk_first: bool = False
    # gpt-oss's attention and MLP (engine/models/gpt_oss.py)
    o_proj_bias: bool = False  # a bias on o_proj too (gpt-oss's attention_bias covers all four projections)
    attention_sinks: bool = False  # a learned logit per query head in each softmax's denominator, with no value
    mlp_bias: bool = False  # biases on gate/up/down (gpt-oss's experts)
    # Clamped SwiGLU (gpt-oss): gate clamped above at the limit, up to +-limit, (up + 1) * gate * sigmoid(alpha
    # gate) in place of act(gate) * up; None: the plain gated MLP of hidden_act.
    swiglu_limit: float | None = None
    swiglu_alpha: float = 1.702

    @property
    def rotary_dim(self) -> int:
        """The dims of each head RoPE rotates (its first ones; the width of the RoPE table)."""
        return int(self.head_dim * self.partial_rotary_factor)

    @property
    def longrope(self) -> bool:
        """LongRoPE (Phi-3 ``rope_scaling`` type ``longrope`` / ``su``): short and long factor tables."""
        return kernels.rope_type(self.rope_scaling) == "longrope"

    @property
    def rope_tables(self) -> list[tuple[float, dict[str, Any] | None, bool]]:
        """``(theta, scaling, long)`` of each RoPE table :func:`rope_cache` stacks, in order.

        One for most models; LongRoPE: its short then long factors (a sequence's tokens take the long
        table once it is longer than the original context, :meth:`DecoderModel.rope_positions`);
        Gemma 3: the global layers' then the local (sliding) layers' (:meth:`layer_rope`)."""
        if self.longrope:
            return [(self.rope_theta, self.rope_scaling, False), (self.rope_theta, self.rope_scaling, True)]
        if self.local_rope_theta is not None:
            return [(self.rope_theta, self.rope_scaling, False), (self.local_rope_theta, None, False)]
        return [(self.rope_theta, self.rope_scaling, False)]

    def sliding(self, i: int) -> bool:
        """Does layer ``i`` attend through a sliding window?"""
        if self.sliding_window is None:
            return False
        return self.layer_types is None or self.layer_types[i] == "sliding_attention"

    def sparse(self, i: int) -> bool:
        """Is layer ``i``'s MLP a mixture of experts (:class:`~llmsys.engine.models.moe.MoE`)?"""
        return self.num_experts > 0 and (self.sparse_layers is None or i in self.sparse_layers)

    def layer_rope(self, i: int) -> int:
        """Which of :attr:`rope_tables` layer ``i`` rotates with (Gemma 3's sliding layers: the local one)."""
        return 1 if self.local_rope_theta is not None and self.sliding(i) else 0

    @classmethod
    def _common(cls, cfg: dict[str, Any], **overrides: Any) -> dict[str, Any]:
        heads = cfg["num_attention_heads"]
        eos = cfg.get("eos_token_id")
        # transformers >= 5 writes `rope_parameters` (theta inside); older
        # configs write `rope_theta` + `rope_scaling`. Accept both.
        rope = dict(cfg.get("rope_parameters") or {})
        theta = rope.pop("rope_theta", None)  # a 0 here is a value to reject (loader.validate), not "absent"
        theta = cfg.get("rope_theta", 10000.0) if theta is None else theta
        scaling = cfg.get("rope_scaling") or (rope if rope.get("rope_type", "default") != "default" else None)
        kw = dict(
            vocab_size=cfg["vocab_size"],
            hidden_size=cfg["hidden_size"],
            intermediate_size=cfg["intermediate_size"],
            num_hidden_layers=cfg["num_hidden_layers"],
            num_attention_heads=heads,
            num_key_value_heads=cfg.get("num_key_value_heads") or heads,
            head_dim=cfg.get("head_dim") or cfg["hidden_size"] // heads,
            rms_norm_eps=cfg.get("rms_norm_eps", 1e-6),
            rope_theta=theta,
            rope_scaling=scaling,
            max_position_embeddings=cfg.get("max_position_embeddings", 2048),
            tie_word_embeddings=cfg.get("tie_word_embeddings", False),
            bos_token_id=cfg.get("bos_token_id"),
            eos_token_id=[] if eos is None else ([eos] if isinstance(eos, int) else list(eos)),
            hidden_act=cfg.get("hidden_act") or "silu",
        )
        kw.update(overrides)
        return kw


def rope_cache(args: TransformerArgs, device: torch.device | None = None,
               positions: int | None = None) -> torch.Tensor:
    """``[S * P, R]`` float32: the model's ``S`` RoPE tables (:attr:`TransformerArgs.rope_tables`) of ``P``
    positions each (``positions``, default ``max_position_embeddings``), stacked; ``R`` columns cos | sin of
    the rotary dims (default/linear/llama3/longrope scaling).

    Why one stacked table: every layer and kernel takes one ``rope_cache`` and reads rows by position; a
    layer (Gemma 3's local ones) or a sequence (LongRoPE's long ones) that needs the second table reads row
    ``position + P`` (:meth:`Attention.rope_positions`, :meth:`DecoderModel.rope_positions`).
    """
    n = positions or args.max_position_embeddings
    try:
        tables = [
            kernels.build_rope_cache(args.rotary_dim, n, theta, scaling, device, long,
                                     kernels.rope_attention_factor(scaling, args.max_position_embeddings))
            for theta, scaling, long in args.rope_tables
        ]
    except ValueError as e:
        raise UnsupportedModelError(f"config.json: {e}") from None
    return tables[0] if len(tables) == 1 else torch.cat(tables)


class Linear(nn.Linear):
    """``nn.Linear`` whose matmul goes through ``kernels.linear`` (the faster
    GEMM library per shape on CPU). Still an ``nn.Linear``, so quantization
    swaps it and checkpoints load into it by name."""

    # False for a head tied to an embedding held in memory: never prepacked (see
    # prepack_linears), so its plain weight must not be packed on the fly either (kernels.linear).
    packed_when_resident = True
    # Batches that kernels.linear runs through the C bf16 GEMV (below the size that takes a GEMM).
    DECODE_MAX_ROWS = kernels.BF16_UPCAST_MIN_ROWS - 1
    # The matmul's kernel, decided once from the weight by the engine's decode plan (decode_plan.plan_kernels);
    # None (a model outside an engine): kernels.linear decides per call.
    kernel: kernels.LinearKernel | None = None

    def decode_weight(self) -> kernels.DecodeWeight | None:
        """The fused decode layers' weight when ``kernels.linear`` runs this layer's decode-sized batches
        through a C GEMV (a plain CPU bf16 weight, or a float32 one too small to pack), else None: the fused
        layer then gives this layer's bits."""
        return kernels.decode_weight(self.weight, self.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.kernel is None:
            return kernels.linear(x, self.weight, self.bias, packed_when_resident=self.packed_when_resident)
        return kernels.run_linear(self.kernel, x, self.weight, self.bias)

    def logits(self, x: torch.Tensor) -> torch.Tensor:  # [N, hidden] float32 -> [N, V] float32
        """This layer as the LM head: float32 logits, never rounded to the weight's dtype (``kernels.linear_logits``)."""
        return kernels.linear_logits(x, self.weight, self.bias, packed_when_resident=self.packed_when_resident)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float, offset: bool = False):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps
        # Gemma: the stored weight is w and the norm scales by (1 + w), all in float32 before the one
        # rounding to the input's dtype (HF GemmaRMSNorm), where Llama rounds first, then multiplies.
        self.offset = offset
        # The C row kernel (``kernels.cpu_fused_rms_norm``, the fused decode layers' row code) for this weight,
        # decided once by the engine's decode plan (decode_plan.plan_kernels); False: ``kernels.rms_norm``.
        self.c_rows = False

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        """HF LlamaRMSNorm numerics (GemmaRMSNorm's with ``offset``); with ``residual`` the add is fused and
        ``(normed, x + residual)`` is returned.

        With ``c_rows`` (planned once), the C kernel ``kernels.rms_norm`` would pick, without the
        wrapper's checks, which cost as much as the op at decode: the same bits. Autograd (quantization's
        refinement) and other inputs take ``kernels.rms_norm``.
        """
        w = self.weight
        if self.offset:
            h = x if residual is None else x + residual
            out = (F.rms_norm(h.float(), (h.shape[-1],), None, self.eps) * (1.0 + w.float())).to(h.dtype)
            return out if residual is None else (out, h)
        if self.c_rows and x.dtype is w.dtype and x.is_contiguous() and not torch.is_grad_enabled():
            return kernels.cpu_fused_rms_norm(x, w, self.eps, residual)
        return kernels.rms_norm(x, w, self.eps, residual)

    def forward_f32(self, x: torch.Tensor, residual: torch.Tensor | None = None) -> torch.Tensor:
        """:meth:`forward`'s norm (of ``x + residual``, the sum in ``x``'s dtype as there) ``[T, D] -> [T, D]`` in
        float32, not rounded to the activations' dtype: the model's final norm, the LM head's input.

        Why: the head quantizes its input per 32 columns (the a8 GEMVs, as llama.cpp does its float32 norm's
        output) or multiplies it in float32; a bf16 rounding first moved codes at block boundaries for nothing.
        Float32 activations keep :meth:`forward` (already float32, its bits unchanged)."""
        if x.dtype == torch.float32:
            return self.forward(x) if residual is None else self.forward(x, residual)[0]
        h = (x if residual is None else x + residual).float()  # [T, D]
        n = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        w = self.weight.float()
        return n * (1.0 + w if self.offset else w)


class Attention(nn.Module):
    def __init__(self, a: TransformerArgs, index: int):
        super().__init__()
        self.index = index  # the layer's index in the KV pool
        self.n_heads, self.n_kv, self.head_dim = a.num_attention_heads, a.num_key_value_heads, a.head_dim
        nq, nkv = self.n_heads * self.head_dim, self.n_kv * self.head_dim
        # q|k|v rows in one GEMM: as the checkpoint stores them (Phi-3), else set by
        # DecoderModel.fuse_projections (which drops q/k/v_proj).
        self.qkv_proj: nn.Module | None = None
        if a.fused_qkv:
            self.qkv_proj = Linear(a.hidden_size, nq + 2 * nkv, bias=a.attention_bias)
            self.q_proj = self.k_proj = self.v_proj = None
        else:
            self.q_proj = Linear(a.hidden_size, nq, bias=a.attention_bias)
            self.k_proj = Linear(a.hidden_size, nkv, bias=a.attention_bias)
            self.v_proj = Linear(a.hidden_size, nkv, bias=a.attention_bias)
        self.o_proj = Linear(nq, a.hidden_size, bias=a.o_proj_bias)
        self.q_norm = RMSNorm(self.head_dim, a.rms_norm_eps, a.norm_offset) if a.qk_norm else None
        self.k_norm = RMSNorm(self.head_dim, a.rms_norm_eps, a.norm_offset) if a.qk_norm else None
        self.scale = (a.query_pre_attn_scalar or self.head_dim) ** -0.5
        self.window = a.sliding_window if a.sliding(index) else None  # attention's sliding window (None: all keys)
        self.softcap = a.attn_logit_softcapping  # logits cap * tanh(logits / cap) (Gemma 2)
        # [Hq] attention sinks (gpt-oss): one more logit per head in the softmax's denominator (HF: self_attn.sinks)
        self.sinks = nn.Parameter(torch.empty(self.n_heads)) if a.attention_sinks else None
        self.rotary_dim = a.rotary_dim  # each head's first dims that RoPE rotates (the rest pass through)
        self.rope_table, self.rope_tables = a.layer_rope(index), len(a.rope_tables)  # which stacked table, of how many

    def project(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """q ``[T, Hq, D]``, k and v ``[T, Hk, D]`` (views into one fused output when fused), q/k normed."""
        T = x.shape[0]
        if self.qkv_proj is not None:
            out = self.qkv_proj(x)  # [T, (Hq + 2 Hk) D]
            nq, nk = self.n_heads * self.head_dim, self.n_kv * self.head_dim
            q = out[:, :nq].view(T, self.n_heads, self.head_dim)
            k = out[:, nq : nq + nk].view(T, self.n_kv, self.head_dim)
            v = out[:, nq + nk :].view(T, self.n_kv, self.head_dim)
        else:
            q = self.q_proj(x).view(T, self.n_heads, self.head_dim)  # [T, Hq, D]
            k = self.k_proj(x).view(T, self.n_kv, self.head_dim)  # [T, Hk, D]
            v = self.v_proj(x).view(T, self.n_kv, self.head_dim)  # [T, Hk, D]
        if self.q_norm is not None:
            q, k = self.q_norm(q.contiguous()), self.k_norm(k.contiguous())
        return q, k, v

    def rope_positions(self, positions: torch.Tensor, rope_cache: torch.Tensor) -> torch.Tensor:
        """``[T]`` rows of ``rope_cache`` this layer rotates ``positions`` with: the position itself, plus one
        table's length for a layer of the second table (Gemma 3's local layers; see :func:`rope_cache`)."""
        if not self.rope_table:
            return positions
        return positions + self.rope_table * (rope_cache.shape[0] // self.rope_tables)

    def rope_store(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, positions: torch.Tensor,
                   rope_cache: torch.Tensor, attn: AttentionBackend, meta: AttentionMetadata) -> torch.Tensor:
        """RoPE on q ``[T, Hq, D]`` and k ``[T, Hk, D]`` with this layer's table; k, v into the pool -> roped q.

        Partial rotary (``rotary_dim < head_dim``, Phi-4-mini): each head's first ``rotary_dim`` dims
        rotate (the table is that wide) and the rest pass through, as in transformers'
        ``apply_rotary_pos_emb``; the roped halves are joined back and stored with the backend's ``store``.
        """
        positions = self.rope_positions(positions, rope_cache)
        r = self.rotary_dim
        if r == self.head_dim:
            return attn.rope_store(self.index, q, k, v, positions, rope_cache, meta)
        qr, kr = kernels.rope(q[..., :r], k[..., :r], positions, rope_cache)  # [T, H, r] each
        q, k = torch.cat([qr, q[..., r:]], dim=-1), torch.cat([kr, k[..., r:]], dim=-1)
        attn.store(self.index, k, v, meta)
        return q

    def attend(self, q: torch.Tensor, attn: AttentionBackend, meta: AttentionMetadata) -> torch.Tensor:
        """Roped q ``[T, Hq, D]`` over the pool with this layer's scale, window, soft-cap and sinks
        -> ``[T, Hq * D]``."""
        o = attn.attend(self.index, q, meta, self.scale, self.window, self.softcap, self.sinks)  # [T, Hq, D]
        return o.reshape(q.shape[0], -1)

    def forward(self, x, positions, rope_cache, attn: AttentionBackend, meta: AttentionMetadata):
        """``x [T, hidden]`` -> ``[T, hidden]``; K/V of the new tokens go into ``attn``'s pool."""
        q, k, v = self.project(x)
        q = self.rope_store(q, k, v, positions, rope_cache, attn, meta)  # k, v into the pool
        o = self.attend(q, attn, meta)  # [T, Hq * D]
        # Decode: the module's forward without nn.Module dispatch (calibration hooks see prompts only).
        return self.o_proj.forward(o) if meta.is_decode else self.o_proj(o)


def gelu_tanh(x: torch.Tensor) -> torch.Tensor:
    """transformers' ``gelu_pytorch_tanh`` (GELUTanh): torch's gelu with the tanh approximation."""
    return F.gelu(x, approximate="tanh")


# The MLP gate activations (HF ACT2FN names): SwiGLU's silu, GeGLU's tanh-approximated gelu (Gemma).
GATE_ACTIVATIONS = {"silu": F.silu, "swish": F.silu, "gelu_pytorch_tanh": gelu_tanh}


def clamped_swiglu(gate: torch.Tensor, up: torch.Tensor, alpha: float, limit: float) -> torch.Tensor:
    """gpt-oss's expert activation (transformers' ``GptOssExperts._apply_gate``): ``[T, I], [T, I] -> [T, I]``.

    The gate is clamped above at ``limit`` and up to ``[-limit, limit]``; then ``(up + 1) * gate *
    sigmoid(alpha * gate)``: a SwiGLU with a sharper sigmoid and a residual-like ``+ 1`` on up."""
    gate = gate.clamp(max=limit)
    up = up.clamp(min=-limit, max=limit)
    return (up + 1) * (gate * torch.sigmoid(gate * alpha))


class MLP(nn.Module):
    def __init__(self, a: TransformerArgs, intermediate: int | None = None):
        """``intermediate``: the width of gate/up (default ``a.intermediate_size``; an MoE expert's is
        ``moe_intermediate_size``, a shared expert's its own)."""
        super().__init__()
        inter = intermediate or a.intermediate_size
        # gate|up rows in one GEMM: as the checkpoint stores them (Phi-3), else set by
        # DecoderModel.fuse_projections (which drops gate/up_proj).
        self.gate_up_proj: nn.Module | None = None
        bias = a.mlp_bias
        if a.fused_gate_up:
            self.gate_up_proj = Linear(a.hidden_size, 2 * inter, bias=bias)
            self.gate_proj = self.up_proj = None
        else:
            self.gate_proj = Linear(a.hidden_size, inter, bias=bias)
            self.up_proj = Linear(a.hidden_size, inter, bias=bias)
        self.down_proj = Linear(inter, a.hidden_size, bias=bias)
        # SwiGLU (the C row kernels' silu * mul; not gpt-oss's clamped one)
        self.silu = a.hidden_act in ("silu", "swish") and a.swiglu_limit is None
        self.act_fn = GATE_ACTIVATIONS[a.hidden_act]
        self.swiglu = (a.swiglu_alpha, a.swiglu_limit) if a.swiglu_limit is not None else None  # gpt-oss
        # SwiGLU or gpt-oss's clamped SwiGLU by the C row code (kernels.cpu_fused_silu_mul,
        # kernels.cpu_fused_clamped_swiglu), decided once by the engine's decode plan
        self.c_glu = False

    def act(self, x: torch.Tensor) -> torch.Tensor:  # [T, hidden] -> [T, I]
        """``silu(gate(x)) * up(x)`` (GeGLU: ``gelu_tanh(gate(x)) * up(x)``), the input of ``down_proj``.

        With ``c_glu`` (planned once for CPU bfloat16 and float32): the C row code (``kernels.cpu_fused_silu_mul``,
        gpt-oss's ``kernels.cpu_fused_clamped_swiglu``) that the fused decode layers and the grouped expert kernel
        run too, so each gives the same bits.
        """
        if self.gate_up_proj is None:
            g, u = self.gate_proj(x), self.up_proj(x)
        else:
            gu = self.gate_up_proj(x)  # [T, 2 I]
            inter = gu.shape[-1] // 2
            g, u = gu[..., :inter], gu[..., inter:]
        if self.c_glu and g.dim() == 2 and not g.requires_grad:  # (a graph to record: torch's ops)
            if self.swiglu is not None:
                return kernels.cpu_fused_clamped_swiglu(g, u, *self.swiglu)
            return kernels.cpu_fused_silu_mul(g, u)
        return self.glu(g, u)

    def glu(self, g: torch.Tensor, u: torch.Tensor) -> torch.Tensor:  # [T, I], [T, I] -> [T, I]
        """``act(g) * u``, or gpt-oss's :func:`clamped_swiglu`, in torch ops."""
        if self.swiglu is not None:
            return clamped_swiglu(g, u, *self.swiglu)
        # contiguous: silu's vectorized and scalar loops round differently, so the gate
        # must sit in memory as the unfused GEMM's output does (the same bits either way).
        return self.act_fn(g.contiguous()) * u

    def forward(self, x, decode: bool = False):
        """``decode``: a pure-decode step (the projections' forward without ``nn.Module`` dispatch;
        calibration hooks see prompt steps only)."""
        if not decode:
            return self.down_proj(self.act(x))
        return self.down_proj.forward(self.act(x))


class DecoderLayer(nn.Module):
    def __init__(self, a: TransformerArgs, index: int = 0):
        super().__init__()
        self.self_attn = Attention(a, index)
        # A sparse layer's MLP is an MoE block over MLP experts (built here: moe.py does not import this module).
        self.mlp: MLP | MoE = MoE(a, lambda n: MLP(a, n)) if a.sparse(index) else MLP(a)
        eps, off = a.rms_norm_eps, a.norm_offset
        self.input_layernorm = RMSNorm(a.hidden_size, eps, off)
        # Llama: the norm before the MLP. Gemma 2/3 (sandwich_norms): the norm of attention's output, and
        # pre_feedforward_layernorm is the one before the MLP, post_feedforward_layernorm that of its output.
        self.post_attention_layernorm = RMSNorm(a.hidden_size, eps, off)
        self.pre_feedforward_layernorm = RMSNorm(a.hidden_size, eps, off) if a.sandwich_norms else None
        self.post_feedforward_layernorm = RMSNorm(a.hidden_size, eps, off) if a.sandwich_norms else None
        self.decode: LayerPlan | None = None  # its fused decode kernels, set once by decode_plan.build_decode_plan

    def forward(self, h, residual, positions, rope_cache, attn: AttentionBackend, meta: AttentionMetadata,
                experts: ExpertSource | None = None):
        """``(h, residual) -> (mlp output, residual)``; the layer's hidden state is ``residual + mlp output``.

        ``h``: the previous layer's MLP output, added to ``residual`` inside this layer's
        input RMSNorm (one fused op instead of an add and a norm: the same sum in the
        model dtype, then the same norm); for layer 0, the embeddings with ``residual``
        None. Norms and attention are called by ``forward``, not ``__call__`` (no
        module dispatch per op at decode); linear layers keep ``__call__`` (calibration
        hooks them). ``experts``: a sparse layer's experts kept elsewhere (``llmsys.offload.experts``; the
        offload runtime's ``run_layer`` hands it in), passed to the MoE block.
        """
        lp = self.decode
        if (lp is not None and (experts is None or lp.moe) and h.shape[0] <= lp.max_rows and h.dtype is lp.dtype
                and not torch.is_grad_enabled()):  # (the C kernels record no autograd)
            return self._forward_fused(lp.fused, h, residual, positions, rope_cache, attn, meta, experts)
        if residual is None:
            x, residual = self.input_layernorm.forward(h), h
        else:
            x, residual = self.input_layernorm.forward(h, residual)
        a = self.self_attn.forward(x, positions, rope_cache, attn, meta)
        if self.pre_feedforward_layernorm is not None:  # Gemma: attention's and the MLP's outputs normed too
            a = self.post_attention_layernorm.forward(a)
            x, residual = self.pre_feedforward_layernorm.forward(a, residual)  # residual <- residual + a
            m = self._mlp(x, meta.is_decode, experts)
            return self.post_feedforward_layernorm.forward(m), residual
        x, residual = self.post_attention_layernorm.forward(a, residual)  # residual <- residual + a
        return self._mlp(x, meta.is_decode, experts), residual

    def _mlp(self, x: torch.Tensor, decode: bool, experts: ExpertSource | None) -> torch.Tensor:
        if experts is None:
            return self.mlp.forward(x, decode)
        return self.mlp.forward(x, decode, experts)  # an MoE block (only sparse layers get a source)

    def _forward_fused(self, fused: kernels.DecodeLayer, h, residual, positions, rope_cache,
                       attn: AttentionBackend, meta: AttentionMetadata, experts: ExpertSource | None = None):
        """:meth:`forward` in two C calls around attention (``kernels.layer_attn_in``: input norm and q|k|v;
        ``kernels.layer_mlp``: o_proj, post-attention norm, gate|up, silu * mul, down).

        Why: at decode the GEMVs of a small model's layer are tens of microseconds each, and the
        Python and module dispatch around each op cost about as much. The same bits as the op-by-op
        forward (the same C row kernels and GEMVs; tests/test_fused_layer.py), so streamed and
        resident layers, and any batch size, agree.
        """
        at = self.self_attn
        # check=False: the decoder's own contiguous bf16 [T, D] activations (forward checked the dtype;
        # the embeddings and the kernels' outputs are contiguous)
        qkv, residual = kernels.layer_attn_in(fused, h, residual, check=False)  # [T, (Hq + 2 Hk) D]
        if at.q_norm is None and at.rotary_dim == at.head_dim:
            # RoPE, the K/V store and attention: one backend call (one C call on the CPU pool)
            o = attn.rope_attend(at.index, qkv, at.n_heads, at.n_kv, at.rope_positions(positions, rope_cache),
                                 rope_cache, meta, at.scale, at.window, at.softcap, at.sinks)
        else:  # per-head q/k norms between the projection and RoPE (Qwen3), or partial rotary (Phi-4-mini)
            T, hq, hk, d = h.shape[0], at.n_heads, at.n_kv, at.head_dim
            q, k = qkv[:, : hq * d].view(T, hq, d), qkv[:, hq * d : (hq + hk) * d].view(T, hk, d)
            v = qkv[:, (hq + hk) * d :].view(T, hk, d)
            if at.q_norm is not None:
                q, k = at.q_norm(q.contiguous()), at.k_norm(k.contiguous())
            o = at.attend(at.rope_store(q, k, v, positions, rope_cache, attn, meta), attn, meta)  # [T, Hq * D]
        if self.decode.moe:  # o_proj and the norm in C, then the block's routed experts in one C call
            x, residual = kernels.layer_post_attn(fused, o.contiguous(), residual, check=False)
            return self._mlp(x, True, experts), residual
        return kernels.layer_mlp(fused, o.contiguous(), residual, check=False)


class DecoderModel(nn.Module):
    """Embeddings -> N decoder layers -> final norm -> LM head.

    Parameter names follow Hugging Face (``model.layers.0.self_attn.q_proj``
    ...) so checkpoints load by name with no renaming table.
    """

    def __init__(self, args: TransformerArgs, embed_file: tuple[Any, torch.dtype] | None = None):
        super().__init__()
        self.args = args
        self.model = nn.Module()
        self.model.embed_tokens = nn.Embedding(args.vocab_size, args.hidden_size)
        self.model.layers = nn.ModuleList(DecoderLayer(args, i) for i in range(args.num_hidden_layers))
        self.model.norm = RMSNorm(args.hidden_size, args.rms_norm_eps, args.norm_offset)
        self.lm_head = Linear(args.hidden_size, args.vocab_size, bias=False)
        # On the meta device (the loader's skeleton) the table is a placeholder the
        # loader rebuilds; computing it there imports torch's symbolic-shape stack
        # (sympy, ~150 MiB RSS), a third of a 512 MiB memory cap (llmsys.offload).
        on_meta = torch.empty(0).is_meta
        rows = len(args.rope_tables) * args.max_position_embeddings
        cache = torch.empty(rows, args.rotary_dim) if on_meta else rope_cache(args)
        self.register_buffer("rope_cache", cache, persistent=False)
        # From the loader, for a tied model whose checkpoint stores the embedding table
        # plainly: (source with .path .offset .nbytes, stored dtype). prepack_linears then
        # serves embedding rows from the file so the tied head can be packed.
        self.embed_file = embed_file
        self.embed_file_bytes = 0  # bytes of the embedding table served from the file (memory_report: "disk")
        # The decode kernels, decided once by the engine's runner (decode_plan.build_decode_plan); None: op by op.
        self.decode_plan: DecodePlan | None = None

    def tie_weights(self) -> None:
        if self.args.tie_word_embeddings:
            emb = self.model.embed_tokens
            if hasattr(emb, "as_linear"):  # quantized table (llmsys.quant.embedding): share it as the head
                self.lm_head = emb.as_linear()
            else:
                self.lm_head.weight = emb.weight
                self.lm_head.packed_when_resident = False

    def forward(
        self,
        input_ids: torch.Tensor,  # [T]
        positions: torch.Tensor,  # [T]
        attn: AttentionBackend,  # the engine's attention backend (owns the KV pool)
        meta: AttentionMetadata,  # built by attn.metadata for this step
        layers: LayerRunner | None = None,  # the offload runtime when some layer streams; None: all resident
    ) -> torch.Tensor:  # [T, hidden] float32
        """The decoder's one forward: prefill, decode and mixed steps, resident or streamed layers; returns the
        final norm's float32 output (:meth:`RMSNorm.forward_f32`), the LM head's input (:meth:`compute_logits`).

        The slots and gather layout are in ``meta``. The residual add after each MLP is
        fused into the next RMSNorm (:meth:`DecoderLayer.forward`).
        """
        rope = self.rope_cache
        positions = self.rope_positions(positions, meta)
        attn = attn.for_step(meta)  # e.g. the scoring decorator steps aside when no sequence scores
        h, res = self.embed(input_ids), None
        dp = self.decode_plan
        if (dp is not None and dp.stack is not None and layers is None and attn is dp.backend
                and meta.plan is not None and meta.plan.one_call and h.shape[0] <= dp.max_rows and h.dtype is dp.dtype
                and not torch.is_grad_enabled()):
            # every layer's fused decode calls in one C call (the same bits as the loop)
            plan = meta.plan
            h, res = kernels.decode_stack(dp.stack, h, positions, rope, meta.slot_mapping, plan.gather_slots,
                                          plan.lens)
        else:
            for i, layer in enumerate(self.model.layers):
                if layers is None:
                    h, res = layer.forward(h, res, positions, rope, attn, meta)
                else:
                    h, res = layers.run_layer(i, layer, h, res, positions, rope, attn, meta)
        return self.model.norm.forward_f32(h, res)  # [T, hidden] float32

    def ensure_rope_positions(self, n_positions: int) -> None:
        """Grow ``rope_cache`` so each of its tables covers ``n_positions`` (a context or a KV policy's
        budget past the trained one: RoPE is defined for any position)."""
        held = self.rope_cache.shape[0] // len(self.args.rope_tables)
        if held < n_positions:
            self.rope_cache = rope_cache(self.args, self.rope_cache.device, n_positions)

    @property
    def kv_policy_blocker(self) -> str | None:
        """Why KV policies other than ``full`` cannot run this model, or None.

        Evicting policies move kept keys to new cache indices and re-rotate them with one whole-head
        table (``offload.eviction.compact``); Quest's page selection and the scoring policies' rows
        know no window, soft-capping or attention sink. Partial rotary, per-layer or per-length tables,
        sliding windows, soft-capped logits and sinks (Phi-3, Gemma 2/3, gpt-oss) need each of those
        taught first."""
        a = self.args
        context = getattr(a, "max_context", a.max_position_embeddings)  # Mistral stops at its window
        what = [name for name, has in (
            ("partial rotary", a.rotary_dim != a.head_dim),
            ("two RoPE tables", len(a.rope_tables) > 1),
            ("sliding-window layers", a.sliding_window is not None and a.sliding_window < context),
            ("soft-capped attention", a.attn_logit_softcapping is not None),
            ("attention sinks", a.attention_sinks),
        ) if has]
        return ", ".join(what) if what else None

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:  # [T] -> [T, hidden]
        """The embedding rows, times ``sqrt(hidden_size)`` rounded to their dtype for Gemma (as transformers
        scales them: by a tensor of the weights' dtype)."""
        h = self.model.embed_tokens(input_ids)
        if self.args.embed_scale:
            h = h * torch.tensor(self.args.hidden_size**0.5, dtype=h.dtype)
        return h

    def rope_positions(self, positions: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        """``[T]`` RoPE table rows of the step's tokens: their positions, but in LongRoPE's long table for a
        sequence longer than the original context (its whole prompt for a prompt chunk: ``meta.seq_lens``).

        Why per sequence and step: transformers picks the long factors when a forward's longest position
        passes ``original_max_position_embeddings``, for every token of that forward, and keeps the keys
        it cached before; a sequence's step (its whole prompt, however it is chunked) is that forward.
        The short table is rows ``0..P-1``, the long ``P..2P-1`` (:func:`rope_cache`)."""
        a = self.args
        if not a.longrope:
            return positions
        orig = a.rope_scaling["original_max_position_embeddings"]
        long = [n > orig for n in (meta.seq_lens or meta.context_lens)]
        if not any(long):
            return positions
        qs = meta.query_start
        shift = torch.tensor([self.rope_cache.shape[0] // 2 * f for f in long])
        counts = torch.tensor([qs[b + 1] - qs[b] for b in range(len(long))])
        return positions + shift.repeat_interleave(counts).to(positions.device)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:  # [N, hidden] -> [N, V] float32
        """The LM head's float32 logits (its ``logits``: every head the engine builds, quantized, plain, tied or
        streamed, writes its float32 sums, never bf16-rounded ones); Gemma 2's soft-capped in float32,
        ``cap * tanh(logits / cap)``. A head without ``logits`` (refinement's float32 training swaps) runs its forward."""
        head = self.lm_head
        logits = head.logits(hidden) if hasattr(head, "logits") else head(hidden).float()
        cap = self.args.final_logit_softcapping
        if cap is not None:
            logits = torch.tanh(logits / cap) * cap
        return logits

    def never_pack(self) -> None:
        """Mark every ``Linear`` (and streamed head) as never packed (an engine whose weights are read or rewritten)."""
        for mod in self.modules():
            if hasattr(mod, "packed_when_resident"):
                mod.packed_when_resident = False

    def prepack_linears(self) -> int:
        """Replace resident CPU ``Linear`` weights by oneDNN's prepacked copies; returns how many.

        Why: a prepacked weight streams faster through the GEMV that dominates decode
        (``kernels.cpu_linear``; docs/benchmarks.md), with bit-identical results. Each weight
        is replaced, not copied, so memory does not grow. A head tied to the embedding is packed
        too when the loader recorded where the checkpoint keeps the table (see
        :meth:`_embed_from_file`); else it stays plain, as the embedding's row lookup needs the
        plain layout and a second copy would cost memory. Only for inference engines: code that
        reads or writes ``.weight`` afterwards (quantization, calibration) must not call this.
        """
        self._embed_from_file()
        self.fuse_projections()
        self.share_scratch()
        n = 0
        for name, mod in self.named_modules():
            if type(mod) is not Linear or not mod.packed_when_resident or mod.weight.device.type != "cpu":
                continue
            packed = kernels.prepack(mod.weight)
            if packed is not None:
                mod.weight = nn.Parameter(packed, requires_grad=False)
                n += 1
        return n

    def fuse_projections(self) -> int:
        """Concatenate each layer's q/k/v and gate/up weights into one GEMM each; returns how many.

        Why: at decode a layer's GEMVs were 7 calls paying oneDNN's fixed per-call cost on small
        matrices, which stream far below memory speed; fused, a decode step is faster
        (docs/benchmarks.md). Exact: each output of the fused GEMM equals the separate GEMM's bit for
        bit (oneDNN and MKL reduce every output over K the same way whatever N is;
        tests/test_fused_decode.py), so resident fused layers and streamed unfused ones agree. The
        separate modules are dropped (set to None), so memory does not grow. Only for resident CPU
        ``Linear`` weights that would be prepacked (inference engines, see :meth:`prepack_linears`).
        """
        n = 0
        for layer in self.model.layers:
            at = layer.self_attn
            if at.qkv_proj is None and at.q_proj is not None:
                fused = _fused_linear([at.q_proj, at.k_proj, at.v_proj])
                if fused is not None:
                    at.qkv_proj, at.q_proj, at.k_proj, at.v_proj = fused, None, None, None
                    n += 1
            # the layer's MLP, or an MoE block's experts and shared expert (each an MLP)
            for mlp in (m for m in layer.mlp.modules() if type(m) is MLP):
                if mlp.gate_up_proj is None and mlp.gate_proj is not None:
                    fused = _fused_linear([mlp.gate_proj, mlp.up_proj])
                    if fused is not None:
                        mlp.gate_up_proj, mlp.gate_proj, mlp.up_proj = fused, None, None
                        n += 1
        return n

    def share_scratch(self) -> None:
        """One dequantization buffer for every layer that takes one (CPU int4 prefill, see
        ``kernels.cpu_int4.Scratch``): no page faults per GEMM, memory of one chunk (<= 16 MiB)."""
        from llmsys.kernels import Int4Scratch as Scratch

        shared = Scratch()
        for mod in self.modules():
            if hasattr(mod, "scratch"):
                mod.scratch = shared

    def _embed_from_file(self) -> None:
        """Serve a tied embedding's rows from the checkpoint, so the head alone owns the matrix.

        Why: a packed head cannot answer row lookups, and a plain second copy would
        double the table's memory (~20% of SmolLM2-135M). A step reads only its tokens'
        rows (``os.preadv``; the page cache keeps hot rows), converted as the loader
        converts the whole table, so lookups give the same bits. Not done without a
        file (a model built in memory), on other devices, for a head that would not be
        packed, or when the embedding is not the plain table (quantized).
        """
        head = self.lm_head
        if type(head) is not Linear or head.weight is not getattr(self.model.embed_tokens, "weight", None):
            return
        emb = self.file_embedding()
        if emb is None or not kernels.packable(head.weight):
            return
        self.model.embed_tokens = emb
        self.embed_file_bytes = emb.src.nbytes
        head.packed_when_resident = True

    def file_embedding(self) -> nn.Module | None:
        """A module that looks embedding rows up in the checkpoint file (``embed_file``), or None.

        Its lookups equal indexing the loaded table bit for bit (tests/test_loader.py).
        """
        emb = self.model.embed_tokens
        if self.embed_file is None or type(emb) is not nn.Embedding:
            return None
        from llmsys.offload.runtime import DiskEmbedding

        src, stored = self.embed_file
        w = emb.weight
        return DiskEmbedding(src, w.shape[0], w.shape[1], w.dtype, w.device, stored=stored, drop_cache=False)


def _fused_linear(mods: list[nn.Module]) -> nn.Module | None:
    """One layer whose rows are the given layers' rows in order, or None when they do not fuse.

    Quantized layers fuse through their format's ``cat_rows`` (llmsys.quant).
    They fuse when all are plain resident CPU ``Linear`` layers meant to be packed, each
    fusable (``cpu_linear.fusable``: each, streamed alone, takes the same GEMM), with one dtype and
    input size, all with or all without bias.
    """
    if any(t.is_meta for m in mods for t in (*m.parameters(), *m.buffers())):
        return None  # not resident (an expert on disk, a streamed layer): bound to unfused tensors per use
    kind = type(mods[0])
    if kind is not Linear and all(type(m) is kind for m in mods) and hasattr(kind, "cat_rows"):
        return kind.cat_rows(mods)  # a quantized format fuses its own way, or not at all
    if any(type(m) is not Linear or not m.packed_when_resident for m in mods):
        return None
    ws = [m.weight for m in mods]
    w0 = ws[0]
    if any(w.device.type != "cpu" or w.is_mkldnn or w.dtype != w0.dtype or w.shape[1] != w0.shape[1] for w in ws):
        return None
    biased = [m.bias is not None for m in mods]
    if any(b != biased[0] for b in biased):
        return None
    if not all(kernels.fusable(w) for w in ws):  # a small part alone would take another GEMM
        return None
    weight = torch.cat([w.detach() for w in ws])  # [sum N, K]
    lin = Linear(weight.shape[1], weight.shape[0], bias=biased[0], device="meta")
    lin.weight = nn.Parameter(weight, requires_grad=False)
    if biased[0]:
        lin.bias = nn.Parameter(torch.cat([m.bias.detach() for m in mods]), requires_grad=False)
    return lin
