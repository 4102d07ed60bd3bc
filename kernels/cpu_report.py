"""Which ISA level the CPU kernels run at, and each C kernel's status: one call, one line.

Why: a figure or a bug report means little without the code path behind it
(an AVX2 laptop runs other kernels than an AVX-512 server, a missing
compiler runs the torch paths). :func:`cpu_kernels` loads every C kernel
(building it if this is an editable install), so callers that run it at
engine start keep compiling out of the first request; ``llmsys bench``
records it with the machine, and ``LLMSYS_DEBUG=1`` prints it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from llmsys.kernels import _cbuild, cpu_decode, cpu_int4, cpu_linear, cpu_qgemv


@dataclass(frozen=True)
class CpuKernels:
    """The level in use (or None), why, torch's own CPU dispatch, and ``{kernel: status line}``."""

    level: str | None
    why: str
    torch_capability: str
    onednn_bf16: bool
    kernels: dict[str, str]

    def summary(self) -> str:
        """``ISA x86-64-v3 (best this CPU supports; torch AVX2, oneDNN bf16 no), C kernels 3/3 (prebuilt)``."""
        ok = [s for s in self.kernels.values() if s.startswith("ok:")]
        hows = sorted({s.split("(", 1)[1].split(")", 1)[0] for s in ok if "(" in s})
        kern = f"C kernels {len(ok)}/{len(self.kernels)}" + (f" ({', '.join(hows)})" if hows else "")
        if len(ok) < len(self.kernels):
            bad = next(s for s in self.kernels.values() if not s.startswith("ok:"))
            kern += f": {bad}"
        return (f"ISA {self.level or 'none'} ({self.why}; torch {self.torch_capability}, "
                f"oneDNN bf16 {'yes' if self.onednn_bf16 else 'no'}), {kern}")


def cpu_kernels() -> CpuKernels:
    """Load every CPU C kernel and report (see the module doc)."""
    level, why = _cbuild.selected_level()
    statuses = {m.__name__.rsplit(".", 1)[1]: m.kernel_status() for m in (cpu_decode, cpu_int4, cpu_qgemv)}
    return CpuKernels(level.name if level else None, why, torch.backends.cpu.get_cpu_capability(),
                      cpu_linear._ONEDNN_BF16, statuses)


@dataclass(frozen=True)
class QuantMatmulSupport:
    """What the quantized layers' CPU matmuls can run in this process (``a8_gemv.c``).

    Read once per layer when it is built (``llmsys.quant``: each layer picks its kernel family
    from this, its device and its format, and keeps it). ``level``: the ISA level the C kernel
    is loaded at, None when it is not (no compiler, ``LLMSYS_NO_CKERNELS=1``, another CPU
    architecture without a build).
    """

    level: str | None

    @property
    def available(self) -> bool:
        return self.level is not None


def quant_matmul_support() -> QuantMatmulSupport:
    """The C quantized-matmul kernel's level and build (loads it on first call; a fact of the process)."""
    if not cpu_qgemv.available():
        return QuantMatmulSupport(None)
    level, _ = _cbuild.selected_level()
    return QuantMatmulSupport(level.name if level else "unknown")
