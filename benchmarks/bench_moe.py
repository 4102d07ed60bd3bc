"""Mixture-of-experts on the CPU: decode speed with int4 experts, and experts on disk read on demand.

Model: the ``qwen3-30b-a3b`` synthetic shape (models.toml: Qwen3-30B-A3B's hidden 2048, 128 experts, 8
per token, expert width 768, vocab 151936) cut to ``--layers`` layers (default 6: full width, ~8.5 GB of
bf16 random weights written under ``--root``, /tmp by default; ``--cleanup`` deletes it at the end).

Measures, each configuration in a child process (its own RSS), ``--quant int4``, 256 tokens greedy and 256
sampled (temperature 1, seed 0: a random model's greedy text soon loops, and so does its routing; sampled
tokens route as varied as the router makes them); decode only (from the first token on):

(a) all resident: decode tok/s; expert bytes a token uses (expert uses counted by the expert cache of a
    run below x bytes per expert) against all expert bytes (k/E = 8/128 = 6.25%), and the planner's
    figures for the full 48-layer model (active vs total parameters);
(b) experts on disk with a RAM cache of ``--cache-frac`` (25%) of the expert bytes (LFU, and LRU for
    comparison): greedy and sampled tokens identical to (a)'s, tok/s, cache hit rate over the generation,
    bytes read per token, RSS — for three routers (``variant``): ``random`` (the random weights as
    written: attention outputs share a direction, so routing concentrates on few experts), ``uniform``
    (attention's ``o_proj`` zeroed: routing near-uniform and independent per sampled token) and ``skewed``
    (``uniform`` with router rows scaled so popularity falls off Zipf-like). ``top10pct_share``: the share
    of expert uses that went to the 10% most used experts (0.10 = uniform).

Wrap in ``flock /tmp/llmsys-bench.lock`` on a shared machine::

    flock /tmp/llmsys-bench.lock python benchmarks/bench_moe.py --cleanup
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

NAME = "qwen3-30b-a3b"
PROMPT = [151643, 785, 3974, 13876, 38835, 34208, 916, 279, 15678, 5562, 13, 576, 3974, 13876, 38835, 34208]


def build(root: Path, layers: int) -> Path:
    from llmsys.engine.bench.synthetic import make_synthetic, synthetic_config

    cfg = synthetic_config(NAME)
    cfg["num_hidden_layers"] = layers
    return make_synthetic(f"{NAME}-{layers}l", seed=0, root=root, config=cfg)


def variant(src: Path, name: str) -> Path:
    """A copy of ``src`` (shards symlinked) with some tensors overridden by a later shard (CheckpointIndex
    reads files in name order, the last holder of a name wins):

    - ``uniform``: every ``o_proj`` zeroed, so attention adds nothing to the residual stream and each router
      sees its token's own state (with random weights the attention outputs share one direction, and the
      routers of the ``random`` model send most tokens to a few experts); sampled tokens then route
      near-uniformly and independently;
    - ``skewed``: ``uniform`` plus router row ``e`` scaled by ``(e + 1) ** -0.5``: a wider logit spread for
      lower-numbered experts, so their popularity falls off Zipf-like (top 10% of experts ~44% of uses in
      a simulation with isotropic inputs).
    """
    import torch
    from safetensors.torch import save_file

    from llmsys.engine.loader.safetensors_io import CheckpointIndex

    out = src.with_name(f"{src.name}-{name}")
    if (out / "done").exists():
        return out
    shutil.rmtree(out, ignore_errors=True)
    out.mkdir()
    for f in src.iterdir():
        if f.suffix == ".safetensors":
            (out / f.name).symlink_to(f)
        elif f.is_file() and not f.name.startswith(".llmsys"):
            shutil.copy(f, out / f.name)
    index = CheckpointIndex.open_dir(src)
    over = {}
    for n in index.where:
        if n.endswith(".self_attn.o_proj.weight"):
            info = index.info(n)
            over[n] = torch.zeros(tuple(info.shape), dtype=info.dtype)
        elif name == "skewed" and n.endswith(".mlp.gate.weight"):
            w = index.read(n)
            scale = (torch.arange(w.shape[0], dtype=torch.float32) + 1) ** -0.5
            over[n] = (w.float() * scale[:, None]).to(w.dtype)
    fname = f"zz-{name}.safetensors"
    save_file(over, str(out / fname), metadata={"format": "pt"})
    idx = out / "model.safetensors.index.json"
    if idx.exists():
        d = json.loads(idx.read_text())
        d["weight_map"].update({n: fname for n in over})
        idx.write_text(json.dumps(d))
    (out / "done").write_text("")
    return out


def one(path: str, mode: str, cache_frac: float, policy: str, tokens: int) -> dict:
    """One configuration in this process: load, warm up, time a prefill and a ``tokens``-token generation."""
    import torch

    from llmsys import LLM, SamplingParams

    kw = dict(dtype="bfloat16", device="cpu", quant="int4", kv_cache_tokens=1024, max_num_seqs=1, progress=False,
              prefix_caching=False)
    if mode == "disk":
        from llmsys.engine.cli.plan_cmd import meta_model
        from llmsys.offload.prepare import shape_of

        cfg = json.loads((Path(path) / "config.json").read_text())
        expert_bytes = sum(u.expert_bytes for u in shape_of(meta_model(cfg), torch.bfloat16, "int4").layers)
        kw["placement"] = {"experts": "disk", "expert_cache": int(cache_frac * expert_bytes),
                           "expert_policy": policy}
    t = time.perf_counter()
    llm = LLM(path, **kw)
    load_s = time.perf_counter() - t
    greedy = dict(temperature=0, ignore_eos=True)
    llm.generate([PROMPT], SamplingParams(max_tokens=4, **greedy))  # warm-up (also warms the expert cache)
    rt = llm.offload
    cache = rt.expert_cache if rt is not None else None

    def counters() -> tuple[int, int, int]:
        return (cache.stats.hits, cache.stats.misses, cache.stats.bytes_read) if cache else (0, 0, 0)

    res = dict(mode=mode, policy=policy if mode == "disk" else None, load_s=load_s)
    # Greedy (the random model soon repeats itself, so its routing repeats too) and seeded sampling at
    # temperature 1 (near-random tokens: routing as varied as the router makes it); both deterministic.
    for name, sp in (("greedy", SamplingParams(max_tokens=tokens, **greedy)),
                     ("sampled", SamplingParams(max_tokens=tokens, temperature=1.0, seed=0, ignore_eos=True))):
        # Decode only: the clock and the cache counters start once the first token (the prefill) is out.
        toks: list[int] = []
        t0 = time.perf_counter()
        for ch in llm.stream(PROMPT, sp):
            if not toks and ch.token_ids:
                prefill_s = time.perf_counter() - t0
                before, t = counters(), time.perf_counter()
            toks += ch.token_ids
        gen_s = time.perf_counter() - t
        n = len(toks) - 1  # decode steps timed
        r = dict(prefill_s=prefill_s, decode_tok_s=n / gen_s, tokens=toks)
        if cache:
            hits, misses, nread = (a - b for a, b in zip(counters(), before))
            r.update(hit_rate=hits / max(hits + misses, 1), read_per_token=nread / n, uses_per_token=(hits + misses) / n)
        res[name] = r
    status = Path("/proc/self/status").read_text()
    res["rss_gib"] = int(status.split("VmRSS:")[1].split()[0]) / 2**20
    res["hwm_gib"] = int(status.split("VmHWM:")[1].split()[0]) / 2**20
    if cache:
        st = cache.stats
        rep = rt.expert_report()
        res.update(bytes_per_expert=cache.slot_bytes, expert_bytes=rep.expert_bytes, cache_bytes=rep.cache_capacity,
                   read_s=st.read_s, wait_s=st.wait_s)
        uses = sorted(cache._uses.values(), reverse=True)
        top = max(len(uses) // 10, 1)
        res["top10pct_share"] = sum(uses[:top]) / max(sum(uses), 1)  # of every use since load
    w = llm.memory_report().weights
    res["weights"] = w
    return res


def planner_figures() -> dict:
    """The full 48-layer Qwen3-30B-A3B: parameters a token uses vs all (the planner's accounting)."""
    import torch

    from llmsys.engine.bench.synthetic import synthetic_config
    from llmsys.engine.cli.plan_cmd import meta_model
    from llmsys.offload.prepare import shape_of

    shape = shape_of(meta_model(synthetic_config(NAME)), torch.bfloat16, "int4")
    embed = shape.head.params if shape.embed is not None else 0  # an untied table: a gather, not computed
    layers = sum(u.params for u in shape.layers)
    active = sum(u.token_params for u in shape.layers) + shape.head.params
    experts = sum(u.expert_params for u in shape.layers)
    return dict(params_total=layers + shape.head.params + embed, params_active=active + embed,
                expert_params=experts, expert_params_active=sum(u.expert_params * u.top_k // u.num_experts
                                                                 for u in shape.layers),
                int4_expert_bytes=sum(u.expert_bytes for u in shape.layers),
                int4_expert_bytes_per_token=sum(u.expert_bytes * u.top_k // u.num_experts for u in shape.layers))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--root", default="/tmp/llmsys-bench-moe")
    ap.add_argument("--layers", type=int, default=6)
    ap.add_argument("--tokens", type=int, default=256)
    ap.add_argument("--cache-frac", type=float, default=0.25)
    ap.add_argument("--policies", default="lfu,lru")
    ap.add_argument("--routers", default="random,uniform,skewed")
    ap.add_argument("--cleanup", action="store_true", help="delete the model folders at the end")
    ap.add_argument("--one", help=argparse.SUPPRESS)  # child: path,mode,policy
    a = ap.parse_args()
    if a.one:
        path, mode, policy = a.one.split(",")
        print("RESULT " + json.dumps(one(path, mode, a.cache_frac, policy, a.tokens)))
        return 0
    root = Path(a.root)
    t = time.perf_counter()
    src = build(root, a.layers)
    print(f"model {src} ({time.perf_counter() - t:.0f} s to build or find)", flush=True)
    print("planner, full 48 layers: " + json.dumps(planner_figures()), flush=True)

    def child(path: Path, mode: str, policy: str = "lfu") -> dict:
        cmd = [sys.executable, __file__, "--one", f"{path},{mode},{policy}", "--tokens", str(a.tokens),
               "--cache-frac", str(a.cache_frac)]
        r = subprocess.run(cmd, capture_output=True, text=True, env=dict(os.environ))
        line = [x for x in r.stdout.splitlines() if x.startswith("RESULT ")]
        if r.returncode or not line:
            raise SystemExit(f"{' '.join(cmd)} failed:\n{r.stderr[-3000:]}")
        return json.loads(line[0][7:])

    for router in a.routers.split(","):
        path = src if router == "random" else variant(src, router)
        ref = child(path, "resident")
        toks = {k: ref[k].pop("tokens") for k in ("greedy", "sampled")}
        print(f"[{router}] resident: " + json.dumps(ref), flush=True)
        for policy in a.policies.split(","):
            got = child(path, "disk", policy)
            for k in ("greedy", "sampled"):
                got[k]["identical_tokens"] = got[k].pop("tokens") == toks[k]
            print(f"[{router}] experts on disk, {policy}: " + json.dumps(got), flush=True)
    if a.cleanup:
        for v in ("uniform", "skewed"):
            shutil.rmtree(src.with_name(f"{src.name}-{v}"), ignore_errors=True)
        shutil.rmtree(src, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
