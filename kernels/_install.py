"""Install-time build of the C kernels: setuptools hooks named in pyproject.toml.

Compiling on first use needs a compiler on the user's machine and costs seconds in the first command,
so ``pip install .`` / ``pip wheel .`` run :class:`BuildPy`: every kernel for every ISA level of the build
machine's architecture (``_cbuild.LEVELS``) into ``kernels/_built/``, where ``_cbuild.find_or_build`` looks
first. An editable install builds nothing here (kernels compile at run time into ``$LLMSYS_HOME/kernels``,
under a lock); a level the compiler cannot build is left to that fallback, with a warning. setuptools
loads this file by path before llmsys is importable, so it loads ``_cbuild.py`` the same way.
"""

from __future__ import annotations

import importlib.util
import os
import sys
import warnings
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from setuptools.command.build_py import build_py

try:
    from setuptools.command.bdist_wheel import bdist_wheel
except ImportError:  # setuptools < 70.1
    from wheel.bdist_wheel import bdist_wheel


def _load_cbuild():
    name = "_llmsys_install_cbuild"
    spec = importlib.util.spec_from_file_location(name, Path(__file__).with_name("_cbuild.py"))
    mod = importlib.util.module_from_spec(spec)
    sys.modules[name] = mod  # dataclasses look their module up while the file runs
    spec.loader.exec_module(mod)
    return mod


def build_all(out_dir: Path) -> list[str]:
    """Compile every kernel library for every level of this architecture into ``out_dir``; returns
    one line per build that failed (``_cbuild.install_builds``)."""
    cb = _load_cbuild()
    levels = cb.arch_levels()
    cc = cb.compiler()
    if not levels or not cc:
        return [f"no C compiler or no ISA levels for {cb.machine_arch()}: kernels are built at run time"]
    jobs = [(lib, level, out_dir / cb.artifact_name(lib, level)) for lib, level in cb.install_builds()]

    def one(job) -> str | None:
        lib, level, target = job
        err = cb.compile_source(cc, lib, target, level.flags)
        return None if err is None else f"{lib.name} at {level.name}: {err}"

    with ThreadPoolExecutor(max_workers=os.cpu_count() or 1) as pool:
        return [e for e in pool.map(one, jobs) if e]


class BuildPy(build_py):
    """build_py, then the kernels into ``<build_lib>/llmsys/kernels/_built`` (not for editable installs)."""

    def run(self) -> None:
        super().run()
        if getattr(self, "editable_mode", False):
            return
        for err in build_all(Path(self.build_lib) / "llmsys" / "kernels" / "_built"):
            warnings.warn(f"llmsys kernels: {err}", stacklevel=1)


class BdistWheel(bdist_wheel):
    """A wheel holding compiled kernels is tied to its platform (any Python 3, no ABI)."""

    def finalize_options(self) -> None:
        super().finalize_options()
        self.root_is_pure = False

    def get_tag(self) -> tuple[str, str, str]:
        _, _, plat = super().get_tag()
        return "py3", "none", plat
