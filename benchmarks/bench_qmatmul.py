"""Quantized CPU matmuls per matrix, against the prepacked bf16 GEMM they must keep up with.

Backs the prefill figures of ``kernels/cpu_qgemv.py`` and docs/benchmarks.md:
the four matrices of one Qwen2.5-0.5B layer as llmsys runs them (fused q|k|v
1152x896, o 896x896, fused gate|up 9728x896, down 896x4864), random weights,
bf16 activations. For each M: the prepacked bf16 GEMM's time, and the time of
the int8 and int4 layers (``Int8Linear`` / ``Int4Linear``, whatever path
they pick at that M) as a ratio of it, median of ``--repeat`` calls; then the
dense fallback (dequantize + bf16 GEMM, which runs without the C kernels) at the
prefill M, and at decode sizes the a8 GEMVs the layers run there (x in int8 per
32 columns, integer dot products), on these matrices and on the 151936x896 LM head
(weights from DRAM).

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
    from llmsys.quant.int4 import Int4Linear
    from llmsys.quant.int8_fp8 import Int8Linear

    g = torch.Generator().manual_seed(0)
    layers = []
    for name, n, k in MATRICES:
        w = torch.randn(n, k, generator=g) * 0.02
        wb = w.bfloat16()
        packed = prepack(wb)  # None where oneDNN does not pack bf16 (AVX2): the plain weight, as the engine keeps it
        layers.append((name, n, k, wb if packed is None else packed, Int8Linear.from_float(w), Int4Linear.from_float(w)))
    kernels_packed = all(lay[3].is_mkldnn for lay in layers)
    print(f"Qwen2.5-0.5B layer matrices, CPU, {a.threads} threads, bf16 activations, median of {a.repeat} calls; "
          f"bf16 GEMM on the prepacked weight where oneDNN packs bf16: {'yes' if kernels_packed else 'no'}; "
          f"C kernels: {cpu_qgemv.kernel_status()}\n")
    print("| matrix | M | bf16 GEMM ms | int8 layer x bf16 | int4 layer x bf16 |")
    print("|---|---:|---:|---:|---:|")
    with torch.inference_mode():
        for name, n, k, wp, l8, l4 in layers:
            for m in (1, 8, 32, a.prefill):
                x = torch.randn(m, k, generator=g).bfloat16()
                tb = _median_ms(lambda: linear(x, wp), a.repeat)
                t8 = _median_ms(lambda: l8(x), a.repeat)
                t4 = _median_ms(lambda: l4(x), a.repeat)
                print(f"| {name} {n}x{k} | {m} | {tb:.3f} | {tb / t8:.2f} | {tb / t4:.2f} |")
        print(f"\nThe dense fallback at M = {a.prefill} (dequantize + bf16 GEMM, weight first), x the bf16 GEMM:\n")
        print("| matrix | bf16 GEMM ms | int8 dense x bf16 | int4 dense x bf16 |")
        print("|---|---:|---:|---:|")
        for name, n, k, wp, l8, l4 in layers:
            x = torch.randn(a.prefill, k, generator=g).bfloat16()
            tb = _median_ms(lambda: linear(x, wp), a.repeat)
            t8 = _median_ms(lambda: l8._dequant_matmul(x), a.repeat)
            t4 = _median_ms(lambda: l4._dequant_matmul(x), a.repeat)
            print(f"| {name} {n}x{k} | {tb:.3f} | {tb / t8:.2f} | {tb / t4:.2f} |")
        if not cpu_qgemv.available():
            return
        print("\nDecode sizes: the a8 GEMVs (what the layers run), ms:\n")
        print("| matrix | M | int8 a8 | int4 a8 |")
        print("|---|---:|---:|---:|")
        head = torch.randn(151936, 896, generator=g) * 0.02
        big = [("head", 151936, 896, None, Int8Linear.from_float(head), Int4Linear.from_float(head))]
        del head
        for name, n, k, _, l8, l4 in layers + big:
            q8 = (l8.qweight, l8.scales)
            q4 = (l4.packed, l4.scales_zeros, l4.zeros_gm.t(), l4.group_size)
            for m in (1,) if name == "head" else (1, 4, 16, 28):
                x = torch.randn(m, k, generator=g).bfloat16()
                a8 = _median_ms(lambda: cpu_qgemv.int8_gemv_a8(x, *q8, check=False), a.repeat)
                a4 = _median_ms(lambda: cpu_qgemv.int4_gemv_a8(x, *q4, check=False), a.repeat)
                print(f"| {name} {n}x{k} | {m} | {a8:.3f} | {a4:.3f} |")

if __name__ == "__main__":
    main()
