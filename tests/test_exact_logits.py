"""The LM head's logits are float32 as summed, never rounded to bf16 (issue #42, exact logits).

Why: with bf16 logits a SmolLM2 Q8_0 head gave log-probability gaps that were exact multiples of 0.125 ("H"
and "El" tied at -2.3200), so greedy answers hit argmax ties and the sampler saw a coarse distribution. Each
head kind here (the a8 GEMVs of int8 / Q8_0 / Q6_K / Q5_K / int4 / Q4_1 / Q4_K weights, bf16 and float32
plain or packed weights, a streamed head) must give float32 logits equal, to float32 rounding, to the float64
product of its dequantized weight and its input (the a8-rounded input where the kernel quantizes x, the
bf16-rounded one where it multiplies bf16 pairs), and a model's generate and score paths must hand such
logits on.
"""

from __future__ import annotations

import pytest
import torch

from conftest import other_isa_build, x86_levels
from tiny_models import make_hf_model

from llmsys.kernels import KScales, cpu_qgemv, quant_matmul_support
from llmsys.quant import Int4Linear, Int8BlockLinear, Int8Linear
from llmsys.quant.int4 import pack_int4

KERNEL = quant_matmul_support().available
needs_kernel = pytest.mark.skipif(not KERNEL, reason="the C kernels are not built here")
K = 576  # SmolLM2-135M's hidden size: 18 a8 blocks, no multiple of 256 (Q6_K / Q4_K tests use 512)
F32 = torch.float32


def _off_bf16_grid(y: torch.Tensor) -> float:
    """The share of values a bf16 rounding would change (bf16 logits: 0)."""
    return (y != y.to(torch.bfloat16).float()).float().mean().item()


def _a8(x: torch.Tensor) -> torch.Tensor:
    """``x [M, K]`` as the a8 GEMVs see it: codes times block scale (float64, exact)."""
    q, d, _ = cpu_qgemv.quantize_a8(x)
    return (q.double() * d.double()[..., None]).reshape(x.shape[0], -1)[:, : x.shape[1]]


def _check(y: torch.Tensor, x_seen: torch.Tensor, w: torch.Tensor, rtol: float = 1e-5) -> None:
    """``y [M, N]`` float32 equals ``x_seen @ w.T`` (float64) to float32 rounding: within ``rtol`` of each
    output's sum of |products| (float32 accumulation over ~K / 32 block sums rounds ~1e-6 of it; a bf16
    rounding of y moves it by up to 2^-9 of |y|, ~1e-4 of that sum here), and off the bf16 grid."""
    assert y.dtype == F32
    xd, wd = x_seen.double(), w.double()
    ref, mag = xd @ wd.t(), xd.abs() @ wd.abs().t()
    err = (y.double() - ref).abs()
    assert bool((err <= rtol * mag + 1e-30).all()), float((err / mag).max())
    assert _off_bf16_grid(y) > 0.9


def _x(m: int, k: int = K, seed: int = 0) -> torch.Tensor:
    return torch.randn(m, k, generator=torch.Generator().manual_seed(seed))  # float32: the final norm's output


def _heads(k: int = K) -> dict[str, object]:
    """One head of each quantized kind, N = 200 rows (not a multiple of 64: the int4 tiling's tail block)."""
    g = torch.Generator().manual_seed(7)
    n = 200
    w = torch.randn(n, k, generator=g) * 0.05
    heads = {
        "int8": Int8Linear.from_float(w),
        "q8_0": Int8BlockLinear.from_float(w),
        "int4-g32": Int4Linear.from_float(w, group_size=32),
        "int4-g64": Int4Linear.from_float(w, group_size=64),
    }
    codes = torch.randint(0, 16, (n, k), generator=g, dtype=torch.uint8)
    scales = torch.rand(n, k // 32, generator=g) * 0.01
    offsets = -torch.rand(n, k // 32, generator=g) * 0.05
    zeros = torch.zeros(n, k // 32, dtype=torch.uint8)
    heads["q4_1"] = Int4Linear(pack_int4(codes), scales, zeros, offsets=offsets)  # w = q * scale + offset
    k2 = 512  # whole 256-column super-blocks
    q6 = torch.randint(-32, 32, (n, k2), generator=g, dtype=torch.int8)
    sc = torch.randint(-128, 128, (k2 // 16, n), generator=g, dtype=torch.int8)
    d = (torch.rand(k2 // 256, n, generator=g) * 1e-3).half()
    heads["q6_k"] = Int8BlockLinear(q6, sc, None, super_scales=d)
    q5 = torch.randint(0, 32, (n, k2), generator=g, dtype=torch.int8)
    heads["q5_k"] = Int8BlockLinear(q5, torch.rand(k2 // 32, n, generator=g) * 0.01, None,
                                    offsets=-torch.rand(k2 // 32, n, generator=g) * 0.05)
    ks = KScales(torch.randint(0, 64, (k2 // 32, n), generator=g, dtype=torch.uint8),
                 torch.randint(0, 64, (k2 // 32, n), generator=g, dtype=torch.uint8),
                 (torch.rand(k2 // 256, n, generator=g) * 1e-3).half(), (torch.rand(k2 // 256, n, generator=g) * 1e-3).half())
    codes2 = torch.randint(0, 16, (n, k2), generator=g, dtype=torch.uint8)
    heads["q4_k"] = Int4Linear(pack_int4(codes2), None, torch.zeros(n, k2 // 32, dtype=torch.uint8), kscales=ks)
    return heads


@pytest.mark.parametrize("kind", ["int8", "q8_0", "int4-g32", "int4-g64", "q4_1", "q6_k", "q5_k", "q4_k"])
def test_quantized_head_logits_are_float32_sums(kind):
    """Each quantized head's ``logits``: float32, the float64 product of its dequantized weight and the
    a8-rounded input to float32 rounding (the reference path without the C kernels: the unrounded input),
    any row alone equal to its row in a batch, and the bf16 ``forward`` still the layers' bits."""
    head = _heads()[kind]
    x = _x(9, head.in_features)
    y = head.logits(x)  # [9, N]
    w = head.dequantize(F32)
    a8 = KERNEL and "C " in head.kernel.name
    _check(y, _a8(x) if a8 else x, w)
    for m in (0, 4):  # batch-invariant: one row (a decode step) gets its batch row's bits
        assert torch.equal(head.logits(x[m : m + 1]), y[m : m + 1])
    assert torch.equal(head._dequant_logits(x), head._dequant_logits(x))  # (the reference is deterministic)
    # the reference head (float32 weight rows) on the same a8-rounded input: the kernel's sums, to rounding
    if a8:
        _check(head._dequant_logits(_a8(x).float()), _a8(x), w)
    assert head(x.bfloat16()).dtype == torch.bfloat16  # the layers' own forward is unchanged


@needs_kernel
@pytest.mark.parametrize("m", [1, 2, 5, 12])
def test_a8_float32_out_is_the_definition(m):
    """The a8 GEMVs on float32 x with float32 out give their definitions' bits (the sums the bf16 path rounds
    last), for every weight layout, at 1 row (the AVX2 rows) and several (the VNNI tiles)."""
    g = torch.Generator().manual_seed(m)
    n = 130
    x = _x(m, 512, seed=m)
    q = torch.randint(-127, 128, (n, 512), generator=g, dtype=torch.int8)
    s = torch.rand(n, generator=g).bfloat16() * 0.01
    bs = (torch.rand(16, n, generator=g) * 0.01).half()
    sc = torch.randint(-128, 128, (32, n), generator=g, dtype=torch.int8)
    d = (torch.rand(2, n, generator=g) * 1e-3).half()
    fs, fo = torch.rand(16, n, generator=g) * 0.01, -torch.rand(16, n, generator=g) * 0.05
    cases = [
        (lambda xx, o: cpu_qgemv.int8_gemv_a8(xx, q, s, out_dtype=o), lambda xx, o: cpu_qgemv.int8_a8_def(xx, q, s, o)),
        (lambda xx, o: cpu_qgemv.int8g_gemv_a8(xx, q, bs, out_dtype=o),
         lambda xx, o: cpu_qgemv.int8g_a8_def(xx, q, bs, out_dtype=o)),
        (lambda xx, o: cpu_qgemv.int8g_gemv_a8(xx, q, sc, super_scales=d, out_dtype=o),
         lambda xx, o: cpu_qgemv.int8g_a8_def(xx, q, sc, super_scales=d, out_dtype=o)),
        (lambda xx, o: cpu_qgemv.int8g_gemv_a8(xx, q, fs, offsets=fo, out_dtype=o),
         lambda xx, o: cpu_qgemv.int8g_a8_def(xx, q, fs, offsets=fo, out_dtype=o)),
    ]
    for i, (run, ref) in enumerate(cases):
        y = run(x, F32)
        assert y.dtype == F32 and torch.equal(y, ref(x, F32)), i
        assert _off_bf16_grid(y) > 0.9, i
        yb = run(x.bfloat16(), torch.bfloat16)  # the layers' path: bf16 in, bf16 out, as before
        assert torch.equal(yb.view(torch.int16), ref(x.bfloat16(), torch.bfloat16).view(torch.int16)), i
        assert torch.equal(run(x.bfloat16(), F32).to(torch.bfloat16).view(torch.int16), yb.view(torch.int16)), i


@needs_kernel
@pytest.mark.parametrize("level", x86_levels())
def test_float32_io_on_every_isa_level(level, tmp_path):
    """Every ISA level's build this CPU runs: float32 x and float32 out give the definitions' bits (the
    scalar, SSSE3, AVX2, AVX-512 and VNNI stores and x loads)."""
    lib = other_isa_build(cpu_qgemv._SOURCE, cpu_qgemv._SIGNATURES, level, tmp_path)
    heads = _heads()
    for m in (1, 3, 9):
        x = _x(m, K, seed=m)
        h = heads["int8"]
        assert torch.equal(cpu_qgemv.int8_gemv_a8(x, h.qweight, h.scales, out_dtype=F32, lib=lib),
                           cpu_qgemv.int8_a8_def(x, h.qweight, h.scales, F32)), (level, m)
        h = heads["q8_0"]
        assert torch.equal(cpu_qgemv.int8g_gemv_a8(x, h.qweight, h.block_scales, out_dtype=F32, lib=lib),
                           cpu_qgemv.int8g_a8_def(x, h.qweight, h.block_scales, out_dtype=F32)), (level, m)
        h = heads["int4-g32"]
        args = (h.packed, h.scales_zeros[:, : h.out_features, 0].t(), h.zeros_u8, h.group_size)
        assert torch.equal(cpu_qgemv.int4_gemv_a8(x, *args, out_dtype=F32, lib=lib),
                           cpu_qgemv.int4_a8_def(x, *args, out_dtype=F32)), (level, m)
        x2 = _x(m, 512, seed=m)
        h = heads["q4_k"]
        ks = h.kscales()
        zeros = torch.zeros(1, dtype=torch.uint8).expand(h.out_features, 512 // 32)
        assert torch.equal(cpu_qgemv.int4k_gemv_a8(x2, h.packed, ks, 512, out_dtype=F32, lib=lib),
                           cpu_qgemv.int4_a8_def(x2, h.packed, ks.scales(), zeros, 32, offsets=ks.offsets(),
                                                 out_dtype=F32)), (level, m)
        w = torch.randn(70, K, generator=torch.Generator().manual_seed(m)).bfloat16()
        xb = x.bfloat16()
        assert torch.equal(cpu_qgemv.bf16_gemv(xb, w, out_dtype=F32, lib=lib),
                           cpu_qgemv.bf16_gemv_def(xb, w, F32)), (level, m)


@pytest.mark.parametrize("dtype,packed", [(torch.bfloat16, False), (torch.float32, False), (torch.float32, True)])
def test_plain_head_logits_are_float32_sums(dtype, packed):
    """A plain head (``Linear``): bf16 weights multiply the bf16-rounded input in float32 and keep the sums
    (the C bf16 GEMV for every row count, so a row's logits do not depend on its batch); float32 weights,
    plain or oneDNN-packed, the float32 GEMM."""
    from llmsys import kernels
    from llmsys.engine.models.base import Linear

    n = 300
    lin = Linear(K, n, bias=False)
    with torch.no_grad():
        lin.weight.copy_(torch.randn(n, K, generator=torch.Generator().manual_seed(3)) * 0.05)
    lin = lin.to(dtype)
    w = lin.weight.detach().clone()
    if packed:
        p = kernels.prepack(lin.weight)
        if p is None:
            pytest.skip("oneDNN cannot pack here")
        lin.weight = torch.nn.Parameter(p, requires_grad=False)
    x = _x(20)
    with torch.inference_mode():
        y = lin.logits(x)
        _check(y, x.to(dtype), w)
        for m in (0, 13):
            one = lin.logits(x[m : m + 1])
            if dtype == torch.bfloat16:
                assert torch.equal(one, y[m : m + 1])  # the C GEMV at every M
            else:
                _check(one, x[m : m + 1], w)


def _llm(path, **kw):
    from llmsys import LLM

    return LLM(str(path), device="cpu", kv_cache_tokens=256, max_num_batched_tokens=64, max_num_seqs=4, progress=False,
               threads=2, **kw)


def _sampled_logits(llm, prompts, max_tokens=4):
    """Generate greedily; every logits tensor the sampler was handed, and the outputs."""
    from llmsys import SamplingParams

    seen = []
    sampler = llm.core.sampler
    orig = sampler.sample

    def spy(logits, *a, **kw):
        seen.append(logits.detach().clone())
        return orig(logits, *a, **kw)

    sampler.sample = spy
    try:
        outs = llm.generate(prompts, SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True, logprobs=5))
    finally:
        sampler.sample = orig
    return seen, outs


@pytest.mark.parametrize("quant", [None, "int8", "int4"])
def test_bf16_model_hands_float32_logits_to_the_sampler_and_scoring(tmp_path, quant):
    """A bf16 model (quantized heads too): the sampler and the scoring path get float32 logits off the bf16
    grid, the head's float32 sums of the final norm's float32 output; greedy tokens are the argmax of them."""
    from llmsys.engine.scoring import prompt_logits

    path = make_hf_model("llama", tmp_path / "m", hidden_size=128, intermediate_size=256)
    llm = _llm(path, dtype="bfloat16", quant=quant)
    model = llm.loaded.model
    prompts = [[5, 17, 99, 200, 31, 7, 8], [300, 12, 4]]
    seen, outs = _sampled_logits(llm, prompts)
    assert seen and all(t.dtype == F32 for t in seen)
    assert min(_off_bf16_grid(t) for t in seen) > 0.9
    ids = prompts[0] + outs[0].token_ids
    lg = prompt_logits(llm.core, ids)  # [L, V]
    assert lg.dtype == F32 and _off_bf16_grid(lg) > 0.9
    # greedy = the argmax of the float32 scoring logits at each generated position (no tie here to break)
    assert lg[len(prompts[0]) - 1 :].argmax(-1)[: len(outs[0].token_ids)].tolist() == outs[0].token_ids
    # the head on the final norm's float32 output: its hidden is float32 (not rounded to the model's bf16)
    with torch.inference_mode():
        h = torch.randn(3, model.args.hidden_size).bfloat16()
        res = torch.randn(3, model.args.hidden_size).bfloat16()
        hf = model.model.norm.forward_f32(h, res)
        assert hf.dtype == F32 and _off_bf16_grid(hf) > 0.9
        assert model.compute_logits(hf).dtype == F32


@pytest.mark.parametrize("placement", [{"cpu": 4, "head": "disk"}, {"cpu": 2, "disk": 2, "head": "disk"}])
def test_streamed_head_gives_the_resident_heads_float32_logits(tmp_path, placement):
    """A bf16 head streamed from disk in row chunks (``StreamedLMHead.logits``): the resident head's float32
    logprobs bit for bit (the C bf16 GEMV computes each row alone, whatever the chunk or batch)."""
    path = make_hf_model("llama", tmp_path / "m", num_hidden_layers=4, hidden_size=128, intermediate_size=256)
    prompts = [[5, 17, 99, 200, 31, 7, 8], [300, 12, 4]]
    _, ref = _sampled_logits(_llm(path, dtype="bfloat16"), prompts)
    llm = _llm(path, dtype="bfloat16", cpu_mem="64MiB", placement=placement)
    assert llm.plan.head.kind == "disk" and type(llm.loaded.model.lm_head).__name__ == "StreamedLMHead"
    seen, got = _sampled_logits(llm, prompts)
    assert [o.token_ids for o in got] == [o.token_ids for o in ref]
    assert [[lp.logprob for lp in o.logprobs] for o in got] == [[lp.logprob for lp in o.logprobs] for o in ref]
    assert all(t.dtype == F32 for t in seen) and min(_off_bf16_grid(t) for t in seen) > 0.9


def test_gemma_soft_cap_runs_on_float32_logits(tmp_path):
    """Gemma 2's final soft cap is applied to the float32 logits: ``cap * tanh(logits / cap)`` of the head's
    float32 sums, bounded by the cap and off the bf16 grid."""
    path = make_hf_model("gemma2", tmp_path / "g")
    llm = _llm(path, dtype="bfloat16")
    model = llm.loaded.model
    cap = model.args.final_logit_softcapping
    with torch.inference_mode():
        hf = model.model.norm.forward_f32(torch.randn(4, model.args.hidden_size).bfloat16())
        raw = model.lm_head.logits(hf)
        got = model.compute_logits(hf)
    assert got.dtype == F32 and torch.equal(got, torch.tanh(raw / cap) * cap)
    assert float(got.abs().max()) <= cap and _off_bf16_grid(got) > 0.9
