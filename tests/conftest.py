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


def other_isa_build(source: Path, signatures: dict, flags: tuple[str, ...], tmp_path: Path):
    """A C kernel built with extra ``flags`` (another ISA's code paths) and loaded; skips the calling
    test when the compiler cannot build it."""
    from llmsys.kernels import _cbuild

    cc = os.environ.get("CC") or "gcc"
    err = _cbuild.compile_source(cc, source, tmp_path / "k.so", flags)
    if err:
        pytest.skip(f"{cc} cannot build with {flags}: {err}")
    return _cbuild.load(tmp_path / "k.so", signatures)


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
