"""Offloading: the planner, the reader ring, and identical tokens per placement kind."""

from __future__ import annotations

import os
import re
from pathlib import Path

import pytest
import torch

from llmsys.kernels.common.errors import BudgetError
from llmsys.offload.bandwidth import Bandwidths
from llmsys.offload.budgets import Budgets
from llmsys.offload.plan import UnitShape, ModelShape, Workload, plan_placement, spread
from llmsys.offload.report import format_plan
from llmsys.offload.streamer import ReaderRing, StreamItem, StreamUnit, TensorSource
from tiny_models import make_hf_model

MiB = 1 << 20
BW = Bandwidths(mem_gbps=10.0, disk_read_gbps=2.0, cpu_gflops={"float32": 50.0, "bfloat16": 50.0})
SMALL = dict(num_hidden_layers=6, hidden_size=256, intermediate_size=512, num_attention_heads=4, num_key_value_heads=2)


@pytest.fixture(autouse=True, scope="module")
def _home(tmp_path_factory):
    """One private $LLMSYS_HOME for the module: the bandwidth probe runs once, not per test."""
    old = os.environ.get("LLMSYS_HOME")
    os.environ["LLMSYS_HOME"] = str(tmp_path_factory.mktemp("home"))
    yield
    if old is None:
        os.environ.pop("LLMSYS_HOME", None)
    else:
        os.environ["LLMSYS_HOME"] = old


def _shape(n=8, layer=30 * MiB, head=260 * MiB, tied=True) -> ModelShape:
    layers = tuple(UnitShape(f"layers.{i}", "layer", layer, layer // 2) for i in range(n))
    head_u = UnitShape("embed+lm_head" if tied else "lm_head", "head", head, head // 2)
    embed = None if tied else UnitShape("embed", "embed", head, 0)
    return ModelShape(layers, embed, head_u, 896, 4864, 151936, 12288 // 24, torch.bfloat16)


# -- planner -------------------------------------------------------------------


def test_everything_resident_when_it_fits():
    plan = plan_placement(_shape(), Budgets(cpu=8 << 30), BW, Workload(kv_tokens=1024))
    assert not plan.needs_streaming
    assert plan.layer_kinds() == ["cpu"] * 8 and plan.head.kind == "cpu"
    assert plan.bound == "compute"


def test_tight_budget_streams_within_budget_and_spreads_resident_layers():
    budget = 256 * MiB
    plan = plan_placement(_shape(), Budgets(cpu=budget, cpu_explicit=True), BW, Workload(kv_tokens=1024, max_batched_tokens=64), max_seqs=4)
    kinds = plan.layer_kinds()
    assert plan.head.kind == "disk"  # 260 MiB cannot be resident in 256 MiB
    assert plan.used("cpu") <= budget
    assert 0 < kinds.count("cpu") < 8
    # Spread: the rarer kind never sits next to itself (resident compute overlaps streamed reads).
    rare = min(("cpu", "disk"), key=kinds.count)
    assert not any(kinds[i] == kinds[i - 1] == rare for i in range(1, 8)), kinds
    assert plan.bound == "disk read"
    assert plan.decode_ms == pytest.approx(plan.resources_ms["disk read"])
    text = format_plan(plan)
    assert "disk, streamed" in text and "bound by disk read" in text


def test_more_budget_is_never_slower():
    ms = [plan_placement(_shape(), Budgets(cpu=b * MiB), BW, Workload(kv_tokens=256, max_batched_tokens=64), max_seqs=1).decode_ms
          for b in (160, 256, 400, 700)]
    assert ms == sorted(ms, reverse=True) and ms[0] > ms[-1]


def test_budget_too_small_fails_up_front_with_the_minimum():
    with pytest.raises(BudgetError, match=r"at least [0-9.]+ MiB"):
        plan_placement(_shape(), Budgets(cpu=40 * MiB, cpu_explicit=True), BW, Workload(kv_tokens=256))


def test_gpu_planner_prefers_streaming_to_gpu_at_large_batch():
    """Batch 1: CPU compute of a RAM-resident layer is memory-bound and competes with PCIe;
    batch 64: the CPU becomes compute-bound and streaming to the GPU wins."""
    bw = Bandwidths(mem_gbps=50.0, disk_read_gbps=3.0, h2d_gbps=20.0, gpu_mem_gbps=2000.0,
                    cpu_gflops={"bfloat16": 500.0}, gpu_gflops={"bfloat16": 200_000.0})
    shape = _shape(n=32, layer=416 * MiB, head=1000 * MiB, tied=False)
    b = Budgets(cpu=32 << 30, gpu=4 << 30, cpu_explicit=True, gpu_explicit=True)
    big = plan_placement(shape, b, bw, Workload(batch=64, kv_tokens=4096, max_batched_tokens=512), max_seqs=64)
    small = plan_placement(shape, b, bw, Workload(batch=1, kv_tokens=4096, max_batched_tokens=512), max_seqs=1)
    assert big.layer_kinds().count("cpu->gpu") > small.layer_kinds().count("cpu->gpu")
    assert small.layer_kinds().count("cpu") > 0
    for p in (big, small):
        assert p.used("gpu") <= 4 << 30 and p.layer_kinds().count("gpu") > 0


def test_spread_interleaves():
    assert spread({"cpu": 2, "disk": 4}) == ["disk", "cpu", "disk", "disk", "cpu", "disk"]


# -- reader ring ---------------------------------------------------------------


def test_reader_ring_reads_exact_bytes_in_order_and_skips(tmp_path):
    data = torch.arange(10_000, dtype=torch.float32)
    f = tmp_path / "blob.bin"
    f.write_bytes(data.numpy().tobytes())
    units = []
    for u in range(3):  # unit u: two adjacent tensors (coalesced into one preadv) + one elsewhere
        a = u * 1000
        items = [StreamItem(torch.float32, (10, 10), TensorSource(str(f), a * 4, 400)),
                 StreamItem(torch.float32, (50,), TensorSource(str(f), (a + 100) * 4, 200)),
                 StreamItem(torch.float32, (7,), TensorSource(str(f), 9000 * 4 + u * 28, 28))]
        units.append(StreamUnit(f"u{u}", items))
    assert len(units[0].reads) == 2  # adjacent tensors coalesced
    ring = ReaderRing(units, slots=2)
    try:
        for _ in range(3):  # three cycles; the ring wraps around
            for u in range(3):
                a = u * 1000
                w, b, c = ring.acquire(u)
                assert torch.equal(w.flatten(), data[a : a + 100]) and torch.equal(b, data[a + 100 : a + 150])
                assert torch.equal(c, data[9000 + u * 7 : 9007 + u * 7])
                ring.release(u)
        ring.acquire(2)  # skipping units 0 and 1 still delivers unit 2
        ring.release(2)
        assert ring.stats.units_skipped == 2
    finally:
        ring.close()


def test_reader_ring_surfaces_read_errors(tmp_path):
    f = tmp_path / "short.bin"
    f.write_bytes(b"\0" * 100)
    ring = ReaderRing([StreamUnit("u", [StreamItem(torch.uint8, (1000,), TensorSource(str(f), 0, 1000))])])
    try:
        with pytest.raises(OSError, match="unexpected end of file"):
            ring.acquire(0)
    finally:
        ring.close()


# -- end to end: identical greedy tokens per placement kind ---------------------


@pytest.fixture(scope="module")
def tiny_untied(tmp_path_factory):
    return make_hf_model("llama", tmp_path_factory.mktemp("m") / "llama", **SMALL)


@pytest.fixture(scope="module")
def tiny_tied(tmp_path_factory):
    return make_hf_model("qwen2", tmp_path_factory.mktemp("m") / "qwen2", **SMALL)


_REFS: dict[tuple[str, str], tuple[list[list[int]], list[list[float]]]] = {}


def _ref(path: Path, dtype="float32") -> list[list[int]]:
    """The all-resident run's tokens (cached: one per model and dtype)."""
    return _ref_full(path, dtype)[0]


def _ref_full(path: Path, dtype="float32") -> tuple[list[list[int]], list[list[float]]]:
    key = (str(path), dtype)
    if key not in _REFS:
        llm, toks = _run(path, dtype)
        _REFS[key] = (toks, llm.last_logprobs)
    return _REFS[key]


def _run(path: Path, dtype="float32", **kw):
    from llmsys import LLM, SamplingParams

    # Threads pinned: the default counts idle cores, and the reference and the offloaded run must
    # reduce in the same order to give the same bits even when another program makes a core busy.
    llm = LLM(str(path), dtype=dtype, device="cpu", kv_cache_tokens=256, max_num_batched_tokens=64, max_num_seqs=4,
              progress=False, threads=2, **kw)
    prompts = [[5, 17, 99, 200, 31, 7, 8], [300, 12, 4]]
    sp = SamplingParams(max_tokens=10, temperature=0, ignore_eos=True, logprobs=0)
    # Batched (M = 2 rows per step) and alone (M = 1): oneDNN's float32 bits for a packed
    # and a plain weight differ only at M = 1, so both must be covered.
    outs = llm.generate(prompts, sp) + llm.generate([[42, 9, 77]], sp)
    llm.last_logprobs = [[lp.logprob for lp in o.logprobs] for o in outs]  # the logits' bits, in effect
    return llm, [o.token_ids for o in outs]


PLACEMENTS = {
    "all-disk": {"disk": 6},
    "mixed+head-disk": {"cpu": 2, "disk": 4, "head": "disk"},
    "disk+embed-disk": {"cpu": 1, "disk": 5, "head": "disk", "embed": "disk"},
    "cpu-resident": {"cpu": 6, "head": "cpu"},
}


@pytest.mark.parametrize("kind", list(PLACEMENTS))
def test_greedy_tokens_identical_per_placement(kind, tiny_untied, tiny_tied):
    force = PLACEMENTS[kind]
    for path in (tiny_untied, tiny_tied):
        if "embed" in force and path is tiny_tied:
            continue  # tied: the embedding is the head's tensor
        ref, ref_lps = _ref_full(path)
        llm, got = _run(path, cpu_mem="64MiB", placement=force)
        assert got == ref, f"{kind} on {path.name}"
        # Stronger than equal tokens: bit-identical logprobs, i.e. the streamed and
        # resident layers (and a chunked head) compute the same float32 bits.
        assert llm.last_logprobs == ref_lps, f"{kind} on {path.name}: logprobs differ"
        assert llm.plan.layer_kinds().count("disk") == force.get("disk", 0)
        rep = llm.memory_report()
        streamed = llm.plan.disk_bytes_per_step
        if force.get("disk"):
            assert rep.weights["disk"] >= streamed > 0 and rep.staging["cpu"] > 0
            assert llm.offload.ring.stats.bytes_read >= streamed  # really read from disk
            assert rep.weights.get("cpu", 0) + rep.staging["cpu"] + sum(rep.kv_total.values()) <= 64 * MiB


def test_dtype_conversion_streams_from_an_offload_file(tiny_untied, tmp_path):
    """float32 checkpoint run in bfloat16: streamed layers are written once, converted, to --offload-dir."""
    ref = _ref(tiny_untied, "bfloat16")
    off = tmp_path / "off"
    llm, got = _run(tiny_untied, dtype="bfloat16", cpu_mem="64MiB", offload_dir=str(off),
                    placement={"cpu": 2, "disk": 4, "head": "disk"})
    assert got == ref
    files = list(off.iterdir())
    assert len(files) == 1 and files[0].stat().st_size >= llm.plan.disk_bytes_per_step
    llm.offload.close()
    assert not files[0].exists()  # scratch offload files are removed on close


def test_budget_plans_automatically_and_reports_tiers(tiny_untied):
    ref = _ref(tiny_untied)
    llm, got = _run(tiny_untied, cpu_mem="12MiB")
    assert got == ref
    kinds = llm.plan.layer_kinds()
    assert "disk" in kinds and llm.plan.used("cpu") <= 12 * MiB
    rep = llm.memory_report()
    assert set(rep.weights) >= {"cpu", "disk"}


def test_too_small_budget_fails_before_loading(tiny_untied):
    from llmsys import LLM

    with pytest.raises(BudgetError, match="at least"):
        LLM(str(tiny_untied), dtype="float32", device="cpu", cpu_mem="1MiB", progress=False)


def test_plan_cli_prints_table_and_explains(capsys):
    from llmsys.engine.cli.main import main

    rc = main(["plan", "qwen2.5-0.5b", "--cpu-mem", "256MiB", "--dtype", "bfloat16", "--batch", "4", "--explain"])
    out = capsys.readouterr().out
    assert rc == 0
    assert "embed+lm_head" in out and "disk, streamed" in out and "ms/step" in out
    # Which resource binds depends on this machine's measured speeds (a busy CPU measures slow
    # GEMMs): the explanation must name one.
    assert re.search(r"bound by (disk read|compute)", out) and "runners-up" in out
    rc = main(["plan", "llama-8b", "--gpu-mem", "4GiB", "--cpu-mem", "32GiB", "--dtype", "bfloat16"])
    out = capsys.readouterr().out
    assert rc == 0 and "GPU (resident)" in out and "streamed to GPU" in out


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_fused_projections_match_streamed_layers(tmp_path, dtype):
    """Resident layers run q|k|v and gate|up as one GEMM each (``DecoderModel.fuse_projections``),
    streamed layers run the checkpoint's separate matrices: the same bits (q/k/v biases too)."""
    path = make_hf_model("qwen2", tmp_path / "m", **dict(SMALL, num_key_value_heads=4))  # every part packable
    ref_llm, ref = _run(path, dtype)
    layer = ref_llm.loaded.model.model.layers[0]
    assert layer.self_attn.qkv_proj is not None and layer.self_attn.q_proj is None
    assert layer.mlp.gate_up_proj is not None and layer.mlp.gate_proj is None
    llm, got = _run(path, dtype, cpu_mem="64MiB", placement={"disk": 6})
    assert llm.plan.layer_kinds().count("disk") == 6
    assert got == ref and llm.last_logprobs == ref_llm.last_logprobs


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_page_cache_kept_maps_streamed_layers_in_place(tmp_path, dtype):
    """``keep_page_cache`` on the CPU: streamed tensors are views of the mapped checkpoint
    (``MappedUnits``, no read, no copy), and the answers stay the resident run's bits."""
    from llmsys.offload.streamer import MappedUnits

    path = make_hf_model("qwen2", tmp_path / "m", **SMALL)
    ref_llm, ref = _run(path, dtype)
    llm, got = _run(path, dtype, cpu_mem="64MiB", placement={"cpu": 1, "disk": 5, "head": "disk"},
                    keep_page_cache=True)
    assert isinstance(llm.offload.ring, MappedUnits) and llm.offload.staging_bytes() == {"cpu": 0}
    assert got == ref and llm.last_logprobs == ref_llm.last_logprobs


def test_mapped_units_name_a_truncated_file(tmp_path):
    """A unit that ends past its file (a checkpoint cut short) is refused when the map is built."""
    from llmsys.offload.streamer import MappedUnits, StreamItem, StreamUnit, TensorSource

    f = tmp_path / "w.bin"
    f.write_bytes(bytes(100))
    ok = StreamUnit("layers.0", [StreamItem(torch.float32, (5,), TensorSource(str(f), 40, 20))])
    views = MappedUnits([ok]).acquire(0)
    assert views[0].shape == (5,) and not views[0].any()
    bad = StreamUnit("layers.1", [StreamItem(torch.float32, (10,), TensorSource(str(f), 80, 40))])
    with pytest.raises(OSError, match="layers.1 ends at byte 120, past the end of the file"):
        MappedUnits([bad])
