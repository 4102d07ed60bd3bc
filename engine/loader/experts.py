"""The engine's MoE tensor names found under the other names checkpoints store them by.

The engine names an expert's weights as Qwen's Hub checkpoints do (``model.layers.N.mlp.experts.E.gate_proj.weight``,
and what transformers' ``save_pretrained`` writes for every MoE family), one ``[I, H]`` matrix each, so each
expert is a ``Linear`` that quantizes and streams like any projection. Two other layouts are met:

* Mixtral's Hub checkpoints: ``block_sparse_moe.gate`` and ``block_sparse_moe.experts.E.w1/w3/w2`` (gate/up/down);
* transformers' in-memory layout (a checkpoint saved without its conversion back): ``mlp.experts.gate_up_proj``
  ``[E, 2 I, H]`` (gate rows first) and ``mlp.experts.down_proj`` ``[E, H, I]``.

Each engine name is added to the index as a view of the stored bytes (``CheckpointIndex.add_view``): an
expert's gate rows, up rows and down matrix are each one contiguous range of the fused tensors, so nothing
is copied, and the offload runtime streams a view like any stored tensor.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from pathlib import Path

from llmsys.engine.loader.safetensors_io import CheckpointIndex
from llmsys.kernels.common.errors import CheckpointError

_NAME = re.compile(r"^(model\.layers\.\d+)\.mlp\.(gate\.weight|experts\.(\d+)\.(gate|up|down)_proj\.weight)$")
_MIXTRAL = {"gate": "w1", "up": "w3", "down": "w2"}


def add_expert_views(index: CheckpointIndex, names: Iterable[str], shapes: dict[str, tuple[int, ...]],
                     path: Path) -> None:
    """For each MoE tensor of ``names`` (the model's) that ``index`` lacks, add it as a view of Mixtral's name
    or of the fused tensors when the checkpoint holds those. ``shapes``: the model's shape of each name."""
    for name in names:
        m = _NAME.match(name)
        if m is None or name in index:
            continue
        layer, _, expert, part = m.groups()
        if expert is None:  # the router
            alias = f"{layer}.block_sparse_moe.gate.weight"
            if alias in index:
                index.add_view(name, alias, 0, shapes[name])
            continue
        alias = f"{layer}.block_sparse_moe.experts.{expert}.{_MIXTRAL[part]}.weight"
        if alias in index:
            index.add_view(name, alias, 0, shapes[name])
            continue
        fused = f"{layer}.mlp.experts.{'down_proj' if part == 'down' else 'gate_up_proj'}"
        if fused in index:
            _fused_view(index, name, fused, int(expert), part, shapes[name], path)


def _fused_view(index: CheckpointIndex, name: str, fused: str, e: int, part: str, shape: tuple[int, ...],
                path: Path) -> None:
    """Expert ``e``'s ``part`` of a fused ``[E, 2 I, H]`` gate|up or ``[E, H, I]`` down tensor."""
    rows, cols = shape
    stored = tuple(index.info(fused).shape)
    per = (2 * rows, cols) if part != "down" else (rows, cols)
    if len(stored) != 3 or stored[1:] != per or e >= stored[0]:
        raise CheckpointError(f"{path}: tensor {fused} has shape {list(stored)}, expected [experts, {per[0]}, "
                              f"{per[1]}] with expert {e} in it; the checkpoint does not match its config")
    first = (e * per[0] + (rows if part == "up" else 0)) * cols  # the element where this expert's part starts
    index.add_view(name, fused, first, shape)
