"""What a model path holds, decided once: a Hugging Face directory, a GGUF file or a llama2.c checkpoint.

Every reader of a model (the LLM load, ``load_model``, ``llmsys plan``, the Ollama API's model listing)
asks :func:`detect_model` and passes its :class:`ModelSource` on, so the rules live in one place and a
GGUF's header (its vocabulary is most of it: tens of MB for a big model) is parsed at most once per
load, on first use, and then shared by the config, the tensor index and the tokenizer.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from enum import Enum
from pathlib import Path
from typing import TYPE_CHECKING

from llmsys.kernels.common.errors import CheckpointError, ModelNotFoundError

if TYPE_CHECKING:
    from llmsys.engine.loader.gguf_header import GGUFHeader


class ModelFormat(Enum):
    HF = "hf"  # a directory with config.json and safetensors
    GGUF = "gguf"  # one GGUF file (Ollama's blobs have no suffix)
    LLAMA2C = "llama2c"  # a llama2.c .bin file, or a directory holding one and no config.json


@dataclass(frozen=True)
class ModelSource:
    """A model path and its format. ``gguf_header``: a GGUF's parsed header, read on first use and kept
    (None for the other formats)."""

    path: Path
    format: ModelFormat

    @functools.cached_property
    def gguf_header(self) -> GGUFHeader | None:
        if self.format is not ModelFormat.GGUF:
            return None
        from llmsys.engine.loader.gguf_header import read_header

        return read_header(self.path)


def detect_model(path: str | Path | ModelSource) -> ModelSource:
    """``path``'s format (a :class:`ModelSource` is returned as it is), or a one-line error naming the path
    and what a model path may be."""
    if isinstance(path, ModelSource):
        return path
    from llmsys.engine.loader import gguf_io, llama2c

    p = Path(path).expanduser()
    if not p.exists():
        raise ModelNotFoundError(f"no such file or directory: {p}")
    if p.is_file() and gguf_io.is_gguf(p):  # by its magic, whatever the name
        return ModelSource(p, ModelFormat.GGUF)
    if llama2c.is_llama2c(p):
        return ModelSource(p, ModelFormat.LLAMA2C)
    if p.is_file():
        raise CheckpointError(
            f"{p}: expected a model directory (with config.json), a GGUF file or a llama2.c .bin checkpoint")
    if not (p / "config.json").exists():
        raise CheckpointError(f"{p}: no config.json; point at a Hugging Face model directory")
    return ModelSource(p, ModelFormat.HF)
