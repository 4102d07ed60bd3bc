"""Checkpoint loading: Hugging Face directories, GGUF files and llama2.c files."""

from llmsys.engine.loader.common import LoadedModel, load_model, resolve_dtype, resolve_device

__all__ = ["LoadedModel", "load_model", "resolve_dtype", "resolve_device"]
