"""How fast the CPU linear paths stream weights: F.linear vs oneDNN plain vs prepacked.

Backs the figures in ``kernels/cpu_linear.py`` and docs/benchmarks.md: the 210
layer matrices of the SmolLM2-135M shape (30 layers x q, k, v, o, gate, up,
down), random weights, timed as one pass at M = 1 (a decode step) and M = 16
(a batched decode step), median of ``--repeat`` passes, GB/s of weights read;
then its LM head (49152 x 576, tied to the embedding) alone.

    python benchmarks/bench_gemv.py [--threads 2] [--repeat 7]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.nn.functional as F

SHAPES = [(576, 576), (192, 576), (192, 576), (576, 576), (1536, 576), (1536, 576), (576, 1536)] * 30
HEAD = [(49152, 576)]


def _median_s(fn, repeat: int) -> float:
    fn()  # warm-up
    times = []
    for _ in range(repeat):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--repeat", type=int, default=7)
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    lp = torch.ops.mkldnn._linear_pointwise
    g = torch.Generator().manual_seed(0)
    for title, shapes in ((f"SmolLM2-135M layer matrices ({len(SHAPES)})", SHAPES), ("SmolLM2-135M LM head (49152 x 576)", HEAD)):
        print(f"{title}, CPU, {a.threads} threads, median of {a.repeat} passes\n")
        print("| dtype | M | F.linear GB/s | oneDNN plain GB/s | prepacked GB/s | prepacked ms/pass | prepacked vs F.linear |")
        print("|---|---:|---:|---:|---:|---:|---:|")
        _table(shapes, a.repeat, g, lp)
        print()


def _table(shapes, repeat, g, lp) -> None:
    from llmsys.kernels import linear, prepack

    for dt in (torch.float32, torch.bfloat16):
        ws = [torch.randn(n, k, generator=g).to(dt) for n, k in shapes]
        packed = [prepack(w) for w in ws]
        nbytes = sum(w.numel() * w.element_size() for w in ws)
        for m in (1, 16):
            xs = {k: torch.randn(m, k, generator=g).to(dt) for k in (576, 1536)}
            with torch.inference_mode():
                t_f = _median_s(lambda: [F.linear(xs[w.shape[1]], w) for w in ws], repeat)
                t_o = _median_s(lambda: [lp(xs[w.shape[1]], w, None, "none", [], "") for w in ws], repeat)
                t_p = _median_s(lambda: [linear(xs[w.shape[1]], p) for w, p in zip(ws, packed)], repeat)
            print(f"| {str(dt).removeprefix('torch.')} | {m} | {nbytes / t_f / 1e9:.1f} | {nbytes / t_o / 1e9:.1f} | "
                  f"{nbytes / t_p / 1e9:.1f} | {t_p * 1e3:.1f} | {t_f / t_p:.2f}x |")


if __name__ == "__main__":
    main()
