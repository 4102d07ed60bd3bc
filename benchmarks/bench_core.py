"""Core engine benchmark: llmsys vs transformers generate(), side by side.

A random-weight Llama with the SmolLM2-135M shape, CPU, batch 1, 128-token
prompt, 64 generated tokens, median of N runs, both engines on the same
weights, dtype and threads in one process. Also 8 prompts batched.

    python benchmarks/bench_core.py --dtype bfloat16 --threads 2 --runs 5
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))


def make_model(out: Path, dtype: torch.dtype) -> Path:
    from transformers import AutoConfig, AutoModelForCausalLM

    from llmsys.engine.catalog import synthetic_configs
    from tiny_models import write_tiny_tokenizer

    cfg = dict(synthetic_configs()["smollm2-135m"])
    mt = cfg.pop("model_type")
    config = AutoConfig.for_model(mt, **cfg)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config).to(dtype)
    model.save_pretrained(out)
    write_tiny_tokenizer(out, 512)
    return out


def time_hf(model, prompt: torch.Tensor, new: int) -> tuple[float, float]:
    """(prefill s, decode tok/s) with transformers generate()."""
    with torch.inference_mode():
        t0 = time.perf_counter()
        model(prompt)  # prefill alone, for the prefill rate
        t1 = time.perf_counter()
        t2 = time.perf_counter()
        out = model.generate(prompt, max_new_tokens=new, min_new_tokens=new, do_sample=False, pad_token_id=0)
        t3 = time.perf_counter()
    assert out.shape[1] == prompt.shape[1] + new
    # generate() = one prefill + (new - 1) decode steps
    decode_s = (t3 - t2) - (t1 - t0)
    return t1 - t0, (new - 1) / decode_s


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--prompt", type=int, default=128)
    ap.add_argument("--new", type=int, default=64)
    ap.add_argument("--batch", type=int, default=8)
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    dtype = getattr(torch, a.dtype)
    from transformers import AutoModelForCausalLM

    from llmsys import LLM, SamplingParams

    with tempfile.TemporaryDirectory() as d:
        path = make_model(Path(d) / "m", dtype)
        hf = AutoModelForCausalLM.from_pretrained(path, dtype=dtype).eval()
        llm = LLM(str(path), dtype=a.dtype, device="cpu", threads=a.threads, progress=False, kv_cache_tokens=4096,
                  max_num_batched_tokens=a.prompt * a.batch,  # all prompts prefill in one step
                  prefix_caching=False)  # every run computes its prompt (as transformers does)
        g = torch.Generator().manual_seed(0)
        prompt = torch.randint(3, 500, (1, a.prompt), generator=g)
        sp = SamplingParams(temperature=0, max_tokens=a.new, ignore_eos=True)
        ids = prompt[0].tolist()
        # warm-up both
        time_hf(hf, prompt, 4)
        llm.generate([ids], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))
        hf_pf, hf_dec, our_pf, our_dec = [], [], [], []
        for _ in range(a.runs):
            p, d_ = time_hf(hf, prompt, a.new)
            hf_pf.append(a.prompt / p)
            hf_dec.append(d_)
            o = llm.generate([ids], sp)[0]
            our_pf.append(o.timings.prompt_tok_s)
            our_dec.append(o.timings.decode_tok_s)
        batch_ids = [torch.randint(3, 500, (a.prompt,), generator=g).tolist() for _ in range(a.batch)]
        agg = []
        for _ in range(a.runs):
            t0 = time.perf_counter()
            outs = llm.generate(batch_ids, sp)
            # aggregate decode rate: tokens after the first, over the span from
            # the (shared) prefill step to the end
            first = max(o.timings.ttft_s for o in outs)
            span = time.perf_counter() - t0 - first
            agg.append(sum(len(o.token_ids) - 1 for o in outs) / span)
    med = statistics.median
    print(f"## core benchmark: SmolLM2-135M shape (random weights), CPU, {a.dtype}, {a.threads} threads")
    print(f"prompt {a.prompt} tokens, {a.new} generated, batch 1, median of {a.runs} runs\n")
    print("| metric | llmsys | transformers | ratio |")
    print("|---|---|---|---|")
    print(f"| prefill tok/s | {med(our_pf):.1f} | {med(hf_pf):.1f} | {med(our_pf) / med(hf_pf):.2f}x |")
    print(f"| decode tok/s | {med(our_dec):.1f} | {med(hf_dec):.1f} | {med(our_dec) / med(hf_dec):.2f}x |")
    print(f"| decode tok/s, {a.batch} prompts batched (aggregate) | {med(agg):.1f} | | {med(agg) / med(our_dec):.2f}x of batch 1 |")


if __name__ == "__main__":
    main()
