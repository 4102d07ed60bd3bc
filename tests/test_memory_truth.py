"""Memory figures that are true everywhere.

The KV pool has three sizes (``MemoryReport``): reserved (its bytes), resident (pages written at
least once: the process holds them) and in use (blocks holding live or cached KV). These tests
check that the pool is sized from the context (not from free RAM), that ``llmsys plan`` predicts
the pool the engine makes, that what the report calls resident is what the process's RSS grows by,
and that every view (``memory_report``, ``/metrics``, ``/api/ps``, the chat panel and ``/info``,
the monitor) shows the same numbers for one engine.

The RSS checks read ``/proc/self/status``: the pool's pages are an anonymous shared mapping
(``kernels.common.memory.zeros_on_demand``), so the kernel counts them under ``RssShmem``, apart
from the heap.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
import torch

from conftest import SHARED, STORIES_HF, need_shared
from llmsys.engine.builder import KV_FULL_CONTEXTS, kv_cost_of, kv_pool_tokens, kv_probe, planned_kv
from llmsys.engine.config import EngineConfig
from llmsys.engine.kv_cache import PAGE, BlockAllocator, KVCacheSpec, make_kv_pool
from llmsys.kernels.common.units import format_bytes
from llmsys.offload.budgets import Budgets

ROOT = Path(__file__).resolve().parents[1]
SMOLLM2 = SHARED / "models" / "smollm2-135m-instruct" / "SmolLM2-135M-Instruct.Q4_1.gguf"
MiB = 1 << 20
GiB = 1 << 30


def _status_kib(*keys: str) -> dict[str, int]:
    out = {}
    with open("/proc/self/status") as f:
        for line in f:
            k = line.split(":")[0]
            if k in keys:
                out[k] = int(line.split()[1]) * 1024
    return out


def _need_smollm2() -> Path:
    if not SMOLLM2.exists():
        pytest.skip(f"{SMOLLM2} is absent: the SmolLM2-135M-Instruct Q4_1 GGUF lives in ../shared/models")
    return SMOLLM2


def _tiny_args(max_pos: int = 2048):
    from llmsys.engine.cli.plan_cmd import meta_model

    cfg = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 256, "intermediate_size": 512,
           "num_hidden_layers": 3, "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 1000,
           "max_position_embeddings": max_pos, "rms_norm_eps": 1e-5, "tie_word_embeddings": False}
    return meta_model(cfg).args


# -- the pool's size -------------------------------------------------------------------------------


def test_the_default_pool_is_full_contexts_not_a_share_of_free_ram():
    a = _tiny_args(2048)
    plenty = Budgets(cpu=64 * GiB, gpu=None, offload_dir=None)

    def tokens(budgets=plenty, **kw) -> int:
        c = EngineConfig(model="unused", **kw)
        cost = kv_cost_of(a, c, 2048, kv_probe(a, c, torch.bfloat16).layer_bytes_per_token)
        return kv_pool_tokens(2048, c, cost, budgets)

    # 32 sequences may run, but the pool holds KV_FULL_CONTEXTS full contexts, not 32 (nor 64 GiB / 4 of them)
    assert tokens() == KV_FULL_CONTEXTS * 2048 < 32 * 2048
    assert tokens(max_num_seqs=1) == 2048 and tokens(max_num_seqs=2) == 2 * 2048
    assert tokens(kv_cache_tokens=1000) == 1000  # --kv-cache-tokens is exact
    # little free memory: a quarter of it (3 layers x 2 heads x 64 x 2 x 2 bytes = 1536 bytes a token)
    assert tokens(Budgets(cpu=6 * MiB, gpu=None, offload_dir=None)) == (6 * MiB // 4) // 1536
    # an explicit budget: an eighth of it, at least 512 tokens
    small = Budgets(cpu=12 * MiB, gpu=None, offload_dir=None, cpu_explicit=True)
    assert tokens(small) == (12 * MiB // 8) // 1536
    assert tokens(Budgets(cpu=1 * MiB, gpu=None, offload_dir=None, cpu_explicit=True)) == 512


def test_plan_predicts_the_pool_the_engine_makes():
    """``llmsys plan --json`` on the GGUF: the KV bytes it places are the engine's pool, byte for byte."""
    path = _need_smollm2()
    from llmsys import LLM

    llm = LLM(str(path), progress=False)
    spec = llm.core.kv.spec
    rep = llm.memory_report()
    assert rep.kv_total == {"cpu": spec.nbytes}
    # SmolLM2's 8192-token context, 4 full contexts (was 32, or a quarter of free RAM: 5.6 GiB)
    assert (spec.num_blocks - 1) * spec.block_size == KV_FULL_CONTEXTS * llm.max_model_len == 4 * 8192
    tokens, planner_tokens = planned_kv(llm.loaded.args, llm.config, llm.loaded.dtype,
                                        Budgets(cpu=64 * GiB, gpu=None, offload_dir=None))
    assert tokens == 4 * 8192 and planner_tokens * spec.bytes_per_token == spec.nbytes
    text = subprocess.run([sys.executable, "-m", "llmsys.engine.cli.main", "plan", str(path)],
                          capture_output=True, text=True, timeout=300, cwd=ROOT).stdout
    assert f"KV: {format_bytes(spec.nbytes)} reserved for {spec.num_slots} tokens" in text
    assert f"0 B in use at start; resident at start on cpu: {format_bytes(rep.weights['cpu'])}" in text
    del llm
    # the same flags, the same pool: one context, an explicit size, and a budget (an eighth of it, whole blocks)
    for kw, flags in (({"max_num_seqs": 1}, ["--max-num-seqs", "1"]), ({"kv_cache_tokens": 1000}, ["--kv-cache-tokens", "1000"]),
                      ({"cpu_mem": "1GiB"}, ["--cpu-mem", "1GiB"])):
        out = subprocess.run([sys.executable, "-m", "llmsys.engine.cli.main", "plan", str(path), "--json", *flags],
                             capture_output=True, text=True, timeout=300, cwd=ROOT)
        assert out.returncode == 0, out.stderr
        engine = LLM(str(path), progress=False, **kw)
        assert json.loads(out.stdout)["kv_bytes"] == engine.memory_report().kv_total["cpu"], flags
        del engine


# -- resident: what the process holds ------------------------------------------------------------------


def test_the_allocators_high_water_mark_bounds_the_blocks_written():
    al = BlockAllocator(64)
    a = al.allocate(3)
    assert a == [1, 2, 3] and al.high_water == 3
    al.free(a)
    assert al.allocate(3) == [1, 2, 3] and al.high_water == 3  # freed blocks are reused first: no new pages
    al.register(1, b"k1")
    al.free([1])
    assert al.num_cached == 1 and al.allocate(1) == [4] and al.high_water == 4  # a cached prefix keeps its block


def test_resident_bytes_are_the_pages_rss_grows_by():
    """Write blocks 1..N of a 96 MiB pool: RssShmem grows by ``spec.resident_nbytes(N + 1)`` (to the page)."""
    spec = KVCacheSpec(num_layers=4, num_blocks=2048, block_size=16, num_kv_heads=3, head_dim=64, dtype=torch.bfloat16)
    for written in (5, 300):
        before = _status_kib("RssShmem")["RssShmem"]
        pool = make_kv_pool(spec, torch.device("cpu"))
        k = torch.randn(written * 16, 3, 64).to(torch.bfloat16)
        for layer in range(4):
            pool.store(layer, k, k, torch.arange(16, 16 * (written + 1)))  # blocks 1..written
        grown = _status_kib("RssShmem")["RssShmem"] - before
        want = spec.resident_nbytes(written + 1)
        assert want < spec.nbytes // 4
        # the estimate counts block 0 (scratch) too: at most one block's pages over, per tensor
        slack = 8 * (-(-spec.layer_bytes_per_token * 16 // 2 // PAGE) + 1) * PAGE
        assert want - slack <= grown <= want, (written, grown, want)
        del pool
    # a GPU pool (or any not backed on demand) is resident whole
    assert spec.resident_nbytes(5, on_demand=False) == spec.nbytes


_RSS_SCRIPT = r"""
import json, sys
from llmsys import LLM
from llmsys.engine.sampling import SamplingParams

def status():
    d = {}
    for line in open("/proc/self/status"):
        k = line.split(":")[0]
        if k in ("VmRSS", "RssAnon", "RssFile", "RssShmem"):
            d[k] = int(line.split()[1]) * 1024
    return d

base = status()
llm = LLM(sys.argv[1], progress=False)
sp = SamplingParams(max_tokens=16, temperature=0.0)
# a warm-up request of a full prefill chunk: the heap reaches its working size (activations)
llm.generate([llm.encode(" ".join(f"warm{i} up" for i in range(300)))], sp)
warm, rw = status(), llm.memory_report()
ids = llm.encode(" ".join(f"word{i} and" for i in range(1500)))
llm.generate([ids], sp)
after, ra = status(), llm.memory_report()
print(json.dumps({"base": base, "warm": warm, "after": after, "prompt": len(ids),
                  "warm_resident": rw.resident["cpu"], "warm_kv": rw.kv_resident["cpu"],
                  "resident": ra.resident["cpu"], "weights": ra.weights["cpu"], "kv_resident": ra.kv_resident["cpu"],
                  "kv_in_use": ra.kv_in_use["cpu"], "kv_reserved": ra.kv_total["cpu"]}))
"""


def test_what_the_report_calls_resident_agrees_with_rss():
    """SmolLM2 (Q4_1 GGUF) in a fresh process: an ~8k-token prompt; RSS less the baseline before
    loading and less the runtime (what the process holds beyond the report's buffers, measured after
    a warm-up request) is the weights plus the KV the report calls resident, within 10%; and the
    pool's own pages (RssShmem) are exactly its resident bytes, to the page."""
    path = _need_smollm2()
    out = subprocess.run([sys.executable, "-c", _RSS_SCRIPT, str(path)], capture_output=True, text=True, timeout=600,
                         cwd=ROOT)
    assert out.returncode == 0, out.stderr[-2000:]
    r = json.loads(out.stdout.strip().splitlines()[-1])
    assert r["prompt"] > 6000
    # the pool's pages are the shared anonymous mapping: RssShmem is them alone
    shm = r["after"]["RssShmem"] - r["base"]["RssShmem"]
    assert abs(shm - r["kv_resident"]) <= 60 * PAGE * 2, (shm, r["kv_resident"])  # 30 layers x K,V: a page or two each
    # in use (live + cached prompt blocks) is what was written: the long prompt and the warm-up's, no more
    assert r["kv_in_use"] <= r["kv_resident"] < r["kv_reserved"] / 3
    runtime = r["warm"]["VmRSS"] - r["base"]["VmRSS"] - r["warm_resident"]
    assert 0 < runtime < 200 * MiB, runtime  # the C kernels, tokenizer, heap: not the weights, not KV
    kv_by_rss = r["after"]["VmRSS"] - r["base"]["VmRSS"] - runtime - r["weights"]
    assert abs(kv_by_rss - r["kv_resident"]) <= 0.10 * r["kv_resident"], (kv_by_rss, r["kv_resident"])


# -- every view, one engine ------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def served():
    need_shared(STORIES_HF)
    from llmsys import LLM
    from llmsys.engine.server.serve import start_server_thread
    from llmsys.engine.server.state import ServerSettings, ServerState

    state = ServerState(ServerSettings())
    # a pool big enough to be backed on demand (its per-layer tensors over 1 MiB)
    llm = LLM(str(STORIES_HF), dtype="float32", progress=False, kv_cache_tokens=65536)
    state.attach(llm, "stories-mem")
    srv = start_server_thread(state)
    yield srv, llm
    srv.stop()


def _idle(srv) -> dict[str, float]:
    from llmsys.engine.server.metrics import parse_metrics

    t0 = time.monotonic()
    while True:
        text = httpx.get(srv.url + "/metrics").text
        m = parse_metrics(text)
        if m["llmsys_requests_running"] == 0 and m.get('llmsys_request_finished_total{reason="length"}', 0):
            return text
        assert time.monotonic() - t0 < 30, "the server did not go idle"
        time.sleep(0.05)


def test_metrics_and_ps_say_the_memory_before_any_request(served):
    """A server just started: /metrics has the pool's figures already (not 0 blocks until a first
    step), and /api/ps the same resident bytes."""
    from llmsys.engine.server.metrics import parse_metrics

    srv, llm = served
    m = parse_metrics(httpx.get(srv.url + "/metrics").text)
    rep = llm.core.memory_report()  # idle
    assert m["llmsys_kv_blocks_total"] == rep.kv_blocks_total > 0
    assert m['llmsys_kv_bytes_reserved{tier="cpu"}'] == rep.kv_total["cpu"]
    assert m['llmsys_memory_resident_bytes{tier="cpu"}'] == rep.resident["cpu"]
    (ps,) = httpx.get(srv.url + "/api/ps").json()["models"]
    assert ps["size"] == rep.resident["cpu"]


def test_every_view_shows_the_engines_numbers(served):
    from llmsys.engine.server.metrics import parse_metrics
    from llmsys.tui.info import info_rows
    from llmsys.tui.memory_panel import describe
    from llmsys.tui.messages import ModelInfo
    from llmsys.tui.metrics import MetricsTracker, parse_prometheus
    from llmsys.tui.snapshot import default_budgets, snapshot_from_engine

    srv, llm = served
    prompt = " ".join(["Once upon a time there was a little girl."] * 20)
    r = httpx.post(srv.url + "/v1/completions", timeout=60,
                   json={"model": "stories-mem", "prompt": prompt, "max_tokens": 40, "temperature": 0})
    assert r.status_code == 200, r.text
    text = _idle(srv)
    rep = llm.core.memory_report()  # idle: nothing changes under these reads
    kv_res, kv_use, kv_all = rep.kv_resident["cpu"], rep.kv_in_use["cpu"], rep.kv_total["cpu"]
    assert 0 < kv_use <= kv_res < kv_all // 10  # written blocks, far from the whole reservation
    assert rep.resident["cpu"] == rep.weights["cpu"] + kv_res + rep.staging.get("cpu", 0)

    m = parse_metrics(text)
    for name, want in (("llmsys_kv_bytes_reserved", kv_all), ("llmsys_kv_bytes_resident", kv_res),
                       ("llmsys_kv_bytes_in_use", kv_use), ("llmsys_memory_resident_bytes", rep.resident["cpu"]),
                       ("llmsys_kv_bytes_total", kv_all), ("llmsys_kv_bytes_used", rep.kv_used["cpu"])):
        assert m[f'{name}{{tier="cpu"}}'] == want, name

    (ps,) = httpx.get(srv.url + "/api/ps").json()["models"]
    assert ps["size"] == rep.resident["cpu"] and ps["size_vram"] == 0

    snap = snapshot_from_engine(llm, default_budgets(llm.config, llm.loaded.device))
    cpu = snap.tier("cpu")
    assert (cpu.kv_reserved, cpu.kv_resident, cpu.kv_used, cpu.used) == (kv_all, kv_res, kv_use, rep.resident["cpu"])
    line = f"{format_bytes(kv_use)} in use · {format_bytes(kv_res)} resident · {format_bytes(kv_all)} reserved"
    assert any(line in x for x in describe(snap))
    info = dict(info_rows(ModelInfo(name="stories-mem", weight_format="safetensors", dtype="float32", quant="none",
                                    n_layers=5, device="cpu", max_len=llm.max_model_len, is_chat=False), snap))
    assert f"CPU {format_bytes(rep.resident['cpu'])} held" in info["memory"]
    assert (f"CPU {format_bytes(kv_use)} in use, {format_bytes(kv_res)} resident, {format_bytes(kv_all)} reserved"
            in info["memory"])

    mon = MetricsTracker().update(parse_prometheus(text), time.monotonic()).tier("cpu")  # llmsys monitor
    assert (mon.kv_reserved, mon.kv_resident, mon.kv_used, mon.used) == (kv_all, kv_res, kv_use, rep.resident["cpu"])
