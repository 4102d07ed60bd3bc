"""`llmsys bench`: rows, sweeps, output formats, plot, baselines, synthetic models.

All on tiny random checkpoints (tests/tiny_models.py) so the file runs in
well under a minute; the numbers themselves are not asserted (shared CPUs),
their presence, consistency and accounting are.
"""

from __future__ import annotations

import csv
import io
import json
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from llmsys.engine.bench import report
from llmsys.engine.bench.machine import MachineInfo, machine_info, measure_bandwidths
from llmsys.offload import bandwidth
from llmsys.offload.bandwidth import Bandwidths, ProbeSettings
from llmsys.engine.bench.measure import StepDriver, TestSpec, measure_test
from llmsys.engine.bench.suite import BenchSpec, LoadConfig, build_configs, build_tests, run_bench, split_policies
from llmsys.engine.cli.main import main
from tiny_models import make_hf_model

FAKE_BW = Bandwidths(mem_gbps=10.0, disk_read_gbps=1.0)


TINY_PROBE = ProbeSettings(mem_bytes=2 << 20, disk_bytes=1 << 20, gemm_mnk=(4, 64, 64), repeat=1, threads=1,
                           kernel_bytes=64 << 10, kernel_shape=(64, 256), kernel_rows=4)


@pytest.fixture(autouse=True)
def _home(tmp_path_factory, monkeypatch):
    # Keep machine.json / synthetic folders out of the user's cache; a probe of milliseconds.
    monkeypatch.setenv("LLMSYS_HOME", str(tmp_path_factory.getbasetemp() / "llmsys-home"))
    monkeypatch.setattr(bandwidth, "DEFAULT_PROBE", TINY_PROBE)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> Path:
    return make_hf_model("llama", tmp_path_factory.mktemp("bench-tiny"), seed=0)


@pytest.fixture(scope="module")
def machine() -> MachineInfo:
    return machine_info(bandwidths=FAKE_BW)


def _spec(model: Path, **kw) -> BenchSpec:
    base = dict(model=str(model), tests=[TestSpec(8, 0), TestSpec(0, 4)], repetitions=2, configs=[LoadConfig(dtype="float32")])
    base.update(kw)
    return BenchSpec(**base)


def test_test_names_and_lists():
    tests = build_tests([512], [128], [(512, 128)], [0, 4096])
    assert [t.name for t in tests] == [
        "pp512", "tg128", "pg512,128", "pp512 @ d4096", "tg128 @ d4096", "pg512,128 @ d4096",
    ]
    assert tests[-1].context == 4096 + 512 + 128
    assert split_policies("full,window:256") == ["full", "window:256"]
    assert split_policies("full,sink:4,window:256") == ["full", "sink:4,window:256"]
    assert split_policies("sink:4,window:64;window:32") == ["sink:4,window:64", "window:32"]
    cfgs = build_configs(quant=["none", "int8"], dtype=["float32", "bfloat16"])
    assert len(cfgs) == 4 and {(c.dtype, c.quant) for c in cfgs} == {
        ("float32", "none"), ("float32", "int8"), ("bfloat16", "none"), ("bfloat16", "int8"),
    }


def test_thread_sweeps_take_auto():
    """`-t 1,2,auto`: auto (and no -t at all) is the engine's own default thread count."""
    from llmsys.engine.bench.suite import thread_list
    from llmsys.kernels.common.errors import InvalidParameterError

    assert thread_list("1,2,auto") == [1, 2, None]
    assert thread_list(None) == [None]
    with pytest.raises(InvalidParameterError, match="-t"):
        thread_list("1,many")


def test_driver_runs_real_engine_steps_and_frees_kv(tiny):
    from llmsys import LLM

    # A tiny step budget forces chunked prefill (depth 40 > 16 tokens per step).
    llm = LLM(str(tiny), dtype="float32", kv_cache_tokens=256, max_num_batched_tokens=16, progress=False)
    driver = StepDriver(llm.core)
    gen = torch.Generator().manual_seed(0)
    times = driver.run(TestSpec(24, 5, depth=40), batch=2, gen=gen)
    assert len(times.decode_steps) == 5  # one step per generated token
    assert times.prefill_s > 0 and all(dt > 0 for dt in times.decode_steps)
    assert llm.core.allocator.num_used == 0  # every block returned
    assert not llm.core.scheduler.running and not llm.core.scheduler.waiting
    # The engine still serves normally afterwards.
    out = llm.generate([[5, 6, 7]], __import__("llmsys").SamplingParams(max_tokens=3, temperature=0, ignore_eos=True))
    assert len(out[0].token_ids) == 3
    res = measure_test(llm.core, TestSpec(0, 6), batch=3, reps=2)
    assert res.reps == 2 and res.tok_s_mean > 0 and res.ttft_ms is None
    assert res.itl_p50_ms <= res.itl_p99_ms


def test_rows_and_all_formats(tiny, machine):
    result = run_bench(_spec(tiny), machine)
    assert len(result.rows) == 2
    pp, tg = result.rows
    for r in result.rows:
        assert r.error is None, r.error
        assert r.tok_s > 0 and r.tok_s_std >= 0 and r.reps == 2
        assert r.dtype == "float32" and r.device == "cpu"
        assert r.e2e_tok_s > 0 and r.e2e_ttft_ms > 0
        assert r.weight_bytes > 0 and r.kv_bytes > 0
        assert r.peak_cpu_bytes > r.weight_bytes
        assert r.command.startswith("llmsys bench ")
    n_params = sum(p.numel() for p in __import__("transformers").AutoModelForCausalLM.from_pretrained(str(tiny)).parameters())
    assert pp.params == n_params
    assert 4 * n_params <= pp.weight_bytes < 4.2 * n_params  # float32, untied (+ RoPE buffers)
    assert pp.test == "pp8" and pp.ttft_ms > 0 and pp.itl_p50_ms is None and pp.roof_pct is None
    assert tg.test == "tg4" and tg.ttft_ms is None and tg.itl_p50_ms > 0 and tg.roof_pct > 0
    # %roof: weights (+ KV) streamed per step at the measured rate, over 10 GB/s.
    assert tg.roof_pct == pytest.approx(100 * tg.tok_s * (tg.weight_bytes + 3.0 * 2 * 2 * 2 * 16 * 4) / 10e9, rel=1e-6)

    # No -t: the engine's default, named as such, with the count it picked and why.
    from llmsys.kernels.common.cpus import usable_cpus

    assert all(r.threads_auto and 1 <= r.threads <= len(usable_cpus()) for r in result.rows)
    assert all("-t auto" in r.command for r in result.rows)
    md = report.render(result, "md")
    assert "machine:" in md and "| pp8 |" in md and "| tg4 |" in md and "t/s" in md
    assert f"| {pp.threads} (auto) |" in md
    data = json.loads(report.render(result, "json"))
    assert data["machine"]["bandwidths"]["mem_gbps"] == 10.0 and len(data["rows"]) == 2
    assert data["rows"][0]["test"] == "pp8" and data["rows"][0]["machine"]["cpu_threads"] >= 1
    lines = report.render(result, "jsonl").splitlines()
    assert [json.loads(x)["test"] for x in lines] == ["pp8", "tg4"]
    rows = list(csv.DictReader(io.StringIO(report.render(result, "csv"))))
    assert len(rows) == 2 and float(rows[1]["tok_s"]) == pytest.approx(tg.tok_s)
    assert rows[0]["machine.cpu_model"] == machine.cpu_model and "machine.bandwidths.mem_gbps" in rows[0]


def test_failing_config_becomes_an_error_row(tiny, machine):
    spec = _spec(tiny, tests=[TestSpec(0, 2)], repetitions=1, e2e=False,
                 configs=[LoadConfig(dtype="float32"), LoadConfig(dtype="float32", quant="bogus-format")])
    ok, bad = run_bench(spec, machine).rows
    assert ok.error is None and ok.tok_s > 0
    assert bad.error and bad.tok_s is None and "bogus-format" in bad.error


def test_cli_verbose_names_each_configs_kernels(tiny, capsys):
    """--verbose: one stderr line per loaded configuration with its quantized layers' kernels."""
    from llmsys.kernels import quant_matmul_support

    rc = main(["bench", str(tiny), "-p", "0", "-n", "2", "-r", "1", "--quant", "none,int8", "--dtype", "float32",
               "--no-e2e", "--no-warmup", "-o", "jsonl", "--verbose"])
    assert rc == 0
    lines = [x for x in capsys.readouterr().err.splitlines() if x.startswith("kernels: ")]
    c = quant_matmul_support()
    int8 = f"C int8 a8 {c.level}" if c.available else "torch int8pack_mm, dequant + bf16 GEMM prefill"
    assert lines[0] == "kernels: dtype float32, quant none, kv auto: no quantized layers", lines
    assert lines[1].startswith(f"kernels: dtype float32, quant int8, kv auto: {int8} x "), lines


def test_cli_sweep_2x2_gives_4_rows_and_plot(tiny, tmp_path, capsys):
    png = tmp_path / "tp.png"
    rc = main([
        "bench", str(tiny), "-p", "0", "-n", "3", "-r", "1", "-b", "1,2", "--dtype", "float32,bfloat16",
        "--no-e2e", "--no-warmup", "-o", "jsonl", "--plot", str(png),
    ])
    assert rc == 0
    rows = [json.loads(x) for x in capsys.readouterr().out.splitlines()]
    assert len(rows) == 4
    assert {(r["batch"], r["dtype"]) for r in rows} == {(1, "float32"), (2, "float32"), (1, "bfloat16"), (2, "bfloat16")}
    assert all(r["error"] is None and r["tok_s"] > 0 for r in rows)
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_cli_layers_cuts_a_synthetic_shape(tiny, capsys):
    """--layers N: the shape at full width with its first N layers; the row and its command say so."""
    from llmsys.engine.bench.synthetic import synthetic_dir

    rc = main(["bench", "--synthetic", "smollm2-135m", "--layers", "1", "-p", "4", "-n", "0", "-r", "1",
               "--dtype", "float32", "--no-e2e", "--no-warmup", "-o", "jsonl"])
    assert rc == 0
    (row,) = [json.loads(x) for x in capsys.readouterr().out.splitlines()]
    assert row["error"] is None and row["model"] == "synthetic smollm2-135m (1 of 30 layers)"
    assert "--synthetic smollm2-135m --layers 1" in row["command"]
    cfg = json.loads((synthetic_dir("smollm2-135m-1l") / "config.json").read_text())
    assert cfg["num_hidden_layers"] == 1 and cfg["hidden_size"] == 576  # full width
    for argv, said in ((["--synthetic", "smollm2-135m", "--layers", "31"], "smollm2-135m has 30 layers"),
                       ([str(tiny), "--layers", "2"], "--layers cuts a --synthetic shape")):
        assert main(["bench", *argv, "-p", "4", "-n", "0", "-r", "1"]) == 2
        assert said in capsys.readouterr().err


def test_cli_cpu_moe_flags_reach_the_engine(tmp_path, capsys):
    """--cpu-moe / --n-cpu-moe N fold into EngineConfig.cpu_moe as for run (was passed through raw: True = 1)."""
    moe = make_hf_model("qwen3_moe", tmp_path / "moe", seed=0)
    for flags, said in ((["--cpu-moe"], "--cpu-moe"), (["--n-cpu-moe", "1"], "--n-cpu-moe 1")):
        rc = main(["bench", str(moe), "-p", "4", "-n", "2", "-r", "1", "--dtype", "float32", "--no-e2e",
                   "--no-warmup", "-o", "jsonl", *flags])
        assert rc == 0
        (row,) = [json.loads(x) for x in capsys.readouterr().out.splitlines() if x.startswith("{")][-1:]
        assert row["error"] is None and row["command"].endswith(said), row["command"]


def test_plot_lines(tiny, machine, tmp_path):
    spec = _spec(tiny, tests=[TestSpec(0, 2)], repetitions=1, e2e=False, batches=[1, 2], threads=[1, 2])
    result = run_bench(spec, machine)
    labels = report.plot(result, tmp_path / "p.png")
    # x = batch; one line per remaining varying axis value (threads)
    assert labels == ["tg2 threads=1", "tg2 threads=2"]
    assert (tmp_path / "p.png").stat().st_size > 1000


def test_vs_transformers_adds_ratio(tiny, machine):
    spec = _spec(tiny, tests=[TestSpec(8, 0), TestSpec(0, 3)], repetitions=1, e2e=False, vs=["transformers"])
    for r in run_bench(spec, machine).rows:
        f = r.baselines["transformers"]
        assert f.error is None and f.tok_s > 0
        assert f.ratio == pytest.approx(r.tok_s / f.tok_s)
    md = report.to_markdown(run_bench(spec, machine))
    assert "transformers t/s" in md and "x transformers" in md


def test_synthetic_model_matches_transformers(tmp_path):
    from transformers import AutoModelForCausalLM

    from llmsys import LLM, SamplingParams
    from llmsys.engine.bench.synthetic import make_synthetic, param_count, synthetic_config, synthetic_names

    assert {"smollm2-135m", "qwen2.5-0.5b", "llama-1b", "llama-8b"} <= set(synthetic_names())
    cfg = synthetic_config("smollm2-135m")
    assert param_count(cfg) == 134_515_008  # SmolLM2-135M, counted on the meta device
    # A cut-down copy of the shape keeps the test fast; same code path.
    small = dict(cfg, num_hidden_layers=2, hidden_size=128, intermediate_size=256, num_attention_heads=4,
                 num_key_value_heads=2, head_dim=32, vocab_size=1000)
    path = make_synthetic("small", seed=3, root=tmp_path, config=small)
    assert make_synthetic("small", seed=3, root=tmp_path, config=small) == path  # cached
    llm = LLM(str(path), dtype="float32", kv_cache_tokens=64, progress=False)
    assert llm.tokenizer.encode(llm.tokenizer.decode([17, 300, 999])) == [17, 300, 999]
    hf = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32)
    assert sum(p.numel() for p in hf.parameters()) == param_count(small)
    ids = [20, 21, 22, 23]
    with torch.inference_mode():
        ref = hf.generate(torch.tensor([ids]), max_new_tokens=3, do_sample=False)[0, 4:].tolist()
    ours = llm.generate([ids], SamplingParams(max_tokens=3, temperature=0, ignore_eos=True))[0].token_ids
    assert ours == ref  # both engines read the same weights


def test_bandwidths_cached(tmp_path, monkeypatch):
    monkeypatch.setenv("LLMSYS_HOME", str(tmp_path))
    bw = measure_bandwidths(cache=True)
    assert bw.mem_gbps > 0.1 and bw.disk_read_gbps > 0.001 and bw.mem_copy_gbps > 0.1
    assert bw.h2d_gbps is None if not torch.cuda.is_available() else bw.h2d_gbps > 0
    data = json.loads((tmp_path / "machine.json").read_text())
    assert data["host"]["mem_gbps"] == bw.mem_gbps
    (disk,) = data["disks"].values()  # the disk figure, with where it was measured
    assert disk["gbps"] == bw.disk_read_gbps and disk["folder"] == bw.disk_probe_dir == str(tmp_path / "offload")
    assert measure_bandwidths(cache=True) == bw  # second call reads the cache

    assert bw.cpu_gflops["float32"] > 0  # the planner's GEMM rates come from the same measurement
    assert bandwidth.measure_bandwidths(cache=True) == bw  # the planner reads bench's record: one cache
    assert machine_info(bandwidths=bw).bandwidths is bw
    monkeypatch.setattr(bandwidth, "others_cpu_seconds", lambda: 0.0)  # a busy machine's probe is not cached
    info = machine_info().bandwidths  # bench adds the kernel probe's figures to the same record
    assert info.kernels is not None and replace(info, kernels=None) == bw
    assert measure_bandwidths(cache=True) == info  # which every later reader (an engine start too) gets


def test_a_thread_count_past_the_cpus_is_clamped_as_run_clamps_it(tiny, machine):
    """-t 100000 ran torch with 100000 threads; the row now says what ran: the CPUs present."""
    from llmsys.kernels.common.cpus import usable_cpus

    result = run_bench(_spec(tiny, tests=[TestSpec(0, 2)], repetitions=1, threads=[100000]), machine)
    (row,) = result.rows
    assert row.error is None and row.threads == len(usable_cpus()) and row.threads_auto is None
    assert "-t 100000" in row.command
