"""The default thread count: the idle physical cores, and --threads clamped to the CPUs present."""

from __future__ import annotations

import subprocess
import sys
import time

import pytest
import torch

from llmsys.kernels.common import cpus


def test_requested_threads_are_kept_or_clamped():
    n = len(cpus.usable_cpus())
    assert cpus.choose_threads(1).threads == 1
    big = cpus.choose_threads(100000)
    assert big.threads == n and "clamped" in big.reason and str(n) in big.reason


def test_physical_cores_count_smt_siblings_once(monkeypatch):
    counts = {True: 8, False: 4}  # 4 cores with 2 hardware threads each
    monkeypatch.setattr(cpus.psutil, "cpu_count", lambda logical=True: counts[logical])
    assert cpus.physical_cores(list(range(8))) == 4
    assert cpus.physical_cores([0, 1]) == 1  # a cpuset of two hardware threads of one core


def test_busy_cores_are_left_to_their_programs(monkeypatch):
    monkeypatch.setattr(cpus, "usable_cpus", lambda: [0, 1, 2, 3])
    monkeypatch.setattr(cpus, "physical_cores", lambda cpu_list: 4)
    monkeypatch.setattr(cpus.psutil, "cpu_percent", lambda interval, percpu: [100.0, 3.0, 97.0, 10.0])
    choice = cpus.choose_threads()
    assert (choice.threads, choice.busy) == (2, 2) and "2 busy" in choice.reason
    monkeypatch.setattr(cpus.psutil, "cpu_percent", lambda interval, percpu: [100.0] * 4)
    assert cpus.choose_threads().threads == 1  # never zero


def test_a_real_busy_loop_is_seen():
    """A process spinning on one CPU is counted busy by the real sample."""
    usable = cpus.usable_cpus()
    if len(usable) < 2:
        pytest.skip("needs two CPUs: one to keep busy, one to sample from")
    spin = subprocess.Popen([sys.executable, "-c", "import os; os.sched_setaffinity(0, {%d})\nwhile True: pass" % usable[-1]])
    try:
        time.sleep(0.5)
        assert cpus.busy_cpus([usable[-1]], sample_s=0.3) == 1
    finally:
        spin.kill()
        spin.wait()


def test_the_engine_uses_its_choice(stories_c):
    from llmsys import LLM

    llm = LLM(str(stories_c), threads=1)
    assert llm.threads.threads == 1 == torch.get_num_threads()
    llm = LLM(str(stories_c))
    assert 1 <= llm.threads.threads == torch.get_num_threads() <= len(cpus.usable_cpus())
