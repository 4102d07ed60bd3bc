"""Architecture registry: Hugging Face ``architectures`` / ``model_type`` -> family module."""

from __future__ import annotations

import importlib
from types import ModuleType
from typing import Any

from llmsys.kernels.common.errors import CheckpointError, UnsupportedModelError

# model_type -> module name; architectures map onto the same modules.
FAMILIES = {
    "llama": "llama",
    "mistral": "mistral",
    "qwen2": "qwen2",
    "qwen3": "qwen3",
    "phi3": "phi3",
    "gemma2": "gemma2",
    "gemma3_text": "gemma3",
    "gemma3": "gemma3",  # Gemma3ForConditionalGeneration's outer config: its text_config is read (text_config())
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
    "Gemma3ForConditionalGeneration": "gemma3",  # text only: the vision tower is not loaded
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


# A multimodal checkpoint's architecture / model_type -> the text model's that llmsys loads out of it
# (text_config()).
MULTIMODAL = {"Gemma3ForConditionalGeneration": "Gemma3ForCausalLM"}
MULTIMODAL_TYPES = {"gemma3": "gemma3_text"}
# Outer fields the language model takes over from a multimodal config: transformers ties the head by the
# outer tie_word_embeddings (Gemma3ForConditionalGeneration's _tied_weights_keys), and the Hub's configs
# keep the special ids ([1, 106] for gemma-3-4b-it's end tokens), the dtype and any quantization outside.
INHERITED = ("tie_word_embeddings", "bos_token_id", "eos_token_id", "pad_token_id", "torch_dtype", "dtype",
             "quantization_config")


def is_multimodal(cfg: dict[str, Any]) -> bool:
    """A config with its language model nested under ``text_config`` (Gemma 3 4B/12B/27B's)."""
    return cfg.get("model_type") in MULTIMODAL_TYPES or any(a in MULTIMODAL for a in cfg.get("architectures") or [])


def text_config(cfg: dict[str, Any], source: str = "config.json") -> dict[str, Any]:
    """The text model's config of a multimodal one (``cfg`` itself for a text model), as transformers builds
    ``Gemma3ForConditionalGeneration``'s language model: ``text_config`` over the text family's defaults (the
    Hub's gemma-3-4b-it lists 6 fields and leaves vocab_size, heads and context to them), then the
    :data:`INHERITED` fields the outer config holds. Why one function: the loader, ``llmsys plan`` and the
    bench read config.json each, and every one must see the same text model."""
    if not is_multimodal(cfg):
        return cfg
    inner = cfg.get("text_config")
    if not isinstance(inner, dict):
        what = ", ".join(cfg.get("architectures") or []) or cfg.get("model_type")
        raise CheckpointError(f"{source}: a {what} config needs a text_config object (the language model's "
                              "fields); fix config.json or download the model again")
    archs = [MULTIMODAL[a] for a in cfg.get("architectures") or [] if a in MULTIMODAL] or ["Gemma3ForCausalLM"]
    model_type = inner.get("model_type") or MULTIMODAL_TYPES.get(cfg.get("model_type"), "gemma3_text")
    family = family_for({"model_type": model_type, "architectures": archs}, source)
    defaults = getattr(family, "text_defaults", dict)()
    inherited = {k: cfg[k] for k in INHERITED if cfg.get(k) is not None}
    return {**defaults, **inner, **inherited, "model_type": model_type, "architectures": archs[:1]}
