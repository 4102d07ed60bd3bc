"""What the batch-invariant CPU kernels cost against what they replaced (issue #48), one thread.

1. Prompt attention: ``cpu_decode.rows_attention`` (every prompt token as a decode step at its position)
   against torch SDPA over one causal sequence, SmolLM2-135M shape (Hq 9, Hk 3, D 64), bf16, per layer.
2. bf16 prompts on an AVX2 build (``x86-64-v3``, loaded on this CPU): the GEMV's register-blocked tile
   (``bf16_gemv``, M >= 4) against the per-row GEMV (M = 3, per row) and the C bf16 GEMM that prompts ran
   before (another summation order), M = 128, Qwen2.5-0.5B-like matrices.

Median of ``--reps``; prints a Markdown table. Usage: ``python benchmarks/bench_invariant_kernels.py``.
"""

from __future__ import annotations

import argparse
import platform
import statistics
import time

import torch
import torch.nn.functional as F

from llmsys.kernels import _cbuild, cpu_decode, cpu_qgemv


def _ms(fn, reps: int) -> float:
    fn()
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e3


def attention(reps: int) -> list[str]:
    hq, hk, d = 9, 3, 64
    rows = ["| prompt tokens | rows_attention ms | torch SDPA ms | ratio |", "|---|---|---|---|"]
    for n in (128, 512, 2048):
        g = torch.Generator().manual_seed(n)
        k, v = (torch.randn(1, n, hk, d, generator=g).bfloat16() for _ in range(2))
        q = torch.randn(n, hq, d, generator=g).bfloat16()
        seq, lens = torch.zeros(n, dtype=torch.int64), torch.arange(1, n + 1)
        mask = torch.ones(n, n, dtype=torch.bool).tril()[None, None]
        qs, ks, vs = q.transpose(0, 1)[None], k[0].transpose(0, 1)[None], v[0].transpose(0, 1)[None]
        a = _ms(lambda: cpu_decode.rows_attention(q, k, v, seq, lens, 0.125), reps)
        b = _ms(lambda: F.scaled_dot_product_attention(qs, ks, vs, attn_mask=mask, scale=0.125, enable_gqa=True), reps)
        rows.append(f"| {n} | {a:.1f} | {b:.1f} | {a / b:.2f}x |")
    return rows


def avx2_gemv(reps: int) -> list[str]:
    path, why = _cbuild.find_or_build(cpu_qgemv._SOURCE, _cbuild.level_named("x86-64-v3"))
    if path is None or not _cbuild.supports(_cbuild.level_named("x86-64-v3")):
        return [f"(no x86-64-v3 build here: {why})"]
    lib = _cbuild.load(path, cpu_qgemv._SIGNATURES)
    rows = ["| weight | per-row GEMV (M = 3) GFLOP/s | GEMV tile (M = 128) | C bf16 GEMM (M = 128) |",
            "|---|---|---|---|"]
    for n, k in ((4864, 896), (896, 4864), (1536, 576)):
        g = torch.Generator().manual_seed(n)
        w = torch.randn(n, k, generator=g).bfloat16()
        x3, x = torch.randn(3, k, generator=g).bfloat16(), torch.randn(128, k, generator=g).bfloat16()
        per_row = 2 * 3 * n * k / _ms(lambda: cpu_qgemv.bf16_gemv(x3, w, lib=lib), reps) / 1e6
        tile = 2 * 128 * n * k / _ms(lambda: cpu_qgemv.bf16_gemv(x, w, lib=lib), reps) / 1e6
        gemm = 2 * 128 * n * k / _ms(lambda: cpu_qgemv.bf16_gemm(x, w, lib=lib), reps) / 1e6
        rows.append(f"| {n}x{k} | {per_row:.0f} | {tile:.0f} | {gemm:.0f} |")
    return rows


def _cpu() -> str:
    """The CPU's model name and family/model (Linux), else the platform's word for it."""
    try:
        info = dict(line.split(":", 1) for line in open("/proc/cpuinfo").read().split("\n\n")[0].splitlines() if ":" in line)
        info = {key.strip(): val.strip() for key, val in info.items()}
        return f"{info['model name']} (family {info['cpu family']}, model {info['model']})"
    except (OSError, KeyError):
        return platform.processor() or platform.machine()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--reps", type=int, default=7)
    args = ap.parse_args()
    torch.set_num_threads(1)
    level = cpu_decode.kernel_status().split()[1] if cpu_decode.available() else "none"
    print(f"Machine: {_cpu()}, kernels at {level}, 1 thread, median of {args.reps}\n")
    print("\n".join(attention(args.reps)))
    print()
    print("\n".join(avx2_gemv(args.reps)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
