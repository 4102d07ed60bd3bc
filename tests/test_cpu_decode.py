"""The CPU decode kernels (kernels/cpu_decode.c) on bfloat16 and float32 rows against their torch definitions and
the references."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest
import torch

from conftest import other_isa_build, x86_levels
from llmsys import kernels
from llmsys.kernels import cpu_decode
from llmsys.kernels.reference import rms_norm_ref, rope_ref

KERNEL = cpu_decode.available()
needs_kernel = pytest.mark.skipif(not KERNEL, reason=f"C kernel not built: {cpu_decode.kernel_status()}")
BF = torch.bfloat16


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.int16 if t.dtype == BF else torch.int32)


@needs_kernel
@pytest.mark.parametrize("dtype", [BF, torch.float32])
@pytest.mark.parametrize("d", [64, 100, 576, 4096])
def test_rms_norm_is_its_definition_and_hf_within_one_ulp(d, dtype):
    g = torch.Generator().manual_seed(d)
    x = (torch.randn(7, d, generator=g) * 3).to(dtype)
    r = torch.randn(7, d, generator=g).to(dtype)
    w = torch.randn(d, generator=g).to(dtype)
    out = cpu_decode.rms_norm(x, w, 1e-5)
    assert torch.equal(_bits(out), _bits(cpu_decode.rms_norm_def(x, w, 1e-5)))
    out2, h = cpu_decode.rms_norm(x, w, 1e-5, residual=r)
    ref2, href = cpu_decode.rms_norm_def(x, w, 1e-5, residual=r)
    assert torch.equal(_bits(out2), _bits(ref2)) and torch.equal(_bits(h), _bits(x + r))
    # HF's LlamaRMSNorm (the torch reference) sums the squares in another order: at most
    # one rounding step apart, through the normalized value and the weight product.
    hf = rms_norm_ref(x, w, 1e-5)
    assert torch.allclose(out.float(), hf.float(), rtol=2 * 2**-8 if dtype == BF else 1e-5, atol=1e-6)
    # kernels.rms_norm routes CPU bf16 and float32 here, 3-D inputs (per-head q/k norms) included
    assert torch.equal(_bits(kernels.rms_norm(x, w, 1e-5)), _bits(out))
    x3 = x.view(7, -1, d // 4 if d % 4 == 0 else d)
    w3 = w[: x3.shape[-1]].contiguous()
    assert torch.equal(_bits(kernels.rms_norm(x3, w3, 1e-5)), _bits(cpu_decode.rms_norm_def(x3, w3, 1e-5)))


@needs_kernel
@pytest.mark.parametrize("scale", [1.0, 8.0, 60.0])
def test_silu_mul_is_its_definition_and_torch(scale):
    """The C silu * mul (its own exp, cpu_ops.h) against torch.exp in its definition and torch's bf16
    ``F.silu(g) * u``: the same bits on this sweep (the exp's ~1 float ulp vanishes in bf16 rounding but
    at rare ties, which a few differing elements in 10^5 would show)."""
    g = torch.Generator().manual_seed(int(scale))
    gate = (torch.randn(50, 2000, generator=g) * scale).to(BF)
    up = torch.randn(50, 2000, generator=g).to(BF)
    y = cpu_decode.silu_mul(gate, up)
    torch_y = torch.nn.functional.silu(gate) * up
    assert (y != torch_y).sum() <= 10 and (y != cpu_decode.silu_mul_def(gate, up)).sum() <= 10
    exact = torch.nn.functional.silu(gate.double()) * up.double()  # two bf16 roundings from the exact value
    assert ((y.double() - exact).abs() <= exact.abs() * 2**-7 + 1e-30).all()
    gu = torch.cat([gate, up], dim=1)  # strided halves of one gate|up output, and kernels.silu_mul's routing
    assert torch.equal(_bits(cpu_decode.silu_mul(gu[:, :2000], gu[:, 2000:])), _bits(y))
    assert torch.equal(_bits(kernels.silu_mul(gu)), _bits(y))
    edge = torch.tensor([[float("nan"), float("inf"), -float("inf"), -89.0, -88.5, 88.5, 0.0, -0.0, 1e-39, -100.0,
                          3.0, -3.0, 20.0, -20.0, 0.5, -0.5]]).to(BF)
    ones = torch.ones_like(edge)
    assert torch.equal(cpu_decode.silu_mul(edge, ones).isnan(), (torch.nn.functional.silu(edge) * ones).isnan())
    with pytest.raises(ValueError, match=r"silu_mul: gate and up must be bf16 or float32 \[T, I\] of one dtype "
                                         r"with unit column stride, got torch.float32 \(50, 2000\)"):
        cpu_decode.silu_mul(gate.float(), up)
    # float32 rows: the same operations without the roundings, within an ulp or two of torch's exp
    y32 = cpu_decode.silu_mul(gate.float(), up.float())
    assert torch.allclose(y32, cpu_decode.silu_mul_def(gate.float(), up.float()), rtol=4e-7, atol=1e-30)
    assert torch.equal(_bits(kernels.silu_mul(gu.float())), _bits(y32))
    with pytest.raises(ValueError, match=r"silu_mul: the C kernel rejected I=0"):
        cpu_decode.silu_mul(gate[:, :0], up[:, :0])
    finite = ~edge.isnan()
    assert torch.equal(_bits(cpu_decode.silu_mul(edge, ones)[finite]), _bits((torch.nn.functional.silu(edge) * ones)[finite]))


@needs_kernel
@pytest.mark.parametrize("dtype", [BF, torch.float32])
def test_rope_is_the_reference_bit_for_bit_and_stores_kv(dtype):
    g = torch.Generator().manual_seed(1)
    cache = kernels.build_rope_cache(64, 512, 10000.0, None, None)
    fused = torch.randn(5, (9 + 3 + 3) * 64, generator=g).to(dtype)  # a q|k|v GEMM output: strided views
    q, k, v = fused[:, :576].view(5, 9, 64), fused[:, 576:768].view(5, 3, 64), fused[:, 768:].view(5, 3, 64)
    pos = torch.tensor([0, 5, 100, 511, 7])
    qo, ko = cpu_decode.rope(q, k, pos, cache)
    qr, kr = rope_ref(q, k, pos, cache)
    assert torch.equal(_bits(qo), _bits(qr)) and torch.equal(_bits(ko), _bits(kr))
    assert torch.equal(_bits(kernels.rope(q, k, pos, cache)[0]), _bits(qr))
    kp, vp = torch.zeros(20, 3, 64, dtype=dtype), torch.zeros(20, 3, 64, dtype=dtype)
    slots = torch.tensor([3, 19, -1, 0, 8])  # -1: no slot (skipped)
    qs = cpu_decode.rope_store(q, k, v, pos, cache, kp, vp, slots)
    assert torch.equal(_bits(qs), _bits(qr))
    for t, s in enumerate(slots.tolist()):
        if s >= 0:
            assert torch.equal(_bits(kp[s]), _bits(kr[t])) and torch.equal(_bits(vp[s]), _bits(v[t]))
    assert int((kp != 0).any(-1).any(-1).sum()) == 4
    with pytest.raises(ValueError, match="position"):
        cpu_decode.rope(q, k, torch.tensor([0, 1, 2, 512, 3]), cache)
    with pytest.raises(ValueError, match="slot"):
        cpu_decode.rope_store(q, k, v, pos, cache, kp, vp, torch.tensor([3, 20, -1, 0, 8]))


def _attention_inputs(seed: int, B=3, L=40, hq=9, hk=3, d=64, dtype=BF):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, hq, d, generator=g).to(dtype)
    k = torch.randn(B, L, hk, d, generator=g).to(dtype)
    v = torch.randn(B, L, hk, d, generator=g).to(dtype)
    return q, k, v, torch.tensor([L, 7, 23][:B])


@needs_kernel
@pytest.mark.parametrize("d", [64, 80, 40])  # the output 64 elements at a time in registers, + a tail, + no vector
@pytest.mark.parametrize("dtype,tol", [(BF, 2**-8), (torch.float32, 1e-6)])
def test_decode_attention_matches_its_definition_and_float_attention(dtype, tol, d):
    q, k, v, lens = _attention_inputs(2, d=d, dtype=dtype)
    out = cpu_decode.decode_attention(q, k, v, lens, 0.125)
    assert out.dtype == dtype
    ref = cpu_decode.decode_attention_def(q, k, v, lens, 0.125)
    assert (out.float() - ref.float()).abs().max() <= tol * ref.float().abs().max()  # expf vs torch.exp
    for b in range(3):
        n = int(lens[b])
        kb = k[b, :n].double().transpose(0, 1).repeat_interleave(3, 0)  # [Hq, n, D]
        vb = v[b, :n].double().transpose(0, 1).repeat_interleave(3, 0)
        p = torch.softmax(q[b].double().unsqueeze(1) @ kb.transpose(-1, -2) * 0.125, -1)
        exact = (p @ vb).squeeze(1)
        atol = 1e-2 if dtype == BF else 1e-5
        assert torch.allclose(out[b].double(), exact, atol=atol, rtol=atol)


@needs_kernel
@pytest.mark.parametrize("dtype", [BF, torch.float32])
def test_decode_attention_by_slot_equals_gathered_and_is_batch_invariant(dtype):
    q, k, v, lens = _attention_inputs(3, dtype=dtype)
    B, L, hk, d = k.shape
    # the same rows scattered over a pool, read back by slot
    perm = torch.randperm(B * L, generator=torch.Generator().manual_seed(0))
    kp, vp = torch.empty(B * L, hk, d, dtype=dtype), torch.empty(B * L, hk, d, dtype=dtype)
    kp[perm], vp[perm] = k.reshape(-1, hk, d), v.reshape(-1, hk, d)
    slots = perm.view(B, L).clone()
    gathered = cpu_decode.decode_attention(q, k, v, lens, 0.125)
    assert torch.equal(cpu_decode.decode_attention(q, kp, vp, lens, 0.125, slots), gathered)
    for b in range(B):  # each sequence alone gives the bits it got in the batch
        alone = cpu_decode.decode_attention(q[b : b + 1], k[b : b + 1], v[b : b + 1], lens[b : b + 1], 0.125)
        assert torch.equal(alone[0], gathered[b])
    with pytest.raises(ValueError, match="lengths"):
        cpu_decode.decode_attention(q, k, v, torch.tensor([L + 1, 1, 1]), 0.125)


@needs_kernel
@pytest.mark.parametrize("dtype", [BF, torch.float32])
def test_rows_attention_is_each_token_a_decode_step(dtype):
    """Prompt tokens by rows (kernels.cpu_decode.rows_attention): each token, of any sequence, with any first
    key (a sliding window's band), by slot or gathered, gives the bits decode_attention gives it alone, and
    its torch definition's up to the C exp."""
    g = torch.Generator().manual_seed(5)
    S, L, hk, hq, d = 2, 40, 2, 6, 64
    k, v = (torch.randn(S, L, hk, d, generator=g).to(dtype) for _ in range(2))
    seq = torch.tensor([0, 0, 1, 1, 1, 0, 1])
    lens = torch.tensor([5, 40, 1, 17, 33, 22, 40])
    first = torch.tensor([0, 30, 0, 3, 0, 21, 0])
    q = torch.randn(len(seq), hq, d, generator=g).to(dtype)
    got = cpu_decode.rows_attention(q, k, v, seq, lens, 0.125, first)
    for t in range(len(seq)):
        s, f, n = int(seq[t]), int(first[t]), int(lens[t])
        alone = cpu_decode.decode_attention(q[t : t + 1].contiguous(), k[s : s + 1, f:].contiguous(),
                                            v[s : s + 1, f:].contiguous(), torch.tensor([n - f]), 0.125)
        assert torch.equal(got[t], alone[0]), t
    perm = torch.randperm(S * L, generator=g)
    kp, vp = torch.empty(S * L, hk, d, dtype=dtype), torch.empty(S * L, hk, d, dtype=dtype)
    kp[perm], vp[perm] = k.reshape(-1, hk, d), v.reshape(-1, hk, d)
    assert torch.equal(cpu_decode.rows_attention(q, kp, vp, seq, lens, 0.125, first, perm.view(S, L).clone()), got)
    ref = cpu_decode.rows_attention_def(q, k, v, seq, first, lens, 0.125)
    atol = 1e-2 if dtype == BF else 1e-5
    assert torch.allclose(got.float(), ref.float(), atol=atol, rtol=atol)
    with pytest.raises(ValueError, match="key ranges"):
        cpu_decode.rows_attention(q, k, v, seq, lens, 0.125, lens.clone())  # first == lens: no key


def _alone(q, k, v, seq, lens, first, t):
    """Token t's rows_attention computed as decode_attention of that token alone (its keys first .. lens - 1)."""
    s, f, n = int(seq[t]), int(first[t]), int(lens[t])
    return cpu_decode.decode_attention(q[t : t + 1].contiguous(), k[s : s + 1, f:n].contiguous(),
                                       v[s : s + 1, f:n].contiguous(), torch.tensor([n - f]), 0.125)[0]


def _long_prompt(dtype, hq, hk, d):
    """q, k [S, L, Hk, D], v, seq, lens, first: a 230-token prompt after a 37-token prefix (sequence 0) and a
    second sequence's scattered tokens with sliding windows; with extreme values: large scores (exps that
    underflow to 0), -0 queries (all-zero scores), tiny and huge bf16 keys, and a token whose products round
    (lane 0 of token 7, head 0, key 20: -2.9e38 + 2^128 is finite, but 2^128 rounds to inf first)."""
    g = torch.Generator().manual_seed(11 + d + hq)
    S, L = 2, 300
    k, v = (torch.randn(S, L, hk, d, generator=g).to(dtype) for _ in range(2))
    n0 = 230
    seq = torch.cat([torch.zeros(n0, dtype=torch.int64), torch.ones(9, dtype=torch.int64)])
    lens = torch.cat([torch.arange(38, 38 + n0), torch.tensor([1, 300, 129, 128, 16, 17, 250, 251, 299])])
    first = torch.cat([torch.zeros(n0, dtype=torch.int64), torch.tensor([0, 0, 1, 100, 15, 0, 120, 250, 283])])
    q = torch.randn(len(seq), hq, d, generator=g).to(dtype)
    q[5] *= 40
    q[6] = -0.0
    k[0, 3, 0, :3] = torch.tensor([1e-30, -3e-25, 2e30])
    if d >= 32:
        q[7, 0, 0], q[7, 0, 16], k[0, 20, 0, 0], k[0, 20, 0, 16] = -1.7e19, 2.0**64, 1.7e19, 2.0**64
    return q, k, v, seq, lens, first


@needs_kernel
@pytest.mark.parametrize("d", [64, 128, 80, 40])
@pytest.mark.parametrize("hq,hk", [(9, 3), (4, 1), (2, 2)])
@pytest.mark.parametrize("dtype", [BF, torch.float32])
def test_rows_attention_long_prompts_are_decode_steps(dtype, hq, hk, d):
    """A long prompt by rows (the AVX-512 and AVX2 builds take runs of tokens x the heads of a KV head as one
    work item, keys in chunks of 128, scores 16 keys at a time, fused multiply-adds where no product rounds):
    every token (_long_prompt: extreme values too), by slot, on 1 and 2 threads, in any chunking or order, gives
    the bits decode_attention gives it alone."""
    q, k, v, seq, lens, first = _long_prompt(dtype, hq, hk, d)
    S, L = k.shape[:2]
    got = cpu_decode.rows_attention(q, k, v, seq, lens, 0.125, first)
    for t in range(len(seq)):
        assert torch.equal(_bits(got[t]), _bits(_alone(q, k, v, seq, lens, first, t))), t
    perm = torch.randperm(S * L, generator=torch.Generator().manual_seed(1))
    kp, vp = torch.empty(S * L, hk, d, dtype=dtype), torch.empty(S * L, hk, d, dtype=dtype)
    kp[perm], vp[perm] = k.reshape(-1, hk, d), v.reshape(-1, hk, d)
    threads = torch.get_num_threads()
    try:
        for n in (1, 2):
            torch.set_num_threads(n)
            by_slot = cpu_decode.rows_attention(q, kp, vp, seq, lens, 0.125, first, perm.view(S, L).clone())
            assert torch.equal(_bits(by_slot), _bits(got))
    finally:
        torch.set_num_threads(threads)
    # a token's bits do not depend on the tokens around it: the prompt in other chunks, reversed
    for a, b in ((0, 1), (1, 100), (100, 239)):
        part = cpu_decode.rows_attention(q[a:b].contiguous(), k, v, seq[a:b], lens[a:b], 0.125, first[a:b])
        assert torch.equal(_bits(part), _bits(got[a:b]))
    rev = torch.arange(len(seq) - 1, -1, -1)
    assert torch.equal(_bits(cpu_decode.rows_attention(q[rev].contiguous(), k, v, seq[rev], lens[rev], 0.125,
                                                       first[rev])), _bits(got[rev]))


@needs_kernel
@pytest.mark.parametrize("dtype", [BF, torch.float32])
def test_rope_store_attend_is_rope_store_then_attention(dtype):
    """The decode step's one attention call (kernels.cpu_fused_rope_store_attend) gives the bits of
    rope_store then decode_attention by slot, and stores the same K/V."""
    g = torch.Generator().manual_seed(3)
    cache = kernels.build_rope_cache(64, 512, 10000.0, None, None)
    hq, hk, d, t, l = 9, 3, 64, 3, 40
    qkv = torch.randn(t, (hq + 2 * hk) * d, generator=g).to(dtype)
    pools = [torch.randn(256, hk, d, generator=g).to(dtype) for _ in range(2)]
    slots = torch.tensor([39, 100, 201])
    gather = torch.stack([torch.arange(l), torch.arange(61, 61 + l), torch.arange(162, 162 + l)])
    gather[:, -1] = slots
    lens, pos = torch.tensor([l, l - 5, l]), torch.tensor([39, 34, 39])
    gather[1, l - 6] = slots[1]
    k2, v2 = pools[0].clone(), pools[1].clone()
    out = cpu_decode.rope_store_attend(qkv, hq, hk, pos, cache, pools[0], pools[1], slots, lens, 0.125, gather)
    q, k, v = (qkv[:, :hq * d].view(t, hq, d), qkv[:, hq * d:(hq + hk) * d].view(t, hk, d),
               qkv[:, (hq + hk) * d:].view(t, hk, d))
    qr = cpu_decode.rope_store(q, k, v, pos, cache, k2, v2, slots)
    want = cpu_decode.decode_attention(qr, k2, v2, lens, 0.125, gather)
    assert torch.equal(_bits(out), _bits(want.view(t, hq * d)))
    assert torch.equal(_bits(pools[0]), _bits(k2)) and torch.equal(_bits(pools[1]), _bits(v2))
    with pytest.raises(ValueError, match="rope_store_attend: .* lengths outside 1..40"):
        cpu_decode.rope_store_attend(qkv, hq, hk, pos, cache, pools[0], pools[1], slots, lens + 1, 0.125, gather)


@needs_kernel
@pytest.mark.parametrize("level", x86_levels())
def test_other_isas_give_the_same_bits(level, tmp_path):
    """No FMA contraction and a fixed reduction order: every ISA level's build this CPU can run gives the same bits."""
    lib = other_isa_build(cpu_decode._SOURCE, cpu_decode._SIGNATURES, level, tmp_path)
    x = (torch.randn(4, 300) * 2).to(BF)
    w = torch.randn(300).to(BF)
    out = torch.empty_like(x)
    for dtype in (BF, torch.float32):
        f32 = int(dtype == torch.float32)
        x = (torch.randn(4, 300) * 2).to(dtype)
        w = torch.randn(300).to(dtype)
        out = torch.empty_like(x)
        assert lib.llmsys_rms_norm(x.data_ptr(), None, w.data_ptr(), out.data_ptr(), None, 4, 300, 1e-6, f32, 2) == 0
        assert torch.equal(_bits(out), _bits(cpu_decode.rms_norm(x, w, 1e-6)))
        gate, up = (torch.randn(3, 203) * 6).to(dtype), torch.randn(3, 203).to(dtype)  # 203: vector and scalar parts
        y = torch.empty_like(gate)
        assert lib.llmsys_silu_mul(gate.data_ptr(), 203, up.data_ptr(), 203, y.data_ptr(), 3, 203, f32, 2) == 0
        assert torch.equal(y, cpu_decode.silu_mul(gate, up))
    for dtype in (BF, torch.float32):
        q, k, v, lens = _attention_inputs(4, dtype=dtype)
        o = torch.empty_like(q)
        assert lib.llmsys_decode_attention(q.data_ptr(), k.data_ptr(), v.data_ptr(), None, lens.data_ptr(), 0.125,
                                           o.data_ptr(), 3, 40, 9, 3, 64, int(dtype == torch.float32), 2) == 0
        assert torch.equal(o, cpu_decode.decode_attention(q, k, v, lens, 0.125))
        # prompt rows (blocked on AVX-512 and AVX2, per query below) against this CPU's build
        for hq, hk, d in ((9, 3, 80), (4, 1, 64)):
            ql, kl, vl, seq_l, lens_l, first_l = _long_prompt(dtype, hq, hk, d)
            o = torch.empty_like(ql)
            assert lib.llmsys_rows_attention(ql.data_ptr(), kl.data_ptr(), vl.data_ptr(), None, seq_l.data_ptr(),
                                             first_l.data_ptr(), lens_l.data_ptr(), 0.125, o.data_ptr(), len(seq_l),
                                             kl.shape[1], hq, hk, d, int(dtype == torch.float32), 2) == 0
            want = cpu_decode.rows_attention(ql, kl, vl, seq_l, lens_l, 0.125, first_l)
            assert torch.equal(_bits(o), _bits(want)), (hq, hk, d)


def test_without_the_kernel_the_torch_paths_run(tmp_path):
    """LLMSYS_NO_CKERNELS=1: the references run (kernels.rms_norm = HF's), and a bf16 model still decodes."""
    code = textwrap.dedent("""
        import torch
        from llmsys import kernels
        from llmsys.kernels import cpu_decode
        from llmsys.kernels.reference import rms_norm_ref
        x, w = torch.randn(3, 64).bfloat16(), torch.randn(64).bfloat16()
        same = torch.equal(kernels.rms_norm(x, w, 1e-6), rms_norm_ref(x, w, 1e-6))
        q, k, v = torch.randn(2, 4, 8).bfloat16(), torch.randn(2, 5, 2, 8).bfloat16(), torch.randn(2, 5, 2, 8).bfloat16()
        lens = torch.tensor([5, 3])
        att = torch.equal(cpu_decode.decode_attention(q, k, v, lens, 0.3), cpu_decode.decode_attention_def(q, k, v, lens, 0.3))
        print(cpu_decode.kernel_status(), same, att)
    """)
    env = {**os.environ, "LLMSYS_HOME": str(tmp_path), "LLMSYS_NO_CKERNELS": "1"}
    res = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=240)
    assert res.returncode == 0, res.stderr
    assert res.stdout.strip().splitlines()[-1] == "disabled by LLMSYS_NO_CKERNELS True True"
    assert not list(tmp_path.glob("kernels/*.so"))


@needs_kernel
def test_bad_inputs_are_one_line_errors():
    """Each check in front of the C kernels names what is wrong (the kernels index raw memory)."""
    cache = kernels.build_rope_cache(64, 16, 10000.0, None, None)
    q, k = torch.randn(2, 4, 64).to(BF), torch.randn(2, 2, 64).to(BF)
    pos = torch.tensor([0, 1])
    with pytest.raises(ValueError, match="heads of q and k must be contiguous"):
        cpu_decode.rope(q.transpose(0, 1).contiguous().transpose(0, 1), k, pos, cache)
    odd = kernels.build_rope_cache(64, 16, 10000.0, None, None)[:, :63].contiguous()
    with pytest.raises(ValueError, match="head_dim must be even"):
        cpu_decode.rope(q[..., :63].contiguous(), k[..., :63].contiguous(), pos, odd)
    with pytest.raises(ValueError, match="rope: q and k must share a dtype, got torch.bfloat16 and torch.float32"):
        cpu_decode.rope(q, k.float(), pos, cache)
    kp, vp = torch.zeros(4, 2, 64, dtype=BF), torch.zeros(4, 2, 64, dtype=BF)
    with pytest.raises(ValueError, match="rope_store: q, k, v and the pools must share a dtype"):
        cpu_decode.rope_store(q.float(), k.float(), k.float(), pos, cache, kp, vp, torch.tensor([0, 1]))
    qa, ka, va, lens = _attention_inputs(7)
    with pytest.raises(ValueError, match="all be bfloat16 or all float32"):
        cpu_decode.decode_attention(qa, ka.float(), va, lens, 0.125)
    w = torch.ones((1 << 20) + 1, dtype=BF)
    with pytest.raises(RuntimeError, match="rejected D=1048577"):
        cpu_decode.rms_norm(torch.ones(1, (1 << 20) + 1, dtype=BF), w, 1e-6)
