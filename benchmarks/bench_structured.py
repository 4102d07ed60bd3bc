"""What structured output costs: tok/s with a JSON schema vs without, batch 1 and 8, on the CPU.

Two parts, one run:

1. **Mask cost per token** (no model): a :class:`GrammarConstraint` for a JSON schema steps
   through sampled tokens (``allowed`` + ``advance`` each), on stories260k's 512-token
   vocabulary and on a byte-level BPE vocabulary trained here on the TinyStories text
   (``--bpe-vocab``, 32000 by default: the size of Llama 2's / Mistral's), median
   microseconds per token.
2. **End to end** through ``llmsys serve`` (in process, the official AsyncOpenAI client, ``/v1/completions``):
   stories260k-hf and the random-weight SmolLM2-135M shape carrying that BPE vocabulary
   (vocab resized to it), ``--batch`` concurrent requests of ``--tokens`` tokens each,
   ``response_format: json_schema`` (a schema whose string field runs until the budget closes
   the document, or the model closes it earlier) vs plain requests each given exactly the
   tokens its structured twin produced (``ignore_eos``), so both runs have the same batch
   shape step by step; interleaved, median of ``--reps``. tok/s = generated tokens / wall time.

Prints a Markdown block for docs/benchmarks.md. Usage:

    python benchmarks/bench_structured.py [--tokens 96] [--reps 3] [--batch 1,8] [--bpe-vocab 32000]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SHARED = Path(os.environ.get("LLMSYS_SHARED", ROOT.parent / "shared"))
STORIES_HF = SHARED / "models" / "stories260k-hf"
CORPUS = SHARED / "corpus" / "tinystories-valid.txt"

SCHEMA = {"type": "object", "properties": {
    "title": {"type": "string", "maxLength": 24},
    "year": {"type": "integer", "minimum": 1900, "maximum": 2100},
    "tags": {"type": "array", "items": {"enum": ["fun", "sad", "long"]}, "maxItems": 3},
    "story": {"type": "string"},
}, "required": ["title", "year", "tags", "story"], "additionalProperties": False}


def train_bpe(out: Path, vocab: int) -> Path:
    """A byte-level BPE tokenizer (GPT-2 style) trained on the TinyStories text, plus
    ``tokenizer_config.json``; returns its folder."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    # use_regex=False: merges may cross word boundaries, so 2 MB of text can fill a 32k vocabulary
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab, special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    text = CORPUS.read_text(encoding="utf-8") + (SHARED / "corpus" / "tinyshakespeare.txt").read_text(encoding="utf-8")
    # JSON-shaped lines too, so the vocabulary has the pieces JSON is written with ('": "', '"}', ...)
    extra = [json.dumps({"title": line[:20], "year": 1990 + i % 30, "story": line}) for i, line in
             enumerate(text.splitlines()[:4000])]
    tok.train_from_iterator(text.splitlines() + extra, trainer=trainer)
    out.mkdir(parents=True, exist_ok=True)
    tok.save(str(out / "tokenizer.json"))
    (out / "tokenizer_config.json").write_text(json.dumps({
        "eos_token": "<|endoftext|>", "bos_token": None, "tokenizer_class": "PreTrainedTokenizerFast",
        "chat_template": "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
                         "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"}))
    return out


def mask_cost(model_dir: Path, vocab_size: int, steps: int = 400, seed: int = 0) -> tuple[float, int]:
    """Median microseconds of one allowed() + advance() under SCHEMA, and the steps timed."""
    import torch

    from llmsys.engine.grammar import GrammarConstraint, GrammarSpec, GrammarVocab
    from llmsys.engine.tokenizer import Tokenizer

    tok = Tokenizer.load(model_dir)
    vocab = GrammarVocab(tok, vocab_size, sorted(tok.eos_token_ids) or [0])
    g = torch.Generator().manual_seed(seed)
    times: list[float] = []
    while len(times) < steps:
        con = GrammarConstraint(vocab, GrammarSpec.json(SCHEMA), budget=200)
        for _ in range(200):
            t0 = time.perf_counter()
            allowed = con.allowed(vocab_size)
            w = torch.rand(vocab_size, generator=g)
            w[~allowed] = -1
            t = int(w.argmax())
            if t in vocab.eos:
                break
            con.advance(t)
            times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e6, len(times)


def smollm_with_bpe(bpe: Path, root: Path) -> Path:
    """The SmolLM2-135M shape (random weights) with the trained BPE vocabulary."""
    from tokenizers import Tokenizer

    from llmsys.engine.bench.synthetic import make_synthetic, synthetic_config

    vocab = Tokenizer.from_file(str(bpe / "tokenizer.json")).get_vocab_size()
    cfg = dict(synthetic_config("smollm2-135m"), vocab_size=vocab, bos_token_id=None, eos_token_id=0,
               max_position_embeddings=2048)
    d = make_synthetic("smollm2-135m-bpe", root=root, config=cfg)
    for f in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(bpe / f, d / f)
    return d


async def run_batch(url: str, model: str, budgets: list[int], structured: bool) -> tuple[list[int], float]:
    """``len(budgets)`` concurrent requests, request i allowed ``budgets[i]`` tokens; (tokens each, wall s)."""
    import openai

    async with openai.AsyncOpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=600) as c:
        async def one(i: int) -> int:
            kw: dict = dict(model=model, prompt=f"Story number {i}: once upon a time", max_tokens=budgets[i],
                            temperature=0.7, seed=i)
            if structured:
                kw["extra_body"] = {"response_format": {"type": "json_schema",
                                                        "json_schema": {"name": "s", "schema": SCHEMA}}}
            else:
                kw["extra_body"] = {"ignore_eos": True}
            r = await c.completions.create(**kw)
            if structured:
                json.loads(r.choices[0].text)  # it parses, or the benchmark fails
            return r.usage.completion_tokens

        t0 = time.perf_counter()
        n = list(await asyncio.gather(*[one(i) for i in range(len(budgets))]))
        return n, time.perf_counter() - t0


def end_to_end(model_dir: Path, name: str, batches: list[int], tokens: int, reps: int) -> list[str]:
    from llmsys import LLM
    from llmsys.engine.server.serve import start_server_thread
    from llmsys.engine.server.state import ServerSettings, ServerState

    state = ServerState(ServerSettings())
    state.attach(LLM(str(model_dir), dtype="float32", max_num_seqs=max(batches)), name)
    srv = start_server_thread(state)
    rows = []
    try:
        asyncio.run(run_batch(srv.url, name, [tokens] * max(batches), True))  # warm: the grammar vocabulary
        for b in batches:
            got: dict[bool, list[float]] = {False: [], True: []}
            for _ in range(reps):
                # A document may close before the budget, so each plain request then gets exactly the
                # tokens its structured twin produced: the same batch shape, step by step.
                lengths, s = asyncio.run(run_batch(srv.url, name, [tokens] * b, True))
                got[True].append(sum(lengths) / s)
                n, s = asyncio.run(run_batch(srv.url, name, lengths, False))
                assert n == lengths
                got[False].append(sum(n) / s)
            plain, js = statistics.median(got[False]), statistics.median(got[True])
            rows.append(f"| {name} | {b} | {plain:.1f} | {js:.1f} | {js / plain:.2f}x |")
    finally:
        srv.stop()
    return rows


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=96)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--batch", default="1,8")
    ap.add_argument("--bpe-vocab", type=int, default=32000)
    args = ap.parse_args()
    if not STORIES_HF.is_dir():
        print(f"needs {STORIES_HF} (../shared)", file=sys.stderr)
        return 2
    import torch

    batches = [int(x) for x in args.batch.split(",")]
    work = Path(tempfile.mkdtemp(prefix="llmsys-structured-"))
    try:
        bpe = train_bpe(work / "bpe", args.bpe_vocab)
        smol = smollm_with_bpe(bpe, work / "synthetic")
        from tokenizers import Tokenizer

        bpe_n = Tokenizer.from_file(str(bpe / "tokenizer.json")).get_vocab_size()
        cost_small, n_small = mask_cost(STORIES_HF, 512)
        cost_big, n_big = mask_cost(smol, bpe_n)
        rows = end_to_end(STORIES_HF, "stories260k", batches, args.tokens, args.reps)
        rows += end_to_end(smol, "smollm2-135m-shape", batches, args.tokens, args.reps)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    print(f"Machine: {platform.processor() or platform.machine()}, torch CPU capability "
          f"{torch.backends.cpu.get_cpu_capability()}, {torch.get_num_threads()} threads; "
          f"`python benchmarks/bench_structured.py --tokens {args.tokens} --reps {args.reps} --batch {args.batch}`\n")
    print("| vocabulary | grammar mask + advance, median per token |")
    print("|---|---|")
    print(f"| stories260k (512 tokens) | {cost_small:.0f} µs ({n_small} steps) |")
    print(f"| byte-level BPE trained on TinyStories + Shakespeare ({bpe_n} tokens) | {cost_big:.0f} µs ({n_big} steps) |\n")
    print("| model | batch | plain tok/s | json_schema tok/s | ratio |")
    print("|---|---|---|---|---|")
    print("\n".join(rows))
    import resource

    print(f"\nPeak RSS of the process (both servers, one after the other, the BPE training): "
          f"{resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024:.0f} MiB.")
    return 0


if __name__ == "__main__":
    sys.exit(main())
