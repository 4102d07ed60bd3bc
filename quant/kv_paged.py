"""Quantized paged KV pools (:class:`Int8KVPool`, :class:`Int4KVPool`): per layer, a K and a V "side".

Each side has ``store(x [T, Hk, D], slot_mapping [T])``, ``gather(slots [B, L]) -> [B, L, Hk, D]`` and
``nbytes()``; slots are the float pool's (``block * block_size + offset``), so block tables, allocator
and scheduler do not change. :class:`Int8Side`: the kernels' layout, int8 ``[NB, BS, Hk, D]`` + float32
scales ``[NB, BS, Hk]`` per (token, head), quantized by ``kernels.kv_store`` and dequantized inside the
attention kernels (perplexity: docs/benchmarks.md). :class:`Int4Side`: KIVI in torch, keys per channel
per block, values per token and ``value_group``; a block is buffered in the model dtype while it fills
(at most ``block_size - 1`` tokens a sequence) and quantized at its last slot. The buffer is indexed by
block id: a write at offset 0 starts a block, a write into a quantized block reopens it.
"""

from __future__ import annotations

import torch

from llmsys import kernels
from llmsys.kernels.common.memory import zeros_on_demand
from llmsys.quant.kv import QuantizedKVBlock, dequantize_kv_block, quantize_kv_block


def _pack4(q: torch.Tensor) -> torch.Tensor:
    """``uint8 [..., D] (0..15) -> [..., D/2]``: even d low nibble."""
    return q[..., 0::2] | (q[..., 1::2] << 4)


def _unpack4(p: torch.Tensor) -> torch.Tensor:
    return torch.stack([p & 15, p >> 4], dim=-1).flatten(-2)  # [..., D]


class Int8Side:
    """int8 codes + per (block, slot, head) float32 scale (the kernels' int8 KV layout)."""

    bits = 8

    def __init__(self, num_blocks: int, block_size: int, n_kv: int, head_dim: int, device: torch.device):
        # Pages backed as blocks are first written (kernels.common.memory): RSS follows use.
        self.codes = zeros_on_demand((num_blocks, block_size, n_kv, head_dim), torch.int8, device)
        self.scale = zeros_on_demand((num_blocks, block_size, n_kv), torch.float32, device)

    @property
    def dtype(self) -> torch.dtype:
        return self.codes.dtype

    @property
    def shape(self) -> torch.Size:
        return self.codes.shape

    def gather(self, slots: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:  # [B, L] -> [B, L, Hk, D]
        hk, d = self.codes.shape[-2:]
        x = self.codes.view(-1, hk, d)[slots].float()
        return (x * self.scale.view(-1, hk)[slots].unsqueeze(-1)).to(dtype)

    def nbytes(self) -> int:
        return self.codes.numel() + self.scale.numel() * 4


class Int4Side:
    """KIVI int4 K or V pool for one layer (see the module docstring)."""

    bits = 4

    def __init__(self, kind: str, num_blocks: int, block_size: int, n_kv: int, head_dim: int,
                 device: torch.device, float_dtype: torch.dtype, value_group: int | None = None,
                 window: bool | None = None):
        if head_dim % 2:
            raise ValueError(f"int4 KV needs an even head_dim, got {head_dim}")
        self.kind = kind
        self.nb, self.bs, self.hk, self.d = num_blocks, block_size, n_kv, head_dim
        self.group = value_group or head_dim
        if head_dim % self.group:
            raise ValueError(f"value group {self.group} does not divide head_dim {head_dim}")
        # Keys must buffer their open block (per-channel stats); values may.
        self.window = True if kind == "key" else bool(window)
        self.float_dtype = float_dtype
        self.data = zeros_on_demand((num_blocks, block_size, n_kv, head_dim // 2), torch.uint8, device)
        stat = (num_blocks, 1, n_kv, head_dim) if kind == "key" else (num_blocks, block_size, n_kv, head_dim // self.group)
        self.qscale = zeros_on_demand(stat, torch.float16, device)
        self.qmin = zeros_on_demand(stat, torch.float16, device)
        # Open (not yet quantized) blocks: buffer rows in the model dtype.
        self.row_of = torch.full((num_blocks,), -1, dtype=torch.int64, device=device)  # block -> buffer row
        self.buf = torch.zeros((0, block_size, n_kv, head_dim), dtype=float_dtype, device=device)
        self.filled = torch.zeros((0, block_size), dtype=torch.bool, device=device)
        self._free_rows: list[int] = []

    @property
    def dtype(self) -> torch.dtype:
        return self.data.dtype

    @property
    def shape(self) -> torch.Size:
        return torch.Size((self.nb, self.bs, self.hk, self.d))

    # -- open-block buffer -----------------------------------------------------
    def _open(self, block: int) -> int:
        if self._free_rows:
            row = self._free_rows.pop()
        else:  # grow by a few rows at a time (rows ~ sequences in flight)
            grow = max(4, self.buf.shape[0] // 2)
            first = self.buf.shape[0]
            self.buf = torch.cat([self.buf, self.buf.new_zeros((grow, *self.buf.shape[1:]))])
            self.filled = torch.cat([self.filled, self.filled.new_zeros((grow, self.bs))])
            self._free_rows.extend(range(first + grow - 1, first, -1))
            row = first
        self.row_of[block] = row
        self.filled[row] = False
        return row

    def _close(self, block: int, row: int) -> None:
        self._quantize_blocks(torch.tensor([block], device=self.data.device), self.buf[row : row + 1])
        self.row_of[block] = -1
        self._free_rows.append(row)

    def _quantize_blocks(self, blocks: torch.Tensor, x: torch.Tensor) -> None:
        """Quantize whole blocks ``x [n, BS, Hk, D]`` into ``blocks``."""
        qb = quantize_kv_block(x, self.kind, 4, None if self.kind == "key" else self.group)
        self.data[blocks] = qb.data
        self.qscale[blocks] = qb.scale
        self.qmin[blocks] = qb.minimum

    def _dequant_block(self, block: int) -> torch.Tensor:  # -> [BS, Hk, D]
        qb = QuantizedKVBlock(self.data[block], self.qscale[block], self.qmin[block], 4, self.kind, self.d)  # type: ignore[arg-type]
        return dequantize_kv_block(qb, self.float_dtype)

    # -- public ------------------------------------------------------------------
    def store(self, x: torch.Tensor, slot_mapping: torch.Tensor) -> None:
        """Write ``x [T, Hk, D]`` at ``slot_mapping [T]`` (slot -1: skip)."""
        keep = slot_mapping >= 0
        if not bool(keep.all()):
            x, slot_mapping = x[keep], slot_mapping[keep]
        if x.shape[0] == 0:
            return
        if not self.window:  # values, no window: per-token stats, quantize now
            qb = quantize_kv_block(x.unsqueeze(1), "value", 4, self.group)  # data [T, 1, Hk, D/2]
            self.data.view(-1, self.hk, self.d // 2)[slot_mapping] = qb.data[:, 0]
            self.qscale.view(-1, self.hk, self.d // self.group)[slot_mapping] = qb.scale[:, 0]
            self.qmin.view(-1, self.hk, self.d // self.group)[slot_mapping] = qb.minimum[:, 0]
            return
        blocks = slot_mapping // self.bs
        offs = slot_mapping % self.bs
        # Fast path for prefill: blocks written whole in this call skip the buffer.
        uniq, counts = torch.unique_consecutive(blocks, return_counts=True)
        starts = torch.cumsum(counts, 0) - counts
        full = (counts == self.bs) & (offs[starts] == 0)
        if bool(full.any()):
            idx = torch.nonzero(full).flatten()
            sel = (starts[idx, None] + torch.arange(self.bs, device=x.device)).flatten()
            fb = uniq[idx]
            self._release(fb)
            self._quantize_blocks(fb, x[sel].view(-1, self.bs, self.hk, self.d).to(self.float_dtype))
        rest = torch.nonzero(~full).flatten().tolist()
        if not rest:
            return
        uniq_l, starts_l, counts_l = uniq.tolist(), starts.tolist(), counts.tolist()
        for i in rest:
            b, s, n = uniq_l[i], starts_l[i], counts_l[i]
            o = offs[s : s + n]
            row = int(self.row_of[b])
            if row < 0:
                first = int(o[0])
                row = self._open(b)
                if first > 0:  # reopening a quantized block mid-way: keep its earlier tokens
                    self.buf[row] = self._dequant_block(b)
                    self.filled[row, :first] = True
            self.buf[row, o] = x[s : s + n].to(self.float_dtype)
            self.filled[row, o] = True
            if bool(self.filled[row].all()):
                self._close(b, row)

    def _release(self, blocks: torch.Tensor) -> None:
        rows = self.row_of[blocks]
        for r in rows[rows >= 0].tolist():
            self._free_rows.append(r)
        self.row_of[blocks] = -1

    def gather(self, slots: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:  # [B, L] -> [B, L, Hk, D]
        blk = slots // self.bs
        q = _unpack4(self.data.view(-1, self.hk, self.d // 2)[slots]).float()  # [B, L, Hk, D]
        if self.kind == "key":
            s = self.qscale.view(self.nb, self.hk, self.d)[blk].float()
            m = self.qmin.view(self.nb, self.hk, self.d)[blk].float()
            x = q * s + m
        else:
            g = self.d // self.group
            s = self.qscale.view(-1, self.hk, g)[slots].float()[..., None]  # [B, L, Hk, G, 1]
            m = self.qmin.view(-1, self.hk, g)[slots].float()[..., None]
            x = (q.unflatten(-1, (g, self.group)) * s + m).flatten(-2)
        x = x.to(dtype)
        if self.window and self.buf.shape[0]:
            rows = self.row_of[blk]  # [B, L]
            open_ = rows >= 0
            if bool(open_.any()):
                f = self.buf[rows.clamp_min(0), slots % self.bs].to(dtype)  # [B, L, Hk, D]
                x = torch.where(open_[..., None, None], f, x)
        return x

    def nbytes(self) -> int:
        fixed = sum(t.numel() * t.element_size() for t in (self.data, self.qscale, self.qmin, self.row_of))
        return fixed + self.buf.numel() * self.buf.element_size()

    def window_bytes(self) -> int:
        return self.buf.numel() * self.buf.element_size()


KV_DTYPES = ("auto", "int8", "int4")


def _per_layer(num_blocks: int | list[int], num_layers: int) -> list[int]:
    """Each layer's block count from one count or a list of them."""
    if isinstance(num_blocks, int):
        return [num_blocks] * num_layers
    if len(num_blocks) != num_layers:
        raise ValueError(f"{len(num_blocks)} block counts for {num_layers} layers")
    return list(num_blocks)


class Int8KVPool:
    """int8 KV pool (the kernels' layout): per layer an :class:`Int8Side` for K and one for V."""

    kind = "int8"
    quantized = True

    def __init__(self, num_layers: int, num_blocks: int | list[int], block_size: int, n_kv: int, head_dim: int,
                 device: torch.device, spec: object = None):
        """``num_blocks``: one count for every layer, or one per layer (a ring pool's layers have fewer,
        ``engine/sliding_kv.py``)."""
        self.spec = spec  # the engine's KVCacheSpec (llmsys.engine.kv_cache), kept for its accounting
        nbs = _per_layer(num_blocks, num_layers)
        self.k = [Int8Side(nb, block_size, n_kv, head_dim, device) for nb in nbs]
        self.v = [Int8Side(nb, block_size, n_kv, head_dim, device) for nb in nbs]

    def store(self, layer: int, k: torch.Tensor, v: torch.Tensor, slots: torch.Tensor) -> None:
        """Quantize on write (``kernels.kv_store``'s int8 path: codes + per (slot, head) scales)."""
        ks, vs = self.k[layer], self.v[layer]
        kernels.kv_store(k, v, ks.codes, vs.codes, slots, ks.scale, vs.scale)

    def nbytes(self) -> int:
        return sum(s.nbytes() for s in self.k + self.v)

    def block_tensors(self):
        raise ValueError("an int8 KV pool has no plain block tensors (no swap space or cold tier)")


class Int4KVPool:
    """KIVI int4 KV pool: per layer an :class:`Int4Side` for K (per channel) and one for V (per token)."""

    kind = "int4"
    quantized = True

    def __init__(self, num_layers: int, num_blocks: int | list[int], block_size: int, n_kv: int, head_dim: int,
                 device: torch.device, float_dtype: torch.dtype, spec: object = None,
                 value_group: int | None = None, value_window: bool = False):
        """``num_blocks``: as for :class:`Int8KVPool`."""
        self.spec = spec  # the engine's KVCacheSpec (llmsys.engine.kv_cache), kept for its accounting
        nbs = _per_layer(num_blocks, num_layers)
        self.k = [Int4Side("key", nb, block_size, n_kv, head_dim, device, float_dtype) for nb in nbs]
        self.v = [Int4Side("value", nb, block_size, n_kv, head_dim, device, float_dtype, value_group,
                           window=value_window) for nb in nbs]

    def store(self, layer: int, k: torch.Tensor, v: torch.Tensor, slots: torch.Tensor) -> None:
        self.k[layer].store(k, slots)
        self.v[layer].store(v, slots)

    def gather(self, layer: int, slots: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """Dequantized K and V ``[B, L, Hk, D]`` of ``layer`` at ``slots [B, L]``."""
        return self.k[layer].gather(slots, dtype), self.v[layer].gather(slots, dtype)

    def nbytes(self) -> int:
        """Bytes held now, the full-precision open-block window included."""
        return sum(s.nbytes() for s in self.k + self.v)

    def block_tensors(self):
        raise ValueError("an int4 KV pool has no plain block tensors (no swap space or cold tier)")


def int4_bytes_per_token(n_kv: int, head_dim: int, block_size: int, value_group: int | None = None) -> float:
    """K+V bytes per token per layer of the int4 pool (codes + fp16 stats; window excluded)."""
    g = value_group or head_dim
    codes = 2 * n_kv * head_dim // 2
    key_stats = 2 * 2 * n_kv * head_dim / block_size
    value_stats = 2 * 2 * n_kv * (head_dim // g)
    return codes + key_stats + value_stats


def kv_layer_bytes_per_token(n_kv: int, head_dim: int, dtype: torch.dtype, kv_dtype: str = "auto",
                             block_size: int = 16) -> float:
    """K+V bytes of one token in one layer, in the pool ``kv_dtype`` names: the one formula the engine's
    pool (``KVCacheSpec``) and the offload planner both use, so a plan sizes the pool the engine makes.
    ``"auto"``: ``dtype`` elements; ``"int8"``: codes + one f32 scale per (token, head); ``"int4"``: KIVI
    codes + fp16 stats (fractional)."""
    if kv_dtype == "int8":
        return 2 * n_kv * (head_dim + 4)
    if kv_dtype == "int4":
        return int4_bytes_per_token(n_kv, head_dim, block_size)
    return 2 * n_kv * head_dim * torch.tensor([], dtype=dtype).element_size()
