"""Embeddings against the reference, and through the ``openai`` and ``ollama`` clients on a live server.

For each model: ``LLM.embed`` and the vectors ``client.embeddings.create`` (OpenAI, base64 as the
client asks) and ``ollama.Client.embed`` return, against transformers' final hidden states pooled the
same way and L2-normalized; prints the max cosine distance over the texts. Models: a tiny random
Qwen3-Embedding-style checkpoint made here (bare decoder, no LM head, sentence-transformers
last-token Pooling + Normalize), stories260k-hf (no pooling config: mean). With ``--gguf FILE`` also
that file's vectors through both clients (no reference: cosine of related and unrelated texts) and
the engine's embedding throughput on a batch of texts.

    python benchmarks/embeddings_check.py [--gguf ../shared/models/smollm2-135m-instruct/SmolLM2-135M-Instruct.Q4_1.gguf]
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))

TEXTS = ["hello world", "the quick brown fox jumps over the lazy dog, " * 4, "a",
         "Once upon a time there was a little girl who liked to read books about embeddings.",
         "Lily and Ben went to the park. They saw a big dog and a little cat playing."]


def _serve(llm, name: str):
    from llmsys.engine.server.serve import start_server_thread
    from llmsys.engine.server.state import ServerSettings, ServerState

    state = ServerState(ServerSettings())
    state.attach(llm, name)
    return start_server_thread(state)


def _clients(url: str, name: str, texts: list[str]) -> tuple[list[torch.Tensor], list[torch.Tensor], int, int]:
    import ollama
    import openai

    r = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0).embeddings.create(model=name, input=texts)
    oa = [torch.tensor(d.embedding) for d in sorted(r.data, key=lambda d: d.index)]
    o = ollama.Client(host=url, timeout=120).embed(model=name, input=texts)
    return oa, [torch.tensor(v) for v in o.embeddings], r.usage.prompt_tokens, o.prompt_eval_count


def _check(folder: Path, name: str, kind) -> None:
    from test_embeddings import max_cosine_distance, reference

    from llmsys import LLM

    llm = LLM(str(folder), dtype="float32", max_num_batched_tokens=16)  # longer texts prefilled in chunks
    ref = reference(folder, TEXTS, kind)
    ours = [o.embedding for o in llm.embed(TEXTS)]
    srv = _serve(llm, name)
    try:
        oa, ol, n_oa, n_ol = _clients(srv.url, name, TEXTS)
    finally:
        srv.stop()
    print(f"{name}: pooling {llm.pooling.type.value} ({llm.pooling.source}), normalize {llm.pooling.normalize}; "
          f"{len(TEXTS)} texts, {n_oa} tokens (openai usage) / {n_ol} (ollama prompt_eval_count)")
    for label, vs in (("LLM.embed", ours), ("openai client", oa), ("ollama client", ol)):
        print(f"  {label:14s} max cosine distance to transformers: {max_cosine_distance(vs, ref):.3e}")


def _gguf(path: Path) -> None:
    from llmsys import LLM

    llm = LLM(str(path))
    name = path.stem
    pairs = ["The cat sat on the mat.", "A kitten was sitting on the rug.", "Stock markets fell sharply on Monday."]
    srv = _serve(llm, name)
    try:
        oa, ol, n_oa, _ = _clients(srv.url, name, pairs)
    finally:
        srv.stop()
    cos = torch.nn.functional.cosine_similarity
    print(f"{name}: pooling {llm.pooling.type.value} ({llm.pooling.source}); {len(oa[0])} values, {n_oa} tokens")
    for label, vs in (("openai client", oa), ("ollama client", ol)):
        print(f"  {label:14s} cos(cat, kitten) {cos(vs[0], vs[1], dim=0):.4f}  cos(cat, stocks) "
              f"{cos(vs[0], vs[2], dim=0):.4f}  norms {[round(v.norm().item(), 4) for v in vs]}")
    docs = [f"Document {i}: " + TEXTS[i % len(TEXTS)] for i in range(64)]
    llm.embed(docs[:4])  # warm
    t = time.perf_counter()
    outs = llm.embed(docs)
    dt = time.perf_counter() - t
    n = sum(o.prompt_tokens for o in outs)
    print(f"  LLM.embed of {len(docs)} texts ({n} tokens): {dt:.3f} s, {n / dt:.0f} tok/s, {len(docs) / dt:.0f} texts/s")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--gguf", type=Path, help="also a GGUF file through both clients, and its throughput")
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    from test_embeddings import make_embedding_model

    from llmsys.engine.embedding import PoolingType

    with tempfile.TemporaryDirectory() as tmp:
        _check(make_embedding_model(Path(tmp) / "qwen3-embedding-tiny"), "qwen3-embedding-tiny", PoolingType.LAST)
    stories = ROOT.parent / "shared" / "models" / "stories260k-hf"
    if stories.is_dir():
        _check(stories, "stories260k", PoolingType.MEAN)
    else:
        print(f"stories260k-hf: not found at {stories}; skipped")
    if args.gguf is not None:
        _gguf(args.gguf)


if __name__ == "__main__":
    main()
