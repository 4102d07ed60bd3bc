"""``llmsys plan MODEL --gpu-mem ... --cpu-mem ... [--batch N] [--explain]``.

Prints where each layer would live and be computed, the bytes per tier and
the predicted time per token, without reading a single weight: the model is
built on the meta device from its config. MODEL may be a model directory, a
catalog name, or a synthetic benchmark shape (``llama-8b``), so a plan for a
model you have not downloaded is one command away.

The measured speeds the plan rests on come from the one machine probe
(``llmsys.offload.bandwidth``, cached in ``$LLMSYS_HOME/machine.json``), the
same record ``llmsys bench`` shows; ``--remeasure`` refreshes it for both.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

import typer

from llmsys.engine.cli.options import build_engine_config, engine_command
from llmsys.kernels.common.errors import CheckpointError, InvalidParameterError

if TYPE_CHECKING:
    from llmsys.engine.loader.detect import ModelSource


def _config_for(model: str) -> tuple[dict[str, Any], str, ModelSource | None]:
    """``(config, where it came from, the GGUF's ModelSource or None)``: a GGUF's header is parsed once,
    here, and its tensor index is built from the same parse. MODEL is any name ``llmsys.engine.names``
    takes, or a config.json; a catalog model not downloaded yet plans from its models.toml shape, so a
    plan needs no weights."""
    p = Path(model).expanduser()
    if p.is_file() and p.suffix == ".json":
        return json.loads(p.read_text()), str(p), None
    from llmsys.engine import names
    from llmsys.engine.catalog import synthetic_configs
    from llmsys.engine.loader import gguf_io
    from llmsys.engine.loader.detect import ModelFormat

    found = names.resolve(model)
    if found.kind is names.NameKind.SHAPE:
        return dict(synthetic_configs()[found.shape]), f"synthetic:{found.shape}", None
    if found.needs_pull and found.shape is not None:
        return (dict(synthetic_configs()[found.shape]),
                f"{found.name} (not downloaded: its shape, models.toml [synthetic.{found.shape}])", None)
    src = found.source()  # not downloaded and no shape: the one-line `llmsys pull` hint
    where = str(src.path) if found.kind is names.NameKind.PATH else f"{found.name} ({src.path})"
    if src.format is ModelFormat.GGUF:
        return gguf_io.hf_config(src.path, src.gguf_header), where, src
    if src.format is ModelFormat.LLAMA2C:
        raise CheckpointError(f"{src.path}: a llama2.c checkpoint; `llmsys plan` needs a Hugging Face model directory, "
                              "a GGUF file or a catalog name")
    return json.loads((src.path / "config.json").read_text()), where, None


def meta_model(cfg: dict[str, Any], source: str = "config.json"):
    from llmsys.engine.models import family_for, text_config

    cfg = text_config(cfg, source)  # a multimodal checkpoint plans its text model (the one loaded)
    family = family_for(cfg, source)
    args = family.ModelArgs.from_hf_config(cfg)
    import torch

    from llmsys.engine.loader.common import skip_init

    with torch.device("meta"), skip_init():
        return family.Model(args)


@engine_command
def plan_command(
    model: Annotated[str, typer.Argument(help="model folder or file, catalog name or alias (qwen2.5:0.5b), org/repo, Ollama NAME:TAG or synthetic shape (llama-8b)")],
    batch: Annotated[int, typer.Option("--batch", help="sequences decoded together")] = 1,
    prompt_len: Annotated[int, typer.Option("--prompt-len", help="prompt tokens per sequence")] = 128,
    output_len: Annotated[int, typer.Option("--output-len", help="generated tokens per sequence")] = 128,
    explain: Annotated[bool, typer.Option("--explain", help="say why this placement was chosen")] = False,
    as_json: Annotated[bool, typer.Option("--json", help="print the plan as JSON")] = False,
    remeasure: Annotated[bool, typer.Option("--remeasure", help="measure RAM / disk / host-GPU bandwidth again (else the cached record llmsys bench shares)")] = False,
    accept: Annotated[float, typer.Option("--accept", help="with --spec: the mean accepted length to predict ms/token at (tokens a verification yields, 1..spec-tokens+1)")] = 2.5,
    *,
    engine_flags: dict[str, Any],
) -> int:
    import torch  # here, not at the top: this module is imported for --help

    from llmsys.engine.builder import kv_probe, planned_kv
    from llmsys.engine.loader import gguf_io
    from llmsys.engine.loader.common import resolve_device, resolve_dtype
    from llmsys.offload.bandwidth import measure_bandwidths
    from llmsys.offload.budgets import Budgets, resolve_budgets
    from llmsys.offload.plan import Workload
    from llmsys.offload.prepare import plan_for
    from llmsys.offload.report import format_plan

    config = build_engine_config(model, engine_flags)
    cfg, source, gguf = _config_for(model)
    meta = meta_model(cfg, source)
    a = meta.args
    hypothetical = config.gpu_mem is not None and not torch.cuda.is_available()
    dev = torch.device("cpu") if hypothetical else resolve_device(config.device)
    dt = resolve_dtype(config.dtype, torch.device("cuda") if hypothetical else dev)
    budgets = resolve_budgets(config.gpu_mem, config.cpu_mem, config.offload_dir, dev)
    if hypothetical:  # plan for a GPU this machine does not have (what-if)
        budgets = Budgets(budgets.cpu, config.gpu_mem, budgets.offload_dir, budgets.cpu_explicit, True)
    # The pool the engine would make with these flags (builder.planned_kv, the function the engine sizes it with).
    _, kv_tokens = planned_kv(a, config, dt, budgets)
    per_tok = kv_probe(a, config, dt).bytes_per_token
    work = Workload(batch=batch, prompt_len=prompt_len, output_len=output_len, kv_tokens=kv_tokens,
                    max_batched_tokens=config.max_num_batched_tokens, kv_cold_tokens=config.offload_tokens(per_tok))
    bpw = None  # a GGUF as stored: its mix of kept int4 codes and dequantized matrices
    if config.quant.method == "none" and gguf is not None:
        bpw = gguf_io.GGUFIndex(gguf.path, gguf.gguf_header, cfg).weight_bytes(dt)
    bw = measure_bandwidths(cache=not remeasure, probe_dir=budgets.offload_dir, kernels=True)
    kv_kw = {"kv_dtype": config.kv_dtype, "block_size": config.block_size}  # the pool's KV format
    plan, shape = plan_for(meta, dt, budgets, work, config.quant.method, bandwidths=bw, max_seqs=batch,
                           bytes_per_weight=bpw, cpu_moe=config.cpu_moe, **kv_kw)
    if as_json:
        print(json.dumps({**plan_to_dict(plan), **speed_dict(plan, shape)}, indent=1))
        return 0
    print(f"{source}: {a.num_hidden_layers} layers, {str(dt).removeprefix('torch.')}"
          + (" (hypothetical GPU: no CUDA device here, host-to-device 16 GB/s assumed)" if hypothetical else ""))
    print(format_plan(plan))
    print(speed_line(plan))
    print(calibration_line(plan, shape))
    if config.spec is not None:
        k = config.spec_tokens
        if not 1.0 <= accept <= k + 1:
            raise InvalidParameterError(f"--accept {accept} must be in 1..{k + 1} (--spec-tokens {k} + 1)")
        vwork = dataclasses.replace(work, batch=batch * (k + 1))
        vplan, _ = plan_for(meta, dt, budgets, vwork, config.quant.method, bandwidths=bw, max_seqs=batch * (k + 1),
                            bytes_per_weight=bpw, **kv_kw)
        per_tok = vplan.decode_ms / accept
        print(f"speculative decoding ({config.spec.kind}, --spec-tokens {k}): a verification step of {batch} x {k + 1} "
              f"tokens {vplan.decode_ms:.1f} ms ({vplan.decode_ms / plan.decode_ms:.2f}x a decode step); at mean "
              f"accepted length {accept:g}: {per_tok:.1f} ms per token per sequence vs {plan.decode_ms:.1f} without "
              f"({plan.decode_ms / per_tok:.2f}x), the draft's own time not included")
    if explain:
        print()
        for line in plan.reasons:
            print(f"- {line}")
        print(f"- {probe_line(plan.bandwidths)}")
    return 0


def prefill_tok_s(plan) -> float:
    """Prompt tokens per second the plan predicts (every sequence's prompt, chunked as the engine does)."""
    w = plan.workload
    return 1000.0 * w.batch * w.prompt_len / max(plan.prefill_ms, 1e-9)


def speed_line(plan) -> str:
    """The predicted speeds in the units ``llmsys bench`` measures (tg and pp t/s), to hold them side by side."""
    w = plan.workload
    return (f"speed: decode {plan.tok_s:.1f} tok/s, prefill {prefill_tok_s(plan):.1f} tok/s "
            f"(batch {w.batch}, {w.prompt_len}-token prompts; llmsys bench -p {w.prompt_len} -n {w.output_len} "
            "measures the same)")


def calibration_line(plan, shape) -> str:
    """Where the CPU compute figures came from: each stored format's probed kernel cost, the key it was probed
    under and whether it is the cached record's, or the roofline where a format has no figure."""
    from datetime import datetime, timezone

    from llmsys.offload.bandwidth import BUSY_PROBE_LOAD, cache_path
    from llmsys.offload.plan import calibration_of

    cal = calibration_of(shape, plan.bandwidths)
    bw, kc = plan.bandwidths, cal.kernels
    if kc is None or not cal.calibrated or plan.layers and plan.layers[0].compute == "gpu":
        missing = ", ".join(f for f, c in cal.formats if c is None)
        why = (f"no kernel figure for {missing}" if kc is not None and missing
               else "GPU compute" if plan.layers and plan.layers[0].compute == "gpu" else "no kernel probe")
        return (f"calibration: roofline ({why}): RAM {bw.mem_gbps:.1f} GB/s, "
                + ", ".join(f"{k} {v:.0f} GFLOP/s" for k, v in bw.cpu_gflops.items()))
    figures = "; ".join(f"{f} {c.decode_gbps:.1f} GB/s at 1 row, {c.gflops:.0f} GFLOP/s per further row ({c.kernel})"
                        for f, c in cal.formats)
    when = datetime.fromtimestamp(kc.measured_at, timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    kept = (f"probed now, not cached: other programs used {kc.probe_load:.1f} cores meanwhile"
            if kc.probe_load > BUSY_PROBE_LOAD else f"cached in {cache_path()}")
    return (f"calibration: kernel probe of this machine ({kc.key.get('isa') or 'no C kernels'}, {kc.key.get('threads')} "
            f"threads, {when}; {kept}; --remeasure refreshes it): {figures}")


def speed_dict(plan, shape) -> dict[str, Any]:
    """The predicted speeds and their calibration, for ``--json``."""
    from llmsys.offload.plan import calibration_of

    cal = calibration_of(shape, plan.bandwidths)
    return {"decode_tok_s": plan.tok_s, "prefill_tok_s": prefill_tok_s(plan),
            "calibration": {"source": "kernel probe" if cal.calibrated else "roofline",
                            "formats": {f: (dataclasses.asdict(c) if c is not None else None) for f, c in cal.formats}}}


def probe_line(bw) -> str:
    """Where the measured speeds came from, so a figure that differs elsewhere can be traced."""
    from llmsys.engine.bench.machine import bandwidth_parts
    from llmsys.offload.bandwidth import cache_path

    return f"machine probe ({cache_path()}, shared with llmsys bench; --remeasure refreshes it): " + ", ".join(bandwidth_parts(bw))


def plan_to_dict(plan) -> dict[str, Any]:
    """A JSON-able view of a plan (what the bench records)."""
    from dataclasses import asdict

    d = {
        "layers": [asdict(p) for p in plan.layers],
        "embed": asdict(plan.embed) if plan.embed else None,
        "head": asdict(plan.head),
        "kv_tier": plan.kv_tier,
        "kv_bytes": plan.kv_bytes,
        "kv_cold_tier": plan.kv_cold_tier if plan.workload.kv_cold_tokens else None,
        "kv_cold_bytes": plan.kv_cold_bytes,
        "staging": plan.staging,
        "decode_ms": plan.decode_ms,
        "prefill_ms": plan.prefill_ms,
        "bound": plan.bound,
        "resources_ms": plan.resources_ms,
        "reasons": list(plan.reasons),
        "budgets": {"cpu": plan.budgets.cpu, "gpu": plan.budgets.gpu},
        "bandwidths": asdict(plan.bandwidths),
    }
    return d
