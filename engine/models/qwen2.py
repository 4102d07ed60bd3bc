"""Qwen2 / Qwen2.5: the Llama decoder with bias on the q/k/v projections."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from llmsys.engine.models.base import DecoderModel, TransformerArgs


@dataclass
class ModelArgs(TransformerArgs):
    @classmethod
    def from_hf_config(cls, cfg: dict[str, Any]) -> "ModelArgs":
        return cls(**cls._common(cfg, attention_bias=True))


class Model(DecoderModel):
    pass
