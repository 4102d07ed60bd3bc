"""Qwen3-MoE (Qwen3-30B-A3B, 235B-A22B): Qwen3's attention (per-head q/k RMSNorm, explicit ``head_dim``)
with mixture-of-experts MLPs and no shared expert.

Routing as transformers' ``Qwen3MoeTopKRouter`` (``engine/models/moe.py``): softmax over the experts in
float32, top ``num_experts_per_tok``, renormalised when ``norm_topk_prob`` (true in the released models),
weights rounded to the model dtype. ``mlp_only_layers`` / ``decoder_sparse_step`` choose the sparse
layers as for Qwen2-MoE (:func:`~llmsys.engine.models.qwen2_moe.qwen_moe_kwargs`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from llmsys.engine.models.base import DecoderModel, TransformerArgs
from llmsys.engine.models.qwen2_moe import qwen_moe_kwargs


@dataclass
class ModelArgs(TransformerArgs):
    @classmethod
    def from_hf_config(cls, cfg: dict[str, Any]) -> "ModelArgs":
        return cls(**cls._common(cfg, qk_norm=True, attention_bias=bool(cfg.get("attention_bias", False)),
                                 **qwen_moe_kwargs(cfg)))


class Model(DecoderModel):
    pass
