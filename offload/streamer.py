"""Streaming weights from disk: a reader thread filling a ring of buffers.

A step needs every streamed layer once, in order, so the reader runs one layer ahead unasked: it owns
``RING_SLOTS`` preallocated buffers (pinned with a GPU) and reads each unit's tensors from the checkpoint's
safetensors file (or an offload file in the run dtype) with ``os.preadv`` at their offsets: no per-step
allocation, no mmap, no copy after the read; read pages are dropped (``POSIX_FADV_DONTNEED``) so a file
larger than RAM is not quietly cached. An engine that keeps the page cache on the CPU maps the files
instead (:class:`MappedUnits`: cached pages read in place). ``preadv`` releases the GIL, so layer i+1's
read overlaps layer i's compute; the order is cyclic across steps.
"""

from __future__ import annotations

import os
import queue
import threading
import time
from dataclasses import dataclass, field

import torch

ALIGN = 64  # buffer offset alignment: any dtype view is legal, cache-line friendly
IOV_MAX = 1024


def pread_full(fd: int, bufs: list[memoryview], offset: int) -> int:
    """Fill ``bufs`` in order from ``fd`` at ``offset``; returns the bytes read.

    ``preadv`` may return fewer bytes than asked (a signal, a large request):
    this continues where it stopped, so a result short of the buffers' total
    means the file ended there.
    """
    total, got = sum(len(b) for b in bufs), 0
    while got < total:
        skip, rest = got, []
        for b in bufs:
            if skip >= len(b):
                skip -= len(b)
                continue
            rest.append(b[skip:])
            skip = 0
        n = os.preadv(fd, rest, offset + got)
        if n <= 0:
            break
        got += n
    return got


@dataclass(frozen=True)
class TensorSource:
    """Where one tensor's bytes are on disk."""

    path: str
    offset: int  # absolute byte offset in the file
    nbytes: int


@dataclass
class Binding:
    """One tensor slot of a module whose weights are not resident: bound to a buffer view while it runs."""

    owner: torch.nn.Module
    leaf: str
    is_param: bool
    placeholder: torch.Tensor  # what the slot holds while the unit is not resident (meta)

    def bind(self, t: torch.Tensor) -> None:
        (self.owner._parameters if self.is_param else self.owner._buffers)[self.leaf] = t

    def unbind(self) -> None:
        self.bind(self.placeholder)


@dataclass(frozen=True)
class StreamItem:
    """One tensor of a unit: its dtype/shape at run time and its bytes on disk."""

    dtype: torch.dtype
    shape: tuple[int, ...]
    src: TensorSource


@dataclass
class StreamUnit:
    """What is made resident together (one decoder layer, one LM-head chunk)."""

    name: str
    items: list[StreamItem]
    offsets: list[int] = field(default_factory=list)  # buffer offset of each item
    nbytes: int = 0  # buffer bytes needed
    reads: list[tuple[str, int, list[tuple[int, int]]]] = field(default_factory=list)  # (path, file off, [(buf off, n)])

    def __post_init__(self) -> None:
        order = sorted(range(len(self.items)), key=lambda j: (self.items[j].src.path, self.items[j].src.offset))
        self.offsets = [0] * len(self.items)
        off = 0
        for j in order:
            self.offsets[j] = off
            off += -(-self.items[j].src.nbytes // ALIGN) * ALIGN
        self.nbytes = off
        # Coalesce tensors adjacent in the file into one preadv with several iovecs.
        reads: list[tuple[str, int, list[tuple[int, int]]]] = []
        end = None
        for j in order:
            s = self.items[j].src
            if reads and reads[-1][0] == s.path and end == s.offset and len(reads[-1][2]) < IOV_MAX:
                reads[-1][2].append((self.offsets[j], s.nbytes))
            else:
                reads.append((s.path, s.offset, [(self.offsets[j], s.nbytes)]))
            end = s.offset + s.nbytes
        self.reads = reads


@dataclass
class RingStats:
    bytes_read: int = 0
    read_s: float = 0.0  # reader thread time inside preadv
    wait_s: float = 0.0  # compute thread time blocked waiting for a unit
    units_read: int = 0
    units_skipped: int = 0


class ReaderRing:
    """``RING_SLOTS`` buffers and one reader thread cycling through ``units``."""

    def __init__(self, units: list[StreamUnit], slots: int = 2, pin: bool = False, drop_cache: bool = True):
        if not units:
            raise ValueError("a reader ring needs at least one unit")
        self.units = units
        self.slot_bytes = max(u.nbytes for u in units)
        bufs = [torch.empty(self.slot_bytes, dtype=torch.uint8) for _ in range(slots)]
        self.slots = [b.pin_memory() if pin else b for b in bufs]
        self._views = [memoryview(b.numpy()) for b in self.slots]
        self.drop_cache = drop_cache
        self.stats = RingStats()
        self._fds: dict[str, int] = {}
        self._free: queue.Queue[int | None] = queue.Queue()
        self._ready: queue.Queue[tuple[int, int] | BaseException] = queue.Queue()
        for k in range(slots):
            self._free.put(k)
        self._held: dict[int, int] = {}  # unit index -> slot
        self._stop = False
        self._thread = threading.Thread(target=self._run, name="llmsys-offload-reader", daemon=True)
        self._thread.start()

    # -- reader thread -----------------------------------------------------
    def _fd(self, path: str) -> int:
        fd = self._fds.get(path)
        if fd is None:
            fd = self._fds[path] = os.open(path, os.O_RDONLY)
        return fd

    def _read(self, u: StreamUnit, k: int) -> None:
        view = self._views[k]
        for path, off, iov in u.reads:
            fd = self._fd(path)
            bufs = [view[b : b + n] for b, n in iov]
            total = sum(n for _, n in iov)
            got = pread_full(fd, bufs, off)
            if got < total:
                raise OSError(f"{path}: unexpected end of file at byte {off + got} while streaming {u.name}")
            if self.drop_cache:
                os.posix_fadvise(fd, off, total, os.POSIX_FADV_DONTNEED)

    def _run(self) -> None:
        i = 0
        try:
            while True:
                k = self._free.get()
                if k is None or self._stop:
                    return
                u = self.units[i]
                t = time.perf_counter()
                self._read(u, k)
                self.stats.read_s += time.perf_counter() - t
                self.stats.bytes_read += u.nbytes
                self.stats.units_read += 1
                self._ready.put((i, k))
                i = (i + 1) % len(self.units)
        except BaseException as e:  # surfaced on the compute thread by acquire()
            self._ready.put(e)

    # -- compute thread ----------------------------------------------------
    def acquire(self, index: int) -> list[torch.Tensor]:
        """Block until unit ``index`` is in a buffer; its tensors as views (no copy)."""
        t = time.perf_counter()
        while True:
            got = self._ready.get()
            if isinstance(got, BaseException):
                raise got
            i, k = got
            if i == index:
                break
            # The step skipped a unit (e.g. no logits this step): drop it and move on.
            self.stats.units_skipped += 1
            self._free.put(k)
        self.stats.wait_s += time.perf_counter() - t
        self._held[index] = k
        u = self.units[index]
        buf = self.slots[k]
        return [buf[o : o + it.src.nbytes].view(it.dtype).view(it.shape) for o, it in zip(u.offsets, u.items)]

    def release(self, index: int) -> None:
        """The unit's compute is done: its buffer may be refilled."""
        self._free.put(self._held.pop(index))

    def close(self) -> None:
        self._stop = True
        self._free.put(None)
        self._thread.join(timeout=10)
        for fd in self._fds.values():
            os.close(fd)
        self._fds.clear()


class MappedUnits:
    """Streamed units read in place from the page cache: every tensor a view of its file, mapped.

    For ``keep_page_cache`` engines on the CPU (the kernel may cache the
    checkpoint; nothing is dropped): where the pages are cached, a unit costs
    no read and no copy -- the GEMV streams the page cache itself, as
    llama.cpp's mmap does -- and a page that is not cached is faulted in from
    disk on first touch. The files hold the run dtype (the checkpoint, or the
    offload file written in it), so a view needs no conversion. The mapping is
    private (copy-on-write, never written), and the views are built once.
    Same interface as :class:`ReaderRing`; ``slot_bytes`` 0 (no buffers).
    """

    def __init__(self, units: list[StreamUnit]):
        import mmap

        self.units = units
        self.slot_bytes = 0
        self.slots: list[torch.Tensor] = []
        self.stats = RingStats()
        self._maps: dict[str, mmap.mmap] = {}
        self._views: list[list[torch.Tensor]] = []
        for u in units:
            views = []
            for it in u.items:
                mm = self._maps.get(it.src.path)
                if mm is None:
                    with open(it.src.path, "rb") as f:
                        mm = self._maps[it.src.path] = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY)
                if it.src.offset + it.src.nbytes > len(mm):
                    raise OSError(f"{it.src.path}: {u.name} ends at byte {it.src.offset + it.src.nbytes}, "
                                  f"past the end of the file ({len(mm)} bytes)")
                raw = torch.frombuffer(mm, dtype=torch.uint8, count=it.src.nbytes, offset=it.src.offset)
                views.append(raw.view(it.dtype).view(it.shape))
            self._views.append(views)

    def acquire(self, index: int) -> list[torch.Tensor]:
        """Unit ``index``'s tensors, views of the mapped files (no read, no copy)."""
        return self._views[index]

    def release(self, index: int) -> None:
        """Nothing to refill."""

    def close(self) -> None:
        self._views.clear()
        for mm in self._maps.values():
            try:
                mm.close()
            except BufferError:  # a tensor view still exported by someone: the GC unmaps it later
                pass
        self._maps.clear()


class CudaStager:  # pragma: no cover - untested: this machine has no GPU
    """Two GPU staging buffers filled on a side stream with non-blocking copies.

    The copy of unit i+1 runs on ``self.stream`` while the compute stream runs
    unit i; events order "copy done -> compute" and "compute done -> buffer
    reused". Sources are pinned CPU buffers (ring slots or resident pinned
    weights), so ``non_blocking=True`` is a true async DMA.
    """

    def __init__(self, nbytes: int, device: torch.device, slots: int = 2):
        self.device = device
        self.bufs = [torch.empty(nbytes, dtype=torch.uint8, device=device) for _ in range(slots)]
        self.stream = torch.cuda.Stream(device)
        self.copied: list[torch.cuda.Event | None] = [None] * slots
        self.freed: list[torch.cuda.Event | None] = [None] * slots
        self.next = 0

    def copy_in(self, srcs: list[torch.Tensor], offsets: list[int]) -> int:
        """Start copying CPU tensors ``srcs`` into a free staging buffer; returns its id."""
        k = self.next
        self.next = (k + 1) % len(self.bufs)
        with torch.cuda.stream(self.stream):
            if self.freed[k] is not None:
                self.stream.wait_event(self.freed[k])
            buf = self.bufs[k]
            for src, off in zip(srcs, offsets):
                n = src.numel() * src.element_size()
                buf[off : off + n].copy_(src.reshape(-1).view(torch.uint8), non_blocking=True)
            ev = torch.cuda.Event()
            ev.record(self.stream)
            self.copied[k] = ev
        return k

    def views(self, k: int, items: list[StreamItem], offsets: list[int]) -> list[torch.Tensor]:
        torch.cuda.current_stream(self.device).wait_event(self.copied[k])
        buf = self.bufs[k]
        return [buf[o : o + it.src.nbytes].view(it.dtype).view(it.shape) for o, it in zip(offsets, items)]

    def done(self, k: int) -> None:
        ev = torch.cuda.Event()
        ev.record(torch.cuda.current_stream(self.device))
        self.freed[k] = ev

    def wait_copied(self, k: int) -> None:
        if self.copied[k] is not None:
            self.copied[k].synchronize()
