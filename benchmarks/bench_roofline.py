"""Decode roofline: how far above transformers any engine could get on this machine.

Batch-1 decode reads every weight once per token, so tok/s <= read bandwidth /
bytes per token. One run measures, with the same thread count:

(a) the achievable streaming read bandwidth: the best of a float32 sum over a
    buffer far larger than the last-level cache and a prepacked oneDNN GEMV
    over a matrix of that size in the model dtype (the kernel decode uses),
    probed before and after the engines (the VM's bandwidth drifts);
(b) transformers' ``generate()`` decode tok/s and (c) llmsys's, on the same
    random SmolLM2-135M-shaped Llama as ``bench_core.py`` (128-token prompt,
    64 new tokens, median of ``--runs``, interleaved).

It reports bytes per token (the weights once, tied embedding = head counted
once, plus the KV cache read at the mean context), each engine's achieved GB/s,
how long llmsys's own GEMVs take alone (what is left of a step is other ops and
overhead), and the ceiling ratio = roof tok/s / transformers tok/s: the largest
decode speed-up over transformers that any engine could reach here.

    python benchmarks/bench_roofline.py [--dtype bfloat16 float32] [--threads 2] [--runs 5]
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import torch

from bench_core import make_model, time_hf

TARGETS = {"bfloat16": 2.0, "float32": 1.5}  # issue 2: decode vs transformers


def gemv_read_gbps(dtype: torch.dtype, nbytes: int, reps: int) -> float:
    """Best read rate of a prepacked M = 1 GEMV over an ``nbytes`` weight (K = 2048)."""
    from llmsys.kernels import linear, prepack

    k = 2048
    n = nbytes // (k * torch.tensor([], dtype=dtype).element_size())
    w = prepack(torch.ones(n, k, dtype=dtype))
    x = torch.ones(1, k, dtype=dtype)
    best = float("inf")
    with torch.inference_mode():
        linear(x, w)
        for _ in range(reps):
            t = time.perf_counter()
            linear(x, w)
            best = min(best, time.perf_counter() - t)
    return n * k * x.element_size() / best / 1e9


def probe(dtype: torch.dtype, nbytes: int, reps: int) -> dict[str, float]:
    from llmsys.offload.bandwidth import probe_mem_gbps

    return {"sum": probe_mem_gbps(nbytes, reps), "gemv": gemv_read_gbps(dtype, nbytes, reps)}


def gemv_pass_s(model: torch.nn.Module, dtype: torch.dtype, reps: int) -> float:
    """Median time of one M = 1 pass over every ``nn.Linear`` of the engine's model (its packed weights)."""
    mods = [m for m in model.modules() if isinstance(m, torch.nn.Linear)]
    xs = {m.in_features: torch.randn(1, m.in_features).to(dtype) for m in mods}
    times = []
    with torch.inference_mode():
        for _ in range(reps + 1):
            t = time.perf_counter()
            for m in mods:
                m(xs[m.in_features])
            times.append(time.perf_counter() - t)
    return statistics.median(times[1:])


def bytes_per_token(hf, ctx: float) -> tuple[int, int]:
    """(weight bytes, KV bytes) read by one batch-1 decode step at context ``ctx``."""
    seen, weights = set(), 0
    for p in hf.parameters():  # a tied embedding is the head's tensor: counted once
        if id(p) not in seen:
            seen.add(id(p))
            weights += p.numel() * p.element_size()
    c = hf.config
    head_dim = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
    elt = next(hf.parameters()).element_size()
    kv = int(2 * c.num_hidden_layers * c.num_key_value_heads * head_dim * elt * ctx)
    return weights, kv


def run(dtype_name: str, a: argparse.Namespace) -> list[str]:
    from transformers import AutoModelForCausalLM

    from llmsys import LLM, SamplingParams

    dtype = getattr(torch, dtype_name)
    before = probe(dtype, a.buffer_mib << 20, a.reps)
    with tempfile.TemporaryDirectory() as d:
        path = make_model(Path(d) / "m", dtype)
        hf = AutoModelForCausalLM.from_pretrained(path, dtype=dtype).eval()
        llm = LLM(str(path), dtype=dtype_name, device="cpu", threads=a.threads, progress=False, kv_cache_tokens=4096)
        prompt = torch.randint(3, 500, (1, a.prompt), generator=torch.Generator().manual_seed(0))
        ids = prompt[0].tolist()
        sp = SamplingParams(temperature=0, max_tokens=a.new, ignore_eos=True)
        time_hf(hf, prompt, 4)  # warm-up both
        llm.generate([ids], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))
        hf_tok, our_tok = [], []
        for _ in range(a.runs):
            hf_tok.append(time_hf(hf, prompt, a.new)[1])
            our_tok.append(llm.generate([ids], sp)[0].timings.decode_tok_s)
        w_bytes, kv_bytes = bytes_per_token(hf, a.prompt + a.new / 2)
        gemv_s = gemv_pass_s(llm.loaded.model, dtype, a.reps)
        del llm, hf
    after = probe(dtype, a.buffer_mib << 20, a.reps)
    roof = max(*before.values(), *after.values())
    per_tok = w_bytes + kv_bytes
    hf_med, our_med = statistics.median(hf_tok), statistics.median(our_tok)
    roof_tok = roof * 1e9 / per_tok
    ceiling = roof_tok / hf_med
    need = TARGETS.get(dtype_name)
    out = [
        f"### {dtype_name}",
        "",
        f"read bandwidth, {a.threads} threads, {a.buffer_mib} MiB buffer, best of {a.reps}: "
        f"sum {before['sum']:.1f} / {after['sum']:.1f} GB/s, prepacked GEMV {before['gemv']:.1f} / {after['gemv']:.1f} GB/s "
        f"(before / after the engines); roof = {roof:.1f} GB/s",
        f"bytes per decode token: {w_bytes / 1e6:.1f} MB weights + {kv_bytes / 1e6:.1f} MB KV "
        f"(mean context {a.prompt + a.new / 2:.0f}) = {per_tok / 1e6:.1f} MB",
        "",
        "| engine | decode tok/s (median of %d) | achieved GB/s | %% of roof | vs transformers |" % a.runs,
        "|---|---:|---:|---:|---:|",
        f"| transformers | {hf_med:.1f} | {hf_med * per_tok / 1e9:.1f} | {100 * hf_med / roof_tok:.0f}% | 1.00x |",
        f"| llmsys | {our_med:.1f} | {our_med * per_tok / 1e9:.1f} | {100 * our_med / roof_tok:.0f}% | {our_med / hf_med:.2f}x |",
        f"| llmsys GEMVs alone (one M = 1 pass, no other op) | {1 / gemv_s:.1f} | {w_bytes / gemv_s / 1e9:.1f} | "
        f"{100 / gemv_s / roof_tok:.0f}% | {1 / gemv_s / hf_med:.2f}x |",
        f"| roof (any engine) | {roof_tok:.1f} | {roof:.1f} | 100% | {ceiling:.2f}x |",
        "",
        f"llmsys per token: {1e3 / our_med:.1f} ms, of which its GEMVs {gemv_s * 1e3:.1f} ms; "
        f"the other {1e3 / our_med - gemv_s * 1e3:.1f} ms is every other op and per-op overhead.",
        "",
    ]
    if need is not None:
        verdict = "below the roof: reachable in principle" if ceiling >= need else "ABOVE this machine's DRAM roof"
        out.append(f"Ceiling {ceiling:.2f}x vs the {need:.1f}x target: the target is {verdict}.")
        out.append("")
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dtype", nargs="+", default=["bfloat16", "float32"])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--prompt", type=int, default=128)
    ap.add_argument("--new", type=int, default=64)
    ap.add_argument("--buffer-mib", type=int, default=512, help="probe buffer (>> the last-level cache)")
    ap.add_argument("--reps", type=int, default=7, help="probe repetitions (best counts)")
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    print(f"## decode roofline: SmolLM2-135M shape (random weights), CPU, {a.threads} threads, batch 1")
    print(f"prompt {a.prompt} tokens, {a.new} generated; ceiling = roof tok/s / transformers tok/s\n")
    for name in a.dtype:
        print("\n".join(run(name, a)))


if __name__ == "__main__":
    main()
