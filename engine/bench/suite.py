"""The bench matrix: sweep axes -> one engine per load configuration -> rows.

Axes that change how the model is loaded (dtype, quant, KV dtype, KV policy,
memory budgets) cost a reload, so they form the outer loop; threads, batch
size and the tests reuse the loaded engine. A configuration that fails (a
value not supported yet, a budget too small) turns into rows that carry the
error message instead of ending the sweep - a sweep is often run to find
exactly where things stop working.
"""

from __future__ import annotations

import gc
import itertools
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable

import torch

from llmsys.engine.bench.machine import MachineInfo
from llmsys.engine.bench.measure import TestSpec, measure_e2e, measure_spec, measure_test
from llmsys.kernels.common.cpus import choose_threads
from llmsys.kernels.common.errors import InvalidParameterError, LLMSysError

LOAD_AXES = ("dtype", "quant", "kv_dtype", "kv_policy", "gpu_mem", "cpu_mem")
DEFAULTS = {"dtype": "auto", "quant": "none", "kv_dtype": "auto", "kv_policy": "full", "gpu_mem": None, "cpu_mem": None}


@dataclass(frozen=True)
class LoadConfig:
    """One point of the load axes (values as the user wrote them)."""

    dtype: str = "auto"
    quant: str = "none"
    kv_dtype: str = "auto"
    kv_policy: str = "full"
    gpu_mem: str | None = None
    cpu_mem: str | None = None


@dataclass
class BenchSpec:
    """Everything ``llmsys bench`` was asked to do."""

    model: str  # folder / .bin / catalog name, or the synthetic folder
    tests: list[TestSpec]
    configs: list[LoadConfig] = field(default_factory=lambda: [LoadConfig()])
    batches: list[int] = field(default_factory=lambda: [1])
    threads: list[int | None] = field(default_factory=lambda: [None])
    repetitions: int = 5
    warmup: bool = True
    e2e: bool = True
    vs: list[str] = field(default_factory=list)
    seed: int = 0
    synthetic: str | None = None  # shape name when the weights are random
    layers: int | None = None  # the synthetic shape cut to its first N layers (bench --layers)
    engine_flags: dict[str, Any] = field(default_factory=dict)  # other EngineConfig fields

    @property
    def num_rows(self) -> int:
        return len(self.configs) * len(self.threads) * len(self.batches) * len(self.tests)


@dataclass
class BaselineFigures:
    tok_s: float | None = None
    tok_s_std: float | None = None
    ratio: float | None = None  # ours / baseline
    error: str | None = None
    peak_cpu_bytes: int | None = None  # the baseline's own peak RSS
    peak_gpu_bytes: int | None = None
    weights: str | None = None  # the baseline's weight format where it differs by name (llama.cpp: "q8_0")


@dataclass
class BenchRow:
    model: str
    synthetic: bool
    params: int | None
    test: str
    n_prompt: int
    n_gen: int
    depth: int
    batch: int
    threads: int
    device: str
    dtype: str  # resolved torch dtype name ("bfloat16"), or what was asked if loading failed
    quant: str
    kv_dtype: str
    kv_policy: str
    gpu_mem: str | None
    cpu_mem: str | None
    reps: int = 0
    tok_s: float | None = None
    tok_s_std: float | None = None
    ttft_ms: float | None = None
    itl_p50_ms: float | None = None
    itl_p99_ms: float | None = None
    e2e_tok_s: float | None = None
    e2e_ttft_ms: float | None = None
    weight_bytes: int | None = None
    kv_bytes: int | None = None  # KV pool reserved, all tiers
    weights_by_tier: dict[str, int] = field(default_factory=dict)
    peak_cpu_bytes: int | None = None  # process peak RSS since this configuration started loading
    peak_gpu_bytes: int | None = None
    roof_pct: float | None = None  # decode: achieved bytes/s over measured memory bandwidth
    error: str | None = None
    baselines: dict[str, BaselineFigures] = field(default_factory=dict)
    command: str = ""
    threads_auto: str | None = None  # -t auto (no -t): why the engine's default picked ``threads``
    # --spec / --draft (tg tests): measure.SpecFigures
    spec: str | None = None
    spec_verify_x: float | None = None
    spec_tokens_per_step: float | None = None
    spec_tok_s: float | None = None
    spec_plain_tok_s: float | None = None

    def to_dict(self, machine: MachineInfo | None = None) -> dict[str, Any]:
        d = asdict(self)
        if machine is not None:
            d["machine"] = machine.to_dict()
        return d


@dataclass
class BenchResult:
    machine: MachineInfo
    rows: list[BenchRow]
    spec: BenchSpec
    wall_s: float = 0.0


# --------------------------------------------------------------------------
# Parsing sweep lists
# --------------------------------------------------------------------------


def split_list(text: str | None) -> list[str]:
    """``"none,int8, int4"`` -> ``["none", "int8", "int4"]``."""
    if text is None:
        return []
    return [p.strip() for p in str(text).split(",") if p.strip()]


def split_policies(text: str | None) -> list[str]:
    """KV policies, whose own syntax has commas (``sink:4,window:256``).

    ``;`` separates policies when present; otherwise a comma does, except
    that a ``window:`` part joins a preceding ``sink:`` part.
    """
    if text is None:
        return []
    if ";" in text:
        return [p.strip() for p in text.split(";") if p.strip()]
    out: list[str] = []
    for part in split_list(text):
        if out and part.startswith("window") and out[-1].startswith("sink") and "window" not in out[-1]:
            out[-1] += "," + part
        else:
            out.append(part)
    return out


def int_list(text: str | None, flag: str, minimum: int = 0) -> list[int]:
    out = []
    for p in split_list(text):
        try:
            v = int(p)
        except ValueError:
            raise InvalidParameterError(f"{flag}: {p!r} is not an integer; give a comma list like 1,8,32") from None
        if v < minimum:
            raise InvalidParameterError(f"{flag}: {v} is below {minimum}")
        out.append(v)
    return out


def thread_list(text: str | None) -> list[int | None]:
    """``-t 1,2,auto``: thread counts, None for ``auto`` (the engine's default); no -t is ``auto``."""
    out: list[int | None] = []
    for p in split_list(text):
        out += [None] if p.lower() == "auto" else int_list(p, "-t", 1)
    return out or [None]


def build_tests(n_prompt: list[int], n_gen: list[int], pg: list[tuple[int, int]], depths: list[int]) -> list[TestSpec]:
    """llama-bench's test list: pp for each -p, tg for each -n, each pg pair; x each depth."""
    tests: list[TestSpec] = []
    for d in depths or [0]:
        tests += [TestSpec(p, 0, d) for p in n_prompt if p > 0]
        tests += [TestSpec(0, n, d) for n in n_gen if n > 0]
        tests += [TestSpec(p, n, d) for p, n in pg if p > 0 or n > 0]
    if not tests:
        raise InvalidParameterError("no tests to run: give -p N, -n N or --pg P,N with N > 0")
    return tests


def build_configs(**axes: list[str]) -> list[LoadConfig]:
    """Cartesian product of the load axes (an empty list means the default)."""
    names = list(LOAD_AXES)
    values = [axes.get(n) or [DEFAULTS[n]] for n in names]
    return [LoadConfig(**dict(zip(names, combo))) for combo in itertools.product(*values)]


# --------------------------------------------------------------------------
# Measurement helpers
# --------------------------------------------------------------------------


def reset_peak_memory() -> None:
    """Start a new peak-RSS window (Linux: clear_refs 5 resets VmHWM)."""
    try:
        with open("/proc/self/clear_refs", "w") as fh:
            fh.write("5")
    except OSError:
        pass
    if torch.cuda.is_available():
        torch.cuda.reset_peak_memory_stats()


def peak_memory() -> tuple[int | None, int | None]:
    """(peak RSS bytes of this process, peak CUDA bytes allocated)."""
    cpu = None
    try:
        for line in open("/proc/self/status"):
            if line.startswith("VmHWM:"):
                cpu = int(line.split()[1]) * 1024
    except OSError:
        import resource

        cpu = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    gpu = torch.cuda.max_memory_allocated() if torch.cuda.is_available() else None
    return cpu, gpu


def count_params(loaded) -> int:
    """Parameter count of the architecture (not of a quantized storage format)."""
    try:
        from llmsys.engine.models import family_for

        family = family_for(loaded.config, "config")
        with torch.device("meta"):
            m = family.Model(loaded.args)
        tied = loaded.args.tie_word_embeddings  # the meta skeleton is not tied yet
        return sum(p.numel() for n, p in m.named_parameters() if not (tied and n == "lm_head.weight"))
    except Exception:  # llama2.c checkpoints have no HF config: count what is loaded
        return sum(p.numel() for p in loaded.model.parameters())


def not_applied(llm, cfg: LoadConfig) -> str | None:
    """Guard against silently unquantized rows while features are being built."""
    if cfg.quant not in ("none", "auto"):
        try:
            from llmsys.quant.base import QuantLinear

            if not any(isinstance(m, QuantLinear) for m in llm.loaded.model.modules()):
                return f"--quant {cfg.quant} was not applied by this engine (no quantized layers were loaded)"
        except ImportError:
            pass
    if cfg.kv_dtype not in ("auto",) and cfg.kv_dtype != str(llm.loaded.dtype).removeprefix("torch."):
        k = getattr(getattr(llm.core, "kv", None), "k", None)
        if k and k[0].dtype == llm.loaded.dtype:
            return f"--kv-dtype {cfg.kv_dtype} was not applied by this engine (the KV pool is {llm.loaded.dtype})"
    return None


def decode_roof_pct(row: BenchRow, kv_bytes_per_token: int, bw_gbps: float | None) -> float | None:
    """Decode bytes per second over the measured memory bandwidth, in percent.

    Each decode step reads every weight once (shared by the batch) plus each
    sequence's KV context (on average depth + n_gen / 2 tokens).
    """
    if not bw_gbps or not row.tok_s or row.n_prompt or not row.n_gen or row.weight_bytes is None:
        return None
    steps_s = row.tok_s / row.batch
    ctx = row.depth + 1 + row.n_gen / 2
    per_step = row.weight_bytes + row.batch * ctx * kv_bytes_per_token
    return 100.0 * per_step * steps_s / (bw_gbps * 1e9)


def row_command(spec: BenchSpec, cfg: LoadConfig, test: TestSpec, batch: int, threads: int | None) -> str:
    """The ``llmsys bench`` command that reproduces one row."""
    parts = ["llmsys bench"]
    parts.append(f"--synthetic {spec.synthetic}" if spec.synthetic else _q(spec.model))
    if spec.layers is not None:
        parts.append(f"--layers {spec.layers}")
    if test.n_prompt and test.n_gen:
        parts += ["-p 0 -n 0", f"--pg {test.n_prompt},{test.n_gen}"]
    else:
        parts += [f"-p {test.n_prompt}", f"-n {test.n_gen}"]
    if test.depth:
        parts.append(f"-d {test.depth}")
    parts.append(f"-r {spec.repetitions}")
    if batch != 1:
        parts.append(f"-b {batch}")
    parts.append(f"-t {threads}" if threads else "-t auto")
    for name in LOAD_AXES:
        v = getattr(cfg, name)
        if v != DEFAULTS[name]:
            parts.append(f"--{name.replace('_', '-')} {_q(str(v))}")
    for name, v in spec.engine_flags.items():
        if name == "cpu_moe":  # EngineConfig's one field, spelled back as llama.cpp's two flags
            parts.append("--cpu-moe" if v == -1 else f"--n-cpu-moe {v}")
        elif v is not None and name != "progress":
            parts.append(f"--{name.replace('_', '-')} {_q(str(v))}")
    if spec.vs:
        parts.append(f"--vs {','.join(spec.vs)}")
    return " ".join(parts)


def _q(s: str) -> str:
    import shlex

    return shlex.quote(s)


# --------------------------------------------------------------------------
# The run
# --------------------------------------------------------------------------


def _engine_config(spec: BenchSpec, cfg: LoadConfig):
    from llmsys.engine.config import EngineConfig
    from llmsys.kernels.common.units import parse_size

    need = max(t.tokens_needed for t in spec.tests)
    flags = {k: v for k, v in spec.engine_flags.items() if v is not None}
    bmax = max(spec.batches)
    block = flags.get("block_size", 16)
    flags["max_num_seqs"] = max(flags.get("max_num_seqs", 1), bmax)
    flags.setdefault("kv_cache_tokens", bmax * (-(-need // block) + 1) * block)
    flags["progress"] = False
    flags["prefix_caching"] = False  # llama-bench semantics: every repetition computes its prompt
    return EngineConfig(
        model=spec.model,
        dtype=cfg.dtype,
        quant=cfg.quant,
        kv_dtype=cfg.kv_dtype,
        kv_policy=cfg.kv_policy,
        gpu_mem=parse_size(cfg.gpu_mem),
        cpu_mem=parse_size(cfg.cpu_mem),
        **flags,
    )


def _error_text(e: BaseException) -> str:
    msg = str(e).splitlines()[0] if str(e) else type(e).__name__
    return msg if isinstance(e, LLMSysError) else f"{type(e).__name__}: {msg}"


Progress = Callable[[int, int, str], None]


def kernels_line(cfg: LoadConfig, kernels: dict[str, int]) -> str:
    """``dtype auto, quant int4, kv auto: C int4 a8 x86-64-v3 x 168`` (``llmsys bench --verbose``)."""
    used = ", ".join(f"{name} x {n}" for name, n in sorted(kernels.items())) or "no quantized layers"
    return f"dtype {cfg.dtype}, quant {cfg.quant}, kv {cfg.kv_dtype}: {used}"


def run_bench(spec: BenchSpec, machine: MachineInfo, progress: Progress | None = None,
              log: Callable[[str], None] | None = None) -> BenchResult:
    """Run the whole matrix; one :class:`BenchRow` per (config, threads, batch, test).

    Per load configuration our engine runs all its rows first and is freed
    before any ``--vs`` baseline loads, so two models never share the memory
    (and the peak RSS of each is its own, up to allocator leftovers). ``log``
    gets one line per loaded configuration naming the quantized layers' kernels.
    """
    from llmsys.engine.llm import LLM

    t_start = time.perf_counter()
    rows: list[BenchRow] = []
    done = 0
    total = spec.num_rows * (1 + len(spec.vs))
    label = f"synthetic {spec.synthetic}" if spec.synthetic else Path(spec.model).name
    if spec.layers is not None:
        from llmsys.engine.bench.synthetic import synthetic_config

        label += f" ({spec.layers} of {synthetic_config(spec.synthetic)['num_hidden_layers']} layers)"
    # The engine's default (kernels.common.cpus), sampled once before anything loads: what `llmsys run`
    # without -t would use on this machine now.
    auto = choose_threads()
    default_threads = auto.threads
    for cfg in spec.configs:
        llm = None
        load_error = None
        gc.collect()
        reset_peak_memory()
        try:
            llm = LLM(_engine_config(spec, cfg))
            load_error = not_applied(llm, cfg) or _max_context_check(spec, llm)
        except Exception as e:  # noqa: BLE001 - shown in the row, the sweep goes on
            load_error = _error_text(e)
        where = (llm.loaded.path, llm.loaded.dtype, llm.loaded.device) if llm is not None else None
        if log is not None and llm is not None:
            log(kernels_line(cfg, llm.memory_report().kernels))
        cfg_rows: list[tuple[BenchRow, TestSpec, int | None]] = []
        for threads in spec.threads:
            # An explicit -t past the CPUs present is clamped as `llmsys run` clamps it; the row says what ran.
            n_threads = choose_threads(threads).threads if threads else default_threads
            torch.set_num_threads(n_threads)
            for batch in spec.batches:
                for test in spec.tests:
                    row = BenchRow(
                        model=label, synthetic=bool(spec.synthetic), params=None, test=test.name,
                        n_prompt=test.n_prompt, n_gen=test.n_gen, depth=test.depth, batch=batch,
                        threads=n_threads, device="?", dtype=cfg.dtype, quant=cfg.quant,
                        kv_dtype=cfg.kv_dtype, kv_policy=cfg.kv_policy, gpu_mem=cfg.gpu_mem, cpu_mem=cfg.cpu_mem,
                        error=load_error, command=row_command(spec, cfg, test, batch, threads),
                        threads_auto=None if threads else auto.reason,
                    )
                    if progress is not None:
                        progress(done, total, f"{test.name} b{batch} t{row.threads} {cfg.dtype} {cfg.quant}")
                    if llm is not None and load_error is None:
                        _measure_row(row, llm, spec, test, batch, machine)
                    cfg_rows.append((row, test, threads))
                    rows.append(row)
                    done += 1
        del llm
        gc.collect()
        for kind in spec.vs:  # also where our engine failed (e.g. a budget it rejects)
            reset_peak_memory()
            base, err = None, None
            try:
                base = _load_baseline(spec, cfg, where, kind)
            except Exception as e:  # noqa: BLE001
                err = _error_text(e)
            for row, test, threads in cfg_rows:
                torch.set_num_threads(row.threads)
                if progress is not None:
                    progress(done, total, f"{kind} {test.name} b{row.batch} t{row.threads}")
                row.baselines[kind] = _measure_baseline(base, err, row, spec, test, row.batch)
                done += 1
            if base is not None:
                base.close()
            del base
            gc.collect()
    torch.set_num_threads(default_threads)
    if progress is not None:
        progress(total, total, "done")
    return BenchResult(machine=machine, rows=rows, spec=spec, wall_s=time.perf_counter() - t_start)


def _max_context_check(spec: BenchSpec, llm) -> str | None:
    """After loading: the engine's own limit (a --kv-cache-tokens pool can be below the model's context)."""
    policy = getattr(llm.core, "kv_policy", None)
    if policy is not None and policy.policy.evicts:
        return None  # an evicting policy runs past the context limit by design
    for t in spec.tests:
        if t.tokens_needed > llm.max_model_len:
            return (f"{t.name} needs {t.tokens_needed} tokens of context but the engine allows {llm.max_model_len}; "
                    f"use a smaller {t.sized_by}, or raise --max-model-len / --kv-cache-tokens")
    return None


@dataclass(frozen=True)
class ContextLimit:
    """Tokens one request may hold under a configuration, and what sets the number (for the fix hint)."""

    tokens: int
    trained: int  # the model's trained context (max_position_embeddings, a llama2.c header's seq_len)
    capped: bool  # an architecture limit (a sliding window) --max-model-len cannot raise
    from_flag: bool  # --max-model-len chose it

    def refusal(self, test: TestSpec) -> str:
        """One line: the test, the tokens it needs, the context, the fix."""
        need = test.tokens_needed
        what = f"--max-model-len {self.tokens}" if self.from_flag else ("its sliding window" if self.capped else "its trained context")
        fix = f"use a smaller {test.sized_by}"
        if not self.capped and need <= self.trained:  # the engine refuses a --max-model-len past the model's
            fix += f", or --max-model-len {need}"
        return f"{test.name} needs {need} tokens of context but the model's context is {self.tokens} ({what}); {fix}"


def _trained_context(source: Path | dict[str, Any]) -> tuple[int, int | None] | None:
    """(trained context, architecture cap) from the model's config, without reading a weight.

    ``source`` is a model path or an HF config dict (a synthetic shape before its
    weights exist). ``None`` when the config cannot be read: loading reports that.
    """
    from llmsys.engine.loader import gguf_io
    from llmsys.engine.loader.common import read_json
    from llmsys.engine.loader.llama2c import HEADER, find_checkpoint
    from llmsys.engine.models import family_for, text_config

    try:
        if isinstance(source, dict):
            cfg = source
        elif (ckpt := find_checkpoint(source)) is not None:
            with open(ckpt, "rb") as fh:
                return HEADER.unpack(fh.read(HEADER.size))[6], None
        elif source.is_file() and gguf_io.is_gguf(source):
            cfg = gguf_io.hf_config(source)
        else:
            cfg = text_config(read_json(source / "config.json"))
        args = family_for(cfg, "config").ModelArgs.from_hf_config(cfg)
    except Exception:  # noqa: BLE001 - an unreadable model becomes the load's error row
        return None
    return args.max_position_embeddings, getattr(args, "max_context", None)


def context_limit(source: Path | dict[str, Any], max_model_len: int | None) -> ContextLimit | None:
    """The per-request context the engine will allow (``engine.builder.context_limit``'s rule), before loading."""
    known = _trained_context(source)
    if known is None:
        return None
    trained, cap = known
    tokens = max_model_len or trained
    capped = cap is not None and cap < tokens
    return ContextLimit(min(tokens, cap) if capped else tokens, trained, capped, bool(max_model_len) and not capped)


def _evicts(cfg: LoadConfig) -> bool:
    from llmsys.offload.eviction.policy import parse_kv_policy

    try:
        return parse_kv_policy(cfg.kv_policy).evicts
    except Exception:  # noqa: BLE001 - a bad policy is its configuration's error row
        return False


def check_context(tests: list[TestSpec], configs: list[LoadConfig], max_model_len: int | None,
                  source: str | Path | dict[str, Any]) -> None:
    """Refuse, before anything loads or is timed, a test that cannot fit the model's context.

    Without this the test ran (or half ran: a timed pp whose end-to-end text
    prompt then overflowed) and came back as a row with a figure and an error.
    Configurations with an evicting KV policy slide past the limit, so they
    need no room. ``source``: the model (as given on the command line, or its
    path) or its HF config when its folder does not exist yet (a synthetic shape).
    """
    if all(_evicts(c) for c in configs):
        return
    if isinstance(source, str):
        from llmsys.engine.builder import _resolve_path

        try:
            source = _resolve_path(source)
        except LLMSysError:
            return  # not found: the load's error says so
    limit = context_limit(source, max_model_len)
    if limit is None:
        return
    for t in tests:
        if t.tokens_needed > limit.tokens:
            raise InvalidParameterError(limit.refusal(t))


def check_baselines(kinds: list[str]) -> None:
    """Refuse an unknown ``--vs`` name (or llama.cpp format) before anything loads."""
    from llmsys.engine.bench.baseline import BASELINES
    from llmsys.engine.bench.llamacpp import NAME, split_kind

    for kind in kinds:
        if kind.partition(":")[0] == NAME:
            split_kind(kind)
        elif kind not in BASELINES:
            raise InvalidParameterError(f"--vs {kind!r}: choose from {', '.join(BASELINES)} (or llama.cpp:FORMAT)")


def _load_baseline(spec: BenchSpec, cfg: LoadConfig, where, kind: str):
    """Load ``kind`` on what our engine used (``where`` = (path, dtype, device)) or would have."""
    from llmsys.engine.bench.baseline import HFBaseline
    from llmsys.engine.bench import llamacpp
    from llmsys.kernels.common.units import parse_size

    if where is not None:
        path, dtype, device = where
    else:
        from llmsys.engine.builder import _resolve_path
        from llmsys.engine.loader import resolve_device, resolve_dtype

        path = _resolve_path(spec.model)
        device = resolve_device(spec.engine_flags.get("device") or "auto")
        dtype = resolve_dtype(cfg.dtype, device)
    if kind.partition(":")[0] == llamacpp.NAME:
        gguf, fmt = llamacpp.prepare(path, dtype, cfg.quant, kind)  # cached export / quantization
        reset_peak_memory()  # the baseline's peak is its load and runs, not a first-time export
        longest = max(max(t.depth, t.n_prompt) for t in spec.tests)
        return llamacpp.LlamaCppBaseline(gguf, fmt, n_ctx=max(t.context for t in spec.tests), n_batch=max(longest, 512))
    return HFBaseline(path, dtype, device, kind, parse_size(cfg.gpu_mem), parse_size(cfg.cpu_mem))


def _measure_row(row: BenchRow, llm, spec: BenchSpec, test: TestSpec, batch: int, machine: MachineInfo) -> None:
    loaded = llm.loaded
    rep = llm.memory_report()
    row.device = loaded.device.type
    row.dtype = str(loaded.dtype).removeprefix("torch.")
    row.weights_by_tier = dict(rep.weights)
    # Weights a decode step reads: not a tied embedding served from the checkpoint (its head twin counts).
    row.weight_bytes = sum(rep.weights.values()) - getattr(loaded.model, "embed_file_bytes", 0)
    row.kv_bytes = sum(rep.kv_total.values())
    row.params = count_params(loaded)
    try:
        res = measure_test(llm.core, test, batch, spec.repetitions, seed=spec.seed, warmup=spec.warmup)
        e2e = measure_e2e(llm, test, batch, seed=spec.seed) if spec.e2e else None
        sp = llm.config.spec
        figs = measure_spec(llm, test, batch, seed=spec.seed) if sp is not None and test.kind == "tg" else None
    except Exception as e:  # noqa: BLE001
        row.error = _error_text(e)  # and no figures: a row has a result or an error, never both
        _drain(llm)
    else:
        row.reps = res.reps
        row.tok_s, row.tok_s_std = res.tok_s_mean, res.tok_s_std
        row.ttft_ms, row.itl_p50_ms, row.itl_p99_ms = res.ttft_ms, res.itl_p50_ms, res.itl_p99_ms
        if e2e is not None:
            row.e2e_tok_s, row.e2e_ttft_ms = e2e.tok_s, e2e.ttft_ms
        if figs is not None:
            row.spec = sp.kind + (f":{sp.quant}" if sp.quant else "") + f" K={llm.config.spec_tokens}"
            row.spec_verify_x, row.spec_tokens_per_step = figs.verify_x, figs.tokens_per_step
            row.spec_tok_s, row.spec_plain_tok_s = figs.tok_s, figs.plain_tok_s
        kv_tok = llm.core.kv.spec.bytes_per_token
        row.roof_pct = decode_roof_pct(row, kv_tok, machine.bandwidths.roof_gbps(row.device))
    row.peak_cpu_bytes, row.peak_gpu_bytes = peak_memory()


def _drain(llm) -> None:
    """Free whatever a failed measurement left in the scheduler."""
    sched = llm.core.scheduler
    for seq in list(sched.running) + list(sched.waiting):
        sched.finish(seq, "abort")
    llm.core.requests.clear()


def _measure_baseline(base, err: str | None, row: BenchRow, spec: BenchSpec, test: TestSpec, batch: int) -> BaselineFigures:
    if base is None:
        return BaselineFigures(error=err or "baseline not loaded")
    try:
        res = base.measure(test, batch, spec.repetitions, seed=spec.seed, warmup=spec.warmup)
    except Exception as e:  # noqa: BLE001
        return BaselineFigures(error=_error_text(e))
    from llmsys.engine.bench.llamacpp import LlamaCppBaseline

    ratio = row.tok_s / res.tok_s_mean if row.tok_s and res.tok_s_mean else None
    cpu, gpu = peak_memory()
    return BaselineFigures(tok_s=res.tok_s_mean, tok_s_std=res.tok_s_std, ratio=ratio, peak_cpu_bytes=cpu,
                           peak_gpu_bytes=gpu, weights=base.format if isinstance(base, LlamaCppBaseline) else None)
