"""``llmsys bench [MODEL]``: llama-bench's tests, swept over our engine's axes.

Flags follow llama-bench (``-p 512 -n 128 --pg 512,128 -d 4096 -r 5 -b 1,8
-t 1,2``); every swept flag takes a comma list and the matrix gives one row
per combination. Without MODEL (and without --synthetic) a small synthetic
model is measured with QUICK settings, so a fresh machine gets a sensible table
in well under 3 minutes; with a MODEL or --synthetic NAME the FULL settings
(llama-bench's) apply. The option help states both, from the same two dicts.

Before anything loads, a test whose depth + prompt + generation does not fit
the model's context is refused (``suite.check_context``), so a row is never
half-run.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Annotated, Any, Optional

import typer

from llmsys.engine.cli.options import ENGINE_PARAMS, _extend, fold_moe_flags, pulling_command
from llmsys.kernels.common.errors import InvalidParameterError

# Engine flags that bench sweeps: it declares them itself as comma lists.
SWEPT = ("dtype", "quant", "kv_dtype", "kv_policy", "gpu_mem", "cpu_mem", "threads")
DEFAULT_SYNTHETIC = "smollm2-135m"
QUICK = {"n_prompt": "128", "n_gen": "32", "repetitions": 3}  # no MODEL: finish in well under 3 minutes
FULL = {"n_prompt": "512", "n_gen": "128", "repetitions": 5}  # llama-bench's defaults


def _default(key: str) -> str:
    """The help text's default, read from QUICK / FULL so help and behaviour cannot drift apart."""
    return f"default {FULL[key]} with MODEL or --synthetic, {QUICK[key]} without either"


def _bench_flags(fn):
    return _extend(fn, [p for p in ENGINE_PARAMS if p.name not in SWEPT], fold_moe_flags, "engine_flags")


def _pg(values: list[str] | None) -> list[tuple[int, int]]:
    out = []
    for v in values or []:
        parts = v.split(",")
        try:
            p, n = (int(x) for x in parts)
        except ValueError:
            raise InvalidParameterError(f"--pg {v!r}: write it as PROMPT,GEN like 512,128") from None
        out.append((p, n))
    return out


@pulling_command
@_bench_flags
def bench_command(
    model: Annotated[Optional[str], typer.Argument(help=f"model folder, llama2.c .bin, GGUF, catalog name or alias (NAME:TAG), org/repo, ollama:NAME or a synthetic shape (default: synthetic {DEFAULT_SYNTHETIC} with -p {QUICK['n_prompt']} -n {QUICK['n_gen']} -r {QUICK['repetitions']})")] = None,
    synthetic: Annotated[Optional[str], typer.Option("--synthetic", help=f"random-weight shape from models.toml [synthetic.*], e.g. smollm2-135m, qwen2.5-0.5b, llama-8b, qwen3-30b-a3b (runs -p {FULL['n_prompt']} -n {FULL['n_gen']} -r {FULL['repetitions']} unless given)")] = None,
    layers: Annotated[Optional[int], typer.Option("--layers", help="with --synthetic: keep the first N layers at full width (a big shape in this machine's RAM; rows say N of the total)")] = None,
    n_prompt: Annotated[Optional[str], typer.Option("--n-prompt", "-p", help=f"prompt tokens for pp tests, comma list ({_default('n_prompt')}; 0 with --pg; 0 = none)")] = None,
    n_gen: Annotated[Optional[str], typer.Option("--n-gen", "-n", help=f"generated tokens for tg tests, comma list ({_default('n_gen')}; 0 with --pg; 0 = none)")] = None,
    pg: Annotated[Optional[list[str]], typer.Option("--pg", help="prompt+generation test PROMPT,GEN (repeatable)")] = None,
    depth: Annotated[str, typer.Option("--depth", "-d", help="context tokens already in the KV cache, comma list")] = "0",
    repetitions: Annotated[Optional[int], typer.Option("--repetitions", "-r", help=f"timed repetitions per test ({_default('repetitions')})")] = None,
    batch: Annotated[str, typer.Option("--batch", "-b", help="sequences run together, comma list")] = "1",
    threads: Annotated[Optional[str], typer.Option("--threads", "-t", help="CPU threads, comma list; auto = the engine's default, the idle physical cores (default: auto)")] = None,
    dtype: Annotated[str, typer.Option("--dtype", help="auto, float32, bfloat16, float16; comma list")] = "auto",
    quant: Annotated[str, typer.Option("--quant", help="weight format(s): none, int8, int8:g32, int4, nf4, fp8; comma list")] = "none",
    kv_dtype: Annotated[str, typer.Option("--kv-dtype", help="KV cache format(s): auto, int8, int4; comma list")] = "auto",
    kv_policy: Annotated[str, typer.Option("--kv-policy", help="KV policies; ';' separates them (or ',' when unambiguous)")] = "full",
    gpu_mem: Annotated[Optional[str], typer.Option("--gpu-mem", help="GPU budget(s), e.g. 2GiB,4GiB")] = None,
    cpu_mem: Annotated[Optional[str], typer.Option("--cpu-mem", help="CPU RAM budget(s), e.g. 512MiB,1GiB")] = None,
    vs: Annotated[Optional[str], typer.Option("--vs", help="baselines in the same run, comma list: transformers, accelerate, llama.cpp (GGUF paired by bits: float32 f32, bf16/fp16 f16, int8 q8_0, int4 q4_0; or llama.cpp:FORMAT with f32, f16, q8_0, q4_0, q4_K_M)")] = None,
    output: Annotated[str, typer.Option("--output", "-o", help="md, json, jsonl or csv (to stdout)")] = "md",
    plot: Annotated[Optional[Path], typer.Option("--plot", help="write a throughput plot (PNG) here")] = None,
    seed: Annotated[int, typer.Option("--seed", help="seed of the synthetic weights and the random prompts")] = 0,
    e2e: Annotated[bool, typer.Option("--e2e/--no-e2e", help="also time LLM.generate end to end")] = True,
    warmup: Annotated[bool, typer.Option("--warmup/--no-warmup", help="one untimed run before the timed ones")] = True,
    fresh_machine: Annotated[bool, typer.Option("--remeasure", help="measure RAM / disk / host-GPU bandwidth again (else the cached record llmsys plan shares)")] = False,
    progress: Annotated[Optional[bool], typer.Option("--progress/--no-progress", help="progress bar on stderr (default: on a TTY)")] = None,
    verbose: Annotated[bool, typer.Option("--verbose", "-v", help="print each configuration's matmul kernels (per quantized layer) on stderr")] = False,
    *,
    engine_flags: dict[str, Any],
    auto_pull: bool,
) -> int:
    from llmsys.engine.bench import report
    from llmsys.engine.bench.machine import machine_info
    from llmsys.engine.bench.suite import (BenchSpec, build_configs, build_tests, check_baselines, check_context, int_list,
                                           run_bench, split_list, split_policies, thread_list)
    from llmsys.engine.bench.synthetic import cut_layers, make_synthetic, synthetic_config

    if output not in report.FORMATS:
        raise InvalidParameterError(f"--output {output!r}: choose one of {', '.join(report.FORMATS)}")
    found = None
    if model is not None:  # any name engine/names.py takes; a synthetic shape's name is --synthetic NAME
        from llmsys.engine import names

        found = names.resolve(model)
        if found.kind is names.NameKind.SHAPE and synthetic is None:
            model, synthetic = None, found.shape
    quick = model is None and synthetic is None
    defaults = QUICK if quick else FULL
    if model is not None and synthetic is not None:
        raise InvalidParameterError("give either MODEL or --synthetic NAME, not both")
    show = sys.stderr.isatty() if progress is None else progress
    baselines = split_list(vs)
    check_baselines(baselines)
    tests = build_tests(
        int_list(n_prompt if n_prompt is not None else ("0" if pg else defaults["n_prompt"]), "-p"),
        int_list(n_gen if n_gen is not None else ("0" if pg else defaults["n_gen"]), "-n"),
        _pg(pg),
        int_list(depth, "-d"),
    )
    reps = repetitions if repetitions is not None else defaults["repetitions"]
    if reps < 1:
        raise InvalidParameterError(f"-r must be >= 1, got {reps}")
    configs = build_configs(
        dtype=split_list(dtype), quant=split_list(quant), kv_dtype=split_list(kv_dtype),
        kv_policy=split_policies(kv_policy), gpu_mem=split_list(gpu_mem), cpu_mem=split_list(cpu_mem),
    )
    if layers is not None and model is not None:
        raise InvalidParameterError("--layers cuts a --synthetic shape; a MODEL is benched whole")
    shape = None
    if model is None:
        synthetic = synthetic or DEFAULT_SYNTHETIC
        shape = synthetic_config(synthetic)
        if layers is not None:
            shape = cut_layers(shape, layers, f"--synthetic {synthetic}")
    if found is not None and found.needs_pull:  # a catalog model or repo not here yet: pulled as `run` does
        from llmsys.engine.cli.models_cmd import ensure_pulled

        ensure_pulled(model, auto_pull)
    # Before any weight is written or read: every test must fit the context.
    check_context(tests, configs, engine_flags.get("max_model_len"), shape if model is None else model)
    if model is None:
        if show:
            sys.stderr.write(f"preparing synthetic {synthetic} (random weights, cached)...\n")
        folder = synthetic if layers is None else f"{synthetic}-{layers}l"
        model = str(make_synthetic(folder, seed=seed, config=shape))
    spec = BenchSpec(
        model=model,
        tests=tests,
        configs=configs,
        batches=int_list(batch, "-b", 1) or [1],
        threads=thread_list(threads),
        repetitions=reps,
        warmup=warmup,
        e2e=e2e,
        vs=baselines,
        seed=seed,
        synthetic=synthetic,
        layers=layers,
        engine_flags={k: v for k, v in engine_flags.items() if v is not None and not _is_default(k, v)},
    )
    if show:
        sys.stderr.write("machine probe: RAM / disk bandwidth (measured once, cached in $LLMSYS_HOME/machine.json)...\n")
    offload_dir = engine_flags.get("offload_dir")
    machine = machine_info(cache=not fresh_machine, probe_dir=Path(offload_dir).expanduser() if offload_dir else None)
    if baselines:
        _quiet_transformers()
    log = (lambda line: sys.stderr.write(f"kernels: {line}\n")) if verbose else None
    result = run_bench(spec, machine, _progress_bar if show else None, log)
    sys.stdout.write(report.render(result, output))
    if output == "md":
        sys.stdout.write("\n")
    if plot is not None:
        report.plot(result, plot)
        sys.stderr.write(f"plot written to {plot}\n")
    return 1 if result.rows and all(r.error for r in result.rows) else 0


def _is_default(name: str, value: Any) -> bool:
    for p in ENGINE_PARAMS:
        if p.name == name:
            return p.default == value
    return False


def _quiet_transformers() -> None:
    import warnings

    warnings.filterwarnings("ignore", module="transformers")
    try:
        from transformers.utils import logging as hf_logging

        hf_logging.set_verbosity_error()
        hf_logging.disable_progress_bar()
    except ImportError:
        pass


def _progress_bar(done: int, total: int, what: str) -> None:
    width = 30
    fill = int(width * done / max(total, 1))
    end = "\n" if done >= total else ""
    sys.stderr.write(f"\r\033[Kbench [{'#' * fill}{'.' * (width - fill)}] {done}/{total} {what}{end}")
    sys.stderr.flush()
