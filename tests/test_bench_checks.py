"""`llmsys bench`: help equals behaviour, context refusals, result-or-error rows, the plot's
structure, and one machine probe shared with `llmsys plan`.

Cheap on purpose: tiny random checkpoints, tiny probe sizes (bandwidth.DEFAULT_PROBE
swapped for a small one), and the figures themselves are never asserted, only
where they come from and that every command shows the same ones.
"""

from __future__ import annotations

import csv
import io
import json
import os
import re
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from conftest import STORIES_HF, need_shared
from llmsys.engine.bench import report
from llmsys.engine.bench import machine as machine_mod
from llmsys.engine.bench.machine import machine_info
from llmsys.engine.bench.measure import TestSpec
from llmsys.engine.bench.suite import BaselineFigures, BenchResult, BenchRow, BenchSpec, LoadConfig, run_bench
from llmsys.engine.cli.bench_cmd import DEFAULT_SYNTHETIC, FULL, QUICK
from llmsys.engine.cli.main import main
from llmsys.kernels.common.errors import ContextOverflowError
from llmsys.offload import bandwidth
from llmsys.offload.bandwidth import Bandwidths, ProbeSettings
from tiny_models import make_hf_model

TINY_PROBE = ProbeSettings(mem_bytes=2 << 20, disk_bytes=1 << 20, gemm_mnk=(4, 64, 64), repeat=1, threads=1,
                           kernel_bytes=64 << 10, kernel_shape=(64, 256), kernel_rows=4)


@pytest.fixture(autouse=True)
def _home(tmp_path, monkeypatch):
    """A fresh $LLMSYS_HOME per test and a probe that takes milliseconds."""
    monkeypatch.setenv("LLMSYS_HOME", str(tmp_path / "home"))
    monkeypatch.setattr(bandwidth, "DEFAULT_PROBE", TINY_PROBE)
    monkeypatch.setenv("COLUMNS", "250")  # help lines unwrapped


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> Path:
    return make_hf_model("llama", tmp_path_factory.mktemp("checks-tiny"), seed=0)  # context 256


@pytest.fixture(scope="module")
def tiny_long(tmp_path_factory) -> Path:
    return make_hf_model("llama", tmp_path_factory.mktemp("checks-long"), seed=0, max_position_embeddings=1024)


# --------------------------------------------------------------------------
# Help equals behaviour
# --------------------------------------------------------------------------


def _captured_spec(monkeypatch, argv: list[str]) -> BenchSpec:
    """Run the real CLI up to the matrix and return the spec it would run."""
    from llmsys.engine.bench import suite

    seen: list[BenchSpec] = []

    def fake_run(spec, machine, progress=None, log=None):
        seen.append(spec)
        return BenchResult(machine=machine, rows=[], spec=spec)

    monkeypatch.setattr(suite, "run_bench", fake_run)
    assert main(argv) == 0
    return seen[0]


def test_help_states_what_each_case_runs(tiny_long, monkeypatch, capsys):
    from llmsys.engine.bench import synthetic

    assert main(["bench", "--help"]) == 0
    help_text = capsys.readouterr().out
    monkeypatch.setattr(synthetic, "make_synthetic", lambda name, seed=0, **kw: tiny_long)  # no 135M weights
    quick = _captured_spec(monkeypatch, ["bench", "-o", "json"])
    full = _captured_spec(monkeypatch, ["bench", str(tiny_long), "-o", "json"])
    named = _captured_spec(monkeypatch, ["bench", "--synthetic", "llama-1b", "-o", "json"])
    capsys.readouterr()
    assert quick.synthetic == DEFAULT_SYNTHETIC and named.synthetic == "llama-1b"
    assert full.tests == named.tests

    def flags(spec: BenchSpec) -> tuple[int, int, int]:
        pp, tg = spec.tests  # one pp and one tg test
        assert pp.kind == "pp" and tg.kind == "tg" and not pp.depth and not tg.depth
        return pp.n_prompt, tg.n_gen, spec.repetitions

    qp, qn, qr = flags(quick)
    fp, fn, fr = flags(full)
    assert (qp, qn, qr) != (fp, fn, fr)
    assert flags(named) == (fp, fn, fr)
    # What ran is what the help says, for both cases.
    assert f"default: synthetic {DEFAULT_SYNTHETIC} with -p {qp} -n {qn} -r {qr}" in help_text
    assert f"runs -p {fp} -n {fn} -r {fr} unless given" in help_text
    assert f"(default {fp} with MODEL or --synthetic, {qp} without either" in help_text
    assert f"(default {fn} with MODEL or --synthetic, {qn} without either" in help_text
    assert f"(default {fr} with MODEL or --synthetic, {qr} without either)" in help_text
    assert (qp, qn, qr) == (int(QUICK["n_prompt"]), int(QUICK["n_gen"]), QUICK["repetitions"])
    assert (fp, fn, fr) == (int(FULL["n_prompt"]), int(FULL["n_gen"]), FULL["repetitions"])


# --------------------------------------------------------------------------
# A context too small is refused before anything runs
# --------------------------------------------------------------------------


@pytest.fixture
def no_engine(monkeypatch):
    """Any attempt to load the model fails the test: the refusal must come first."""
    from llmsys.engine import llm

    def boom(*a, **kw):
        raise AssertionError("the engine was loaded")

    monkeypatch.setattr(llm, "LLM", boom)


@pytest.mark.parametrize("argv, line", [
    (["-p", "300", "-n", "0"],
     "error: pp300 needs 302 tokens of context but the model's context is 256 (its trained context); "
     "use a smaller -p"),
    (["-p", "0", "-n", "8", "-d", "250"],
     "error: tg8 @ d250 needs 260 tokens of context but the model's context is 256 (its trained context); "
     "use a smaller -n/-d"),
    (["-p", "120", "-n", "0", "--max-model-len", "100"],
     "error: pp120 needs 122 tokens of context but the model's context is 100 (--max-model-len 100); "
     "use a smaller -p, or --max-model-len 122"),
    (["-p", "0", "-n", "0", "--pg", "200,100"],
     "error: pg200,100 needs 301 tokens of context but the model's context is 256 (its trained context); "
     "use a smaller --pg"),
])
def test_context_too_small_is_refused_before_loading(tiny, no_engine, capsys, argv, line):
    rc = main(["bench", str(tiny), *argv, "-r", "1"])
    out, err = capsys.readouterr()
    assert rc == 2 and out == ""
    assert err.strip().splitlines() == [line]


def test_default_full_tests_are_refused_on_a_short_context(tiny, no_engine, capsys):
    """MODEL without -p: the FULL pp (llama-bench's 512) cannot fit a 256-token model."""
    assert main(["bench", str(tiny)]) == 2
    assert capsys.readouterr().err.startswith(f"error: pp{FULL['n_prompt']} needs ")


def test_evicting_policy_is_not_refused(tiny, no_engine, capsys):
    """A window policy slides past the context, so the check lets it through to loading."""
    rc = main(["bench", str(tiny), "-p", "300", "-n", "0", "-r", "1", "--kv-policy", "window:64", "-o", "jsonl"])
    (row,) = [json.loads(x) for x in capsys.readouterr().out.splitlines()]
    assert rc == 1 and "the engine was loaded" in row["error"]


def test_context_read_before_loading_matches_the_engines(tiny):
    """The pre-load rule (config / llama2.c header) gives the limit the loaded engine enforces."""
    from llmsys import LLM
    from llmsys.engine.bench.suite import context_limit
    from conftest import STORIES_C

    models = [tiny] + ([STORIES_C] if STORIES_C.exists() else [])
    for model in models:
        for mml in (None, 100):
            llm = LLM(str(model), dtype="float32", max_model_len=mml, progress=False)
            assert context_limit(Path(model), mml).tokens == llm.max_model_len, (model, mml)
            del llm


def test_synthetic_context_is_read_without_weights(no_engine, capsys):
    from llmsys.engine.bench.suite import context_limit
    from llmsys.engine.bench.synthetic import synthetic_config

    cfg = synthetic_config(DEFAULT_SYNTHETIC)
    limit = context_limit(cfg, None)
    assert limit.tokens == cfg["max_position_embeddings"] and not limit.from_flag
    assert context_limit(cfg, 64).tokens == 64 and context_limit(cfg, 64).from_flag
    need = limit.tokens + 1
    assert main(["bench", "-p", str(need), "-n", "0"]) == 2  # refused before the synthetic weights are made
    assert f"pp{need} needs {need + 2} tokens" in capsys.readouterr().err
    assert not (Path(os.environ["LLMSYS_HOME"]) / "synthetic").exists()


# --------------------------------------------------------------------------
# A row has a result or an error, never both, in every format
# --------------------------------------------------------------------------


def _agree(result: BenchResult) -> None:
    for r in result.rows:
        assert (r.tok_s is None) == (r.error is not None), r
    md_rows = [x for x in report.to_markdown(result).splitlines() if x.startswith("| ") and "---" not in x][1:]
    for r, line in zip(result.rows, md_rows):
        assert ("error:" in line) == (r.error is not None), line
        assert (f"{r.tok_s:.2f} ±" in line) if r.tok_s else ("±" not in line.split("error:")[0])
    for d in json.loads(report.to_json(result))["rows"] + [json.loads(x) for x in report.to_jsonl(result).splitlines()]:
        assert (d["tok_s"] is None) == (d["error"] is not None)
        if d["error"]:
            assert d["e2e_tok_s"] is None and d["ttft_ms"] is None and d["reps"] == 0
    for d in csv.DictReader(io.StringIO(report.to_csv(result))):
        assert (d["tok_s"] == "") == (d["error"] != ""), d


def test_a_failure_after_timing_leaves_no_figures(tiny, monkeypatch):
    """The reported case: pp timed, then its end-to-end prompt overflowed; the row had both."""
    from llmsys.engine.bench import suite

    real = suite.measure_e2e

    def overflow_on_pp(llm, test, batch, seed=0):
        if test.n_prompt:
            raise ContextOverflowError(54, 48)
        return real(llm, test, batch, seed=seed)

    monkeypatch.setattr(suite, "measure_e2e", overflow_on_pp)
    machine = machine_info(bandwidths=Bandwidths(mem_gbps=10.0, disk_read_gbps=1.0))
    spec = BenchSpec(model=str(tiny), tests=[TestSpec(8, 0), TestSpec(0, 3)], repetitions=1, warmup=False,
                     configs=[LoadConfig(dtype="float32")])
    result = run_bench(spec, machine)
    pp, tg = result.rows
    assert pp.error.startswith("prompt has 54 tokens") and pp.tok_s is None and pp.ttft_ms is None
    assert tg.error is None and tg.tok_s > 0 and tg.e2e_tok_s > 0
    _agree(result)


def test_stories_small_prompt_runs_clean_in_every_format(capsys):
    """`bench stories260k-hf -p 32 -n 8 -r 1`, the command from the report."""
    model = need_shared(STORIES_HF)
    outs = {}
    for fmt in ("md", "csv", "json"):
        assert main(["bench", str(model), "-p", "32", "-n", "8", "-r", "1", "--no-warmup", "-o", fmt, "-t", "1"]) == 0
        outs[fmt] = capsys.readouterr().out
    assert "error" not in outs["md"].split("\n\n", 1)[1].lower()
    rows = list(csv.DictReader(io.StringIO(outs["csv"])))
    assert [r["test"] for r in rows] == ["pp32", "tg8"] and all(r["error"] == "" and float(r["tok_s"]) > 0 for r in rows)
    assert all(r["error"] is None and r["e2e_tok_s"] > 0 for r in json.loads(outs["json"])["rows"])


# --------------------------------------------------------------------------
# The plot: structure through matplotlib's objects
# --------------------------------------------------------------------------


def _row(test: TestSpec, batch: int, threads: int, tok: float, std: float, base: float | None = None) -> BenchRow:
    r = BenchRow(model="tiny-model", synthetic=False, params=1000, test=test.name, n_prompt=test.n_prompt,
                 n_gen=test.n_gen, depth=test.depth, batch=batch, threads=threads, device="cpu", dtype="float32",
                 quant="none", kv_dtype="auto", kv_policy="full", gpu_mem=None, cpu_mem=None, reps=5, tok_s=tok,
                 tok_s_std=std)
    if base is not None:
        r.baselines["transformers"] = BaselineFigures(tok_s=base, tok_s_std=base / 10)
    return r


def _fake_result(batches=(1, 2, 3)) -> BenchResult:
    tests = [TestSpec(512, 0), TestSpec(0, 128), TestSpec(512, 128)]
    rows = [_row(t, b, th, (5000 if t.kind == "pp" else 50) * b * th, 40.0 * b, base=30.0 * b if t.kind == "tg" else None)
            for th in (1, 2) for b in batches for t in tests]
    rows.append(BenchRow(**{**rows[0].__dict__, "tok_s": None, "tok_s_std": None, "error": "boom", "batch": 99}))
    machine = machine_info(bandwidths=Bandwidths(mem_gbps=10.0, disk_read_gbps=1.0))
    return BenchResult(machine=machine, rows=rows, spec=BenchSpec(model="x", tests=tests, repetitions=5))


def test_plot_has_a_panel_per_test_kind_with_error_bars(tmp_path):
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.container import ErrorbarContainer

    result = _fake_result()
    fig = report.draw(result)
    axes = fig.axes
    assert [ax.get_title() for ax in axes] == ["pp: prompt processing", "tg: text generation", "pg: prompt + generation"]
    per_panel = [[c for c in ax.containers if isinstance(c, ErrorbarContainer)] for ax in axes]
    assert [len(c) for c in per_panel] == [2, 4, 2]  # threads=1/2; tg also has transformers' lines
    for containers in per_panel:
        for c in containers:
            bars = c.lines[2][0].get_segments()
            assert len(bars) == 3 and all(seg[1][1] > seg[0][1] for seg in bars)  # stddev drawn at every point
    for ax in axes:
        assert list(ax.get_xticks()) == [1, 2, 3]  # integer batches only: no 1.5 / 2.5
        assert ax.get_xlabel() == "batch size (sequences)" and ax.get_ylabel() == "throughput (tokens/s)"
        assert ax.get_ylim()[0] == 0
    assert "tiny-model" in fig.get_suptitle() and result.machine.cpu_model in fig.get_suptitle()
    # One legend, outside every panel: it never covers data.
    assert all(ax.get_legend() is None for ax in axes) and len(fig.legends) == 1
    canvas = FigureCanvasAgg(fig)
    canvas.draw()
    renderer = canvas.get_renderer()
    legend_box = fig.legends[0].get_window_extent(renderer)
    for ax in axes:
        assert not legend_box.overlaps(ax.get_window_extent(renderer))
    labels = report.plot(result, tmp_path / "p.png")
    assert "tg128 threads=2 [transformers]" in labels and len(labels) == 8
    assert (tmp_path / "p.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_wide_batch_sweep_uses_log2_with_integer_ticks():
    fig = report.draw(_fake_result(batches=(1, 2, 4, 8, 16, 32)))
    for ax in fig.axes:
        assert ax.get_xscale() == "log"
        ticks = list(ax.get_xticks())
        assert ticks == [1, 2, 4, 8, 16, 32]
        assert [t.get_text() for t in ax.get_xticklabels()] == ["1", "2", "4", "8", "16", "32"]


# --------------------------------------------------------------------------
# One machine probe, one cache, shared by plan and bench
# --------------------------------------------------------------------------

_BENCH = ["-p", "0", "-n", "2", "-r", "1", "--no-e2e", "--no-warmup"]


def _plan_bw(model: Path, capsys, *extra: str) -> dict:
    assert main(["plan", str(model), "--json", *extra]) == 0
    return json.loads(capsys.readouterr().out)["bandwidths"]


def _bench_bw(model: Path, capsys, *extra: str) -> dict:
    assert main(["bench", str(model), *_BENCH, "-o", "json", *extra]) == 0
    return json.loads(capsys.readouterr().out)["machine"]["bandwidths"]


def _record() -> dict:
    return json.loads(bandwidth.cache_path().read_text())


def test_plan_and_bench_show_the_same_machine_probe(tiny, capsys):
    plan_bw = _plan_bw(tiny, capsys)  # measures (tiny probe) and writes the one record
    bench_bw = _bench_bw(tiny, capsys)
    assert plan_bw == bench_bw
    rec = _record()
    (disk,) = rec["disks"].values()
    assert disk["folder"] == str(bandwidth.default_probe_dir().resolve()) == bench_bw["disk_probe_dir"]
    assert disk["gbps"] == bench_bw["disk_read_gbps"] and rec["host"]["mem_gbps"] == bench_bw["mem_gbps"]
    assert bench_bw["mem_threads"] == TINY_PROBE.threads
    # The human-readable lines say the same numbers in the same words.
    assert main(["plan", str(tiny), "--explain"]) == 0
    plan_text = capsys.readouterr().out
    assert main(["bench", str(tiny), *_BENCH]) == 0
    bench_text = capsys.readouterr().out
    for pattern in (r"RAM read [\d.]+ GB/s", r"disk read [\d.]+ GB/s in \S+"):
        assert re.findall(pattern, plan_text) == re.findall(pattern, bench_text)[:1] != []


def test_remeasure_refreshes_the_record_for_every_reader(tiny, capsys):
    first = _bench_bw(tiny, capsys)
    rec = _record()
    rec["host"]["mem_gbps"] = 999.0  # a stale figure both commands would show
    bandwidth.cache_path().write_text(json.dumps(rec))
    assert _plan_bw(tiny, capsys)["mem_gbps"] == 999.0 == _bench_bw(tiny, capsys)["mem_gbps"]
    fresh = _bench_bw(tiny, capsys, "--remeasure")
    assert fresh["mem_gbps"] != 999.0 and fresh["disk_probe_dir"] == first["disk_probe_dir"]
    assert _plan_bw(tiny, capsys) == fresh
    rec["host"]["mem_gbps"] = 999.0
    bandwidth.cache_path().write_text(json.dumps(rec))
    assert _plan_bw(tiny, capsys, "--remeasure")["mem_gbps"] != 999.0  # plan's --remeasure too
    assert _bench_bw(tiny, capsys)["mem_gbps"] == _record()["host"]["mem_gbps"]


def test_probe_threads_and_disk_folders(tmp_path):
    caller = torch.get_num_threads()
    bw = bandwidth.measure_bandwidths(cache=False, probe=replace(TINY_PROBE, threads=caller + 1))
    assert bw.mem_threads == caller + 1 and torch.get_num_threads() == caller  # never the caller's -t; given back
    # Another folder on the same filesystem: the recorded figure and where it was measured.
    same = bandwidth.measure_bandwidths(probe_dir=tmp_path / "elsewhere")
    assert same.disk_read_gbps == bw.disk_read_gbps and same.disk_probe_dir == bw.disk_probe_dir
    shm = Path("/dev/shm")
    if os.path.ismount(shm) and os.access(shm, os.W_OK) and bandwidth.filesystem_of(shm)[1] == "tmpfs":
        folder = shm / f"llmsys-test-{os.getpid()}"
        try:
            ram = bandwidth.measure_bandwidths(probe_dir=folder)
        finally:
            folder.rmdir()
        assert ram.disk_cached and ram.disk_probe_dir == str(folder) and ram.mem_gbps == bw.mem_gbps
        assert set(_record()["disks"]) == {bandwidth.filesystem_of(tmp_path)[0], str(shm)}


def test_a_probe_beside_busy_programs_is_shown_and_not_cached(monkeypatch):
    """Other processes' CPU during the host probe (here faked: 0.5 s of it per reading, over a probe that
    counts as long enough) marks the figures as low and keeps them out of the one record; a quiet probe
    is recorded as before."""
    clock = iter(range(0, 10_000))
    monkeypatch.setattr(bandwidth, "others_cpu_seconds", lambda: 0.5 * next(clock))
    monkeypatch.setattr(bandwidth, "LOAD_MIN_SECONDS", 0.0)
    busy = bandwidth.measure_bandwidths(cache=False)
    assert busy.probe_load > bandwidth.BUSY_PROBE_LOAD and not bandwidth.cache_path().exists()
    assert "not cached" in " ".join(machine_mod.bandwidth_parts(busy))
    monkeypatch.setattr(bandwidth, "others_cpu_seconds", lambda: 0.0)
    quiet = bandwidth.measure_bandwidths(cache=False)
    assert quiet.probe_load == 0.0 and _record()["host"]["mem_gbps"] == quiet.mem_gbps
    assert "not cached" not in " ".join(machine_mod.bandwidth_parts(quiet))
