"""Quantized CPU matmuls per matrix, against the prepacked bf16 GEMM they must keep up with.

Backs the prefill figures of ``kernels/cpu_qgemv.py`` and docs/benchmarks.md:
the four matrices of one Qwen2.5-0.5B layer as llmsys runs them (fused q|k|v
1152x896, o 896x896, fused gate|up 9728x896, down 896x4864), random weights,
bf16 activations. For each M: the prepacked bf16 GEMM's time, and the time of
the int8 and int4 layers (``Int8Linear`` / ``Int4Linear``, whatever path
they pick at that M) as a ratio of it, median of ``--repeat`` calls; then the
dense fallback (dequantize + bf16 GEMM, which runs where the C GEMM is not
native) at the prefill M, and the int4 GEMV vs GEMM times at small M (the two
give the same bits, so the layer switches at ``GEMM_MIN_ROWS`` by speed alone).

    python benchmarks/bench_qmatmul.py [--threads 2] [--repeat 25]
"""

from __future__ import annotations

import argparse

import torch
from bench_gemv import _median_s  # the same warm-up + median timing

MATRICES = [("q\\|k\\|v", 1152, 896), ("o", 896, 896), ("gate\\|up", 9728, 896), ("down", 896, 4864)]  # \| in Markdown


def _median_ms(fn, repeat: int) -> float:
    return _median_s(fn, repeat) * 1e3


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--repeat", type=int, default=25)
    ap.add_argument("--prefill", type=int, default=128, help="rows of the prefill-sized call")
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    from llmsys.kernels import cpu_qgemv, prepack
    from llmsys.kernels.cpu_linear import linear
    from llmsys.quant.int4 import GEMM_MIN_ROWS, Int4Linear
    from llmsys.quant.int8_fp8 import Int8Linear

    g = torch.Generator().manual_seed(0)
    layers = []
    for name, n, k in MATRICES:
        w = torch.randn(n, k, generator=g) * 0.02
        layers.append((name, n, k, prepack(w.bfloat16()), Int8Linear.from_float(w), Int4Linear.from_float(w)))
    native = cpu_qgemv.available() and cpu_qgemv.gemm_native()
    print(f"Qwen2.5-0.5B layer matrices, CPU, {a.threads} threads, bf16 activations, median of {a.repeat} calls; "
          f"C GEMM native: {'yes' if native else 'no (' + cpu_qgemv.kernel_status() + ')'}\n")
    print("| matrix | M | bf16 prepacked ms | int8 layer x bf16 | int4 layer x bf16 |")
    print("|---|---:|---:|---:|---:|")
    with torch.inference_mode():
        for name, n, k, wp, l8, l4 in layers:
            for m in (1, 8, 32, a.prefill):
                x = torch.randn(m, k, generator=g).bfloat16()
                tb = _median_ms(lambda: linear(x, wp), a.repeat)
                t8 = _median_ms(lambda: l8(x), a.repeat)
                t4 = _median_ms(lambda: l4(x), a.repeat)
                print(f"| {name} {n}x{k} | {m} | {tb:.3f} | {tb / t8:.2f} | {tb / t4:.2f} |")
        print(f"\nThe dense fallback at M = {a.prefill} (dequantize + bf16 GEMM, weight first), x bf16 prepacked:\n")
        print("| matrix | bf16 prepacked ms | int8 dense x bf16 | int4 dense x bf16 |")
        print("|---|---:|---:|---:|")
        for name, n, k, wp, l8, l4 in layers:
            x = torch.randn(a.prefill, k, generator=g).bfloat16()
            tb = _median_ms(lambda: linear(x, wp), a.repeat)
            t8 = _median_ms(lambda: l8._dequant_matmul(x), a.repeat)
            t4 = _median_ms(lambda: l4._dequant_matmul(x), a.repeat)
            print(f"| {name} {n}x{k} | {tb:.3f} | {tb / t8:.2f} | {tb / t4:.2f} |")
        if not cpu_qgemv.available():
            return
        print(f"\nint4 GEMV time / GEMM time (same bits; > 1: the GEMM is faster; the layer takes the GEMM "
              f"from M = {GEMM_MIN_ROWS}):\n")
        ms = (2, 4, 6, 8, 16, 32)
        print("| matrix | " + " | ".join(f"M={m}" for m in ms) + " |")
        print("|---|" + "---:|" * len(ms))
        for name, n, k, wp, l8, l4 in layers:
            args = (l4.packed, l4.scales_zeros, l4.zeros_gm.t(), l4.group_size)
            row = []
            for m in ms:
                x = torch.randn(m, k, generator=g).bfloat16()
                tv = _median_ms(lambda: cpu_qgemv.int4_gemv(x, *args, check=False), a.repeat)
                tm = _median_ms(lambda: cpu_qgemv.int4_gemm(x, *args, check=False), a.repeat)
                row.append(f"{tv / tm:.2f}")
            print(f"| {name} {n}x{k} | " + " | ".join(row) + " |")


if __name__ == "__main__":
    main()
