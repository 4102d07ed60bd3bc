"""Which implementation a wrapper runs: Triton on CUDA, plain torch elsewhere.

This is the only place that *tries* ``import triton``; the Triton kernel modules
(``triton_*.py``) import it unconditionally and are imported lazily from here,
so ``llmsys.kernels`` imports and works (references only) on machines where
Triton is missing or broken. Nothing outside ``kernels/`` imports triton.

``TRITON_INTERPRET=1`` makes Triton run kernels on CPU tensors through its
interpreter; the tests use that to check every kernel without a GPU. It must be
set before the first ``import triton`` in the process.
"""

from __future__ import annotations

import os
from types import ModuleType
from typing import Literal

import torch

Impl = Literal["auto", "triton", "reference"]
_IMPLS = ("auto", "triton", "reference")


def triton_available() -> bool:
    """True when ``import triton`` succeeds (after the first success this is a
    ``sys.modules`` lookup; callers on CPU never reach it in ``auto`` mode)."""
    try:
        import triton  # noqa: F401
        import triton.language  # noqa: F401  (a broken install fails here)
    except Exception:  # ImportError, or a broken install raising anything else
        return False
    return True


def interpreter_enabled() -> bool:
    """True when Triton kernels run on CPU via the interpreter."""
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def use_triton(impl: str, device: torch.device, op: str) -> bool:
    """Decide the backend for one call.

    ``auto``: Triton for CUDA tensors when Triton imports, else the torch
    reference. ``triton``: force the kernel (CUDA, or CPU under the
    interpreter); raises when it cannot run. ``reference``: always torch.
    """
    if impl not in _IMPLS:
        raise ValueError(f"{op}: impl must be one of {_IMPLS}, got {impl!r}")
    if impl == "reference":
        return False
    if impl == "auto":
        return device.type == "cuda" and triton_available()
    runnable = (device.type == "cuda" or interpreter_enabled()) and triton_available()
    if not runnable:
        raise ValueError(
            f"{op}: impl='triton' needs triton installed and CUDA tensors "
            f"(or TRITON_INTERPRET=1 for CPU); got device {device}, "
            f"triton available={triton_available()}; use impl='auto' instead"
        )
    return True


def triton_module(name: str) -> ModuleType:
    """Import one of the ``llmsys.kernels.triton_*`` modules on first use."""
    import importlib

    return importlib.import_module(f"llmsys.kernels.{name}")
