"""Memory budgets per tier: GPU memory, CPU RAM, disk (the offload folder).

A budget is what llmsys may allocate on a tier for weights, the KV pool, staging buffers and
activations; the interpreter and its libraries (python + torch RSS) are overhead on top, not part of
``--cpu-mem``. Unset budgets are what is free now minus a margin. Stated sizes (``--kv-cache-tokens``,
``--kv-offload-tokens``, ``--swap-space``) are checked against their tier's free space before anything
is allocated (:func:`check_room`), so they fail at start-up in one line, not mid-run.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path

import psutil
import torch

from llmsys.kernels.common.errors import BudgetError
from llmsys.kernels.common.paths import llmsys_home
from llmsys.kernels.common.units import format_bytes

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


@dataclass(frozen=True)
class SpaceAsk:
    """What one flag will fill on one tier, named as the user wrote it (the error quotes it)."""

    flag: str  # e.g. "--swap-space 1.0 TiB"
    nbytes: int
    tier: str  # "cpu" (RAM) | "disk"
    fix: str  # what to change, e.g. "lower --swap-space"
    folder: Path | None = None  # the disk tier's folder


def ram_available() -> int:
    """Bytes of RAM the OS could hand out now (free + reclaimable page cache)."""
    return psutil.virtual_memory().available


def existing_parent(folder: Path) -> Path:
    """``folder`` or its nearest existing parent (an offload folder is made on first use)."""
    p = Path(folder).expanduser().absolute()
    while not p.exists() and p != p.parent:
        p = p.parent
    return p


def disk_free(folder: Path) -> int:
    """Free bytes on the filesystem that will hold ``folder``."""
    return shutil.disk_usage(existing_parent(folder)).free


def check_room(asks: list[SpaceAsk]) -> None:
    """Raise :class:`BudgetError` for the first ask its tier cannot hold, counting the asks before it
    on the same RAM / filesystem (a swap file and a KV tier in one folder share its free space)."""
    taken: dict[object, tuple[int, list[str]]] = {}
    for ask in asks:
        if ask.nbytes <= 0:
            continue
        if ask.tier == "disk":
            folder = ask.folder or Path(tempfile.gettempdir())
            where: object = os.stat(existing_parent(folder)).st_dev
            free, what = disk_free(folder), f"of disk in {folder}"
        else:
            where, free, what = "ram", ram_available(), "of RAM"
        before, flags = taken.get(where, (0, []))
        if before + ask.nbytes > free:
            left = max(free - before, 0)
            also = f" once {', '.join(flags)} took {format_bytes(before)}" if flags else ""
            raise BudgetError(f"{ask.flag} needs {format_bytes(ask.nbytes)} {what} but {format_bytes(left)} is "
                              f"{'free there' if ask.tier == 'disk' else 'available'}{also}; {ask.fix}")
        taken[where] = (before + ask.nbytes, [*flags, ask.flag.split(" ")[0]])
