"""Llama 1/2/3/3.1/3.2 (incl. ``rope_scaling`` type ``llama3``; tied or untied embeddings)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from llmsys.engine.models.base import DecoderModel, TransformerArgs


@dataclass
class ModelArgs(TransformerArgs):
    @classmethod
    def from_hf_config(cls, cfg: dict[str, Any]) -> "ModelArgs":
        return cls(**cls._common(cfg, attention_bias=bool(cfg.get("attention_bias", False))))


class Model(DecoderModel):
    pass
