"""Choosing and finding the C kernels' ISA level: the probe, LLMSYS_CPU_ISA, the cache, the build lock."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

from llmsys.kernels import _cbuild

pytestmark = pytest.mark.skipif(_cbuild.cpu_features()[0] is None,
                                reason=f"no C kernels here: {_cbuild.cpu_features()[1]}")

REPORT = textwrap.dedent("""
    import warnings
    warnings.simplefilter("ignore")
    from llmsys.kernels import _cbuild
    from llmsys.kernels.cpu_report import cpu_kernels
    r = cpu_kernels()
    print(r.level, "|", r.kernels["cpu_qgemv"], "|", " ".join(lv.name for lv in _cbuild.arch_levels() if _cbuild.supports(lv)))
""")


def _report(tmp_path, **env) -> tuple[str, str]:
    full = {**os.environ, "LLMSYS_HOME": str(tmp_path), **env}
    res = subprocess.run([sys.executable, "-c", REPORT], capture_output=True, text=True, timeout=300, env=full)
    assert res.returncode == 0, res.stderr[-2000:]
    level, status, _ = res.stdout.strip().splitlines()[-1].split(" | ")
    return level, status


def _child_supported(tmp_path) -> list[str]:
    """The levels the child process's CPU supports (under qemu-user a child runs natively, not emulated)."""
    full = {**os.environ, "LLMSYS_HOME": str(tmp_path)}
    res = subprocess.run([sys.executable, "-c", REPORT], capture_output=True, text=True, timeout=300, env=full)
    assert res.returncode == 0, res.stderr[-2000:]
    return res.stdout.strip().splitlines()[-1].split(" | ")[2].split()


def test_probe_agrees_with_torch_cpuinfo():
    """The C probe (cpuid) and torch's own cpuinfo see the same CPU."""
    import torch

    features, _ = _cbuild.cpu_features()
    if _cbuild.machine_arch() == "x86_64":
        assert ("avx2" in features) == torch.cpu._is_avx2_supported()
        assert ({"avx512f", "avx512bw", "avx512vl", "avx512dq"} <= features) == torch.cpu._is_avx512_supported()
        assert ("avx512bf16" in features) == torch.cpu._is_avx512_bf16_supported()
    level, why = _cbuild.selected_level()
    assert level == [lv for lv in _cbuild.arch_levels() if lv.needs <= features][-1] and why


def test_forced_lower_level_builds_its_own_file_beside_the_native_one(tmp_path):
    native, status = _report(tmp_path)
    assert status.startswith(f"ok: {native} ")
    low = _cbuild.arch_levels()[0].name
    level, status = _report(tmp_path, LLMSYS_CPU_ISA=low)
    assert level == low and status.startswith(f"ok: {low} (built)")
    built = sorted(p.name.split("-", 1)[1].rsplit("-", 1)[0] for p in tmp_path.glob(f"kernels/{_cbuild.KERNELS.name}-*.so"))
    assert built == sorted({native, low})  # one file per level: a cache shared by two CPUs never mixes them
    assert _report(tmp_path, LLMSYS_CPU_ISA=low)[1].startswith(f"ok: {low} (cached)")


def test_one_library_per_level_holds_every_kernel():
    """Every kernel module's functions come from one library, opened once: the install builds it once per
    level (and the CPU probe once, at the baseline), and the decode stack needs no address from Python."""
    from llmsys.kernels import cpu_decode, cpu_int4, cpu_qgemv

    builds = _cbuild.install_builds()
    levels = _cbuild.arch_levels()
    assert sorted((lib.name, lv.name) for lib, lv in builds) == sorted(
        [(_cbuild.KERNELS.name, lv.name) for lv in levels] + [(_cbuild.FEATURES.name, levels[0].name)])
    assert len({_cbuild.artifact_name(lib, lv) for lib, lv in builds}) == len(builds)
    libs = {id(m._KERNEL.lib()) for m in (cpu_decode, cpu_int4, cpu_qgemv)}
    assert len(libs) == 1 and cpu_qgemv._KERNEL.lib() is _cbuild.open_library(_cbuild.KERNELS)[0]
    assert cpu_decode.kernel_status() == cpu_int4.kernel_status() == cpu_qgemv.kernel_status()
    assert not hasattr(cpu_decode, "rope_store_attend_address")


def test_bad_or_unsupported_level_runs_the_torch_paths_and_says_why(tmp_path):
    level, status = _report(tmp_path, LLMSYS_CPU_ISA="avx9000")
    assert level == "None" and "LLMSYS_CPU_ISA=avx9000 is not a level of" in status and "C kernels off" in status
    above = [lv for lv in _cbuild.arch_levels() if lv.name not in _child_supported(tmp_path)]
    if above:
        level, status = _report(tmp_path, LLMSYS_CPU_ISA=above[0].name)
        assert level == "None" and "needs features this CPU lacks" in status


def test_concurrent_builds_compile_once(tmp_path):
    """Two processes start on an empty cache: the folder lock lets one compile, the other reuses it."""
    code = "from llmsys.kernels import cpu_decode; print(cpu_decode.kernel_status())"
    env = {**os.environ, "LLMSYS_HOME": str(tmp_path)}
    procs = [subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True, env=env)
             for _ in range(2)]
    outs = [p.communicate(timeout=300)[0].strip() for p in procs]
    assert all(o.startswith("ok: ") for o in outs), outs
    hows = sorted(o.split("(")[1].split(")")[0] for o in outs)
    assert hows == ["built", "cached"], outs
    assert len(list(tmp_path.glob(f"kernels/{_cbuild.KERNELS.name}-*.so"))) == 1


def test_no_compiler_still_runs_and_says_so_once(tmp_path, stories_c):
    """No compiler and no prebuilt kernel: `llmsys run` answers on the torch paths, with one line saying why."""
    env = {**os.environ, "LLMSYS_HOME": str(tmp_path), "CC": str(tmp_path / "no-such-cc")}
    res = subprocess.run([sys.executable, "-m", "llmsys.engine.cli.main", "run", str(stories_c), "Once upon a time",
                          "--temperature", "0", "-n", "8", "--quant", "int4"],
                         capture_output=True, text=True, timeout=300, env=env)
    assert res.returncode == 0, res.stderr[-2000:]
    assert res.stdout.strip()  # it answered
    said = [ln for ln in res.stderr.splitlines() if "the torch paths run instead" in ln]
    assert len(said) == 1 and said[0].startswith("notice: C kernels unavailable (") and "no-such-cc" in said[0], \
        res.stderr


def test_no_compiler_on_path_and_no_prebuilt_build_says_how_to_get_one(tmp_path):
    """CC unset and no gcc/cc on PATH, an empty cache, a source with no prebuilt build: the status names the fix."""
    code = ("from llmsys.kernels import _cbuild;"
            "print(_cbuild.find_or_build(_cbuild.KERNELS, _cbuild.arch_levels()[0])[1])")
    env = {k: v for k, v in os.environ.items() if k != "CC"}
    env.update(PATH=str(tmp_path), LLMSYS_HOME=str(tmp_path / "home"))
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, env=env)
    assert res.returncode == 0, res.stderr[-2000:]
    line = res.stdout.strip().splitlines()[-1]
    if line in ("prebuilt", "cached"):
        pytest.skip(f"this install carries a {line} build: the no-compiler branch is not reached")
    assert line == "no C compiler (gcc) on PATH and no prebuilt kernel (install from a wheel or `pip install .`)"


def test_unknown_level_name_is_a_clear_error():
    with pytest.raises(ValueError, match=r"unknown ISA level 'avx9000'; levels: x86-64, x86-64-v2, x86-64-v3"):
        _cbuild.level_named("avx9000")
