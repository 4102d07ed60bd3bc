#!/usr/bin/env python
"""A one-shot run, as a user types it: `llmsys run MODEL PROMPT -n 64` vs llama.cpp, peak RSS and time to first token.

Issue #17's must-show 4. For each synthetic shape (models.toml [synthetic.*], random bf16 weights; the GGUF is
the f16 one ``llmsys bench --vs llama.cpp`` writes, engine/bench/gguf_export.py) and format pair (llmsys bf16 /
llama.cpp f16, int8 / q8_0, int4 / q4_0), each round starts one fresh process per engine, interleaved:

- llmsys: the real CLI, ``python -m llmsys.engine.cli.main run MODEL PROMPT -n 64 --temperature 0 -t THREADS``
  (``--dtype bfloat16 --quant Q``);
- llama.cpp: llama-cpp-python's ``Llama(gguf, n_threads=THREADS)`` generating 64 greedy tokens from the same
  prompt token ids (the synthetic GGUF's vocabulary is a stand-in llama.cpp's tokenizer cannot use), each id
  printed as it comes.

"Start to first token" is the wall time from spawning the process to the first byte of generated text on its
stdout (the interpreter's start, imports, loading, prefill and one decode step: what a user waits for); peak RSS
is the process's own maximum (``os.wait4``'s ru_maxrss). The table gives medians over rounds and the
llmsys/llama.cpp ratios (targets: RSS <= 1.25x, start to first token <= 1.5x). Both sides are Python processes;
llama.cpp's own C++ CLI starts without an interpreter, so its figure would be lower still.

    python benchmarks/bench_run_startup.py --rounds 3
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time

SHAPES = ("smollm2-135m", "qwen2.5-0.5b")
PAIRS = (("none", "f16"), ("int8", "q8_0"), ("int4", "q4_0"))
PROMPT = "Once upon a time, in a small village by the sea, there lived"
LLAMA = """
import sys
from llama_cpp import Llama
llm = Llama(sys.argv[1], n_threads=int(sys.argv[2]), n_threads_batch=int(sys.argv[2]), n_ctx=512, verbose=False)
ids = [int(t) for t in sys.argv[3].split(",")]
for i, tok in enumerate(llm.generate(ids, temp=0.0)):
    sys.stdout.write(f"{tok} ")
    sys.stdout.flush()
    if i + 1 == int(sys.argv[4]):
        break
"""


def timed(cmd: list[str], env: dict[str, str]) -> tuple[float, int]:
    """(seconds from spawn to the first stdout byte, peak RSS bytes) of one process run to its end."""
    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env)
    first = None
    while True:
        b = proc.stdout.read(1)
        if not b:
            break
        if first is None and not b.isspace():
            first = time.perf_counter() - t0
    err = proc.stderr.read().decode(errors="replace")
    _, status, usage = os.wait4(proc.pid, 0)
    proc.returncode = os.waitstatus_to_exitcode(status)
    if proc.returncode != 0 or first is None:
        raise SystemExit(f"{' '.join(cmd[:6])}... failed (rc {proc.returncode}):\n{err[-2000:]}")
    return first, usage.ru_maxrss * 1024


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shapes", default=",".join(SHAPES))
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--new", type=int, default=64)
    a = ap.parse_args()

    from llmsys.engine.bench.gguf_export import gguf_file
    from llmsys.engine.bench.synthetic import make_synthetic
    from llmsys.engine.tokenizer import Tokenizer

    env = dict(os.environ, OMP_NUM_THREADS=str(a.threads))
    rows = []
    for shape in a.shapes.split(","):
        model = str(make_synthetic(shape, seed=0))
        ids = ",".join(str(t) for t in Tokenizer.load(model).encode(PROMPT))  # what `llmsys run` feeds the model
        for quant, fmt in PAIRS:
            gguf = str(gguf_file(model, fmt, a.threads))  # written / quantized before any timing
            ours = [sys.executable, "-m", "llmsys.engine.cli.main", "run", model, PROMPT, "-n", str(a.new),
                    "--temperature", "0", "-t", str(a.threads), "--dtype", "bfloat16", "--quant", quant]
            theirs = [sys.executable, "-c", LLAMA, gguf, str(a.threads), ids, str(a.new)]
            got: dict[str, list[tuple[float, int]]] = {"llmsys": [], "llama.cpp": []}
            for rnd in range(a.rounds):
                for name, cmd in (("llmsys", ours), ("llama.cpp", theirs)):
                    sys.stderr.write(f"round {rnd + 1}/{a.rounds}: {name} {shape} {fmt}\n")
                    got[name].append(timed(cmd, env))
            med = {k: (statistics.median(t for t, _ in v), statistics.median(r for _, r in v)) for k, v in got.items()}
            rows.append((shape, quant, fmt, med))
    print(f"\n`llmsys run MODEL PROMPT -n {a.new}` vs llama-cpp-python, {a.threads} threads, fresh processes, "
          f"median of {a.rounds} interleaved rounds\n")
    print("| shape | llmsys | llama.cpp | llmsys start->first token | llama.cpp | ratio | llmsys peak RSS | llama.cpp "
          "| ratio |")
    print("|---|---|---|---|---|---|---|---|---|")
    for shape, quant, fmt, med in rows:
        (t1, r1), (t2, r2) = med["llmsys"], med["llama.cpp"]
        print(f"| {shape} | {'bf16' if quant == 'none' else quant} | {fmt} | {t1:.2f} s | {t2:.2f} s | "
              f"{t1 / t2:.2f}x | {r1 / 2**20:.0f} MiB | {r2 / 2**20:.0f} MiB | {r1 / r2:.2f}x |")


if __name__ == "__main__":
    main()
