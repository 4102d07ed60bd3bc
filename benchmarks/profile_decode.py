#!/usr/bin/env python
"""Where a CPU decode step goes: cProfile over llmsys's decode steps, grouped by what the time is.

Loads a synthetic model (``models.toml`` [synthetic.*], random weights, cached in
$LLMSYS_HOME/synthetic) as ``bench_vs_llamacpp.py`` does, runs one warm-up and then a profiled
8-token prompt + ``--steps`` one-token decode steps (batch 1, engine/bench/measure.py's
StepDriver), and prints the milliseconds per step in the C matmul wrappers, in the other C
kernel wrappers (RMSNorm, RoPE + K/V store, decode attention) and in everything else (Python,
module dispatch, small torch ops), then the top functions by own time. cProfile adds its own cost
to every Python call, so "everything else" reads high; the split is what counts.

    python benchmarks/profile_decode.py --quant int4
    python benchmarks/profile_decode.py --shape qwen2.5-0.5b --quant int8
"""

from __future__ import annotations

import argparse
import cProfile
import io
import pstats


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shape", default="smollm2-135m")
    ap.add_argument("--quant", default="int4", help="none / int8 / int4")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--steps", type=int, default=64)
    ap.add_argument("--top", type=int, default=15)
    a = ap.parse_args()
    import torch

    from llmsys import LLM
    from llmsys.engine.bench.measure import StepDriver, TestSpec
    from llmsys.engine.bench.synthetic import make_synthetic

    torch.set_num_threads(a.threads)
    model = make_synthetic(a.shape, seed=0)
    llm = LLM(str(model), dtype="bfloat16", quant=a.quant, device="cpu", threads=a.threads, progress=False,
              kv_cache_tokens=2 * (8 + a.steps + 16), prefix_caching=False)
    driver, gen = StepDriver(llm.core), torch.Generator().manual_seed(0)
    test = TestSpec(8, a.steps)
    driver.run(test, 1, gen)  # warm-up
    prof = cProfile.Profile()
    prof.enable()
    driver.run(test, 1, gen)
    prof.disable()
    stats = pstats.Stats(prof)
    total = sum(v[2] for v in stats.stats.values())  # own time of every function
    groups = {"C matmuls (cpu_qgemv wrappers, torch linear)": 0.0, "other C kernels (cpu_decode)": 0.0}
    for (path, _, name), v in stats.stats.items():
        if path.endswith("cpu_qgemv.py") or name in ("<built-in method torch._C._nn.linear>",
                                                     "<built-in method torch.mm>"):
            groups["C matmuls (cpu_qgemv wrappers, torch linear)"] += v[2]
        elif path.endswith("cpu_decode.py"):
            groups["other C kernels (cpu_decode)"] += v[2]
    steps = a.steps + 1
    print(f"{a.shape}, quant {a.quant}, {a.threads} threads: {1e3 * total / steps:.1f} ms per step under cProfile "
          f"(8-token prompt + {a.steps} decode steps)\n")
    print("| where | ms per step | share |")
    print("|---|---:|---:|")
    rest = total - sum(groups.values())
    for what, sec in [*groups.items(), ("everything else (Python, dispatch, small torch ops)", rest)]:
        print(f"| {what} | {1e3 * sec / steps:.2f} | {100 * sec / total:.0f}% |")
    out = io.StringIO()
    pstats.Stats(prof, stream=out).sort_stats("tottime").print_stats(a.top)
    print("\n```\n" + "\n".join(ln for ln in out.getvalue().splitlines() if ln.strip()) + "\n```")


if __name__ == "__main__":
    main()
