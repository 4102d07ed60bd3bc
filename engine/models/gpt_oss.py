"""gpt-oss (``GptOssForCausalLM``: openai/gpt-oss-20b, gpt-oss-120b) on the shared decoder.

Attention: q/k/v/o biases, ``head_dim`` (64) apart from the hidden size, attention sinks (one learned
logit per query head in each softmax's denominator, ``self_attn.sinks``), every other layer a sliding
window (128; ``layer_types``, the even layers by default as transformers derives them), YaRN RoPE.
Every layer's MLP is a mixture of ``num_local_experts`` experts: the router is a linear layer with a
bias whose top ``num_experts_per_tok`` logits are softmaxed (``moe.route``'s ``topk_first``); each
expert is a clamped SwiGLU (``swiglu_limit``, ``swiglu_alpha``: ``base.clamped_swiglu``) with biases on
its three projections. Norms are Llama's (transformers keeps their weights in float32; the same in a
float32 engine).

Checkpoints store the experts fused, ``mlp.experts.gate_up_proj`` ``[E, hidden, 2 I]`` (``x @ W``, gate
and up interleaved column by column) and ``down_proj`` ``[E, I, hidden]``, in bf16, or as MXFP4 blocks and
scales (openai's release, ``quantization_config.quant_method`` ``mxfp4``). The loader reads them as the
engine's per-expert ``[I, hidden]`` / ``[hidden, I]`` matrices (``engine/loader/experts.py``; MXFP4
dequantized at load by ``quant/mxfp4.py``), so ``--quant`` then applies to experts as to any projection.
Defaults are transformers' ``GptOssConfig``'s, for a config that leaves a field out.
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
