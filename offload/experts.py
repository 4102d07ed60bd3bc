"""Experts of sparse (MoE) layers off the layer's device: on disk, read on demand into a RAM cache, or
resident in CPU RAM beside a GPU layer (``--cpu-moe``).

A token uses ``k`` of ``E`` experts a layer, so streaming a layer whole reads ``E / k`` times what it
computes: the router runs first and :class:`DiskExperts` reads only the chosen experts with ``preadv``
into :class:`ExpertCache` slots (no mmap, read pages dropped: RSS is the resident weights plus the slots).
Eviction is LFU by default: a decode step sweeps every layer, so LRU evicts everything once a step's
experts exceed the cache; counts halve every ``AGE_USES_PER_SLOT`` uses per slot, so drifting popularity
wins slots back (``placement={"expert_policy": "lru"}`` picks LRU; hit rates: docs/benchmarks.md, ``moe``).
Cached experts run while up to ``READ_DEPTH`` reads fetch the rest; the order changes no bit (each
``(token, slot)`` row is written once and summed in slot order: ``engine/models/moe.py``). Pre-gating: once a
layer has routed, the next sparse layer's router runs on the same input (the hidden state changes little over one
layer) and the experts it names are read ahead in the reads left over (``DiskExperts.prefetch_next``), so the next
layer finds them landed or in flight; the guess's hit rate and the bytes read ahead for nothing are counted.
"""

from __future__ import annotations

import os
import threading
import time
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Callable, Iterator

import torch
from torch import nn

from llmsys.offload.streamer import ALIGN, Binding, StreamUnit, TensorSource, pread_full


POLICIES = ("lru", "lfu")
# Expert reads in flight at most: one 2.8 MB preadv at a time reached 0.66 GB/s on a disk whose sequential
# probe reads 1.67 GB/s (docs/benchmarks.md, script moe); four in flight halved the time spent waiting on
# reads there (on 2 cores the reads' kernel copies then compete with compute: ~the same tok/s).
READ_DEPTH = 4
# LFU counts halve after this many routing uses per cache slot (a 25% cache of 6 Qwen3-30B-A3B layers: 192
# slots, so every ~3000 uses = ~64 decode steps of 6 x 8 experts): long enough that a stable router's ranks
# settle, short enough that a drift in popularity (a new topic, greedy vs sampled text) is followed.
AGE_USES_PER_SLOT = 16
# Experts of the next sparse layer read ahead on one guess at most (pre-gating: a decode step's guess names top_k;
# a prompt's many tokens name most experts, ranked by how many tokens picked each).
AHEAD = 16


@dataclass
class ExpertCacheStats:
    """Counters of one engine's expert cache (``OffloadRuntime.expert_report``)."""

    hits: int = 0  # expert uses found in the cache
    misses: int = 0  # expert uses read from disk
    bytes_read: int = 0
    read_s: float = 0.0  # reader time inside preadv (either thread)
    wait_s: float = 0.0  # compute thread blocked on a read
    repack_s: float = 0.0  # building run-time tensors from stored bytes (:class:`Repacked`), either thread
    evictions: int = 0
    files: dict[str, int] = field(default_factory=dict)  # bytes read per file (the checkpoint, an offload file)
    # pre-gating: the next layer's experts guessed from this layer's router input and read ahead
    guess_hits: int = 0  # experts a layer routed to that its guess named
    guess_chosen: int = 0  # experts routed to by layers that had a guess
    ahead_reads: int = 0  # experts read ahead on a guess (also in misses when routed to, in bytes_read)
    ahead_used: int = 0  # of those, routed to by the layer they were read for
    ahead_bytes: int = 0
    ahead_unused_bytes: int = 0  # read ahead, evicted without ever being routed to

    @property
    def guess_rate(self) -> float:
        return self.guess_hits / max(self.guess_chosen, 1)

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
    # pre-gating (disk tier): how often the guess of a layer's experts named the ones it routed to, and the reads ahead
    guess_hits: int = 0
    guess_chosen: int = 0
    ahead_reads: int = 0
    ahead_used: int = 0
    ahead_bytes: int = 0
    ahead_unused_bytes: int = 0  # read ahead and never routed to (evicted so, or in the cache still)

    @property
    def hit_rate(self) -> float:
        return self.hits / max(self.hits + self.misses, 1)

    @property
    def guess_rate(self) -> float:
        """Experts routed to that the pre-gating guess named, of all routed to by layers that had a guess."""
        return self.guess_hits / max(self.guess_chosen, 1)


@dataclass(frozen=True)
class StoredTensor:
    """``locate()``'s answer for a tensor whose stored bytes are not what the engine computes on (a GGUF block
    format): where they are and the loader's own way from them to the run-time form, so reading them at run time
    gives the resident load's bits. ``layer``: the quantized layer a matrix kept as codes becomes (its bias, in
    the run dtype, passed in); ``decode``: the float tensor one dequantized at load becomes. One of them is set."""

    offset: int  # absolute byte offset in the file
    nbytes: int
    shape: tuple[int, ...]  # as the model holds it ([out, in])
    layer: Callable[[torch.Tensor, "torch.Tensor | None"], nn.Module] | None = None  # (uint8 [nbytes], bias) -> layer
    decode: Callable[[torch.Tensor, torch.dtype], torch.Tensor] | None = None  # (uint8 [nbytes], dtype) -> tensor
    dtype: torch.dtype = torch.uint8  # what the file holds, as bytes
    # ``layer``'s tensors written from the stored bytes straight into place (uint8 [nbytes], {buffer name: where it
    # goes}) -> False (nothing written) where that is not the layout it writes: a loader's faster way to its bits
    fill: Callable[[torch.Tensor, dict[str, torch.Tensor]], bool] | None = None


@dataclass(frozen=True)
class SlotTensor:
    """Where one run-time tensor of a :class:`Repacked` lies in a slot, with the strides the resident module
    holds it in (Int4Linear's fp16 ``scales_orig`` is an ``[N, G]`` view of a ``[G, N]`` tensor; a stride-0
    ``zeros_u8`` costs one element): ``span`` elements from its first to its last address."""

    dtype: torch.dtype
    shape: tuple[int, ...]
    stride: tuple[int, ...]
    offset: int  # byte offset in the slot (ALIGN-aligned)
    span: int

    @staticmethod
    def span_of(t: torch.Tensor) -> int:
        if t.numel() == 0:
            return 0
        return 1 + sum((n - 1) * s for n, s in zip(t.shape, t.stride()))

    @property
    def nbytes(self) -> int:
        return self.span * torch.tensor([], dtype=self.dtype).element_size()

    def view(self, slot: torch.Tensor) -> torch.Tensor:
        flat = slot[self.offset : self.offset + self.nbytes].view(self.dtype)
        return flat.as_strided(self.shape, self.stride)

    def put(self, slot: torch.Tensor, t: torch.Tensor, what: str) -> None:
        """Copy ``t`` (the memory it addresses, so its strides hold) into the slot."""
        if (t.dtype, tuple(t.shape), tuple(t.stride())) != (self.dtype, self.shape, self.stride):
            raise RuntimeError(f"{what}: built as {t.dtype} {tuple(t.shape)} strides {tuple(t.stride())}, but the "
                               f"expert's slot holds {self.dtype} {self.shape} strides {self.stride} (its first expert's)")
        if self.span:
            src = t.as_strided((self.span,), (1,), t.storage_offset())
            slot[self.offset : self.offset + self.nbytes].view(self.dtype).copy_(src)


@dataclass(frozen=True)
class Repacked:
    """Run-time tensors an expert's slot holds that are built from stored bytes of another form: ``stored`` is read
    into a staging buffer, ``make`` (the loader's conversion, :class:`StoredTensor`) returns the tensors in
    ``tensors`` order and they are copied into the slot, each bound to its ``bindings`` entry."""

    name: str  # for messages: "layers.3.mlp.experts.5.gate_proj"
    stored: tuple[TensorSource, ...]
    make: Callable[[list[torch.Tensor]], list[torch.Tensor]]  # stored bytes (uint8 [nbytes] each) -> tensors
    tensors: tuple[SlotTensor, ...]
    bindings: tuple[Binding, ...]
    # stored bytes, each tensor's view in the slot -> True when it wrote them all there (``make``'s bits, in one pass)
    fill: Callable[[list[torch.Tensor], list[torch.Tensor]], bool] | None = None


@dataclass(frozen=True)
class ExpertWeights:
    """One expert's tensors: where their bytes are on disk and the module slots they bind into. ``unit``: tensors
    stored as the engine computes on them, read straight into the slot; ``repacked``: the rest, built from their
    stored bytes into the slot after it (:class:`Repacked`)."""

    unit: StreamUnit
    bindings: tuple[Binding, ...]
    repacked: tuple[Repacked, ...] = ()

    @property
    def nbytes(self) -> int:
        """Slot bytes this expert needs."""
        ends = [t.offset + t.nbytes for r in self.repacked for t in r.tensors]
        return max([self.unit.nbytes, *ends])

    @property
    def read_bytes(self) -> int:
        """Bytes one read of this expert takes from disk (what the file stores)."""
        return sum(it.src.nbytes for it in self.unit.items) + self.stored_bytes

    @property
    def stored_bytes(self) -> int:
        """Bytes of the repacked parts as stored."""
        return sum(s.nbytes for r in self.repacked for s in r.stored)

    @property
    def staging_bytes(self) -> int:
        """Staging bytes a read of the repacked parts needs (each part ALIGN-aligned)."""
        return sum(-(-s.nbytes // ALIGN) * ALIGN for r in self.repacked for s in r.stored)

    def views(self, buf: torch.Tensor) -> list[torch.Tensor]:
        """The tensors this expert's modules hold when its weights are in ``buf`` (a slot), in :meth:`bind_views`
        order: making them costs more than the expert's GEMVs, so the cache keeps them while the slot holds it."""
        out = [buf[o : o + it.src.nbytes].view(it.dtype).view(it.shape)
               for o, it in zip(self.unit.offsets, self.unit.items)]
        return out + [t.view(buf) for r in self.repacked for t in r.tensors]

    def bind_views(self, views: list[torch.Tensor]) -> None:
        for b, t in zip(self.bindings, views):
            b.bind(t)
        rest = views[len(self.bindings) :]
        for r in self.repacked:
            for b, t in zip(r.bindings, rest):
                b.bind(t)
            rest = rest[len(r.bindings) :]

    def bind(self, buf: torch.Tensor) -> None:
        self.bind_views(self.views(buf))

    def unbind(self) -> None:
        for b in self.bindings:
            b.unbind()
        for r in self.repacked:
            for b in r.bindings:
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
        # One intra-op thread per reader: a repack's ops (offload/experts.py's Repacked) are an expert's few MB, too
        # small to gain from more, and each reader's own OpenMP team would contend with the compute thread's (a
        # 2-core VM under load: an F16 -> float32 conversion of 128K weights 13 ms with 2 threads, 0.02 ms with 1).
        self._reader = ThreadPoolExecutor(depth, thread_name_prefix="llmsys-expert-reader",
                                          initializer=torch.set_num_threads, initargs=(1,))
        self._staging = threading.local()  # per reading thread: uint8 buffer for stored bytes to repack
        self.staging_bytes = 0  # those buffers' bytes, all threads
        # Pre-gating (:meth:`expect`), all on the compute thread: the guess per layer (scored when it routes), the reads
        # still to start, reads ahead by key (slots held apart from the cache until that layer routes; at most
        # _ahead_max, so a miss always finds a slot: depth reads + the one computing + these < the slots), ones its
        # layer did not use (into the cache once landed), and those in the cache never routed to (their bytes).
        self._guess: dict[int, set[int]] = {}
        self._want: tuple[int, list[int], list[ExpertWeights]] | None = None
        self._ahead: dict[tuple[int, int], tuple[int, Future]] = {}
        self._stale: dict[tuple[int, int], tuple[int, Future]] = {}
        self._ahead_bytes: dict[tuple[int, int], int] = {}
        self._unused: dict[tuple[int, int], int] = {}
        self._ahead_max = max(0, min(AHEAD, n - depth - 2))
        self._bound: dict[int, tuple[ExpertWeights, list[torch.Tensor]]] = {}  # slot -> its expert's module tensors
        self._held_bound: dict[int, list[ExpertWeights]] = {}  # layer -> experts bound while held (bind_held)

    def _stage(self, n: int) -> torch.Tensor:
        """This thread's staging buffer of at least ``n`` bytes (grown, never shrunk)."""
        buf = getattr(self._staging, "buf", None)
        if buf is None or buf.numel() < n:
            with self._stats_lock:
                self.staging_bytes += n - (0 if buf is None else buf.numel())
            buf = self._staging.buf = torch.empty(n, dtype=torch.uint8)
        return buf

    @property
    def cached_bytes(self) -> int:
        return len(self._lru) * self.slot_bytes

    @property
    def unused_ahead_bytes(self) -> int:
        """Bytes read ahead on a guess and never routed to: evicted so, or in the cache still."""
        return self.stats.ahead_unused_bytes + sum(self._unused.values())

    def _fd(self, path: str) -> int:
        with self._fd_lock:
            fd = self._fds.get(path)
            if fd is None:
                fd = self._fds[path] = os.open(path, os.O_RDONLY)
            return fd

    def _pread(self, path: str, off: int, bufs: list[memoryview], name: str) -> int:
        fd = self._fd(path)
        total = sum(len(b) for b in bufs)
        got = pread_full(fd, bufs, off)
        if got < total:
            raise OSError(f"{path}: unexpected end of file at byte {off + got} while reading expert {name}")
        if self.drop_cache:
            os.posix_fadvise(fd, off, total, os.POSIX_FADV_DONTNEED)
        return total

    def _read(self, w: ExpertWeights, slot: int) -> None:
        t = time.perf_counter()
        view = self._views[slot]
        files: dict[str, int] = {}
        for path, off, iov in w.unit.reads:
            n = self._pread(path, off, [view[b : b + n] for b, n in iov], w.unit.name)
            files[path] = files.get(path, 0) + n
        repack_s = 0.0
        if w.repacked:  # stored bytes of every repacked part into staging (in file order), then each part built
            stage = self._stage(w.staging_bytes)
            sview = memoryview(stage.numpy())
            raws: list[list[torch.Tensor]] = []
            reads = []
            pos = 0
            for r in w.repacked:
                mine = []
                for s in r.stored:
                    reads.append((s.path, s.offset, pos, s.nbytes))
                    mine.append(stage[pos : pos + s.nbytes])
                    pos += -(-s.nbytes // ALIGN) * ALIGN
                raws.append(mine)
            for path, off, at, n in sorted(reads):
                files[path] = files.get(path, 0) + self._pread(path, off, [sview[at : at + n]], w.unit.name)
            r0 = time.perf_counter()
            slot_t = self.slots[slot]
            for r, raw in zip(w.repacked, raws):
                if r.fill is not None and r.fill(raw, [st.view(slot_t) for st in r.tensors]):
                    continue
                outs = r.make(raw)
                if len(outs) != len(r.tensors):
                    raise RuntimeError(f"{r.name}: built {len(outs)} tensors, its slot holds {len(r.tensors)}")
                for st, out in zip(r.tensors, outs):
                    st.put(slot_t, out, r.name)
            repack_s = time.perf_counter() - r0
        with self._stats_lock:  # (reader threads and the compute thread read at once)
            self.stats.read_s += time.perf_counter() - t - repack_s
            self.stats.repack_s += repack_s
            self.stats.bytes_read += sum(files.values())
            for path, n in files.items():
                self.stats.files[path] = self.stats.files.get(path, 0) + n

    def _count(self, key: tuple[int, int]) -> None:
        """One more use of ``key``; every ``_age_every`` uses all counts halve (zeros dropped)."""
        self._uses[key] = self._uses.get(key, 0) + 1
        self._since_age += 1
        if self._since_age >= self._age_every:
            self._since_age = 0
            self._uses = {k: c // 2 for k, c in self._uses.items() if c > 1}

    def _take(self, layer: int, keep: set[int], busy: set[int], strict: bool,
              spare: frozenset[tuple[int, int]] = frozenset()) -> int | None:
        """A slot to fill: a free one, else the least recently used not in ``busy`` (being read or computed)
        nor, for ``strict``, one of ``layer``'s experts in ``keep`` (still to run this step) or in ``spare``."""
        if self._free:
            return self._free.pop()
        for passes in ((True,) if strict else (True, False)):
            ok = [key for key, s in self._lru.items()
                  if s not in busy and not (passes and (key[0] == layer and key[1] in keep or key in spare))]
            if not ok:
                continue
            # "lru": the oldest use; "lfu": the expert routed to least often lately (aged counts; ties: the oldest use)
            key = ok[0] if self.policy == "lru" else min(ok, key=lambda k: self._uses.get(k, 0))
            self.stats.evictions += 1
            if key in self._unused:  # read ahead on a guess, never routed to
                self.stats.ahead_unused_bytes += self._unused.pop(key)
            return self._lru.pop(key)
        if strict:
            return None
        raise RuntimeError("expert cache: every slot is busy (it needs at least one)")

    def _victim(self, layer: int, keep: set[int], busy: set[int],
                spare: frozenset[tuple[int, int]]) -> tuple[int, int] | None:
        """The expert :meth:`_take` with ``strict`` would evict (LFU), or None."""
        ok = [key for key, s in self._lru.items()
              if s not in busy and not (key[0] == layer and key[1] in keep or key in spare)]
        return min(ok, key=lambda k: self._uses.get(k, 0)) if ok else None

    def expect(self, layer: int, ids: list[int], weights: list[ExpertWeights]) -> None:
        """Pre-gating: ``layer`` will likely route to ``ids`` (most likely first). Reads of the ones not cached start
        from the next :meth:`each` on, once that layer's own reads are under way (never in place of them), into
        free slots or evicted ones that layer does not need; ``layer``'s :meth:`each` picks them up."""
        self._guess[layer] = set(ids)
        self._settle()
        self._want = (layer, [e for e in ids[:AHEAD] if (layer, e) not in self._lru], weights)

    def _settle(self) -> None:
        """Reads ahead that the guessed layer did not use: into the cache once landed, their slot freed if they failed
        (the expert is read again when routed to, and a failure then is that read's error)."""
        for key, (slot, fut) in list(self._stale.items()):
            if not fut.done():
                continue
            del self._stale[key]
            if fut.exception() is None and key not in self._lru:
                self._lru[key] = slot
                self._unused[key] = self._ahead_bytes.pop(key, 0)
            else:
                self._free.append(slot)
                self._ahead_bytes.pop(key, None)

    def _read_ahead(self, layer: int, keep: set[int], busy: set[int], reading: int) -> None:
        """Start reads of the guessed next layer's experts while fewer than ``depth`` reads are in flight
        (``reading``: the current layer's), into slots that are not ``busy`` nor hold ``layer``'s ``keep``."""
        if self._want is None:
            return
        nxt, ids, weights = self._want
        inflight = reading + sum(1 for _, f in self._ahead.values() if not f.done())
        spare = frozenset((nxt, e) for e in self._guess.get(nxt, ()))
        while ids and inflight < self.depth and len(self._ahead) < self._ahead_max:
            e = ids.pop(0)
            key = (nxt, e)
            if key in self._lru or key in self._ahead or key in self._stale:
                continue
            if not self._free and self.policy == "lfu":
                # Over a full cache a guess may only evict an expert routed to less often lately than itself: a
                # wrong guess lands unused (count 0) and would be the next guess's victim, read again every step.
                victim = self._victim(layer, keep, busy, spare)
                if victim is None:
                    ids.clear()
                    break
                if self._uses.get(victim, 0) >= self._uses.get(key, 0):
                    continue
            slot = self._take(layer, keep, busy, strict=True, spare=spare)
            if slot is None:
                ids.clear()
                break
            busy.add(slot)
            self._ahead[key] = (slot, self._reader.submit(self._read, weights[e], slot))
            self._ahead_bytes[key] = weights[e].read_bytes
            self.stats.ahead_reads += 1
            self.stats.ahead_bytes += weights[e].read_bytes
            inflight += 1

    def _bind(self, w: ExpertWeights, slot: int) -> None:
        """``w``'s modules onto its weights in ``slot`` (the slot's views are made once per expert it holds)."""
        views = self._bound.get(slot)
        if views is None or views[0] is not w:
            views = self._bound[slot] = (w, w.views(self.slots[slot]))
        w.bind_views(views[1])

    def slot_of(self, layer: int, e: int) -> int:
        """The slot ``layer``'s expert ``e`` is cached in (KeyError if it is not)."""
        return self._lru[(layer, e)]

    def bind_held(self, layer: int, e: int, w: ExpertWeights) -> None:
        """Bind an expert held by ``each(..., hold=True)`` (unbound again when that generator closes)."""
        self._bind(w, self._lru[(layer, e)])
        self._held_bound.setdefault(layer, []).append(w)

    def holds(self, n: int) -> bool:
        """Can ``n`` experts be bound at once (``each(..., hold=True)``), with the reads in flight beside them (the
        step's own and those ahead)?"""
        return n + self.depth + 1 + self._ahead_max <= len(self.slots)

    def _held_hits(self, layer: int, ids: list[int]) -> Iterator[int]:
        """:meth:`each` with ``hold`` when every expert is cached and no read is due (a cache that holds the model
        once warm): the same counts and order of uses, without the per-expert read planning."""
        lru = self._lru
        for e in ids:
            key = (layer, e)
            self._count(key)
            lru.move_to_end(key)
            self._unused.pop(key, None)
        self.stats.hits += len(ids)
        try:
            yield from ids
        finally:
            for w in self._held_bound.pop(layer, ()):
                w.unbind()

    def each(self, layer: int, ids: list[int], weights: list[ExpertWeights], hold: bool = False) -> Iterator[int]:
        """:meth:`ExpertSource.each` for one layer: cached experts first, then those read ahead on a guess
        (:meth:`expect`), the missing ones as they are read (up to ``depth`` reads in flight while the compute thread
        works, the next layer's guessed experts read in what is left). ``hold``: every expert yielded stays in its
        slot until the generator is closed, not bound (for one call over all of them: :meth:`slot_of` names where,
        :meth:`bind_held` binds one; :meth:`holds` says whether they fit)."""
        held: set[int] = set()  # slots of the experts yielded and still bound (hold)
        lru, ahead = self._lru, self._ahead
        self._settle()
        guess = self._guess.pop(layer, None)
        if guess is not None:
            self.stats.guess_hits += len(guess.intersection(ids))
            self.stats.guess_chosen += len(ids)
        if self._want is not None and self._want[0] == layer:  # its guess is spent: this layer routed
            self._want = None
        if hold and self._want is None and not ahead and all((layer, e) in lru for e in ids):  # cached, no read due
            yield from self._held_hits(layer, ids)
            return
        order = ([e for e in ids if (layer, e) in lru] + [e for e in ids if (layer, e) in ahead]
                 + [e for e in ids if (layer, e) not in lru and (layer, e) not in ahead])
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
                    self._unused.pop(key, None)
                else:
                    t = time.perf_counter()
                    if key in ahead:
                        slot, fut = ahead.pop(key)
                        self._ahead_bytes.pop(key, None)
                        self.stats.ahead_used += 1
                    elif e in pending:
                        slot, fut = pending.pop(e)
                    else:
                        slot = self._take(layer, left, {s for s, _ in pending.values()} | held, strict=False)
                        # a repack runs on a reader (one intra-op thread, as every repack), the rest here
                        fut = self._reader.submit(self._read, weights[e], slot) if weights[e].repacked else None
                    try:
                        fut.result() if fut is not None else self._read(weights[e], slot)
                    except BaseException:
                        self._free.append(slot)
                        raise
                    self.stats.wait_s += time.perf_counter() - t
                    lru[key] = slot
                    self.stats.misses += 1
                # Keep up to `depth` of the step's next missing experts reading while this one computes.
                busy = {slot} | {s for s, _ in pending.values()} | held
                for x in order[i + 1 :]:
                    if len(pending) >= self.depth:
                        break
                    if (layer, x) in lru or x in pending or (layer, x) in ahead:
                        continue
                    s = self._take(layer, left - {e}, busy, strict=True)
                    if s is None:
                        break
                    busy.add(s)
                    pending[x] = (s, self._reader.submit(self._read, weights[x], s))
                self._read_ahead(layer, left, busy, len(pending))  # the next layer's guess, in the reads left over
                w = weights[e]
                if hold:  # in its slot, neither taken nor evicted until the generator closes; bound on request (bind)
                    held.add(slot)
                    yield e
                    continue
                self._bind(w, slot)
                try:
                    yield e
                finally:
                    w.unbind()
                left.discard(e)
        finally:
            if hold:  # the experts bound while held (bind_held), unbound again
                for w in self._held_bound.pop(layer, ()):
                    w.unbind()
            for x, (s, fut) in pending.items():  # the consumer stopped early: let reads land, keep slots usable
                try:
                    fut.result()
                    lru[(layer, x)] = s
                except BaseException:
                    self._free.append(s)
            for key in [k for k in ahead if k[0] == layer]:  # read ahead for this layer, not routed to
                self._stale[key] = ahead.pop(key)
            self._settle()

    def close(self) -> None:
        self._reader.shutdown(wait=True)
        with self._fd_lock:
            for fd in self._fds.values():
                os.close(fd)
            self._fds.clear()
        self._lru.clear()
        self._ahead.clear()
        self._stale.clear()
        self._bound.clear()
        self.slots = []
        self._views = []
        self._staging = threading.local()


@dataclass(frozen=True)
class NextRouter:
    """The router of the sparse layer after a layer, for pre-gating (``DiskExperts.prefetch_next``): ``router``
    maps a ``[T, hidden]`` input to ``[T, experts]`` logits (the next layer's ``gate`` module, a callable so this
    package does not import the engine), and each token routes to the ``top_k`` largest of them."""

    router: Callable[[torch.Tensor], torch.Tensor]
    top_k: int
    experts: "DiskExperts"


@dataclass
class DiskExperts:
    """A sparse layer's experts on disk (``ExpertSource``): read on demand into the shared cache; with ``next``, the
    next sparse layer's likely experts are read ahead (pre-gating)."""

    layer: int
    weights: list[ExpertWeights]
    cache: ExpertCache
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))
    next: NextRouter | None = None

    def each(self, experts: list[int], hold: bool = False) -> Iterator[int]:
        return self.cache.each(self.layer, experts, self.weights, hold)

    def holds(self, n: int) -> bool:
        return self.cache.holds(n)

    def where(self, e: int) -> int:
        return self.cache.slot_of(self.layer, e)

    def bind(self, e: int) -> None:
        self.cache.bind_held(self.layer, e, self.weights[e])

    def prefetch_next(self, x: torch.Tensor) -> None:
        """Guess the next sparse layer's experts from this layer's router input ``x`` through the next router (its
        hidden state drifts little over one layer), the experts most tokens pick first, and queue their reads."""
        nxt = self.next
        if nxt is None:
            return
        logits = nxt.router(x)  # [T, E]
        top = torch.topk(logits, min(nxt.top_k, logits.shape[-1]), dim=-1).indices  # [T, k], most likely first
        if top.shape[0] == 1:  # a decode step of one sequence: its top k as they rank
            ids = top[0].tolist()
        else:
            votes = torch.bincount(top.reshape(-1).cpu(), minlength=logits.shape[-1])
            ids = torch.argsort(votes, descending=True, stable=True)[: int((votes > 0).sum())].tolist()
        self.cache.expect(nxt.experts.layer, ids, nxt.experts.weights)


@dataclass
class ResidentExperts:
    """A sparse layer's experts resident in CPU RAM beside a layer computed elsewhere (``--cpu-moe`` on a
    CUDA engine): the routed hidden rows go to ``device`` and the weighted sum comes back, the weights
    never move. ``uses`` counts the steps that ran here (tests check the path was taken)."""

    device: torch.device
    uses: int = 0

    def each(self, experts: list[int], hold: bool = False) -> Iterator[int]:
        self.uses += 1
        return iter(experts)

    def holds(self, n: int) -> bool:
        return True

    def where(self, e: int) -> int:
        return 0  # (always where they are)

    def bind(self, e: int) -> None:
        """Resident: always bound."""

    def prefetch_next(self, x: torch.Tensor) -> None:
        """Resident experts: nothing to read."""
