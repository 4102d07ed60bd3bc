"""What machine a benchmark ran on, and its measured physical limits.

A tok/s figure means little without the hardware next to it, and decode speed
is bounded by how fast weights can be streamed: from RAM (or GPU memory), over
PCIe (host -> device) or from disk when weights are offloaded. Those
bandwidths are *measured* here (once, then cached in
``$LLMSYS_HOME/machine.json``) so every bench row can show a ``%roof`` column,
and the offload planner can predict what a tier split will cost.

Public API::

    measure_bandwidths(cache=True) -> Bandwidths
    machine_info(cache=True) -> MachineInfo
"""

from __future__ import annotations

import json
import os
import platform
import tempfile
import time
from dataclasses import asdict, dataclass, field
from importlib import metadata
from pathlib import Path
from typing import Any

import psutil
import torch

from llmsys.kernels.common.units import format_bytes
from llmsys.kernels import cpu_kernels
from llmsys.offload.bandwidth import Bandwidths, cold_read_gbps

CACHE_NAME = "machine.json"
_MEM_BYTES = 256 * 1024**2  # per buffer: well above any last-level cache
_DISK_BYTES = 256 * 1024**2
_H2D_BYTES = 256 * 1024**2


@dataclass(frozen=True)
class MachineInfo:
    """Hardware and software a result was measured on (recorded in every row)."""

    cpu_model: str
    cpu_cores: int  # physical
    cpu_threads: int  # logical
    ram_bytes: int
    gpu_name: str | None
    gpu_mem_bytes: int | None
    torch_version: str
    triton_version: str | None
    python_version: str
    os: str
    bandwidths: Bandwidths
    cpu_kernels: str = ""  # ISA level and C kernel status (kernels.cpu_report), e.g. "ISA x86-64-v3 (...)"
    extra: dict[str, Any] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    def summary(self) -> str:
        """One line for a table header."""
        gpu = f"{self.gpu_name} ({format_bytes(self.gpu_mem_bytes or 0)})" if self.gpu_name else "no GPU"
        bw = self.bandwidths
        parts = [
            f"{self.cpu_model} ({self.cpu_cores} cores / {self.cpu_threads} threads)",
            f"RAM {format_bytes(self.ram_bytes)}",
            gpu,
            f"torch {self.torch_version}",
            f"triton {self.triton_version or '-'}",
            *([self.cpu_kernels] if self.cpu_kernels else []),
            f"mem {bw.mem_gbps:.1f} GB/s",
        ]
        if bw.gpu_mem_gbps:
            parts.append(f"GPU mem {bw.gpu_mem_gbps:.0f} GB/s")
        if bw.h2d_gbps:
            parts.append(f"H2D {bw.h2d_gbps:.1f} GB/s")
        if bw.disk_read_gbps is not None:
            parts.append(f"disk {bw.disk_read_gbps:.2f} GB/s" + (" (cached)" if bw.disk_cached else ""))
        return " | ".join(parts)


# --------------------------------------------------------------------------
# Static facts
# --------------------------------------------------------------------------


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _version(pkg: str) -> str | None:
    try:
        return metadata.version(pkg)
    except metadata.PackageNotFoundError:
        return None


def _fingerprint() -> dict[str, Any]:
    """What must match for a cached measurement to be reused."""
    gpu = torch.cuda.get_device_name(0) if torch.cuda.is_available() else None
    return {
        "cpu_model": _cpu_model(),
        "cpu_threads": psutil.cpu_count(logical=True) or 1,
        "ram_bytes": psutil.virtual_memory().total,
        "gpu_name": gpu,
        "node": platform.node(),
    }


# --------------------------------------------------------------------------
# Measurements
# --------------------------------------------------------------------------


def _best_time(fn, reps: int) -> float:
    fn()  # warm-up: page faults, allocator
    best = float("inf")
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best


def measure_mem_read_gbps(nbytes: int = _MEM_BYTES, reps: int = 5) -> float:
    """Host RAM read bandwidth: sum a tensor far larger than the caches."""
    x = torch.ones(nbytes // 4, dtype=torch.float32)
    t = _best_time(lambda: x.sum(), reps)
    return nbytes / t / 1e9


def measure_mem_copy_gbps(nbytes: int = _MEM_BYTES, reps: int = 5) -> float:
    """Host RAM copy bandwidth, read + write bytes counted."""
    src = torch.ones(nbytes // 4, dtype=torch.float32)
    dst = torch.empty_like(src)
    t = _best_time(lambda: dst.copy_(src), reps)
    return 2 * nbytes / t / 1e9


def measure_disk_read_gbps(directory: Path, nbytes: int = _DISK_BYTES) -> tuple[float, bool]:
    """Sequential read of a fresh file with its pages evicted from the cache.

    Returns (GB/s, cached): ``cached`` is True when the kernel could not be
    asked to drop the pages (no ``posix_fadvise``), so the figure may be the
    page cache's speed rather than the disk's.
    """
    directory.mkdir(parents=True, exist_ok=True)
    chunk = os.urandom(8 * 1024**2)  # incompressible, so no filesystem shortcut
    fd, name = tempfile.mkstemp(prefix=".bw-", dir=directory)
    try:
        with os.fdopen(fd, "wb") as fh:
            for _ in range(nbytes // len(chunk)):
                fh.write(chunk)
            fh.flush()
            os.fsync(fh.fileno())
        return cold_read_gbps(Path(name)), not hasattr(os, "posix_fadvise")
    finally:
        os.unlink(name)


def measure_h2d_gbps(nbytes: int = _H2D_BYTES, reps: int = 5) -> float | None:
    if not torch.cuda.is_available():
        return None
    src = torch.ones(nbytes // 4, dtype=torch.float32).pin_memory()
    dst = torch.empty(src.shape, dtype=src.dtype, device="cuda")

    def go():
        dst.copy_(src, non_blocking=True)
        torch.cuda.synchronize()

    return nbytes / _best_time(go, reps) / 1e9


def measure_gpu_mem_gbps(nbytes: int = 1024**3, reps: int = 10) -> float | None:
    if not torch.cuda.is_available():
        return None
    src = torch.ones(nbytes // 4, dtype=torch.float32, device="cuda")
    dst = torch.empty_like(src)

    def go():
        dst.copy_(src)
        torch.cuda.synchronize()

    return 2 * nbytes / _best_time(go, reps) / 1e9


# --------------------------------------------------------------------------
# Cached entry points
# --------------------------------------------------------------------------


def _cache_path() -> Path:
    from llmsys.kernels.common.paths import llmsys_home

    return llmsys_home() / CACHE_NAME


def _read_cache() -> Bandwidths | None:
    path = _cache_path()
    try:
        data = json.loads(path.read_text())
        if data.get("fingerprint") != _fingerprint():
            return None
        return Bandwidths(**data["bandwidths"])
    except (OSError, ValueError, KeyError, TypeError):
        return None


def measure_bandwidths(cache: bool = True) -> Bandwidths:
    """Measure RAM / disk / host->GPU bandwidths (about 5-10 s), or reuse the cache.

    With ``cache=True`` a previous result in ``$LLMSYS_HOME/machine.json`` is
    returned when it was measured on the same machine (CPU, RAM, GPU, host
    name); a fresh measurement is always written back there.
    """
    if cache:
        hit = _read_cache()
        if hit is not None:
            return hit
    from llmsys.kernels.common.paths import llmsys_home

    disk, disk_cached = measure_disk_read_gbps(llmsys_home())
    bw = Bandwidths(
        mem_gbps=round(measure_mem_read_gbps(), 2),
        disk_read_gbps=round(disk, 3),
        h2d_gbps=_round(measure_h2d_gbps()),
        mem_copy_gbps=round(measure_mem_copy_gbps(), 2),
        gpu_mem_gbps=_round(measure_gpu_mem_gbps()),
        disk_cached=disk_cached,
    )
    path = _cache_path()
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(".tmp")
        payload = {"fingerprint": _fingerprint(), "measured_at": time.time(), "bandwidths": asdict(bw)}
        tmp.write_text(json.dumps(payload, indent=2))
        tmp.replace(path)
    except OSError:
        pass  # a read-only home only costs a re-measurement next time
    return bw


def _round(x: float | None, nd: int = 2) -> float | None:
    return None if x is None else round(x, nd)


def machine_info(cache: bool = True, bandwidths: Bandwidths | None = None) -> MachineInfo:
    """Describe this machine; bandwidths measured (or cached) unless given."""
    fp = _fingerprint()
    gpu_mem = torch.cuda.get_device_properties(0).total_memory if torch.cuda.is_available() else None
    return MachineInfo(
        cpu_model=fp["cpu_model"],
        cpu_cores=psutil.cpu_count(logical=False) or fp["cpu_threads"],
        cpu_threads=fp["cpu_threads"],
        ram_bytes=fp["ram_bytes"],
        gpu_name=fp["gpu_name"],
        gpu_mem_bytes=gpu_mem,
        torch_version=torch.__version__,
        triton_version=_version("triton"),
        python_version=platform.python_version(),
        os=f"{platform.system()} {platform.release()}",
        bandwidths=bandwidths if bandwidths is not None else measure_bandwidths(cache=cache),
        cpu_kernels=cpu_kernels().summary(),
    )
