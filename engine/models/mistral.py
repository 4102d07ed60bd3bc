"""Mistral (7B v0.1-v0.3): the Llama decoder with GQA.

v0.2+ disable the sliding window (``sliding_window: null``); a configured
window larger than the context we run is equivalent to full attention, which
is what we implement (a smaller one is refused up front by the LLM facade via
``max_context``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from llmsys.engine.models.base import DecoderModel, TransformerArgs


@dataclass
class ModelArgs(TransformerArgs):
    sliding_window: int | None = None

    @classmethod
    def from_hf_config(cls, cfg: dict[str, Any]) -> "ModelArgs":
        return cls(**cls._common(cfg, sliding_window=cfg.get("sliding_window")))

    @property
    def max_context(self) -> int:
        if self.sliding_window:
            return min(self.max_position_embeddings, self.sliding_window)
        return self.max_position_embeddings


class Model(DecoderModel):
    pass
