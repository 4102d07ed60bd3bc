#!/usr/bin/env python
"""A/B two builds of the C kernels (``kernels/*.c``): a git revision's against the working tree's, side by side.

Why: a kernel change must give the same bits and should be faster, and on these VMs two runs of one
build differ by 10-30% from minute to minute. So both builds are compiled here for the same ISA level,
loaded into one process, checked bit for bit against each other on every shape, and timed
interleaved (A, B, A, B, ...; median of each): the ratio is what counts. The a8 GEMVs (what every row
of a quantized CPU layer runs) on the Qwen2.5-0.5B gate|up (9728x896) and down (896x4864) matrices,
SmolLM2-135M's gate|up (1728x576) and its 49152x576 head; int4 with group 64. ``--kinds`` adds the GGUF
layouts kept as stored (q8_0: fp16 scales per 32 columns; q6_k: int8 scales per 16 and fp16 per 256, on
the matrices whose K is a multiple of 256; q5_k: float32 scales and offsets per 32). ``--dram MB``: each
call runs over that many MB of copies of the weight, one after another, so the weights come from RAM as in
a decode step (one matrix alone is served from the L3 cache after its first call).

    python benchmarks/ab_qgemv_builds.py HEAD~1                  # the best level this CPU runs
    python benchmarks/ab_qgemv_builds.py HEAD~1 --level x86-64-v3 --rows 1,8,128
    python benchmarks/ab_qgemv_builds.py HEAD~1 --rows 1,4 --dram 256   # decode: weights from RAM
    python benchmarks/ab_qgemv_builds.py HEAD~1 --kinds q8_0,q6_k,q5_k --rows 1 --dram 256
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SHAPES = [(9728, 896), (896, 4864), (1728, 576), (49152, 576)]
KINDS = ("int4", "int8", "q8_0", "q6_k", "q5_k")


def _kernel_dir(rev: str | None, into: Path) -> Path:
    """The ``kernels/`` folder of git revision ``rev`` extracted under ``into`` (None: the working tree's)."""
    if rev is None:
        return ROOT / "kernels"
    tar = subprocess.run(["git", "archive", rev, "kernels"], cwd=ROOT, check=True, capture_output=True).stdout
    subprocess.run(["tar", "-x", "-C", str(into)], input=tar, check=True)
    return into / "kernels"


def _build(kernels: Path, level, out: Path):
    """Compile one version's kernel sources (every ``*.c`` but the CPU probe) into one library and load it."""
    from llmsys.kernels import _cbuild, cpu_qgemv

    sources = [str(p) for p in sorted(kernels.glob("*.c")) if p.name != "cpu_features.c"]
    cmd = [_cbuild.compiler() or "gcc", *_cbuild.COMMON_FLAGS, *level.flags, "-I", str(kernels), "-o", str(out),
           *sources]
    subprocess.run(cmd, check=True, capture_output=True, text=True)
    return _cbuild.load(out, cpu_qgemv._SIGNATURES)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("rev", help="git revision of the A build (B is the working tree)")
    ap.add_argument("--level", help="ISA level of both builds (default: the best this CPU runs)")
    ap.add_argument("--rows", default="1,2,4,8,32,128", help="rows of x, comma list")
    ap.add_argument("--kinds", default="int4,int8", help="weight layouts, comma list of " + ",".join(KINDS))
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=3, help="interleaved rounds (each a median of --reps calls)")
    ap.add_argument("--reps", type=int, default=9)
    ap.add_argument("--dram", type=float, default=0.0,
                    help="MB of weight copies a timed call runs over (weights from RAM, not cache); 0: one matrix")
    a = ap.parse_args()

    import torch
    from bench_gemv import _median_s  # the same warm-up + median timing

    from llmsys.kernels import _cbuild, cpu_qgemv

    torch.set_num_threads(a.threads)
    level = _cbuild.level_named(a.level) if a.level else _cbuild.selected_level()[0]
    if level is None or not _cbuild.supports(level):
        sys.exit(f"ISA level {a.level or 'of this CPU'} cannot run here")
    with tempfile.TemporaryDirectory() as tmp:
        libs = [_build(_kernel_dir(a.rev, Path(tmp)), level, Path(tmp) / "a.so"),
                _build(_kernel_dir(None, Path(tmp)), level, Path(tmp) / "b.so")]
        where = f"weights from RAM ({a.dram:g} MB of copies a pass)" if a.dram else "one matrix (cache-warm)"
        print(f"A = {a.rev}, B = working tree; {level.name}, {a.threads} threads, {where}; ms per call, median "
              f"of {a.rounds} interleaved rounds of {a.reps}; B's bits checked equal to A's\n")
        kinds = [kd for kd in a.kinds.split(",") if kd]
        if any(kd not in KINDS for kd in kinds):
            sys.exit(f"--kinds: one of {', '.join(KINDS)}, got {a.kinds}")
        print("| matrix | rows | " + " | ".join(f"{kd} A | {kd} B | B speed-up" for kd in kinds) + " |")
        print("|---|---|" + "---|---|---|" * len(kinds))
        for n, k in SHAPES:
            torch.manual_seed(n + k)
            w = torch.randn(n, k) * 0.02
            copies = max(1, round(a.dram * 1e6 / (n * k)))  # int8 bytes; int4's copies are half as many bytes
            weights = {kd: [_weight(kd, w, torch) for _ in range(copies)] for kd in kinds if _fits(kd, k)}
            for m in (int(r) for r in a.rows.split(",")):
                x = torch.randn(m, k).bfloat16()
                cells = []
                for kd in kinds:
                    if kd not in weights:
                        cells += ["-", "-", "-"]  # q6_k: K not a multiple of 256
                        continue

                    def op(lib, kd=kd):
                        return [_call(kd, x, wt, lib, cpu_qgemv) for wt in weights[kd]][-1]
                    if not torch.equal(op(libs[0]).view(torch.int16), op(libs[1]).view(torch.int16)):
                        sys.exit(f"{kd} {n}x{k} M={m}: the builds give different bits")
                    t = [[], []]
                    for _ in range(a.rounds):
                        for j in (0, 1):
                            t[j].append(_median_s(lambda: op(libs[j]), a.reps) * 1e3 / copies)
                    ta, tb = statistics.median(t[0]), statistics.median(t[1])
                    cells += [f"{ta:.3f}", f"{tb:.3f}", f"{ta / tb:.2f}x"]
                print(f"| {n}x{k} | {m} | " + " | ".join(cells) + " |", flush=True)


def _fits(kind: str, k: int) -> bool:
    return kind != "q6_k" or k % 256 == 0


def _weight(kind: str, w, torch) -> tuple:
    """One copy of w [N, K] in the layout the kind's GEMV reads (random codes and scales of that layout for
    the GGUF kinds: only their bytes and the bits the two builds give matter here)."""
    from llmsys.quant.int4 import Int4Linear
    from llmsys.quant.int8_fp8 import Int8Linear

    n, k = w.shape
    if kind == "int4":
        b4 = Int4Linear.from_float(w, group_size=64)._buffers
        sc = b4["scales_orig"] if b4["scales_orig"] is not None else b4["scales_zeros"]
        return b4["packed"].clone(), sc.clone(), b4["zeros_gm"].t().clone()
    if kind == "int8":
        l8 = Int8Linear.from_float(w)
        return l8.qweight.clone(), l8.scales.clone()
    q = torch.randint(-32, 32, (n, k), dtype=torch.int8)
    if kind == "q8_0":
        return q, (torch.rand(-(-k // 32), n) / 64).half()
    if kind == "q6_k":
        return q, torch.randint(-64, 64, (k // 16, n), dtype=torch.int8), (torch.rand(k // 256, n) / 4096).half()
    return q.abs(), torch.rand(k // 32, n) / 64, -torch.rand(k // 32, n) / 64  # q5_k


def _call(kind: str, x, wt: tuple, lib, cpu_qgemv):
    if kind == "int4":
        return cpu_qgemv.int4_gemv_a8(x, *wt, 64, check=False, lib=lib)
    if kind == "int8":
        return cpu_qgemv.int8_gemv_a8(x, *wt, check=False, lib=lib)
    if kind == "q8_0":
        return cpu_qgemv.int8g_gemv_a8(x, *wt, check=False, lib=lib)
    if kind == "q6_k":
        return cpu_qgemv.int8g_gemv_a8(x, wt[0], wt[1], super_scales=wt[2], check=False, lib=lib)
    return cpu_qgemv.int8g_gemv_a8(x, wt[0], wt[1], offsets=wt[2], check=False, lib=lib)


if __name__ == "__main__":
    main()
