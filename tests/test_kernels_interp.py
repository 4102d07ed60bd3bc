"""Every Triton kernel vs its torch reference, run by the Triton interpreter on CPU.

Only meaningful with TRITON_INTERPRET=1 set before triton is first imported,
so tests/test_kernels.py::test_triton_kernels_under_interpreter runs this file
in a fresh subprocess with the flag; a plain pytest run skips it as a module.
To run it by hand: ``TRITON_INTERPRET=1 python -m pytest tests/test_kernels_interp.py``.

Tolerances (Triton vs reference): float32 1e-5 abs/rel (attention, matmuls:
1e-4 abs for accumulations over K); bf16/fp16 one rounding step (2e-2; the
interpreter truncates f32 -> bf16 instead of rounding);
kv_store codes and scales exact (same float32 operations).
Shapes are tiny: the interpreter runs numpy per program.
"""

from __future__ import annotations

import os

import pytest
import torch

if os.environ.get("TRITON_INTERPRET") != "1":
    pytest.skip(
        "needs TRITON_INTERPRET=1 before triton import; run via tests/test_kernels.py",
        allow_module_level=True,
    )
pytest.importorskip("triton")

from llmsys import kernels as K  # noqa: E402

torch.set_num_threads(1)

F32 = dict(atol=1e-5, rtol=1e-5)
LOW = dict(atol=2e-2, rtol=2e-2)


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)


def both(fn, *args, **kwargs):
    return fn(*args, **kwargs, impl="triton"), fn(*args, **kwargs, impl="reference")


def _close(a, b, **tol):
    torch.testing.assert_close(a.float(), b.float(), **tol)


# ------------------------------------------------------------------ elementwise


@pytest.mark.parametrize("shape", [(1, 8), (3, 37), (2, 3, 64)])
@pytest.mark.parametrize("with_residual", [False, True])
def test_rms_norm(shape, with_residual):
    x, w = torch.randn(shape), torch.randn(shape[-1])
    r = torch.randn(shape) if with_residual else None
    got, want = both(K.rms_norm, x, w, 1e-6, r)
    if with_residual:
        _close(got[0], want[0], **F32)
        _close(got[1], want[1], atol=0, rtol=0)
    else:
        _close(got, want, **F32)


def test_rms_norm_bf16():
    x, w = torch.randn(3, 40).bfloat16(), torch.randn(40).bfloat16()
    r = torch.randn(3, 40).bfloat16()
    (out, res), (out_r, res_r) = both(K.rms_norm, x, w, 1e-5, r)
    assert out.dtype == torch.bfloat16
    # Not bit-exact here: the interpreter truncates f32 -> bf16 where GPUs and
    # torch round to nearest even, so allow one bf16 step.
    _close(res, res_r, **LOW)
    _close(out, out_r, **LOW)


@pytest.mark.parametrize("hq,hk,d", [(4, 4, 16), (8, 2, 10), (8, 1, 32)])
def test_rope_strided_qk(hq, hk, d):
    t = 5
    cache = K.build_rope_cache(d, 64, 10000.0, {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                                 "high_freq_factor": 4.0, "original_max_position_embeddings": 16})
    qkv = torch.randn(t, (hq + 2 * hk) * d)  # q and k as strided views of a fused projection
    q = qkv[:, : hq * d].view(t, hq, d)
    k = qkv[:, hq * d : (hq + hk) * d].view(t, hk, d)
    pos = torch.tensor([0, 3, 17, 63, 1])
    (gq, gk), (wq, wk) = both(K.rope, q, k, pos, cache)
    _close(gq, wq, **F32)
    _close(gk, wk, **F32)


@pytest.mark.parametrize("dtype,tol", [(torch.float32, F32), (torch.float16, LOW)])
def test_silu_mul(dtype, tol):
    x = torch.randn(2, 3, 2 * 37).to(dtype)
    got, want = both(K.silu_mul, x)
    assert got.shape == (2, 3, 37)
    _close(got, want, **tol)


# ------------------------------------------------------------- quant matmul


@pytest.mark.parametrize("m", [1, 3, 8, 9, 33])  # <= 8: GEMV kernel, > 8: tl.dot GEMM
def test_w8a16(m):
    n, k = 70, 45
    x = torch.randn(m, k)
    q = torch.randint(-127, 128, (n, k), dtype=torch.int8)
    s = torch.rand(n) * 0.02
    got, want = both(K.w8a16_matmul, x, q, s)
    _close(got, want, atol=1e-4, rtol=1e-5)


def test_w8a16_fp16_strided_x():
    x = torch.randn(20, 64).half()[:, :48]  # row stride 64
    q = torch.randint(-127, 128, (24, 48), dtype=torch.int8)
    s = (torch.rand(24) * 0.02).half()
    got, want = both(K.w8a16_matmul, x, q, s)
    _close(got, want, **LOW)


@pytest.mark.parametrize("m", [1, 5, 17])
@pytest.mark.parametrize("k,group_size", [(50, 16), (64, 32)])  # K < Kp (padding) and K == Kp
def test_w4a16(m, k, group_size):
    n = 37
    groups = -(-k // group_size)
    codes = torch.randint(0, 16, (n, groups * group_size))
    scales, zeros = torch.rand(n, groups) * 0.1, torch.rand(n, groups) * 15
    x = torch.randn(m, k)
    got, want = both(K.w4a16_matmul, x, K.pack_int4(codes), scales, zeros, group_size)
    _close(got, want, atol=1e-4, rtol=1e-5)


@pytest.mark.parametrize("m,dtype", [(2, torch.bfloat16), (2, torch.float16), (20, torch.float16)])
def test_w4a16_half(m, dtype):
    # bf16 only on the GEMV path: the interpreter's tl.dot multiplies bf16 bit
    # patterns as uint16 (numpy has no bf16), so bf16 GEMM/attention can only
    # be checked on a GPU; fp16 exercises the same half-precision dot here.
    codes = torch.randint(0, 16, (16, 64))
    scales, zeros = (torch.rand(16, 2) * 0.1).to(dtype), torch.full((16, 2), 8.0).to(dtype)
    x = torch.randn(m, 64).to(dtype)
    got, want = both(K.w4a16_matmul, x, K.pack_int4(codes), scales, zeros, 32)
    _close(got, want, **LOW)


# ------------------------------------------------------------- paged KV cache


def _tables(lens, block_size, seed=0):
    g = torch.Generator().manual_seed(seed)
    max_blocks = max(-(-n // block_size) for n in lens) + 1
    num_blocks = len(lens) * max_blocks + 2
    perm = torch.randperm(num_blocks, generator=g)[: len(lens) * max_blocks]
    return perm.view(len(lens), max_blocks).to(torch.int32), num_blocks


def _slots(lens, tables, block_size):
    out = []
    for b, n in enumerate(lens):
        t = torch.arange(n)
        out.append(tables[b].long()[t // block_size] * block_size + t % block_size)
    return torch.cat(out)


@pytest.mark.parametrize("cache_dtype", [torch.float32, torch.bfloat16, torch.int8])
@pytest.mark.parametrize("block_size", [8, 16])
def test_kv_store(cache_dtype, block_size):
    lens, hk, d = [3, 17], 2, 12
    tables, nb = _tables(lens, block_size)
    slots = _slots(lens, tables, block_size)
    slots = torch.cat([slots, torch.tensor([-1])])  # padding token: skipped
    src = torch.float32 if cache_dtype == torch.int8 else cache_dtype
    k = torch.randn(len(slots), hk, 2 * d).to(src)[:, :, :d]  # strided like a fused qkv view
    v = torch.randn(len(slots), hk, d).to(src)
    caches = []
    for impl in ("triton", "reference"):
        kc = torch.zeros(nb, block_size, hk, d, dtype=cache_dtype)
        vc = torch.zeros_like(kc)
        ks = torch.zeros(nb, block_size, hk) if cache_dtype == torch.int8 else None
        vs = torch.zeros(nb, block_size, hk) if cache_dtype == torch.int8 else None
        K.kv_store(k, v, kc, vc, slots, ks, vs, impl=impl)
        caches.append((kc, vc, ks, vs))
    for got, want in zip(*caches):
        if want is not None:
            assert torch.equal(got, want)
    assert caches[0][0].any()


def _decode_case(lens, hq, hk, d, block_size, cache_dtype, seed=0):
    tables, nb = _tables(lens, block_size, seed)
    slots = _slots(lens, tables, block_size)
    src = torch.float32 if cache_dtype == torch.int8 else cache_dtype
    kc = torch.zeros(nb, block_size, hk, d, dtype=cache_dtype)
    vc = torch.zeros_like(kc)
    ks = torch.zeros(nb, block_size, hk) if cache_dtype == torch.int8 else None
    vs = torch.zeros(nb, block_size, hk) if cache_dtype == torch.int8 else None
    K.kv_store(torch.randn(len(slots), hk, d).to(src), torch.randn(len(slots), hk, d).to(src),
               kc, vc, slots, ks, vs, impl="reference")
    q = torch.randn(len(lens), hq, d).to(src)
    return q, kc, vc, ks, vs, tables, torch.tensor(lens, dtype=torch.int32)


@pytest.mark.parametrize(
    "hq,hk,block_size,partition",
    [
        (4, 4, 8, 16),  # MHA, many partitions per sequence
        (8, 2, 16, 16),  # GQA 4
        (8, 1, 8, 32),  # GQA 8
        (8, 1, 16, 512),  # single partition
    ],
)
def test_paged_decode_attention_f32(hq, hk, block_size, partition):
    lens = [1, 8, 9, 17, 40]  # block boundaries and partition boundaries crossed
    q, kc, vc, _, _, tables, cl = _decode_case(lens, hq, hk, 16, block_size, torch.float32)
    got = K.paged_decode_attention(q, kc, vc, tables, cl, 0.25, return_scores=True,
                                   partition_size=partition, impl="triton")
    want = K.paged_decode_attention(q, kc, vc, tables, cl, 0.25, return_scores=True, impl="reference")
    for g, w in zip(got, want):
        _close(g, w, **F32)
    assert torch.equal(got.token_mass == 0, want.token_mass == 0)


def test_paged_decode_attention_small_head_dim_no_scores():
    # head_dim 8 (stories260k) is padded to 16 lanes for tl.dot.
    q, kc, vc, _, _, tables, cl = _decode_case([5, 12], 8, 4, 8, 8, torch.float32)
    got = K.paged_decode_attention(q, kc, vc, tables, cl, 0.35, partition_size=16, impl="triton")
    want = K.paged_decode_attention(q, kc, vc, tables, cl, 0.35, impl="reference")
    _close(got, want, **F32)


@pytest.mark.parametrize("block_size", [8, 16])
def test_paged_decode_attention_int8(block_size):
    q, kc, vc, ks, vs, tables, cl = _decode_case([3, 20, 33], 8, 2, 16, block_size, torch.int8)
    got = K.paged_decode_attention(q, kc, vc, tables, cl, 0.25, ks, vs, return_scores=True,
                                   partition_size=16, impl="triton")
    want = K.paged_decode_attention(q, kc, vc, tables, cl, 0.25, ks, vs, return_scores=True,
                                    impl="reference")
    for g, w in zip(got, want):
        _close(g, w, **F32)


def test_paged_decode_attention_fp16():
    # fp16, not bf16: see test_w4a16_half about the interpreter's bf16 tl.dot.
    q, kc, vc, _, _, tables, cl = _decode_case([7, 26], 4, 2, 16, 8, torch.float16)
    got = K.paged_decode_attention(q, kc, vc, tables, cl, 0.25, partition_size=16, impl="triton")
    want = K.paged_decode_attention(q, kc, vc, tables, cl, 0.25, impl="reference")
    assert got.dtype == torch.float16
    _close(got, want, **LOW)
