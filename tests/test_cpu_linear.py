"""kernels.linear: the per-shape CPU GEMM choice computes F.linear."""

import pytest
import torch
import torch.nn.functional as F

from llmsys import kernels
from llmsys.kernels import cpu_linear, cpu_qgemv

@pytest.mark.parametrize("m", [1, 2, 8, 33])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_linear_matches_f_linear(m, dtype):
    g = torch.Generator().manual_seed(m)
    x = torch.randn(m, 72, generator=g).to(dtype)
    w = torch.randn(130, 72, generator=g).to(dtype)
    b = torch.randn(130, generator=g).to(dtype)
    with torch.inference_mode():
        got = kernels.linear(x, w, b)
    ref = F.linear(x.double(), w.double(), b.double())
    tol = 1e-4 if dtype == torch.float32 else 5e-2
    assert got.dtype == dtype and got.shape == (m, 130)
    assert (got.double() - ref).abs().max().item() < tol * ref.abs().max().item()


def _weights(dtype, n=512, k=256, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, k, generator=g).to(dtype), torch.randn(n, generator=g).to(dtype)


@pytest.mark.parametrize("m", [1, 3, 8])
def test_prepacked_weight_is_bit_identical_to_the_plain_one(m):
    """A resident layer (packed) and the same layer streamed from disk (plain) must agree exactly."""
    dtype = torch.float32  # bf16 is never packed (test_prepack_skips_...)
    w, b = _weights(dtype)
    packed = kernels.prepack(w)
    assert packed is not None and packed.is_mkldnn and packed.shape == w.shape
    x = torch.randn(m, 256, generator=torch.Generator().manual_seed(m)).to(dtype)
    with torch.inference_mode():
        plain, fast = kernels.linear(x, w, b), kernels.linear(x, packed, b)
        fast3d = kernels.linear(x.view(1, m, 256), packed, b)  # [..., K] inputs keep their leading dims
    assert torch.equal(plain, fast) and torch.equal(fast3d.view(m, 512), fast)
    ref = F.linear(x.double(), w.double(), b.double())
    assert (fast.double() - ref).abs().max().item() < 1e-5 * ref.abs().max().item()


@pytest.mark.parametrize("m", [1, 7, 11, 12, 40])
def test_small_float32_weights_take_the_c_gemv_at_every_batch(m):
    """float32 batches on a weight too small to pack run the C float32 GEMV whatever their row count (its
    definition's bits, then y + bias: what the fused decode layers compute), so a row's bits never depend on
    its batch; without the C kernel, torch's F.linear."""
    w, b = _weights(torch.float32, n=200, k=64)  # 12.8K elements: never packed
    x = torch.randn(m, 64, generator=torch.Generator().manual_seed(m))
    with torch.inference_mode():
        got = kernels.linear(x, w, b)
        alone = torch.cat([kernels.linear(x[i : i + 1], w, b) for i in range(m)])
    assert not cpu_linear.packable(w)
    if cpu_linear.f32_gemv_applies(w, b):
        assert torch.equal(got, cpu_qgemv.f32_gemv_def(x, w) + b)
        assert torch.equal(got, alone)
        with torch.inference_mode():  # row chunks of it (a streamed head) give the whole matrix's bits
            parts = torch.cat([kernels.linear(x, w[r : r + 50], b[r : r + 50], rows_of=200) for r in (0, 50, 100, 150)], 1)
        assert torch.equal(parts, got)
    else:
        assert torch.equal(got, F.linear(x, w, b))
    ref = F.linear(x.double(), w.double(), b.double())
    assert (got.double() - ref).abs().max().item() < 1e-5 * ref.abs().max().item()


@pytest.mark.parametrize("m", [1, 7, 8, 11, 12, 40])
def test_bf16_batches_take_the_c_gemv_at_every_batch(m):
    """bf16 batches run the C bf16 GEMV whatever their row count on every CPU with the C kernel (its
    definition's bits, then bf16(y + bias): what the fused decode layers compute), so a row's bits never
    depend on its batch; without it, torch's bf16 linear. The upcast path (weights the GEMV does not take)
    rounds the float32 product once."""
    w, b = _weights(torch.bfloat16, n=1000, k=256)
    x = torch.randn(m, 256, generator=torch.Generator().manual_seed(m)).bfloat16()
    with torch.inference_mode():
        up = cpu_linear._bf16_upcast(x.view(1, m, 256), w, b)  # every CPU: the path itself
        got = kernels.linear(x, w, b)
        alone = torch.cat([kernels.linear(x[i : i + 1], w, b) for i in range(m)])
    assert up.dtype == torch.bfloat16 and up.shape == (1, m, 1000)
    whole = (torch.mm(w.float(), x.float().t()).t() + b.float()).bfloat16()  # one sgemm, bias, one rounding
    assert torch.equal(up[0], whole)  # the weight's row chunks change no bits
    if cpu_linear.bf16_gemv_applies(w, b):
        assert torch.equal(got, cpu_qgemv.bf16_gemv_def(x, w) + b)
        assert torch.equal(got, alone)
    else:
        assert torch.equal(got, F.linear(x, w, b))
    ref = F.linear(x.double(), w.double(), b.double())
    assert (got.double() - ref).abs().max().item() < 1e-2 * ref.abs().max().item()


@pytest.mark.parametrize("n,k", [(896, 4864), (576, 1536), (1536, 576)])
def test_packed_float32_rows_do_not_depend_on_the_batch(n, k):
    """A packed float32 weight gives each row the bits it gets in any batch, one row included (oneDNN's M = 1
    kernel differs in the last bit from its GEMM for K of ~1,500 and more, so a single row runs as two)."""
    w = torch.randn(n, k, generator=torch.Generator().manual_seed(k))
    packed = cpu_linear.prepack(w)
    if packed is None:
        pytest.skip("this torch has no oneDNN linear to pack for")
    x = torch.randn(300, k, generator=torch.Generator().manual_seed(n))
    with torch.inference_mode():
        whole = kernels.linear(x, packed)
        for m in (1, 2, 5, 16, 100):
            assert torch.equal(kernels.linear(x[:m], packed), whole[:m]), m


def test_prepack_skips_what_would_not_pay_or_cannot_pack():
    assert kernels.prepack(torch.randn(64, 64)) is None  # tiny: oneDNN's per-call cost dominates
    assert kernels.prepack(torch.randn(512, 256).bfloat16()) is None  # bf16 stays plain: the C GEMV reads it
    assert kernels.prepack(torch.randn(512, 256).half()) is None
    assert kernels.prepack(torch.randn(256, 512).t()) is None  # not contiguous
    assert kernels.prepack(kernels.prepack(torch.randn(512, 256))) is None  # already packed


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("kind", ["llama", "qwen2"])  # untied and tied heads
def test_engine_prepacks_resident_linears_with_identical_tokens(tmp_path, dtype, kind):
    from tiny_models import make_hf_model

    from llmsys import LLM, SamplingParams

    path = make_hf_model(kind, tmp_path / kind, hidden_size=256, intermediate_size=512, num_attention_heads=4,
                         num_key_value_heads=4)
    kw = dict(dtype=dtype, device="cpu", kv_cache_tokens=512, progress=False)
    packed = LLM(str(path), **kw)
    plain = LLM(str(path), prepack=False, **kw)
    model = packed.loaded.model
    mods = [m for m in model.modules() if hasattr(m, "weight") and type(m).__name__ == "Linear"]
    is_packed = {m: m.weight.is_mkldnn for m in mods}
    packs = dtype == "float32"  # bf16 is never packed: the C bf16 GEMV reads the plain weight at decode
    assert is_packed[model.model.layers[0].mlp.down_proj] == packs  # 256 x 512 = 128K elements: packed
    assert is_packed[model.lm_head] == packs  # tied too: its embedding rows are then read from the checkpoint
    assert not any(m.weight.is_mkldnn for m in plain.loaded.model.modules() if hasattr(m, "weight"))
    # Replaced, not copied; a tied embedding table now lives in the checkpoint file (page cache).
    on_disk = {"disk": 512 * 256 * 4} if kind == "qwen2" and packs else {}  # the float32 checkpoint's table
    assert packed.memory_report().weights == {**plain.memory_report().weights, **on_disk}
    sp = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    prompts = [[5, 17, 99, 200, 31], [7, 7, 300]]
    assert [o.token_ids for o in packed.generate(prompts, sp)] == [o.token_ids for o in plain.generate(prompts, sp)]
