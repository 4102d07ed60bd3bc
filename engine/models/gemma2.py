"""Gemma 2 (``Gemma2ForCausalLM``): the shared decoder with Gemma's switches.

RMSNorm weights scale by ``1 + w`` in float32 (``norm_offset``), around attention and around the
MLP both (``sandwich_norms``); embeddings times ``sqrt(hidden_size)``; a GeGLU MLP
(``gelu_pytorch_tanh``); attention scaled by ``query_pre_attn_scalar ** -0.5``; attention and final
logits soft-capped, ``cap * tanh(x / cap)``; every other layer (``layer_types``: the even ones by
default) attends through a ``sliding_window``. Defaults are transformers' ``Gemma2Config``'s, for a
config that leaves a field out.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from llmsys.engine.models.base import DecoderModel, TransformerArgs
from llmsys.kernels.common.errors import UnsupportedModelError


def gemma_kwargs(cfg: dict[str, Any], pattern: int) -> dict[str, Any]:
    """The switches Gemma 2 and 3 share, from an HF config (``pattern``: every ``pattern``-th layer is a
    global one when the config lists no ``layer_types``, as transformers derives them)."""
    if cfg.get("attention_bias"):
        raise UnsupportedModelError("config.json: Gemma with attention_bias (an o_proj bias) is not supported")
    n = cfg["num_hidden_layers"]
    types = cfg.get("layer_types") or [
        "sliding_attention" if (i + 1) % pattern else "full_attention" for i in range(n)
    ]
    return dict(
        hidden_act=cfg.get("hidden_activation") or cfg.get("hidden_act") or "gelu_pytorch_tanh",
        head_dim=cfg.get("head_dim") or 256,
        rms_norm_eps=cfg.get("rms_norm_eps", 1e-6),
        max_position_embeddings=cfg.get("max_position_embeddings", 8192),
        tie_word_embeddings=cfg.get("tie_word_embeddings", True),
        sliding_window=cfg.get("sliding_window", 4096),
        layer_types=tuple(types),
        query_pre_attn_scalar=cfg.get("query_pre_attn_scalar", 256),
        norm_offset=True,
        sandwich_norms=True,
        embed_scale=True,
    )


@dataclass
class ModelArgs(TransformerArgs):
    @classmethod
    def from_hf_config(cls, cfg: dict[str, Any]) -> "ModelArgs":
        return cls(**cls._common(
            cfg, **gemma_kwargs(cfg, 2),
            attn_logit_softcapping=cfg.get("attn_logit_softcapping", 50.0),
            final_logit_softcapping=cfg.get("final_logit_softcapping", 30.0),
        ))


class Model(DecoderModel):
    pass
