"""gpt-oss (``GptOssForCausalLM``: openai/gpt-oss-20b, gpt-oss-120b) on the shared decoder.

Attention: q/k/v/o biases, ``head_dim`` 64, attention sinks (``self_attn.sinks``: a learned logit per
query head in the softmax denominator), a 128-token sliding window on every other layer (``layer_types``),
YaRN RoPE. Every MLP is a mixture of experts: a biased router whose top ``num_experts_per_tok`` logits
are softmaxed (``moe.route``'s ``topk_first``), each expert a clamped SwiGLU with biases
(``base.clamped_swiglu``). Fused ``gate_up_proj`` ``[E, hidden, 2 I]`` (gate/up interleaved by column) and
``down_proj`` ``[E, I, hidden]``, bf16 or MXFP4, load as per-expert matrices (``engine/loader/experts.py``,
``quant/mxfp4.py``), so ``--quant`` applies to them. Missing config fields take ``GptOssConfig``'s defaults.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from llmsys.engine.models.base import DecoderModel, TransformerArgs

DEFAULT_THETA = 150000.0
# GptOssConfig's rope_parameters when a config names none (the released models' own).
DEFAULT_YARN = {"rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0, "truncate": False,
                "original_max_position_embeddings": 4096}


def gpt_oss_rope(cfg: dict[str, Any]) -> tuple[float, dict[str, Any]]:
    """``(theta, scaling)`` from ``rope_parameters`` (transformers >= 5) or ``rope_theta`` + ``rope_scaling``
    (the Hub's configs), with GptOssConfig's defaults; YaRN without ``original_max_position_embeddings``
    takes ``max_position_embeddings``, as transformers' ``standardize_rope_params`` sets it."""
    params = dict(cfg.get("rope_parameters") or {})
    theta = params.pop("rope_theta", None)
    theta = cfg.get("rope_theta", DEFAULT_THETA) if theta is None else theta
    scaling = dict(cfg.get("rope_scaling") or params or DEFAULT_YARN)
    if scaling.get("rope_type", scaling.get("type")) == "yarn":
        scaling.setdefault("original_max_position_embeddings", cfg.get("max_position_embeddings", 131072))
    return theta, scaling


@dataclass
class ModelArgs(TransformerArgs):
    @classmethod
    def from_hf_config(cls, cfg: dict[str, Any]) -> "ModelArgs":
        n = cfg["num_hidden_layers"]
        types = cfg.get("layer_types") or [
            "sliding_attention" if (i + 1) % 2 else "full_attention" for i in range(n)
        ]
        theta, scaling = gpt_oss_rope(cfg)
        bias = bool(cfg.get("attention_bias", True))
        return cls(**cls._common(
            cfg,
            head_dim=cfg.get("head_dim") or 64,
            rms_norm_eps=cfg.get("rms_norm_eps", 1e-5),
            rope_theta=theta,
            rope_scaling=scaling,
            max_position_embeddings=cfg.get("max_position_embeddings", 131072),
            sliding_window=cfg.get("sliding_window", 128),
            layer_types=tuple(types),
            attention_bias=bias,
            o_proj_bias=bias,
            attention_sinks=True,
            num_experts=cfg.get("num_local_experts") or cfg.get("num_experts") or 128,
            num_experts_per_tok=cfg.get("num_experts_per_tok") or cfg.get("experts_per_token") or 4,
            moe_intermediate_size=cfg["intermediate_size"],
            experts_layout="gpt_oss",
            router_bias=True,
            router_topk_first=True,
            mlp_bias=True,
            swiglu_limit=float(cfg.get("swiglu_limit", 7.0)),
            swiglu_alpha=float(cfg.get("swiglu_alpha", 1.702)),
        ))


class Model(DecoderModel):
    pass
