#!/usr/bin/env python
"""A cold one-shot answer as a user types it, against llama.cpp: wall time and peak RSS, and `llmsys --version`.

Each round starts one fresh process per side, interleaved:

- llmsys: the console script's entry (``llmsys.engine.cli.main:main``) with
  ``run MODEL "Write a short story about a cat." -n 64`` (the chat template applies by default);
- llama.cpp: a Python process that loads ``llama_cpp.Llama(model_path=MODEL, n_threads=THREADS)`` and asks
  ``create_chat_completion`` for the same user message, ``max_tokens=64``.

Wall time is spawn to exit (interpreter start, imports, load, prompt, 64 tokens, shutdown); peak RSS is the
process's own maximum (``os.wait4``'s ru_maxrss). Medians over rounds; the goals are llmsys <= 2x llama.cpp's
wall time and <= 1.5x its peak RSS, and ``llmsys --version`` under 0.3 s.

"Cold" is the process, not the machine: one unmeasured warm-up of each side first fills what an installed
program has after its first use (compiled bytecode, llmsys's C kernels and machine record in $LLMSYS_HOME,
the model file in the page cache). Bytecode goes to a private ``PYTHONPYCACHEPREFIX`` for both sides, as a pip
install writes it, so an environment that sets PYTHONDONTWRITEBYTECODE does not recompile every module on
every start. ``--pythonpath DIR`` puts DIR first on the llmsys side's path (a folder holding an ``llmsys``
folder or link: another checkout, e.g. ``git archive`` of the commit before a change).

    flock /tmp/bench46.lock python benchmarks/cold_start.py --rounds 5
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

MODEL = Path(__file__).resolve().parents[2] / "shared/models/smollm2-135m-instruct/SmolLM2-135M-Instruct.Q4_1.gguf"
PROMPT = "Write a short story about a cat."
LLMSYS = "import sys; from llmsys.engine.cli.main import main; sys.exit(main())"
LLAMA = """
import sys
from llama_cpp import Llama
llm = Llama(model_path=sys.argv[1], n_threads=int(sys.argv[2]), verbose=False)
out = llm.create_chat_completion(messages=[{"role": "user", "content": sys.argv[3]}], max_tokens=int(sys.argv[4]))
print(out["choices"][0]["message"]["content"])
"""


def timed(cmd: list[str], env: dict[str, str]) -> tuple[float, float, int, str]:
    """(wall seconds, CPU seconds, peak RSS bytes, stdout) of one process run to its end; a failure stops the
    benchmark. CPU time (user + system, all threads) is what contention on a shared machine disturbs least."""
    with tempfile.TemporaryFile() as out, tempfile.TemporaryFile() as err:
        t0 = time.perf_counter()
        proc = subprocess.Popen(cmd, stdout=out, stderr=err, env=env)
        _, status, usage = os.wait4(proc.pid, 0)  # the child's own peak RSS, which Popen.wait would not give
        wall = time.perf_counter() - t0
        proc.returncode = os.waitstatus_to_exitcode(status)
        out.seek(0)
        err.seek(0)
        if proc.returncode != 0:
            sys.exit(f"{' '.join(cmd[3:6])} exited {proc.returncode}: {err.read().decode(errors='replace')[-500:]}")
        cpu = usage.ru_utime + usage.ru_stime
        return wall, cpu, usage.ru_maxrss * 1024, out.read().decode(errors="replace")  # ru_maxrss: KiB on Linux


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", type=Path, default=MODEL)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("-n", type=int, default=64)
    ap.add_argument("--pythonpath", default=None, help="a folder put first on the llmsys side's sys.path")
    args = ap.parse_args()
    if not args.model.exists():
        sys.exit(f"{args.model}: no such file (pass --model)")

    pyc = tempfile.mkdtemp(prefix="cold_start_pyc_")
    env = {k: v for k, v in os.environ.items() if k != "PYTHONDONTWRITEBYTECODE"}
    env["PYTHONPYCACHEPREFIX"] = pyc
    lenv = dict(env)
    if args.pythonpath:
        lenv["PYTHONPATH"] = os.pathsep.join([args.pythonpath, *filter(None, [env.get("PYTHONPATH")])])
    ours = [sys.executable, "-c", LLMSYS, "run", str(args.model), PROMPT, "-n", str(args.n), "-t", str(args.threads)]
    theirs = [sys.executable, "-c", LLAMA, str(args.model), str(args.threads), PROMPT, str(args.n)]
    version = [sys.executable, "-c", LLMSYS, "--version"]

    for cmd, e in ((ours, lenv), (theirs, env), (version, lenv)):  # warm-up, not measured
        timed(cmd, e)
    rows: dict[str, list[tuple[float, float, int]]] = {"llmsys run": [], "llama.cpp": [], "llmsys --version": []}
    for r in range(args.rounds):
        for name, cmd, e in (("llmsys run", ours, lenv), ("llama.cpp", theirs, env), ("llmsys --version", version, lenv)):
            wall, cpu, rss, _ = timed(cmd, e)
            rows[name].append((wall, cpu, rss))
            print(f"round {r + 1}: {name:<17} {wall:6.2f} s wall {cpu:6.2f} s CPU {rss / 2**20:7.1f} MiB",
                  file=sys.stderr)

    def med(name: str, i: int) -> float:
        return statistics.median(row[i] for row in rows[name])

    print(f"model {args.model.name}, {args.threads} threads, -n {args.n}, {args.rounds} rounds, "
          f"load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} CPUs")
    print(f"{'':<18} {'wall s (median)':>16} {'wall s (min)':>13} {'CPU s':>7} {'peak RSS MiB':>13}")
    for name in rows:
        print(f"{name:<18} {med(name, 0):>16.2f} {min(w for w, _, _ in rows[name]):>13.2f} {med(name, 1):>7.2f} "
              f"{med(name, 2) / 2**20:>13.1f}")
    ours, theirs = "llmsys run", "llama.cpp"
    print(f"{'ratio run/llama':<18} {med(ours, 0) / med(theirs, 0):>15.2f}x "
          f"{min(w for w, _, _ in rows[ours]) / min(w for w, _, _ in rows[theirs]):>12.2f}x "
          f"{med(ours, 1) / med(theirs, 1):>6.2f}x {med(ours, 2) / med(theirs, 2):>12.2f}x")
    print("goals: run <= 2x llama.cpp's wall time and <= 1.5x its peak RSS; llmsys --version < 0.3 s")

if __name__ == "__main__":
    main()
