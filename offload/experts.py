"""Experts of sparse (MoE) layers kept off the layer's device: on disk, read on demand into a RAM cache, or
resident in CPU RAM beside a GPU layer (``--cpu-moe``).

Why on demand: a token of an MoE model uses ``k`` of ``E`` experts per layer (Qwen3-30B-A3B: 8 of 128),
so streaming a sparse layer whole reads ``E / k`` times the bytes the step computes. The non-expert
weights (attention, norms, router, shared expert) stay resident; the router runs first, and only the
experts its tokens chose are read (:class:`DiskExperts`), with ``preadv`` into fixed slots of an
:class:`ExpertCache` (no mmap: pages read do not stay resident, the read pages are dropped from the page
cache, so RSS is the budget's resident weights plus the cache's slots).

Why frequency-based (``"lfu"``, the default) and not LRU: a decode step sweeps every sparse layer in
order, so an expert used at one step is reused at the earliest one step later, after a whole step's
``layers x k`` other experts. Once that exceeds the cache, LRU has evicted it every time (a loop larger
than the cache: 0 hits where LFU got 24%, tests/test_moe.py's tiny model at a fifth of its experts
cached). Evicting the expert routed to least often so far keeps a stable set: with uniform routing about
``capacity / expert bytes`` of uses hit (the planner's estimate, ``offload.plan.ExpertPlan``), with a
skewed router the popular experts stay. Measured (docs/benchmarks.md, script ``moe``: 6 Qwen3-30B-A3B
layers, a 25% cache): uniform routing 23.2% LFU vs 23.0% LRU, a Zipf-like router 69% vs 53%; LRU wins
where popularity drifts (98% vs 89% when the greedy phase counted other experts than the sampled one
uses). So the counts age: every ``AGE_USES_PER_SLOT`` routing uses per cache slot they are all halved,
so an expert popular long ago yields its slot to one popular now within about that many uses, while a
stable popularity keeps its order (halving every count keeps their ranks up to rounding).
``placement={"expert_policy": "lru"}`` picks LRU.

Overlap: the experts already cached run first while reader threads read the missing ones, up to
``READ_DEPTH`` at a time, each into its own slot; each read overlaps the compute of the experts before
it. The order experts run in does not change any bit: each ``(token, slot)`` row is written once and a
token's rows are summed in slot order (``engine/models/moe.py``).
"""

from __future__ import annotations

import os
import threading
import time
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Iterator

import torch

from llmsys.offload.streamer import Binding, StreamUnit, pread_full


POLICIES = ("lru", "lfu")
# Expert reads in flight at most: one 2.8 MB preadv at a time reached 0.66 GB/s on a disk whose sequential
# probe reads 1.67 GB/s (docs/benchmarks.md, script moe); four in flight halved the time spent waiting on
# reads there (on 2 cores the reads' kernel copies then compete with compute: ~the same tok/s).
READ_DEPTH = 4
# LFU counts halve after this many routing uses per cache slot (a 25% cache of 6 Qwen3-30B-A3B layers: 192
# slots, so every ~3000 uses = ~64 decode steps of 6 x 8 experts): long enough that a stable router's ranks
# settle, short enough that a drift in popularity (a new topic, greedy vs sampled text) is followed.
AGE_USES_PER_SLOT = 16


@dataclass
class ExpertCacheStats:
    """Counters of one engine's expert cache (``OffloadRuntime.expert_report``)."""

    hits: int = 0  # expert uses found in the cache
    misses: int = 0  # expert uses read from disk
    bytes_read: int = 0
    read_s: float = 0.0  # reader time inside preadv (either thread)
    wait_s: float = 0.0  # compute thread blocked on a read
    evictions: int = 0

    @property
    def hit_rate(self) -> float:
        return self.hits / max(self.hits + self.misses, 1)


@dataclass(frozen=True)
class ExpertReport:
    """What ``memory_report`` / ``/metrics`` show of the expert placement."""

    tier: str  # where the experts live: "disk" (read on demand) | "cpu" (resident, computed on the CPU)
    layers: int  # sparse layers placed so
    expert_bytes: int  # those layers' expert bytes (on disk, or in CPU RAM)
    cache_capacity: int  # RAM expert cache slots' bytes (disk tier)
    cache_bytes: int  # bytes of slots holding an expert now
    hits: int
    misses: int
    bytes_read: int

    @property
    def hit_rate(self) -> float:
        return self.hits / max(self.hits + self.misses, 1)


@dataclass(frozen=True)
class ExpertWeights:
    """One expert's tensors: where their bytes are on disk (``unit``) and the module slots they bind into."""

    unit: StreamUnit
    bindings: tuple[Binding, ...]

    def bind(self, buf: torch.Tensor) -> None:
        for b, o, it in zip(self.bindings, self.unit.offsets, self.unit.items):
            b.bind(buf[o : o + it.src.nbytes].view(it.dtype).view(it.shape))

    def unbind(self) -> None:
        for b in self.bindings:
            b.unbind()


class ExpertCache:
    """``capacity // slot_bytes`` fixed slots of expert weights in RAM over ``(layer, expert)`` keys, evicting
    the least often routed-to (``"lfu"``) or least recently used (``"lru"``) one.

    The slots are allocated once (``torch.empty``: a page costs RAM when first written), so a step
    allocates nothing and the cache never holds more than its capacity. One reader thread reads ahead.
    """

    def __init__(self, capacity: int, slot_bytes: int, drop_cache: bool = True, policy: str = "lfu",
                 depth: int = READ_DEPTH):
        if policy not in POLICIES:
            raise ValueError(f"expert cache policy {policy!r}: one of {', '.join(POLICIES)}")
        self.policy = policy
        self.slot_bytes = slot_bytes
        n = max(1, capacity // max(slot_bytes, 1))
        self.slots = [torch.empty(slot_bytes, dtype=torch.uint8) for _ in range(n)]
        self._views = [memoryview(s.numpy()) for s in self.slots]
        self.capacity = n * slot_bytes
        self.drop_cache = drop_cache
        self.stats = ExpertCacheStats()
        self._lru: OrderedDict[tuple[int, int], int] = OrderedDict()  # (layer, expert) -> slot, oldest first
        self._uses: dict[tuple[int, int], int] = {}  # (layer, expert) -> times routed to ("lfu"), cached or not
        self._age_every = AGE_USES_PER_SLOT * n  # uses between two halvings of every count
        self._since_age = 0
        self._free = list(range(n))
        self._fds: dict[str, int] = {}
        self._fd_lock = threading.Lock()
        self.depth = depth  # reads in flight at most (each into its own slot)
        self._stats_lock = threading.Lock()
        self._reader = ThreadPoolExecutor(depth, thread_name_prefix="llmsys-expert-reader")

    @property
    def cached_bytes(self) -> int:
        return len(self._lru) * self.slot_bytes

    def _fd(self, path: str) -> int:
        with self._fd_lock:
            fd = self._fds.get(path)
            if fd is None:
                fd = self._fds[path] = os.open(path, os.O_RDONLY)
            return fd

    def _read(self, w: ExpertWeights, slot: int) -> None:
        t = time.perf_counter()
        view = self._views[slot]
        for path, off, iov in w.unit.reads:
            fd = self._fd(path)
            total = sum(n for _, n in iov)
            got = pread_full(fd, [view[b : b + n] for b, n in iov], off)
            if got < total:
                raise OSError(f"{path}: unexpected end of file at byte {off + got} while reading expert {w.unit.name}")
            if self.drop_cache:
                os.posix_fadvise(fd, off, total, os.POSIX_FADV_DONTNEED)
        with self._stats_lock:  # (reader threads and the compute thread read at once)
            self.stats.read_s += time.perf_counter() - t
            self.stats.bytes_read += w.unit.nbytes

    def _count(self, key: tuple[int, int]) -> None:
        """One more use of ``key``; every ``_age_every`` uses all counts halve (zeros dropped)."""
        self._uses[key] = self._uses.get(key, 0) + 1
        self._since_age += 1
        if self._since_age >= self._age_every:
            self._since_age = 0
            self._uses = {k: c // 2 for k, c in self._uses.items() if c > 1}

    def _take(self, layer: int, keep: set[int], busy: set[int], strict: bool) -> int | None:
        """A slot to fill: a free one, else the least recently used not in ``busy`` (being read or
        computed) nor, for ``strict``, one of ``layer``'s experts in ``keep`` (still to run this step)."""
        if self._free:
            return self._free.pop()
        for passes in ((True,) if strict else (True, False)):
            ok = [key for key, s in self._lru.items()
                  if s not in busy and not (passes and key[0] == layer and key[1] in keep)]
            if not ok:
                continue
            # "lru": the oldest use; "lfu": the expert routed to least often lately (aged counts; ties: the oldest use)
            key = ok[0] if self.policy == "lru" else min(ok, key=lambda k: self._uses.get(k, 0))
            self.stats.evictions += 1
            return self._lru.pop(key)
        if strict:
            return None
        raise RuntimeError("expert cache: every slot is busy (it needs at least one)")

    def each(self, layer: int, ids: list[int], weights: list[ExpertWeights]) -> Iterator[int]:
        """:meth:`ExpertSource.each` for one layer: cached experts first, the missing ones as they are read
        (up to ``depth`` reads in flight while the compute thread works)."""
        lru = self._lru
        order = [e for e in ids if (layer, e) in lru] + [e for e in ids if (layer, e) not in lru]
        left = set(order)
        pending: dict[int, tuple[int, Future]] = {}  # expert -> (slot, read) in flight
        try:
            for i, e in enumerate(order):
                key = (layer, e)
                self._count(key)
                if key in lru:
                    slot = lru[key]
                    lru.move_to_end(key)
                    self.stats.hits += 1
                else:
                    t = time.perf_counter()
                    if e in pending:
                        slot, fut = pending.pop(e)
                    else:
                        slot = self._take(layer, left, {s for s, _ in pending.values()}, strict=False)
                        fut = None
                    try:
                        fut.result() if fut is not None else self._read(weights[e], slot)
                    except BaseException:
                        self._free.append(slot)
                        raise
                    self.stats.wait_s += time.perf_counter() - t
                    lru[key] = slot
                    self.stats.misses += 1
                # Keep up to `depth` of the step's next missing experts reading while this one computes.
                busy = {slot} | {s for s, _ in pending.values()}
                for x in order[i + 1 :]:
                    if len(pending) >= self.depth:
                        break
                    if (layer, x) in lru or x in pending:
                        continue
                    s = self._take(layer, left - {e}, busy, strict=True)
                    if s is None:
                        break
                    busy.add(s)
                    pending[x] = (s, self._reader.submit(self._read, weights[x], s))
                w = weights[e]
                w.bind(self.slots[slot])
                try:
                    yield e
                finally:
                    w.unbind()
                left.discard(e)
        finally:
            for x, (s, fut) in pending.items():  # the consumer stopped early: let reads land, keep slots usable
                try:
                    fut.result()
                    lru[(layer, x)] = s
                except BaseException:
                    self._free.append(s)

    def close(self) -> None:
        self._reader.shutdown(wait=True)
        with self._fd_lock:
            for fd in self._fds.values():
                os.close(fd)
            self._fds.clear()
        self._lru.clear()
        self.slots = []
        self._views = []


@dataclass
class DiskExperts:
    """A sparse layer's experts on disk (``ExpertSource``): read on demand into the shared cache."""

    layer: int
    weights: list[ExpertWeights]
    cache: ExpertCache
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))

    def each(self, experts: list[int]) -> Iterator[int]:
        return self.cache.each(self.layer, experts, self.weights)


@dataclass
class ResidentExperts:
    """A sparse layer's experts resident in CPU RAM beside a layer computed elsewhere (``--cpu-moe`` on a
    CUDA engine): the routed hidden rows go to ``device`` and the weighted sum comes back, the weights
    never move. ``uses`` counts the steps that ran here (tests check the path was taken)."""

    device: torch.device
    uses: int = 0

    def each(self, experts: list[int]) -> Iterator[int]:
        self.uses += 1
        return iter(experts)
