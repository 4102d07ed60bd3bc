"""Input checks shared by the public wrappers.

Kernels index raw memory, so a wrong dtype, shape or stride does not fail
loudly inside them: it silently reads garbage. Every wrapper therefore checks
its inputs first and raises ``ValueError`` naming the op, the argument and
what was expected. (``kernels`` sits below ``engine`` in the import order, so
it cannot raise ``LLMSysError``; these are programming errors anyway.)
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def fail(op: str, msg: str) -> None:
    raise ValueError(f"{op}: {msg}")


def check(
    op: str,
    name: str,
    t: object,
    *,
    ndim: int | None = None,
    dtypes: Sequence[torch.dtype] | None = None,
    shape: Sequence[int | None] | None = None,
    device: torch.device | None = None,
    contiguous: bool = False,
    unit_last_stride: bool = False,
) -> torch.Tensor:
    """Validate one tensor argument; ``None`` entries in ``shape`` are free."""
    if not isinstance(t, torch.Tensor):
        fail(op, f"{name} must be a torch.Tensor, got {type(t).__name__}")
    assert isinstance(t, torch.Tensor)
    if ndim is not None and t.dim() != ndim:
        fail(op, f"{name} must be {ndim}-D, got shape {tuple(t.shape)}")
    if dtypes is not None and t.dtype not in dtypes:
        fail(op, f"{name} dtype must be one of {[str(d) for d in dtypes]}, got {t.dtype}")
    if shape is not None:
        ok = len(shape) == t.dim() and all(s is None or s == n for s, n in zip(shape, t.shape))
        if not ok:
            want = tuple("*" if s is None else s for s in shape)
            fail(op, f"{name} must have shape {want}, got {tuple(t.shape)}")
    if device is not None and t.device != device:
        fail(op, f"{name} is on {t.device} but the other inputs are on {device}")
    if contiguous and not t.is_contiguous():
        fail(op, f"{name} must be contiguous (call .contiguous() first)")
    if unit_last_stride and t.dim() > 0 and t.shape[-1] > 1 and t.stride(-1) != 1:
        fail(op, f"{name} must have unit stride in its last dim, got strides {t.stride()}")
    return t


def check_int8_scales(
    op: str, cache: torch.Tensor, scale: torch.Tensor | None, name: str
) -> None:
    """int8 caches need float32 [num_blocks, block_size, Hk] scales; float caches none."""
    if cache.dtype == torch.int8:
        if scale is None:
            fail(op, f"{name} is required when the cache is int8")
        check(op, name, scale, dtypes=(torch.float32,), shape=tuple(cache.shape[:3]),
              device=cache.device, contiguous=True)
    elif scale is not None:
        fail(op, f"{name} is only meaningful for an int8 cache (cache dtype is {cache.dtype})")


def check_kv_cache(op: str, k_cache: object, v_cache: object, device: torch.device) -> tuple[int, int, int]:
    """Both caches [num_blocks, block_size, Hk, D], same dtype, contiguous -> (bs, Hk, D)."""
    check(op, "k_cache", k_cache, ndim=4, dtypes=FLOAT_DTYPES + (torch.int8,),
          device=device, contiguous=True)
    assert isinstance(k_cache, torch.Tensor)
    check(op, "v_cache", v_cache, dtypes=(k_cache.dtype,), shape=tuple(k_cache.shape),
          device=device, contiguous=True)
    return k_cache.shape[1], k_cache.shape[2], k_cache.shape[3]
