#!/usr/bin/env python
"""What the a8 kernels cost in quality: perplexity with x rounded to int8 per 32 columns vs bf16 x.

The quantized CPU layers run every row of x, prompt and decode, through the a8 kernels
(``kernels.cpu_qgemv``: x quantized to int8 per 32 columns, integer dot products, as llama.cpp's
q8_0 activations), so a perplexity run (all prefill) scores a8 itself. The bf16-x figure is the
same model with the C kernels off (``LLMSYS_NO_CKERNELS=1``: torch's dequantize + GEMM, or torch's
packed int8 op, on unquantized x: bf16, or float32 where int8's float32 path takes it). Each figure is its own process; stories260k on the
TinyStories validation text as ``llmsys perplexity`` scores it (windows of 256, the first 2048
tokens), beside float32 and bf16 for scale.

    python benchmarks/bench_a8_quality.py
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
MODEL = ROOT.parent / "shared" / "models" / "stories260k-hf"
TEXT = ROOT.parent / "shared" / "corpus" / "tinystories-valid.txt"


def _score_here(quant: str, dtype: str) -> float:
    import torch

    from llmsys import LLM
    from llmsys.engine.scoring import perplexity_windows

    torch.set_num_threads(2)
    text = TEXT.read_text(encoding="utf-8", errors="replace")
    llm = LLM(str(MODEL), dtype=dtype, quant=quant, device="cpu", progress=False)
    ids = llm.tokenizer.encode(text, add_special_tokens=False)[:2048]
    return perplexity_windows(llm.core, ids, 256, llm.tokenizer.bos_token_id).perplexity


def score(quant: str, dtype: str, c_kernels: bool = True) -> float:
    """Perplexity in a fresh process (``LLMSYS_NO_CKERNELS=1`` when ``c_kernels`` is False)."""
    env = {k: v for k, v in os.environ.items() if k != "LLMSYS_NO_CKERNELS"}
    if not c_kernels:
        env["LLMSYS_NO_CKERNELS"] = "1"
    out = subprocess.run([sys.executable, __file__, "--one", quant, dtype], env=env, capture_output=True,
                         text=True, check=True)
    return float(out.stdout.strip().splitlines()[-1])


def main() -> None:
    if not MODEL.exists():
        sys.exit(f"needs {MODEL} (../shared)")
    if sys.argv[1:2] == ["--one"]:
        print(_score_here(sys.argv[2], sys.argv[3]))
        return
    print("| weights | x in the matmuls | perplexity | a8 vs bf16 x |")
    print("|---|---|---|---|")
    print(f"| float32 | float32 | {score('none', 'float32'):.4f} | |")
    print(f"| bf16 | bf16 | {score('none', 'bfloat16'):.4f} | |")
    for quant in ("int8", "int4"):
        exact, a8 = score(quant, "float32", c_kernels=False), score(quant, "float32")
        print(f"| {quant} | bf16 / float32 (C kernels off) | {exact:.4f} | |")
        print(f"| {quant} | int8 per 32 (a8, what the engine runs) | {a8:.4f} | {100 * (a8 / exact - 1):+.2f}% |")


if __name__ == "__main__":
    main()
