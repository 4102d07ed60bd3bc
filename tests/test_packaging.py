"""The installed layout: top-level folders are subpackages of llmsys."""

from __future__ import annotations

import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_every_package_folder_is_listed_in_pyproject():
    listed = set(tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"])
    found = {"llmsys"}
    for init in ROOT.glob("*/**/__init__.py"):
        rel = init.parent.relative_to(ROOT)
        if rel.parts[0] in {"tests", "benchmarks", "docs", "build"} or any(p.startswith(".") for p in rel.parts):
            continue
        found.add("llmsys." + ".".join(rel.parts))
    assert found == listed


def test_public_api_and_no_top_level_engine_module():
    import importlib.util

    from llmsys import LLM, EngineConfig, SamplingParams  # noqa: F401

    assert importlib.util.find_spec("llmsys.engine") is not None
    assert importlib.util.find_spec("llmsys.kernels").origin.endswith("kernels/__init__.py")


def test_c_kernel_sources_ship_with_the_package():
    """The C kernels compile on first use from their sources: a wheel must carry every .c and .h."""
    import fnmatch

    data = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["package-data"]
    patterns = data.get("llmsys.kernels", [])
    sources = [p.name for p in (ROOT / "kernels").iterdir() if p.suffix in (".c", ".h")]
    assert sources and all(any(fnmatch.fnmatch(n, pat) for pat in patterns) for n in sources)
