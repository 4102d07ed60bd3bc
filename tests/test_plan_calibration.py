"""The planner's calibration: each stored weight format's cost probed on the real kernels, cached in the one
machine record under a key that changes with the ISA level and the kernel build, and the plan's cost model
reading it (faster kernels, faster predictions; bigger models and prompts, slower). No timing asserts."""

from __future__ import annotations

import json
import sys
from dataclasses import replace

import pytest
import torch

from conftest import SHARED, need_shared
from llmsys.offload import bandwidth, kernel_probe
from llmsys.offload.bandwidth import Bandwidths, FormatCost, KernelCosts, MachineRecord, ProbeSettings
from llmsys.offload.budgets import Budgets
from llmsys.offload.plan import ModelShape, UnitShape, Workload, calibration_of, plan_placement

MiB = 1 << 20
TINY = ProbeSettings(mem_bytes=2 << 20, disk_bytes=1 << 20, gemm_mnk=(4, 64, 64), repeat=1, threads=1,
                     kernel_bytes=64 << 10, kernel_shape=(64, 256), kernel_rows=4)
SMOLLM2_GGUF = SHARED / "models" / "smollm2-135m-instruct" / "SmolLM2-135M-Instruct.Q4_1.gguf"
BW = Bandwidths(mem_gbps=20.0, disk_read_gbps=1.0, cpu_gflops={"float32": 100.0, "bfloat16": 400.0})


@pytest.fixture
def home(tmp_path, monkeypatch):
    """A private $LLMSYS_HOME and a quiet machine as far as the probes can tell (the busy rule is tested in
    test_bench_checks; here it would make caching depend on what else runs)."""
    monkeypatch.setenv("LLMSYS_HOME", str(tmp_path))
    monkeypatch.setattr(bandwidth, "others_cpu_seconds", lambda: 0.0)
    return tmp_path


def _costs(**per_format: tuple[float, float]) -> KernelCosts:
    """Kernel costs with (decode GB/s, GFLOP/s) per format."""
    return KernelCosts({"isa": "test"}, {f: FormatCost(1e-9 / gbps, 1e-9 / gflops, 1e-5, bpw, "test")
                                         for f, (gbps, gflops, bpw) in per_format.items()})


def _shape(layers: int = 4, params: int = 4_000_000, fmt: str = "int4", bpw: float = 0.6) -> ModelShape:
    f = ((fmt, 1.0),)
    us = tuple(UnitShape(f"layers.{i}", "layer", int(params * bpw), params, formats=f) for i in range(layers))
    head = UnitShape("embed+lm_head", "head", int(8_000_000 * bpw), 8_000_000, formats=f)
    return ModelShape(us, None, head, 512, 1536, 16000, 256.0, torch.bfloat16)


def _plan(shape: ModelShape, bw: Bandwidths, **work):
    return plan_placement(shape, Budgets(cpu=8 << 30), bw, Workload(kv_tokens=256, **work))


# -- the record --------------------------------------------------------------------------------------------


def test_kernel_costs_round_trip_through_the_machine_record():
    costs = _costs(int4=(20.0, 300.0, 0.59), bfloat16=(25.0, 900.0, 2.0))
    host = Bandwidths(mem_gbps=12.5, disk_read_gbps=None, cpu_gflops={"float32": 50.0})
    rec = MachineRecord({"cpu_model": "x"}, host, {}, 1.0, costs)
    back = MachineRecord.from_json(rec.to_json())
    assert back == rec and back.kernels.cost("int4") == costs.formats["int4"]
    assert json.loads(rec.to_json())["host"]["kernels"] is None  # kept once, beside the host figures
    # A record written before kernel costs existed still reads (no kernels).
    raw = json.loads(rec.to_json())
    del raw["kernels"], raw["host"]["kernels"]
    assert MachineRecord.from_json(json.dumps(raw)).kernels is None


def test_probe_is_cached_and_redone_when_the_kernel_key_changes(home, monkeypatch):
    calls = []
    real = kernel_probe.probe_kernels
    monkeypatch.setattr(kernel_probe, "probe_kernels", lambda probe: calls.append(probe) or real(probe))
    first = bandwidth.measure_bandwidths(probe=TINY, kernels=True)
    assert len(calls) == 1 and first.kernels is not None
    assert first.kernels.key == bandwidth.kernel_key(TINY.threads)
    assert bandwidth.read_record().kernels == first.kernels  # in the one record, beside the host figures
    again = bandwidth.measure_bandwidths(probe=TINY, kernels=True)
    assert len(calls) == 1 and again.kernels == first.kernels
    # An engine start (kernels=False) reads the cached figures without probing.
    assert bandwidth.measure_bandwidths(probe=TINY).kernels == first.kernels and len(calls) == 1

    # Another ISA level / kernel build: the cached figures no longer apply; a start uses none, plan re-probes.
    key = bandwidth.kernel_key(TINY.threads)
    monkeypatch.setattr(bandwidth, "kernel_key", lambda threads: {**key, "isa": "x86-64-v2", "threads": threads})
    assert bandwidth.measure_bandwidths(probe=TINY).kernels is None and len(calls) == 1
    redone = bandwidth.measure_bandwidths(probe=TINY, kernels=True)
    assert len(calls) == 2 and redone.kernels.key["isa"] == "x86-64-v2"
    assert bandwidth.read_record().kernels.key["isa"] == "x86-64-v2"
    # Other probe threads are another key as well.
    bandwidth.measure_bandwidths(probe=replace(TINY, threads=2), kernels=True)
    assert len(calls) == 3


def test_kernel_key_names_the_level_and_build_in_use():
    from llmsys.kernels import cpu_kernels

    key = bandwidth.kernel_key(3)
    ck = cpu_kernels()
    assert key["isa"] == ck.level and key["threads"] == 3 and key["torch"] == torch.__version__
    loaded = [s for s in ck.kernels.values() if s.startswith("ok:")]
    assert len(key["builds"]) == len({s.rsplit("/", 1)[-1] for s in loaded})
    assert all(ck.level in b for b in key["builds"])  # the build's file name carries its level (and hash)


def test_busy_kernel_probe_is_used_but_not_cached(home, monkeypatch):
    clock = iter(range(10_000))
    monkeypatch.setattr(bandwidth, "LOAD_MIN_SECONDS", 0.0)
    bandwidth.measure_bandwidths(probe=TINY)  # a quiet host record first
    monkeypatch.setattr(bandwidth, "others_cpu_seconds", lambda: 5.0 * next(clock))
    busy = bandwidth.measure_bandwidths(probe=TINY, kernels=True)
    assert busy.kernels is not None and busy.kernels.probe_load > bandwidth.BUSY_PROBE_LOAD
    assert bandwidth.read_record().kernels is None


# -- the probe ---------------------------------------------------------------------------------------------


def test_probe_times_every_format_the_planner_can_name(home):
    """Every format a GGUF keeps or a --quant method makes has a probed figure (or a stand-in probed with the
    same kernel), taken from the layer the engine builds for it: the kernel named is that layer's."""
    from llmsys.engine.loader.gguf_io import KEPT_FORMATS
    from llmsys.offload.prepare import QUANT_FORMATS
    from llmsys.quant import Int4Linear

    costs = kernel_probe.probe_kernels(TINY)
    named = set(KEPT_FORMATS.values()) | set(QUANT_FORMATS.values()) | {"float32", "bfloat16"}
    assert all(costs.cost(f) is not None for f in named), named - set(costs.formats)
    for f, c in costs.formats.items():
        assert c.s_per_byte > 0 and c.s_per_flop >= 0 and c.call_s > 0 and c.bytes_per_weight > 0, f
    assert costs.formats["int4"].kernel == Int4Linear.from_float(torch.randn(64, 256)).kernel.name
    # Stored bytes per weight as the layers hold them: int4 codes below int8's, int8 below bf16's.
    assert costs.formats["int4"].bytes_per_weight < costs.formats["int8"].bytes_per_weight < 2.0
    assert costs.formats["bfloat16"].bytes_per_weight == 2.0 and costs.formats["float32"].bytes_per_weight == 4.0


# -- the cost model ----------------------------------------------------------------------------------------


def test_plan_uses_the_calibrated_figure_of_its_format():
    shape = _shape()
    slow = replace(BW, kernels=_costs(int4=(10.0, 100.0, 0.6)))
    fast = replace(BW, kernels=_costs(int4=(40.0, 100.0, 0.6)))
    other = replace(BW, kernels=_costs(int4=(10.0, 100.0, 0.6), int8=(100.0, 1000.0, 1.0)))
    p_slow, p_fast, p_other = _plan(shape, slow), _plan(shape, fast), _plan(shape, other)
    assert p_fast.decode_ms < p_slow.decode_ms  # a faster int4 kernel predicts faster decode
    assert p_other.decode_ms == pytest.approx(p_slow.decode_ms)  # another format's figure does not matter
    # Decode reads every weight once: the int4 figure per byte over the matrices' bytes (one row).
    c = slow.kernels.formats["int4"]
    weights = sum(u.params for u in shape.layers) + shape.head.params
    want = weights * c.bytes_per_weight * c.s_per_byte
    kv = p_slow.resources_ms["compute"] / 1000 - want  # the rest: the KV reads, from RAM
    assert 0 <= kv < 0.05 * want
    # Prefill: the further rows' figure; a faster one predicts a faster prompt, decode barely moves.
    quick = replace(BW, kernels=_costs(int4=(10.0, 400.0, 0.6)))
    assert _plan(shape, quick).prefill_ms < p_slow.prefill_ms
    assert calibration_of(shape, slow).calibrated and calibration_of(shape, slow).formats == (("int4", c),)


def test_calibrated_cost_is_monotone():
    bw = replace(BW, kernels=_costs(int4=(20.0, 200.0, 0.6)))
    by_layers = [_plan(_shape(layers=n), bw).decode_ms for n in (2, 4, 8, 16)]
    assert by_layers == sorted(by_layers) and by_layers[0] < by_layers[-1]
    by_params = [_plan(_shape(params=p), bw).decode_ms for p in (1_000_000, 4_000_000, 16_000_000)]
    assert by_params == sorted(by_params) and by_params[0] < by_params[-1]
    by_prompt = [_plan(_shape(), bw, prompt_len=n).prefill_ms for n in (16, 64, 256, 1024)]
    assert by_prompt == sorted(by_prompt) and by_prompt[0] < by_prompt[-1]
    by_batch = [_plan(_shape(), bw, batch=b).decode_ms for b in (1, 4, 16)]
    assert by_batch == sorted(by_batch) and by_batch[0] < by_batch[-1]


def test_ram_bounds_a_kernel_faster_than_memory():
    """A figure probed in cache never predicts reading a model faster than RAM delivers it."""
    shape = _shape(params=40_000_000)
    blazing = replace(BW, mem_gbps=5.0, kernels=_costs(int4=(1000.0, 1e6, 0.6)))
    nbytes = sum(u.nbytes for u in shape.layers) + shape.head.nbytes
    assert _plan(shape, blazing).decode_ms >= 1000 * nbytes / 5e9


def test_without_a_figure_the_roofline_stands_in():
    shape = _shape(fmt="nf4")
    roof = _plan(shape, BW)
    other = replace(BW, kernels=_costs(int4=(1.0, 1.0, 0.6)))  # no nf4 figure
    assert _plan(shape, other).decode_ms == pytest.approx(roof.decode_ms)
    assert not calibration_of(shape, other).calibrated


# -- formats from the model --------------------------------------------------------------------------------


def test_gguf_parts_carry_their_stored_formats():
    need_shared(SMOLLM2_GGUF)
    from llmsys.engine.loader import gguf_io
    from llmsys.engine.loader.detect import detect_model

    src = detect_model(SMOLLM2_GGUF)
    cfg = gguf_io.hf_config(src.path, src.gguf_header)
    wb = gguf_io.GGUFIndex(src.path, src.gguf_header, cfg).weight_bytes(torch.bfloat16)
    assert wb.layer_formats == (("int4+offset", 1.0),)  # Q4_1 layers kept as int4 codes with offsets
    assert wb.embed_formats == wb.head_formats == (("int8:g32", 1.0),)  # the Q8_0 tied table


def test_quant_method_names_every_matrix_format():
    from llmsys.engine.cli.plan_cmd import meta_model
    from llmsys.offload.prepare import shape_of
    from tiny_models import ARCH_CONFIGS, TINY

    model = meta_model(dict(TINY, **ARCH_CONFIGS["llama"], architectures=["LlamaForCausalLM"]))
    shape = shape_of(model, torch.bfloat16, "int8")
    assert all(u.formats == (("int8", 1.0),) for u in (*shape.layers, shape.head))
    assert shape_of(model, torch.bfloat16).layers[0].formats == ()  # the dtype's: bfloat16


# -- the RAM probe's size ----------------------------------------------------------------------------------


def test_ram_probe_is_sized_from_the_memory_left(monkeypatch):
    from llmsys.offload import memcap

    monkeypatch.setattr(memcap, "own_cgroup_room", lambda: 64 * MiB)
    assert bandwidth.mem_probe_bytes() == bandwidth.MIN_MEM_PROBE_BYTES  # a tight cgroup: the floor
    monkeypatch.setattr(memcap, "own_cgroup_room", lambda: 1 << 30)
    assert bandwidth.mem_probe_bytes() == min(bandwidth.MEM_PROBE_BYTES, (1 << 30) // bandwidth.MEM_PROBE_SHARE)
    monkeypatch.setattr(memcap, "own_cgroup_room", lambda: None)
    assert bandwidth.mem_probe_bytes(32 * MiB) == 32 * MiB  # never above what was asked


CAPPED_PROBE = r"""
from llmsys.offload import bandwidth, memcap
room = memcap.own_cgroup_room()
host = bandwidth.probe_host(bandwidth.DEFAULT_PROBE)
print(room, bandwidth.mem_probe_bytes(), host.mem_gbps)
"""


def test_host_probe_runs_in_a_small_cgroup():
    """Two 256 MiB buffers in a 400 MiB cgroup (python, torch and llmsys take ~160 MiB of it) were killed;
    sized from the cgroup's room they fit."""
    from llmsys.offload.memcap import run_capped, unavailable_reason

    why = unavailable_reason()
    if why:
        pytest.skip(f"cannot create a memory cgroup here: {why}")
    cap = 400 * MiB
    r = run_capped([sys.executable, "-c", CAPPED_PROBE], cap, timeout=300)
    assert r.returncode == 0, f"rc {r.returncode}, oom {r.oom_killed}: {r.stderr[-600:]}"
    room, size, gbps = r.stdout.split()
    assert 0 < int(room) < cap and int(size) <= max(int(room) // bandwidth.MEM_PROBE_SHARE,
                                                   bandwidth.MIN_MEM_PROBE_BYTES)
    assert float(gbps) > 0


def test_a_zero_gflops_figure_counts_as_missing():
    """A probe under emulation rounds a slow dtype's GEMM to 0.0 GFLOP/s; the planner divides by the figure,
    so 0 falls back to the slowest other dtype's (or the default), never to 0."""
    from llmsys.offload.bandwidth import Bandwidths

    bw = Bandwidths(mem_gbps=10.0, disk_read_gbps=1.0, cpu_gflops={"bfloat16": 0.0, "float32": 2.0})
    assert bw.cpu_flops(torch.bfloat16) == 2e9 and bw.cpu_flops(torch.float32) == 2e9
    assert Bandwidths(mem_gbps=10.0, disk_read_gbps=1.0, cpu_gflops={"bfloat16": 0.0}).cpu_flops(torch.bfloat16) == 20e9
