"""The grouped expert kernel (``kernels.moe_experts``: every routed expert of an MoE layer in one C call) against
the per-expert path it replaces: the same bits for every stored format, batch size and left-over expert, and
the same greedy tokens from a whole engine."""

from __future__ import annotations

import pytest
import torch

from llmsys import kernels
from tiny_models import make_hf_model

pytestmark = pytest.mark.skipif(not kernels.cpu_fused_available(), reason="the C kernels are not built here "
                                "(no compiler, or LLMSYS_NO_CKERNELS=1): nothing to compare")

MOE = ["qwen3_moe", "qwen2_moe", "mixtral", "gpt_oss"]
GREEDY = dict(temperature=0, ignore_eos=True)


def _llm(path, dtype: str, quant: str | None):
    from llmsys import LLM

    return LLM(str(path), dtype=dtype, device="cpu", kv_cache_tokens=1024, progress=False,
               **({"quant": quant} if quant else {}))


def _moes(llm):
    from llmsys.engine.models.moe import MoE

    return [layer.mlp for layer in llm.loaded.model.model.layers if isinstance(layer.mlp, MoE)]


def _per_expert(moe, x: torch.Tensor, decode: bool) -> torch.Tensor:
    g, moe.grouped = moe.grouped, None
    try:
        return moe.forward(x, decode)
    finally:
        moe.grouped = g


@pytest.mark.parametrize("dtype,quant", [("bfloat16", None), ("bfloat16", "int8"), ("bfloat16", "int4"),
                                         ("float32", None)])
@pytest.mark.parametrize("arch", MOE)
def test_grouped_equals_per_expert_bit_for_bit(arch, dtype, quant, tmp_path):
    """Every sparse layer plans the grouped kernel, and its output equals the per-expert path's bit for bit at
    1 token, a decode batch, and a prompt long enough that popular experts exceed the kernel's rows (their own
    forward runs them, the sum is shared)."""
    from llmsys.engine.models.moe import route

    llm = _llm(make_hf_model(arch, tmp_path / arch, seed=4), dtype, quant)
    moes = _moes(llm)
    assert moes and all(m.grouped is not None for m in moes), "the decode plan should give every MoE block the kernel"
    g = torch.Generator().manual_seed(1)
    dt = getattr(torch, dtype)
    for moe in moes:
        h = moe.gate.weight.shape[1]
        for t in (1, 5, 8 * moe.grouped.max_rows):
            x = (torch.randn(t, h, generator=g) * 2).to(dt)
            with torch.no_grad():
                got, want = moe.forward(x, t <= 8), _per_expert(moe, x, t <= 8)
            assert got.dtype == want.dtype == dt and torch.equal(got, want), (t, (got.float() - want.float()).abs().max())
        with torch.no_grad():
            _, chosen = route(moe.gate(x), moe.top_k, moe.normalize, moe.float_weights, moe.topk_first)
        counts = torch.bincount(chosen.flatten(), minlength=len(moe.experts))
        assert int(counts.max()) > moe.grouped.max_rows  # the long case did leave experts to their own forward


@pytest.mark.parametrize("arch", MOE)
def test_engine_tokens_with_and_without_the_kernel(arch, tmp_path):
    """Greedy tokens of a batch of int4 prompts are the same with the grouped kernel (and the sparse layers' fused
    attention around it) and expert by expert, op by op."""
    from llmsys import SamplingParams
    from llmsys.engine.models import decode_plan

    path = make_hf_model(arch, tmp_path / arch, seed=3)
    g = torch.Generator().manual_seed(7)
    prompts = [torch.randint(3, 512, (int(n),), generator=g).tolist() for n in (3, 17, 40, 9)]
    sp = SamplingParams(max_tokens=12, **GREEDY)
    llm = _llm(path, "bfloat16", "int4")
    assert all(m.grouped is not None for m in _moes(llm))
    sparse = [layer for layer in llm.loaded.model.model.layers if layer.mlp in _moes(llm)]
    assert all(layer.decode is not None and layer.decode.moe for layer in sparse)  # attention fused around them
    grouped = [o.token_ids for o in llm.generate(prompts, sp)]
    planned = decode_plan.moe_plan
    try:
        decode_plan.moe_plan = lambda moe, dtype: None  # the engine's plan without the kernel
        ref = _llm(path, "bfloat16", "int4")
        assert all(m.grouped is None for m in _moes(ref))
        per_expert = [o.token_ids for o in ref.generate(prompts, sp)]
    finally:
        decode_plan.moe_plan = planned
    assert grouped == per_expert


@pytest.mark.parametrize("dtype,quant", [("float32", "none"), ("bfloat16", "int4"), ("bfloat16", "int8")])
def test_experts_held_from_disk_run_grouped(dtype, quant, tmp_path):
    """Experts on disk, read into a cache that holds a step's experts at once: each layer binds its routed
    experts together and runs them in one grouped call, with the all-resident run's tokens and logprobs bit for
    bit; with a cache too small to hold them, expert by expert, the same bits."""
    from test_moe import _moe_engine_pair

    llm, ref, got = _moe_engine_pair(tmp_path, dtype, quant, cpu_mem="24MiB",
                                     placement={"experts": "disk", "expert_cache": 12 * 2**20})
    assert llm.plan.experts.tier == "disk" and got == ref
    moes = _moes(llm)
    assert all(m.grouped is None for m in moes)  # (the experts are not resident: no plan-time arguments)
    assert all(m.held_args is not None and m.held_args.bound for m in moes), "every layer should have run grouped"
    layers = llm.loaded.model.model.layers
    assert llm.plan.layer_kinds() == ["cpu"] * len(layers)
    if quant != "none":  # (float32's plain projections take the C float32 GEMV only when small: op by op here)
        assert all(layer.decode is not None and layer.decode.moe for layer in layers if layer.mlp in moes)  # fused too
    assert llm.offload.expert_report().misses > 0
    rep = llm.offload.expert_report()
    small, ref2, got2 = _moe_engine_pair(tmp_path / "small", dtype, quant, cpu_mem="24MiB",
                                         placement={"experts": "disk", "expert_cache": 4 * rep.expert_bytes // 64})
    assert not small.offload.expert_cache.holds(moes[0].top_k)  # 4 slots: room for a read or two, not a step
    assert got2 == ref2 == ref
    assert not any(m.held_args is not None and m.held_args.bound for m in _moes(small))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_clamped_swiglu_row_code_is_transformers_ops(dtype):
    """gpt-oss's activation in C (what its experts run, one by one or grouped) against transformers' torch ops:
    bf16 bit for bit on a sweep across the clamp (NaN and infinities included); float32 within an ulp (the exp)."""
    from llmsys.engine.models.base import clamped_swiglu

    g = torch.Generator().manual_seed(2)
    gate, up = ((torch.randn(64, 2880, generator=g) * 6).to(dtype) for _ in range(2))
    gate[0, :5] = torch.tensor([float("nan"), float("inf"), -float("inf"), 7.0, 100.0])
    up[0, :5] = torch.tensor([1.0, float("nan"), -100.0, 7.5, 0.0])
    want, got = clamped_swiglu(gate, up, 1.702, 7.0), kernels.cpu_fused_clamped_swiglu(gate, up, 1.702, 7.0)
    same = (got == want) | (got.isnan() & want.isnan())
    if dtype == torch.bfloat16:
        assert bool(same.all())
    else:
        assert same.float().mean() > 0.99 and torch.allclose(got[~same], want[~same], rtol=1e-6, atol=0)


def test_kernel_rejects_bad_arguments(tmp_path):
    """Ids outside the experts or a wrong x shape are a clear error, not a read out of bounds."""
    llm = _llm(make_hf_model("qwen3_moe", tmp_path / "m", seed=4), "bfloat16", "int8")
    moe = _moes(llm)[0]
    h = moe.gate.weight.shape[1]
    x = torch.randn(2, h).to(torch.bfloat16)
    w = torch.full((2, moe.top_k), 0.5).to(torch.bfloat16)
    bad = torch.full((2, moe.top_k), len(moe.experts), dtype=torch.int64)
    with pytest.raises(ValueError, match="rejected the layer"):
        kernels.moe_experts(moe.grouped, x, bad, w)
    with pytest.raises(ValueError, match="contiguous"):
        kernels.moe_experts(moe.grouped, x.float(), bad.clamp(max=0), w)
    with pytest.raises(ValueError, match=r"clamped_swiglu: gate and up must be bf16 or float32 \[T, I\] of one dtype"):
        kernels.cpu_fused_clamped_swiglu(x, x.float(), 1.702, 7.0)
