"""Live KV offload: decode over a context whose KV does not fit the hot blocks.

A random-weight SmolLM2-135M-shaped model in float32 (30 layers, 3 KV heads
of 64: 46 KiB of KV per token) reads a long random prompt and decodes greedy
tokens, three ways with the same chunking (so the tokens must be identical):

* ``hot``: every block in the pool (``--kv-cache-tokens`` covers the context);
* ``hot+cold``: ``--kv-cache-tokens 512`` hot, the rest in the cold tier, a
  file in the offload folder, read back per layer one layer ahead; the page
  cache keeps what was written (the OS decides, as it would in a real run);
* ``hot+cold, page cache dropped``: the same, but the file is synced and
  dropped from the page cache after every write and read
  (``POSIX_FADV_DONTNEED``), so every cold read comes from the device.

Reported per decode token: seconds (median over a round's decode steps, the
prompt excluded; median over rounds), bytes read from the cold tier, the
reader thread's time in the reads, and the time the compute thread waited for
a layer's read (what prefetch did not hide). One thread for compute by
default: the reader thread gets the other core, and a shared 2-core machine
makes a 2-thread OpenMP step erratic.

    python benchmarks/bench_kv_tier.py --prompt 3500 --new 32 --rounds 3
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import tempfile
import time
from pathlib import Path

import torch

BS = 16


def make_model(ctx: int) -> Path:
    from llmsys.engine.bench.synthetic import make_synthetic, synthetic_config

    cfg = dict(synthetic_config("smollm2-135m"), torch_dtype="float32", max_position_embeddings=ctx)
    return make_synthetic(f"smollm2-135m-f32-ctx{ctx}", config=cfg)


class Engine:
    """One configuration: an engine that read the prompt once; ``decode()`` times a greedy continuation.

    Each round re-sends the same prompt: prefix caching serves its full blocks
    (from the cold tier in the tiered runs), so a round costs one short chunk
    plus the timed decode steps, and the configurations can take turns.
    """

    def __init__(self, name: str, path: Path, ids: list[int], new: int, threads: int, hot: int | None,
                 folder: str | None, drop: bool):
        from llmsys import LLM, SamplingParams

        kw: dict = dict(dtype="float32", device="cpu", threads=threads, progress=False, swap_space=0,
                        max_num_batched_tokens=hot or 512)
        if hot is None:
            kw.update(kv_cache_tokens=2 * (len(ids) + new + BS))
        else:
            kw.update(kv_cache_tokens=hot, kv_offload_tokens=2 * (len(ids) + new + BS), offload_dir=folder,
                      kv_offload_drop_cache=drop)
        self.name, self.ids = name, ids
        self.sp = SamplingParams(temperature=0, max_tokens=new, ignore_eos=True)
        self.llm = LLM(str(path), **kw)
        self.rounds: list[dict] = []
        self.decode()  # prefill (not timed) and a first decode (warm-up, dropped)
        self.rounds.clear()

    def decode(self) -> None:
        core = self.llm.core
        tier = core.tier
        core.add_request(self.ids, self.sp)
        toks: list[int] = []
        step_s: list[float] = []
        marks = None
        cold_max = 0
        while core.has_unfinished():
            t = time.perf_counter()
            chunks = core.step()
            dt = time.perf_counter() - t
            got = [tok for ch in chunks for tok in ch.token_ids]
            if toks and got:  # a decode step (the first token ends the prompt)
                step_s.append(dt)
            if got and not toks and tier is not None:
                marks = (tier.stats.bytes_read, tier.stats.wait_s, tier.stats.read_s)
            toks += got
            cold_max = max(cold_max, core.allocator.num_cold_used)
        r = {"tokens": toks, "s_per_token": statistics.median(step_s)}
        if tier is not None:
            st, n = tier.stats, len(step_s)
            r.update(cold_bytes=(st.bytes_read - marks[0]) / n, wait_s=(st.wait_s - marks[1]) / n,
                     read_s=(st.read_s - marks[2]) / n, cold_blocks=cold_max)
        self.rounds.append(r)

    def close(self) -> None:
        if self.llm.core.tier is not None:
            self.llm.core.tier.close()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--prompt", type=int, default=3500)
    ap.add_argument("--new", type=int, default=32)
    ap.add_argument("--hot", type=int, default=512, help="hot KV tokens of the tiered runs")
    ap.add_argument("--rounds", type=int, default=3, help="timed decodes per configuration, taken in turns")
    ap.add_argument("--threads", type=int, default=1)
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    ctx = -(-(a.prompt + a.new + BS) // 1024) * 1024
    path = make_model(ctx)
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(3, 49000, (a.prompt,), generator=g).tolist()
    t0 = time.strftime("%Y-%m-%d %H:%M", time.gmtime())
    with tempfile.TemporaryDirectory() as folder:
        runs = [
            Engine("hot (all KV in the pool)", path, ids, a.new, a.threads, None, None, False),
            Engine(f"hot {a.hot} + cold, page cache kept", path, ids, a.new, a.threads, a.hot, folder, False),
            Engine(f"hot {a.hot} + cold, page cache dropped", path, ids, a.new, a.threads, a.hot, folder, True),
        ]
        for _ in range(a.rounds):
            for e in runs:
                e.decode()
        for e in runs:
            e.close()
    base = runs[0]
    ref_tokens = base.rounds[0]["tokens"]
    kv_tok = 30 * 3 * 64 * 2 * 4
    print(f"*{t0} UTC; `{platform.processor() or platform.machine()}`, {os.cpu_count()} cores, load average "
          f"{os.getloadavg()[0]:.1f} at the end.* SmolLM2-135M shape, random weights, float32, CPU, {a.threads} "
          f"thread(s); prompt {a.prompt} random tokens, {a.new} greedy tokens per round, {a.rounds} rounds per run "
          f"taken in turns; KV {kv_tok // 1024} KiB/token ({(a.prompt + a.new) * kv_tok / 2**20:.0f} MiB for the "
          f"context); block {BS}.\n")
    print("| run | decode ms/token: median of rounds (min-max) | x hot | cold MiB read/token | "
          "read ms/token (reader thread) | wait on reads ms/token | cold blocks | tokens = hot |")
    print("|---|---:|---:|---:|---:|---:|---:|---|")
    hot_med = statistics.median(r["s_per_token"] for r in base.rounds)
    for e in runs:
        ms = [r["s_per_token"] * 1e3 for r in e.rounds]
        med = statistics.median(ms)
        last = e.rounds[-1]
        cold = "cold_bytes" in last

        def col(key: str, scale: float, nd: int = 1) -> str:
            return f"{statistics.median(r[key] for r in e.rounds) * scale:.{nd}f}" if cold else "-"

        same = "yes" if all(r["tokens"] == ref_tokens for r in e.rounds) else "NO"
        print(f"| {e.name} | {med:.1f} ({min(ms):.1f}-{max(ms):.1f}) | {med / (hot_med * 1e3):.2f} | "
              f"{col('cold_bytes', 2**-20)} | {col('read_s', 1e3)} | {col('wait_s', 1e3)} | "
              f"{last.get('cold_blocks', '-')} | {same} |")


if __name__ == "__main__":
    main()
