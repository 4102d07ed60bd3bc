#!/usr/bin/env python
"""The default thread count on a quiet machine and with one core busy: `llmsys bench -t 1,2,auto`.

Issue #22's must-show 4. Runs the real CLI twice, ``llmsys bench --synthetic SHAPE -p P -n N -r R -t 1,...,auto
-o json``: once on a quiet machine, once with a busy loop pinned to the last CPU this process may use (what a
browser tab or a build does to a desktop). ``auto`` is the engine's default (no ``-t``:
``kernels.common.cpus.choose_threads``, the physical cores minus those busy at start-up); the table shows
what it picked and whether that was the fastest row.

    python benchmarks/bench_threads.py --shape smollm2-135m
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time


def bench(args: argparse.Namespace, threads: str) -> list[dict]:
    cmd = [sys.executable, "-m", "llmsys.engine.cli.main", "bench", "--synthetic", args.shape, "-p", str(args.prompt),
           "-n", str(args.gen), "-r", str(args.reps), "-t", threads, "--no-e2e", "-o", "json", "--no-progress"]
    out = subprocess.run(cmd, capture_output=True, text=True, check=True)
    return json.loads(out.stdout)["rows"]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shape", default="smollm2-135m")
    ap.add_argument("--prompt", type=int, default=64)
    ap.add_argument("--gen", type=int, default=32)
    ap.add_argument("--reps", type=int, default=3)
    args = ap.parse_args()
    cpus = sorted(os.sched_getaffinity(0))
    sweep = ",".join(str(t) for t in range(1, len(cpus) + 1)) + ",auto"
    runs = {"quiet": bench(args, sweep)}
    spin = subprocess.Popen([sys.executable, "-c", f"import os; os.sched_setaffinity(0, {{{cpus[-1]}}})\nwhile True: pass"])
    try:
        time.sleep(1.0)
        runs[f"CPU {cpus[-1]} busy"] = bench(args, sweep)
    finally:
        spin.kill()
        spin.wait()
    cpu = next((ln.split(":", 1)[1].strip() for ln in open("/proc/cpuinfo") if ln.startswith("model name")), "?")
    from llmsys.kernels.cpu_report import cpu_kernels

    print(f"Machine: {cpu}, {len(cpus)} CPUs, {cpu_kernels().summary()}; synthetic {args.shape}, bf16, pp{args.prompt} / tg{args.gen}, "
          f"mean of {args.reps} (± stddev).\n")
    print("| machine state | threads | pp t/s | tg t/s | tg ITL p99 ms |")
    print("|---|---|---|---|---|")
    for state, rows in runs.items():
        by = {}
        for r in rows:
            key = f"{r['threads']} (auto: {r['threads_auto']})" if r.get("threads_auto") else str(r["threads"])
            by.setdefault(key, {})[r["test"][:2]] = r
        best = max(by, key=lambda k: by[k]["tg"]["tok_s"])
        for key, t in by.items():
            mark = " **fastest**" if key == best else ""
            print(f"| {state} | {key} | {t['pp']['tok_s']:.0f} ± {t['pp']['tok_s_std']:.0f} | "
                  f"{t['tg']['tok_s']:.1f} ± {t['tg']['tok_s_std']:.1f}{mark} | {t['tg']['itl_p99_ms']:.1f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
