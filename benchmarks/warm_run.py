#!/usr/bin/env python
"""A second ``llmsys run`` while ``llmsys serve`` holds the model: time from process spawn to its first stdout byte.

Starts ``llmsys serve MODEL`` on a free port (or uses ``--host`` where one already runs), sends one unmeasured
run to warm the server and the bytecode cache, then spawns ``ROUNDS`` fresh ``llmsys run MODEL PROMPT --chat
-n 64`` processes with ``$LLMSYS_HOST`` pointing at it (the console script's entry,
``llmsys.engine.cli.main:main``, as benchmarks/cold_start.py runs it). Per round: spawn -> first byte of the
answer on stdout (the goal: median <= 0.2 s), spawn -> exit, the client's CPU time, and the server's own
time to first token from the run's stats line. ``--local`` rounds beside them give the in-process figure for
the same command.

    flock /tmp/bench46.lock python benchmarks/warm_run.py --rounds 5
"""

from __future__ import annotations

import argparse
import os
import re
import selectors
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

MODEL = Path(__file__).resolve().parents[2] / "shared/models/smollm2-135m-instruct/SmolLM2-135M-Instruct.Q4_1.gguf"
PROMPT = "Write a short story about a cat."
LLMSYS = "import sys; from llmsys.engine.cli.main import main; sys.exit(main())"


def first_byte(cmd: list[str], env: dict[str, str]) -> tuple[float, float, float, str]:
    """(spawn -> first stdout byte, spawn -> exit, the process's CPU seconds, stderr) of one process; a failure
    stops the benchmark. CPU time (user + system) is what contention on a shared machine disturbs least."""
    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, stdin=subprocess.DEVNULL, env=env)
    sel = selectors.DefaultSelector()
    sel.register(proc.stdout, selectors.EVENT_READ)
    sel.select()
    os.read(proc.stdout.fileno(), 1)
    first = time.perf_counter() - t0
    proc.stdout.read()  # a 64-token answer and one stats line fit the pipes: no deadlock reading them in turn
    err = proc.stderr.read()
    _, status, usage = os.wait4(proc.pid, 0)
    wall = time.perf_counter() - t0
    proc.returncode = os.waitstatus_to_exitcode(status)
    if proc.returncode != 0:
        sys.exit(f"{' '.join(cmd[3:])} exited {proc.returncode}: {err.decode(errors='replace')[-500:]}")
    return first, wall, usage.ru_utime + usage.ru_stime, err.decode(errors="replace")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[1])
    ap.add_argument("--model", default=str(MODEL))
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--host", help="a running llmsys serve (default: start one on a free port)")
    ap.add_argument("--local-rounds", type=int, default=1, help="--local rounds beside, for the in-process figure")
    args = ap.parse_args()

    cache = tempfile.mkdtemp(prefix="llmsys-pycache-")
    # bytecode written once and read after, as an installed program has it, even where the environment sets
    # PYTHONDONTWRITEBYTECODE (every start would compile every module from source)
    env = {k: v for k, v in os.environ.items() if k != "PYTHONDONTWRITEBYTECODE"}
    env["PYTHONPYCACHEPREFIX"] = cache
    server = None
    host = args.host
    if host is None:
        host = f"127.0.0.1:{free_port()}"
        port = host.rsplit(":", 1)[1]
        server = subprocess.Popen([sys.executable, "-c", LLMSYS, "serve", args.model, "--port", port, "--kv-disk", "0"],
                                  stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env)
    env["LLMSYS_HOST"] = host
    try:
        from llmsys.engine import remote

        t0 = time.perf_counter()
        while not remote.answers(remote.server_address(host), timeout=1.0):
            if server is not None and server.poll() is not None:
                sys.exit("llmsys serve exited before it answered")
            time.sleep(0.2)
        print(f"server at {host} answered after {time.perf_counter() - t0:.1f} s")
        cmd = [sys.executable, "-c", LLMSYS, "run", args.model, PROMPT, "--chat", "-n", "64"]
        first_byte(cmd, env)  # warm-up: bytecode, the server's first request
        rows = []
        for i in range(args.rounds):
            fb, wall, cpu, err = first_byte(cmd, env)
            if "using the llmsys server" not in err:
                sys.exit(f"the run did not use the server: {err[-300:]}")
            ttft = re.search(r"ttft (\d+) ms", err)
            rows.append((fb, wall, cpu))
            print(f"round {i + 1}: first byte {fb * 1000:.0f} ms, exit {wall * 1000:.0f} ms, client CPU "
                  f"{cpu * 1000:.0f} ms, server ttft "
                  f"{ttft.group(1) if ttft else '?'} ms")
        fbs = [r[0] for r in rows]
        print(f"through the server: first byte median {statistics.median(fbs) * 1000:.0f} ms "
              f"(min {min(fbs) * 1000:.0f}, max {max(fbs) * 1000:.0f}); exit median "
              f"{statistics.median(r[1] for r in rows) * 1000:.0f} ms; client CPU median "
              f"{statistics.median(r[2] for r in rows) * 1000:.0f} ms; goal: first byte <= 200 ms")
        for i in range(args.local_rounds):
            fb, wall, cpu, _ = first_byte(cmd + ["--local"], env)
            print(f"--local round {i + 1}: first byte {fb * 1000:.0f} ms, exit {wall * 1000:.0f} ms, "
                  f"CPU {cpu * 1000:.0f} ms")
    finally:
        if server is not None:
            server.send_signal(signal.SIGINT)
            try:
                server.wait(30)
            except subprocess.TimeoutExpired:
                server.kill()


if __name__ == "__main__":
    main()
