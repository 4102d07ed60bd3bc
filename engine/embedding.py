"""Embeddings: how a model pools its final hidden states into one vector, and the pooling itself.

An embedding request runs its prompt through the decoder like a prefill (batched with every other
request by the scheduler, its KV freed when it ends) and keeps the final norm's output instead of
sampling. The model says how to pool, read once at load (:func:`read_pooling`):

- a sentence-transformers folder: ``modules.json`` names the Pooling module's folder (its
  ``config.json``: ``pooling_mode_lasttoken`` for Qwen3-Embedding, ``pooling_mode_mean_tokens``,
  ``pooling_mode_cls_token``) and whether a Normalize module follows; without ``modules.json``,
  ``1_Pooling/config.json`` alone;
- a GGUF: ``<arch>.pooling_type`` (llama.cpp's enum: 1 mean, 2 cls, 3 last);
- anything else: the mean of every token's state.

Vectors are L2-normalized unless the model's ``modules.json`` lists no Normalize module: OpenAI's
and Ollama's ``/api/embed`` clients expect unit vectors (cosine = dot product), and a
sentence-transformers model that leaves them unnormalized says so by its modules.
"""

from __future__ import annotations

import enum
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from llmsys.kernels.common.errors import ContextOverflowError, InvalidParameterError


class PoolingType(enum.Enum):
    MEAN = "mean"  # the average of every prompt token's state
    LAST = "last"  # the last prompt token's state (decoder embedding models: it has seen every token)
    CLS = "cls"  # the first token's state


# llama.cpp's LLAMA_POOLING_TYPE_* (GGUF ``<arch>.pooling_type``): 0 none, 4 rank are not embeddings of a text
_GGUF_POOLING = {1: PoolingType.MEAN, 2: PoolingType.CLS, 3: PoolingType.LAST}
# sentence-transformers Pooling config keys llmsys computes, and the ones it cannot
_ST_MODES = {"pooling_mode_lasttoken": PoolingType.LAST, "pooling_mode_mean_tokens": PoolingType.MEAN,
             "pooling_mode_cls_token": PoolingType.CLS}
_ST_OTHER = ("pooling_mode_max_tokens", "pooling_mode_mean_sqrt_len_tokens", "pooling_mode_weightedmean_tokens")
_ST_KNOWN_MODULES = ("Transformer", "Pooling", "Normalize")


@dataclass(frozen=True)
class Pooling:
    """How a model's embedding is made. ``source``: where that was read (for messages and ``/api/show``);
    ``unsupported``: the one line an embedding request is refused with when the model asks for a step
    llmsys does not run (a Dense projection, max pooling); None: supported."""

    type: PoolingType
    normalize: bool
    source: str
    unsupported: str | None = None

    def check(self) -> None:
        if self.unsupported is not None:
            raise InvalidParameterError(self.unsupported)


DEFAULT_POOLING = Pooling(PoolingType.MEAN, True, "default (mean, normalized)")


def read_pooling(path: Path, gguf_fields: dict[str, Any] | None = None) -> Pooling:
    """The pooling of the model at ``path`` (a folder, or a GGUF file with its header's ``gguf_fields``)."""
    if gguf_fields is not None:
        arch = gguf_fields.get("general.architecture")
        key = f"{arch}.pooling_type"
        value = gguf_fields.get(key)
        if value is None:
            return DEFAULT_POOLING
        kind = _GGUF_POOLING.get(int(value))
        if kind is None:
            return Pooling(PoolingType.MEAN, True, f"GGUF {key}",
                           f"{path.name}: GGUF {key} = {int(value)} is not a text embedding's pooling (llmsys pools "
                           "1 mean, 2 cls, 3 last)")
        return Pooling(kind, True, f"GGUF {key}")
    if not path.is_dir():
        return DEFAULT_POOLING
    modules_file = path / "modules.json"
    if modules_file.is_file():
        return _from_modules(path, modules_file)
    if (path / "1_Pooling" / "config.json").is_file():
        kind, why = _pooling_config(path / "1_Pooling" / "config.json")
        return Pooling(kind, True, "1_Pooling/config.json", why)
    return DEFAULT_POOLING


def _from_modules(root: Path, modules_file: Path) -> Pooling:
    try:
        modules = json.loads(modules_file.read_text())
        entries = [(str(m.get("path", "")), str(m.get("type", "")).rsplit(".", 1)[-1]) for m in modules]
    except (OSError, ValueError, AttributeError, TypeError) as e:
        return Pooling(PoolingType.MEAN, True, "modules.json", f"{modules_file}: unreadable ({e}); fix or delete it")
    kind, why, source = PoolingType.MEAN, None, "modules.json (no Pooling module: mean)"
    for folder, name in entries:
        if name == "Pooling":
            cfg = root / folder / "config.json"
            if cfg.is_file():
                kind, why = _pooling_config(cfg)
                source = str(cfg.relative_to(root))
        elif name not in _ST_KNOWN_MODULES and why is None:
            why = (f"{modules_file}: the sentence-transformers module {folder or name!r} ({name}) is not run by llmsys "
                   "(it runs Transformer, Pooling and Normalize); its embeddings would be wrong")
    normalize = any(name == "Normalize" for _, name in entries)
    return Pooling(kind, normalize, source, why)


def _pooling_config(cfg: Path) -> tuple[PoolingType, str | None]:
    """A sentence-transformers Pooling config's mode, and the refusal line of a mode llmsys does not compute."""
    try:
        raw = json.loads(cfg.read_text())
    except (OSError, ValueError) as e:
        return PoolingType.MEAN, f"{cfg}: unreadable ({e}); fix or delete it"
    if not isinstance(raw, dict):
        return PoolingType.MEAN, f"{cfg}: not a JSON object; fix or delete it"
    on = [k for k, v in raw.items() if v is True and (k in _ST_MODES or k in _ST_OTHER)]
    if len(on) == 1 and on[0] in _ST_MODES:
        return _ST_MODES[on[0]], None
    if not on:
        return PoolingType.MEAN, None  # sentence-transformers' own default
    return PoolingType.MEAN, (f"{cfg}: pooling {' + '.join(on)} is not computed by llmsys (it pools one of "
                              f"{', '.join(_ST_MODES)})")


class Pooler:
    """One request's pooling over its prompt, fed chunk by chunk as the scheduler runs it.

    A chunk that starts at position 0 starts over: a sequence preempted and recomputed feeds its
    prompt again from the start (an embedding request never reuses cached prefix blocks, whose rows
    it would miss: ``Sequence.prefix_reuse``)."""

    def __init__(self, pooling: Pooling, prompt_len: int):
        self.pooling = pooling
        self.prompt_len = prompt_len
        self._acc: torch.Tensor | None = None

    @property
    def reuses_prefix(self) -> bool:
        """Whether cached prefix blocks may stand in for prompt rows (only the last row is read)."""
        return self.pooling.type is PoolingType.LAST

    def add(self, start: int, rows: torch.Tensor) -> None:
        """The final hidden states ``rows [n, D]`` (float32) of prompt positions ``start .. start + n - 1``."""
        kind, n = self.pooling.type, rows.shape[0]
        if start == 0:
            self._acc = None
        if kind is PoolingType.MEAN:
            s = rows.sum(0, dtype=torch.float64)
            self._acc = s if self._acc is None else self._acc + s
        elif kind is PoolingType.CLS and start == 0:
            self._acc = rows[0].double()
        elif kind is PoolingType.LAST and start + n == self.prompt_len:
            self._acc = rows[-1].double()

    def result(self) -> torch.Tensor:
        """The embedding ``[D]`` float32 (normalized when the pooling says)."""
        if self._acc is None:
            raise RuntimeError("the pooled prompt was not fully computed")
        v = self._acc / self.prompt_len if self.pooling.type is PoolingType.MEAN else self._acc
        if self.pooling.normalize:
            v = torch.nn.functional.normalize(v, dim=0)
        return v.float()


def fit_context(ids: list[int], max_len: int, truncate: bool) -> list[int]:
    """An embedding's prompt within the context: its first ``max_len`` tokens when ``truncate``, else a
    :class:`ContextOverflowError` naming both lengths."""
    if len(ids) <= max_len:
        return ids
    if truncate:
        return ids[:max_len]
    raise ContextOverflowError(len(ids), max_len, f"an input has {len(ids)} tokens but the context holds {max_len}; "
                               "shorten it, raise --max-model-len, or ask for truncation")


def shorten(vector: torch.Tensor, dimensions: int | None, normalize: bool) -> torch.Tensor:
    """The first ``dimensions`` values (OpenAI's ``dimensions``: the Matryoshka cut models like Qwen3-Embedding
    are trained for), normalized again when the full vector was; None: the whole vector."""
    if dimensions is None or dimensions == vector.shape[-1]:
        return vector
    if not 1 <= dimensions <= vector.shape[-1]:
        raise InvalidParameterError(f"dimensions={dimensions} is outside 1..{vector.shape[-1]}, this model's "
                                    "embedding size")
    v = vector[..., :dimensions]
    return torch.nn.functional.normalize(v, dim=-1) if normalize else v


@dataclass(frozen=True)
class EmbeddingOutput:
    """One input's embedding (``LLM.embed``): the vector ``[D]`` float32 and the tokens it was made of."""

    embedding: torch.Tensor
    prompt_tokens: int
    truncated: bool = False  # the input was cut to the context (asked for with truncate=True)
