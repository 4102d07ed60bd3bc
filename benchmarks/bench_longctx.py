"""Long-context KV policies on one long stream (issue #5).

stories260k (trained context 512) scores >= 20,000 tokens of TinyStories as
one continuous stream, token by token once a KV budget of 256 tokens is
reached, under: full (no eviction, past the trained context), window:256,
sink:4,window:252 (StreamingLLM), h2o:128,recent:128, snapkv:256, and the
sliding-window-with-recomputation oracle (recompute:256). Also measured:
per-token time of sink vs recomputing the last 256 tokens each step, the
cost of re-rotating keys on eviction vs rotating every key at attention
time, and Quest (top-25% pages) vs full attention on a 4,000-token prompt.

    python benchmarks/bench_longctx.py            # writes docs/img/longctx.png, prints Markdown
"""

from __future__ import annotations

import argparse
import math
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
SHARED = ROOT.parent / "shared"


def build_stream(tok, corpus: Path, n: int) -> list[int]:
    """The corpus' documents as one stream (BOS once, at the start), >= n tokens."""
    text = corpus.read_text(encoding="utf-8", errors="replace")
    chars = n * 5
    while True:
        ids = [tok.bos_token_id] + tok.encode(text[:chars], add_special_tokens=False)
        if len(ids) >= n or chars >= len(text):
            return ids[:n]
        chars *= 2


def timing(core, ids, budget: int, steps: int, chunk: int) -> dict[str, float]:
    """Per-token seconds: sink (steady state) vs recompute-256 through the engine, unbatched."""
    from llmsys.engine.scoring import perplexity_recompute, perplexity_stream

    sink = perplexity_stream(core, ids[: budget + steps], f"sink:4,window:{budget - 4}", chunk=chunk)
    rec = perplexity_recompute(core, ids[: budget + steps], budget, batch=1, fast=False)
    return {"sink": sink.steady_s_per_token, "recompute": rec.steady_s_per_token}


def rotation_costs(core, budget: int, chunk: int, reps: int = 200) -> dict[str, float]:
    """Seconds per generated token: re-rotate on eviction (amortised) vs RoPE on all keys each step."""
    from llmsys.offload.kv_policy import compact_kv, rotate_by

    kv, bs = core.kv, core.kv.spec.block_size
    rope = core.loaded.model.rope_cache
    table = core.allocator.allocate(-(-budget // bs))
    try:
        keep = torch.cat([torch.arange(4), torch.arange(4 + chunk, budget)])
        t = time.perf_counter()
        for _ in range(reps):
            compact_kv(kv.k, kv.v, table, bs, keep, rope)
        evict = (time.perf_counter() - t) / reps / chunk
        keys = kv.k[0].view(-1, *kv.k[0].shape[2:])[:budget]
        pos = torch.arange(budget)
        t = time.perf_counter()
        for _ in range(reps):
            for _layer in kv.k:
                rotate_by(keys, pos, rope)
        at_attn = (time.perf_counter() - t) / reps
    finally:
        core.allocator.free(table)
    return {"rerotate_on_evict": evict, "rope_at_attention": at_attn}


@torch.inference_mode()
def quest_vs_full(model_dir: Path, ids: list[int], prompt_len: int, decode: int, frac: float, threads: int):
    """KL(full || quest) of teacher-forced decode logits after a long prompt, and the KV fraction read."""
    from llmsys import LLM
    from llmsys.engine.attention import QuestBackend
    from llmsys.engine.kv_cache import blocks_needed
    from llmsys.offload.kv_policy import QuestAttention

    total = prompt_len + decode
    llm = LLM(str(model_dir), dtype="float32", progress=False, max_model_len=total + 64,
              kv_cache_tokens=total + 64, threads=threads)
    core, m = llm.core, llm.loaded.model
    bs = core.kv.spec.block_size
    pages = blocks_needed(prompt_len, bs)
    k_pages = max(1, math.ceil(frac * pages))
    runs = {}
    for name in ("full", "quest"):
        quest = QuestAttention(k_pages, bs) if name == "quest" else None
        attn = QuestBackend(core.attn, quest) if quest is not None else core.attn
        table = core.allocator.allocate(blocks_needed(total, bs))
        logits = []
        pos = 0
        try:
            while pos < total - 1:
                n = min(512, prompt_len - pos) if pos < prompt_len else 1
                meta = attn.metadata([n], [pos + n], [table])
                h = m(torch.tensor(ids[pos : pos + n]), torch.arange(pos, pos + n), attn, meta)
                if pos + n > prompt_len:
                    logits.append(m.compute_logits(h[-1:]).float())
                pos += n
        finally:
            core.allocator.free(table)
        runs[name] = (torch.cat(logits), quest.stats.fraction if quest else 1.0)
    lf, lq = torch.log_softmax(runs["full"][0], -1), torch.log_softmax(runs["quest"][0], -1)
    kl = (lf.exp() * (lf - lq)).sum(-1)  # [decode]
    agree = (lf.argmax(-1) == lq.argmax(-1)).float().mean().item()
    return {"pages": pages, "k": k_pages, "kl_mean": kl.mean().item(), "kl_max": kl.max().item(),
            "read_fraction": runs["quest"][1], "top1_agree": agree, "steps": kl.numel()}


def plot(results, out: Path, budget: int) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a1, a2) = plt.subplots(2, 1, figsize=(9, 7), sharex=True)
    for r in results:
        segs = r.segments()
        a1.plot([(a + b) / 2 for a, b, _ in segs], [p for _, _, p in segs], marker=".", label=r.policy)
        xs = [min((i + 1) * r.segment, r.nll.numel()) for i in range(len(r.kv_bytes))]
        if not r.policy.startswith("recompute"):
            a2.plot(xs, [b / 1024 for b in r.kv_bytes], marker=".", label=r.policy)
    a1.set_yscale("log")
    a1.set_ylabel("perplexity per 1,000 tokens")
    a1.axvline(512, color="grey", ls=":", lw=1)
    a1.set_title(f"stories260k on a long TinyStories stream, KV budget {budget} tokens")
    a1.legend(fontsize=8)
    a2.set_yscale("log")
    a2.set_ylabel("KV KiB in use")
    a2.set_xlabel("stream position (tokens)")
    a2.legend(fontsize=8)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.tight_layout()
    fig.savefig(out, dpi=110)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", type=Path, default=SHARED / "models" / "stories260k-hf")
    ap.add_argument("--corpus", type=Path, default=SHARED / "corpus" / "tinystories-valid.txt")
    ap.add_argument("--tokens", type=int, default=20000)
    ap.add_argument("--budget", type=int, default=256)
    ap.add_argument("--chunk", type=int, default=1, help="tokens evicted at once (1 = exact token-by-token)")
    ap.add_argument("--timing-steps", type=int, default=150)
    ap.add_argument("--quest-prompt", type=int, default=4000)
    ap.add_argument("--quest-decode", type=int, default=32)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--policies", default="full;recompute:{B};window:{B};sink:4,window:{W};h2o:{H},recent:{H};snapkv:{B}")
    ap.add_argument("--out", type=Path, default=ROOT / "docs" / "img" / "longctx.png")
    ap.add_argument("--timing-only", action="store_true",
                    help="only the sink vs recompute per-token time (median of 3 rounds): a quick rerun on a quiet machine")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    from llmsys import LLM
    from llmsys.engine.scoring import perplexity_stream

    B = args.budget
    llm = LLM(str(args.model), dtype="float32", progress=False, kv_cache_tokens=max(args.tokens, 16 * B) + 1024, threads=args.threads)
    ids = build_stream(llm.tokenizer, args.corpus, args.tokens)
    if args.timing_only:
        rounds = [timing(llm.core, ids, B, args.timing_steps, args.chunk) for _ in range(3)]
        sink = sorted(r["sink"] for r in rounds)[1]
        rec = sorted(r["recompute"] for r in rounds)[1]
        print(f"| recompute last {B} tokens each step | {rec * 1e3:.2f} ms/token | 1.0x |")
        print(f"| `sink:4,window:{B - 4}` (chunk {args.chunk}) | {sink * 1e3:.2f} ms/token | {rec / sink:.1f}x |")
        return
    results = []
    for p in args.policies.format(B=B, W=B - 4, H=B // 2).split(";"):
        t = time.perf_counter()
        r = perplexity_stream(llm.core, ids, p, segment=1000, chunk=args.chunk)
        results.append(r)
        print(f"<!-- {p}: ppl {r.perplexity:.3f} in {time.perf_counter() - t:.0f}s -->", flush=True)
    oracle = next((r for r in results if r.policy.startswith("recompute")), None)
    plot(results, args.out, B)

    print(f"\n### Long stream: {len(ids)} tokens, budget {B}, eviction chunk {args.chunk}\n")
    print("| policy | ppl (all) | vs oracle | ppl 0-512 | ppl 512+ | KV bytes after budget (min-max) | s/token | evicted |")
    print("|---|---:|---:|---:|---:|---|---:|---:|")
    for r in results:
        head = math.exp(float(r.nll[:511].mean()))
        tail = math.exp(float(r.nll[511:].mean())) if r.nll.numel() > 511 else float("nan")
        vs = f"{r.perplexity / oracle.perplexity - 1:+.1%}" if oracle else "-"
        kvb = r.kv_bytes[1:] if len(r.kv_bytes) > 1 else r.kv_bytes
        kv = "grows" if r.policy == "full" else f"{min(kvb)}-{max(kvb)}"
        if r.policy == "full":
            kv = f"grows to {r.kv_bytes[-1]}"
        per = r.seconds / max(r.nll.numel(), 1)
        print(f"| `{r.policy}` | {r.perplexity:.3f} | {vs} | {head:.3f} | {tail:.3f} | {kv} | {per * 1e3:.2f} ms | {r.evicted} |")
    print("\nPer-1,000-token segments:\n")
    print("| segment | " + " | ".join(f"`{r.policy}`" for r in results) + " |")
    print("|---|" + "---:|" * len(results))
    for i, (a, b, _) in enumerate(results[0].segments()):
        print(f"| {a}-{b} | " + " | ".join(f"{r.segments()[i][2]:.3f}" for r in results) + " |")

    tm = timing(llm.core, ids, B, args.timing_steps, args.chunk)
    rc = rotation_costs(llm.core, B, 1)
    rc16 = rotation_costs(llm.core, B, llm.core.kv.spec.block_size)
    print("\n### Per-token time (unbatched, steady state)\n")
    print("| method | ms/token | speed-up |")
    print("|---|---:|---:|")
    print(f"| recompute last {B} tokens each step | {tm['recompute'] * 1e3:.2f} | 1.0x |")
    print(f"| `sink:4,window:{B - 4}` (chunk {args.chunk}) | {tm['sink'] * 1e3:.2f} | {tm['recompute'] / tm['sink']:.1f}x |")
    print("\n### Keeping StreamingLLM positions: re-rotate on eviction vs RoPE at attention time\n")
    print("| method | us per generated token (all layers) |")
    print("|---|---:|")
    print(f"| re-rotate survivors on eviction, chunk 1 (token-exact) | {rc['rerotate_on_evict'] * 1e6:.1f} |")
    print(f"| re-rotate survivors on eviction, chunk {llm.core.kv.spec.block_size} | {rc16['rerotate_on_evict'] * 1e6:.1f} |")
    print(f"| pre-RoPE keys, rotate all {B} at attention time | {rc['rope_at_attention'] * 1e6:.1f} |")

    q = quest_vs_full(args.model, ids, args.quest_prompt, args.quest_decode, 0.25, args.threads)
    print(f"\n### Quest on a {args.quest_prompt}-token prompt\n")
    print("| pages | K | KV read by attention | KL(full‖quest) mean | max | top-1 agreement |")
    print("|---:|---:|---:|---:|---:|---:|")
    print(f"| {q['pages']} | {q['k']} | {q['read_fraction']:.1%} | {q['kl_mean']:.2e} | {q['kl_max']:.2e} | {q['top1_agree']:.0%} |")
    print(f"\nplot: {args.out.relative_to(ROOT) if args.out.is_relative_to(ROOT) else args.out}")


if __name__ == "__main__":
    main()
