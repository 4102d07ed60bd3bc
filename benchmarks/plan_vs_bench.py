"""``llmsys plan`` against ``llmsys bench``: predicted and measured decode and prefill tok/s, side by side.

The planner costs each stored weight format with the kernel probe's figures (``offload/kernel_probe.py``,
cached in ``$LLMSYS_HOME/machine.json``); this checks that its predictions match what the engine runs, on
the real SmolLM2-135M-Instruct Q4_1 file (read in place from ../shared) as stored and on the Qwen2.5-0.5B
shape (the bench's random-weight checkpoint) in bfloat16, int8 and int4. Each bench runs at the probe's
thread count (``-t``), so the two speak of the same threads. ``--lock FILE`` takes an exclusive ``flock`` on
FILE around the probe and each bench (a machine shared with other timing runs); plans take no lock (no
timing). Prints a markdown table; a ratio is predicted / measured.

    python benchmarks/plan_vs_bench.py [--cases smollm2,qwen-bf16,qwen-int8,qwen-int4] [-p 128] [-n 32] [-r 3]
                                       [--lock FILE] [--remeasure] [--json]
"""

from __future__ import annotations

import argparse
import contextlib
import fcntl
import io
import json
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

SHARED = Path(__file__).resolve().parents[2] / "shared"
SMOLLM2 = SHARED / "models" / "smollm2-135m-instruct" / "SmolLM2-135M-Instruct.Q4_1.gguf"
TOLERANCE = 0.30  # |predicted / measured - 1| within this counts as a match


@dataclass(frozen=True)
class Case:
    name: str
    model: str  # "gguf" (the SmolLM2 file) or a synthetic shape name
    quant: str  # --quant


CASES = {
    "smollm2": Case("SmolLM2-135M Q4_1 (as stored)", "gguf", "none"),
    "qwen-bf16": Case("Qwen2.5-0.5B bf16", "qwen2.5-0.5b", "none"),
    "qwen-int8": Case("Qwen2.5-0.5B int8", "qwen2.5-0.5b", "int8"),
    "qwen-int4": Case("Qwen2.5-0.5B int4", "qwen2.5-0.5b", "int4"),
}


@contextlib.contextmanager
def locked(path: str | None):
    """An exclusive flock on ``path`` (None: no lock)."""
    if path is None:
        yield
        return
    with open(path, "a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def model_path(case: Case) -> Path:
    if case.model == "gguf":
        if not SMOLLM2.exists():
            raise SystemExit(f"{SMOLLM2} is absent: the SmolLM2 GGUF lives in ../shared beside the checkout")
        return SMOLLM2
    from llmsys.engine.bench.synthetic import make_synthetic

    return make_synthetic(case.model, progress=True)  # cached under $LLMSYS_HOME/synthetic


def plan(path: Path, case: Case, prompt: int, gen: int) -> dict:
    """``llmsys plan PATH --json`` in this process (no timing: reads the cached kernel figures)."""
    from llmsys.engine.cli.main import main

    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        rc = main(["plan", str(path), "--json", "--prompt-len", str(prompt), "--output-len", str(gen),
                   "--dtype", "bfloat16", "--quant", case.quant])
    if rc != 0:
        raise SystemExit(f"llmsys plan {path} failed (exit {rc})")
    return json.loads(out.getvalue())


def bench(path: Path, case: Case, prompt: int, gen: int, reps: int, threads: int, lock: str | None) -> dict[str, float]:
    """``llmsys bench`` in a child process: {"pp": prompt tok/s, "tg": decode tok/s}."""
    cmd = [sys.executable, "-m", "llmsys.engine.cli.main", "bench", str(path), "-p", str(prompt), "-n", str(gen),
           "-r", str(reps), "-t", str(threads), "--dtype", "bfloat16", "--quant", case.quant, "--no-e2e", "-o", "json"]
    with locked(lock):
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=1800)
    if done.returncode != 0:
        raise SystemExit(f"{' '.join(cmd)} failed:\n{done.stderr[-2000:]}")
    rows = json.loads(done.stdout)["rows"]
    got = {r["test"][:2]: r["tok_s"] for r in rows if not r.get("error")}
    if set(got) != {"pp", "tg"}:
        raise SystemExit(f"{' '.join(cmd)}: no pp/tg rows ({[r.get('error') for r in rows]})")
    p50 = next(r["itl_p50_ms"] for r in rows if r["test"].startswith("tg"))
    got["tg_p50"] = 1000.0 / p50 if p50 else float("nan")  # the median step's rate: less moved by a busy machine
    return got


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--cases", default=",".join(CASES), help=f"comma list of {', '.join(CASES)}")
    ap.add_argument("-p", "--prompt", type=int, default=128)
    ap.add_argument("-n", "--gen", type=int, default=32)
    ap.add_argument("-r", "--reps", type=int, default=3)
    ap.add_argument("--lock", default=None, help="flock this file around the probe and each bench")
    ap.add_argument("--remeasure", action="store_true", help="probe the machine and the kernels again first")
    ap.add_argument("--threads", type=int, default=None,
                    help="probe and bench on this many threads (default: the probe's, one per physical core)")
    ap.add_argument("--json", action="store_true", help="print the rows as JSON lines too")
    args = ap.parse_args(argv)
    cases = [CASES[c.strip()] for c in args.cases.split(",") if c.strip()]

    from dataclasses import replace

    from llmsys.offload import bandwidth

    probe = replace(bandwidth.DEFAULT_PROBE, threads=args.threads)
    bandwidth.DEFAULT_PROBE = probe  # the plans below read the figures of these threads (the record's key)
    with locked(args.lock):  # the probe is a timing too
        bw = bandwidth.measure_bandwidths(cache=not args.remeasure, probe=probe, kernels=True)
    kc = bw.kernels
    threads = int(kc.key["threads"])
    print(f"kernel probe: {kc.key.get('isa')}, {threads} threads, {kc.seconds:.1f} s, other programs "
          f"{kc.probe_load:.2f} cores meanwhile; RAM read {bw.mem_gbps:.1f} GB/s")
    for f, c in kc.formats.items():
        print(f"  {f:16s} {c.decode_gbps:6.1f} GB/s at 1 row, {c.gflops:6.0f} GFLOP/s further rows, "
              f"call {c.call_s * 1e6:5.1f} us  ({c.kernel})")
    print()
    print(f"| case | threads | decode tok/s plan | bench (mean) | bench (median step) | ratio |"
          f" prefill tok/s (p{args.prompt}) plan | bench | ratio | within 30% |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    rows = []
    for case in cases:
        path = model_path(case)
        p = plan(path, case, args.prompt, args.gen)
        m = bench(path, case, args.prompt, args.gen, args.reps, threads, args.lock)
        rd, rp = p["decode_tok_s"] / m["tg"], p["prefill_tok_s"] / m["pp"]
        ok = abs(rd - 1) <= TOLERANCE and abs(rp - 1) <= TOLERANCE
        rows.append(dict(case=case.name, threads=threads, plan_decode=p["decode_tok_s"], bench_decode=m["tg"],
                         bench_decode_median_step=m["tg_p50"],
                         plan_prefill=p["prefill_tok_s"], bench_prefill=m["pp"], calibration=p["calibration"]["source"]))
        print(f"| {case.name} | {threads} | {p['decode_tok_s']:.1f} | {m['tg']:.1f} | {m['tg_p50']:.1f} | {rd:.2f} | "
              f"{p['prefill_tok_s']:.1f} | {m['pp']:.1f} | {rp:.2f} | {'yes' if ok else 'no'} |", flush=True)
    if args.json:
        for r in rows:
            print(json.dumps(r))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
