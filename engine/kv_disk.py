"""The prefix cache's disk tier (``--kv-disk SIZE``): full KV blocks kept in files across restarts.

Why: the prefix cache lives in the pool, so a restart, a crash or a reboot throws every conversation's KV
away and the next turn of a long chat computes its whole prompt again. Here every full block the prefix
cache registers is also written to a file named by the same chained block key
(:func:`llmsys.engine.prefix_cache.block_key`: it names the whole token prefix), and a prompt whose
longest prefix is not in the pool reads the next blocks back from disk instead of computing them.

* Off the step's path: :meth:`KVDisk.submit` copies the new blocks' rows (every layer) into one staging
  tensor and queues it; a writer thread checksums and writes. The queue is bounded in bytes: when it is
  full, blocks are dropped (not written), never waited for.
* Never trusted blindly: a file holds a header (format, namespace, key, payload length, XXH3-128 of the
  payload); a short, torn or corrupt file is deleted and its blocks computed.
* Never mixed up: files live under a namespace, a hash of the model's file content
  (:func:`content_fingerprint`), the float dtype, the KV format (``--kv-dtype``, block size, shape) and
  the kernels and versions that computed the KV, so another model, format or machine never reuses one.
* Bounded: least recently used files go first once the folder (every namespace) passes ``SIZE``; the
  blocks of a saved conversation (:meth:`KVDisk.pin`) are kept.
* Harmless when the disk fails: any write or read error other than a missing file (ENOSPC, EIO, a
  read-only folder) turns the tier off with one log line; prompts are computed as without it.

The engine thread calls :meth:`submit` and :meth:`restore`; the writer thread only writes, evicts and
scans, under one lock for the shared index.
"""

from __future__ import annotations

import atexit
import errno
import hashlib
import json
import logging
import os
import struct
import threading
import time
from collections import OrderedDict, deque
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import torch
import xxhash

from llmsys.engine.prefix_cache import extend_keys
from llmsys.kernels.common.paths import llmsys_home
from llmsys.kernels.common.protocols import KVPool
from llmsys.kernels.common.units import format_bytes

if TYPE_CHECKING:
    from llmsys.engine.config import EngineConfig
    from llmsys.engine.kv_cache import BlockAllocator
    from llmsys.engine.loader.common import LoadedModel

log = logging.getLogger(__name__)

FORMAT_VERSION = 1
MAGIC = b"LLMSYSKV"
_HEADER = struct.Struct("<8sI16s16sQ16s")  # magic, version, namespace, key, payload bytes, xxh3-128(payload)
SUFFIX = ".kvb"
PIN_FLUSH_S = 5.0  # /save waits this long at most for the conversation's last blocks to be written
EXIT_FLUSH_S = 10.0  # at exit, wait this long at most for queued blocks to be written
QUEUE_BYTES = 256 << 20  # staged blocks waiting for the writer at most; more are dropped
STALE_TMP_S = 600  # a temporary file this old is a killed process's, not a live writer's
_SAMPLES = 16  # evenly spaced 64 KiB samples of each weight file in its fingerprint
_HEAD = 1 << 20  # the first MiB of each file: a GGUF's header and tensor table, a safetensors header
_SAMPLE = 64 << 10


def default_kv_disk_dir() -> Path:
    return llmsys_home() / "kv"


def content_fingerprint(path: str | Path) -> bytes:
    """16 bytes naming a checkpoint's content, cheaply: per weight file its size, first MiB (a GGUF's
    header, a safetensors header), last 64 KiB and 16 evenly spaced 64 KiB samples (a folder's files also
    by name).

    Content, not mtime or path: a copied, renamed or re-downloaded file keeps its blocks; a re-quantized
    or fine-tuned one differs in its header, its size or its samples. A folder counts its config and weight
    files (not the tokenizer, which does not change the KV of given token ids)."""
    p = Path(path)
    if p.is_dir():
        files = sorted(f for f in p.iterdir() if f.is_file() and (
            f.suffix in (".safetensors", ".gguf", ".bin", ".pt", ".pth") or f.name in ("config.json",)))
    else:
        files = [p]
    h = hashlib.blake2b(digest_size=16)
    for f in files:
        size = f.stat().st_size
        h.update((f.name.encode() if p.is_dir() else b"") + b"\0" + size.to_bytes(8, "little"))
        with open(f, "rb") as fh:
            offsets = [0] + [size * i // (_SAMPLES + 1) for i in range(1, _SAMPLES + 1)] + [max(0, size - _SAMPLE)]
            for i, off in enumerate(offsets):
                fh.seek(off)
                h.update(fh.read(_HEAD if i == 0 else _SAMPLE))
    return h.digest()


def kv_namespace(fingerprint: bytes, **fmt: object) -> bytes:
    """16 bytes naming the blocks one engine writes: the model's content and every setting that changes
    a block's bytes (``fmt``: dtype, KV format, block size, shape, kernels, versions)."""
    h = hashlib.blake2b(fingerprint, digest_size=16)
    h.update(json.dumps({k: str(v) for k, v in sorted(fmt.items())}, sort_keys=True).encode())
    h.update(FORMAT_VERSION.to_bytes(4, "little"))
    return h.digest()


def block_parts(kv: KVPool) -> list[torch.Tensor] | None:
    """The pool tensors that hold a block (dimension 0 is the block id), in file order; None: a pool whose
    blocks are not kept whole in such tensors (int4 buffers each open block apart), which this tier skips."""
    if kv.kind == "plain":
        out = []
        for k, v in zip(kv.k, kv.v):
            out += [k, v]
        return out
    if kv.kind == "int8":
        out = []
        for k, v in zip(kv.k, kv.v):
            out += [k.codes, k.scale, v.codes, v.scale]
        return out
    return None


@dataclass
class KVDiskStats:
    """What the memory report, ``/metrics`` and the tests read."""

    hits: int = 0  # blocks read back instead of computed
    misses: int = 0  # prompts that looked on disk past the pool and found nothing
    corrupt: int = 0  # files found torn or corrupt (deleted; computed instead)
    written: int = 0  # blocks written
    dropped: int = 0  # blocks not written: the queue was full, or one block is larger than SIZE
    evicted: int = 0  # files deleted to stay within SIZE
    bytes_on_disk: int = 0  # every namespace's files (known to this process)
    read_s: float = 0.0
    write_s: float = 0.0


@dataclass(frozen=True)
class KVDiskReport:
    """The tier as :class:`llmsys.engine.core.MemoryReport` carries it (a frozen copy)."""

    folder: str
    limit: int
    enabled: bool
    failure: str | None
    stats: KVDiskStats

    def to_dict(self) -> dict:
        return {"folder": self.folder, "limit": self.limit, "enabled": self.enabled, "failure": self.failure,
                **asdict(self.stats)}


class KVDisk:
    """Full KV blocks on disk under one namespace (see the module doc)."""

    def __init__(self, folder: str | Path, limit: int, namespace: bytes, parts: list[torch.Tensor],
                 describe: dict | None = None, queue_bytes: int = QUEUE_BYTES):
        self.root = Path(folder).expanduser()
        self.limit = int(limit)
        self.namespace = namespace
        self.dir = self.root / namespace.hex()
        self.parts = parts
        self._part_bytes = [p[0].numel() * p.element_size() for p in parts]
        self.block_bytes = sum(self._part_bytes)
        self.file_bytes = _HEADER.size + self.block_bytes
        self.stats = KVDiskStats()
        self.failure: str | None = None
        self._queue_bytes = queue_bytes
        self._lock = threading.Lock()
        self._wake = threading.Condition(self._lock)
        self._queue: deque[tuple[torch.Tensor, list[bytes]]] = deque()
        self._pending = 0  # bytes staged in the queue
        self._busy = False  # the writer holds an item it has taken off the queue
        self._index: OrderedDict[Path, int] = OrderedDict()  # every namespace's files, least recently used first
        self._pinned: set[str] = set()  # file names (key hex + suffix) a saved conversation keeps
        self._stop = False
        try:
            self.dir.mkdir(parents=True, exist_ok=True)
            (self.root / "pins").mkdir(exist_ok=True)
            if describe is not None and not (self.dir / "format.json").exists():
                self._write_atomic(self.dir / "format.json", json.dumps(describe, indent=1).encode())
            self._load_pins()
        except OSError as e:
            self._fail("cannot use", self.dir, e)
            return
        self._thread = threading.Thread(target=self._run, name="llmsys-kv-disk", daemon=True)
        self._thread.start()
        atexit.register(self.close, EXIT_FLUSH_S)  # a planned exit keeps the last turn's blocks

    # -- state -----------------------------------------------------------------
    @property
    def enabled(self) -> bool:
        return self.failure is None

    def _fail(self, what: str, path: Path, e: OSError) -> None:
        """Turn the tier off, with one log line (the first failure only)."""
        with self._lock:
            if self.failure is not None:
                return
            name = errno.errorcode.get(e.errno, "") if e.errno else ""
            self.failure = f"{what} {path}: {e.strerror or e}" + (f" ({name})" if name else "")
            self._queue.clear()
            self._pending = 0
            self._wake.notify_all()
        log.warning("KV disk tier off: %s; prompts are computed as without it", self.failure)

    def report(self) -> KVDiskReport:
        with self._lock:
            stats = KVDiskStats(**asdict(self.stats))
        return KVDiskReport(str(self.root), self.limit, self.enabled, self.failure, stats)

    def path_of(self, key: bytes) -> Path:
        return self.dir / (key.hex() + SUFFIX)

    # -- engine thread: write ----------------------------------------------------
    def submit(self, blocks: list[int], keys: list[bytes]) -> None:
        """Queue pool ``blocks`` (full, registered under ``keys``) for writing: their rows are copied now
        (the pool may reuse the blocks at once), the file is written by the writer thread."""
        if not blocks or not self.enabled:
            return
        with self._lock:
            fresh = [(b, k) for b, k in zip(blocks, keys) if self.path_of(k) not in self._index]
            room = (self._queue_bytes - self._pending) // self.block_bytes
            if len(fresh) > room:
                self.stats.dropped += len(fresh) - room
                fresh = fresh[:max(0, room)]
            if not fresh:
                return
            self._pending += len(fresh) * self.block_bytes
        idx = torch.tensor([b for b, _ in fresh], device=self.parts[0].device)
        n = len(fresh)
        rows = torch.cat([p.index_select(0, idx).reshape(n, -1).view(torch.uint8) for p in self.parts], dim=1)
        with self._lock:
            self._queue.append((rows.cpu(), [k for _, k in fresh]))
            self._wake.notify()

    def flush(self, timeout: float = 30.0) -> bool:
        """Wait until every queued block is written (or dropped by a failure); False if ``timeout`` ran out.
        Front ends call it before a planned exit so the last turn's blocks survive."""
        end = time.monotonic() + timeout
        with self._lock:
            while (self._queue or self._busy) and self.failure is None:
                left = end - time.monotonic()
                if left <= 0:
                    return False
                self._wake.wait(min(left, 0.1))
        return True

    def close(self, timeout: float = 30.0) -> None:
        self.flush(timeout)
        with self._lock:
            self._stop = True
            self._wake.notify_all()

    # -- engine thread: read -----------------------------------------------------
    def restore(self, keys: list[bytes], allocator: BlockAllocator, max_blocks: int) -> list[int]:
        """Read the longest run of ``keys`` on disk (at most ``max_blocks``) into fresh pool blocks,
        registered under their keys, each with one reference; [] on a miss. A corrupt file ends the run
        (and is deleted); a failing disk turns the tier off."""
        if not self.enabled or max_blocks <= 0 or not keys:
            return []
        t0 = time.perf_counter()
        keys = keys[:max_blocks]
        rows = None
        n = 0
        for key in keys:
            path = self.path_of(key)
            try:
                fd = os.open(path, os.O_RDONLY)
            except FileNotFoundError:
                break
            except OSError as e:
                self._fail("cannot read", path, e)
                break
            try:
                if rows is None:
                    rows = torch.empty((len(keys), self.block_bytes), dtype=torch.uint8)
                ok = self._read_block(fd, key, rows[n])
            except OSError as e:
                self._fail("cannot read", path, e)
                break
            finally:
                os.close(fd)
            if not ok:
                self.stats.corrupt += 1
                log.info("KV disk tier: %s is torn or corrupt; deleted, its tokens are computed", path.name)
                self._forget(path, unlink=True)
                break
            self._touch(path)
            n += 1
        if n == 0:
            self.stats.misses += 1
            return []
        blocks = allocator.allocate(n)
        idx = torch.tensor(blocks, device=self.parts[0].device)
        src = rows[:n].to(self.parts[0].device)
        off = 0
        for p, size in zip(self.parts, self._part_bytes):
            p.index_copy_(0, idx, src[:, off:off + size].contiguous().view(p.dtype).view(n, *p.shape[1:]))
            off += size
        for b, k in zip(blocks, keys):
            allocator.register(b, k)
        self.stats.hits += n
        self.stats.read_s += time.perf_counter() - t0
        return blocks

    def _read_block(self, fd: int, key: bytes, out: torch.Tensor) -> bool:
        """One file into ``out`` (its payload); False: not a whole, intact block of this namespace."""
        head = os.pread(fd, _HEADER.size, 0)
        if len(head) != _HEADER.size:
            return False
        magic, version, ns, k, size, digest = _HEADER.unpack(head)
        if (magic, version, ns, k, size) != (MAGIC, FORMAT_VERSION, self.namespace, key, self.block_bytes):
            return False
        view = memoryview(out.numpy())
        got = os.preadv(fd, [view], _HEADER.size)
        if got != size or os.pread(fd, 1, _HEADER.size + size):  # short, or longer than it says
            return False
        return xxhash.xxh3_128(view).digest() == digest

    def _touch(self, path: Path) -> None:
        with self._lock:
            if path in self._index:
                self._index.move_to_end(path)
        try:
            os.utime(path)  # the next process's scan orders by mtime
        except OSError:
            pass

    def _forget(self, path: Path, unlink: bool) -> None:
        with self._lock:
            size = self._index.pop(path, None)
            if size is not None:
                self.stats.bytes_on_disk -= size
        if unlink:
            try:
                path.unlink()
            except OSError:
                pass

    # -- saved conversations -------------------------------------------------------
    def pin(self, name: str, keys: list[bytes]) -> int:
        """Keep the files of ``keys`` (a saved conversation's blocks) out of LRU eviction, under ``name`` (the
        conversation file's path: a later pin of it replaces it for later processes; a pin whose file is
        gone is dropped when the next process starts). Returns how many of them are on disk now."""
        if not self.enabled:
            return 0
        pin = self.root / "pins" / (hashlib.blake2b(name.encode(), digest_size=8).hexdigest() + ".json")
        files = [str(self.path_of(k).relative_to(self.root)) for k in keys]
        try:
            self._write_atomic(pin, json.dumps({"name": name, "files": files}).encode())
        except OSError as e:
            self._fail("cannot write", pin, e)
            return 0
        with self._lock:
            self._pinned.update(files)
        return sum(1 for k in keys if self.path_of(k).exists())

    def pin_prompt(self, name: str, token_ids: list[int], block_size: int) -> tuple[int, int]:
        """:meth:`pin` the full blocks of ``token_ids`` (a saved conversation's prompt) once the queued writes
        are done; returns (blocks on disk, full blocks of the prompt)."""
        keys: list[bytes] = []
        extend_keys(keys, token_ids, block_size, len(token_ids) // block_size)
        self.flush(PIN_FLUSH_S)
        return self.pin(name, keys), len(keys)

    def _load_pins(self) -> None:
        """The pins of saved conversations; a pin whose conversation file is gone is deleted."""
        for f in (self.root / "pins").glob("*.json"):
            try:
                pin = json.loads(f.read_text())
                if not Path(pin["name"]).exists():
                    f.unlink()
                    continue
                self._pinned.update(pin["files"])
            except (OSError, ValueError, KeyError, TypeError):
                continue

    # -- writer thread ---------------------------------------------------------------
    def _run(self) -> None:
        self._scan()
        while True:
            with self._lock:
                while not self._queue and not self._stop and self.failure is None:
                    self._wake.wait()
                if self._stop or self.failure is not None:
                    return
                rows, keys = self._queue.popleft()
                self._busy = True
            try:
                self._write_rows(rows, keys)
            finally:
                with self._lock:
                    self._pending = max(0, self._pending - len(keys) * self.block_bytes)
                    self._busy = False
                    self._wake.notify_all()

    def _scan(self) -> None:
        """Index every namespace's files, oldest mtime first (the LRU order a previous process left)."""
        found = []
        try:
            subs = [d for d in self.root.iterdir() if d.is_dir() and d.name != "pins"]
            for sub in subs:
                for f in sub.iterdir():
                    try:
                        st = f.stat()
                        if f.name.endswith(".tmp") and time.time() - st.st_mtime > STALE_TMP_S:
                            f.unlink()  # a write a killed process left half done
                        elif f.suffix == SUFFIX:
                            found.append((st.st_mtime, f, st.st_size))
                    except FileNotFoundError:  # another process evicted it meanwhile
                        continue
        except FileNotFoundError:
            pass
        except OSError as e:
            self._fail("cannot list", self.root, e)
            return
        found.sort(key=lambda t: t[0])
        with self._lock:
            for _, f, size in found:
                if f not in self._index:
                    self._index[f] = size
                    self.stats.bytes_on_disk += size
        self._evict()

    def _write_rows(self, rows: torch.Tensor, keys: list[bytes]) -> None:
        data = rows.numpy()
        for j, key in enumerate(keys):
            if self.failure is not None:
                return
            path = self.path_of(key)
            if path in self._index:
                continue
            if not self._evict(room=self.file_bytes):  # larger than SIZE, or pins fill it
                self.stats.dropped += 1
                continue
            t0 = time.perf_counter()
            payload = memoryview(data[j])
            head = _HEADER.pack(MAGIC, FORMAT_VERSION, self.namespace, key, self.block_bytes,
                                xxhash.xxh3_128(payload).digest())
            try:
                self._write_atomic(path, head, payload)
            except OSError as e:
                self._fail("cannot write", path, e)
                return
            with self._lock:
                self._index[path] = self.file_bytes
                self.stats.bytes_on_disk += self.file_bytes
                self.stats.written += 1
                self.stats.write_s += time.perf_counter() - t0

    def _evict(self, room: int = 0) -> bool:
        """Delete least recently used unpinned files until the folder plus ``room`` bytes is within the limit;
        False if it cannot be (pinned files fill it, or ``room`` alone is larger)."""
        while True:
            with self._lock:
                if self.stats.bytes_on_disk + room <= self.limit:
                    return True
                victim = next((f for f in self._index
                               if str(f.relative_to(self.root)) not in self._pinned), None)
                if victim is None:
                    return False
                self.stats.bytes_on_disk -= self._index.pop(victim)
                self.stats.evicted += 1
            try:
                victim.unlink()
            except FileNotFoundError:
                pass
            except OSError as e:
                self._fail("cannot delete", victim, e)
                return False

    @staticmethod
    def _write_atomic(path: Path, *chunks: bytes | memoryview) -> None:
        """Write a file under a temporary name, then rename it: a reader sees a whole file or none."""
        tmp = path.with_name(f"{path.name}.{os.getpid()}.{threading.get_ident()}.tmp")
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        try:
            for c in chunks:
                view = memoryview(c).cast("B")
                while view:
                    view = view[os.write(fd, view):]
        except BaseException:
            os.close(fd)
            tmp.unlink(missing_ok=True)
            raise
        os.close(fd)
        os.replace(tmp, path)


def open_kv_disk(config: EngineConfig, loaded: LoadedModel, kv: KVPool, attention: str, kernels: dict[str, int],
                 has_ring: bool) -> KVDisk | None:
    """The engine's disk tier, or None: ``--kv-disk 0``, no prefix caching, or an engine this tier cannot
    serve (an int4 pool or sliding layers' rings, whose blocks are not whole per key; Quest's page summaries,
    made only as keys are stored): said in the log."""
    if not config.kv_disk or not config.prefix_caching:
        return None
    parts = block_parts(kv)
    quest = config.kv_policy.kind == "quest"  # per-page key summaries made as keys are stored, not on a read
    if parts is None or has_ring or quest:
        why = ("sliding-window rings" if has_ring else "--kv-policy quest" if quest else
               f"--kv-dtype {kv.spec.kv_dtype}")
        log.info("KV disk tier off: an engine with %s does not keep KV on disk", why)
        return None
    spec = kv.spec
    fmt = dict(dtype=spec.dtype, kv_dtype=spec.kv_dtype, block_size=spec.block_size, layers=spec.num_layers,
               kv_heads=spec.num_kv_heads, head_dim=spec.head_dim, parts=[tuple(p.shape[1:]) for p in parts],
               quant=config.quant, keep_float=config.quant_keep_float, kernels=sorted(kernels), attention=attention,
               device=loaded.device.type, cpu=torch.backends.cpu.get_cpu_capability(), torch=torch.__version__)
    try:
        fingerprint = content_fingerprint(loaded.path)
    except OSError as e:
        log.warning("KV disk tier off: cannot read %s to name its blocks: %s", loaded.path, e.strerror or e)
        return None
    folder = Path(config.kv_disk_dir) if config.kv_disk_dir else default_kv_disk_dir()
    describe = {"model": str(loaded.path), "fingerprint": fingerprint.hex(), **{k: str(v) for k, v in fmt.items()}}
    disk = KVDisk(folder, config.kv_disk, kv_namespace(fingerprint, **fmt), parts, describe)
    if disk.enabled:
        log.info("KV disk tier: %s in %s (%s per block)", format_bytes(config.kv_disk), disk.dir,
                 format_bytes(disk.file_bytes))
    return disk
