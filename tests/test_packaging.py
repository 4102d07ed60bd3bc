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
    """A wheel carries every .c and .h: their hash names the builds, and an editable install compiles them."""
    import fnmatch

    data = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["package-data"]
    patterns = data.get("llmsys.kernels", [])
    sources = [p.name for p in (ROOT / "kernels").iterdir() if p.suffix in (".c", ".h")]
    assert sources and all(any(fnmatch.fnmatch(n, pat) for pat in patterns) for n in sources)


def test_wheel_carries_every_level_and_runs_without_a_compiler(tmp_path, stories_c):
    """``pip wheel .`` compiles every kernel for every ISA level of this architecture; installed into a
    fresh venv, ``llmsys run`` loads the prebuilt kernels with no compiler on PATH and an empty cache."""
    import os
    import subprocess
    import sys
    import zipfile

    from llmsys.kernels import _cbuild

    import shutil

    src = tmp_path / "src"  # a copy: setuptools writes build/ beside the sources, never into the checkout
    shutil.copytree(ROOT, src, ignore=shutil.ignore_patterns(".git", "build", "*.egg-info", "__pycache__", "_built"))
    res = subprocess.run([sys.executable, "-m", "pip", "wheel", str(src), "--no-deps", "--no-build-isolation",
                          "-q", "-w", str(tmp_path / "dist")], capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, res.stderr[-2000:]
    (wheel,) = (tmp_path / "dist").glob("llmsys-*.whl")
    assert "-py3-none-" in wheel.name and not wheel.name.endswith("-any.whl")  # tied to the platform
    names = {Path(n).name for n in zipfile.ZipFile(wheel).namelist() if "/_built/" in n}
    want = {_cbuild.artifact_name(src, lv) for src, lv in _cbuild.install_builds()}
    # every kernel library at every level, the CPU probe at the baseline only
    assert len(want) == (len(_cbuild.LIBRARIES) - 1) * len(_cbuild.arch_levels()) + 1 and names == want
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, timeout=120)
    py = venv / "bin" / "python"
    res = subprocess.run([str(py), "-m", "pip", "install", "-q", "--no-deps", "--no-index", str(wheel)],
                         capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr[-2000:]
    # The wheel's dependencies (torch, ...) from wherever this interpreter has them: its own venv's
    # site-packages (the README's setup) or the system's. `venv --system-site-packages` would see only
    # the base interpreter's, which lack torch when torch lives in a venv. Listed after the new venv's
    # own site-packages, so its llmsys is the wheel's.
    site_dir = subprocess.run([str(py), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                              capture_output=True, text=True, check=True, timeout=60).stdout.strip()
    deps = [p for p in sys.path if Path(p).name in ("site-packages", "dist-packages") and Path(p).is_dir()]
    (Path(site_dir) / "_llmsys_test_deps.pth").write_text("\n".join(deps) + "\n")
    assert not any((venv / "bin" / cc).exists() for cc in ("gcc", "cc"))
    env = {**os.environ, "PATH": str(venv / "bin"), "LLMSYS_HOME": str(tmp_path / "home"), "LLMSYS_DEBUG": "1"}
    env.pop("CC", None)  # no compiler anywhere on PATH
    res = subprocess.run([str(venv / "bin" / "llmsys"), "run", str(stories_c), "Once upon a time",
                          "--temperature", "0", "-n", "8", "--quant", "int4"],
                         capture_output=True, text=True, timeout=300, env=env, cwd=tmp_path)
    assert res.returncode == 0, res.stderr[-2000:]
    debug = [ln for ln in res.stderr.splitlines() if ln.startswith("debug: ISA")]
    # "prebuilt": found in the installed package's _built/ (only the wheel's copy has one)
    assert debug and "C kernels 3/3 (prebuilt)" in debug[0], res.stderr
    assert not list((tmp_path / "home").glob("kernels/*.so"))  # nothing compiled at run time


def test_triton_is_an_extra_not_a_base_dependency():
    """A CPU user's `pip install llmsys` does not pull Triton (999 MB); the test extra does."""
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    assert not any(dep.lower().startswith("triton") for dep in project["dependencies"])
    extras = project["optional-dependencies"]
    assert any(dep.startswith("triton") for dep in extras["triton"])
    assert "llmsys[triton]" in extras["test"]


def test_runs_without_triton(stories_c):
    """With `import triton` failing, llmsys still loads and generates (the CPU path needs no Triton)."""
    import subprocess
    import sys

    code = (
        "import sys; sys.modules['triton'] = None\n"  # makes `import triton` raise ImportError
        "from llmsys import LLM, EngineConfig, SamplingParams\n"
        "from llmsys.kernels import triton_available\n"
        "assert not triton_available()\n"
        f"llm = LLM(EngineConfig(model={str(stories_c)!r}))\n"
        "out = llm.generate(['Once upon a time'], SamplingParams(max_tokens=8, temperature=0))[0]\n"
        "print(len(out.token_ids))\n"
    )
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr[-2000:]
    assert res.stdout.strip() == "8"
