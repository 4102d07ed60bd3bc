"""C kernels built for named ISA levels, the level chosen by the running CPU, loaded with ctypes.

Levels, not ``-march=native``: a native build moved to another CPU (a cache, an image, a wheel) died with
SIGILL. Every kernel source links into one library per level (:data:`KERNELS`, opened once per process;
:data:`LEVELS`: x86-64, x86-64-v2, x86-64-v3 AVX2+FMA+F16C, x86-64-v4 AVX-512, v4 + BF16; armv8-a NEON,
armv8.2-a dotprod + fp16), and the best level the CPU supports is loaded, as ``cpu_features.c`` says
(cpuid / hwcaps). The probe stays its own library, built at the baseline: it runs before a level is chosen.
``LLMSYS_CPU_ISA=<level>`` forces a lower level,
``LLMSYS_NO_CKERNELS=1`` turns the kernels off. A build comes from ``_built/`` (install time), else the
cache ``$LLMSYS_HOME/kernels``, else a compile there under a file lock; its name carries the library, the
level and a hash of sources, headers and flags. ``-ffp-contract=off``: no FMA a kernel does not write, so
every level gives the torch definitions' bits. Standard library only: the install hook loads it by path.
"""

from __future__ import annotations

import ctypes
import fcntl
import functools
import hashlib
import os
import platform
import shutil
import subprocess
import tempfile
import warnings
from dataclasses import dataclass
from pathlib import Path

HERE = Path(__file__).resolve().parent
COMMON_FLAGS = ("-O3", "-fopenmp", "-ffp-contract=off", "-fPIC", "-shared")
PREBUILT = HERE / "_built"


@dataclass(frozen=True)
class Library:
    """One shared library: its name (the file's stem) and the C sources compiled and linked into it."""

    name: str
    sources: tuple[Path, ...]


FEATURES = Library("cpu_features", (HERE / "cpu_features.c",))  # the CPU probe, baseline level only
# every kernel, one library per level: row ops and attention, the int4 layout, the GEMVs, the fused layers, the
# GGUF block repacks, the grouped MoE experts
KERNELS = Library("llmsys_kernels", tuple(HERE / f for f in (
    "cpu_decode.c", "cpu_int4.c", "a8_gemv.c", "dense_gemv.c", "fused_layer.c", "decode_stack.c", "repack.c",
    "moe_experts.c")))
LIBRARIES = (FEATURES, KERNELS)  # what the install hook builds
KERNEL_SOURCES = KERNELS.sources


@dataclass(frozen=True)
class IsaLevel:
    """One build target: its name, architecture, compiler flags and the CPU features it needs."""

    name: str
    arch: str  # "x86_64" | "aarch64"
    flags: tuple[str, ...]
    needs: frozenset[str]


_V2 = frozenset({"ssse3", "sse4_1", "sse4_2", "popcnt"})
_V3 = _V2 | {"avx2", "fma", "f16c", "bmi2"}
_V4 = _V3 | {"avx512f", "avx512bw", "avx512dq", "avx512vl", "avx512cd"}
LEVELS: tuple[IsaLevel, ...] = (  # per architecture, lowest first
    IsaLevel("x86-64", "x86_64", ("-march=x86-64", "-mtune=generic"), frozenset()),
    # SSSE3 / SSE4: every x86-64 CPU without AVX still sold (Celeron / Pentium to 2020, Atom): the a8 kernels'
    # byte dot products 128 bits at a time, 2.4-3.7x the x86-64 build's scalar code
    IsaLevel("x86-64-v2", "x86_64", ("-march=x86-64-v2", "-mtune=generic"), _V2),
    IsaLevel("x86-64-v3", "x86_64", ("-march=x86-64-v3", "-mtune=generic"), _V3),
    IsaLevel("x86-64-v4", "x86_64", ("-march=x86-64-v4", "-mtune=generic"), _V4),
    # + BF16 and VNNI: every CPU with AVX512-BF16 has AVX512-VNNI too (Cooper Lake, Sapphire Rapids, Zen 4)
    IsaLevel("x86-64-v4-bf16", "x86_64", ("-march=x86-64-v4", "-mavx512bf16", "-mavx512vnni", "-mtune=generic"),
             _V4 | {"avx512bf16", "avx512vnni"}),
    IsaLevel("armv8-a", "aarch64", ("-march=armv8-a",), frozenset({"neon"})),
    IsaLevel("armv8.2-a-dotprod", "aarch64", ("-march=armv8.2-a+dotprod+fp16",),
             frozenset({"neon", "dotprod", "fp16"})),
)
# cpu_features.c's bits
FEATURE_BITS = {
    "avx2": 0, "fma": 1, "f16c": 2, "bmi2": 3, "avx512f": 4, "avx512bw": 5, "avx512dq": 6, "avx512vl": 7,
    "avx512cd": 8, "avx512bf16": 9, "avx512vnni": 10, "ssse3": 11, "sse4_1": 12, "sse4_2": 13, "popcnt": 14,
    "neon": 16, "dotprod": 17, "fp16": 18,
}


def machine_arch() -> str:
    """``x86_64`` or ``aarch64`` (or whatever else ``platform.machine()`` says: no levels there)."""
    m = platform.machine().lower()
    return {"amd64": "x86_64", "x64": "x86_64", "arm64": "aarch64"}.get(m, m)


def arch_levels(arch: str | None = None) -> tuple[IsaLevel, ...]:
    """The levels of ``arch`` (default: this machine's), lowest first."""
    arch = arch or machine_arch()
    return tuple(lv for lv in LEVELS if lv.arch == arch)


def level_named(name: str) -> IsaLevel:
    for lv in LEVELS:
        if lv.name == name:
            return lv
    raise ValueError(f"unknown ISA level {name!r}; levels: {', '.join(lv.name for lv in LEVELS)}")


def cache_dir() -> Path:
    """Where kernels compiled at run time are kept: ``$LLMSYS_HOME/kernels`` (default ``~/.cache/llmsys``)."""
    # Imported here, not at the top: the install hooks load this file by path before llmsys is
    # importable, and they never reach this run-time cache.
    from llmsys.kernels.common.paths import llmsys_home

    return llmsys_home() / "kernels"


def disabled() -> bool:
    return os.environ.get("LLMSYS_NO_CKERNELS", "0") not in ("", "0")


def artifact_name(lib: Library, level: IsaLevel) -> str:
    """``<name>-<level>-<hash of sources, headers, flags>.so``: the same name at install and at run time."""
    headers = [h.read_bytes() for h in sorted(HERE.glob("*.h"))]  # what the sources include
    flags = " ".join(COMMON_FLAGS + level.flags).encode()
    key = hashlib.sha256(b"\0".join([*(s.read_bytes() for s in lib.sources), *headers, flags])).hexdigest()[:16]
    return f"{lib.name}-{level.name}-{key}.so"


def install_builds(arch: str | None = None) -> list[tuple[Library, IsaLevel]]:
    """Every (library, level) an install compiles: each kernel library at every level of ``arch``, the CPU
    probe at the baseline only (it must run on any CPU of the architecture, and is only loaded there)."""
    levels = arch_levels(arch)
    return [(lib, lv) for lib in LIBRARIES for lv in (levels[:1] if lib is FEATURES else levels)]


def compiler() -> str | None:
    return os.environ.get("CC") or shutil.which("gcc") or shutil.which("cc")


def compile_source(cc: str, source: Library | Path, target: Path, level_flags: tuple[str, ...]) -> str | None:
    """Compile a library's sources (or one source file) into the shared library ``target`` with
    ``level_flags`` (atomically); returns an error line, or None."""
    sources = source.sources if isinstance(source, Library) else (source,)
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
        tmp_so = Path(tmp) / target.name
        res = subprocess.run([cc, *COMMON_FLAGS, *level_flags, "-o", str(tmp_so), *map(str, sources)],
                             capture_output=True, text=True, timeout=300)
        if res.returncode != 0:
            return f"{cc} failed: {(res.stderr or res.stdout).strip().splitlines()[-1:]}"
        os.replace(tmp_so, target)  # atomic: a reader sees no half-written file
    return None


def find_or_build(lib: Library, level: IsaLevel) -> tuple[Path | None, str]:
    """The build of ``lib`` for ``level``: ``(path or None, how: "prebuilt" / "cached" / "built" / why not)``."""
    name = artifact_name(lib, level)
    if (PREBUILT / name).exists():
        return PREBUILT / name, "prebuilt"
    target = cache_dir() / name
    if target.exists():
        return target, "cached"
    cc = compiler()
    if not cc:
        return None, "no C compiler (gcc) on PATH and no prebuilt kernel (install from a wheel or `pip install .`)"
    target.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(target.parent, os.O_RDONLY)  # the cache folder is the lock: no lock files left behind
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)  # another process building into this cache: wait, then reuse its build
        if target.exists():
            return target, "cached"
        error = compile_source(cc, lib, target, level.flags)
    finally:
        os.close(fd)  # releases the lock
    return (None, error) if error else (target, "built")


def declare(lib: ctypes.CDLL, signatures: dict[str, list]) -> None:
    """Each function named in ``signatures`` returns int and takes ``signatures[name]`` (AttributeError: missing)."""
    for name, argtypes in signatures.items():
        fn = getattr(lib, name)
        fn.restype = ctypes.c_int
        fn.argtypes = argtypes


def load(path: Path, signatures: dict[str, list]) -> ctypes.CDLL:
    """Load a compiled library (another build than :func:`open_library`'s: tests, benchmarks) with ``signatures``."""
    lib = ctypes.CDLL(str(path))
    declare(lib, signatures)
    return lib


@functools.lru_cache(maxsize=1)  # a fact about this process's CPU
def cpu_features() -> tuple[frozenset[str] | None, str]:
    """The CPU's features from ``cpu_features.c`` built at the baseline level: ``(names or None, status)``."""
    levels = arch_levels()
    if not levels:
        return None, f"no ISA levels for architecture {machine_arch()!r}"
    if disabled():
        return None, "disabled by LLMSYS_NO_CKERNELS"
    try:
        path, how = find_or_build(FEATURES, levels[0])
        if path is None:
            return None, how
        bits = load(path, {"llmsys_cpu_features": []}).llmsys_cpu_features()
    except (OSError, AttributeError, subprocess.SubprocessError) as exc:
        return None, f"build or load failed: {exc}"
    return frozenset(n for n, b in FEATURE_BITS.items() if bits >> b & 1), "ok"


@functools.lru_cache(maxsize=1)
def selected_level() -> tuple[IsaLevel | None, str]:
    """The level the kernels load: the best the CPU supports, or ``LLMSYS_CPU_ISA``'s: ``(level or None, why)``."""
    features, status = cpu_features()
    if features is None:
        return None, status
    supported = [lv for lv in arch_levels() if lv.needs <= features]
    forced = os.environ.get("LLMSYS_CPU_ISA", "").strip()
    if not forced:
        return supported[-1], "best this CPU supports"
    names = [lv.name for lv in arch_levels()]
    if forced not in names:
        msg = f"LLMSYS_CPU_ISA={forced} is not a level of {machine_arch()} ({', '.join(names)}); C kernels off"
    elif forced not in [lv.name for lv in supported]:
        msg = (f"LLMSYS_CPU_ISA={forced} needs features this CPU lacks "
               f"(best: {supported[-1].name}); C kernels off")
    else:
        return level_named(forced), "forced by LLMSYS_CPU_ISA"
    warnings.warn(msg, RuntimeWarning, stacklevel=2)
    return None, msg


def supports(level: IsaLevel) -> bool:
    """Can this CPU run code built for ``level``?"""
    features, _ = cpu_features()
    return features is not None and level.arch == machine_arch() and level.needs <= features


@functools.lru_cache(maxsize=None)  # a fact about this machine and the sources: built and opened once
def open_library(library: Library) -> tuple[ctypes.CDLL | None, str]:
    """``library`` at :func:`selected_level`, opened: ``(CDLL or None, "ok: <level> (<how>) <path>" or why not)``."""
    if disabled():
        return None, "disabled by LLMSYS_NO_CKERNELS"
    level, why = selected_level()
    if level is None:
        return None, why
    try:
        path, how = find_or_build(library, level)
        if path is None:
            return None, how
        return ctypes.CDLL(str(path)), f"ok: {level.name} ({how}) {path}"
    except (OSError, subprocess.SubprocessError) as exc:
        return None, f"build or load failed: {exc}"


class Kernel:
    """A kernel module's view of a C library (:func:`open_library`: one per process): the library with the
    module's functions' signatures set, or the reason there is none.

    A kernel module holds one and re-exports :meth:`available` and :meth:`status`.
    """

    def __init__(self, library: Library, signatures: dict[str, list]):
        self.library = library
        self.signatures = signatures

    @functools.cached_property
    def _loaded(self) -> tuple[ctypes.CDLL | None, str]:
        lib, status = open_library(self.library)
        if lib is None:
            return None, status
        try:
            declare(lib, self.signatures)
        except AttributeError as exc:  # a function the build lacks
            return None, f"build or load failed: {exc}"
        return lib, status

    def lib(self) -> ctypes.CDLL | None:
        """The loaded library, or None (then the callers' torch path runs)."""
        return self._loaded[0]

    def status(self) -> str:
        """``"ok: <level> (<prebuilt|cached|built>) <path>"`` when the library is loaded, else why not."""
        return self._loaded[1]

    def available(self) -> bool:
        return self._loaded[0] is not None
