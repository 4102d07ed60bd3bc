"""How many CPU threads the engine computes with, when the user does not say.

Not torch's one per logical CPU: every parallel region of a decode step ends at a barrier, so it takes
its slowest thread's time; a second hardware thread of a core adds little bandwidth, and a core busy
with another program stalls our thread for a scheduler slice at every barrier (docs/benchmarks.md). So
the default is the physical cores this process may run on (llama.cpp's default too) minus those busy
at start-up; ``--threads`` overrides it.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import psutil

BUSY_PERCENT = 60.0  # a CPU above this share busy (other programs) over the sample counts as taken
SAMPLE_S = 0.05  # the start-up sample: long enough to see a busy loop, short beside a model load


@dataclass(frozen=True)
class ThreadChoice:
    """The thread count picked and why (shown by ``llmsys bench`` and the debug log)."""

    threads: int
    physical: int  # physical cores this process may use
    busy: int  # of the CPUs this process may use, how many were busy in the sample
    reason: str


def usable_cpus() -> list[int]:
    """The logical CPUs this process may run on (its affinity mask, e.g. a container's cpuset)."""
    try:
        return sorted(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # not Linux
        return list(range(os.cpu_count() or 1))


def physical_cores(cpus: list[int]) -> int:
    """Physical cores among ``cpus`` (SMT siblings count once)."""
    logical = psutil.cpu_count(logical=True) or len(cpus)
    physical = psutil.cpu_count(logical=False) or logical
    per_core = max(1, logical // max(physical, 1))  # hardware threads per core
    return max(1, len(cpus) // per_core)


def busy_cpus(cpus: list[int], sample_s: float = SAMPLE_S) -> int:
    """How many of ``cpus`` other programs kept busy during a short sample."""
    try:
        shares = psutil.cpu_percent(interval=sample_s, percpu=True)
    except (OSError, RuntimeError):
        return 0
    return sum(1 for cpu in cpus if cpu < len(shares) and shares[cpu] >= BUSY_PERCENT)


def choose_threads(requested: int | None = None, sample_s: float = SAMPLE_S) -> ThreadChoice:
    """``requested`` (clamped to the CPUs present), else the idle physical cores (at least one)."""
    cpus = usable_cpus()
    physical = physical_cores(cpus)
    if requested is not None:
        if requested <= len(cpus):
            return ThreadChoice(requested, physical, 0, f"--threads {requested}")
        return ThreadChoice(len(cpus), physical, 0, f"--threads {requested} clamped to the {len(cpus)} CPUs present")
    busy = busy_cpus(cpus, sample_s) if physical > 1 else 0
    threads = max(1, physical - busy)
    if busy:
        reason = f"{physical} physical cores, {busy} busy with other programs"
    else:
        reason = f"{physical} physical cores"
    return ThreadChoice(threads, physical, busy, reason)
