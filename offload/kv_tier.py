"""Live KV offload (``--kv-offload-tokens N``): a cold tier for the KV blocks of running sequences.

The pool's blocks are hot; ``C = ceil(N / block_size)`` cold ids ``first .. first + C - 1`` (``first`` =
the pool's block count) share the block tables. Out of hot blocks, the scheduler demotes full hot blocks
(oldest first) before preempting and the runner copies them here; new tokens always land hot, so a cold
block is written once. Cold blocks live in an unlinked sparse file, ``[layer][K|V][cold block][block_size,
Hk, D]`` (a run is two ``preadv``), or in pinned RAM for a GPU pool. A step's cold blocks are read one
layer ahead into two staging buffers (:meth:`KVTier.rows`; under ``INLINE_READ_BYTES`` inline) and the
gather copies them over the cold positions: attention gets exactly an all-hot pool's K/V. A failed write
keeps its blocks in RAM (``_spill``); a failed read raises ``KVReadError`` and only their holders
re-prefill. Either way demotions stop (:attr:`KVTier.accepts_demotions`: the scheduler preempts) until
:meth:`KVTier.retry` succeeds (``offload.recovery``), so a freed disk serves again without a restart.
"""

from __future__ import annotations

import errno
import math
import os
import tempfile
import time
import weakref
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import torch

from llmsys.kernels.common.errors import InvalidParameterError, KVReadError
from llmsys.kernels.common.protocols import KVPool
from llmsys.kernels import ColdBlocks
from llmsys.offload.recovery import Recovery, RetryPolicy
from llmsys.offload.streamer import pread_full

# A layer's read smaller than this is done inline when attention asks for it: handing it to the
# reader thread and back (two wake-ups, the GIL) costs more than copying it from the page cache.
INLINE_READ_BYTES = 256 << 10


@dataclass
class KVTierStats:
    """Counters the memory report, the benchmark and the tests read."""

    demoted_blocks: int = 0  # blocks moved hot -> cold (all layers each)
    spilled_blocks: int = 0  # demoted blocks kept in RAM because their write failed
    lost_blocks: int = 0  # cold blocks whose read failed: their sequences recomputed
    bytes_written: int = 0
    write_s: float = 0.0
    blocks_read: int = 0  # (layer, block) pairs read back for attention
    bytes_read: int = 0
    read_s: float = 0.0  # time inside the reads (reader thread or main thread)
    wait_s: float = 0.0  # compute thread time blocked on a layer's read
    steps: int = 0  # steps that read cold blocks


def _runs(ids: list[int]) -> list[tuple[int, int, int]]:
    """``(first staged index, first id, count)`` of each run of consecutive ids."""
    out: list[tuple[int, int, int]] = []
    for j, c in enumerate(ids):
        if out and out[-1][1] + out[-1][2] == c:
            j0, c0, m = out[-1]
            out[-1] = (j0, c0, m + 1)
        else:
            out.append((j, c, 1))
    return out


class KVTier:
    """Cold KV blocks beyond the pool (see the module doc)."""

    def __init__(self, kv: KVPool, num_cold: int, folder: str | Path | None = None, tier: str | None = None,
                 drop_cache: bool = False, retry: RetryPolicy | None = None):
        if kv.quantized:
            raise InvalidParameterError(
                f"--kv-offload-tokens needs a float KV pool; drop --kv-dtype {kv.spec.kv_dtype} or the offload")
        if num_cold < 1:
            raise ValueError("a KV tier needs at least one cold block")
        if tier not in (None, "cpu", "disk"):
            raise ValueError(f"KV tier must be 'cpu' or 'disk', got {tier!r}")
        s = kv.spec
        self.kv = kv
        self.first = s.num_blocks
        self.num_cold = num_cold
        self.num_layers = s.num_layers
        self.block_size = s.block_size
        self.device = kv.block_tensors()[0][0].device
        self.cuda = self.device.type == "cuda"
        self.tier = tier or ("cpu" if self.cuda else "disk")
        self.drop_cache = drop_cache
        shape = (2, num_cold, s.block_size, s.num_kv_heads, s.head_dim)  # K | V of every cold block, one layer
        self.side_bytes = s.block_size * s.num_kv_heads * s.head_dim * kv.block_tensors()[0][0].element_size()  # K (or V) of one block
        self.layer_block_bytes = 2 * self.side_bytes  # K + V of one block in one layer
        self.block_bytes = self.layer_block_bytes * s.num_layers  # one cold block, every layer
        self.stats = KVTierStats()
        pin = torch.cuda.is_available()
        # Two staging buffers on the pool's device: layer i computes from one while i+1 is read into the other.
        self._stage = [torch.empty(shape, dtype=s.dtype, device=self.device) for _ in range(2)]
        self._flat = [(b[0].view(-1, *shape[3:]), b[1].view(-1, *shape[3:])) for b in self._stage]
        self._store: torch.Tensor | None = None  # cpu tier: [L, 2, C, bs, Hk, D]
        self._bounce: list[torch.Tensor] = []  # GPU pool: pinned host copies of the staged blocks
        self._events: list = [None, None]
        self._stream = None
        self._fd: int | None = None
        self._path: Path | None = None
        # Cold blocks whose write failed: cold id -> [L, 2, bs, Hk, D] on the CPU (see the module doc).
        self._spill: dict[int, torch.Tensor] = {}
        self.write_error: str | None = None  # the last failed write while the tier is off (None once back)
        self.read_error: str | None = None  # the last failed read while the tier is off (None once back)
        self._folder = Path(folder) if folder else Path(tempfile.gettempdir())
        where = f"in --offload-dir {self._folder}" if self.tier == "disk" else "in CPU RAM"
        self.recovery = Recovery(f"KV cold tier (--kv-offload-tokens, {where})",
                                 "it takes no more blocks: the scheduler preempts and recomputes instead", retry)
        if self.tier == "cpu":
            self._store = torch.empty((s.num_layers, *shape), dtype=s.dtype, pin_memory=pin)
            if self.cuda:  # written for GPU pools, untested here (no GPU): see offload/README.md
                self._bounce = [torch.empty_like(self._stage[0], device="cpu", pin_memory=True) for _ in range(2)]
                self._stream = torch.cuda.Stream(self.device)
        else:
            if self.cuda:
                raise ValueError("a GPU pool's cold tier is pinned CPU RAM (tier 'cpu')")
            self._open(self._folder)
            self._views = [[memoryview(b[kind].view(-1).view(torch.uint8).numpy()) for kind in (0, 1)] for b in self._stage]
        # One reader thread for CPU pools (preadv / index_select release the GIL); GPU pools copy on a side stream.
        self._pool = None if self.cuda else ThreadPoolExecutor(1, thread_name_prefix="llmsys-kv-tier")
        if self._pool is not None:
            weakref.finalize(self, self._pool.shutdown, False)
        # Per step (cold_blocks / begin_step): the staged ids and where each layer's read stands.
        self._ids: list[int] = []
        self._idx: torch.Tensor | None = None  # ids - first (cpu tier)
        self._runs: list[tuple[int, int, int]] = []
        self._layer_of: dict[int, tuple[int, int]] = {}  # pool tensor data_ptr -> (layer, 0 = K / 1 = V)
        self._futs: dict[int, Future | None] = {}
        self._cur = -1
        self._prefetch = True

    # -- accounting ---------------------------------------------------------------
    def nbytes(self) -> int:
        return self.num_cold * self.block_bytes

    def staging_bytes(self) -> int:
        """Staging buffers (every cold block, two layers' worth: ``2 / num_layers`` of the tier, allocated once,
        untouched pages free), plus blocks kept in RAM after a failed write.
        """
        spill = sum(t.numel() * t.element_size() for t in self._spill.values())
        return sum(b.numel() * b.element_size() for b in self._stage + self._bounce) + spill

    @property
    def accepts_demotions(self) -> bool:
        """False while the tier is off after a failed write or read (until :meth:`retry` brings it back):
        the scheduler preempts instead of demoting (module doc)."""
        return not self.recovery.off

    @property
    def failure(self) -> str | None:
        """Why the tier stopped taking demotions, for a user-facing message (None: it still takes them)."""
        o = self.recovery.outage
        if o is None:
            return None
        what = f"a write failed ({self.write_error})" if self.write_error is not None else \
            f"a read failed ({self.read_error})" if self.read_error is not None else o.reason
        left = o.retry_at - self.recovery.clock()
        return f"{what}; it retries in {math.ceil(left)} s" if left > 0 else f"{what}; it retries now"

    def retry(self) -> bool:
        """Off and the backoff ran out: try a write again; True when the tier takes demotions again.

        The blocks a failed write left in RAM go to the file (they are the probe, and the RAM comes
        back); with none, one block's bytes are written past the file's end and cut off again.
        """
        if not self.recovery.due():
            return not self.recovery.off
        try:
            if self._fd is not None:
                self._flush_spill()
        except OSError as e:
            self.write_error = f"{self._path}: {e.strerror or e}"
            self.recovery.failed("write", self.write_error)
            return False
        self.write_error = self.read_error = None
        self.recovery.succeeded()
        return True

    def _flush_spill(self) -> None:
        """Blocks kept in RAM after a failed write into the file (each popped once written), else a probe."""
        if not self._spill:
            probe = memoryview(os.urandom(self.side_bytes))
            try:
                write_at(self._fd, probe, self.nbytes())
            finally:
                os.ftruncate(self._fd, self.nbytes())
            return
        for c in sorted(self._spill):
            data = self._spill[c]  # [L, 2, bs, Hk, D]
            for layer in range(self.num_layers):
                for kind in (0, 1):
                    raw = memoryview(data[layer, kind].contiguous().view(-1).view(torch.uint8).numpy())
                    write_at(self._fd, raw, self._offset(layer, kind, c))
            del self._spill[c]

    # -- the file -----------------------------------------------------------------
    def _open(self, folder: Path) -> None:
        try:
            folder.mkdir(parents=True, exist_ok=True)
            fd, name = tempfile.mkstemp(prefix="llmsys-kv-tier-", suffix=".bin", dir=folder)
        except OSError as e:
            raise InvalidParameterError(
                f"offload folder {folder}: cannot create the KV offload file there ({e.strerror}); "
                "pass --offload-dir with a writable folder, or --kv-offload-tokens 0"
            ) from None
        os.unlink(name)  # the open fd keeps it; nothing is left behind if the process dies
        os.ftruncate(fd, self.nbytes())  # sparse: disk is used only by blocks actually written
        self._fd, self._path = fd, Path(name)
        self._close_fd = weakref.finalize(self, os.close, fd)  # also when the engine is dropped unclosed

    def _offset(self, layer: int, kind: int, cold: int) -> int:
        """File offset of cold block ``cold``'s keys (kind 0) or values (kind 1) in ``layer``."""
        return ((2 * layer + kind) * self.num_cold + cold - self.first) * self.side_bytes

    # -- demotion (runner, before the forward pass) -----------------------------------
    def demote(self, pairs: list[tuple[int, int]]) -> None:
        """Copy pool blocks to cold blocks, every layer; a cold id listed twice keeps its last source.

        A failed file write is not raised: these blocks are kept in RAM instead
        and the tier takes no more demotions (see the module doc).
        """
        if not pairs:
            return
        t0 = time.perf_counter()
        last = {c: h for h, c in pairs}  # a cold block freed and reused within the step: the later write wins
        cold = sorted(last)
        hot = torch.tensor([last[c] for c in cold], dtype=torch.long, device=self.device)
        idx = torch.tensor(cold, dtype=torch.long) - self.first
        try:
            self._write(hot, cold, idx)
        except OSError as e:
            self._keep_in_ram(hot, cold)
            self.write_error = f"{self._path}: {e.strerror or e}"
            self.recovery.failed("write", self.write_error)
        else:
            for c in cold if self._spill else ():
                self._spill.pop(c, None)  # written now: the file has the newer data
        st = self.stats
        st.demoted_blocks += len(cold)
        st.bytes_written += len(cold) * self.block_bytes
        st.write_s += time.perf_counter() - t0

    def _write(self, hot: torch.Tensor, cold: list[int], idx: torch.Tensor) -> None:
        """Every layer's K and V of pool blocks ``hot`` into cold blocks ``cold`` (sorted; ``idx`` = cold - first)."""
        runs = _runs(cold)
        for layer, (k, v) in enumerate(zip(*self.kv.block_tensors())):
            for kind, side in enumerate((k, v)):
                data = side.index_select(0, hot)  # [n, bs, Hk, D]
                if self._store is not None:
                    self._store[layer, kind].index_copy_(0, idx, data.cpu())
                    continue
                raw, sb = memoryview(data.view(-1).view(torch.uint8).numpy()), self.side_bytes
                for j0, c0, m in runs:
                    write_at(self._fd, raw[j0 * sb : (j0 + m) * sb], self._offset(layer, kind, c0))
        if self._fd is not None and self.drop_cache:  # benchmarks: later reads must come from the device
            os.fdatasync(self._fd)
            os.posix_fadvise(self._fd, 0, 0, os.POSIX_FADV_DONTNEED)

    def _keep_in_ram(self, hot: torch.Tensor, cold: list[int]) -> None:
        """A write failed: keep these blocks (still intact in the pool: nothing is computed before the
        forward pass) in RAM, ``[L, 2, bs, Hk, D]`` per cold id, where :meth:`_read` finds them."""
        ks, vs = self.kv.block_tensors()
        data = torch.stack([torch.stack([k.index_select(0, hot), v.index_select(0, hot)], dim=1).cpu()
                            for k, v in zip(ks, vs)], dim=1)  # [n, L, 2, bs, Hk, D]
        for j, c in enumerate(cold):
            self._spill[c] = data[j].clone()
        self.stats.spilled_blocks += len(cold)

    # -- reads (runner / attention) ----------------------------------------------------
    def cold_blocks(self, ids: list[int]) -> ColdBlocks:
        """Fix this step's cold blocks (sorted ids); the plan's view of them."""
        self._ids = ids
        self._runs = _runs(ids)
        self._idx = torch.tensor(ids, dtype=torch.long) - self.first
        ks, vs = self.kv.block_tensors()
        self._layer_of = {t.data_ptr(): (i, 0) for i, t in enumerate(ks)}
        self._layer_of.update({t.data_ptr(): (i, 1) for i, t in enumerate(vs)})
        self._futs = {}
        self._cur = -1
        return ColdBlocks(self.first, torch.tensor(ids, dtype=torch.int64), self, self.block_size)

    def begin_step(self, prefetch: bool = True) -> None:
        """Start reading layer 0 (``prefetch=False``: layers are read when asked, one at a time)."""
        self._prefetch = prefetch
        self.stats.steps += 1
        if prefetch:
            self._submit(0)

    def _submit(self, layer: int) -> None:
        if layer in self._futs:
            return
        buf = layer % 2
        if self._pool is not None and len(self._ids) * self.layer_block_bytes >= INLINE_READ_BYTES:
            self._futs[layer] = self._pool.submit(self._read, layer, buf, self._ids, self._runs, self._idx)
        else:
            self._read(layer, buf, self._ids, self._runs, self._idx)
            self._futs[layer] = None

    def _read(self, layer: int, buf: int, ids: list[int], runs: list[tuple[int, int, int]], idx: torch.Tensor) -> None:
        """Layer ``layer``'s K|V of ``ids`` into staging buffer ``buf`` (staged block j = ids[j])."""
        t0 = time.perf_counter()
        n = len(ids)
        if self._fd is not None:
            sb = self.side_bytes
            for kind in (0, 1):
                view = self._views[buf][kind]
                for j0, c0, m in runs:
                    off, dst = self._offset(layer, kind, c0), view[j0 * sb : (j0 + m) * sb]
                    try:
                        got = pread_full(self._fd, [dst], off)
                    except OSError as e:
                        self._lost(list(range(c0, c0 + m)), f"{e.strerror or e} reading layer {layer} blocks "
                                                            f"{c0}..{c0 + m - 1}")
                    if got < len(dst):
                        self._lost(list(range(c0, c0 + m)), f"short read of layer {layer} block {c0} "
                                                            f"({got} of {len(dst)} bytes)")
                    if self.drop_cache:
                        os.posix_fadvise(self._fd, off, m * sb, os.POSIX_FADV_DONTNEED)
            if self._spill:  # blocks a failed write left in RAM: the file does not have them
                for j, c in enumerate(ids):
                    if c in self._spill:
                        self._stage[buf][:, j].copy_(self._spill[c][layer])
        elif not self.cuda:
            for kind in (0, 1):
                torch.index_select(self._store[layer, kind], 0, idx, out=self._stage[buf][kind, :n])
        else:  # GPU pool (untested here): host gather into pinned memory, then an async copy on a side stream
            ev = self._events[buf]
            if ev is not None:
                ev.synchronize()  # the previous copy out of this bounce buffer is done
            for kind in (0, 1):
                torch.index_select(self._store[layer, kind], 0, idx, out=self._bounce[buf][kind, :n])
            self._stream.wait_stream(torch.cuda.current_stream(self.device))  # layer i-2 no longer reads the stage
            with torch.cuda.stream(self._stream):
                self._stage[buf][:, :n].copy_(self._bounce[buf][:, :n], non_blocking=True)
                ev = self._events[buf] = torch.cuda.Event()
                ev.record(self._stream)
        st = self.stats
        st.read_s += time.perf_counter() - t0
        st.blocks_read += n
        st.bytes_read += n * self.layer_block_bytes

    def _lost(self, cold: list[int], why: str) -> None:
        """A read of ``cold`` failed: no more demotions, and the step learns which blocks are gone."""
        self.read_error = f"{self._path}: {why}"
        self.recovery.failed("read", self.read_error)
        self.stats.lost_blocks += len(cold)
        raise KVReadError(f"KV offload file {self.read_error}", cold) from None

    def _wait(self, layer: int) -> None:
        self._submit(layer)
        fut, self._futs[layer] = self._futs[layer], None  # consumed: end_step does not wait on it again
        if fut is not None:
            t0 = time.perf_counter()
            fut.result()
            self.stats.wait_s += time.perf_counter() - t0
        if self.cuda:
            torch.cuda.current_stream(self.device).wait_event(self._events[layer % 2])

    def rows(self, cache: torch.Tensor) -> torch.Tensor:
        """Staged rows of ``cache``'s layer (K or V): staged block j's offset o is row ``j * bs + o``.

        The first call for a layer waits for its read and starts the next
        layer's into the other buffer (whose previous layer is done).
        """
        layer, kind = self._layer_of[cache.data_ptr()]
        if layer != self._cur:
            self._wait(layer)
            self._cur = layer
            if self._prefetch and layer + 1 < self.num_layers:
                self._submit(layer + 1)
        return self._flat[layer % 2][kind]

    def read(self, cache: torch.Tensor, ids: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        """Synchronously read just ``ids`` (sorted cold ids) of ``cache``'s layer: (K rows, V rows).

        Rows as in :meth:`rows` (block j of ``ids`` at ``j * bs + o``).
        For Quest decode, whose selection needs the layer's query; the step
        was begun without prefetch, so both buffers are idle.
        """
        layer, _ = self._layer_of[cache.data_ptr()]
        self._drain()
        idx = torch.tensor(ids, dtype=torch.long) - self.first
        t0 = time.perf_counter()
        self._read(layer, 0, ids, _runs(ids), idx)
        if self.cuda:
            torch.cuda.current_stream(self.device).wait_event(self._events[0])
        self.stats.wait_s += time.perf_counter() - t0
        return self._flat[0]

    def _drain(self) -> None:
        for fut in self._futs.values():
            if fut is not None:
                fut.exception()  # wait; a read nobody waited for (the step failed first) has no one to tell
        self._futs = {}
        self._cur = -1

    def end_step(self) -> None:
        """No read may still be writing a buffer when the next step begins."""
        self._drain()

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True)
            self._pool = None
        if self._fd is not None:
            self._close_fd()
            self._fd = None
        self._store = None


def write_at(fd: int, data: memoryview, offset: int) -> None:
    """Write all of ``data`` at ``offset``; a short write (the disk filled up mid-run) is ENOSPC."""
    n = os.pwritev(fd, [data], offset)
    if n < len(data):
        raise OSError(errno.ENOSPC, f"short write ({n} of {len(data)} bytes)")


def make_kv_tier(kv: KVPool, tokens: int, folder: str | None, tier: str | None = None,
                 drop_cache: bool = False, retry: RetryPolicy | None = None) -> KVTier | None:
    """The engine's cold tier for ``tokens`` tokens of KV, or None (0: ``--kv-offload-tokens``' default)."""
    if tokens <= 0:
        return None
    return KVTier(kv, -(-tokens // kv.spec.block_size), folder, tier, drop_cache, retry)
