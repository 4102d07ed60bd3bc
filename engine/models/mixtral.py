"""Mixtral (8x7B, 8x22B): Mistral's attention with every layer's MLP a mixture of experts.

Each of ``num_local_experts`` experts is a SwiGLU MLP of ``intermediate_size`` (the checkpoint's
``block_sparse_moe.experts.{e}.w1/w3/w2`` are gate/up/down; the loader names them as the engine's
``mlp.experts.{e}.gate_proj/up_proj/down_proj``, ``engine/loader/experts.py``). Routing as transformers'
``MixtralTopKRouter``: softmax over all experts in float32, the top ``num_experts_per_tok`` renormalised
(the same as a softmax over the top-k logits), and the weights kept in float32, so each expert's output
is weighted and the top-k summed in float32 before the one rounding to the model dtype.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from llmsys.engine.models import mistral


@dataclass
class ModelArgs(mistral.ModelArgs):
    @classmethod
    def from_hf_config(cls, cfg: dict[str, Any]) -> "ModelArgs":
        return cls(**cls._common(
            cfg, sliding_window=cfg.get("sliding_window"),
            # transformers' MixtralConfig defaults; num_experts is its other name (attribute_map)
            num_experts=cfg.get("num_local_experts") or cfg.get("num_experts") or 8,
            num_experts_per_tok=cfg.get("num_experts_per_tok") or 2,
            moe_intermediate_size=cfg["intermediate_size"],
            norm_topk_prob=True, router_float_weights=True,
        ))


class Model(mistral.Model):
    pass
