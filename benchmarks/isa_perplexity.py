#!/usr/bin/env python
"""Perplexity of every weight and KV format on every x86-64 ISA level: natively and under qemu-user.

For each level (this CPU's own, then ``qemu-x86_64 -cpu Haswell`` (x86-64-v3)
and ``-cpu Nehalem`` (x86-64-v2, no AVX); Haswell is skipped when it is the
native level) it scores stories260k on the TinyStories validation text
(``--ctx 256 --limit 2048``, as ``llmsys perplexity``) in float32, bf16, int8,
fp8, int4 RTN, a GPTQ int4 checkpoint made once natively by ``llmsys quantize``
(so a checkpoint from one level is loaded on the others), NF4, int8 KV and int4
KV, and checks each against float32 on the same level with the bounds of the
"every CPU" issue. All levels share one ``$LLMSYS_HOME`` (the native kernel
cache reused on the older CPU must not SIGILL).

    python benchmarks/isa_perplexity.py                 # markdown table on stdout
    python benchmarks/isa_perplexity.py --inner GPTQ_DIR # one level, JSON (what the outer run calls)
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SHARED = ROOT.parent / "shared"
MODEL = SHARED / "models" / "stories260k-hf"
TEXT = SHARED / "corpus" / "tinystories-valid.txt"
# name -> (engine flags, bound on perplexity vs float32 on the same level, relative)
FORMATS = {
    "float32": (dict(dtype="float32"), 0.0),
    "bf16": (dict(dtype="bfloat16"), 0.01),
    "int8": (dict(quant="int8"), 0.01),
    "fp8": (dict(quant="fp8"), 0.03),
    "int4 RTN": (dict(quant="int4"), 0.20),
    "int4 GPTQ": (dict(), 0.04),  # the checkpoint written by `llmsys quantize --method gptq`
    "nf4": (dict(quant="nf4"), 0.25),
    "int8 KV": (dict(dtype="float32", kv_dtype="int8"), 0.01),
    "int4 KV": (dict(dtype="float32", kv_dtype="int4"), 0.03),
}
CPUS = {"Haswell": "x86-64-v3", "Nehalem": "x86-64-v2"}


def inner(gptq: str) -> None:
    """Score every format in this process (on whatever CPU it runs) and print one JSON line."""
    import torch

    from llmsys import LLM
    from llmsys.engine.scoring import perplexity_windows
    from llmsys.kernels.cpu_report import cpu_kernels

    torch.set_num_threads(2)
    out = {"kernels": cpu_kernels().summary(), "level": cpu_kernels().level, "ppl": {}, "seconds": {}}
    for name, (flags, _) in FORMATS.items():
        t = time.perf_counter()
        llm = LLM(gptq if name == "int4 GPTQ" else str(MODEL), device="cpu", progress=False, kv_cache_tokens=2048,
                  **flags)
        ids = llm.tokenizer.encode(TEXT.read_text(encoding="utf-8", errors="replace"), add_special_tokens=False)
        res = perplexity_windows(llm.core, ids[:2048], 256, llm.tokenizer.bos_token_id)
        out["ppl"][name] = res.perplexity
        out["seconds"][name] = round(time.perf_counter() - t, 1)
        del llm
    print(json.dumps(out))


def run_level(cpu: str | None, gptq: Path, home: Path) -> dict:
    cmd = [sys.executable, __file__, "--inner", str(gptq)]
    if cpu is not None:
        cmd = [shutil.which("qemu-x86_64"), "-cpu", cpu, *cmd]
    res = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, "LLMSYS_HOME": str(home)},
                         timeout=3600)
    if res.returncode != 0:
        raise SystemExit(f"{cpu or 'native'} failed (rc {res.returncode}): {res.stderr[-3000:]}")
    return json.loads(res.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--inner", metavar="GPTQ_DIR", help="score this process's level (internal)")
    ap.add_argument("--home", type=Path, help="LLMSYS_HOME shared by the levels (default: a temporary one)")
    args = ap.parse_args()
    if args.inner:
        inner(args.inner)
        return
    if not MODEL.exists() or not TEXT.exists():
        raise SystemExit(f"needs {MODEL} and {TEXT} (../shared beside the checkout)")
    with tempfile.TemporaryDirectory() as tmp:
        home = args.home or Path(tmp) / "home"
        gptq = Path(tmp) / "stories-gptq"
        t = time.perf_counter()
        subprocess.run([sys.executable, "-m", "llmsys.engine.cli.main", "quantize", str(MODEL), "--quant", "int4",
                        "--method", "gptq", "-o", str(gptq)], check=True, env={**os.environ, "LLMSYS_HOME": str(home)},
                       capture_output=True)
        print(f"GPTQ checkpoint made natively in {time.perf_counter() - t:.0f} s", file=sys.stderr)
        results = {"native": run_level(None, gptq, home)}
        for cpu, level in CPUS.items():
            if shutil.which("qemu-x86_64") is None:
                break
            if level != results["native"]["level"]:
                results[f"qemu {cpu}"] = run_level(cpu, gptq, home)
    names = list(FORMATS)
    print("| format | bound | " + " | ".join(f"{where} ({r['level']})" for where, r in results.items()) + " |")
    print("|---|---|" + "---|" * len(results))
    ok = True
    for name in names:
        cells = []
        for r in results.values():
            ppl, base = r["ppl"][name], r["ppl"]["float32"]
            rel = ppl / base - 1
            good = rel <= FORMATS[name][1] + 1e-9
            ok &= good
            cells.append(f"{ppl:.4f} ({rel:+.2%}){'' if good else ' **over**'}")
        print(f"| {name} | {'-' if name == 'float32' else f'<= +{FORMATS[name][1]:.0%}'} | " + " | ".join(cells) + " |")
    for where, r in results.items():
        print(f"\n{where}: {r['kernels']}; seconds per format {r['seconds']}")
    if not ok:
        raise SystemExit("some format is over its bound")


if __name__ == "__main__":
    main()
