"""Qwen2-MoE (Qwen1.5-MoE, Qwen2-57B-A14B): Qwen2's decoder (q/k/v bias) with mixture-of-experts MLPs.

Routing as transformers' ``Qwen2MoeTopKRouter`` (``engine/models/moe.py``: softmax, top-k, renormalised
only with ``norm_topk_prob``, weights rounded to the model dtype) plus a shared expert of
``shared_expert_intermediate_size`` every token runs, scaled by ``sigmoid(shared_expert_gate(x))``.
``mlp_only_layers`` / ``decoder_sparse_step`` choose the sparse layers (:func:`qwen_moe_kwargs`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from llmsys.engine.models.base import DecoderModel, TransformerArgs
from llmsys.kernels.common.errors import UnsupportedModelError


def qwen_moe_kwargs(cfg: dict[str, Any]) -> dict[str, Any]:
    """The MoE switches of a Qwen2/3-MoE config; layer ``i`` is sparse as transformers decides it:
    ``i not in mlp_only_layers and num_experts > 0 and (i + 1) % decoder_sparse_step == 0``."""
    # transformers 5 writes Qwen3-MoE's num_experts as num_local_experts (its attribute_map); the Hub's say num_experts
    if cfg.get("use_sliding_window"):
        raise UnsupportedModelError("config.json: use_sliding_window true is not supported for Qwen MoE models "
                                    "(the released ones attend fully); set it to false")
    n, experts = cfg["num_hidden_layers"], cfg.get("num_experts") or cfg.get("num_local_experts") or 0
    step, dense = cfg.get("decoder_sparse_step") or 1, set(cfg.get("mlp_only_layers") or ())
    return dict(
        num_experts=experts,
        num_experts_per_tok=cfg.get("num_experts_per_tok") or 0,
        moe_intermediate_size=cfg.get("moe_intermediate_size") or 0,
        norm_topk_prob=bool(cfg.get("norm_topk_prob", False)),
        sparse_layers=tuple(i for i in range(n) if i not in dense and experts > 0 and (i + 1) % step == 0),
    )


@dataclass
class ModelArgs(TransformerArgs):
    @classmethod
    def from_hf_config(cls, cfg: dict[str, Any]) -> "ModelArgs":
        return cls(**cls._common(
            cfg, attention_bias=bool(cfg.get("qkv_bias", True)), **qwen_moe_kwargs(cfg),
            shared_expert_intermediate_size=cfg.get("shared_expert_intermediate_size") or 0,
        ))


class Model(DecoderModel):
    pass
