"""Architecture registry: Hugging Face ``architectures`` / ``model_type`` -> family module."""

from __future__ import annotations

import importlib
from types import ModuleType
from typing import Any

from llmsys.kernels.common.errors import UnsupportedModelError

# model_type -> module name; architectures map onto the same modules.
FAMILIES = {
    "llama": "llama",
    "mistral": "mistral",
    "qwen2": "qwen2",
    "qwen3": "qwen3",
    "phi3": "phi3",
    "gemma2": "gemma2",
    "gemma3_text": "gemma3",
    "qwen2_moe": "qwen2_moe",
    "qwen3_moe": "qwen3_moe",
    "mixtral": "mixtral",
    "gpt_oss": "gpt_oss",
}
ARCHITECTURES = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "mistral",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
    "Phi3ForCausalLM": "phi3",
    "Gemma2ForCausalLM": "gemma2",
    "Gemma3ForCausalLM": "gemma3",
    "Qwen2MoeForCausalLM": "qwen2_moe",
    "Qwen3MoeForCausalLM": "qwen3_moe",
    "MixtralForCausalLM": "mixtral",
    "GptOssForCausalLM": "gpt_oss",
}


def family_for(cfg: dict[str, Any], source: str = "config.json") -> ModuleType:
    """Pick the family module for a config, or fail naming the supported ones."""
    archs = cfg.get("architectures") or []
    mt = cfg.get("model_type")
    name = FAMILIES.get(mt) if mt else None
    if name is None:
        name = next((ARCHITECTURES[a] for a in archs if a in ARCHITECTURES), None)
    if name is None:
        what = ", ".join(archs) or mt or "no architectures/model_type"
        raise UnsupportedModelError(
            f"{source}: unsupported architecture {what}; supported: {', '.join(ARCHITECTURES)}"
        )
    return importlib.import_module(f"llmsys.engine.models.{name}")
