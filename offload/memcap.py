"""Run a command in a memory cgroup: honest proof that a budget holds.

"Peak memory stays within the budget" is only believable when the kernel
enforces it: a process in a cgroup whose memory limit is below the model's
size is killed the moment it (or the page cache it fills) exceeds the limit.
Supports cgroup v2 (``memory.max``) and v1 (``memory.limit_in_bytes``); needs
root. ``unavailable_reason()`` says why it cannot run here (tests skip with it).
"""

from __future__ import annotations

import os
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path("/sys/fs/cgroup")


@dataclass(frozen=True)
class CappedResult:
    returncode: int
    stdout: str
    stderr: str
    peak_bytes: int | None  # the cgroup's peak charge (RSS + page cache), when the kernel reports it
    limit_bytes: int
    oom_killed: bool


def _v2() -> bool:
    return (ROOT / "cgroup.controllers").exists()


def _v1_memory_root() -> Path | None:
    mem = ROOT / "memory"
    if not (mem / "memory.limit_in_bytes").exists():
        return None
    try:
        for line in Path("/proc/self/cgroup").read_text().splitlines():
            _, ctrls, path = line.split(":", 2)
            if "memory" in ctrls.split(","):
                cand = mem / path.lstrip("/")
                return cand if cand.exists() else mem
    except OSError:
        return None
    return mem


def unavailable_reason() -> str | None:
    """None when a capped run is possible here, else a one-line reason."""
    if os.geteuid() != 0:
        return "memory cgroups need root to create"
    if _v2():
        if "memory" not in (ROOT / "cgroup.controllers").read_text().split():
            return f"{ROOT} is cgroup v2 without the memory controller"
        return None if os.access(ROOT, os.W_OK) else f"{ROOT} is not writable"
    base = _v1_memory_root()
    if base is None:
        return f"no memory cgroup (neither cgroup v2 at {ROOT} nor v1 at {ROOT / 'memory'})"
    return None if os.access(base, os.W_OK) else f"{base} is not writable"


_PREFIX = "llmsys-cap-"  # names of the cgroups run_capped makes (and only those may be tightened)


def run_capped(cmd: list[str], limit_bytes: int, timeout: float = 600, env: dict | None = None,
               cwd: str | None = None) -> CappedResult:
    """Run ``cmd`` inside a fresh memory cgroup capped at ``limit_bytes`` (no swap)."""
    why = unavailable_reason()
    if why:
        raise RuntimeError(why)
    name = f"{_PREFIX}{os.getpid()}-{time.monotonic_ns()}"
    v2 = _v2()
    cg = (ROOT / name) if v2 else (_v1_memory_root() / name)  # type: ignore[operator]
    cg.mkdir()
    try:
        if v2:
            if (ROOT / "cgroup.subtree_control").exists():
                try:
                    (ROOT / "cgroup.subtree_control").write_text("+memory")
                except OSError:
                    pass
            (cg / "memory.max").write_text(str(limit_bytes))
            if (cg / "memory.swap.max").exists():
                (cg / "memory.swap.max").write_text("0")
        else:
            (cg / "memory.limit_in_bytes").write_text(str(limit_bytes))
            if (cg / "memory.memsw.limit_in_bytes").exists():
                try:
                    (cg / "memory.memsw.limit_in_bytes").write_text(str(limit_bytes))
                except OSError:
                    pass
        procs = cg / "cgroup.procs"
        # The shell moves itself into the cgroup, then execs the command: every byte is charged.
        wrapped = ["sh", "-c", f'echo $$ > "{procs}" && exec "$@"', "sh", *cmd]
        p = subprocess.run(wrapped, capture_output=True, text=True, timeout=timeout, env=env, cwd=cwd)
        peak = None
        for f in ("memory.peak", "memory.max_usage_in_bytes"):
            try:
                peak = int((cg / f).read_text().split()[0])
                break
            except (OSError, ValueError, IndexError):
                continue
        oom = p.returncode in (-9, 137)
        try:
            events = (cg / "memory.events").read_text() if v2 else (cg / "memory.oom_control").read_text()
            oom = oom or any(l.split()[0] in ("oom_kill", "oom_kill_disable") and l.split()[1] != "0" and l.startswith("oom_kill ")
                             for l in events.splitlines())
        except OSError:
            pass
        return CappedResult(p.returncode, p.stdout, p.stderr, peak, limit_bytes, oom)
    finally:
        for _ in range(50):
            try:
                cg.rmdir()
                break
            except OSError:
                time.sleep(0.1)


def tighten_own_limit(limit_bytes: int) -> Path:
    """Lower the memory limit of the cgroup this process runs in; returns the file written.

    Why: HF Accelerate loads the whole model before it offloads, so it cannot
    start under a cap smaller than the model. A benchmark starts it in a
    roomy cgroup and the child calls this after loading: from then on it
    decodes under the same cap as llmsys (the kernel reclaims page cache to
    get under it, or OOM-kills the process if its own memory does not fit;
    cgroup v1 instead refuses the write with EBUSY when it cannot reclaim enough).

    Only a cgroup made by :func:`run_capped` is touched: lowering whatever
    cgroup a stray caller sits in (a container's, a session's) would cap far
    more than this process.
    """
    if _v2():
        cg = next((ROOT / line[3:].lstrip("/") for line in Path("/proc/self/cgroup").read_text().splitlines()
                   if line.startswith("0::")), None)
    else:
        cg = _v1_memory_root()  # this process's own memory cgroup (v1)
    if cg is None or not cg.name.startswith(_PREFIX):
        raise RuntimeError(
            f"this process is not in a cgroup made by run_capped (it is in {cg}); refusing to lower that cgroup's limit"
        )
    if _v2():
        f = cg / "memory.max"
        f.write_text(str(limit_bytes))
        return f
    f = cg / "memory.limit_in_bytes"
    f.write_text(str(limit_bytes))  # first: memsw must never be below it
    if (cg / "memory.memsw.limit_in_bytes").exists():
        try:
            (cg / "memory.memsw.limit_in_bytes").write_text(str(limit_bytes))
        except OSError:
            pass
    return f


def own_cgroup_room() -> int | None:
    """Bytes this process's memory cgroup still allows (its limit less its charge, reclaimable file pages
    given back), or None where no limit applies (none set, no cgroup, unreadable).

    Why: ``psutil``'s available RAM is the machine's; a process in a cgroup of 512 MiB on a 64 GiB host that
    sizes a buffer from it is OOM-killed. Probes size their buffers from the smaller of the two.
    """
    try:
        if _v2():
            cg = next((ROOT / line[3:].lstrip("/") for line in Path("/proc/self/cgroup").read_text().splitlines()
                       if line.startswith("0::")), None)
            names = ("memory.max", "memory.current", "inactive_file")
        else:
            cg = _v1_memory_root()
            names = ("memory.limit_in_bytes", "memory.usage_in_bytes", "total_inactive_file")
        if cg is None:
            return None
        raw = (cg / names[0]).read_text().strip()
        if raw == "max" or int(raw) >= 1 << 60:  # v2's "max", v1's page-rounded 2^63
            return None
        stat = dict(line.split() for line in (cg / "memory.stat").read_text().splitlines() if len(line.split()) == 2)
        used = int((cg / names[1]).read_text()) - int(stat.get(names[2], 0))
        return max(0, int(raw) - used)
    except (OSError, ValueError):
        return None
