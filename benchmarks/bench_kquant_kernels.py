#!/usr/bin/env python
"""The a8 GEMVs of GGUF's K-quant layouts kept as stored, and a GGUF's memory once loaded (issue #19).

Kernels (default): one decode row (M = 1) against each layout at the Llama-3.2-1B matrix shapes, the median of
``--reps`` calls after two warm-ups, in ms and in GB/s of the bytes the layer holds (codes and factors): int4 with
integer zeros and fp16 scales (Q4_0 as kept), int4 with float32 scales and offsets (Q4_1), int4 with Q4_K's stored
6-bit scales and fp16 super-block factors, int8 with fp16 scales per 32 (Q8_0), int8 with Q6_K's stored int8
scales per 16 and fp16 factors per 256, int8 with float32 scales and offsets per 32 (Q5_K).

``--gguf FILE``: ``LLM(FILE)``'s weight bytes (``memory_report``), the process's resident memory once loaded and
its peak. Only ``LLM`` and ``memory_report`` are used, so a worktree of an older commit on PYTHONPATH measures that
commit the same way.

    python benchmarks/bench_kquant_kernels.py [--threads 2] [--reps 30]
    python benchmarks/bench_kquant_kernels.py --gguf FILE.gguf
"""

from __future__ import annotations

import argparse
import platform
import resource
import time


def _median_s(fn, reps: int) -> float:
    fn(), fn()
    ts = []
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t)
    return sorted(ts)[len(ts) // 2]


def kernels(threads: int, reps: int) -> None:
    import torch

    from llmsys.kernels import KScales, cpu_report, pack_int4
    from llmsys.quant.int4 import Int4Linear
    from llmsys.quant.int8_block import Int8BlockLinear, quantize_int8_block

    torch.set_num_threads(threads)
    k = cpu_report.cpu_kernels()
    print(f"machine: {platform.machine()}, C kernels at {k.level}, torch {torch.__version__} "
          f"({torch.backends.cpu.get_cpu_capability()}), {threads} threads, M = 1, median of {reps}\n")
    print("| N x K | layout | ms | GB/s of the layer's bytes |")
    print("|---|---|---|---|")
    for n, kk in [(8192, 2048), (2048, 8192), (128256, 2048)]:
        g = torch.Generator().manual_seed(0)
        q4 = pack_int4(torch.randint(0, 16, (n, kk), generator=g, dtype=torch.uint8))
        groups = kk // 32
        s = torch.rand(n, groups, generator=g) * 0.01
        ks = KScales(torch.randint(0, 64, (groups, n), generator=g, dtype=torch.uint8),
                     torch.randint(0, 64, (groups, n), generator=g, dtype=torch.uint8),
                     (torch.rand(groups // 8, n, generator=g) * 1e-3).half(),
                     (torch.rand(groups // 8, n, generator=g) * 1e-3).half())
        q8, bs = quantize_int8_block(torch.randn(n, kk, generator=g) * 0.02)
        layers = {
            "int4, fp16 scales, zero 8 (Q4_0)": Int4Linear(q4, s.half(), torch.full((n, groups), 8.0).half(),
                                                           in_features=kk),
            "int4, float32 scales + offsets (Q4_1)": Int4Linear(q4, s, torch.zeros(n, groups),
                                                                offsets=-s * 3, in_features=kk),
            "int4, stored 6-bit scales (Q4_K)": Int4Linear(q4, None, torch.zeros(n, groups), kscales=ks, in_features=kk),
            "int8, fp16 scales per 32 (Q8_0)": Int8BlockLinear(q8, bs, None),
            "int8, stored scales per 16 (Q6_K)": Int8BlockLinear(
                q8, torch.randint(-128, 128, (kk // 16, n), generator=g, dtype=torch.int8), None,
                super_scales=(torch.rand(kk // 256, n, generator=g) * 1e-3).half()),
            "int8, float32 scales + offsets (Q5_K)": Int8BlockLinear(q8, torch.rand(groups, n, generator=g) * 0.01,
                                                                     None, offsets=torch.rand(groups, n, generator=g)),
        }
        x = torch.randn(1, kk, generator=g).bfloat16()
        for name, lin in layers.items():
            with torch.inference_mode():
                t = _median_s(lambda: lin(x), reps)
            print(f"| {n} x {kk} | {name} | {t * 1e3:.2f} | {lin.nbytes() / t / 1e9:.1f} |")


def gguf(path: str) -> None:
    import psutil

    import llmsys
    from llmsys import LLM

    llm = LLM(path, device="cpu", progress=False, max_model_len=512, max_num_seqs=1)
    weights = sum(llm.memory_report().weights.values())
    rss = psutil.Process().memory_info().rss
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    print(f"{path}: llmsys from {llmsys.__file__}: weights {weights / 2**20:.1f} MiB, resident once loaded "
          f"{rss / 2**20:.0f} MiB, peak {peak / 2**20:.0f} MiB")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--reps", type=int, default=30)
    ap.add_argument("--gguf", default=None, help="measure this GGUF's memory once loaded instead")
    a = ap.parse_args()
    if a.gguf:
        gguf(a.gguf)
    else:
        kernels(a.threads, a.reps)


if __name__ == "__main__":
    main()
