"""Offload faults are recovered from, not only survived (issue #48, item 6).

A full disk is simulated two ways: a real one for the start-up probe (a
subprocess under ``RLIMIT_FSIZE``, whose writes past the limit fail with
``EFBIG`` as a full filesystem's fail with ``ENOSPC``), and, for the KV cold
tier and the swap space, their write functions raising ``ENOSPC`` while a
switch is on (as ``tests/test_offload_io_errors.py`` does). The retry
backoff runs on a fake clock the test advances, so nothing sleeps.

Checked: the disk-speed probe on a folder that cannot take its file prints
one notice naming the folder and ``--offload-dir`` and start-up goes on; a
run killed mid-probe leaves no file, and files earlier runs left are removed
at start; a KV cold tier whose write failed is off (``/health`` stays 200
and lists it under ``degraded``), retries after the backoff once the disk has
room, and a request that needs it then gets exactly a fault-free run's
tokens; a swap write that fails makes preemptions recompute (the same
tokens) with exactly one warning for the whole episode, and swapping comes
back after the backoff.
"""

from __future__ import annotations

import errno
import logging
import os
import resource
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from conftest import STORIES_HF, need_shared
from llmsys import LLM, SamplingParams
from llmsys.offload import bandwidth, kv_swap, kv_tier
from llmsys.offload.bandwidth import ASSUMED_DISK_GBPS, PROBE_PREFIX, ProbeSettings
from llmsys.offload.recovery import Recovery, RetryPolicy

PROMPTS = ["Once upon a time", "The cat sat", "Tom and Sue went to", "One day, a big dog"]
LONG = "Once upon a time there was a little girl named Lily. She loved to play outside in the sun."
SP = SamplingParams(temperature=0, max_tokens=60, ignore_eos=True)
SP_LONG = SamplingParams(temperature=0, max_tokens=300, ignore_eos=True)  # ~320 tokens: past a 128-token hot pool
TINY_PROBE = ProbeSettings(mem_bytes=2 << 20, disk_bytes=64 << 20, gemm_mnk=(4, 64, 64), repeat=1, threads=1,
                           kernel_bytes=64 << 10, kernel_shape=(64, 256), kernel_rows=4)


class Clock:
    """A monotonic clock the test moves by hand."""

    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


class Disk:
    """``module.name`` raises ENOSPC while ``full``; counts the calls that failed."""

    def __init__(self, monkeypatch, module, name: str):
        self.full, self.failed = False, 0
        real = getattr(module, name)

        def write(*args):
            if self.full:
                self.failed += 1
                raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
            return real(*args)

        monkeypatch.setattr(module, name, write)


def _drive(llm, prompts, sps):
    """Every prompt through the core; per request: (tokens, finish_reason, error)."""
    core = llm.core
    ids = [core.add_request(llm.encode(p), s) for p, s in zip(prompts, sps)]
    toks = {rid: [] for rid in ids}
    final = {}
    while len(final) < len(ids):
        for ch in core.step():
            toks[ch.request_id].extend(ch.token_ids)
            if ch.finished:
                final[ch.request_id] = (ch.finish_reason, ch.error)
    return [(toks[rid], *final[rid]) for rid in ids]


@pytest.fixture(scope="module")
def plain():
    """Greedy tokens of an engine with room for everything (no swap, no tier): the reference."""
    llm = LLM(str(need_shared(STORIES_HF)), dtype="float32", progress=False, kv_cache_tokens=2048, swap_space=0,
              max_num_batched_tokens=32)
    out = llm.generate([*PROMPTS, LONG], [SP] * len(PROMPTS) + [SP_LONG])
    return {"prompts": [o.token_ids for o in out[:4]], "long": out[4].token_ids, "long_text": out[4].text}


# -- the start-up disk probe ---------------------------------------------------------------------------


def _under_fsize_limit(limit: int):
    def apply():
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a write past the limit fails (EFBIG), it does not kill
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))
    return apply


def test_start_up_on_a_disk_that_cannot_take_the_probe_goes_on_with_one_notice(tmp_path):
    """``llmsys plan --offload-dir`` where no file may pass 16 MiB: the 64 MiB probe file cannot be written."""
    off = tmp_path / "off"
    env = {**os.environ, "LLMSYS_HOME": str(tmp_path / "home")}
    r = subprocess.run([sys.executable, "-m", "llmsys.engine.cli.main", "plan", str(need_shared(STORIES_HF)),
                        "--offload-dir", str(off)], capture_output=True, text=True, env=env, timeout=300,
                       preexec_fn=_under_fsize_limit(16 << 20))
    assert r.returncode == 0, r.stderr
    assert "KV pool" in r.stdout  # the plan was made
    notices = [line for line in r.stderr.splitlines() if PROBE_PREFIX in line or "disk-speed probe" in line]
    assert len(notices) == 1, r.stderr
    assert notices[0].startswith(f"notice: --offload-dir {off.resolve()}: the disk-speed probe failed (File too large)")
    assert f"{ASSUMED_DISK_GBPS:g} GB/s" in notices[0]
    assert list(off.iterdir()) == []  # nothing left behind


def test_too_little_free_space_skips_the_probe_and_is_not_cached(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("LLMSYS_HOME", str(tmp_path / "home"))
    real = bandwidth.shutil.disk_usage
    monkeypatch.setattr(bandwidth.shutil, "disk_usage", lambda p: real(p)._replace(free=20 << 20))
    wrote = []
    monkeypatch.setattr(bandwidth, "probe_disk_read_gbps", lambda *a: wrote.append(a) or 1.0)
    bw = bandwidth.measure_bandwidths(probe_dir=tmp_path / "off", probe=TINY_PROBE)
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 1 and err[0].startswith(f"notice: --offload-dir {(tmp_path / 'off').resolve()}: only 20.0 MiB")
    assert "too little for the disk-speed probe" in err[0]
    assert wrote == [] and bw.disk_read_gbps == ASSUMED_DISK_GBPS
    assert bandwidth.read_record().disks == {}  # a later start with room measures


def test_the_probe_file_is_sized_to_the_free_space(tmp_path, monkeypatch):
    real = bandwidth.shutil.disk_usage
    monkeypatch.setattr(bandwidth.shutil, "disk_usage", lambda p: real(p)._replace(free=100 << 20))
    sizes = []
    monkeypatch.setattr(bandwidth, "probe_disk_read_gbps", lambda folder, n: sizes.append(n) or 1.0)
    disk = bandwidth.probe_disk(tmp_path, 64 << 20)
    assert sizes == [25 << 20] and disk.measured  # a quarter of what is free, not the 64 MiB asked


def test_a_run_killed_mid_probe_leaves_no_file(tmp_path):
    """The probe's file is unlinked as soon as it is open: SIGKILL while it is written leaves nothing."""
    code = (
        "import os, sys, time\n"
        "from pathlib import Path\n"
        "from llmsys.offload import bandwidth\n"
        "real = os.pwrite\n"
        "def slow(fd, data, off):\n"
        "    n = real(fd, data, off)\n"
        "    print('writing', flush=True)\n"
        "    time.sleep(60)\n"
        "    return n\n"
        "bandwidth.os.pwrite = slow\n"
        f"bandwidth.probe_disk_read_gbps(Path({str(tmp_path)!r}), 16 << 20)\n"
    )
    p = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    try:
        assert p.stdout.readline().strip() == "writing"
        assert os.listdir(tmp_path) == []  # already unlinked while the write is under way
    finally:
        p.send_signal(signal.SIGKILL)
        p.wait(30)
    assert os.listdir(tmp_path) == []


def test_probe_files_a_killed_run_left_are_removed_at_start(tmp_path, monkeypatch):
    monkeypatch.setenv("LLMSYS_HOME", str(tmp_path / "home"))
    off = tmp_path / "off"
    off.mkdir()
    gone = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    dead = off / f"{PROBE_PREFIX}{int(gone.stdout)}_k1ll3d"  # its process has ended
    old = off / f"{PROBE_PREFIX}a8f3kq0z"  # an earlier version's name (no PID), an hour old
    live = off / f"{PROBE_PREFIX}{os.getpid()}_busy"  # a live process's probe: kept
    fresh = off / f"{PROBE_PREFIX}q9w8e7r6"  # no PID, seconds old: may be another start's, kept
    mine = off / "llmsys-kv-tier-keep.bin"  # not a probe file
    for f in (dead, old, live, fresh, mine):
        f.write_bytes(os.urandom(4096))
    hour_ago = time.time() - 3600
    os.utime(old, (hour_ago, hour_ago))
    bandwidth.measure_bandwidths(probe_dir=off, probe=TINY_PROBE)
    assert sorted(p.name for p in off.iterdir()) == sorted([live.name, fresh.name, mine.name])


# -- the retry schedule --------------------------------------------------------------------------


def test_backoff_doubles_to_its_cap_and_logs_once_per_kind_per_episode(caplog):
    clock = Clock()
    rec = Recovery("KV swap space (--swap-space)", "preempted sequences recompute", RetryPolicy(1.0, 8.0), clock)
    caplog.set_level(logging.INFO, "llmsys.offload")
    delays = []
    for _ in range(6):
        rec.failed("write", "/x/f.bin: No space left on device")
        delays.append(rec.outage.retry_at - clock.t)
        assert not rec.due()
        clock.t = rec.outage.retry_at
        assert rec.due()
    assert delays == [1.0, 2.0, 4.0, 8.0, 8.0, 8.0]
    rec.failed("read", "/x/f.bin: Input/output error")  # another kind in the same episode: its own line
    assert [r.levelname for r in caplog.records] == ["WARNING", "WARNING"]
    assert "a write failed (/x/f.bin: No space left on device); preempted sequences recompute; retrying in 1 s" \
        in caplog.records[0].getMessage()
    assert "a read failed" in caplog.records[1].getMessage()
    line = rec.describe()
    assert line.startswith("KV swap space (--swap-space) off since ") and "Input/output error; retrying in 8 s" in line
    rec.succeeded()
    assert rec.describe() is None and not rec.off and caplog.records[-1].levelname == "INFO"
    rec.failed("write", "/x/f.bin: No space left on device")  # a new episode: logged again, backoff from the start
    assert len([r for r in caplog.records if r.levelname == "WARNING"]) == 3
    assert rec.outage.retry_at - clock.t == 1.0 and rec.episodes == 2


# -- the KV cold tier: off, degraded, back ------------------------------------------------------------


def _tiered(tmp_path):
    llm = LLM(str(need_shared(STORIES_HF)), dtype="float32", progress=False, kv_cache_tokens=128,
              kv_offload_tokens=2048, offload_dir=str(tmp_path), max_num_batched_tokens=32)
    clock = Clock()
    llm.core.tier.recovery.clock = clock
    return llm, clock


def test_a_cold_tier_whose_write_failed_comes_back_with_the_same_tokens(tmp_path, monkeypatch, plain):
    llm, clock = _tiered(tmp_path)
    core, tier = llm.core, llm.core.tier
    disk = Disk(monkeypatch, kv_tier, "write_at")
    disk.full = True
    (toks, reason, error), = _drive(llm, [LONG], [SP_LONG])
    assert disk.failed >= 1 and reason == "error" and "\n" not in error
    assert "No space left on device" in error and "retries in 1 s" in error and "(--offload-dir)" in error
    assert f"{tmp_path}/llmsys-kv-tier-" in error  # the file, in the folder
    assert not tier.accepts_demotions
    [line] = core.degraded()
    assert line.startswith(f"KV cold tier (--kv-offload-tokens, in --offload-dir {tmp_path}) off since ")
    assert "No space left on device; retrying in 1 s" in line
    spilled = tier.staging_bytes()

    # Still full when the backoff runs out: the retry fails, the next one is 2 s later.
    clock.t += 1.0
    assert _drive(llm, [PROMPTS[0]], [SP])[0] == (plain["prompts"][0], "length", None)  # short requests run
    assert not tier.accepts_demotions and "retrying in 2 s" in core.degraded()[0]

    disk.full = False  # the disk has room again; the tier stays off until its retry
    (_, reason, error), = _drive(llm, [LONG], [SP_LONG])
    assert reason == "error" and "retries in 2 s" in error
    clock.t += 2.0
    got = _drive(llm, [LONG, *PROMPTS], [SP_LONG] + [SP] * len(PROMPTS))
    assert core.degraded() == [] and tier.accepts_demotions and tier.write_error is None
    assert got == [(plain["long"], "length", None)] + [(t, "length", None) for t in plain["prompts"]]
    assert tier.stats.demoted_blocks > 0 and core.allocator.num_used == 0
    assert tier.staging_bytes() < spilled  # the blocks kept in RAM went to the file on the retry


def test_health_lists_the_degraded_tier_and_clears_it(tmp_path, monkeypatch, plain):
    from llmsys.engine.server.serve import start_server_thread
    from llmsys.engine.server.state import ServerSettings, ServerState

    llm, clock = _tiered(tmp_path)
    disk = Disk(monkeypatch, kv_tier, "write_at")
    state = ServerState(ServerSettings())
    state.attach(llm, "stories")
    srv = start_server_thread(state)
    body = {"prompt": LONG, "max_tokens": 300, "ignore_eos": True, "temperature": 0}
    try:
        h = httpx.get(srv.url + "/health").json()
        assert h["status"] == "ok" and h["degraded"] == []
        disk.full = True
        r = httpx.post(srv.url + "/v1/completions", json=body, timeout=120)
        assert r.status_code == 503 and "No space left on device" in r.json()["error"]["message"]
        h = httpx.get(srv.url + "/health")
        assert h.status_code == 200 and h.json()["status"] == "ok"  # it still answers what fits
        [line] = h.json()["degraded"]
        assert line.startswith("KV cold tier (--kv-offload-tokens") and "retrying in 1 s" in line
        disk.full = False
        clock.t += 1.0
        r = httpx.post(srv.url + "/v1/completions", json=body, timeout=120)
        assert r.status_code == 200 and r.json()["choices"][0]["text"] == plain["long_text"]
        assert httpx.get(srv.url + "/health").json()["degraded"] == []
    finally:
        srv.stop()


# -- the swap space: recompute meanwhile, one log line, back ---------------------------------------------


def test_a_failed_swap_write_recomputes_logs_once_and_swapping_comes_back(tmp_path, monkeypatch, plain, caplog):
    llm = LLM(str(need_shared(STORIES_HF)), dtype="float32", progress=False, kv_cache_tokens=160, block_size=8,
              offload_dir=str(tmp_path))
    sw = llm.core.swap
    clock = Clock()
    sw.recovery.clock = clock
    disk = Disk(monkeypatch, kv_swap, "write_block")
    disk.full = True
    caplog.set_level(logging.INFO, "llmsys.offload")
    ticks = [0]
    real_step = llm.core.step

    def step():  # the clock moves 0.6 s a step: the backoff runs out (and the retry fails) several times
        ticks[0] += 1
        clock.t += 0.6
        return real_step()

    monkeypatch.setattr(llm.core, "step", step)
    got = _drive(llm, PROMPTS, [SP] * len(PROMPTS))
    assert got == [(t, "length", None) for t in plain["prompts"]]  # recomputed: the same tokens
    assert sw.stats.lost_swap_outs >= 1 and sw.recovery.outage.failures >= 3 and disk.failed >= 3
    warnings = [r for r in caplog.records if r.levelno >= logging.WARNING]
    assert len(warnings) == 1, [r.getMessage() for r in warnings]
    msg = warnings[0].getMessage()
    assert msg.startswith(f"KV swap space (--swap-space, in --offload-dir {tmp_path}): a write failed (")
    assert "No space left on device" in msg and "preempted sequences recompute instead of swapping" in msg

    disk.full = False
    clock.t = sw.recovery.outage.retry_at
    before = sw.stats.swapped_out_blocks
    got = _drive(llm, PROMPTS, [SP] * len(PROMPTS))
    assert got == [(t, "length", None) for t in plain["prompts"]]
    assert not sw.recovery.off and sw.write_error is None and llm.core.degraded() == []
    assert sw.stats.swapped_out_blocks > before  # swapping again
    assert [r.levelname for r in caplog.records] == ["WARNING", "INFO"] and "is back" in caplog.records[1].getMessage()
