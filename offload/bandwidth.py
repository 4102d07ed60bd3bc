"""Measured machine speeds the placement cost model runs on.

Why measure: the best placement flips with the numbers (a layer in CPU RAM
computed on the CPU beats streaming it to the GPU only while the CPU's memory
bandwidth beats PCIe; disk streaming is only worth planning around with the
disk's real read speed). Each probe takes well under a second and runs once
per machine: results are cached as JSON in ``$LLMSYS_HOME/machine.json``.

:class:`Bandwidths` is the one type for measured machine speeds and
:func:`measure_bandwidths` the one measurement: the planner's cost model and
``llmsys bench``'s %roof column (``engine.bench.machine``) read the same record.
"""

from __future__ import annotations

import json
import os
import platform
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from llmsys.kernels.common.paths import llmsys_home

CACHE_VERSION = 3
CACHE_NAME = "machine.json"  # under $LLMSYS_HOME: one record per machine (see machine_fingerprint)
MEM_PROBE_BYTES = 256 << 20  # per buffer: well above any last-level cache


@dataclass(frozen=True)
class Bandwidths:
    """Measured sequential bandwidths in GB/s (1e9 bytes per second) and GEMM GFLOP/s.

    ``mem_gbps``: host RAM read bandwidth (a large tensor reduction, all torch
    threads) - the roof for CPU decode, which streams every weight once per
    step. ``disk_read_gbps``: sequential cold read of a file where offloaded
    weights live (``None``: not measured). ``h2d_gbps``: pinned host -> GPU copy;
    ``gpu_mem_gbps``: on-GPU copy (read + write); both ``None`` without a GPU.
    ``mem_copy_gbps``: a large host tensor copy counting read + write bytes
    (STREAM "copy"). ``disk_cached``: the page cache could not be dropped, so the
    disk figure is an upper bound. ``cpu_gflops`` / ``gpu_gflops``: dtype name ->
    GEMM GFLOP/s (empty means the cost model's defaults).
    """

    mem_gbps: float
    disk_read_gbps: float | None
    h2d_gbps: float | None = None
    gpu_mem_gbps: float | None = None
    mem_copy_gbps: float | None = None
    disk_cached: bool = False
    cpu_gflops: dict[str, float] = field(default_factory=dict)
    gpu_gflops: dict[str, float] = field(default_factory=dict)

    def roof_gbps(self, device_type: str) -> float:
        """Bandwidth that bounds decode on ``device_type`` ("cpu" or "cuda")."""
        if device_type == "cuda" and self.gpu_mem_gbps:
            return self.gpu_mem_gbps
        return self.mem_gbps

    def cpu_flops(self, dtype: torch.dtype) -> float:
        name = str(dtype).removeprefix("torch.")
        return 1e9 * self.cpu_gflops.get(name, min(self.cpu_gflops.values(), default=20.0))

    def gpu_flops(self, dtype: torch.dtype) -> float:
        name = str(dtype).removeprefix("torch.")
        return 1e9 * self.gpu_gflops.get(name, min(self.gpu_gflops.values(), default=50_000.0))


def machine_fingerprint() -> dict:
    """What must match for a cached measurement to be reused (the machine, not the run)."""
    import psutil

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
        "cpu_threads": psutil.cpu_count(logical=True) or 1,
        "ram_bytes": psutil.virtual_memory().total,
        "gpu_name": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
        "node": platform.node(),
    }


def _cache_path() -> Path:
    return llmsys_home() / CACHE_NAME


def _best(fn, repeat: int = 3) -> float:
    fn()  # warm-up: page faults, allocator
    best = float("inf")
    for _ in range(repeat):
        t = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t)
    return max(best, 1e-9)


def probe_mem_gbps(nbytes: int = MEM_PROBE_BYTES, repeat: int = 5) -> float:
    """Host RAM read bandwidth: a sum over a buffer far larger than the caches (all torch threads)."""
    x = torch.ones(nbytes // 4, dtype=torch.float32)
    return nbytes / _best(lambda: x.sum(), repeat) / 1e9


def probe_mem_copy_gbps(nbytes: int = MEM_PROBE_BYTES, repeat: int = 5) -> float:
    """Host RAM copy bandwidth, read + write bytes counted (STREAM "copy")."""
    src = torch.ones(nbytes // 4, dtype=torch.float32)
    dst = torch.empty_like(src)
    return 2 * nbytes / _best(lambda: dst.copy_(src), repeat) / 1e9


def probe_cpu_gflops(dtype: torch.dtype, m: int = 32, n: int = 2048, k: int = 2048) -> float:
    a = torch.randn(m, k).to(dtype)
    b = torch.randn(n, k).to(dtype)
    dt = _best(lambda: torch.nn.functional.linear(a, b))
    return 2 * m * n * k / dt / 1e9


def cold_read_gbps(path: Path, chunk: int = 8 << 20) -> float:
    """Sequential read of the whole file after evicting its pages from the page cache (GB/s).

    Where ``posix_fadvise`` is missing the pages cannot be evicted, and the figure
    may be the page cache's speed; callers that care check ``hasattr(os, "posix_fadvise")``.
    """
    evict = hasattr(os, "posix_fadvise")
    fd = os.open(path, os.O_RDONLY)
    try:
        if evict:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        view = memoryview(bytearray(chunk))
        total, t = 0, time.perf_counter()
        while (n := os.readv(fd, [view])) > 0:
            total += n
        dt = time.perf_counter() - t
        if evict:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)  # leave the cache as we found it
    finally:
        os.close(fd)
    return total / max(dt, 1e-9) / 1e9


def probe_disk_read_gbps(folder: Path, nbytes: int = 32 << 20) -> float:
    """Write a file, then time a cold sequential read of it."""
    folder.mkdir(parents=True, exist_ok=True)
    buf = torch.ones(nbytes, dtype=torch.uint8)
    fd_, path = tempfile.mkstemp(prefix=".llmsys_bw_", dir=folder)
    try:
        with os.fdopen(fd_, "wb") as f:
            f.write(memoryview(buf.numpy()))
            f.flush()
            os.fsync(f.fileno())
        return cold_read_gbps(Path(path))
    finally:
        os.unlink(path)


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


def measure_bandwidths(cache: bool = True, probe_dir: Path | None = None) -> Bandwidths:
    """Measure this machine's speeds once (about 2-5 s), or reuse the cached record.

    The one measurement the planner's cost model and ``llmsys bench``'s %roof
    both read. With ``cache`` a record in ``$LLMSYS_HOME/machine.json`` is
    reused when it was measured on this machine (CPU, threads, RAM, GPU, host
    name: :func:`machine_fingerprint`); a fresh measurement is written back there.
    ``probe_dir`` is where the disk probe writes its scratch file: the offload
    folder when there is one, since that is the disk that will be read.
    """
    path = _cache_path()
    fp = machine_fingerprint()
    if cache:
        try:
            raw = json.loads(path.read_text())
            if raw.get("version") == CACHE_VERSION and raw.get("fingerprint") == fp:
                return Bandwidths(**raw["bandwidths"])
        except (OSError, ValueError, TypeError, KeyError):
            pass
    mem = probe_mem_gbps()
    copy = probe_mem_copy_gbps()
    flops = {str(dt).removeprefix("torch."): probe_cpu_gflops(dt) for dt in (torch.float32, torch.bfloat16)}
    disk = probe_disk_read_gbps(probe_dir or llmsys_home() / "machine")
    h2d = gpu_mem = None
    gpu_flops: dict[str, float] = {}
    if torch.cuda.is_available():  # pragma: no cover - untested here (no GPU)
        h2d, gpu_mem, gpu_flops = probe_cuda()
    bw = Bandwidths(mem_gbps=round(mem, 2), disk_read_gbps=round(disk, 3), h2d_gbps=h2d, gpu_mem_gbps=gpu_mem,
                    mem_copy_gbps=round(copy, 2), disk_cached=not hasattr(os, "posix_fadvise"),
                    cpu_gflops=flops, gpu_gflops=gpu_flops)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps({"version": CACHE_VERSION, "fingerprint": fp, "measured_at": time.time(),
                                   "bandwidths": asdict(bw)}, indent=1))
        tmp.replace(path)
    except OSError:
        pass  # a read-only home only costs a re-measurement next time
    return bw
