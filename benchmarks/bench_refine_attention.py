#!/usr/bin/env python
"""What batching the refinement's attention would save: per-sequence SDPA vs one batched call.

`llmsys quantize --method gptq` refines on 8 equal-length calibration sequences per step; the engine's prompt
attention (kernels/cpu_attention._prefill_each) runs one SDPA per sequence with an explicit causal mask, so a
sequence's bits do not depend on the rest of the step. This times forward + backward of that against one
batched SDPA with the same mask and against ``is_causal``, at stories260k's shape (8 heads, head_dim 8) and
the default 128-token sequences, and checks the batched output is bit-identical. Median of 5 rounds of 50.

    python benchmarks/bench_refine_attention.py
"""

from __future__ import annotations

import statistics
import time

import torch
import torch.nn.functional as F


def main() -> int:
    from llmsys.kernels.cpu_report import cpu_kernels

    torch.set_num_threads(2)
    b, h, length, d = 8, 8, 128, 8
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(b, h, length, d, generator=gen).requires_grad_() for _ in range(3))
    mask = torch.ones(length, length, dtype=torch.bool).tril()[None, None]  # [1, 1, L, L]
    variants = {
        "one SDPA per sequence (the engine's prompt path)": lambda: torch.cat(
            [F.scaled_dot_product_attention(q[i:i + 1], k[i:i + 1], v[i:i + 1], attn_mask=mask) for i in range(b)]),
        "one batched SDPA, same mask": lambda: F.scaled_dot_product_attention(q, k, v, attn_mask=mask.expand(b, 1, length, length)),
        "one batched SDPA, is_causal": lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True),
    }
    times = {name: [] for name in variants}
    for _ in range(5):  # interleaved rounds
        for name, fn in variants.items():
            t0 = time.perf_counter()
            for _ in range(50):
                fn().sum().backward()
            times[name].append((time.perf_counter() - t0) / 50 * 1000)
    ref = list(variants.values())[0]().detach()
    cpu = next((ln.split(":", 1)[1].strip() for ln in open("/proc/cpuinfo") if ln.startswith("model name")), "?")
    print(f"Machine: {cpu}, {cpu_kernels().summary()}; 2 threads; [8 seqs, 8 heads, 128 tokens, head_dim 8], float32.\n")
    print("| attention | fwd+bwd ms per layer (median of 5) | output bits equal to per-sequence |")
    print("|---|---|---|")
    for name, fn in variants.items():
        same = torch.equal(fn().detach(), ref)
        print(f"| {name} | {statistics.median(times[name]):.2f} | {'yes' if same else 'no'} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
