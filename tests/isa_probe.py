"""Model answers on this CPU, as JSON: what tests/test_isa_matrix.py compares across ISA levels.

Run natively and under ``qemu-x86_64 -cpu Haswell|Nehalem`` on the same
checkpoints: for each model directory and each (dtype, weight quant, KV dtype)
setting it prints the greedy tokens of a fixed prompt and the log-probabilities
the engine assigns to a fixed sequence (every position of one prefill), with
the ISA level and kernel status it ran on. Not a test module: no transformers
import (slow under emulation), only llmsys.

    python tests/isa_probe.py MODEL_DIR [MODEL_DIR ...] > out.json
"""

from __future__ import annotations

import json
import sys

import torch

# (dtype, weight quant, KV dtype): every fast path the CPU has (bf16 C RMSNorm/RoPE/attention,
# int8 and int4 GEMV/GEMM, int8 KV) and the float32 reference.
SETTINGS = [("float32", "none", "auto"), ("bfloat16", "none", "auto"), ("bfloat16", "int8", "auto"),
            ("bfloat16", "int4", "auto"), ("float32", "none", "int8")]
PROMPT = [1, 7, 42, 99, 5, 300, 17, 64, 250, 3, 77, 128]  # ids valid in a 512-token vocab


def scored_sequence(vocab: int) -> list[int]:
    """The sequence whose log-probabilities are compared (tests/test_isa_matrix.py scores it with transformers)."""
    return torch.randint(3, vocab, (96,), generator=torch.Generator().manual_seed(1)).tolist()


def probe(path: str) -> dict:
    from llmsys import LLM, SamplingParams
    from llmsys.engine.scoring import score_sequences

    out = {}
    for dtype, quant, kv in SETTINGS:
        llm = LLM(path, dtype=dtype, quant=quant, kv_dtype=kv, device="cpu", kv_cache_tokens=512, progress=False)
        vocab = llm.loaded.args.vocab_size
        seq = scored_sequence(vocab)
        sp = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
        tokens = llm.generate([[t % vocab for t in PROMPT]], sp)[0].token_ids
        (lp,) = score_sequences(llm.core, [seq])
        out[f"{dtype}/{quant}/kv-{kv}"] = {"tokens": list(tokens), "logprobs": lp.tolist()}
        del llm
    return out


def main(paths: list[str]) -> None:
    from llmsys.kernels.cpu_report import cpu_kernels

    report = cpu_kernels()
    print(json.dumps({"level": report.level, "summary": report.summary(),
                      "torch": report.torch_capability, "models": {p: probe(p) for p in paths}}))


if __name__ == "__main__":
    torch.set_num_threads(2)
    main(sys.argv[1:])
