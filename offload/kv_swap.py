"""Swap space for preempted sequences: their KV blocks move out, not away.

Without it a preempted sequence's blocks are freed and its context re-prefilled; with it they are copied
to pinned CPU RAM (GPU pool) or a file in the offload folder (CPU pool) and back into fresh blocks on
readmission. :meth:`KVSwapSpace.prefer_swap` picks the cheaper from measured figures (``2 x bytes /
bandwidth`` vs a prefill of every cached token). The scheduler decides (``swap_out``/``swap_in``); the
runner copies before the forward, swap-outs first. A failed write marks its blocks lost
(:meth:`KVSwapSpace.lost`: the sequence recomputes); a failed read copies what it can and raises
``KVReadError`` (``Scheduler.drop_unreadable``). Either way swap-outs stop (``write_error`` /
``read_error``, logged once) until :meth:`KVSwapSpace.retry` (``offload.recovery``) succeeds.
"""

from __future__ import annotations

import errno
import os
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from llmsys.kernels.common.errors import KVReadError
from llmsys.kernels.common.protocols import KVPool
from llmsys.offload.budgets import disk_free
from llmsys.offload.recovery import Recovery, RetryPolicy

# Priors used until the first copy is timed (then the measured speed wins).
_PRIOR_GBPS = {"cpu": 5.0, "disk": 0.5}
_EMA = 0.5  # weight of the newest measurement


@dataclass
class SwapStats:
    """Counters the memory report and the metrics endpoint show."""

    swapped_out_blocks: int = 0
    swapped_in_blocks: int = 0
    swap_outs: int = 0  # preemptions that swapped out (lost_swap_outs of them could not be written)
    recomputes: int = 0  # preemptions that dropped the KV (recompute later)
    lost_swap_outs: int = 0  # swap-outs whose write failed: their sequences recomputed instead
    lost_swap_in_blocks: int = 0  # blocks whose read failed: their sequences recomputed instead
    bytes_moved: int = 0
    seconds: float = 0.0


class KVSwapSpace:
    """A second, slower home for whole KV blocks of preempted sequences.

    Layout: swap block ``j`` holds every layer's K and V of one pool block,
    ``[num_layers, 2, block_size, Hk, D]`` contiguous (``chunk_bytes``), so one
    pool block is one write and one read. Only full-precision pools swap
    (quantized pools keep their scales in side objects; they recompute).
    """

    def __init__(self, kv: KVPool, num_blocks: int, folder: str | Path | None = None, tier: str | None = None,
                 retry: RetryPolicy | None = None):
        if tier not in (None, "cpu", "disk"):
            raise ValueError(f"swap tier must be 'cpu' or 'disk', got {tier!r}")
        self.kv = kv
        self.num_blocks = num_blocks
        self._tier = tier  # None: follow the pool (see `tier`)
        self._block_shape = _block_shape(kv)
        self.chunk_bytes = _chunk_bytes(kv)
        self._free = list(range(num_blocks - 1, -1, -1))
        self._pending_free: list[int] = []  # freed by a swap-in scheduled this step (copied in the runner)
        self._lost: set[int] = set()  # allocated swap blocks whose copy-out failed (their data is not there)
        self.write_error: str | None = None  # the last failed write while swapping is off (None once back)
        self.read_error: str | None = None  # the last failed read while swapping is off (None once back)
        self.stats = SwapStats()
        self.gbps: float | None = None  # measured copy speed (None: the tier's prior)
        self.recompute_s_per_token: float | None = None  # fed back by the engine core
        self._store: torch.Tensor | None = None  # cpu tier: [num_blocks, L, 2, bs, Hk, D]
        self._fd: int | None = None  # disk tier: one file, opened on first use
        self._path: Path | None = None
        self._folder = Path(folder) if folder else None
        where = f"--offload-dir {self._folder or tempfile.gettempdir()}"
        self.recovery = Recovery(f"KV swap space (--swap-space, in {where})",
                                 "preempted sequences recompute instead of swapping", retry)

    @property
    def tier(self) -> str:
        """Where swapped blocks go: CPU RAM for a pool with GPU layers, else disk.

        Read from the pool each time: the offload runtime may move layers' KV
        after the engine (and this object) is built.
        """
        if self._tier is not None:
            return self._tier
        return "cpu" if any(t.is_cuda for t in self.kv.block_tensors()[0]) else "disk"

    # -- bookkeeping (scheduler side, no tensors) --------------------------------
    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_used(self) -> int:
        return self.num_blocks - len(self._free) - len(self._pending_free)

    def nbytes(self) -> int:
        return self.num_blocks * self.chunk_bytes

    def used_bytes(self) -> int:
        return self.num_used * self.chunk_bytes

    def allocate(self, n: int) -> list[int] | None:
        if n > len(self._free):
            return None
        return [self._free.pop() for _ in range(n)]

    def release(self, ids: list[int]) -> None:
        """Free swap blocks whose data is copied in this step (reusable from the next step)."""
        self._pending_free.extend(ids)

    def end_step(self) -> None:
        self._lost.difference_update(self._pending_free)
        self._free.extend(reversed(self._pending_free))
        self._pending_free = []

    def lost(self, ids: list[int]) -> bool:
        """Did the copy-out of any of these swap blocks fail (so the sequence must recompute)?"""
        return bool(self._lost) and not self._lost.isdisjoint(ids)

    def swap_seconds(self, num_blocks: int) -> float:
        gbps = self.gbps if self.gbps is not None else _PRIOR_GBPS[self.tier]
        return 2 * num_blocks * self.chunk_bytes / (gbps * 1e9)

    def prefer_swap(self, num_blocks: int, num_tokens: int) -> bool:
        """Swap (True) or recompute (False) a sequence holding ``num_tokens`` in ``num_blocks``?"""
        if num_blocks == 0 or num_blocks > len(self._free) or self.recovery.off:
            return False
        if self.recompute_s_per_token is None:
            return True  # nothing measured yet: keeping computed work is the safe bet
        return self.swap_seconds(num_blocks) < num_tokens * self.recompute_s_per_token

    def observe_prefill(self, seconds: float, tokens: int) -> None:
        """Feed back one step that prefilled ``tokens`` tokens in ``seconds``."""
        if tokens <= 0 or seconds <= 0:
            return
        x = seconds / tokens
        r = self.recompute_s_per_token
        self.recompute_s_per_token = x if r is None else (1 - _EMA) * r + _EMA * x

    # -- data movement (runner side) ---------------------------------------------
    def _gather(self, blocks: list[int]) -> torch.Tensor:  # [n, L, 2, bs, Hk, D] in CPU RAM
        idx = torch.tensor(blocks, dtype=torch.long)
        per_layer = []  # L x [n, 2, bs, Hk, D]; layers may live on different devices
        for k, v in zip(*self.kv.block_tensors()):
            i = idx.to(k.device)
            per_layer.append(torch.stack([k.index_select(0, i), v.index_select(0, i)], dim=1).cpu())
        return torch.stack(per_layer, dim=1)

    def _scatter(self, blocks: list[int], data: torch.Tensor) -> None:  # data [n, L, 2, bs, Hk, D] in CPU RAM
        idx = torch.tensor(blocks, dtype=torch.long)
        for layer, (k, v) in enumerate(zip(*self.kv.block_tensors())):
            i = idx.to(k.device)
            k.index_copy_(0, i, data[:, layer, 0].to(k.device, non_blocking=True))
            v.index_copy_(0, i, data[:, layer, 1].to(v.device, non_blocking=True))

    def _ensure_store(self) -> None:
        if self.tier == "cpu" and self._store is None:
            pin = torch.cuda.is_available()
            self._store = torch.empty((self.num_blocks, *self._block_shape), dtype=self.kv.spec.dtype, pin_memory=pin)
        if self.tier == "disk" and self._fd is None:
            folder = self._folder or Path(tempfile.gettempdir())
            folder.mkdir(parents=True, exist_ok=True)
            fd, name = tempfile.mkstemp(prefix="llmsys-kv-swap-", suffix=".bin", dir=folder)
            os.ftruncate(fd, self.nbytes())  # sparse: disk is used only by blocks actually written
            self._fd, self._path = fd, Path(name)
            os.unlink(name)  # the open fd keeps it; nothing is left behind if the process dies

    def copy_out(self, pairs: list[tuple[int, int]]) -> None:
        """Pool block -> swap block, for every layer.

        A failed write (disk full, I/O error) is not raised: the blocks not
        written are marked lost (their sequences recompute, see the module
        doc) and ``write_error`` says why.
        """
        if not pairs:
            return
        t0 = time.perf_counter()
        done = 0
        try:
            self._ensure_store()
            data = self._gather([p for p, _ in pairs])  # [n, L, 2, bs, Hk, D]
            if self.tier == "cpu":
                self._store.index_copy_(0, torch.tensor([s for _, s in pairs]), data)
                done = len(pairs)
            else:
                raw = data.view(torch.uint8).numpy().reshape(len(pairs), self.chunk_bytes)
                for i, (_, s) in enumerate(pairs):
                    write_block(self._fd, raw[i], s * self.chunk_bytes)
                    done = i + 1
        except OSError as e:
            self._lost.update(s for _, s in pairs[done:])
            self.write_error = f"{self._path or self._folder or 'swap space'}: {e.strerror or e}"
            self.recovery.failed("write", self.write_error)
        if done:
            self._account(done, time.perf_counter() - t0, out=True)

    def copy_in(self, pairs: list[tuple[int, int]]) -> None:
        """Swap block -> pool block, for every layer.

        A block that cannot be read is skipped (the others are copied in), then
        :class:`KVReadError` names the pool blocks left without their data.
        """
        if not pairs:
            return
        t0 = time.perf_counter()
        failed: list[int] = []  # pool blocks
        if self.tier == "cpu":
            data = self._store.index_select(0, torch.tensor([s for s, _ in pairs]))
        else:
            data = torch.empty((len(pairs), *self._block_shape), dtype=self.kv.spec.dtype)
            raw = data.view(torch.uint8).numpy().reshape(len(pairs), self.chunk_bytes)
            for i, (s, p) in enumerate(pairs):
                try:
                    read_block(self._fd, raw[i], s * self.chunk_bytes, s)
                except OSError as e:
                    failed.append(p)
                    self.read_error = f"{self._path}: {e.strerror or e}"
        if failed:
            bad = set(failed)
            keep = [i for i, (_, p) in enumerate(pairs) if p not in bad]
            pairs, data = [pairs[i] for i in keep], data[keep]
            self.stats.lost_swap_in_blocks += len(failed)
        if pairs:
            self._scatter([p for _, p in pairs], data)
            self._account(len(pairs), time.perf_counter() - t0, out=False)
        if failed:
            self.recovery.failed("read", self.read_error)
            raise KVReadError(f"KV swap file {self.read_error}", failed)

    def retry(self) -> bool:
        """Off and the backoff ran out: write one probe block past the file's end (cut off again);
        True when swap-outs are back. A CPU-RAM swap space has nothing to probe: it is back at once."""
        if not self.recovery.due():
            return not self.recovery.off
        try:
            self._ensure_store()
            if self._fd is not None:
                try:
                    write_block(self._fd, os.urandom(self.chunk_bytes), self.nbytes())
                finally:
                    os.ftruncate(self._fd, self.nbytes())
        except OSError as e:
            self.write_error = f"{self._path or self._folder or 'swap space'}: {e.strerror or e}"
            self.recovery.failed("write", self.write_error)
            return False
        self.write_error = self.read_error = None
        self.recovery.succeeded()
        return True

    def _account(self, n: int, seconds: float, out: bool) -> None:
        nbytes = n * self.chunk_bytes
        st = self.stats
        st.bytes_moved += nbytes
        st.seconds += seconds
        if out:
            st.swapped_out_blocks += n
        else:
            st.swapped_in_blocks += n
        if seconds > 0:
            gbps = nbytes / seconds / 1e9
            self.gbps = gbps if self.gbps is None else (1 - _EMA) * self.gbps + _EMA * gbps

    def close(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None
        self._store = None


def write_block(fd: int, data, offset: int) -> None:
    """Write all of ``data`` at ``offset``; a short write (the disk filled up mid-block) is ENOSPC."""
    n = os.pwrite(fd, data, offset)
    if n < len(data):
        raise OSError(errno.ENOSPC, f"short write ({n} of {len(data)} bytes)")


def read_block(fd: int, buf, offset: int, block: int) -> None:
    """Fill ``buf`` with swap block ``block`` (at ``offset``); a short read (the file ends early, a failing
    disk) is EIO naming the block."""
    n = os.preadv(fd, [buf], offset)
    if n < len(buf):
        raise OSError(errno.EIO, f"short read of block {block} ({n} of {len(buf)} bytes)")


def _block_shape(kv: KVPool) -> tuple[int, ...]:
    s = kv.spec
    return (s.num_layers, 2, s.block_size, s.num_kv_heads, s.head_dim)


def _chunk_bytes(kv: KVPool) -> int:
    """Bytes of one swap block: every layer's K and V of one pool block."""
    return int(torch.Size(_block_shape(kv)).numel()) * torch.tensor([], dtype=kv.spec.dtype).element_size()


def make_swap_space(kv: KVPool, swap_bytes: int | None, offload_dir: str | None) -> KVSwapSpace | None:
    """The engine's swap space, or None (swap disabled, or a pool that cannot swap).

    ``swap_bytes`` None means auto: room for as many blocks as the pool has,
    capped at 4 GiB and, for a file, at half the free space of its disk (an
    explicit size was checked against that space at start-up,
    ``engine.builder.check_kv_room``). The tier follows the pool: a GPU pool
    swaps to CPU RAM, a CPU pool to a (sparse, unlinked) file in
    ``offload_dir`` or the temp dir.
    """
    if swap_bytes == 0 or kv.quantized:
        return None
    chunk = _chunk_bytes(kv)
    if swap_bytes is None:
        swap_bytes = min(kv.spec.num_blocks * chunk, 4 << 30)
        if not any(t.is_cuda for t in kv.block_tensors()[0]):
            swap_bytes = min(swap_bytes, disk_free(Path(offload_dir or tempfile.gettempdir())) // 2)
    n = swap_bytes // chunk
    if n < 1:
        return None
    return KVSwapSpace(kv, n, offload_dir)
