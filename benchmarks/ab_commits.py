"""Decode and prefill speed of two checkouts side by side: this one and an older one.

Each (model, format) runs in a fresh process per side, old and new interleaved
(ABA per round), 128-token prompt, 64 greedy steps; reports the medians and
whether the greedy tokens agree. Used for "no regression" checks of a change:

    git worktree add /tmp/old <rev>
    python benchmarks/ab_commits.py --old /tmp/old --rounds 3
    python benchmarks/ab_commits.py --old /tmp/old --only "int8,int4"   # the quantized cases only
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CHILD = r'''
import sys, json, time, statistics, torch
from llmsys import LLM, SamplingParams
path, dtype, quant = sys.argv[1:4]
llm = LLM(path, dtype=dtype, device="cpu", progress=False, kv_cache_tokens=4096, prefix_caching=False, quant=quant)
p = [torch.randint(3, 250, (128,), generator=torch.Generator().manual_seed(0)).tolist()]
one = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)
many = SamplingParams(temperature=0, max_tokens=65, ignore_eos=True)
llm.generate(p, many)
def wall(sp):
    t = time.perf_counter(); out = llm.generate(p, sp); return time.perf_counter() - t, out[0].token_ids
pf, dec = [], []
for _ in range(3):
    t1, _ = wall(one); tn, toks = wall(many)
    pf.append(t1); dec.append((tn - t1) / 64 * 1e3)
print(json.dumps({"prefill_tok_s": 128 / statistics.median(pf), "decode_ms": statistics.median(dec), "toks": toks[:8]}))
'''


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--old", required=True, help="the older checkout (a git worktree of this repository)")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--shared", default=str(ROOT.parent / "shared"), help="../shared (stories260k)")
    ap.add_argument("--only", default="", help="comma list: run only the cases whose name contains one of them")
    args = ap.parse_args()
    sys.path.insert(0, str(ROOT / "benchmarks"))
    import torch
    from bench_core import make_model

    with tempfile.TemporaryDirectory() as tmp:
        t = Path(tmp)
        smol = make_model(t / "smol", torch.bfloat16)
        cases = [("stories260k float32", f"{args.shared}/models/stories260k-hf", "float32", "none"),
                 ("SmolLM2-135M shape bfloat16", str(smol), "bfloat16", "none"),
                 ("SmolLM2-135M shape float32", str(smol), "float32", "none"),
                 ("SmolLM2-135M shape bf16 + int8", str(smol), "bfloat16", "int8"),
                 ("SmolLM2-135M shape bf16 + int4", str(smol), "bfloat16", "int4")]
        if args.only:
            cases = [c for c in cases if any(w in c[0] for w in args.only.split(","))]
        sides = {}
        for name, src in (("old", Path(args.old)), ("new", ROOT)):
            (t / f"pp-{name}").mkdir()
            (t / f"pp-{name}" / "llmsys").symlink_to(src.resolve())
            sides[name] = {"PYTHONPATH": str(t / f"pp-{name}"), "LLMSYS_HOME": str(t / f"home-{name}")}
        (t / "child.py").write_text(CHILD)
        res: dict = {(c[0], s): [] for c in cases for s in sides}
        for r in range(args.rounds):
            for c in cases:
                for s in (("old", "new") if r % 2 == 0 else ("new", "old")):
                    out = subprocess.run([sys.executable, str(t / "child.py"), *c[1:]], capture_output=True,
                                         text=True, env={**os.environ, **sides[s]}, cwd=tmp, check=True)
                    res[(c[0], s)].append(json.loads(out.stdout.strip().splitlines()[-1]))
        print("| model, format | decode ms/token old | new | speed new/old | prefill tok/s old | new | new/old | same tokens |")
        print("|---|---|---|---|---|---|---|---|")
        for c in cases:
            o, n = res[(c[0], "old")], res[(c[0], "new")]

            def md(v: list, k: str) -> float:
                return statistics.median(x[k] for x in v)

            same = all(a["toks"] == b["toks"] for a, b in zip(o, n))
            print(f"| {c[0]} | {md(o, 'decode_ms'):.2f} | {md(n, 'decode_ms'):.2f} | {md(o, 'decode_ms') / md(n, 'decode_ms'):.2f} "
                  f"| {md(o, 'prefill_tok_s'):.0f} | {md(n, 'prefill_tok_s'):.0f} "
                  f"| {md(n, 'prefill_tok_s') / md(o, 'prefill_tok_s'):.2f} | {same} |")


if __name__ == "__main__":
    main()
