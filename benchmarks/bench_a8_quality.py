#!/usr/bin/env python
"""What the a8 decode GEMVs cost in quality: perplexity with x rounded to int8 per 32 columns vs bf16 x.

The quantized CPU layers run decode-sized batches (up to the format's ``PACKED_MAX_ROWS`` rows)
through the a8 GEMVs (``kernels.cpu_qgemv``: x quantized to int8 per 32 columns, integer dot
products, as llama.cpp's q8_0 activations) and prefill through bf16-x paths. A perplexity run
scores windows as prefill, so it would never see the a8 path; this script moves the switch
(``PACKED_MAX_ROWS`` of ``llmsys.quant.int4`` and ``llmsys.quant.int8_fp8``, in this process
only) so that every row takes one path, then the other, and scores stories260k on the
TinyStories validation text as ``llmsys perplexity`` does (windows of 256, the first 2048
tokens), beside float32 and bf16 for scale.

    python benchmarks/bench_a8_quality.py
"""

from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
MODEL = ROOT.parent / "shared" / "models" / "stories260k-hf"
TEXT = ROOT.parent / "shared" / "corpus" / "tinystories-valid.txt"


def main() -> None:
    if not MODEL.exists():
        sys.exit(f"needs {MODEL} (../shared)")
    import torch

    from llmsys import LLM
    from llmsys.engine.scoring import perplexity_windows
    from llmsys.quant import int4, int8_fp8

    torch.set_num_threads(2)
    text = TEXT.read_text(encoding="utf-8", errors="replace")
    defaults = (int4.PACKED_MAX_ROWS, int8_fp8.PACKED_MAX_ROWS)

    def score(quant: str, dtype: str, limit: int | None) -> float:
        if limit is not None:  # every row through one path: a8 (any batch) or bf16 x (none)
            int4.PACKED_MAX_ROWS = int8_fp8.PACKED_MAX_ROWS = limit
        try:
            llm = LLM(str(MODEL), dtype=dtype, quant=quant, device="cpu", progress=False)
            ids = llm.tokenizer.encode(text, add_special_tokens=False)[:2048]
            return perplexity_windows(llm.core, ids, 256, llm.tokenizer.bos_token_id).perplexity
        finally:
            int4.PACKED_MAX_ROWS, int8_fp8.PACKED_MAX_ROWS = defaults

    print("| weights | x in the matmuls | perplexity | a8 vs bf16 x |")
    print("|---|---|---|---|")
    print(f"| float32 | float32 | {score('none', 'float32', None):.4f} | |")
    print(f"| bf16 | bf16 | {score('none', 'bfloat16', None):.4f} | |")
    for quant in ("int8", "int4"):
        exact, a8 = score(quant, "float32", 0), score(quant, "float32", 1 << 30)
        print(f"| {quant} | bf16 | {exact:.4f} | |")
        print(f"| {quant} | int8 per 32 (a8) | {a8:.4f} | {100 * (a8 / exact - 1):+.2f}% |")

if __name__ == "__main__":
    main()
