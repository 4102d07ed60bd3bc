"""What machine a benchmark ran on, and its measured physical limits.

Decode speed is bounded by how fast weights stream (RAM or GPU memory, PCIe, disk), so every bench
row carries a ``%roof`` column from the bandwidths the one machine probe measures
(``llmsys.offload.bandwidth``, cached per machine in ``$LLMSYS_HOME/machine.json``, which ``llmsys plan``
and the offload planner read too), with each weight format's kernel cost the planner predicts from.
API: ``measure_bandwidths(cache=True, probe_dir=None) -> Bandwidths``,
``machine_info(cache=True, probe_dir=None) -> MachineInfo``.
"""

from __future__ import annotations

import platform
from dataclasses import asdict, dataclass, field
from importlib import metadata
from pathlib import Path
from typing import Any

import psutil
import torch

from llmsys.kernels.common.units import format_bytes
from llmsys.kernels import cpu_kernels
from llmsys.offload.bandwidth import BUSY_PROBE_LOAD, Bandwidths, machine_fingerprint, measure_bandwidths


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
            *bandwidth_parts(bw),
        ]
        return " | ".join(parts)


def bandwidth_parts(bw: Bandwidths) -> list[str]:
    """The measured speeds in the words ``llmsys plan --explain`` uses, so the two read alike."""
    notes = [f"{bw.mem_threads} threads"] if bw.mem_threads else []
    if bw.probe_load > BUSY_PROBE_LOAD:
        notes.append(f"other programs used {bw.probe_load:.1f} cores meanwhile: low, not cached")
    parts = [f"RAM read {bw.mem_gbps:.1f} GB/s" + (f" ({'; '.join(notes)})" if notes else "")]
    if bw.kernels is not None:  # the planner's per-format costs (llmsys plan prints them per format)
        kc = bw.kernels
        busy = f"; other programs used {kc.probe_load:.1f} cores meanwhile: not cached" if kc.probe_load > BUSY_PROBE_LOAD else ""
        parts.append(f"kernel probe {len(kc.formats)} formats ({kc.key.get('isa') or 'no C kernels'}, "
                     f"{kc.key.get('threads')} threads{busy})")
    if bw.gpu_mem_gbps:
        parts.append(f"GPU mem {bw.gpu_mem_gbps:.0f} GB/s")
    if bw.h2d_gbps:
        parts.append(f"host-to-device {bw.h2d_gbps:.1f} GB/s")
    if bw.disk_read_gbps is not None:
        where = f" in {bw.disk_probe_dir}" if bw.disk_probe_dir else ""
        parts.append(f"disk read {bw.disk_read_gbps:.2f} GB/s{where}" + (" (page cache: upper bound)" if bw.disk_cached else ""))
    return parts


# --------------------------------------------------------------------------
# Static facts
# --------------------------------------------------------------------------


def _version(pkg: str) -> str | None:
    try:
        return metadata.version(pkg)
    except metadata.PackageNotFoundError:
        return None


def machine_info(cache: bool = True, bandwidths: Bandwidths | None = None, probe_dir: Path | None = None) -> MachineInfo:
    """Describe this machine; bandwidths from the one machine probe (cached; ``cache=False``
    re-measures for every reader) unless given. ``probe_dir``: the folder whose disk counts."""
    fp = machine_fingerprint()
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
        bandwidths=(bandwidths if bandwidths is not None
                    else measure_bandwidths(cache=cache, probe_dir=probe_dir, kernels=True)),
        cpu_kernels=cpu_kernels().summary(),
    )
