"""The engine's MoE tensor names, found under the other names checkpoints store them by.

The engine names experts as Qwen's Hub checkpoints do (``model.layers.N.mlp.experts.E.gate_proj.weight``),
one ``[I, H]`` ``Linear`` each, so experts quantize and stream like any projection. Also read: Mixtral's
``block_sparse_moe.gate`` / ``experts.E.w1,w3,w2``; transformers' in-memory ``gate_up_proj [E, 2 I, H]``
(gate rows first) and ``down_proj [E, H, I]``; gpt-oss's ``mlp.router`` (with bias), ``gate_up_proj [E, H,
2 I]`` (``x @ W``, gate/up interleaved by column), ``down_proj [E, I, H]``, their biases, or MXFP4
``*_blocks`` / ``*_scales`` (``quant/mxfp4.py``). Contiguous pieces become views of the stored bytes
(``CheckpointIndex.add_view``: no copy, streamable); gpt-oss's strided or packed ones are derived when
asked (``CheckpointIndex.add_derived``), offloaded ones written to the offload file once.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from pathlib import Path

import torch

from llmsys.engine.loader.safetensors_io import CheckpointIndex
from llmsys.kernels.common.errors import CheckpointError
from llmsys.quant.mxfp4 import dequantize_mxfp4

_NAME = re.compile(r"^(model\.layers\.\d+)\.mlp\.(gate|experts\.(\d+)\.(gate|up|down)_proj)\.(weight|bias)$")
_MIXTRAL = {"gate": "w1", "up": "w3", "down": "w2"}


def add_expert_views(index: CheckpointIndex, names: Iterable[str], shapes: dict[str, tuple[int, ...]],
                     path: Path, layout: str = "rows") -> None:
    """For each MoE tensor of ``names`` (the model's) that ``index`` lacks, add it as a view of Mixtral's name
    or of the fused tensors when the checkpoint holds those, or (``layout`` ``"gpt_oss"``) as derived from
    gpt-oss's fused or MXFP4 tensors. ``shapes``: the model's shape of each name."""
    for name in names:
        m = _NAME.match(name)
        if m is None or name in index:
            continue
        layer, _, expert, part, leaf = m.groups()
        if layout == "gpt_oss":
            _gpt_oss(index, name, layer, expert, part, leaf, shapes[name], path)
            continue
        if leaf != "weight":
            continue
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


def _gpt_oss(index: CheckpointIndex, name: str, layer: str, expert: str | None, part: str | None, leaf: str,
             shape: tuple[int, ...], path: Path) -> None:
    """``name`` (the router's, or one expert's gate / up / down weight or bias) from gpt-oss's tensors."""
    if expert is None:  # the router: mlp.router.weight [E, H] / .bias [E], as stored
        alias = f"{layer}.mlp.router.{leaf}"
        if alias in index:
            index.add_view(name, alias, 0, shape)
        return
    e = int(expert)
    fused = f"{layer}.mlp.experts.{'down_proj' if part == 'down' else 'gate_up_proj'}"
    if leaf == "bias":  # [E, 2 I] (gate, up interleaved) / [E, H]
        src = f"{fused}_bias"
        if src not in index:
            return
        n = shape[0]
        if part == "down":
            _check(index, src, (None, n), e, path)
            index.add_view(name, src, e * n, shape)
        else:
            _check(index, src, (None, 2 * n), e, path)
            odd = part == "up"
            index.add_derived(name, index.info(src).dtype, shape,
                              lambda: index.read_piece(src, e * 2 * n, (2 * n,))[odd::2].contiguous())
        return
    rows, cols = shape  # the engine's [out, in]: gate/up [I, H], down [H, I]
    odd = part == "up"
    if f"{fused}_blocks" in index:  # MXFP4: [E, out rows (gate, up interleaved for gate|up), in / 32, 16]
        blocks, scales = f"{fused}_blocks", f"{fused}_scales"
        out = rows if part == "down" else 2 * rows
        g = cols // 32
        _check(index, blocks, (None, out, g, 16), e, path)
        _check(index, scales, (None, out, g), e, path)

        def mxfp4() -> torch.Tensor:
            w = dequantize_mxfp4(index.read_piece(blocks, e * out * g * 16, (out, g, 16)),
                                 index.read_piece(scales, e * out * g, (out, g)))  # [out, in] bfloat16
            return w if part == "down" else w[odd::2].contiguous()

        index.add_derived(name, torch.bfloat16, shape, mxfp4)
        return
    if fused not in index:
        return
    if part == "down":  # [E, I, H]: expert e's [I, H] transposed
        _check(index, fused, (None, cols, rows), e, path)
        index.add_derived(name, index.info(fused).dtype, shape,
                          lambda: index.read_piece(fused, e * cols * rows, (cols, rows)).t().contiguous())
    else:  # [E, H, 2 I]: expert e's [H, 2 I], every other column from `odd`, transposed
        _check(index, fused, (None, cols, 2 * rows), e, path)
        def gate_up() -> torch.Tensor:
            return index.read_piece(fused, e * cols * 2 * rows, (cols, 2 * rows))[:, odd::2].t().contiguous()

        index.add_derived(name, index.info(fused).dtype, shape, gate_up)


def _check(index: CheckpointIndex, src: str, per: tuple[int | None, ...], e: int, path: Path) -> None:
    """``src`` has shape ``per`` (None: any number of experts, expert ``e`` among them)."""
    stored = tuple(index.info(src).shape)
    if len(stored) != len(per) or stored[1:] != per[1:] or e >= stored[0]:
        want = ", ".join(["experts", *(str(x) for x in per[1:])])
        raise CheckpointError(f"{path}: tensor {src} has shape {list(stored)}, expected [{want}] with expert {e} in "
                              "it; the checkpoint does not match its config")
