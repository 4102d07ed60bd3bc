"""Qwen3 (dense): per-head RMSNorm on q and k, explicit ``head_dim``, no qkv bias."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from llmsys.engine.models.base import DecoderModel, TransformerArgs


@dataclass
class ModelArgs(TransformerArgs):
    @classmethod
    def from_hf_config(cls, cfg: dict[str, Any]) -> "ModelArgs":
        return cls(**cls._common(cfg, qk_norm=True, attention_bias=bool(cfg.get("attention_bias", False))))


class Model(DecoderModel):
    pass
