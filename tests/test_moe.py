"""Mixture-of-experts families (Qwen3-MoE, Qwen2-MoE, Mixtral) beyond the parity tests of test_models.py:
the router against transformers', long prefills, batching, load-time quantization, streamed layers and the
checkpoint layouts experts are stored in."""

from __future__ import annotations

import pytest
import torch

from llmsys.engine.loader import load_model
from tiny_models import make_hf_model

MOE = ["qwen3_moe", "qwen2_moe", "mixtral"]
GREEDY = dict(temperature=0, ignore_eos=True)


def _sparse_layer(arch: str) -> int:
    """A layer with an MoE block in the tiny config (Qwen2-MoE's layer 0 is dense: decoder_sparse_step 2)."""
    return 1 if arch == "qwen2_moe" else 0


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("arch", MOE)
def test_routing_equals_transformers_router(arch, dtype, tmp_path):
    """On a batch of 256 hidden states: the same router logits, top-k experts and routing weights (bits and
    dtype: Mixtral's stay float32) as transformers' router; the block's output matches its sparse block."""
    from transformers import AutoModelForCausalLM

    from llmsys.engine.models.moe import MoE, route

    path = make_hf_model(arch, tmp_path / arch)
    i = _sparse_layer(arch)
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=dtype).eval()
    ours = load_model(path, dtype=str(dtype).removeprefix("torch."), device="cpu").model.model.layers[i].mlp
    assert isinstance(ours, MoE)
    x = torch.randn(256, hf.config.hidden_size, generator=torch.Generator().manual_seed(0)).to(dtype)
    with torch.no_grad():
        ref_logits, ref_w, ref_e = hf.model.layers[i].mlp.gate(x)
        logits = ours.gate(x)
        w, e = route(logits, ours.top_k, ours.normalize, ours.float_weights)
        assert torch.equal(logits, ref_logits)
        assert torch.equal(e, ref_e) and w.dtype == ref_w.dtype and torch.equal(w, ref_w)
        assert len(set(e.flatten().tolist())) == len(ours.experts)  # every expert chosen somewhere
        if dtype == torch.float32:
            ref = hf.model.layers[i].mlp(x[None])[0]
            assert (ours(x) - ref).abs().max().item() < 1e-5


@pytest.mark.parametrize("arch", MOE)
def test_long_prefill_many_tokens_per_expert(arch, tmp_path):
    """One 240-token prefill (~120 rows per expert GEMM): every position's logits equal transformers'."""
    from transformers import AutoModelForCausalLM

    from llmsys.engine.attention import make_backend
    from llmsys.engine.kv_cache import KVCacheSpec, make_kv_pool

    path = make_hf_model(arch, tmp_path / arch)
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    loaded = load_model(path, dtype="float32", device="cpu")
    a = loaded.args
    n = 240
    prompt = torch.randint(3, 512, (n,), generator=torch.Generator().manual_seed(3))
    pool = make_kv_pool(KVCacheSpec(a.num_hidden_layers, 17, 16, a.num_key_value_heads, a.head_dim, torch.float32),
                        loaded.device)
    attn = make_backend(pool, loaded.device, 16)
    with torch.inference_mode():
        h = loaded.model(prompt, torch.arange(n), attn, attn.metadata([n], [n], [list(range(1, 16))]))
        ours = loaded.model.compute_logits(h)  # [n, V]
        ref = hf(prompt[None]).logits[0]
    assert (ours - ref).abs().max().item() < 1e-4


@pytest.mark.parametrize("arch", MOE)
def test_batched_requests_equal_alone(arch, tmp_path):
    """Eight prompts of different lengths in one batch (their tokens sharing the experts' GEMMs) give each
    prompt's greedy tokens alone."""
    from llmsys import LLM, SamplingParams

    path = make_hf_model(arch, tmp_path / arch, seed=3)
    g = torch.Generator().manual_seed(11)
    prompts = [torch.randint(3, 512, (int(n),), generator=g).tolist() for n in torch.randint(2, 40, (8,), generator=g)]
    llm = LLM(str(path), dtype="float32", device="cpu", kv_cache_tokens=1024, progress=False)
    sp = SamplingParams(max_tokens=24, **GREEDY)
    batched = [o.token_ids for o in llm.generate(prompts, sp)]
    alone = [llm.generate([p], sp)[0].token_ids for p in prompts]
    assert batched == alone


@pytest.mark.parametrize("arch", MOE)
def test_int8_quantizes_experts_and_keeps_the_router(arch, tmp_path):
    """``--quant int8`` at load: every expert projection is an int8 layer, the router and the shared expert's
    gate stay float (a routing decision is discrete), and over a prompt and 32 forced tokens the logits stay
    close to float's (the tiny random models' logits are nearly flat, so free-running greedy text drifts
    apart within a few tokens even for dense families: the same argmax at most steps is the smoke test)."""
    from llmsys import LLM, SamplingParams
    from llmsys.engine.models.moe import FloatLinear
    from llmsys.quant.base import QuantLinear
    from test_models import llmsys_logits

    path = make_hf_model(arch, tmp_path / arch, seed=3)
    g = torch.Generator().manual_seed(5)
    prompt, cont = torch.randint(3, 512, (12,), generator=g).tolist(), torch.randint(3, 512, (32,), generator=g).tolist()
    ref = LLM(str(path), dtype="float32", device="cpu", kv_cache_tokens=512, progress=False)
    llm = LLM(str(path), dtype="float32", device="cpu", kv_cache_tokens=512, quant="int8", progress=False)
    moe = llm.loaded.model.model.layers[_sparse_layer(arch)].mlp
    experts = [m for e in moe.experts for m in e.modules() if isinstance(m, torch.nn.Linear | QuantLinear)]
    assert experts and all(isinstance(m, QuantLinear) for m in experts)
    assert type(moe.gate) is FloatLinear and moe.gate.weight.dtype == torch.float32
    if moe.shared_expert_gate is not None:
        assert type(moe.shared_expert_gate) is FloatLinear
    want = torch.stack(llmsys_logits(ref.loaded, prompt, cont))  # [33, V]
    got = torch.stack(llmsys_logits(llm.loaded, prompt, cont))
    same = int((want.argmax(-1) == got.argmax(-1)).sum())
    assert same >= 28 and (want - got).abs().max().item() < 0.5, (same, (want - got).abs().max().item())
    out = llm.generate([prompt], SamplingParams(max_tokens=16, **GREEDY))[0].token_ids
    # greedy's first token is the int8 model's own argmax (float's can differ at a near-tie: qwen2_moe's top-2
    # float logits are 0.022 apart, the int8 model's float32 logits 0.001 the other way)
    assert len(out) == 16 and out[0] == int(got[0].argmax())


def test_streamed_moe_layers_give_identical_tokens(tmp_path):
    """A Mixtral (Hub names ``block_sparse_moe.experts.E.w1``) bigger than ``cpu_mem``: layers streamed whole
    from the checkpoint (the views of the renamed tensors), and the planner's own choice (experts on disk,
    read on demand), each with the resident run's greedy tokens and logprobs."""
    from llmsys import LLM, SamplingParams

    path = make_hf_model("mixtral", tmp_path / "m", seed=3, hidden_size=128, intermediate_size=256,
                         num_hidden_layers=6, num_local_experts=8)  # ~20 MiB of float32 weights
    prompts = [[5, 17, 99, 200, 31, 7, 8], [300, 12, 4]]
    sp = SamplingParams(max_tokens=16, logprobs=0, **GREEDY)

    def run(**kw):
        llm = LLM(str(path), dtype="float32", device="cpu", kv_cache_tokens=256, max_num_batched_tokens=64,
                  max_num_seqs=4, progress=False, threads=2, **kw)
        outs = llm.generate(prompts, sp)
        return llm, [(o.token_ids, [lp.logprob for lp in o.logprobs]) for o in outs]

    ref_llm, ref = run()
    assert ref_llm.loaded.weight_bytes > 16 * 2**20
    llm, got = run(cpu_mem="12MiB", placement={"disk": 6})  # layers streamed whole
    assert "disk" in llm.plan.layer_kinds() and llm.offload.ring.stats.bytes_read > 0
    assert got == ref
    # Unforced, the planner keeps the experts on disk instead (a step reads k/E of them, not every one).
    llm, got = run(cpu_mem="12MiB")
    assert llm.plan.experts.tier == "disk" and llm.offload.expert_report().misses > 0
    assert got == ref


def test_fused_expert_checkpoint_loads_and_streams(tmp_path):
    """A checkpoint holding transformers' in-memory layout (``mlp.experts.gate_up_proj`` [E, 2I, H],
    ``mlp.experts.down_proj`` [E, H, I]) loads as the per-expert one does (the same weights, bit for bit),
    resident and streamed; a fused tensor of the wrong shape is one line naming it."""
    from llmsys import LLM, SamplingParams
    from llmsys.engine.loader.safetensors_io import CheckpointIndex, save_file
    from llmsys.kernels.common.errors import CheckpointError

    path = make_hf_model("qwen3_moe", tmp_path / "m", seed=3)
    index = CheckpointIndex.open_dir(path)
    tensors = {n: index.read(n) for n in index.where}
    E = 8
    fused: dict[str, torch.Tensor] = {}
    for n, t in tensors.items():
        if ".mlp.experts." not in n:
            fused[n] = t
        elif n.endswith(".experts.0.gate_proj.weight"):
            pre = n.removesuffix(".0.gate_proj.weight")
            gu = [torch.cat([tensors[f"{pre}.{e}.gate_proj.weight"], tensors[f"{pre}.{e}.up_proj.weight"]])
                  for e in range(E)]
            fused[f"{pre}.gate_up_proj"] = torch.stack(gu)
            fused[f"{pre}.down_proj"] = torch.stack([tensors[f"{pre}.{e}.down_proj.weight"] for e in range(E)])
    (path / "model.safetensors").unlink()
    other = tmp_path / "fused"
    other.mkdir()
    for f in path.iterdir():
        (other / f.name).write_bytes(f.read_bytes())
    save_file(fused, other / "model.safetensors")
    save_file(tensors, path / "model.safetensors")
    a, b = load_model(path, dtype="float32", device="cpu"), load_model(other, dtype="float32", device="cpu")
    sa, sb = a.model.state_dict(), b.model.state_dict()
    assert sa.keys() == sb.keys() and all(torch.equal(sa[k], sb[k]) for k in sa)
    sp = SamplingParams(max_tokens=12, **GREEDY)
    ref = LLM(str(path), dtype="float32", device="cpu", kv_cache_tokens=256, progress=False).generate([[5, 6, 7]], sp)
    llm = LLM(str(other), dtype="float32", device="cpu", kv_cache_tokens=256, progress=False, cpu_mem="64MiB",
              placement={"disk": 2})
    assert llm.plan.layer_kinds().count("disk") == 2
    assert llm.generate([[5, 6, 7]], sp)[0].token_ids == ref[0].token_ids
    fused["model.layers.0.mlp.experts.down_proj"] = fused["model.layers.0.mlp.experts.down_proj"][:, :, :32]
    save_file(fused, other / "model.safetensors")
    with pytest.raises(CheckpointError, match=r"mlp\.experts\.down_proj has shape \[8, 64, 32\]") as e:
        load_model(other, dtype="float32", device="cpu")
    assert "\n" not in str(e.value)


def _moe_engine_pair(tmp_path, dtype: str, quant: str = "none", **kw):
    """Greedy tokens + logprobs of a Qwen3-MoE (16 experts, 4 per token) all resident and under ``kw``."""
    from llmsys import LLM, SamplingParams

    path = make_hf_model("qwen3_moe", tmp_path / "m", seed=3, hidden_size=128, intermediate_size=256,
                         moe_intermediate_size=128, num_hidden_layers=4, num_experts=16, num_experts_per_tok=4)
    prompts = [[5, 17, 99, 200, 31, 7, 8], [300, 12, 4]]
    sp = SamplingParams(max_tokens=16, logprobs=0, **GREEDY)

    def run(**extra):
        llm = LLM(str(path), dtype=dtype, device="cpu", kv_cache_tokens=256, max_num_batched_tokens=64, max_num_seqs=4,
                  progress=False, threads=2, quant=quant, **extra)
        return llm, [(o.token_ids, [lp.logprob for lp in o.logprobs]) for o in llm.generate(prompts, sp)]

    _, ref = run()
    llm, got = run(**kw)
    return llm, ref, got


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_experts_on_disk_read_on_demand_identical(dtype, tmp_path):
    """Experts left on disk (every other weight resident) and read on demand into a cache of a fifth of them:
    the all-resident run's greedy tokens and logprobs, bit for bit; the cache counted hits and misses, read
    less than streaming every expert each step would, and memory_report lists the experts under disk and the
    cache under staging (RAM)."""
    from llmsys.offload.experts import DiskExperts

    llm, ref, got = _moe_engine_pair(tmp_path, dtype, cpu_mem="12MiB",
                                     placement={"experts": "disk", "expert_cache": 2 * 2**20})
    plan = llm.plan
    assert plan.experts is not None and plan.experts.tier == "disk" and plan.layer_kinds() == ["cpu"] * 4
    assert got == ref
    rep = llm.offload.expert_report()
    steps = 16 + 1
    assert rep.tier == "disk" and rep.hits > 0 and rep.misses > 0 and rep.cache_bytes <= rep.cache_capacity
    assert rep.bytes_read < steps * rep.expert_bytes / 2  # whole-layer streaming reads every expert every step
    assert isinstance(llm.offload._experts[plan.experts.layers[0]], DiskExperts)
    mem = llm.memory_report()
    assert mem.weights["disk"] >= rep.expert_bytes and mem.staging["cpu"] >= rep.cache_capacity
    assert mem.experts == rep  # the engine's own report carries the expert cache's counters
    from llmsys.engine.server.metrics import Metrics, parse_metrics

    m = Metrics()
    m.add_engine().set_memory(mem)
    scraped = parse_metrics(m.render())
    assert scraped["llmsys_expert_cache_hits_total"] == rep.hits
    assert scraped["llmsys_expert_cache_misses_total"] == rep.misses
    assert scraped['llmsys_expert_bytes{tier="disk"}'] == rep.expert_bytes
    # The TUI panel shows the same counters, from the engine (chat) and from /metrics (monitor).
    from llmsys.tui.memory_panel import describe
    from llmsys.tui.metrics import MetricsTracker, parse_prometheus
    from llmsys.tui.snapshot import snapshot_from_engine

    text = m.render()
    for snap in (snapshot_from_engine(llm, {}),
                 MetricsTracker().update(parse_prometheus(text if isinstance(text, str) else text.decode()), 0.0)):
        (line,) = [x for x in describe(snap) if x.startswith("experts")]
        assert "on disk" in line and f"hits {100 * rep.hit_rate:.0f}% ({rep.hits}/{rep.hits + rep.misses})" in line
    # No expert weight is resident: the MoE blocks' experts hold meta placeholders between uses.
    moe = llm.loaded.model.model.layers[plan.experts.layers[0]].mlp
    assert all(p.device.type == "meta" for e in moe.experts for p in e.parameters())


def test_experts_on_disk_int4_and_lru(tmp_path):
    """``--quant int4``: quantized experts are written to the offload file once and read from there with the
    resident int4 run's tokens; the LRU policy (kept for comparison) gives the same tokens too."""
    llm, ref, got = _moe_engine_pair(tmp_path, "float32", quant="int4", cpu_mem="12MiB",
                                     placement={"experts": "disk", "expert_cache": 1 << 20, "expert_policy": "lru"})
    assert llm.plan.experts.policy == "lru" and llm.offload.expert_cache.policy == "lru"
    assert got == ref and llm.offload.expert_report().misses > 0


def test_cpu_moe_routes_rows_through_the_expert_source(tmp_path):
    """``--cpu-moe`` (``cpu_moe=-1``): the experts stay in CPU RAM and the MoE blocks compute them through the
    resident source (on a CPU engine the device is the CPU, so the hidden rows' trip is a no-op, but the path
    is the CUDA engine's); the tokens are the plain run's. A dense model refuses the flag in one line."""
    from llmsys import LLM
    from llmsys.kernels.common.errors import InvalidParameterError
    from llmsys.offload.experts import ResidentExperts

    llm, ref, got = _moe_engine_pair(tmp_path, "float32", cpu_moe=-1)
    assert got == ref
    srcs = llm.offload._experts
    assert srcs and all(isinstance(s, ResidentExperts) and s.uses > 0 for s in srcs.values())
    assert llm.plan.experts.tier == "cpu" and llm.offload.expert_report().tier == "cpu"
    dense = make_hf_model("llama", tmp_path / "dense")
    with pytest.raises(InvalidParameterError, match="no mixture-of-experts") as e:
        LLM(str(dense), device="cpu", cpu_moe=2, progress=False)
    assert "\n" not in str(e.value)


def test_expert_cache_smaller_than_a_step():
    """A cache of one slot serves a step that needs several experts (each read when its turn comes); a
    consumer that stops early leaves every module unbound and the cache usable."""
    import tempfile

    from llmsys.offload.experts import ExpertCache, ExpertWeights
    from llmsys.offload.streamer import Binding, StreamItem, StreamUnit, TensorSource

    data = torch.arange(4 * 16, dtype=torch.float32).view(4, 16)
    with tempfile.NamedTemporaryFile() as f:
        f.write(data.numpy().tobytes())
        f.flush()
        mods = [torch.nn.Linear(4, 4, bias=False) for _ in range(4)]
        ws = []
        for e, m in enumerate(mods):
            b = Binding(m, "weight", True, torch.nn.Parameter(torch.empty(4, 4, device="meta"), requires_grad=False))
            b.unbind()
            ws.append(ExpertWeights(StreamUnit(f"e{e}", [StreamItem(torch.float32, (4, 4), TensorSource(f.name, e * 64, 64))]), (b,)))
        for policy in ("lfu", "lru"):
            cache = ExpertCache(64, 64, policy=policy)
            for _ in range(2):
                seen = []
                for e in cache.each(0, [3, 1, 2], ws):
                    assert torch.equal(mods[e].weight.view(-1), data[e])
                    seen.append(e)
                assert sorted(seen) == [1, 2, 3]
            it = cache.each(0, [0, 2], ws)
            next(it)
            it.close()
            assert all(m.weight.device.type == "meta" for m in mods)
            assert cache.stats.misses + cache.stats.hits == 7
            cache.close()


def test_expert_cache_counts_age(monkeypatch):
    """LFU follows a drift in popularity: after experts 0-1 were used 50 times each, a new favourite (3) gets a
    slot within a few dozen uses (counts halve every AGE_USES_PER_SLOT x slots uses); with counts that never
    age it would wait behind the old favourites' 50 uses."""
    import tempfile

    from llmsys.offload import experts as ex
    from llmsys.offload.streamer import Binding, StreamItem, StreamUnit, TensorSource

    with tempfile.NamedTemporaryFile() as f:
        f.write(bytes(64 * 4))
        f.flush()
        ws = []
        for e in range(4):
            m = torch.nn.Linear(4, 4, bias=False)
            b = Binding(m, "weight", True, torch.nn.Parameter(torch.empty(4, 4, device="meta"), requires_grad=False))
            b.unbind()
            ws.append(ex.ExpertWeights(StreamUnit(f"e{e}", [StreamItem(torch.float32, (4, 4), TensorSource(f.name, e * 64, 64))]), (b,)))

        def uses_until_cached(age: int) -> int:
            monkeypatch.setattr(ex, "AGE_USES_PER_SLOT", age)
            cache = ex.ExpertCache(2 * 64, 64)  # two slots
            for _ in range(50):
                list(cache.each(0, [0, 1], ws))
            for n in range(1, 200):
                list(cache.each(0, [2 + n % 2], ws))  # drift: 2 and 3 take turns
                if (0, 3) in cache._lru and (0, 2) in cache._lru:
                    cache.close()
                    return n
            cache.close()
            return 10**6

        assert uses_until_cached(4) < 40  # aged: the new pair owns the cache soon
        assert uses_until_cached(10**9) >= 100  # never aged: until the new pair has 50 uses each too


def test_planner_accounts_experts():
    """Qwen3-30B-A3B's shape (models.toml): a token computes k/E of the expert bytes; on a CPU budget below the
    model the planner keeps every non-expert weight resident and the experts on disk with the rest of the budget
    as their cache, and --explain says where expert bytes live and the bytes read per token; --cpu-moe on a GPU
    budget moves the expert bytes to the CPU tier."""
    from llmsys.engine.bench.synthetic import synthetic_config
    from llmsys.engine.cli.plan_cmd import meta_model
    from llmsys.offload.bandwidth import Bandwidths
    from llmsys.offload.budgets import Budgets
    from llmsys.offload.plan import Workload
    from llmsys.offload.prepare import plan_for, shape_of

    cfg = synthetic_config("qwen3-30b-a3b")
    assert (cfg["num_experts"], cfg["num_experts_per_tok"], cfg["num_hidden_layers"]) == (128, 8, 48)
    meta = meta_model(cfg)
    shape = shape_of(meta, torch.bfloat16, "int4")
    u = shape.layers[0]
    assert u.num_experts == 128 and u.top_k == 8 and len(shape.sparse) == 48
    total_e = sum(x.expert_bytes for x in shape.layers)
    assert 28e9 < sum(x.expert_params for x in shape.layers) < 30e9  # ~29B of the 30B are experts
    assert u.compute_bytes(1) - (u.nbytes - u.expert_bytes) == u.expert_bytes * 8 // 128
    bw = Bandwidths(mem_gbps=20.0, disk_read_gbps=2.0, cpu_gflops={"bfloat16": 200.0, "float32": 200.0})
    budget = int(shape.weight_bytes - 0.6 * total_e)
    plan, _ = plan_for(meta, torch.bfloat16, Budgets(budget, None, None, True), Workload(kv_tokens=1024), "int4",
                       bandwidths=bw)
    ep = plan.experts
    assert ep is not None and ep.tier == "disk" and set(plan.layer_kinds()) == {"cpu"}
    assert plan.used("cpu") <= budget and 0.3 < ep.hit_rate < 0.45
    assert ep.active_bytes_per_token == total_e * 8 // 128
    assert ep.read_bytes_per_token == pytest.approx(ep.active_bytes_per_token * (1 - ep.hit_rate), rel=1e-3)
    assert plan.bytes_in("disk") - sum(p.nbytes for p in (plan.embed, plan.head) if p and p.kind == "disk") == total_e
    text = "\n".join(plan.reasons)
    assert "experts:" in text and "read per token" in text, text
    gplan, _ = plan_for(meta, torch.bfloat16, Budgets(64 << 30, 16 << 30, None, True, True), Workload(kv_tokens=1024),
                        "int4", bandwidths=bw, cpu_moe=-1)
    assert gplan.experts.tier == "cpu" and gplan.bytes_in("cpu") >= total_e and gplan.bytes_in("gpu") < total_e / 4


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gpt_oss_router_equals_transformers(dtype, tmp_path):
    """gpt-oss's router (a bias; the top-k logits, then a softmax over those in the logits' dtype): the same
    logits, experts and weights, bit for bit and dtype, as transformers' ``GptOssTopKRouter``; in float32
    the MoE block's output matches ``GptOssMLP`` (clamped SwiGLU experts with biases)."""
    from transformers import AutoModelForCausalLM

    from llmsys.engine.models.moe import MoE, route

    path = make_hf_model("gpt_oss", tmp_path / "g")
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=dtype).eval()
    ours = load_model(path, dtype=str(dtype).removeprefix("torch."), device="cpu").model.model.layers[0].mlp
    assert isinstance(ours, MoE) and ours.topk_first and ours.gate.bias is not None
    x = torch.randn(256, hf.config.hidden_size, generator=torch.Generator().manual_seed(0)).to(dtype)
    with torch.no_grad():
        ref_logits, ref_w, ref_e = hf.model.layers[0].mlp.router(x)
        logits = ours.gate(x)
        w, e = route(logits, ours.top_k, ours.normalize, ours.float_weights, ours.topk_first)
        assert torch.equal(logits, ref_logits)
        assert torch.equal(e, ref_e) and w.dtype == ref_w.dtype and torch.equal(w, ref_w)
        assert len(set(e.flatten().tolist())) == len(ours.experts)
        if dtype == torch.float32:
            ref = hf.model.layers[0].mlp(x[None])[0][0]
            assert (ours(x) - ref).abs().max().item() < 1e-5


def test_gpt_oss_mxfp4_checkpoint_dequantized_at_load(tmp_path):
    """openai's release stores the experts as MXFP4 blocks and scales: each loaded expert matrix equals
    transformers' ``convert_moe_packed_tensors`` of the same bytes, value for value, and over a prefill and 32
    decode steps the logits match transformers loading the same checkpoint (which dequantizes on the CPU);
    ``--quant int8`` then quantizes the dequantized experts like any; a blocks tensor of the wrong shape is
    one line naming it."""
    from safetensors.torch import load_file, save_file
    from transformers import AutoModelForCausalLM
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    from llmsys import LLM
    from llmsys.kernels.common.errors import CheckpointError
    from llmsys.quant.base import QuantLinear
    from test_models import llmsys_logits
    from tiny_models import write_mxfp4_checkpoint

    mx = write_mxfp4_checkpoint(make_hf_model("gpt_oss", tmp_path / "g", seed=3), tmp_path / "mx")
    stored = load_file(str(mx / "model.safetensors"))
    loaded = load_model(mx, dtype="float32", device="cpu")
    assert loaded.stored_formats == {"MXFP4 (4)": "dequantized to float32"}
    for i, layer in enumerate(loaded.model.model.layers):
        pre = f"model.layers.{i}.mlp.experts."
        gu = convert_moe_packed_tensors(stored[pre + "gate_up_proj_blocks"], stored[pre + "gate_up_proj_scales"],
                                        dtype=torch.float32)  # [E, H, 2 I]
        down = convert_moe_packed_tensors(stored[pre + "down_proj_blocks"], stored[pre + "down_proj_scales"],
                                          dtype=torch.float32)  # [E, I, H]
        for e, ex in enumerate(layer.mlp.experts):
            assert torch.equal(ex.gate_proj.weight, gu[e][:, 0::2].t()) and torch.equal(ex.up_proj.weight, gu[e][:, 1::2].t())
            assert torch.equal(ex.down_proj.weight, down[e].t())
            assert torch.equal(ex.up_proj.bias, stored[pre + "gate_up_proj_bias"][e][1::2])
    hf = AutoModelForCausalLM.from_pretrained(mx, dtype=torch.float32).eval()
    g = torch.Generator().manual_seed(1)
    prompt, cont = torch.randint(3, 512, (32,), generator=g).tolist(), torch.randint(3, 512, (32,), generator=g).tolist()
    with torch.no_grad():
        assert torch.equal(hf.model.layers[1].mlp.experts.down_proj, down)  # transformers decoded the same values
        full = hf(torch.tensor([prompt + cont])).logits[0]
    ours = llmsys_logits(loaded, prompt, cont)
    worst = max((o - r).abs().max().item() for o, r in zip(ours, [full[31]] + [full[32 + i] for i in range(32)]))
    assert worst < 1e-4, f"max |logit diff| {worst:.2e} over prefill + 32 decode steps"
    llm = LLM(str(mx), dtype="float32", device="cpu", kv_cache_tokens=256, quant="int8", progress=False)
    experts = [m for layer in llm.loaded.model.model.layers for e in layer.mlp.experts for m in e.modules()
               if isinstance(m, torch.nn.Linear | QuantLinear)]
    assert len(experts) == 2 * 4 * 2 and all(isinstance(m, QuantLinear) for m in experts)  # gate|up fused, down
    assert llm.loaded.stored_formats == {"MXFP4 (4)": "dequantized, matrices re-quantized to int8 (--quant)"}
    stored["model.layers.1.mlp.experts.down_proj_blocks"] = stored["model.layers.1.mlp.experts.down_proj_blocks"][:, :32].clone()
    save_file(stored, str(mx / "model.safetensors"))
    with pytest.raises(CheckpointError, match=r"down_proj_blocks has shape \[4, 32, 3, 16\]") as err:
        load_model(mx, dtype="float32", device="cpu")
    assert "\n" not in str(err.value)


def test_gpt_oss_experts_on_disk_identical(tmp_path):
    """gpt-oss's experts are derived tensors (strided columns, MXFP4), not byte ranges of the checkpoint: left on
    disk they are written to the offload file once decoded and read on demand from there, with the resident
    run's greedy tokens and logprobs, bit for bit."""
    from llmsys import LLM, SamplingParams
    from tiny_models import write_mxfp4_checkpoint

    src = make_hf_model("gpt_oss", tmp_path / "g", seed=3, hidden_size=128, intermediate_size=128,
                        num_hidden_layers=4, num_local_experts=16, num_experts_per_tok=4)
    mx = write_mxfp4_checkpoint(src, tmp_path / "mx")
    prompts = [[5, 17, 99, 200, 31, 7, 8], [300, 12, 4]]
    sp = SamplingParams(max_tokens=16, logprobs=0, **GREEDY)

    def run(**extra):
        llm = LLM(str(mx), dtype="float32", device="cpu", kv_cache_tokens=256, max_num_batched_tokens=64,
                  max_num_seqs=4, progress=False, threads=2, **extra)
        return llm, [(o.token_ids, [lp.logprob for lp in o.logprobs]) for o in llm.generate(prompts, sp)]

    _, ref = run()
    llm, got = run(cpu_mem="12MiB", placement={"experts": "disk", "expert_cache": 2 * 2**20})
    assert llm.plan.experts is not None and llm.plan.experts.tier == "disk"
    assert got == ref and llm.offload.expert_report().misses > 0
