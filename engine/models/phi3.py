"""Phi-3 / Phi-3.5-mini / Phi-4-mini (``Phi3ForCausalLM``): the Llama decoder with fused checkpoints.

The checkpoint stores q|k|v as one ``qkv_proj`` and gate|up as one ``gate_up_proj``; the layers are
built fused (``fused_qkv``, ``fused_gate_up``), so the tensors load by name and the inference engine
runs the one GEMM each that it would fuse for Llama anyway. ``partial_rotary_factor`` (Phi-4-mini:
0.75) rotates only each head's first dims. ``rope_scaling`` LongRoPE (``longrope``; ``su`` and
``yarn`` in older configs) gives a short and a long factor table; as in transformers' forward, a
step rotates a sequence's new tokens with the long one when the sequence (a prompt: all of it,
however it is chunked) is longer than ``original_max_position_embeddings``
(``DecoderModel.rope_positions``). Keys cached before a generation passes that length keep their
short rotation (transformers' ``generate`` recomputes them once, at the switch), as do prompt
blocks reused from the prefix cache. A configured ``sliding_window`` applies to every layer, as in
transformers (Phi-3-mini-4k: 2047).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from llmsys.engine.models.base import DecoderModel, TransformerArgs
from llmsys.kernels import rope_type


# transformers' Phi3Config reads these rope types as LongRoPE (configs before 4.42 say "su").
LONGROPE_NAMES = ("longrope", "su", "yarn")


@dataclass
class ModelArgs(TransformerArgs):
    @classmethod
    def from_hf_config(cls, cfg: dict[str, Any]) -> "ModelArgs":
        kw = cls._common(cfg, fused_qkv=True, fused_gate_up=True, sliding_window=cfg.get("sliding_window"),
                         attention_bias=bool(cfg.get("attention_bias", False)))
        # transformers >= 5 writes partial_rotary_factor (and LongRoPE's original context) into
        # rope_parameters too; older configs hold them beside rope_scaling.
        rope = cfg.get("rope_parameters") or {}
        kw["partial_rotary_factor"] = float(rope.get("partial_rotary_factor", cfg.get("partial_rotary_factor", 1.0)))
        scaling = kw["rope_scaling"]
        if rope_type(scaling) in LONGROPE_NAMES:
            orig = scaling.get("original_max_position_embeddings", cfg.get("original_max_position_embeddings"))
            kw["rope_scaling"] = dict(scaling, rope_type="longrope", original_max_position_embeddings=orig)
        return cls(**kw)


class Model(DecoderModel):
    pass
