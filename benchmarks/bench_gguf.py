#!/usr/bin/env python
"""GGUF files in llmsys vs in llama.cpp, on the same file (issue #19, must-show 2).

For each format (llama.cpp's own quantizer makes q8_0 / q4_0 / q4_K_M from the f32/f16 export of
the same weights, ``engine.bench.gguf_export``), both engines load *the same GGUF* and score
the same token windows:

* **logits**: one 256-token window of TinyStories validation text, every position: max |llmsys -
  llama.cpp| over the vocabulary (and relative to the position's largest |logit|), top-1 agreement;
* **perplexity**: llama-perplexity style (consecutive windows of 256 tokens, each starting with BOS,
  every token after the first scored), the first ``--tokens`` tokens, both engines on identical windows;
* **memory**: llmsys's weight bytes as loaded (``memory_report()``) and what each GGUF type became
  (``stored_formats``), beside the file size.

stories260k is the real trained model (its dimensions, 64 and 172, are too small for the K-quants:
llama.cpp falls back to Q5_0/Q8_0/F16 there). The synthetic SmolLM2-135M / Qwen2.5-0.5B shapes
(random weights, ``engine.bench.synthetic``) carry Q4_K/Q6_K/Q5_0 in their q4_K_M files: for them
the logits of one window of random ids are compared (a perplexity of random weights means nothing).

Tokens come from llmsys's tokenizer rebuilt from the GGUF metadata; llama.cpp is handed the same
ids (``Llama.eval``), so tokenization is not part of the comparison (tests/test_gguf_tokenizer.py
checks it separately). Needs llama-cpp-python (``pip install -e ".[llamacpp]"``).

    python benchmarks/bench_gguf.py [--tokens 4096] [--threads 2]
"""

from __future__ import annotations

import argparse
import os
import platform
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
MODEL = ROOT.parent / "shared" / "models" / "stories260k-hf"
TEXT = ROOT.parent / "shared" / "corpus" / "tinystories-valid.txt"
FORMATS = ("f32", "f16", "q8_0", "q4_0", "q4_K_M")
CTX = 256


def _windows(ids: list[int], bos: int | None) -> list[list[int]]:
    body = CTX - 1 if bos is not None else CTX
    out = [([bos] if bos is not None else []) + ids[i : i + body] for i in range(0, len(ids) - 1, body)]
    return [w for w in out if len(w) >= 2]


def _nll(logits: np.ndarray, window: list[int]) -> float:
    """Summed -log p(window[t+1] | window[:t+1]) from logits [T, V] (float64 log-softmax)."""
    x = logits[:-1].astype(np.float64)
    m = x.max(-1, keepdims=True)
    lse = (m[:, 0] + np.log(np.exp(x - m).sum(-1)))
    return float((lse - x[np.arange(len(window) - 1), window[1:]]).sum())


def _llmsys_logits(llm, window: list[int]) -> np.ndarray:
    from llmsys.engine.scoring import prompt_logits

    return prompt_logits(llm.core, window).float().numpy()


def run(fmt: str, path: Path, ids: list[int], threads: int, text: bool) -> dict:
    import llama_cpp
    import torch

    from llmsys import LLM

    torch.set_num_threads(threads)
    llm = LLM(str(path), device="cpu", progress=False, max_model_len=CTX)
    bos = llm.tokenizer.bos_token_id
    windows = _windows(ids, bos) if text else [ids[:CTX]]
    cpp = llama_cpp.Llama(str(path), n_ctx=CTX, n_batch=CTX, logits_all=True, verbose=False, n_threads=threads)
    ours_nll = cpp_nll = 0.0
    count = 0
    first: tuple[np.ndarray, np.ndarray] | None = None
    for w in windows:
        mine = _llmsys_logits(llm, w)
        cpp.reset()
        cpp.eval(w)
        theirs = np.array(cpp.scores[: len(w)], dtype=np.float32)
        if first is None:
            first = (mine, theirs)
        ours_nll += _nll(mine, w)
        cpp_nll += _nll(theirs, w)
        count += len(w) - 1
    cpp.close()
    mine, theirs = first
    diff = np.abs(mine - theirs)
    rep = llm.memory_report()
    return {
        "fmt": fmt, "file": path.stat().st_size, "weights": sum(rep.weights.values()),
        "formats": rep.stored_formats, "dtype": str(llm.loaded.dtype).removeprefix("torch."),
        "maxabs": float(diff.max()), "rel": float((diff.max(-1) / np.abs(theirs).max(-1)).max()),
        "top1": float((mine.argmax(-1) == theirs.argmax(-1)).mean()), "positions": len(mine),
        "ppl": float(np.exp(ours_nll / count)), "ppl_cpp": float(np.exp(cpp_nll / count)), "scored": count,
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tokens", type=int, default=4096, help="text tokens scored for perplexity")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--formats", default=",".join(FORMATS))
    ap.add_argument("--shapes", default="smollm2-135m,qwen2.5-0.5b",
                    help="synthetic shapes compared on logits too (comma list; empty: stories260k only)")
    args = ap.parse_args()
    try:
        import llama_cpp  # noqa: F401
    except ImportError:
        print('llama-cpp-python is not installed: pip install -e ".[llamacpp]"', file=sys.stderr)
        return 2
    import torch

    from llmsys.engine.bench.gguf_export import gguf_file
    from llmsys.engine.tokenizer import Tokenizer

    from llmsys.engine.bench.synthetic import make_synthetic

    text = TEXT.read_text(encoding="utf-8", errors="replace")
    models = [("stories260k", MODEL, Tokenizer.load(MODEL).encode(text, add_special_tokens=False)[: args.tokens], True)]
    for shape in filter(None, args.shapes.split(",")):
        folder = make_synthetic(shape, seed=0)
        vocab = Tokenizer.load(folder).vocab_size
        ids = np.random.default_rng(0).integers(3, vocab, CTX).tolist()
        models.append((f"{shape} (random weights)", folder, ids, False))
    cpu = platform.processor() or platform.machine()
    print(f"GGUF files exported by llmsys and quantized by llama.cpp {llama_cpp_version()}; torch {torch.__version__}, "
          f"capability {torch.backends.cpu.get_cpu_capability()}, {args.threads} threads, {cpu}.\n")
    for label, folder, ids, is_text in models:
        rows = []
        for fmt in args.formats.split(","):
            t0 = time.perf_counter()
            rows.append(run(fmt, gguf_file(folder, fmt, args.threads), ids, args.threads, is_text))
            print(f"[{label} {fmt}] {time.perf_counter() - t0:.0f} s", file=sys.stderr)
        what = (f"perplexity over {rows[0]['scored']} scored tokens of TinyStories validation (windows of {CTX}), "
                f"logits over the first window" if is_text else f"logits of {CTX} random ids")
        print(f"**{label}**: {what} ({rows[0]['positions']} positions).\n")
        head = "| file (llmsys dtype) | GGUF tensor types -> llmsys | llmsys weights / file | logits max abs (rel) | top-1 agree"
        print(head + (" | ppl llmsys | ppl llama.cpp | diff |" if is_text else " |"))
        print("|---" * (8 if is_text else 5) + "|")
        for r in rows:
            kinds = "; ".join(f"{k} -> {v}" for k, v in r["formats"].items())
            line = (f"| {r['fmt']} ({r['dtype']}) | {kinds} | {r['weights'] / 2**20:.2f} / {r['file'] / 2**20:.2f} MiB "
                    f"| {r['maxabs']:.3f} ({r['rel']:.1e}) | {r['top1']:.3f} |")
            if is_text:
                line += f" {r['ppl']:.4f} | {r['ppl_cpp']:.4f} | {100 * (r['ppl'] / r['ppl_cpp'] - 1):+.2f}% |"
            print(line)
        print()
    return 0


def llama_cpp_version() -> str:
    import llama_cpp

    return getattr(llama_cpp, "__version__", "?")


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    sys.exit(main())
