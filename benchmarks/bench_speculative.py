"""Speculative decoding (issue #20): acceptance on real text, end-to-end tok/s, the verify step's cost.

Part 1, stories260k (CPU, float32, batch 1, fresh requests, greedy): plain decoding vs each proposer
(n-gram prompt lookup, the int4 / int8 self-draft, stories260k cut to 2 and 3 layers as a draft) on
two kinds of prompt over TinyStories validation text: a story opening the model continues, and a
"retell" prompt (a whole story, a blank line, its first words again), where the output copies its
input. Engines interleaved, median tok/s of the rounds; mean accepted length = tokens a
verification yields per sequence (accepted drafts + the target's own token); every run's tokens
checked equal to plain decoding.

Part 2 (``--offload``), the offload issue's setup: a random-weight Qwen2.5-0.5B-shaped bfloat16
model (~1 GB) with ``--cpu-mem 256MiB`` (most layers streamed from disk, their pages dropped). The
cost of a verification step of K + 1 = 5 tokens vs a decode step of one (a proposer that always
proposes 4 tokens, so every step verifies 5), median over steps; the resulting tok/s at Part 1's
acceptance lengths; and a real self:int4 run on it, tokens equal to the plain offloaded run.

Usage: ``python benchmarks/bench_speculative.py [--rounds 5] [--tokens 128] [--offload]``; prints Markdown.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
SHARED = ROOT.parent / "shared"
STORIES = SHARED / "models" / "stories260k-hf"
TEXT = SHARED / "corpus" / "tinystories-valid.txt"


def machine() -> str:
    from llmsys.kernels import cpu_kernels

    name = next((ln.split(":", 1)[1].strip() for ln in Path("/proc/cpuinfo").read_text().splitlines()
                 if ln.startswith("model name")), platform.processor())
    return (f"{name}, torch capability {torch.backends.cpu.get_cpu_capability()}, "
            f"kernels {cpu_kernels().level}, {torch.get_num_threads()} threads")


def stories(n: int) -> list[str]:
    """The first ``n`` TinyStories validation stories of 300-900 characters (one per paragraph block)."""
    raw = TEXT.read_text(encoding="utf-8")
    parts = [p.strip() for p in raw.replace("<|endoftext|>", "\n\n").split("\n\n")]
    return [p for p in parts if 300 <= len(p) <= 900][:n]


def prompts() -> dict[str, list[str]]:
    texts = stories(4)
    return {
        "continue": [" ".join(t.split()[:12]) for t in texts],  # a story opening
        "retell": [t + "\n\n" + " ".join(t.split()[:8]) for t in texts],  # the story, then its start again
    }


def truncated(work: Path, layers: int) -> Path:
    sys.path.insert(0, str(ROOT / "tests"))
    from test_speculative import truncated_stories

    return truncated_stories(STORIES, work / f"stories-{layers}l", layers)


def part1(rounds: int, tokens: int, work: Path) -> list[str]:
    from llmsys import LLM, SamplingParams

    kinds = {"plain": {}, "ngram": {"spec": "ngram"}, "self:int4": {"spec": "self:int4"},
             "self:int8": {"spec": "self:int8"}, "draft 2 layers": {"draft_model": str(truncated(work, 2))},
             "draft 3 layers": {"draft_model": str(truncated(work, 3))}}
    engines = {k: LLM(str(STORIES), dtype="float32", kv_cache_tokens=4096, progress=False, **kw)
               for k, kw in kinds.items()}
    sp = SamplingParams(temperature=0, max_tokens=tokens, ignore_eos=True)
    lines = ["| prompts | engine | mean accepted length | drafts kept | tok/s (median) | vs plain | same tokens |",
             "|---|---|---|---|---|---|---|"]
    for pname, plist in prompts().items():
        speed: dict[str, list[float]] = {k: [] for k in engines}
        toks: dict[str, list[list[int]]] = {}
        stats0 = {k: (e.core.spec_stats.verify_seqs, e.core.spec_stats.proposed, e.core.spec_stats.accepted)
                  for k, e in engines.items()}
        for r in range(rounds):
            for k, llm in engines.items():
                t = time.perf_counter()
                outs = [llm.generate(p, sp)[0] for p in plist]
                dt = time.perf_counter() - t
                speed[k].append(sum(len(o.token_ids) for o in outs) / dt)
                toks[k] = [o.token_ids for o in outs]
        base = statistics.median(speed["plain"])
        for k, e in engines.items():
            st = e.core.spec_stats
            v0, p0, a0 = stats0[k]
            v, p, a = st.verify_seqs - v0, st.proposed - p0, st.accepted - a0
            med = statistics.median(speed[k])
            mal = f"{(a + v) / v:.2f}" if v else "-"
            kept = f"{a / p:.0%}" if p else "-"
            lines.append(f"| {pname} | {k} | {mal} | {kept} | {med:.0f} | {med / base:.2f}x | "
                         f"{'yes' if toks[k] == toks['plain'] else 'NO'} |")
    return lines


# -- part 2: the offloaded target, in a child process per engine -----------------------------------------


CHILD = r"""
import json, statistics, sys, time, torch
from llmsys import LLM, SamplingParams
from llmsys.engine.speculative import NgramProposer
args = json.loads(sys.argv[1])

class Fixed:
    # Always k random drafts: every step verifies k + 1 tokens (cost, not acceptance).
    name = "fixed"
    def __init__(self, k): self.k, self.g = k, torch.Generator().manual_seed(0)
    def propose(self, reqs, live): return [torch.randint(16, 1000, (r.k,), generator=self.g).tolist() for r in reqs]

llm = LLM(args["model"], **args["kw"])
if args.get("fixed"):
    llm.core.proposer = Fixed(args["fixed"])
prompt = list(range(100, 112))
sp = SamplingParams(temperature=0, max_tokens=args["tokens"], ignore_eos=True)
core = llm.core
rid = core.add_request(prompt, sp)
times, out = [], []
while core.has_unfinished():
    t = time.perf_counter()
    for ch in core.step():
        out.extend(ch.token_ids)
    times.append(time.perf_counter() - t)
st = core.spec_stats
# VmHWM, not ru_maxrss: a child started by vfork + exec inherits its parent's high-water mark there.
hwm = next(int(ln.split()[1]) for ln in open("/proc/self/status") if ln.startswith("VmHWM"))
print(json.dumps({"tokens": out, "step_s": times[1:], "steps": len(times), "total_s": sum(times[1:]),
                  "verify_seqs": st.verify_seqs, "proposed": st.proposed, "accepted": st.accepted,
                  "peak_rss_mib": hwm / 1024}))
"""


def child(model: Path, kw: dict, tokens: int, fixed: int = 0) -> dict:
    arg = json.dumps({"model": str(model), "kw": kw, "tokens": tokens, "fixed": fixed})
    r = subprocess.run([sys.executable, "-c", CHILD, arg], capture_output=True, text=True, check=False)
    if r.returncode:
        raise RuntimeError(r.stderr[-2000:])
    return json.loads(r.stdout.strip().splitlines()[-1])


def part2(tokens: int, work: Path, acc_lens: dict[str, float]) -> list[str]:
    from llmsys.engine.bench.synthetic import make_synthetic
    from llmsys.engine.catalog import synthetic_configs

    cfg = dict(synthetic_configs()["qwen2.5-0.5b"])
    cfg["max_position_embeddings"] = 4096
    model = make_synthetic("qwen2.5-0.5b-pos4096", root=work, config=cfg)
    kw = dict(dtype="bfloat16", device="cpu", prefix_caching=False, kv_cache_tokens=1024, cpu_mem="256MiB")
    plain = child(model, kw, tokens)
    fixed = child(model, kw, tokens, fixed=4)  # the engine's proposer swapped for the fixed one after load
    spec = child(model, dict(kw, spec="self:int4"), tokens)
    dec = statistics.median(plain["step_s"])
    ver = statistics.median(fixed["step_s"])
    lines = [
        "| offloaded target (`--cpu-mem 256MiB`) | median step | vs decode step | tok/s | peak RSS |",
        "|---|---|---|---|---|",
        f"| decode step, 1 token | {dec * 1000:.0f} ms | 1.00x | {1 / dec:.2f} | {plain['peak_rss_mib']:.0f} MiB |",
        f"| verification step, K + 1 = 5 tokens | {ver * 1000:.0f} ms | {ver / dec:.2f}x | - | "
        f"{fixed['peak_rss_mib']:.0f} MiB |",
    ]
    for name, L in acc_lens.items():
        lines.append(f"| at mean accepted length {L:.2f} ({name}, Part 1), draft cost excluded | {ver * 1000:.0f} ms | "
                     f"- | {L / ver:.2f} ({L / ver * dec:.2f}x) | - |")
    v = spec["verify_seqs"]
    mal = (spec["accepted"] + v) / v if v else 0.0
    tps = len(spec["tokens"]) / spec["total_s"]
    base = len(plain["tokens"]) / plain["total_s"]
    lines.append(f"| self:int4 draft on this random-weight model, measured (accepted length {mal:.2f}) | "
                 f"{statistics.median(spec['step_s']) * 1000:.0f} ms | - | {tps:.2f} ({tps / base:.2f}x) | "
                 f"{spec['peak_rss_mib']:.0f} MiB |")
    lines.append("")
    lines.append(f"Greedy tokens of the self:int4 run equal to the plain offloaded run: "
                 f"{'yes' if spec['tokens'] == plain['tokens'] else 'NO'} ({len(plain['tokens'])} tokens).")
    return lines


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--offload", action="store_true")
    ap.add_argument("--offload-tokens", type=int, default=24)
    ap.add_argument("--work", type=Path, default=None)
    a = ap.parse_args()
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        print(f"Machine: {machine()}\n")
        lines = part1(a.rounds, a.tokens, work)
        print("\n".join(lines))
        print()
        if a.offload:
            acc = {}
            for ln in lines[2:]:
                cells = [c.strip() for c in ln.strip("|").split("|")]
                if cells[0] == "continue" and cells[2] != "-":
                    acc[cells[1]] = float(cells[2])
            print("\n".join(part2(a.offload_tokens, a.work or work, acc)))
    print(f"\n*{time.perf_counter() - t0:.0f} s.*")


if __name__ == "__main__":
    main()
