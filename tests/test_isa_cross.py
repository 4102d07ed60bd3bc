"""The C kernels on the other architecture and on every x86-64 level this CPU runs: built, run, same bits.

aarch64 has no Python or torch here, so ``tests/isa_harness.c`` drives every
kernel on fixed inputs and prints the outputs' bits; it is built with the
kernel sources for each x86-64 level this CPU supports (run natively) and,
with ``aarch64-linux-gnu-gcc``, for each aarch64 level (run under
``qemu-aarch64``, whose default CPU has dot products and fp16). Every build
must print the bits of the baseline x86-64 build: the kernels fix their
arithmetic (summation order, no contraction), so the level may change the
speed, never the answer.

``tests/isa_prims.c`` checks the ISA primitives of ``kernels/isa.h`` (the NEON,
x86 and scalar families) against their plain-C definitions on random and
extreme inputs, per level, and aarch64 also with ``-DLLMSYS_NO_NEON``.
"""

from __future__ import annotations

import shutil
import struct
import subprocess
from pathlib import Path

import pytest

from conftest import ISA_RUNS

from llmsys.kernels import _cbuild

ROOT = Path(__file__).resolve().parents[1]
KERNELS = [str(p.relative_to(ROOT)) for p in _cbuild.KERNEL_SOURCES]
CROSS = shutil.which("aarch64-linux-gnu-gcc")
QEMU_ARM = shutil.which("qemu-aarch64")
SYSROOT = Path("/usr/aarch64-linux-gnu")
needs_cross = pytest.mark.skipif(CROSS is None, reason="aarch64-linux-gnu-gcc not installed "
                                                       "(apt-get install gcc-aarch64-linux-gnu): no aarch64 build")
pytestmark = pytest.mark.skipif(_cbuild.machine_arch() != "x86_64", reason="cross builds are made from x86-64")


PRIM_FLAGS = ("-O3", "-ffp-contract=off", "-Ikernels")


def _prims(cc: str, flags: tuple[str, ...], out: Path, qemu: bool) -> dict[str, tuple[str, int, str]]:
    """tests/isa_prims.c built with ``flags`` and run: case -> (family, mismatches against the definitions, hex)."""
    res = subprocess.run([cc, *PRIM_FLAGS, *flags, "-o", str(out), "tests/isa_prims.c", "-lm"],
                         capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert res.returncode == 0, f"{cc} {flags}: {res.stderr[-2000:]}"
    run = subprocess.run([QEMU_ARM, "-L", str(SYSROOT), str(out)] if qemu else [str(out)],
                         capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-2000:]
    out_lines = {}
    for ln in run.stdout.splitlines():
        name, family, bad, data = ln.split()
        out_lines[name] = (family, int(bad), data)
    return out_lines


@pytest.fixture(scope="module")
def prims_baseline(tmp_path_factory):
    cc = _cbuild.compiler()
    if cc is None:
        pytest.skip("no C compiler: no primitives build to compare")
    base = _prims(cc, _cbuild.arch_levels("x86_64")[0].flags, tmp_path_factory.mktemp("prims") / "p-x86-64", False)
    assert {fam for fam, _, _ in base.values()} == {"scalar"}  # the baseline build is the definitions' family
    return base


def _check_prims(got: dict, baseline: dict, family: str) -> None:
    assert set(got) == set(baseline)
    assert {fam for fam, _, _ in got.values()} == {family}
    assert [name for name, (_, bad, _) in got.items() if bad] == []  # each primitive == its definition in-build
    assert [name for name in baseline if got[name][2] != baseline[name][2]] == []  # and the baseline's bits


@pytest.mark.parametrize("level", [lv.name for lv in _cbuild.arch_levels("x86_64")[1:]])
def test_x86_primitives_give_their_definitions_bits(level, prims_baseline, tmp_path):
    lv = _cbuild.level_named(level)
    if not _cbuild.supports(lv):
        pytest.skip(f"ISA level {level} not run: this CPU lacks {sorted(lv.needs - _cbuild.cpu_features()[0])}")
    family = "x86-avx2" if "avx2" in lv.needs else "x86-ssse3"
    _check_prims(_prims(_cbuild.compiler(), lv.flags, tmp_path / f"p-{level}", False), prims_baseline, family)


def _needs_qemu():
    if CROSS is None:
        pytest.skip("aarch64-linux-gnu-gcc not installed (apt-get install gcc-aarch64-linux-gnu): no aarch64 build")
    if QEMU_ARM is None or not (SYSROOT / "lib").exists():
        pytest.skip("qemu-aarch64 or the aarch64 libraries are missing (apt-get install qemu-user libc6-arm64-cross)")


@pytest.mark.parametrize("level,extra,family", [("armv8-a", (), "neon"), ("armv8.2-a-dotprod", (), "neon-dotprod"),
                                                ("armv8-a", ("-DLLMSYS_NO_NEON",), "scalar")])
def test_neon_primitives_give_the_x86_bits_under_qemu(level, extra, family, prims_baseline, tmp_path):
    """Widening multiplies (armv8-a) and vdotq_s32 (dotprod) for the byte dots, float32x4 lanes for the float
    sums, the NEON exp: each equal to its definition in the same build and to the x86-64 build's bits."""
    _needs_qemu()
    got = _prims(CROSS, (*_cbuild.level_named(level).flags, *extra), tmp_path / "p-arm", True)
    _check_prims(got, prims_baseline, family)


def test_primitives_check_sees_a_fused_multiply_add(prims_baseline, tmp_path):
    """The check can fail: the NEON build with contraction on (vmulq + vaddq fused into fmla, the product no
    longer rounded) prints other float sums than the x86-64 build, while the integer dots stay the same."""
    _needs_qemu()
    got = _prims(CROSS, (*_cbuild.level_named("armv8-a").flags, "-ffp-contract=fast"), tmp_path / "p-fma", True)
    changed = {name for name in prims_baseline if got[name][2] != prims_baseline[name][2]}
    assert {"dot_f32", "dot_f32_bf16", "axpy_f32"} <= changed
    assert not any(name.startswith(("dot_i8", "dot32_i8", "i4_dot64")) for name in changed)


def _build_harness(cc: str, level: _cbuild.IsaLevel, out: Path, extra: tuple[str, ...] = ()) -> Path:
    res = subprocess.run([cc, *_cbuild.COMMON_FLAGS[:-2], *level.flags, *extra, "-o", str(out), "tests/isa_harness.c",
                          *KERNELS, "-lm"], capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert res.returncode == 0, f"{cc} at {level.name}: {res.stderr[-2000:]}"
    return out


def _run(cmd: list[str]) -> dict[str, bytes]:
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr[-2000:]
    out = {}
    for line in res.stdout.splitlines():
        name, rc, data = line.split()
        assert rc == "rc=0", line[:80]
        out[name] = bytes.fromhex(data)
    return out


def _same(a: dict[str, bytes], b: dict[str, bytes]) -> list[str]:
    """Names whose outputs differ (attention: more than 1e-6 relative, for another libm's expf)."""
    bad = []
    for name, want in a.items():
        got = b[name]
        if got == want:
            continue
        if name == "attention_f32":
            fa, fb = struct.unpack(f"{len(want) // 4}f", want), struct.unpack(f"{len(got) // 4}f", got)
            if all(abs(x - y) <= 1e-6 * max(abs(x), 1e-3) for x, y in zip(fa, fb)):
                continue
        bad.append(name)
    return bad


@pytest.fixture(scope="module")
def baseline(tmp_path_factory):
    cc = _cbuild.compiler()
    if cc is None:
        pytest.skip("no C compiler: no kernel build to compare")
    exe = _build_harness(cc, _cbuild.arch_levels("x86_64")[0], tmp_path_factory.mktemp("isa") / "h-x86-64")
    return _run([str(exe)])


@pytest.mark.parametrize("level", [lv.name for lv in _cbuild.arch_levels("x86_64")[1:]])
def test_every_x86_level_gives_the_baseline_bits(level, baseline, tmp_path):
    lv = _cbuild.level_named(level)
    if not _cbuild.supports(lv):
        pytest.skip(f"ISA level {level} not run: this CPU lacks {sorted(lv.needs - _cbuild.cpu_features()[0])}")
    exe = _build_harness(_cbuild.compiler(), lv, tmp_path / f"h-{level}")
    assert _same(baseline, _run([str(exe)])) == []


@needs_cross
@pytest.mark.parametrize("level", [lv.name for lv in _cbuild.arch_levels("aarch64")])
def test_aarch64_builds_and_gives_the_baseline_bits(level, baseline, tmp_path, request):
    lv = _cbuild.level_named(level)
    for lib in _cbuild.LIBRARIES:  # the shared objects a wheel for aarch64 would carry
        err = _cbuild.compile_source(CROSS, lib, tmp_path / f"{lib.name}.so", lv.flags)
        assert err is None, f"{lib.name} at {level}: {err}"
    exe = _build_harness(CROSS, lv, tmp_path / f"h-{level}")
    if QEMU_ARM is None or not (SYSROOT / "lib").exists():
        request.config.stash[ISA_RUNS].setdefault(level, []).append("cross-built only (no qemu-aarch64)")
        pytest.skip("qemu-aarch64 or the aarch64 libraries are missing: built, not run")
    assert _same(baseline, _run([QEMU_ARM, "-L", str(SYSROOT), str(exe)])) == []
    request.config.stash[ISA_RUNS].setdefault(level, []).append(
        "cross-built; qemu-aarch64: the C kernels (NEON: kernels/isa_neon.h) give the x86-64 bits (tests/isa_harness.c)")


def test_aarch64_scalar_build_gives_the_baseline_bits(baseline, tmp_path):
    """-DLLMSYS_NO_NEON: the kernels over isa.h's scalar family on aarch64 (the build the NEON one is timed
    against, benchmarks/isa_decode_step.c) give the same bits too."""
    _needs_qemu()
    exe = _build_harness(CROSS, _cbuild.level_named("armv8-a"), tmp_path / "h-arm-scalar", ("-DLLMSYS_NO_NEON",))
    assert _same(baseline, _run([QEMU_ARM, "-L", str(SYSROOT), str(exe)])) == []
