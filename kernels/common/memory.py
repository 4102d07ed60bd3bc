"""Large zero-filled CPU buffers whose pages are paid for when first written, and handing freed heap
back to the system.

Why: the KV pool is sized for the longest contexts the engine may serve, but
a one-shot run or a chat uses a small part of it. ``torch.zeros`` writes every
page (a 6 GB pool cost 6 GB of RSS and seconds of startup before the first
token); an anonymous ``mmap`` is zero-filled by the kernel and backed only
where it is touched, so resident memory follows the blocks in use (the block
allocator hands out low ids first and reuses freed ones first). The mapping
lives as long as the tensor (``torch.frombuffer`` holds it).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import mmap
import math

import torch

# Below this a buffer is allocated plainly: a mapping per small tensor is not worth it.
ON_DEMAND_MIN_BYTES = 1 << 20


def zeros_on_demand(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device | str = "cpu") -> torch.Tensor:
    """``torch.zeros(shape, dtype=dtype, device=device)``, with CPU pages backed on first write."""
    device = torch.device(device)
    itemsize = torch.empty((), dtype=dtype).element_size()
    nbytes = math.prod(shape) * itemsize
    if device.type != "cpu" or nbytes < ON_DEMAND_MIN_BYTES:
        return torch.zeros(shape, dtype=dtype, device=device)
    buf = mmap.mmap(-1, nbytes)  # anonymous, private: zero pages until written
    return torch.frombuffer(buf, dtype=dtype).view(shape)


def release_free_heap() -> bool:
    """Return the C heap's free pages to the system (glibc ``malloc_trim(0)``); False where there is none.

    Loading frees many temporaries of up to tens of MB, and glibc raises its mmap threshold as large
    blocks are freed, so later ones come from the heap and stay resident after ``free`` (a GGUF load's RSS
    stayed near twice its weights until trimmed: docs/benchmarks.md). Called once a model is built.
    """
    trim = _malloc_trim()
    return trim is not None and bool(trim(0))


@functools.cache
def _malloc_trim():
    """libc's ``malloc_trim``, looked up once per process (each ``ctypes.CDLL`` makes a class of its own: a
    handle dropped per call would leave reference cycles for the collector), or None (not glibc)."""
    name = ctypes.util.find_library("c")
    if name is None:
        return None
    try:
        trim = ctypes.CDLL(name).malloc_trim
    except (OSError, AttributeError):  # musl, macOS: nothing to call
        return None
    trim.argtypes, trim.restype = [ctypes.c_size_t], ctypes.c_int
    return trim
