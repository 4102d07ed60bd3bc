"""Compile a C kernel on first use, cache it on disk, load it with ctypes.

Shared by the CPU kernels (``cpu_int4.c``, ``cpu_decode.c``): each is built
with ``gcc -O3 -march=native -fopenmp -ffp-contract=off -shared`` into
``$LLMSYS_HOME/kernels`` (default ``~/.cache/llmsys/kernels``), named by a
hash of the source, flags, compiler and CPU, so a changed file or another CPU
builds afresh and a second process reuses the build. ``-ffp-contract=off``: no
fused multiply-adds, so every product and sum rounds once, as the torch
definitions of the kernels compute them. Without a compiler, when the build
fails, or with ``LLMSYS_NO_CKERNELS=1``, callers get ``None`` and a reason and
run their torch path instead.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import platform
import shutil
import subprocess
import tempfile
from pathlib import Path

FLAGS = ("-O3", "-march=native", "-fopenmp", "-ffp-contract=off", "-fPIC", "-shared")


def cache_dir() -> Path:
    """Where compiled kernels are kept: ``$LLMSYS_HOME/kernels`` (default ``~/.cache/llmsys``)."""
    return Path(os.environ.get("LLMSYS_HOME") or "~/.cache/llmsys").expanduser() / "kernels"


def build(source: Path) -> tuple[Path | None, str]:
    """Compile ``source`` (once per source/compiler/CPU): ``(path of the .so or None, status line)``."""
    if os.environ.get("LLMSYS_NO_CKERNELS", "0") not in ("", "0"):
        return None, "disabled by LLMSYS_NO_CKERNELS"
    cc = os.environ.get("CC") or shutil.which("gcc")
    if not cc:
        return None, "no C compiler (gcc) on PATH"
    try:
        version = subprocess.run([cc, "--version"], capture_output=True, text=True, timeout=30).stdout
        headers = [h.read_bytes() for h in sorted(source.parent.glob("*.h"))]  # what the sources include
        key = hashlib.sha256(b"\0".join([source.read_bytes(), *headers, " ".join(FLAGS).encode(), version.encode(),
                                         cpu_signature().encode()])).hexdigest()[:16]
        target = cache_dir() / f"{source.stem}-{key}.so"
        if not target.exists():
            error = compile_source(cc, source, target)
            if error:
                return None, error
        return target, f"ok: {target}"
    except (OSError, subprocess.SubprocessError) as exc:
        return None, f"build or load failed: {exc}"


def compile_source(cc: str, source: Path, target: Path, extra_flags: tuple[str, ...] = ()) -> str | None:
    """Compile ``source`` to ``target`` (atomically); returns an error line, or None.

    ``extra_flags`` (e.g. ``-mno-avx512f``) build the other code paths for the tests.
    """
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
        tmp_so = Path(tmp) / target.name
        res = subprocess.run([cc, *FLAGS, *extra_flags, "-o", str(tmp_so), str(source)],
                             capture_output=True, text=True, timeout=300)
        if res.returncode != 0:
            return f"{cc} failed: {(res.stderr or res.stdout).strip().splitlines()[-1:]}"
        os.replace(tmp_so, target)  # atomic: concurrent builders each write their own temp file
    return None


def build_and_load(source: Path, signatures: dict[str, list]) -> tuple[ctypes.CDLL | None, str]:
    """:func:`build` then :func:`load`: ``(library or None, status line)``; callers memoize it per process."""
    path, status = build(source)
    if path is None:
        return None, status
    try:
        return load(path, signatures), status
    except (OSError, AttributeError) as exc:
        return None, f"build or load failed: {exc}"


class Kernel:
    """One C source, built and loaded on first use and then kept for the process.

    The outcome (a library, or the reason there is none) is a fact about this
    machine and source, like ``cpu_linear._ONEDNN``, so it is computed once.
    A kernel module holds one and re-exports :meth:`available` and :meth:`status`.
    """

    def __init__(self, source: Path, signatures: dict[str, list]):
        self.source = source
        self.signatures = signatures

    @functools.cached_property
    def _loaded(self) -> tuple[ctypes.CDLL | None, str]:
        return build_and_load(self.source, self.signatures)

    def lib(self) -> ctypes.CDLL | None:
        """The loaded library, or None (then the callers' torch path runs)."""
        return self._loaded[0]

    def status(self) -> str:
        """``"ok: <path>"`` when the library is loaded, else why not."""
        return self._loaded[1]

    def available(self) -> bool:
        return self._loaded[0] is not None


def load(path: Path, signatures: dict[str, list]) -> ctypes.CDLL:
    """Load a compiled kernel; each named function returns int and takes ``signatures[name]``."""
    lib = ctypes.CDLL(str(path))
    for name, argtypes in signatures.items():
        fn = getattr(lib, name)
        fn.restype = ctypes.c_int
        fn.argtypes = argtypes
    return lib


def cpu_signature() -> str:
    """-march=native code is only valid on the CPU it was built for: key the cache by it."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as f:
            lines = [ln for ln in f if ln.startswith(("model name", "flags"))]
        return "".join(sorted(set(lines)))
    except OSError:
        return platform.processor() or platform.machine()
