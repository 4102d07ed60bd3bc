"""Gemma 3, text only (``Gemma3ForCausalLM``, config ``Gemma3TextConfig``, model_type ``gemma3_text``).

Gemma 2's decoder (:mod:`.gemma2`) plus per-head q/k RMSNorm (``1 + w`` too), five local
(sliding-window) layers to one global by default (``sliding_window_pattern`` 6, or ``layer_types``),
and the local layers' own RoPE base (``rope_local_base_freq``, unscaled; the global layers take
``rope_theta`` and ``rope_scaling``): a second RoPE table (``local_rope_theta``). No soft-capping
unless the config sets it.

Gemma 3 4B/12B/27B ship as ``Gemma3ForConditionalGeneration`` (model_type ``gemma3``): the text model is
read out of them (``models.text_config`` over :func:`text_defaults`; the weights under the
``language_model`` prefixes, ``loader.multimodal``), the vision tower and projector left unread.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from llmsys.engine.models.base import DecoderModel, TransformerArgs
from llmsys.engine.models.gemma2 import gemma_kwargs
from llmsys.kernels.common.errors import UnsupportedModelError

GLOBAL_THETA, LOCAL_THETA = 1_000_000.0, 10_000.0  # transformers' Gemma3TextConfig defaults


def text_defaults() -> dict[str, Any]:
    """transformers' ``Gemma3TextConfig`` defaults of the fields llmsys reads, for the ``text_config`` of a
    ``Gemma3ForConditionalGeneration`` checkpoint (``models.text_config``): the Hub's gemma-3-4b-it states
    only hidden/intermediate size, layers, sliding window and RoPE scaling, so its vocabulary (262208),
    heads (8, 4 KV, 256 wide) and context (131072) are these. A function: a fresh dict per caller."""
    return dict(
        vocab_size=262_208, hidden_size=2304, intermediate_size=9216, num_hidden_layers=26, num_attention_heads=8,
        num_key_value_heads=4, head_dim=256, hidden_activation="gelu_pytorch_tanh", max_position_embeddings=131_072,
        rms_norm_eps=1e-6, pad_token_id=0, eos_token_id=1, bos_token_id=2, tie_word_embeddings=True,
        query_pre_attn_scalar=256, sliding_window=4096,
    )


@dataclass
class ModelArgs(TransformerArgs):
    @classmethod
    def from_hf_config(cls, cfg: dict[str, Any]) -> "ModelArgs":
        if cfg.get("use_bidirectional_attention"):
            raise UnsupportedModelError("config.json: Gemma 3 with use_bidirectional_attention (an embedding "
                                        "model) is not supported; llmsys runs causal language models")
        rope = cfg.get("rope_parameters") or {}
        full, local = rope.get("full_attention"), rope.get("sliding_attention")
        if isinstance(full, dict) or isinstance(local, dict):  # transformers >= 5: one dict per layer type
            full, local = dict(full or {}), dict(local or {})
            if local.get("rope_type", "default") != "default":
                raise UnsupportedModelError(f"config.json: Gemma 3 local layers with rope_type "
                                            f"{local['rope_type']!r} are not supported (default is)")
            theta = full.pop("rope_theta", GLOBAL_THETA)
            local_theta = local.get("rope_theta", LOCAL_THETA)
            scaling = full if full.get("rope_type", "default") != "default" else None
        else:  # older configs: rope_theta + rope_scaling (the global layers'), rope_local_base_freq
            theta = cfg.get("rope_theta", GLOBAL_THETA)
            local_theta = cfg.get("rope_local_base_freq", LOCAL_THETA)
            scaling = cfg.get("rope_scaling")
        pattern = cfg.get("sliding_window_pattern") or cfg.get("_sliding_window_pattern") or 6
        return cls(**cls._common(
            cfg, **gemma_kwargs(cfg, pattern), qk_norm=True, rope_theta=theta, rope_scaling=scaling,
            local_rope_theta=local_theta,
            attn_logit_softcapping=cfg.get("attn_logit_softcapping"),
            final_logit_softcapping=cfg.get("final_logit_softcapping"),
        ))

    @property
    def max_context(self) -> int:
        """``max_position_embeddings``: Gemma 3's configs state the context their linear RoPE factor
        already stretched (the builder would otherwise stretch it once more, as for older Llama configs)."""
        return self.max_position_embeddings


class Model(DecoderModel):
    pass
