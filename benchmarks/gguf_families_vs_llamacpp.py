"""llmsys vs llama.cpp on GGUF files of every family, made by llama.cpp's own converter and quantizer.

For each family's tiny random checkpoint (``tests/gguf_families.py``: converted by ``convert_hf_to_gguf.py``,
quantized by llama.cpp) and each file type: greedy tokens for 32 steps from 3 prompts (equal steps per prompt;
at a divergence, llama.cpp's logit gap between the two picks beside the engines' largest logit difference
there), perplexity over 160 tokens by each engine, and for F16 files the largest logit difference to
transformers on the source checkpoint (its matrices rounded to f16 as the file holds them). A correctness
table, not a timing: prints markdown for docs/benchmarks.md.

    python benchmarks/gguf_families_vs_llamacpp.py [--families llama,gemma3] [--formats f16,q4_K_M]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))  # the family checkpoints live with the tests

import torch  # noqa: E402

from gguf_families import FAMILIES, MXFP4, QUANT_TYPES, compare_with_llama_cpp, converted, hf_checkpoint  # noqa: E402


def transformers_rel_diff(name: str) -> float:
    """Largest |logit difference| of llmsys on the F16 file vs transformers on the checkpoint (f16-rounded as the
    file), relative to the largest |logit|, over a 40-token prefill."""
    from transformers import AutoModelForCausalLM

    from gguf_families import random_ids
    from llmsys.engine.loader import load_model
    from llmsys.engine.loader.gguf_io import open_index
    from test_gguf_loading import _logits

    path = converted(name, "f16")
    ids = random_ids(40, 0)
    mine = _logits(load_model(path, dtype="float32", device="cpu"), ids)
    hf = AutoModelForCausalLM.from_pretrained(hf_checkpoint(name), dtype=torch.float32)
    index = open_index(path)
    with torch.no_grad():
        for pname, p in hf.named_parameters():
            if (".experts." in pname and p.dim() == 3) or (pname in index and index.info(pname).qtype == "F16"):
                p.copy_(p.half().float())
        theirs = hf(torch.tensor([ids])).logits[0]
    return ((mine - theirs).abs().max() / theirs.abs().max()).item()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--families", default=",".join(FAMILIES))
    ap.add_argument("--formats", default=",".join(("f16", *QUANT_TYPES, MXFP4)))
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    formats = args.formats.split(",")
    print("| family | file | greedy steps equal (of 32, 3 prompts) | at a divergence: llama.cpp gap / engines' max "
          "diff | ppl llmsys | ppl llama.cpp | ratio | ppl exact | mean err vs exact: llmsys / llama.cpp | "
          "vs transformers (F16) |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for name in args.families.split(","):
        for fmt in formats:
            if fmt == MXFP4 and name != "gpt-oss":
                continue
            a = compare_with_llama_cpp(name, fmt, args.threads)
            div = "; ".join(f"{d.gap:.1e} / {d.noise:.1e} (of {d.scale:.1f})" for d in a.divergences) or "-"
            hf = f"{transformers_rel_diff(name):.1e}" if fmt == "f16" else ""
            print(f"| {name} | {fmt} | {' / '.join(map(str, a.equal_steps))} | {div} | {a.ppl_llmsys:.3f} | "
                  f"{a.ppl_llama_cpp:.3f} | {a.ppl_llmsys / a.ppl_llama_cpp:.4f} | {a.ppl_exact:.3f} | "
                  f"{a.err_llmsys:.1e} / {a.err_llama_cpp:.1e} | {hf} |", flush=True)


if __name__ == "__main__":
    main()
