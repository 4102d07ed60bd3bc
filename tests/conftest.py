"""Shared fixtures: where ../shared lives, tiny random HF checkpoints."""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path

import pytest
import torch

from llmsys.kernels import quant_matmul_support

SHARED = Path(__file__).resolve().parents[1].parent / "shared"
STORIES_HF = SHARED / "models" / "stories260k-hf"
STORIES_C = SHARED / "models" / "stories260k"
CORPUS = SHARED / "corpus"
ISA_RUNS = pytest.StashKey[dict]()  # ISA level -> what ran it emulated (tests/test_isa_matrix.py)
SLOW_LEFT_OUT = pytest.StashKey[int]()  # slow-tier tests a whole-suite run without -m left out

# The slower tier (marker ``slow``): test files whose cost is out of proportion to what only they check.
# ``python -m pytest -q`` (the whole suite, no -m) leaves them out and says so; ``python -m pytest -q -m slow``
# runs only them; .ci/run runs both. A file or test named on the command line runs as asked.
SLOW_FILES = {
    "test_isa_matrix.py": "the kernel, quant and model tests again under qemu-x86_64 as Haswell and Nehalem: "
                          "~10 of a 2-core machine's minutes; natively every level the CPU has is tested anyway",
}


# $LLMSYS_HOME entries a test run links from the real home (built once, read by every run: C kernels,
# converted GGUF files, synthetic checkpoints, cached tokenizers, the machine record); everything else a run
# writes as a user's state (pulled models, the KV disk tier's blocks) stays in a home of its own.
SHARED_CACHES = ("kernels", "gguf", "test-gguf", "synthetic", "tokenizers", "offload")
SHARED_FILES = ("machine.json",)
RUN_HOME = pytest.StashKey[Path]()


def _run_home() -> Path:
    """A fresh $LLMSYS_HOME for this run, so a served model never reads KV blocks an earlier run wrote
    (tests/test_kv_disk.py tests reuse on purpose, in their own folders)."""
    from llmsys.kernels.common.paths import llmsys_home

    real = llmsys_home()
    home = Path(tempfile.mkdtemp(prefix="llmsys-test-home-"))
    for name in SHARED_CACHES:
        (real / name).mkdir(parents=True, exist_ok=True)
        (home / name).symlink_to(real / name, target_is_directory=True)
    for name in SHARED_FILES:
        (home / name).symlink_to(real / name)
    for entry in real.iterdir():  # other build caches (llama.cpp's converter source, ...)
        if entry.name not in ("kv", "models") and not (home / entry.name).exists() and entry.is_dir():
            (home / entry.name).symlink_to(entry, target_is_directory=True)
    return home


def pytest_configure(config):
    config.stash[ISA_RUNS] = {}
    config.stash[SLOW_LEFT_OUT] = 0
    config.stash[RUN_HOME] = home = _run_home()
    os.environ["LLMSYS_HOME"] = str(home)  # subprocesses (llmsys serve, chat) inherit it


def pytest_unconfigure(config):
    home = config.stash.get(RUN_HOME, None)
    if home is not None:
        shutil.rmtree(home, ignore_errors=True)  # the links only: rmtree does not follow them


def pytest_collection_modifyitems(config, items):
    for item in items:
        if item.path.name in SLOW_FILES:
            item.add_marker(pytest.mark.slow)
    if config.option.markexpr or config.args_source != pytest.Config.ArgsSource.TESTPATHS:
        return  # -m chose, or paths were named: run what was asked
    slow = [it for it in items if it.get_closest_marker("slow")]
    if slow:
        config.hook.pytest_deselected(items=slow)
        items[:] = [it for it in items if not it.get_closest_marker("slow")]
        config.stash[SLOW_LEFT_OUT] = len(slow)


def pytest_terminal_summary(terminalreporter, exitstatus, config):
    """Which ISA levels ran natively, which emulated, which not at all (the issue's ISA matrix)."""
    from llmsys.kernels import _cbuild

    native, why = _cbuild.selected_level()
    features = _cbuild.cpu_features()[0] or frozenset()
    lines = []
    for level in _cbuild.arch_levels():
        emulated = config.stash[ISA_RUNS].get(level.name, [])
        if level.needs <= features and native is not None:
            where = "native" + (" (the kernels' level)" if level == native else " (kernel tests build it)")
        elif emulated:
            where = "emulated"
        else:
            where = f"not run (this CPU lacks {', '.join(sorted(level.needs - features))})"
        lines.append(f"  {level.name}: {where}" + "".join(f"; {e}" for e in emulated))
    for level in (lv for lv in _cbuild.LEVELS if lv.arch != _cbuild.machine_arch()):
        done = config.stash[ISA_RUNS].get(level.name)
        lines.append(f"  {level.name}: " + ("; ".join(done) if done else "not run (other architecture)"))
    terminalreporter.write_sep("-", f"ISA levels (kernels at {native.name if native else 'none'}: {why})")
    for ln in lines:
        terminalreporter.write_line(ln)
    if config.stash[SLOW_LEFT_OUT]:
        terminalreporter.write_line(f"slow tier: {config.stash[SLOW_LEFT_OUT]} tests left out of this run "
                                    "(python -m pytest -q -m slow runs them; .ci/run runs both tiers)")


def need_shared(path: Path = SHARED) -> Path:
    """Skip the calling test when the read-only ../shared data is absent."""
    if not path.exists():
        pytest.skip(f"{path} is absent: the stories260k model and corpora live in ../shared beside the checkout")
    return path


def other_isa_build(source: Path, signatures: dict, level_name: str, tmp_path: Path):
    """A C kernel built for another ISA level (``kernels._cbuild.LEVELS``) and loaded; skips the
    calling test, naming the level, when this CPU cannot run that level's code or the compiler
    cannot build it."""
    from llmsys.kernels import _cbuild

    level = _cbuild.level_named(level_name)
    if not _cbuild.supports(level):
        pytest.skip(f"ISA level {level_name} not run: this CPU ({_cbuild.machine_arch()}) lacks "
                    f"{sorted(level.needs - (_cbuild.cpu_features()[0] or frozenset()))}")
    cc = _cbuild.compiler() or "gcc"
    # Built once per session and level: the file is named by the hash of the sources, headers and flags
    # (as the run-time cache names it), kept in the session's base temp folder (tmp_path's parent). Each
    # of ~45 tests compiled the whole library again (3-7 s each on 2 cores).
    lib = source if isinstance(source, _cbuild.Library) else _cbuild.Library(source.stem, (source,))
    target = tmp_path.parent / "isa-builds" / _cbuild.artifact_name(lib, level)
    err = None if target.exists() else _cbuild.compile_source(cc, source, target, level.flags)
    if err:
        pytest.skip(f"{cc} cannot build level {level_name}: {err}")
    return _cbuild.load(target, signatures)


# Relative error (norm of the difference over the norm) a quantized CPU layer's output may have against
# the float matmul on its own dequantized weight where the C kernel runs it (every row): the a8 GEMVs
# round x to int8 per 32 columns (~0.5% on Gaussian x; bf16 x alone was ~0.2%).
A8_REL_ERR = 1e-2
# The quantized CPU layers run the C a8 kernels (else torch's dequantize + GEMM paths)
C_KERNEL = quant_matmul_support().available


def x86_levels() -> list[str]:
    """Every x86-64 level's name, for tests that run each one the CPU supports."""
    from llmsys.kernels import _cbuild

    return [lv.name for lv in _cbuild.arch_levels("x86_64")]


@pytest.fixture
def stories_hf() -> Path:
    return need_shared(STORIES_HF)


@pytest.fixture
def stories_c() -> Path:
    return need_shared(STORIES_C)


@pytest.fixture(autouse=True)
def _threads():
    # Two cores on CI: keep each test on a fixed thread count for stable timings.
    torch.set_num_threads(2)
    yield
