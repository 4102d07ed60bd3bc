#!/usr/bin/env python
"""What `llmsys quantize --quant int4 --method gptq` costs with its defaults: wall time per stage, peak RSS, perplexity.

Issue #22's must-show 3. On stories260k (the real model in ../shared) it runs the README's command with the
defaults, end to end, then ``llmsys perplexity`` on tinystories-valid (``--ctx 256 --limit 30000``: on the
first 2,048 tokens alone the calibration seed moves the result by half a point) for the float model and the checkpoint (bound: +4%). For bigger shapes (random-weight synthetic
models of models.toml, whose self-generated text is noise but whose cost is real) it runs the command twice on
few sequences / steps and fits each stage as fixed + per-unit cost (calibration text and GPTQ per sequence,
refinement per step), then evaluates the fit at the defaults (512 sequences of 128 tokens, DEFAULT_TUNE_STEPS steps): an
estimate, labelled as one, because the full run would take hours here. Peak RSS is measured (each run's own
process, from wait4), not estimated.

    python benchmarks/bench_quantize_cost.py --shapes qwen2.5-0.5b
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from llmsys.engine.config import DEFAULT_TUNE_STEPS

ROOT = Path(__file__).resolve().parents[1]
SHARED = ROOT.parent / "shared"
CLI = [sys.executable, "-m", "llmsys.engine.cli.main"]
STAGES = {  # stage -> (regex over quantize's stderr, what the default count is of)
    "calibration text": r"calibrating on (\d+) x (\d+) tokens .*?, ([0-9.]+) s\)",
    "gptq": r"gptq: \d+ layers quantized \(([0-9.]+) s\)",
    "refine": r"\((\d+) steps, ([0-9.]+) s\)",
}


def quantize(model: str, out: Path, extra: list[str]) -> tuple[float, str, float, float]:
    """(wall s, stderr, peak RSS GiB, user + sys CPU s) of one ``llmsys quantize`` process (its own rusage,
    from wait4)."""
    t0 = time.perf_counter()
    with tempfile.TemporaryFile("w+") as err:
        proc = subprocess.Popen([*CLI, "quantize", model, "--quant", "int4", "--method", "gptq", "-o", str(out),
                                 *extra], stdout=subprocess.DEVNULL, stderr=err)
        _, status, usage = os.wait4(proc.pid, 0)  # reaped here, so Popen.wait is never called
        rc = os.waitstatus_to_exitcode(status)
        err.seek(0)
        log = err.read()
    if rc != 0:
        raise SystemExit(f"quantize {model} {' '.join(extra)} failed (exit {rc}): {log[-800:]}")
    return time.perf_counter() - t0, log, usage.ru_maxrss / 2**20, usage.ru_utime + usage.ru_stime  # KiB on Linux


def perplexity(model: str) -> float:
    res = subprocess.run([*CLI, "perplexity", model, str(SHARED / "corpus" / "tinystories-valid.txt"),
                          "--ctx", "256", "--limit", "30000"], capture_output=True, text=True, check=True)
    return float(re.search(r"perplexity ([0-9.]+)", res.stdout + res.stderr).group(1))


def stage_times(log: str) -> tuple[float, float, float, int, int]:
    """(calibration s, gptq s, refine s, sequences, refinement steps) from quantize's stage lines."""
    cal = re.search(STAGES["calibration text"], log)
    gptq = re.search(STAGES["gptq"], log)
    ref = re.search(STAGES["refine"], log)
    return float(cal.group(3)), float(gptq.group(1)), float(ref.group(2)), int(cal.group(1)), int(ref.group(1))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shapes", default="qwen2.5-0.5b", help="synthetic shapes to estimate (comma list; '' = none)")
    ap.add_argument("--seeds", default="0,1", help="stories260k: one default run per calibration seed (comma list)")
    ap.add_argument("--points", default="8x2,24x6",
                    help="synthetic shapes: the two measured runs, SEQUENCESxSTEPS each (the fit's two points)")
    args = ap.parse_args()
    cpu = next((ln.split(":", 1)[1].strip() for ln in open("/proc/cpuinfo") if ln.startswith("model name")), "?")
    from llmsys.kernels.cpu_report import cpu_kernels

    print(f"Machine: {cpu}, {cpu_kernels().summary()}; threads: the engine's default (the idle physical cores).\n")
    with tempfile.TemporaryDirectory() as tmp:
        stories = str(SHARED / "models" / "stories260k-hf")
        base = perplexity(stories)
        print("| model | run | calibration text | gptq | refinement | total wall | user + sys | peak RSS | "
              "perplexity (30,000 tokens) | vs float |")
        print("|---|---|---|---|---|---|---|---|---|---|")
        for seed in [int(x) for x in args.seeds.split(",") if x]:
            wall, log, peak, cpu_s = quantize(stories, Path(tmp) / "q", ["--seed", str(seed)])
            cal, gptq, ref, n, steps = stage_times(log)
            ppl = perplexity(str(Path(tmp) / "q"))
            print(f"| stories260k | defaults ({n} x 128 tokens, {steps} steps), seed {seed}, measured | {cal:.1f} s | "
                  f"{gptq:.1f} s | {ref:.1f} s | {wall:.1f} s | {cpu_s:.1f} s | {peak:.2f} GiB | {ppl:.4f} "
                  f"(float {base:.4f}) | {100 * (ppl / base - 1):+.2f}% |", flush=True)
        for shape in [s for s in args.shapes.split(",") if s]:
            from llmsys.engine.bench.synthetic import make_synthetic

            model = str(make_synthetic(shape, seed=0))
            runs = []  # (sequences, steps, stage seconds, wall, peak)
            for n_seq, n_steps in (tuple(int(x) for x in p.split("x")) for p in args.points.split(",")):
                wall, log, peak, cpu_s = quantize(model, Path(tmp) / shape, ["--calib-samples", str(n_seq),
                                                                      "--tune-steps", str(n_steps)])
                cal, gptq, ref, _, _ = stage_times(log)
                runs.append((n_seq, n_steps, (cal, gptq, ref), wall, peak))
                print(f"| synthetic {shape} | measured: {n_seq} sequences, {n_steps} steps | {cal:.1f} s | "
                      f"{gptq:.1f} s | {ref:.1f} s | {wall:.1f} s | {cpu_s:.1f} s | {peak:.2f} GiB | - | - |", flush=True)
            (n0, s0, t0, _, _), (n1, s1, t1, _, _) = runs
            est = []
            for stage, (u0, u1, full) in enumerate(((n0, n1, 512), (n0, n1, 512), (s0, s1, DEFAULT_TUNE_STEPS))):
                per_unit = (t1[stage] - t0[stage]) / (u1 - u0)
                # A stage whose fixed cost hides its per-unit cost (the second run no slower) has no estimate.
                est.append(t0[stage] + per_unit * (full - u0) if per_unit > 0 else None)
            cells = [f"{est[0] / 60:.0f} min" if est[0] else "no fit", f"{est[1] / 60:.0f} min" if est[1] else "no fit",
                     f"{est[2] / 3600:.1f} h" if est[2] else "no fit"]
            total = f"{sum(est) / 3600:.1f} h" if all(est) else f">= {sum(e for e in est if e) / 3600:.1f} h"
            print(f"| synthetic {shape} | estimate at the defaults (512 x 128 tokens, {DEFAULT_TUNE_STEPS} steps) | "
                  f"{' | '.join(cells)} | {total} | - | - | - | - |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
