"""The C kernels on the other architecture and on every x86-64 level this CPU runs: built, run, same bits.

aarch64 has no Python or torch here, so ``tests/isa_harness.c`` drives every
kernel on fixed inputs and prints the outputs' bits; it is built with the
kernel sources for each x86-64 level this CPU supports (run natively) and,
with ``aarch64-linux-gnu-gcc``, for each aarch64 level (run under
``qemu-aarch64``, whose default CPU has dot products and fp16). Every build
must print the bits of the baseline x86-64 build: the kernels fix their
arithmetic (summation order, no contraction), so the level may change the
speed, never the answer. The kernels have no hand-written NEON yet: on aarch64
the compiler's auto-vectorization is the SIMD path.
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
KERNELS = ["kernels/cpu_decode.c", "kernels/cpu_int4.c", "kernels/cpu_qgemv.c"]
CROSS = shutil.which("aarch64-linux-gnu-gcc")
QEMU_ARM = shutil.which("qemu-aarch64")
SYSROOT = Path("/usr/aarch64-linux-gnu")
needs_cross = pytest.mark.skipif(CROSS is None, reason="aarch64-linux-gnu-gcc not installed "
                                                       "(apt-get install gcc-aarch64-linux-gnu): no aarch64 build")
pytestmark = pytest.mark.skipif(_cbuild.machine_arch() != "x86_64", reason="cross builds are made from x86-64")


def _build_harness(cc: str, level: _cbuild.IsaLevel, out: Path) -> Path:
    res = subprocess.run([cc, *_cbuild.COMMON_FLAGS[:-2], *level.flags, "-o", str(out), "tests/isa_harness.c",
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
    for src in [*KERNELS, "kernels/cpu_features.c"]:  # the shared objects a wheel for aarch64 would carry
        err = _cbuild.compile_source(CROSS, ROOT / src, tmp_path / (Path(src).stem + ".so"), lv.flags)
        assert err is None, f"{src} at {level}: {err}"
    exe = _build_harness(CROSS, lv, tmp_path / f"h-{level}")
    if QEMU_ARM is None or not (SYSROOT / "lib").exists():
        request.config.stash[ISA_RUNS].setdefault(level, []).append("cross-built only (no qemu-aarch64)")
        pytest.skip("qemu-aarch64 or the aarch64 libraries are missing: built, not run")
    assert _same(baseline, _run([QEMU_ARM, "-L", str(SYSROOT), str(exe)])) == []
    request.config.stash[ISA_RUNS].setdefault(level, []).append(
        "cross-built; qemu-aarch64: the C kernels give the x86-64 bits (tests/isa_harness.c)")
