#!/usr/bin/env python
"""The CPU decode kernels of issue #17, each against what it replaced, in one process, interleaved.

- the C bf16 GEMV (``cpu_qgemv.bf16_gemv``) vs torch's bf16 ``F.linear`` at M = 1, weights from DRAM (enough
  copies of each matrix to pass the last-level cache), GB/s of weight read;
- the C bf16 GEMV vs the upcast sgemm (``cpu_linear._bf16_upcast``) at M = 8 and 16 (where
  ``BF16_UPCAST_MIN_ROWS`` splits them);
- decode attention (``cpu_decode.decode_attention`` by slot) at 40 / 160 / 1000 tokens of context;
- a whole decode step of the SmolLM2-135M shape (synthetic weights), the fused decode layers against the
  same layers op by op (the engine's decode plan cleared: ``decode_plan.clear_decode_plan``), bf16 / int8 / int4.

Minimum over repetitions for the kernels, median of alternating rounds for the steps.

    python benchmarks/bench_decode_kernels.py --threads 2
"""

from __future__ import annotations

import argparse
import statistics
import time


def best(f, reps: int = 5) -> float:
    f()
    ts = []
    for _ in range(reps):
        t0 = time.perf_counter()
        f()
        ts.append(time.perf_counter() - t0)
    return min(ts)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=5)
    a = ap.parse_args()
    import torch
    import torch.nn.functional as F

    from llmsys.kernels import cpu_decode, cpu_linear, cpu_qgemv

    torch.set_num_threads(a.threads)
    print(f"{a.threads} threads, torch {torch.__version__}, CPU capability {torch.backends.cpu.get_cpu_capability()}\n")
    print("| bf16 GEMV, M = 1, from DRAM | C | torch F.linear |")
    print("|---|---|---|")
    for n, k in ((49152, 576), (3072, 576), (576, 1536), (960, 576)):
        ws = [torch.randn(n, k).bfloat16() for _ in range(max(2, 200_000_000 // (n * k * 2)))]
        x = torch.randn(1, k).bfloat16()
        cells = []
        for f in (lambda w: cpu_qgemv.bf16_gemv(x, w, check=False), lambda w: F.linear(x, w)):
            t = best(lambda: [f(w) for w in ws], 3) / len(ws)
            cells.append(f"{t * 1e6:.0f} us, {n * k * 2 / t / 1e9:.1f} GB/s")
        print(f"| {n}x{k} | {cells[0]} | {cells[1]} |")
    print("\n| bf16 matmul, ms | M | C GEMV | upcast sgemm |")
    print("|---|---|---|---|")
    for n, k in ((3072, 576), (49152, 576)):
        w = torch.randn(n, k).bfloat16()
        for m in (8, 16):
            x = torch.randn(m, k).bfloat16()
            c = best(lambda: cpu_qgemv.bf16_gemv(x, w, check=False))
            u = best(lambda: cpu_linear._bf16_upcast(x, w, None))
            print(f"| {n}x{k} | {m} | {c * 1e3:.2f} | {u * 1e3:.2f} |")
    print("\n| decode attention, 9 q heads / 3 KV heads x 64, bf16 | context | us |")
    print("|---|---|---|")
    kp, vp = torch.randn(2048, 3, 64).bfloat16(), torch.randn(2048, 3, 64).bfloat16()
    q = torch.randn(1, 9, 64).bfloat16()
    for n in (40, 160, 1000):
        slots, lens = torch.arange(n).view(1, n), torch.tensor([n])
        t = best(lambda: [cpu_decode.decode_attention(q, kp, vp, lens, 0.125, slots) for _ in range(200)]) / 200
        print(f"| | {n} | {t * 1e6:.1f} |")

    from llmsys import LLM
    from llmsys.engine.bench.measure import StepDriver, TestSpec
    from llmsys.engine.bench.synthetic import make_synthetic
    from llmsys.engine.models.decode_plan import build_decode_plan, clear_decode_plan

    model = make_synthetic("smollm2-135m", seed=0)
    print("\n| SmolLM2-135M shape decode step (8-token prompt + 64 steps), ms | fused layers | op by op | ratio |")
    print("|---|---|---|---|")
    for quant in ("none", "int8", "int4"):
        llm = LLM(str(model), dtype="bfloat16", quant=quant, device="cpu", threads=a.threads, progress=False,
                  kv_cache_tokens=512, prefix_caching=False)
        d, g = StepDriver(llm.core), torch.Generator().manual_seed(0)
        d.run(TestSpec(8, 64), 1, g)
        res: dict[str, list[float]] = {"fused": [], "op": []}
        m, runner = llm.loaded.model, llm.core.runner
        for _ in range(a.rounds):
            for name in ("fused", "op"):
                if name == "fused":
                    build_decode_plan(m, runner.attn, runner.layers)
                else:
                    clear_decode_plan(m)
                res[name].append(statistics.median(d.run(TestSpec(8, 64), 1, g).decode_steps))
        f_ms, o_ms = (1e3 * statistics.median(res[k]) for k in ("fused", "op"))
        print(f"| {'bf16' if quant == 'none' else quant} | {f_ms:.2f} | {o_ms:.2f} | {o_ms / f_ms:.2f}x |")


if __name__ == "__main__":
    main()
