"""Quantization benchmark: weight bytes and CPU decode/prefill speed, side by side in one run.

Random-weight checkpoint with the Qwen2.5-0.5B shape (hidden 896, 24 layers,
14/2 heads, intermediate 4864, vocab 151936, tied embeddings), written once by
``llmsys.engine.bench.synthetic``. For each weight format the same prompt is
prefilled and ``--decode`` tokens are generated greedily at batch 1; the best
of ``--repeats`` runs is kept (the machine is shared). Quality rows are the
``llmsys perplexity`` commands printed at the end (stories260k), run separately.

    python benchmarks/bench_quant.py --threads 2
"""

from __future__ import annotations

import argparse

import torch

FORMATS = ("bf16", "int8", "int4")
# The quality rows of docs/benchmarks.md (stories260k perplexity), printed for reference.
QUALITY = """\
M=../shared/models/stories260k-hf; F=../shared/corpus/tinystories-valid.txt
llmsys perplexity $M $F --ctx 256 --limit 30000 --dtype float32 -t 1 [--quant int8|int4|nf4] [--kv-dtype int8|int4]
llmsys quantize $M --quant int4 --method gptq|awq [--tune-steps 0] -o /tmp/s260k-int4-calibrated -t 1
llmsys perplexity /tmp/s260k-int4-calibrated $F --ctx 256 --limit 30000 --dtype float32 -t 1 [--kv-dtype int8]"""


def measure(path: str, quant: str, threads: int, prompt_len: int, decode: int, repeats: int) -> dict:
    from llmsys import LLM, SamplingParams

    llm = LLM(path, dtype="bfloat16", quant="none" if quant == "bf16" else quant, threads=threads,
              kv_cache_tokens=2048, max_num_seqs=1, progress=False,
              prefix_caching=False)  # the repeated prompt is prefilled every run
    prompt = [(17 * i) % 150000 + 100 for i in range(prompt_len)]
    best_pre, best_dec = 0.0, 0.0
    for r in range(repeats + 1):  # the first run warms up
        out = llm.generate([prompt], SamplingParams(max_tokens=decode, temperature=0, ignore_eos=True))[0]
        t = out.timings
        if r:
            best_pre = max(best_pre, t.prompt_tokens / t.prefill_s if t.prefill_s else 0.0)
            best_dec = max(best_dec, (t.generated_tokens - 1) / t.decode_s if t.decode_s else 0.0)
    rep = llm.memory_report()
    return {"quant": quant, "weights": sum(rep.weights.values()), "prefill": best_pre, "decode": best_dec}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--shape", default="qwen2.5-0.5b")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--prompt", type=int, default=128)
    ap.add_argument("--decode", type=int, default=32)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--formats", default=",".join(FORMATS))
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    from llmsys.engine.bench.synthetic import make_synthetic

    path = str(make_synthetic(a.shape))
    rows = [measure(path, q, a.threads, a.prompt, a.decode, a.repeats) for q in a.formats.split(",")]
    base = next(r for r in rows if r["quant"] == "bf16")
    print(f"\n{a.shape}, CPU, {a.threads} threads, batch 1, prompt {a.prompt}, decode {a.decode} (best of {a.repeats})\n")
    print("| weights | bytes | x bf16 | prefill tok/s | x bf16 | decode tok/s | x bf16 |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        print(f"| {r['quant']} | {r['weights']:,} | {r['weights'] / base['weights']:.3f} | {r['prefill']:.1f} | "
              f"{r['prefill'] / base['prefill']:.2f} | {r['decode']:.2f} | {r['decode'] / base['decode']:.2f} |")
    print(f"\nquality rows (run separately):\n{QUALITY}")


if __name__ == "__main__":
    main()
