"""Sliding-window layers keeping only their window of KV (engine/sliding_kv.py): an 8k-token chat.

Model: Gemma-3-1B's layer pattern and attention shape (26 layers, 5 sliding to 1 global: layers
5, 11, 17, 23 global; window 512; 4 query heads, 1 KV head of 256; bf16), so its KV bytes per token
and layer are the 1B's (1 KiB); the widths default to small ones (hidden 256, MLP 1024, vocab
32768) so an 8k prefill takes seconds on 2 cores; ``--full-width`` writes the real 1B widths
(hidden 1152, MLP 6912, vocab 262144: ~2 GB of random bf16 weights; minutes of prefill).

For ``--sliding-kv full`` then ``auto`` (rings), one request: a ``--prompt`` (8000) token prompt,
then ``--gen`` (64) greedy tokens. Reported from ``memory_report()`` while the request is still
running (after its last token): the KV bytes the global and the sliding layers hold, the pool
reserved; the greedy tokens of both runs (equal), prefill s and decode tok/s; and what a 256 MiB KV
budget buys in context tokens (``KVCost.tokens_within``, the engine's sizing). Each run in its own
process (its RSS)::

    flock /tmp/llmsys-bench.lock python benchmarks/bench_sliding_kv.py
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

MiB = 1 << 20


def config(full_width: bool) -> dict:
    cfg = dict(
        architectures=["Gemma3ForCausalLM"], model_type="gemma3_text", num_hidden_layers=26, num_attention_heads=4,
        num_key_value_heads=1, head_dim=256, sliding_window=512, sliding_window_pattern=6,
        layer_types=["full_attention" if (i + 1) % 6 == 0 else "sliding_attention" for i in range(26)],
        max_position_embeddings=32768, rope_theta=1000000.0, rope_local_base_freq=10000.0, query_pre_attn_scalar=256,
        rms_norm_eps=1e-6, hidden_activation="gelu_pytorch_tanh", tie_word_embeddings=True, torch_dtype="bfloat16",
        bos_token_id=2, eos_token_id=1, hidden_size=256, intermediate_size=1024, vocab_size=32768,
    )
    if full_width:
        cfg.update(hidden_size=1152, intermediate_size=6912, vocab_size=262144)
    return cfg


def run_one(path: str, mode: str, prompt: int, gen: int, threads: int | None) -> dict:
    import psutil
    import torch

    from llmsys import LLM, SamplingParams
    from llmsys.engine.builder import kv_cost_of

    llm = LLM(path, dtype="bfloat16", device="cpu", sliding_kv=mode, kv_cache_tokens=prompt + gen + 64,
              max_num_seqs=1, threads=threads, progress=False)
    core = llm.core
    ids = torch.randint(3, 32000, (prompt,), generator=torch.Generator().manual_seed(0)).tolist()
    rid = core.add_request(ids, SamplingParams(temperature=0, max_tokens=gen + 1, ignore_eos=True))
    seq = core.requests[rid]
    toks: list[int] = []
    t0 = time.perf_counter()
    while not toks:
        for ch in core.step():
            toks.extend(ch.token_ids)
    t1 = time.perf_counter()
    while len(toks) < gen:
        for ch in core.step():
            toks.extend(ch.token_ids)
    t2 = time.perf_counter()
    rep = llm.memory_report()
    while core.has_unfinished():
        core.step()
    a, c = llm.loaded.args, llm.config
    per_layer = core.kv.spec.layer_bytes_per_token
    budget = 256 * MiB
    buys = kv_cost_of(a, c.with_(max_num_seqs=1), 32768, per_layer).tokens_within(budget)
    return dict(
        mode=mode, context=seq.num_tokens, tokens=toks[:gen],
        kv_layers={k: dict(layers=v.layers, ring=v.ring, used_mib=v.bytes_used / MiB, total_mib=v.bytes_total / MiB)
                   for k, v in rep.kv_layers.items()},
        kv_used_mib=sum(rep.kv_used.values()) / MiB, kv_total_mib=sum(rep.kv_total.values()) / MiB,
        ring_blocks=core.kv.spec.sliding.ring_blocks if core.kv.spec.sliding is not None else None,
        prefill_s=t1 - t0, decode_tok_s=(gen - 1) / (t2 - t1), rss_mib=psutil.Process().memory_info().rss / MiB,
        tokens_in_256mib=buys,
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--prompt", type=int, default=8000)
    ap.add_argument("--gen", type=int, default=64)
    ap.add_argument("--full-width", action="store_true")
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--root", type=Path, default=Path("/tmp"))
    ap.add_argument("--child", nargs=2, metavar=("PATH", "MODE"), help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.child:
        print(json.dumps(run_one(a.child[0], a.child[1], a.prompt, a.gen, a.threads)))
        return
    from llmsys.engine.bench.synthetic import make_synthetic

    name = "gemma3-1b-layers" + ("-full" if a.full_width else "-narrow")
    path = make_synthetic(name, seed=0, root=a.root, config=config(a.full_width))
    rows = []
    for mode in ("full", "auto"):
        cmd = [sys.executable, __file__, "--child", str(path), mode, "--prompt", str(a.prompt), "--gen", str(a.gen)]
        if a.threads:
            cmd += ["--threads", str(a.threads)]
        out = subprocess.run(cmd, check=True, capture_output=True, text=True).stdout
        rows.append(json.loads(out.strip().splitlines()[-1]))
    print(f"model: {name} (Gemma-3-1B layer pattern, KV 1 KiB per token and layer), context {rows[0]['context']}")
    print("| --sliding-kv | global KV used | sliding KV used | KV used | KV reserved | prefill s | decode tok/s "
          "| RSS MiB | context in 256 MiB |")
    print("|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        g, s = r["kv_layers"]["global"], r["kv_layers"]["sliding"]
        ring = f" (rings of {r['ring_blocks']} blocks)" if s["ring"] else ""
        print(f"| {r['mode']} | {g['used_mib']:.1f} MiB ({g['layers']} layers) | {s['used_mib']:.1f} MiB "
              f"({s['layers']} layers){ring} | {r['kv_used_mib']:.1f} MiB | {r['kv_total_mib']:.1f} MiB | "
              f"{r['prefill_s']:.1f} | {r['decode_tok_s']:.1f} | {r['rss_mib']:.0f} | {r['tokens_in_256mib']} |")
    same = rows[0]["tokens"] == rows[1]["tokens"]
    print(f"greedy tokens identical: {same}")


if __name__ == "__main__":
    main()
