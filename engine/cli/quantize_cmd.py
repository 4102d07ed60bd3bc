"""``llmsys quantize MODEL --quant int4 -o DIR``: write a quantized checkpoint that ``llmsys run DIR`` loads.

The directory (``model.safetensors``, ``config.json`` with ``quantization_config``, tokenizer files)
is rebuilt from the stored tensors, never re-quantized or expanded. ``--method rtn`` is ``--quant`` at
load (so ``quantize`` -> ``run`` gives the tokens of quantizing on the fly); ``gptq`` and ``awq`` (int4)
calibrate layer by layer (``engine.quantize.awq_calibrate``) and then distil from the float model
(``--tune-steps``, ``engine.quantize.refine_quantized``), by default on text the model generates
itself, so calibration never overlaps an evaluation file.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path
from typing import Annotated, Any, Optional

import typer

from llmsys.engine.cli.options import build_engine_config, engine_command
from llmsys.engine.config import DEFAULT_CALIB_LEN, DEFAULT_TUNE_STEPS
from llmsys.kernels.common.errors import InvalidParameterError

METHODS = ("rtn", "gptq", "awq")


@engine_command
def quantize_command(
    model: Annotated[str, typer.Argument(help="model directory or catalog name (Hugging Face safetensors)")],
    output: Annotated[Path, typer.Option("--output", "-o", help="directory to write the quantized checkpoint to")],
    method: Annotated[str, typer.Option("--method", help="rtn (round to nearest), gptq or awq (calibrated, int4)")] = "rtn",
    calib: Annotated[Optional[Path], typer.Option("--calib", help="calibration text file (default: text the model generates itself)")] = None,
    calib_samples: Annotated[int, typer.Option("--calib-samples", help="calibration sequences")] = 512,
    calib_len: Annotated[int, typer.Option("--calib-len", help="tokens per calibration sequence")] = DEFAULT_CALIB_LEN,
    seed: Annotated[int, typer.Option("--seed", help="seed for self-generated calibration text")] = 0,
    tune_steps: Annotated[int, typer.Option("--tune-steps", help="gptq/awq: distillation steps after calibration (0: plain GPTQ/AWQ)")] = DEFAULT_TUNE_STEPS,
    *,
    engine_flags: dict[str, Any],
) -> int:
    from llmsys.engine.loader.quantized import save_quantized, stored_quantized
    method = method.strip().lower()
    if method not in METHODS:
        raise InvalidParameterError(f"unknown --method {method!r}; valid: {', '.join(METHODS)}")
    spec = build_engine_config(model, engine_flags).quant  # the flags parsed (and checked) once
    if spec.method == "none":
        raise InvalidParameterError("llmsys quantize needs --quant (int8, int4, int4:g32, int4:g128, nf4, nf4:dq, fp8)")
    if calib_samples < 1 or calib_len < 8:
        raise InvalidParameterError("--calib-samples must be >= 1 and --calib-len >= 8")
    if tune_steps < 0:
        raise InvalidParameterError(f"--tune-steps must be >= 0, got {tune_steps}")
    t0 = time.perf_counter()
    if method == "rtn":
        llm = _load(model, engine_flags, quant=spec.name)
    else:
        llm = _load(model, engine_flags, quant="none")
        model_obj = llm.loaded.model
        from llmsys.engine.quantize import (awq_calibrate, file_calibration, gptq_calibrate, refine_quantized,
                                            self_generated_calibration)

        t = time.perf_counter()
        if calib is not None:
            seqs = file_calibration(llm, str(calib), calib_samples, calib_len)
            source = calib.name
        else:
            seqs = self_generated_calibration(llm, calib_samples, min(calib_len, llm.max_model_len - 1), seed,
                                              progress=True)
            source = f"self-generated (seed {seed})"
        sys.stderr.write(f"calibrating on {len(seqs)} x {len(seqs[0])} tokens ({source}, {time.perf_counter() - t:.1f} s)\n")
        teacher = {k: v.detach().clone() for k, v in model_obj.state_dict().items()} if tune_steps else {}
        t = time.perf_counter()
        (gptq_calibrate if method == "gptq" else awq_calibrate)(model_obj, seqs, spec, progress=True)
        sys.stderr.write(f"{method}: {len(model_obj.model.layers)} layers quantized ({time.perf_counter() - t:.1f} s)\n")
        if tune_steps:
            t = time.perf_counter()
            rep = refine_quantized(model_obj, teacher, seqs, steps=tune_steps, progress=True, report_seqs=64)
            del teacher
            sys.stderr.write(f"refined: KL(float || int4) per token ({min(64, len(seqs))} sequences) {rep.kl_before:.4f} -> {rep.kl_after:.4f} "
                             f"({rep.steps} steps, {time.perf_counter() - t:.1f} s)\n")
    loaded = llm.loaded
    if stored_quantized(loaded.config):  # (MXFP4 experts were dequantized at load: quantized like float ones)
        raise InvalidParameterError(f"{model} is already quantized; quantize its float checkpoint instead")
    if not loaded.config:
        raise InvalidParameterError(f"{model}: llmsys quantize needs a Hugging Face directory (config.json)")
    extra = {"calibration": source, "tune_steps": tune_steps} if method != "rtn" else {}
    out = save_quantized(loaded.model, loaded.config, output, spec.name, method, loaded.tokenizer_path, extra)
    from llmsys.engine.quantize import format_memory

    mem = llm.memory_report()
    wbytes = sum(mem.weights.values())
    sys.stderr.write(format_memory(mem) + "\n")
    sys.stderr.write(
        f"wrote {out} ({spec.name}, {method}): weights {wbytes} bytes, file {out.stat().st_size} bytes, "
        f"{time.perf_counter() - t0:.1f} s\n"
    )
    return 0


def _load(model: str, flags: dict[str, Any], quant: str):
    from llmsys.engine.llm import LLM

    f = dict(flags)
    f["quant"] = quant
    if f.get("dtype", "auto") == "auto":
        f["dtype"] = "float32"  # keep float tensors at checkpoint precision; quantizers read that anyway
    if f.get("kv_cache_tokens") is None:
        f["kv_cache_tokens"] = 8192
    f["prepack"] = False  # calibration reads and rewrites Linear weights
    return LLM(build_engine_config(model, f))
