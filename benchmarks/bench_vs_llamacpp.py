"""llmsys vs llama.cpp on the CPU: same weights, same bits, same threads, fresh processes.

For the SmolLM2-135M and Qwen2.5-0.5B shapes (random bf16 weights from
``llmsys.engine.bench.synthetic``, models.toml [synthetic.*]; cached in
$LLMSYS_HOME/synthetic) each llmsys weight format is paired with the llama.cpp
GGUF of the same bit width - bf16 / f16, int8 / q8_0, int4 / q4_0 - and
llama.cpp's q4_K_M is reported beside int4. The GGUFs are the ones
``llmsys bench --vs llama.cpp`` uses (engine/bench/gguf_export.py: the gguf
package for f16, llama.cpp's own quantizer for the rest), made before any
timing. Each measurement is a fresh process (this script with ``--worker``)
that loads one engine (llama.cpp's GGUF read through the page cache first:
:func:`read_through`), runs one untimed warm-up and ``--reps`` timed
repetitions of a 128-token prompt then 64 one-token decode steps (batch 1,
greedy, argmax outside the timer: engine/bench/measure.py's StepDriver for
llmsys, LlamaCppBaseline for llama.cpp), and reports prefill tok/s, decode
tok/s and its peak RSS. Rounds interleave the engines (A B A B ...), and the
table gives the median over rounds.

Decode %roof: the bytes a decode step reads (every weight the step multiplies:
the layers and the LM head, not the embedding table's other rows; llmsys: the
model's tensors, llama.cpp: the GGUF's tensors) times decode tok/s, over this
machine's read bandwidth measured once before the rounds
(``llmsys.offload.bandwidth.probe_mem_gbps``, a large tensor reduction on the
same threads): 100% is the physical limit of a weight-streaming decode.
``--batches 8,16``: each engine's aggregate decode tok/s with that many sequences
decoding together (one fresh process per shape, engine, format and batch, after
the rounds; llama.cpp through its batch API, every sequence's token of a step in
one ``llama_decode`` call: ``LlamaCppBaseline.run_batched``).

    python benchmarks/bench_vs_llamacpp.py --threads 2 --rounds 3
    python benchmarks/bench_vs_llamacpp.py --quick   # wiring check: smollm2-135m, 8+4 tokens, one round
    python benchmarks/bench_vs_llamacpp.py --shapes qwen3-30b-a3b,gpt-oss-20b --layers 6 --formats q4_0,q8_0

Mixture-of-experts shapes (``qwen3-30b-a3b`` and ``gpt-oss-20b``, written for llama.cpp as its ``qwen3moe``
and ``gpt-oss``, experts as plain f16 tensors its quantizer turns into the row's format): the MB read per
token counts k/E of the expert tensors and their biases (a batch-1 step runs k of each layer's E experts), on
both sides. The f16 GGUF such a shape is quantized from is as large as the checkpoint and is not timed: when
this run wrote it only for that and f16 is not among ``--formats``, it is deleted once the quantized files are
made (they stay cached).

The tensor-type mix of each GGUF is printed under the table: llama.cpp falls
back to other types for tensors whose rows do not divide its block size (256
for the K-quants: 576 and 896 columns do not), so "q4_K_M" on these shapes is
partly q5_0 / q8_0.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from dataclasses import asdict, dataclass
from pathlib import Path

SHAPES = ("smollm2-135m", "qwen2.5-0.5b")
# (llmsys --quant, llama.cpp format); None = not run on that side.
PAIRS = (("none", "f16"), ("int8", "q8_0"), ("int4", "q4_0"), (None, "q4_K_M"))
PAIRED_WITH = {"q4_K_M": "int4"}  # llama.cpp-only rows: the llmsys format their ratio uses


@dataclass(frozen=True)
class Job:
    engine: str  # "llmsys" or "llama.cpp"
    shape: str
    model: str  # the synthetic folder
    fmt: str  # llmsys --quant (none / int8 / int4) or a GGUF format
    threads: int
    n_prompt: int
    n_gen: int
    reps: int
    batch: int = 1  # > 1: only the aggregate decode of that many sequences (llmsys)


@dataclass(frozen=True)
class Figures:
    prefill_tok_s: float
    decode_tok_s: float
    peak_rss: int
    step_bytes: int  # bytes of weights a decode step reads


def llmsys_step_bytes(model) -> int:
    """Bytes of the tensors a decode step of ``model`` reads: every parameter and buffer once, except the
    embedding table's when the LM head does not share it (a step looks up one row) and the RoPE table.
    A mixture of experts' expert tensors count k/E of their bytes: one token runs k of a layer's E experts."""
    emb, head = model.model.embed_tokens, model.lm_head
    a = model.args
    expert_share = a.num_experts_per_tok / a.num_experts if a.num_experts else 1.0

    def ids(mod) -> set[int]:
        return {id(t) for t in (*mod.parameters(), *mod.buffers())}

    skip = ids(emb) - ids(head)
    seen: set[int] = set()
    total = 0
    for name, t in (*model.named_parameters(), *model.named_buffers()):
        if t is None or id(t) in skip or "rope" in name or t.is_meta:
            continue
        key = id(t) if t.is_mkldnn else t.untyped_storage().data_ptr() + t.storage_offset() * t.element_size()
        if key in seen:
            continue
        seen.add(key)
        total += t.numel() * t.element_size() * (expert_share if ".experts." in name else 1.0)
    return int(total)


def gguf_step_bytes(path: Path) -> int:
    """Bytes of a GGUF's tensors a decode step reads: all, less token_embd when an output.weight exists;
    the stacked expert tensors (``*_exps``, weights and biases) at k/E of their bytes, as :func:`llmsys_step_bytes`."""
    import gguf

    reader = gguf.GGUFReader(str(path))
    arch = str(bytes(reader.fields["general.architecture"].parts[-1]), "utf-8")

    def meta(key: str) -> int:
        f = reader.fields.get(f"{arch}.{key}")
        return int(f.parts[-1][0]) if f is not None else 0

    share = meta("expert_used_count") / meta("expert_count") if meta("expert_count") else 1.0
    tensors = {t.name: int(t.n_bytes) * (share if "_exps." in t.name else 1.0) for t in reader.tensors}
    return int(sum(tensors.values()) - (tensors.get("token_embd.weight", 0) if "output.weight" in tensors else 0))


def read_through(path: Path, chunk: int = 64 << 20) -> None:
    """Read ``path`` once, so the pages llama.cpp maps are in the page cache before its warm-up.

    llama.cpp maps the GGUF (its default) and faults each page in on first use, while llmsys reads every
    weight at load. An expert the warm-up does not route to would otherwise be read from the disk inside a
    timed step -- after the other engine's process has pushed the file out of the page cache by reading its
    own checkpoint -- and a short run would time the disk, not the decode.
    """
    with open(path, "rb", buffering=0) as f:
        buf = bytearray(chunk)
        while f.readinto(buf):
            pass


def worker(job: Job) -> Figures:
    """One engine in this (fresh) process: warm-up + ``reps`` timed runs, medians of the runs."""
    import torch

    from llmsys.engine.bench.measure import TestSpec
    from llmsys.engine.bench.suite import peak_memory

    torch.set_num_threads(job.threads)
    test = TestSpec(job.n_prompt, job.n_gen)
    gen = torch.Generator().manual_seed(0)
    if job.engine == "llmsys":
        from llmsys import LLM
        from llmsys.engine.bench.measure import StepDriver

        llm = LLM(job.model, dtype="bfloat16", quant=job.fmt, device="cpu", threads=job.threads, progress=False,
                  kv_cache_tokens=(job.batch + 1) * (test.context + 16), prefix_caching=False,
                  max_num_batched_tokens=max(512, job.n_prompt))
        runner = StepDriver(llm.core)
        step_bytes = llmsys_step_bytes(llm.loaded.model)
    else:
        from llmsys.engine.bench.gguf_export import gguf_file
        from llmsys.engine.bench.llamacpp import LlamaCppBaseline

        path = gguf_file(job.model, job.fmt, job.threads)
        read_through(path)
        runner = LlamaCppBaseline(path, job.fmt, n_ctx=test.context + 16, n_batch=max(512, job.n_prompt))
        step_bytes = gguf_step_bytes(path)
    run = runner.run_batched if job.engine == "llama.cpp" and job.batch > 1 else runner.run
    run(test, job.batch, gen)  # warm-up
    runs = [run(test, job.batch, gen) for _ in range(job.reps)]
    cpu, _ = peak_memory()
    return Figures(
        prefill_tok_s=statistics.median(job.batch * job.n_prompt / r.prefill_s for r in runs),
        decode_tok_s=statistics.median(job.batch * job.n_gen / sum(r.decode_steps) for r in runs),
        peak_rss=cpu or 0,
        step_bytes=step_bytes,
    )


def run_job(job: Job) -> Figures:
    env = dict(os.environ, OMP_NUM_THREADS=str(job.threads))
    res = subprocess.run([sys.executable, __file__, "--worker", json.dumps(asdict(job))], env=env,
                         capture_output=True, text=True, timeout=1800)
    lines = [ln for ln in res.stdout.splitlines() if ln.startswith("RESULT ")]
    if res.returncode != 0 or not lines:
        raise SystemExit(f"worker {job.engine} {job.shape} {job.fmt} failed:\n{res.stderr[-3000:]}")
    return Figures(**json.loads(lines[-1].removeprefix("RESULT ")))


def type_mix(path: Path) -> str:
    """``q4_0 88%, q8_0 10%, f32 2%`` by bytes of the GGUF's tensors."""
    import gguf

    by: dict[str, int] = {}
    for t in gguf.GGUFReader(str(path)).tensors:
        by[t.tensor_type.name.lower()] = by.get(t.tensor_type.name.lower(), 0) + int(t.n_bytes)
    total = sum(by.values())
    return ", ".join(f"{k} {100 * v / total:.0f}%" for k, v in sorted(by.items(), key=lambda kv: -kv[1]))


def machine_line() -> str:
    """The CPU, the ISA level each engine runs at (what every figure must name)."""
    import torch

    from llmsys.kernels import cpu_qgemv
    from llmsys.offload.bandwidth import machine_fingerprint

    fp = machine_fingerprint()  # the planner's own record of the CPU: model name, family / model / stepping
    try:
        import llama_cpp

        llama = llama_cpp.llama_print_system_info().decode().strip()
    except Exception as exc:  # noqa: BLE001 - only a description
        llama = f"not importable ({exc})"
    return (f"Machine: {fp['cpu_model']} (family/model/stepping {fp['cpu_id']}); llmsys C kernels: "
            f"{cpu_qgemv.kernel_status().split(' /')[0]}; torch {torch.__version__} at "
            f"{torch.backends.cpu.get_cpu_capability()}; llama.cpp: {llama}")


def _mib(n: int) -> str:
    return f"{n / 2**20:.0f} MiB"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--worker", help=argparse.SUPPRESS)
    ap.add_argument("--shapes", default=",".join(SHAPES), help="synthetic shapes, comma list")
    ap.add_argument("--layers", type=int, help="cut each shape to its first N layers, full width (llmsys bench --layers)")
    ap.add_argument("--formats", default=",".join(f for _, f in PAIRS),
                    help="llama.cpp formats to run (with their llmsys pair), comma list")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=3, help="fresh-process rounds per engine and format (median)")
    ap.add_argument("--reps", type=int, default=1, help="timed repetitions inside each process")
    ap.add_argument("--prompt", type=int, default=128)
    ap.add_argument("--new", type=int, default=64)
    ap.add_argument("--batches", default="8,16", help="both engines' aggregate decode at these batches ('' for none)")
    ap.add_argument("--quick", action="store_true", help="wiring check: smollm2-135m, 8 + 4 tokens, one round")
    a = ap.parse_args()
    if a.worker:
        print("RESULT " + json.dumps(asdict(worker(Job(**json.loads(a.worker))))), flush=True)
        return
    if a.quick:
        a.shapes, a.rounds, a.prompt, a.new, a.batches = "smollm2-135m", 1, 8, 4, "2"
    if a.rounds < 1:
        raise SystemExit("--rounds must be >= 1")

    from llmsys.engine.bench.gguf_export import FLOAT_FORMATS, cache_path, gguf_file
    from llmsys.engine.bench.synthetic import cut_layers, make_synthetic, synthetic_config
    from llmsys.offload.bandwidth import probe_mem_gbps

    import torch

    torch.set_num_threads(a.threads)
    mem_gbps = probe_mem_gbps()  # before any engine runs: the roof of every decode row

    jobs: list[tuple[Job, ...]] = []  # one tuple per (shape, pair): the engines run back to back
    mixes: dict[tuple[str, str], str] = {}
    formats = a.formats.split(",")
    for name in a.shapes.split(","):
        if a.layers is None:
            shape, model = name, str(make_synthetic(name, seed=0))
        else:
            cfg = cut_layers(synthetic_config(name), a.layers, name)
            shape, model = f"{name} ({a.layers} layers)", str(make_synthetic(f"{name}-{a.layers}l", seed=0, config=cfg))
        # float GGUFs this run would write only as the quantizer's input (deleted below)
        scratch = [p for f in FLOAT_FORMATS if f not in formats and not (p := cache_path(model, f)).exists()]
        for quant, fmt in PAIRS:
            if fmt not in formats:
                continue
            mixes[(shape, fmt)] = type_mix(gguf_file(model, fmt, a.threads))  # exported / quantized before timing
            pair = []
            if quant is not None:
                pair.append(Job("llmsys", shape, model, quant, a.threads, a.prompt, a.new, a.reps))
            pair.append(Job("llama.cpp", shape, model, fmt, a.threads, a.prompt, a.new, a.reps))
            jobs.append(tuple(pair))
        for p in scratch:
            p.unlink(missing_ok=True)

    results: dict[Job, list[Figures]] = {j: [] for pair in jobs for j in pair}
    for rnd in range(a.rounds):
        for pair in jobs:
            for job in pair:  # A B, A B, ...
                f = run_job(job)
                results[job].append(f)
                sys.stderr.write(f"round {rnd + 1}/{a.rounds}: {job.engine} {job.shape} {job.fmt}: prefill "
                                 f"{f.prefill_tok_s:.1f} decode {f.decode_tok_s:.1f} tok/s\n")

    batches = [int(b) for b in a.batches.split(",") if b.strip()]
    batched: dict[Job, Figures] = {}
    for pair in jobs:
        if len(pair) < 2:
            continue  # a llama.cpp-only format: no llmsys pair to set it beside
        for b in batches:
            for job in pair:  # A B, as the rounds
                bj = Job(job.engine, job.shape, job.model, job.fmt, job.threads, job.n_prompt, job.n_gen, 1, b)
                sys.stderr.write(f"batched: {job.engine} {job.shape} {job.fmt} x{b}\n")
                batched[bj] = run_job(bj)

    def med(job: Job) -> Figures:
        fs = results[job]
        return Figures(statistics.median(f.prefill_tok_s for f in fs), statistics.median(f.decode_tok_s for f in fs),
                       int(statistics.median(f.peak_rss for f in fs)), fs[0].step_bytes)

    def roof(f: Figures) -> str:
        return f"{100 * f.step_bytes * f.decode_tok_s / (mem_gbps * 1e9):.0f}%"

    ours = {(j.shape, j.fmt): med(j) for j in results if j.engine == "llmsys"}
    print(f"\n{machine_line()}")
    print(f"\n{a.threads} threads, batch 1, {a.prompt}-token prompt, {a.new} generated tokens, "
          f"median of {a.rounds} fresh-process rounds ({a.reps} timed rep(s) each, after a warm-up)\n")
    print(f"Read bandwidth {mem_gbps:.1f} GB/s ({a.threads} threads, offload.bandwidth.probe_mem_gbps): a decode step "
          "reading B bytes of weights is limited to that / B tokens per second (%roof = 100%).\n")
    print("| shape | engine | format | prefill tok/s | decode tok/s | MB read / token | decode %roof | peak RSS "
          "| llmsys/llama.cpp prefill | decode |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for pair in jobs:
        for job in pair:
            f = med(job)
            ratio = ["-", "-"]
            if job.engine == "llama.cpp":
                mine = ours.get((job.shape, PAIRED_WITH.get(job.fmt) or next(q for q, g in PAIRS if g == job.fmt)))
                if mine is not None:
                    ratio = [f"{mine.prefill_tok_s / f.prefill_tok_s:.2f}x", f"{mine.decode_tok_s / f.decode_tok_s:.2f}x"]
            label = {"none": "bf16"}.get(job.fmt, job.fmt)
            print(f"| {job.shape} | {job.engine} | {label} | {f.prefill_tok_s:.1f} | {f.decode_tok_s:.1f} | "
                  f"{f.step_bytes / 1e6:.0f} | {roof(f)} | {_mib(f.peak_rss)} | {ratio[0]} | {ratio[1]} |")
    if batched:
        print(f"\nAggregate decode tok/s, {a.prompt}-token prompts, {a.new} tokens each, sequences decoding together "
              "(one fresh process each; llama.cpp: one llama_decode call per step for all of them):\n")
        print("| shape | llmsys | llama.cpp | " + " | ".join(f"batch {b}: llmsys | llama.cpp | ratio" for b in batches)
              + " |")
        print("|---|---|---|" + "---|---|---|" * len(batches))
        by = {(j.shape, j.engine, j.fmt, j.batch): f for j, f in batched.items()}
        for pair in jobs:
            if len(pair) < 2 or not batches:
                continue
            ours, theirs = pair
            cells = []
            for b in batches:
                m, t = by[(ours.shape, ours.engine, ours.fmt, b)], by[(theirs.shape, theirs.engine, theirs.fmt, b)]
                cells += [f"{m.decode_tok_s:.1f}", f"{t.decode_tok_s:.1f}", f"{m.decode_tok_s / t.decode_tok_s:.2f}x"]
            label = {"none": "bf16"}.get(ours.fmt, ours.fmt)
            print(f"| {ours.shape} | {label} | {theirs.fmt} | " + " | ".join(cells) + " |")
    print("\nGGUF tensor types (by bytes; llama.cpp's fallbacks where rows do not divide the block):")
    for (shape, fmt), mix in mixes.items():
        print(f"- {shape} {fmt}: {mix}")


if __name__ == "__main__":
    main()
