"""Shared fixtures: where ../shared lives, tiny random HF checkpoints."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

SHARED = Path(__file__).resolve().parents[1].parent / "shared"
STORIES_HF = SHARED / "models" / "stories260k-hf"
STORIES_C = SHARED / "models" / "stories260k"
CORPUS = SHARED / "corpus"


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
    err = _cbuild.compile_source(cc, source, tmp_path / "k.so", level.flags)
    if err:
        pytest.skip(f"{cc} cannot build level {level_name}: {err}")
    return _cbuild.load(tmp_path / "k.so", signatures)


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
