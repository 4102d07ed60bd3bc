"""Structural types handed across package boundaries.

Why Protocols: the engine builds the paged KV pool (``engine/kv_cache.py``) and
hands it to offload's swap space and KV tier, which must not import the engine.
They name here exactly what they read, and any pool with those attributes fits.
"""

from __future__ import annotations

from typing import Iterator, Protocol

import torch


class PagedKVShape(Protocol):
    """The geometry of a paged KV pool (``engine.kv_cache.KVCacheSpec`` is one)."""

    @property
    def num_layers(self) -> int: ...
    @property
    def num_blocks(self) -> int: ...
    @property
    def block_size(self) -> int: ...  # tokens per block
    @property
    def num_kv_heads(self) -> int: ...
    @property
    def head_dim(self) -> int: ...
    @property
    def dtype(self) -> torch.dtype: ...  # the float dtype of a non-quantized pool
    @property
    def kv_dtype(self) -> str: ...  # "auto" (= dtype), "int8" or "int4"
    @property
    def bytes_per_token(self) -> int: ...  # all layers, K and V (quantized pools: codes and scales)


class KVPool(Protocol):
    """The KV pool of one engine: where each layer's K/V live and how they are written.

    Chosen once, by ``engine.kv_cache.make_kv_pool`` from ``spec.kv_dtype``; the
    attention backend built for it (``engine.attention.make_backend``) is the only
    code that reads it during a step, and offload's swap space and KV tier copy its
    blocks through :meth:`block_tensors`. Token *slots* are ``block * block_size +
    offset`` for every kind, so block tables, the allocator and the scheduler do not
    care which pool holds the tokens. ``k[i]`` / ``v[i]`` are layer ``i``'s sides:
    ``[num_blocks, block_size, Hk, D]`` tensors for a plain pool, quantized side
    objects (``llmsys.quant.kv_paged``) otherwise.
    """

    spec: PagedKVShape
    kind: str  # "plain" | "int8" | "int4"
    k: list
    v: list

    @property
    def quantized(self) -> bool: ...

    def store(self, layer: int, k: torch.Tensor, v: torch.Tensor, slots: torch.Tensor) -> None:
        """Write new K/V ``[T, Hk, D]`` of ``layer`` at ``slots [T]`` (quantized pools quantize on write)."""
        ...

    def nbytes(self) -> int: ...

    def block_tensors(self) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """Per-layer K and V tensors whose blocks the swap space and the cold tier copy (plain pools only)."""
        ...


class LayerRunner(Protocol):
    """Runs decoder layers whose weights are not all resident (``llmsys.offload.runtime.OffloadRuntime``).

    Why a Protocol handed to the forward, not a hook set on the model: the model
    is built before the offload runtime knows which layers stream, and offload
    must not import the engine. The engine's runner passes it to
    ``DecoderModel.forward``; with None every layer runs as it is.
    """

    def run_layer(self, i: int, layer: torch.nn.Module, h: torch.Tensor, residual: torch.Tensor | None,
                  positions: torch.Tensor, rope: torch.Tensor, attn: object, meta: object,
                  ) -> tuple[torch.Tensor, torch.Tensor]:
        """Layer ``i``'s ``layer(h, residual, positions, rope, attn, meta)`` with its weights made resident."""
        ...

    def rebinds(self, i: int) -> bool:
        """Are layer ``i``'s weights bound afresh for each step (streamed or copied in), so no kernel argument
        may be built from them ahead of the step (``engine/models/decode_plan.py``)?"""
        ...


class ExpertSource(Protocol):
    """A sparse layer's experts whose weights are not all resident where the layer runs
    (``llmsys.offload.experts``: experts read from disk on demand into a RAM cache, or kept in CPU RAM
    and computed there beside a GPU layer).

    Why a Protocol handed to the layer's forward (by the offload runtime's ``run_layer``), not a hook
    set on the MoE block: the block is built on the meta device before any plan exists, and offload
    must not import the engine. The block routes first, then asks only for the experts its tokens
    chose.
    """

    @property
    def device(self) -> torch.device:
        """Where the experts compute: the block sends the routed hidden rows there and the sum back."""
        ...

    def each(self, experts: list[int], hold: bool = False) -> Iterator[int]:
        """Yield every id of ``experts`` once (in any order), each while the layer's expert module of that
        id holds its weights; they are unbound again when the consumer asks for the next one. ``hold``: each
        yielded expert's weights stay in place until the generator is closed, its module bound only on
        :meth:`bind` (a grouped call over all of them reads the weights where they are: :meth:`where`)."""
        ...

    def holds(self, n: int) -> bool:
        """Can ``n`` experts be held at once (``each(..., hold=True)``)?"""
        ...

    def where(self, e: int) -> int:
        """Where held expert ``e``'s weights are (the same number while they stay there): a key for what was
        built from them."""
        ...

    def bind(self, e: int) -> None:
        """Bind held expert ``e``'s module to its weights (until the holding generator closes)."""
        ...

    def prefetch_next(self, x: torch.Tensor) -> None:
        """Called once the layer has routed ``x [T, hidden]`` (its router's input): a source whose experts are
        read from disk may guess the next sparse layer's experts from ``x`` and start reading them while this
        layer computes (pre-gating); others do nothing."""
        ...
