"""The one machine probe: RAM, disk and host-GPU speeds, measured once per machine and cached in one place.

The best placement flips with these numbers and a tok/s means little without its roof, so
:func:`measure_bandwidths` fills one :class:`Bandwidths` record in ``$LLMSYS_HOME/machine.json`` that the
planner, ``llmsys plan`` and ``llmsys bench`` all read (``--remeasure`` replaces it). The RAM probe runs on
:meth:`ProbeSettings.thread_count` threads, not the caller's; disk figures are kept per filesystem with
their folder, read from random bytes (no compressing-filesystem flattery), tmpfs flagged ``disk_cached``.
The disk probe never stops a start: sized to a quarter of the free space, else one notice and
:data:`ASSUMED_DISK_GBPS` (not cached); its file is unlinked once open, and stale ``.llmsys_bw_*`` files
are removed (dead PID, else older than :data:`STALE_PROBE_S`). The record also keeps what each stored weight
format costs on the matmul kernels the engine runs (:class:`KernelCosts`, ``offload.kernel_probe``), under a
:func:`kernel_key` (ISA level, C kernel build, torch, threads): another level or build probes them again.
The RAM buffers are sized from the memory this process may still take (:func:`mem_probe_bytes`), so a
small cgroup runs the probe rather than being killed by it.
"""

from __future__ import annotations

import errno
import json
import os
import platform
import re
import shutil
import sys
import tempfile
import time
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any, Iterator

import psutil
import torch

from llmsys.kernels.common.cpus import physical_cores, usable_cpus
from llmsys.kernels.common.paths import llmsys_home
from llmsys.kernels.common.units import format_bytes

CACHE_VERSION = 5
BUSY_PROBE_LOAD = 0.25  # cores' worth of other processes' CPU during the host probe above which it is not cached
LOAD_MIN_SECONDS = 0.2  # host probes shorter than this report no load (see probe_host)
CACHE_NAME = "machine.json"  # under $LLMSYS_HOME: one record per machine (see machine_fingerprint)
MEM_PROBE_BYTES = 256 << 20  # per buffer: well above most last-level caches
MIN_MEM_PROBE_BYTES = 16 << 20  # the smallest buffer the RAM probe runs with (a tight cgroup: a rough figure)
MEM_PROBE_SHARE = 8  # the probe's two buffers take at most 2/8 of the memory this process may still take
RAM_FILESYSTEMS = ("tmpfs", "ramfs")  # "disk" reads there come from RAM: the figure is no disk's
PROBE_PREFIX = ".llmsys_bw_"  # the disk probe's scratch file: .llmsys_bw_<pid>_<random>
PROBE_FREE_SHARE = 4  # the probe file takes at most 1/4 of the folder's free space
MIN_DISK_PROBE_BYTES = 8 << 20  # below this (or the probe's own size) the probe is skipped: too little free
ASSUMED_DISK_GBPS = 0.1  # the figure when the probe cannot run: a slow disk's, so nothing plans on a fast one
STALE_PROBE_S = 600.0  # a probe file without a live PID in its name this old is a killed run's (probes take ~1 s)


@dataclass(frozen=True)
class ProbeSettings:
    """Sizes and thread count of the probes: fixed, so figures compare across runs and commands.

    ``threads``: torch threads for the RAM and GEMM probes (``None``: one per
    physical core this process may use), never the caller's ``-t``: the figure
    is the machine's, not the run's. Tests pass small sizes to keep it cheap.
    """

    mem_bytes: int = MEM_PROBE_BYTES  # per buffer, at most (mem_probe_bytes: less where memory is short)
    disk_bytes: int = 64 << 20
    gemm_mnk: tuple[int, int, int] = (32, 2048, 2048)
    repeat: int = 5
    threads: int | None = None
    # The kernel probe (offload.kernel_probe): each format's working set (copies of one matrix, beyond the
    # core's own caches), its matrix [N, K] and the rows of its prompt-sized call.
    kernel_bytes: int = 16 << 20
    kernel_shape: tuple[int, int] = (2048, 1024)
    kernel_rows: int = 64

    def thread_count(self) -> int:
        """``threads``, else one per physical core, at most the CPUs this process may run on."""
        return self.threads or physical_cores(usable_cpus())


DEFAULT_PROBE = ProbeSettings()  # frozen: what every command measures with (tests swap in a smaller one)


@dataclass(frozen=True)
class DiskSpeed:
    """One filesystem's measured sequential cold read, and where it was measured."""

    gbps: float
    folder: str  # where the scratch file was written
    mount: str  # the filesystem's mount point: the key in the cache
    fstype: str
    cached: bool  # the page cache could not be bypassed (tmpfs, no posix_fadvise): an upper bound
    measured: bool = True  # False: the probe could not run (too little free space) and gbps is assumed


@dataclass(frozen=True)
class FormatCost:
    """One stored weight format on this machine's matmul kernels: a call reading ``bytes`` of its weights for
    ``rows`` rows of x takes ``call_s + s_per_byte * bytes + s_per_flop * 2 * weights * (rows - 1)`` seconds.

    ``s_per_byte``: the one-row (decode) cost per stored byte, scales included; ``s_per_flop``: what each
    further row adds (a prompt chunk, a batch); ``call_s``: the fixed cost of a call (Python, dispatch, the
    input's quantization); ``bytes_per_weight``: the probed layer's (scales included); ``kernel``: what ran.
    """

    s_per_byte: float
    s_per_flop: float
    call_s: float
    bytes_per_weight: float
    kernel: str

    def read_s(self, weights: float) -> float:
        """Seconds the one-row pass over ``weights`` weights of this format takes (their bytes read)."""
        return weights * self.bytes_per_weight * self.s_per_byte

    def rows_s(self, weights: float, rows: int) -> float:
        """Seconds the rows of x after the first add over ``weights`` weights (2 FLOPs a weight a row)."""
        return 2.0 * weights * max(rows - 1, 0) * self.s_per_flop

    @property
    def decode_gbps(self) -> float:
        """Stored bytes per second at one row (GB/s)."""
        return 1e-9 / max(self.s_per_byte, 1e-18)

    @property
    def gflops(self) -> float:
        """GFLOP/s of the rows after the first."""
        return 1e-9 / max(self.s_per_flop, 1e-18)


@dataclass(frozen=True)
class KernelCosts:
    """Each stored weight format's :class:`FormatCost`, probed on the real kernels (``offload.kernel_probe``)
    under ``key`` (:func:`kernel_key`: reused only where the ISA level, C kernel build, torch and threads
    are the same)."""

    key: dict[str, Any]
    formats: dict[str, FormatCost]
    probe_load: float = 0.0  # cores' worth of other processes' CPU meanwhile (see Bandwidths.probe_load)
    seconds: float = 0.0  # how long the probe took
    measured_at: float = 0.0

    def cost(self, fmt: str) -> FormatCost | None:
        """``fmt``'s figure, or a probed format run by the same kernel family (None: not probed)."""
        got = self.formats.get(fmt)
        if got is None and fmt in FORMAT_STAND_INS:
            got = self.formats.get(FORMAT_STAND_INS[fmt])
        return got

    @classmethod
    def from_dict(cls, raw: dict[str, Any]) -> "KernelCosts":
        return cls(raw["key"], {k: FormatCost(**v) for k, v in raw["formats"].items()},
                   raw.get("probe_load", 0.0), raw.get("seconds", 0.0), raw.get("measured_at", 0.0))


# Formats the planner may name that the probe does not time, and the probed one whose kernel they run.
FORMAT_STAND_INS = {"float16": "bfloat16", "int4:g32": "int4", "int4:g128": "int4", "nf4:dq": "nf4"}


def _positive_figure(gflops: dict[str, float], dtype: torch.dtype, default: float) -> float:
    """``dtype``'s GFLOP/s, else the slowest other dtype's, else ``default``. A figure of 0 (a probe under
    emulation or on a starved CPU rounds to 0.0) counts as missing: the planner divides by it."""
    got = gflops.get(str(dtype).removeprefix("torch."), 0.0)
    return got if got > 0 else min((v for v in gflops.values() if v > 0), default=default)


@dataclass(frozen=True)
class Bandwidths:
    """Measured sequential bandwidths in GB/s (1e9 bytes per second) and GEMM GFLOP/s.

    ``mem_gbps``: host RAM read bandwidth (a large tensor reduction on
    ``mem_threads`` torch threads) - the roof for CPU decode, which streams
    every weight once per step. ``disk_read_gbps``: sequential cold read of a
    file in ``disk_probe_dir`` (``None``: not measured). ``h2d_gbps``: pinned
    host -> GPU copy; ``gpu_mem_gbps``: on-GPU copy (read + write); both
    ``None`` without a GPU. ``mem_copy_gbps``: a large host tensor copy
    counting read + write bytes (STREAM "copy"). ``disk_cached``: the page cache
    could not be bypassed, so the disk figure is an upper bound.
    ``cpu_gflops`` / ``gpu_gflops``: dtype name -> GEMM GFLOP/s (empty means the
    cost model's defaults).
    """

    mem_gbps: float
    disk_read_gbps: float | None
    h2d_gbps: float | None = None
    gpu_mem_gbps: float | None = None
    mem_copy_gbps: float | None = None
    disk_cached: bool = False
    cpu_gflops: dict[str, float] = field(default_factory=dict)
    gpu_gflops: dict[str, float] = field(default_factory=dict)
    disk_probe_dir: str | None = None  # the folder disk_read_gbps was measured in
    mem_threads: int | None = None  # torch threads the RAM / GEMM probes ran on
    # Cores' worth of CPU other processes used while the host probes ran: above BUSY_PROBE_LOAD the
    # figures are this run's only and are not cached (a probe beside a test suite read RAM at 23.5 GB/s
    # where the quiet machine reads 33.6: every %roof after it would have been 1.4x too high).
    probe_load: float = 0.0
    # Each weight format's cost on this machine's kernels (None: not probed; the planner then uses the
    # roofline of mem_gbps and cpu_gflops).
    kernels: KernelCosts | None = None

    def roof_gbps(self, device_type: str) -> float:
        """Bandwidth that bounds decode on ``device_type`` ("cpu" or "cuda")."""
        if device_type == "cuda" and self.gpu_mem_gbps:
            return self.gpu_mem_gbps
        return self.mem_gbps

    def cpu_flops(self, dtype: torch.dtype) -> float:
        return 1e9 * _positive_figure(self.cpu_gflops, dtype, 20.0)

    def gpu_flops(self, dtype: torch.dtype) -> float:
        return 1e9 * _positive_figure(self.gpu_gflops, dtype, 50_000.0)

    def with_disk(self, disk: DiskSpeed) -> "Bandwidths":
        return replace(self, disk_read_gbps=disk.gbps, disk_cached=disk.cached, disk_probe_dir=disk.folder)

    @classmethod
    def from_dict(cls, raw: dict[str, Any]) -> "Bandwidths":
        kernels = raw.get("kernels")
        return cls(**{**raw, "kernels": KernelCosts.from_dict(kernels) if kernels else None})


def kernel_key(threads: int) -> dict[str, Any]:
    """What must match for cached kernel costs to be reused: the ISA level the C kernels run at, their
    builds (file names hold the level and a hash of sources and flags), torch's version and CPU dispatch,
    and the threads the probe ran on."""
    from llmsys.kernels import cpu_kernels

    ck = cpu_kernels()
    builds = sorted({s.rsplit("/", 1)[-1] for s in ck.kernels.values() if s.startswith("ok:")})
    return {"isa": ck.level, "builds": builds, "torch": torch.__version__, "torch_cpu": ck.torch_capability,
            "onednn_bf16": ck.onednn_bf16, "threads": threads}


def machine_fingerprint() -> dict:
    """What must match for a cached measurement to be reused (the machine, not the run)."""
    model = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return {
        "cpu_model": model,
        # family / model / stepping: a VM's "AMD EPYC" names Zen 3, 4 and 5 alike, whose speeds differ
        "cpu_id": _cpuinfo_fields(("cpu family", "model", "stepping")),
        "cpu_threads": psutil.cpu_count(logical=True) or 1,
        "ram_bytes": psutil.virtual_memory().total,
        "gpu_name": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
        "node": platform.node(),
    }


def _cpuinfo_fields(keys: tuple[str, ...]) -> str:
    """``/proc/cpuinfo``'s first values for ``keys``, joined (empty where there is no such file)."""
    found: dict[str, str] = {}
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            key, _, value = line.partition(":")
            if key.strip() in keys and key.strip() not in found:
                found[key.strip()] = value.strip()
            if len(found) == len(keys) or not line.strip():
                break
    except OSError:
        pass
    return "/".join(found.get(k, "") for k in keys)


def others_cpu_seconds() -> float:
    """CPU seconds every other process (and the hypervisor's steal) has used so far: all CPUs' busy time
    minus this process's own."""
    t = psutil.cpu_times()
    busy = sum(getattr(t, f, 0.0) for f in ("user", "nice", "system", "irq", "softirq", "steal"))
    own = psutil.Process().cpu_times()
    return busy - own.user - own.system


def cache_path() -> Path:
    """The one record of this machine's speeds (``$LLMSYS_HOME/machine.json``)."""
    return llmsys_home() / CACHE_NAME


def default_probe_dir() -> Path:
    """Where the disk probe writes without an ``--offload-dir``: the folder scratch offload files go to."""
    return llmsys_home() / "offload"


@contextmanager
def torch_threads(n: int) -> Iterator[None]:
    """Probe on ``n`` threads and give the caller its own count back."""
    old = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(old)


def filesystem_of(folder: Path) -> tuple[str, str]:
    """(mount point, filesystem type) holding ``folder`` (or its nearest existing parent)."""
    p = folder.expanduser().resolve()
    while not p.exists() and p != p.parent:
        p = p.parent
    while not os.path.ismount(p) and p != p.parent:
        p = p.parent
    fstype = next((d.fstype for d in psutil.disk_partitions(all=True) if Path(d.mountpoint) == p), "")
    return str(p), fstype



def _best(fn, repeat: int = 3) -> float:
    fn()  # warm-up: page faults, allocator
    best = float("inf")
    for _ in range(repeat):
        t = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t)
    return max(best, 1e-9)


def mem_probe_bytes(wanted: int = MEM_PROBE_BYTES) -> int:
    """The RAM probe's buffer size: ``wanted``, less where two buffers would take more than
    1/:data:`MEM_PROBE_SHARE` of the memory this process may still take (the machine's available RAM, or its
    cgroup's room when smaller), never below :data:`MIN_MEM_PROBE_BYTES`."""
    from llmsys.offload.memcap import own_cgroup_room

    room = psutil.virtual_memory().available
    cap = own_cgroup_room()
    if cap is not None:
        room = min(room, cap)
    return max(min(wanted, MIN_MEM_PROBE_BYTES), min(wanted, room // MEM_PROBE_SHARE)) // 4096 * 4096


def probe_mem_gbps(nbytes: int = MEM_PROBE_BYTES, repeat: int = 5) -> float:
    """Host RAM read bandwidth: a sum over a buffer far larger than the caches (the current torch threads)."""
    x = torch.ones(nbytes // 4, dtype=torch.float32)
    return nbytes / _best(lambda: x.sum(), repeat) / 1e9


def probe_mem_copy_gbps(nbytes: int = MEM_PROBE_BYTES, repeat: int = 5) -> float:
    """Host RAM copy bandwidth, read + write bytes counted (STREAM "copy")."""
    src = torch.ones(nbytes // 4, dtype=torch.float32)
    dst = torch.empty_like(src)
    return 2 * nbytes / _best(lambda: dst.copy_(src), repeat) / 1e9


def probe_cpu_gflops(dtype: torch.dtype, m: int = 32, n: int = 2048, k: int = 2048, repeat: int = 3) -> float:
    a = torch.randn(m, k).to(dtype)
    b = torch.randn(n, k).to(dtype)
    dt = _best(lambda: torch.nn.functional.linear(a, b), repeat)
    return 2 * m * n * k / dt / 1e9


def cold_read_gbps(path: Path, chunk: int = 8 << 20) -> float:
    """Sequential read of the whole file after evicting its pages from the page cache (GB/s).

    Where ``posix_fadvise`` is missing the pages cannot be evicted, and the figure
    may be the page cache's speed; callers that care check ``hasattr(os, "posix_fadvise")``.
    """
    fd = os.open(path, os.O_RDONLY)
    try:
        return _cold_read_fd_gbps(fd, chunk)
    finally:
        os.close(fd)


def _cold_read_fd_gbps(fd: int, chunk: int = 8 << 20) -> float:
    """:func:`cold_read_gbps` of an open file, from its start."""
    evict = hasattr(os, "posix_fadvise")
    if evict:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    view = memoryview(bytearray(chunk))
    total, off, t = 0, 0, time.perf_counter()
    while (n := os.preadv(fd, [view], off)) > 0:
        total += n
        off += n
    dt = time.perf_counter() - t
    if evict:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)  # leave the cache as we found it
    return total / max(dt, 1e-9) / 1e9


def probe_disk_read_gbps(folder: Path, nbytes: int = 64 << 20) -> float:
    """Write a file of random bytes (nothing a compressing filesystem can shrink), then time a cold read.

    The file is unlinked as soon as it exists: the open descriptor keeps it, and a
    run killed mid-probe leaves no file behind (the disk space comes back with the process).
    """
    folder.mkdir(parents=True, exist_ok=True)
    fd, path = tempfile.mkstemp(prefix=f"{PROBE_PREFIX}{os.getpid()}_", dir=folder)
    try:
        os.unlink(path)
        chunk = 8 << 20
        for off in range(0, nbytes, chunk):
            data = os.urandom(min(chunk, nbytes - off))
            if os.pwrite(fd, data, off) < len(data):
                raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        os.fsync(fd)
        return _cold_read_fd_gbps(fd)
    finally:
        os.close(fd)


def remove_stale_probe_files(folder: Path, now: float | None = None) -> list[Path]:
    """Delete the disk probe's files a killed run left in ``folder``; returns those removed.

    A file named with a PID is stale once that process is gone (or the file is older than
    :data:`STALE_PROBE_S`: the PID may have been reused); one without a PID (earlier versions)
    once it is older than :data:`STALE_PROBE_S`. A file another process is probing with is kept.
    """
    now = time.time() if now is None else now
    removed: list[Path] = []
    try:
        found = [p for p in folder.iterdir() if p.name.startswith(PROBE_PREFIX)]
    except OSError:  # no folder yet, or not readable: nothing of ours can be there
        return removed
    for p in found:
        m = re.match(rf"{re.escape(PROBE_PREFIX)}(\d+)_", p.name)
        try:
            old = now - p.lstat().st_mtime > STALE_PROBE_S
            if old or (m is not None and not psutil.pid_exists(int(m.group(1)))):
                p.unlink()
                removed.append(p)
        except OSError:
            continue  # gone already (another start removed it), or not ours to remove
    return removed


def probe_disk(folder: Path, nbytes: int) -> DiskSpeed:
    """The disk figure for ``folder``'s filesystem, with where it was measured.

    Never raises for the disk: with too little free space (a probe file of at most a
    quarter of it, at least ``MIN_DISK_PROBE_BYTES``) or a write that fails, one notice
    names the folder and the flag and :data:`ASSUMED_DISK_GBPS` stands in (``measured=False``).
    """
    mount, fstype = filesystem_of(folder)
    where = folder.expanduser().resolve()
    cached = fstype in RAM_FILESYSTEMS or not hasattr(os, "posix_fadvise")
    try:
        folder.mkdir(parents=True, exist_ok=True)
        free = shutil.disk_usage(folder).free
        size = min(nbytes, free // PROBE_FREE_SHARE) // 4096 * 4096
        if size < min(MIN_DISK_PROBE_BYTES, nbytes):
            why = f"only {format_bytes(free)} free, too little for the disk-speed probe"
            return _assumed_disk(where, mount, fstype, cached, why)
        gbps = probe_disk_read_gbps(folder, size)
    except OSError as e:
        return _assumed_disk(where, mount, fstype, cached, f"the disk-speed probe failed ({e.strerror or e})")
    return DiskSpeed(round(gbps, 3), str(where), mount, fstype, cached)


def _assumed_disk(where: Path, mount: str, fstype: str, cached: bool, why: str) -> DiskSpeed:
    """The stand-in figure when the probe cannot run, and its one-line notice."""
    print(f"notice: --offload-dir {where}: {why}; assuming {ASSUMED_DISK_GBPS:g} GB/s disk reads (free space "
          "there, or pass --offload-dir on a disk with room)", file=sys.stderr)
    return DiskSpeed(ASSUMED_DISK_GBPS, str(where), mount, fstype, cached, measured=False)


def probe_host(probe: ProbeSettings) -> Bandwidths:
    """RAM, GEMM and (with a GPU) host-GPU speeds; no disk figure (that is per filesystem)."""
    threads = probe.thread_count()
    others, start = others_cpu_seconds(), time.perf_counter()
    size = mem_probe_bytes(probe.mem_bytes)
    with torch_threads(threads):
        mem = probe_mem_gbps(size, probe.repeat)
        copy = probe_mem_copy_gbps(size, probe.repeat)
        m, n, k = probe.gemm_mnk
        flops = {str(dt).removeprefix("torch."): round(probe_cpu_gflops(dt, m, n, k), 1)
                 for dt in (torch.float32, torch.bfloat16)}
    h2d = gpu_mem = None
    gpu_flops: dict[str, float] = {}
    if torch.cuda.is_available():  # pragma: no cover - untested here (no GPU)
        h2d, gpu_mem, gpu_flops = probe_cuda()
    elapsed = time.perf_counter() - start
    # CPU times tick every 10 ms: a probe shorter than LOAD_MIN_SECONDS cannot tell load from noise
    load = max(0.0, others_cpu_seconds() - others) / elapsed if elapsed >= LOAD_MIN_SECONDS else 0.0
    return Bandwidths(mem_gbps=round(mem, 2), disk_read_gbps=None, h2d_gbps=h2d, gpu_mem_gbps=gpu_mem,
                      mem_copy_gbps=round(copy, 2), cpu_gflops=flops, gpu_gflops=gpu_flops, mem_threads=threads,
                      probe_load=round(load, 2))


def probe_cuda() -> tuple[float, float, dict[str, float]]:  # pragma: no cover - needs a GPU
    """(h2d GB/s from pinned memory, GPU memory GB/s, GPU GFLOP/s per dtype)."""
    n = 256 << 20
    host = torch.empty(n, dtype=torch.uint8).pin_memory()
    dev = torch.empty(n, dtype=torch.uint8, device="cuda")

    def h2d():
        dev.copy_(host, non_blocking=True)
        torch.cuda.synchronize()

    h2d_gbps = n / _best(h2d) / 1e9
    dev2 = torch.empty_like(dev)

    def d2d():
        dev2.copy_(dev)
        torch.cuda.synchronize()

    gpu_mem = 2 * n / _best(d2d) / 1e9
    flops: dict[str, float] = {}
    for dt in (torch.bfloat16, torch.float16, torch.float32):
        a = torch.randn(4096, 4096, device="cuda", dtype=dt)

        def mm():
            a @ a
            torch.cuda.synchronize()

        flops[str(dt).removeprefix("torch.")] = 2 * 4096**3 / _best(mm) / 1e9
    return h2d_gbps, gpu_mem, flops


@dataclass(frozen=True)
class MachineRecord:
    """What ``machine.json`` holds: this machine's host speeds, one disk figure per filesystem, and the
    weight formats' kernel costs (under their :func:`kernel_key`; None until a command asks for them)."""

    fingerprint: dict[str, Any]
    host: Bandwidths  # disk fields and kernels unset
    disks: dict[str, DiskSpeed]  # mount point -> its measured read
    measured_at: float
    kernels: KernelCosts | None = None

    def to_json(self) -> str:
        return json.dumps({"version": CACHE_VERSION, "fingerprint": self.fingerprint, "measured_at": self.measured_at,
                           "host": asdict(replace(self.host, kernels=None)),
                           "disks": {k: asdict(v) for k, v in self.disks.items()},
                           "kernels": asdict(self.kernels) if self.kernels is not None else None}, indent=1)

    @classmethod
    def from_json(cls, text: str) -> "MachineRecord":
        raw = json.loads(text)
        if raw.get("version") != CACHE_VERSION:
            raise ValueError(f"machine.json version {raw.get('version')}, expected {CACHE_VERSION}")
        disks = {k: DiskSpeed(**v) for k, v in raw["disks"].items()}
        kernels = KernelCosts.from_dict(raw["kernels"]) if raw.get("kernels") else None
        return cls(raw["fingerprint"], Bandwidths.from_dict(raw["host"]), disks, raw["measured_at"], kernels)


def read_record() -> MachineRecord | None:
    """This machine's cached record, or ``None`` (missing, unreadable, older format, another machine's)."""
    try:
        rec = MachineRecord.from_json(cache_path().read_text())
    except (OSError, ValueError, TypeError, KeyError):
        return None
    return rec if rec.fingerprint == machine_fingerprint() else None


def _write_record(rec: MachineRecord) -> None:
    path = cache_path()
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(rec.to_json())
        tmp.replace(path)  # atomic: a concurrent reader sees the old record or the new one
    except OSError:
        pass  # a read-only home only costs a re-measurement next time


def current_kernels(rec: MachineRecord | None, threads: int) -> KernelCosts | None:
    """``rec``'s kernel costs when they were probed under this process's :func:`kernel_key`, else None."""
    if rec is None or rec.kernels is None:
        return None
    return rec.kernels if rec.kernels.key == kernel_key(threads) else None


def measure_bandwidths(cache: bool = True, probe_dir: Path | None = None,
                       probe: ProbeSettings | None = None, kernels: bool = False) -> Bandwidths:
    """This machine's speeds from the one record, measuring what it lacks (about 2-5 s the first time).

    The measurement ``llmsys plan``, ``llmsys bench`` and the planner inside
    ``LLM(...)`` all read. With ``cache`` the record in ``$LLMSYS_HOME/machine.json``
    is reused when it was measured on this machine (:func:`machine_fingerprint`);
    ``cache=False`` (``--remeasure``) measures again and replaces it for every
    reader. ``probe_dir`` is the folder whose disk matters (the offload folder;
    default :func:`default_probe_dir`): its filesystem's figure comes from the
    record when there is one, else it is measured and added. ``kernels``: probe the
    weight formats' kernel costs when the record has none under this :func:`kernel_key`
    (``llmsys plan`` and ``llmsys bench`` ask; an engine start only reads what is there,
    so it never waits for the probe).
    """
    probe = probe or DEFAULT_PROBE
    folder = Path(probe_dir) if probe_dir is not None else default_probe_dir()
    rec = read_record() if cache else None
    fresh = rec is None
    if rec is None:
        rec = MachineRecord(machine_fingerprint(), probe_host(probe), {}, time.time())
    keep = fresh and rec.host.probe_load <= BUSY_PROBE_LOAD  # a busy machine's figures are not kept
    costs = current_kernels(rec, probe.thread_count())
    if kernels and costs is None:
        from llmsys.offload.kernel_probe import probe_kernels

        costs = replace(probe_kernels(probe), measured_at=time.time())
        if costs.probe_load <= BUSY_PROBE_LOAD:
            rec, keep = replace(rec, kernels=costs), keep or not fresh
    remove_stale_probe_files(folder)
    mount, _ = filesystem_of(folder)
    disk = rec.disks.get(mount)
    if disk is None:
        disk = probe_disk(folder, probe.disk_bytes)
        if disk.measured:  # an assumed figure is this run's only: a later start with room measures
            rec = replace(rec, disks={**rec.disks, disk.mount: disk})
        keep = keep or not fresh
    if keep:
        _write_record(rec)
    return replace(rec.host.with_disk(disk), kernels=costs)
