"""The decoder shared by the Llama-family architectures.

Llama, Mistral, Qwen2 and Qwen3 differ only in a few switches (q/k/v bias,
per-head q/k RMSNorm, explicit head_dim, RoPE scaling, tied embeddings), so
one decoder implements them and each family module only maps its Hugging Face
config onto :class:`TransformerArgs`. Tokens of a batch are packed into one
``[T, ...]`` tensor; attention gets the per-sequence layout from
:class:`~llmsys.engine.attention.AttentionMetadata`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from llmsys.engine.attention import AttentionMetadata, paged_attention
from llmsys.engine.kv_cache import KVCache


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
    qk_norm: bool = False  # RMSNorm per head on q and k (Qwen3)
    bos_token_id: int | None = None
    eos_token_id: list[int] = field(default_factory=list)

    @classmethod
    def _common(cls, cfg: dict[str, Any], **overrides: Any) -> dict[str, Any]:
        heads = cfg["num_attention_heads"]
        eos = cfg.get("eos_token_id")
        # transformers >= 5 writes `rope_parameters` (theta inside); older
        # configs write `rope_theta` + `rope_scaling`. Accept both.
        rope = dict(cfg.get("rope_parameters") or {})
        theta = rope.pop("rope_theta", None) or cfg.get("rope_theta", 10000.0)
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
        )
        kw.update(overrides)
        return kw


def rope_inv_freq(args: TransformerArgs) -> torch.Tensor:
    """Inverse frequencies ``[head_dim/2]`` incl. Llama 3 / linear scaling."""
    d = args.head_dim
    inv = 1.0 / (args.rope_theta ** (torch.arange(0, d, 2, dtype=torch.int64).float() / d))
    sc = args.rope_scaling or {}
    kind = sc.get("rope_type", sc.get("type", "default"))
    if kind == "linear":
        inv = inv / sc["factor"]
    elif kind == "llama3":
        factor = sc["factor"]
        lo, hi = sc.get("low_freq_factor", 1.0), sc.get("high_freq_factor", 4.0)
        old_ctx = sc["original_max_position_embeddings"]
        lo_wl, hi_wl = old_ctx / lo, old_ctx / hi
        wavelen = 2 * math.pi / inv
        scaled = torch.where(wavelen > lo_wl, inv / factor, inv)
        smooth = (old_ctx / wavelen - lo) / (hi - lo)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        medium = ~(wavelen < hi_wl) & ~(wavelen > lo_wl)
        inv = torch.where(medium, smoothed, scaled)
    elif kind not in ("default", None):
        from llmsys.engine.errors import UnsupportedModelError

        raise UnsupportedModelError(f"rope_scaling type {kind!r} is not supported; supported: default, linear, llama3")
    return inv


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Same op order as HF LlamaRMSNorm: normalize in float32, cast, scale.
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * xf.to(x.dtype)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate-half RoPE. x: [T, H, D]; cos/sin: [T, 1, D]."""
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half], x[..., half:]
    rot = torch.cat((-x2, x1), dim=-1)
    return x * cos + rot * sin


class Attention(nn.Module):
    def __init__(self, a: TransformerArgs):
        super().__init__()
        self.n_heads, self.n_kv, self.head_dim = a.num_attention_heads, a.num_key_value_heads, a.head_dim
        self.q_proj = nn.Linear(a.hidden_size, self.n_heads * self.head_dim, bias=a.attention_bias)
        self.k_proj = nn.Linear(a.hidden_size, self.n_kv * self.head_dim, bias=a.attention_bias)
        self.v_proj = nn.Linear(a.hidden_size, self.n_kv * self.head_dim, bias=a.attention_bias)
        self.o_proj = nn.Linear(self.n_heads * self.head_dim, a.hidden_size, bias=False)
        self.q_norm = RMSNorm(self.head_dim, a.rms_norm_eps) if a.qk_norm else None
        self.k_norm = RMSNorm(self.head_dim, a.rms_norm_eps) if a.qk_norm else None
        self.scale = self.head_dim**-0.5

    def forward(self, x, cos, sin, k_cache, v_cache, meta: AttentionMetadata):
        T = x.shape[0]
        q = self.q_proj(x).view(T, self.n_heads, self.head_dim)  # [T, Hq, D]
        k = self.k_proj(x).view(T, self.n_kv, self.head_dim)  # [T, Hk, D]
        v = self.v_proj(x).view(T, self.n_kv, self.head_dim)  # [T, Hk, D]
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        k_cache.index_copy_(0, meta.slot_mapping, k.to(k_cache.dtype))
        v_cache.index_copy_(0, meta.slot_mapping, v.to(v_cache.dtype))
        o = paged_attention(q, k_cache, v_cache, meta, self.scale)  # [T, Hq, D]
        return self.o_proj(o.reshape(T, self.n_heads * self.head_dim))


class MLP(nn.Module):
    def __init__(self, a: TransformerArgs):
        super().__init__()
        self.gate_proj = nn.Linear(a.hidden_size, a.intermediate_size, bias=False)
        self.up_proj = nn.Linear(a.hidden_size, a.intermediate_size, bias=False)
        self.down_proj = nn.Linear(a.intermediate_size, a.hidden_size, bias=False)

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DecoderLayer(nn.Module):
    def __init__(self, a: TransformerArgs):
        super().__init__()
        self.self_attn = Attention(a)
        self.mlp = MLP(a)
        self.input_layernorm = RMSNorm(a.hidden_size, a.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(a.hidden_size, a.rms_norm_eps)

    def forward(self, h, cos, sin, k_cache, v_cache, meta):
        h = h + self.self_attn(self.input_layernorm(h), cos, sin, k_cache, v_cache, meta)
        return h + self.mlp(self.post_attention_layernorm(h))


class DecoderModel(nn.Module):
    """Embeddings -> N decoder layers -> final norm -> LM head.

    Parameter names follow Hugging Face (``model.layers.0.self_attn.q_proj``
    ...) so checkpoints load by name with no renaming table.
    """

    def __init__(self, args: TransformerArgs):
        super().__init__()
        self.args = args
        self.model = nn.Module()
        self.model.embed_tokens = nn.Embedding(args.vocab_size, args.hidden_size)
        self.model.layers = nn.ModuleList(DecoderLayer(args) for _ in range(args.num_hidden_layers))
        self.model.norm = RMSNorm(args.hidden_size, args.rms_norm_eps)
        self.lm_head = nn.Linear(args.hidden_size, args.vocab_size, bias=False)
        self.register_buffer("inv_freq", rope_inv_freq(args), persistent=False)

    def tie_weights(self) -> None:
        if self.args.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    def rope(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        freqs = positions.float().unsqueeze(1) * self.inv_freq.unsqueeze(0)  # [T, D/2]
        emb = torch.cat((freqs, freqs), dim=-1)  # [T, D]
        return emb.cos().to(dtype).unsqueeze(1), emb.sin().to(dtype).unsqueeze(1)  # [T, 1, D]

    def forward(
        self,
        input_ids: torch.Tensor,  # [T]
        positions: torch.Tensor,  # [T]
        kv: KVCache,
        meta: AttentionMetadata,
    ) -> torch.Tensor:  # [T, hidden]
        h = self.model.embed_tokens(input_ids)
        cos, sin = self.rope(positions, h.dtype)
        for i, layer in enumerate(self.model.layers):
            k_cache, v_cache = kv.layer(i)
            h = layer(h, cos, sin, k_cache, v_cache, meta)
        return self.model.norm(h)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:  # [N, hidden] -> [N, V]
        return self.lm_head(hidden)
