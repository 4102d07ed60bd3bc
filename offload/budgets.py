"""Memory budgets per tier: GPU memory, CPU RAM, disk (the offload folder).

A budget is what llmsys may allocate for weights, the KV pool, staging
buffers and activations on that tier. The interpreter and the libraries it
loads (python + torch: ~0.2 GiB of RSS) are the stated overhead on top and are
not part of ``--cpu-mem``. Unset budgets default to what the machine has free
now minus a safety margin, so the default plan never asks for memory that is
not there.
"""

from __future__ import annotations

import tempfile
from dataclasses import dataclass
from pathlib import Path

import psutil
import torch

from llmsys.kernels.common.paths import llmsys_home

# Keep this much free: the OS, the page cache of the files we read and the
# allocator's slack need room, and other processes share the machine.
SAFETY_FRACTION = 0.10
SAFETY_MIN = 512 << 20
GPU_SAFETY = 512 << 20  # CUDA context, cuBLAS workspaces, fragmentation


@dataclass(frozen=True)
class Budgets:
    """Bytes llmsys may use per tier (``gpu`` is None on a CPU-only machine)."""

    cpu: int
    gpu: int | None = None
    offload_dir: Path | None = None  # where converted/quantized layers are written
    cpu_explicit: bool = False  # came from --cpu-mem (not from free memory)
    gpu_explicit: bool = False

    @property
    def has_gpu(self) -> bool:
        return self.gpu is not None


def _free_after_margin(free: int, margin_min: int) -> int:
    return max(free - max(int(free * SAFETY_FRACTION), margin_min), 0)


def resolve_budgets(
    gpu_mem: int | None,
    cpu_mem: int | None,
    offload_dir: str | Path | None,
    device: torch.device,
) -> Budgets:
    """Budgets from flags, defaulting to free memory minus a margin."""
    cpu_free = _free_after_margin(psutil.virtual_memory().available, SAFETY_MIN)
    cpu = cpu_mem if cpu_mem is not None else cpu_free
    gpu = None
    if device.type == "cuda":  # pragma: no cover - no GPU here
        free = torch.cuda.mem_get_info(device)[0]
        gpu = gpu_mem if gpu_mem is not None else _free_after_margin(free, GPU_SAFETY)
    folder = Path(offload_dir).expanduser() if offload_dir else None
    return Budgets(cpu=int(cpu), gpu=None if gpu is None else int(gpu), offload_dir=folder,
                   cpu_explicit=cpu_mem is not None, gpu_explicit=gpu_mem is not None)


def scratch_offload_dir() -> Path:
    """A private folder for offload files when --offload-dir was not given."""
    base = llmsys_home() / "offload"
    base.mkdir(parents=True, exist_ok=True)
    return Path(tempfile.mkdtemp(prefix="run-", dir=base))
