"""llmsys.kernels: references vs naive formulas / Hugging Face, input checks,
dispatch, the no-triton fallback, and (in a subprocess under
TRITON_INTERPRET=1) every Triton kernel vs its reference.

Tolerances: float32 references vs float64 naive formulas 1e-5 (abs+rel);
HF comparisons in float32 are exact or 1e-6; bf16 RMSNorm vs HF exact.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from llmsys import kernels as K

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)


def _close(a, b, atol=1e-5, rtol=1e-5):
    torch.testing.assert_close(a.double(), b.double(), atol=atol, rtol=rtol)


# ------------------------------------------------------------------ RMSNorm


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rms_norm_ref_matches_hf(dtype):
    llama = pytest.importorskip("transformers.models.llama.modeling_llama")
    norm = llama.LlamaRMSNorm(37, eps=1e-5)
    with torch.no_grad():
        norm.weight.copy_(torch.randn(37))
    norm = norm.to(dtype)
    x = torch.randn(2, 3, 37).to(dtype)
    with torch.no_grad():
        want = norm(x)
    got = K.rms_norm(x, norm.weight.detach(), 1e-5)
    assert got.dtype == dtype
    assert torch.equal(got, want)


def test_rms_norm_residual_is_norm_of_sum():
    x, r, w = torch.randn(4, 24), torch.randn(4, 24), torch.randn(24)
    out, new_res = K.rms_norm(x, w, 1e-6, residual=r)
    s = x.double() + r.double()
    want = w.double() * s / torch.sqrt(s.pow(2).mean(-1, keepdim=True) + 1e-6)
    _close(new_res, s)
    _close(out, want)


# --------------------------------------------------------------------- RoPE


@pytest.mark.parametrize(
    "rope_parameters",
    [
        {"rope_type": "default", "rope_theta": 10000.0},
        {"rope_type": "linear", "factor": 2.0, "rope_theta": 10000.0},
        {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
         "high_freq_factor": 4.0, "original_max_position_embeddings": 64},
    ],
)
def test_rope_cache_and_rotation_match_hf(rope_parameters):
    transformers = pytest.importorskip("transformers")
    llama = pytest.importorskip("transformers.models.llama.modeling_llama")
    head_dim, heads, max_pos = 16, 4, 256
    cfg = transformers.LlamaConfig(
        hidden_size=head_dim * heads, num_attention_heads=heads, num_key_value_heads=2,
        head_dim=head_dim, max_position_embeddings=max_pos, rope_parameters=dict(rope_parameters),
    )
    emb = llama.LlamaRotaryEmbedding(cfg)
    scaling = {k: v for k, v in rope_parameters.items() if k != "rope_theta"}
    inv = K.rope_inv_freq(head_dim, rope_parameters["rope_theta"], scaling)
    assert torch.equal(inv, emb.inv_freq)
    cache = K.build_rope_cache(head_dim, max_pos, rope_parameters["rope_theta"], scaling)
    assert cache.shape == (max_pos, head_dim) and cache.dtype == torch.float32

    pos = torch.tensor([0, 1, 5, 63, 64, 200, 255])
    q = torch.randn(len(pos), heads, head_dim)
    k = torch.randn(len(pos), 2, head_dim)
    cos, sin = emb(q, pos[None])  # [1, T, D]
    assert torch.equal(cache[pos, : head_dim // 2], cos[0, :, : head_dim // 2])
    assert torch.equal(cache[pos, head_dim // 2 :], sin[0, :, : head_dim // 2])
    want_q, want_k = llama.apply_rotary_pos_emb(
        q.transpose(0, 1)[None], k.transpose(0, 1)[None], cos, sin
    )  # [1, H, T, D]
    got_q, got_k = K.rope(q, k, pos, cache)
    _close(got_q, want_q[0].transpose(0, 1), atol=1e-6, rtol=1e-6)
    _close(got_k, want_k[0].transpose(0, 1), atol=1e-6, rtol=1e-6)


def test_rope_cache_rejects_unknown_type():
    with pytest.raises(ValueError, match="yarn"):
        K.build_rope_cache(16, 8, 10000.0, {"rope_type": "yarn", "factor": 4.0})
    with pytest.raises(ValueError, match="low_freq_factor"):
        K.build_rope_cache(16, 8, 10000.0, {"rope_type": "llama3", "factor": 8.0})


# ----------------------------------------------------------------- SiLU-mul


def test_silu_mul_ref_naive():
    x = torch.randn(3, 5, 2 * 11)
    g, u = x[..., :11].double(), x[..., 11:].double()
    _close(K.silu_mul(x), g * torch.sigmoid(g) * u)


# ------------------------------------------------------------- quant matmul


def test_w8a16_ref_naive():
    x = torch.randn(5, 19)
    q = torch.randint(-127, 128, (7, 19), dtype=torch.int8)
    s = torch.rand(7) * 0.02
    want = torch.zeros(5, 7, dtype=torch.float64)
    for n in range(7):
        want[:, n] = x.double() @ (q[n].double() * s[n].double())
    _close(K.w8a16_matmul(x, q, s), want)


def test_int4_pack_layout():
    codes = torch.tensor([[1, 2, 15, 0, 3, 4]])
    packed = K.pack_int4(codes)
    assert packed.dtype == torch.uint8
    assert packed.tolist() == [[0x21, 0x0F, 0x43]]  # low nibble = even k
    assert torch.equal(K.unpack_int4(packed), codes.to(torch.uint8))


def test_w4a16_ref_naive_with_k_padding():
    n, k, gs = 6, 21, 8
    groups = 3  # Kp = 24 > K = 21
    codes = torch.randint(0, 16, (n, groups * gs))
    scales, zeros = torch.rand(n, groups) * 0.1, torch.rand(n, groups) * 15
    x = torch.randn(4, k)
    want = torch.zeros(4, n, dtype=torch.float64)
    for i in range(n):
        for j in range(k):  # x is zero beyond K, so only k < K matters
            w = (codes[i, j] - zeros[i, j // gs].double()) * scales[i, j // gs].double()
            want[:, i] += x[:, j].double() * w
    got = K.w4a16_matmul(x, K.pack_int4(codes), scales, zeros, gs)
    _close(got, want)


# ------------------------------------------------------------- paged KV cache


def test_quantize_int8_ref_bounds():
    x = torch.randn(10, 3, 16)
    x[0, 0] = 0.0
    q, s = K.quantize_int8_ref(x)
    assert q.dtype == torch.int8 and s.shape == (10, 3)
    assert s[0, 0] == 0 and not q[0, 0].any()
    err = (q.float() * s[..., None] - x).abs()
    assert bool((err <= s[..., None] / 2 + 1e-7).all())
    amax_codes = q.abs().amax(-1)
    amax_codes[0, 0] = 127  # the all-zero vector
    assert bool((amax_codes == 127).all())  # each vector's amax maps to +-127


def _paged_case(lens, qlens, hq, hk, d, bs, dtype):
    """A paged pool of ``lens`` contexts (``_paged_setup``) plus ``qlens`` new queries per sequence: the pool,
    the packed queries' start offsets, ``q [sum(qlens), hq, d]`` (float32 for an int8 pool) and its dtype."""
    kc, vc, ks, vs, tables, _, _ = _paged_setup(lens, hk, d, bs, dtype=dtype)
    starts = [0]
    for q_ in qlens:
        starts.append(starts[-1] + q_)
    qdtype = torch.float32 if dtype == torch.int8 else dtype
    q = torch.randn(starts[-1], hq, d, generator=torch.Generator().manual_seed(3)).to(qdtype)
    return kc, vc, ks, vs, tables, starts, q, qdtype


def _paged_setup(lens, hk, d, block_size, dtype=torch.float32, seed=0):
    """Random K/V per sequence stored through kv_store into shuffled blocks.

    Returns (k_cache, v_cache, k_scale, v_scale, block_tables, dense K list, dense V list).
    """
    g = torch.Generator().manual_seed(seed)
    max_blocks = max(-(-n // block_size) for n in lens) + 1
    num_blocks = len(lens) * max_blocks + 3
    tables = torch.randperm(num_blocks, generator=g)[: len(lens) * max_blocks]
    tables = tables.view(len(lens), max_blocks).to(torch.int32)
    shape = (num_blocks, block_size, hk, d)
    kc = torch.zeros(shape, dtype=dtype)
    vc = torch.zeros(shape, dtype=dtype)
    ks = torch.zeros(shape[:3]) if dtype == torch.int8 else None
    vs = torch.zeros(shape[:3]) if dtype == torch.int8 else None
    dense_k, dense_v = [], []
    for b, n in enumerate(lens):
        kk = torch.randn(n, hk, d, generator=g)
        vv = torch.randn(n, hk, d, generator=g)
        t = torch.arange(n)
        slots = tables[b].long()[t // block_size] * block_size + t % block_size
        src_dtype = torch.float32 if dtype == torch.int8 else dtype
        K.kv_store(kk.to(src_dtype), vv.to(src_dtype), kc, vc, slots, ks, vs)
        dense_k.append(kk)
        dense_v.append(vv)
    return kc, vc, ks, vs, tables, dense_k, dense_v


def test_kv_store_ref_slots_and_skip():
    kc = torch.zeros(4, 8, 2, 4)
    vc = torch.zeros(4, 8, 2, 4)
    k, v = torch.randn(3, 2, 4), torch.randn(3, 2, 4)
    K.kv_store(k, v, kc, vc, torch.tensor([13, -1, 0]))
    assert torch.equal(kc[1, 5], k[0]) and torch.equal(vc[0, 0], v[2])
    assert int((kc != 0).any(-1).any(-1).sum()) == 2  # the -1 token wrote nothing


@pytest.mark.parametrize("hq,hk", [(4, 4), (8, 2), (8, 1)])
@pytest.mark.parametrize("block_size", [8, 16])
def test_paged_decode_ref_vs_dense(hq, hk, block_size):
    lens, d, scale = [1, 8, 9, 23], 16, 0.3
    kc, vc, _, _, tables, dk, dv = _paged_setup(lens, hk, d, block_size)
    q = torch.randn(len(lens), hq, d)
    res = K.paged_decode_attention(q, kc, vc, tables, torch.tensor(lens, dtype=torch.int32), scale,
                                   return_scores=True)
    assert res.token_mass.shape == (len(lens), hk, tables.shape[1] * block_size)
    assert res.block_max.shape == (len(lens), hk, tables.shape[1])
    for b, n in enumerate(lens):
        kk = dk[b].double().repeat_interleave(hq // hk, 1)  # [L, Hq, D]
        vv = dv[b].double().repeat_interleave(hq // hk, 1)
        logits = torch.einsum("hd,lhd->hl", q[b].double(), kk) * scale
        p = torch.exp(logits - logits.amax(-1, keepdim=True))
        p = p / p.sum(-1, keepdim=True)  # [Hq, L]
        _close(res.out[b], torch.einsum("hl,lhd->hd", p, vv))
        mass = p.view(hk, hq // hk, n).sum(1)
        _close(res.token_mass[b, :, :n], mass)
        assert not res.token_mass[b, :, n:].any()
        for j in range(tables.shape[1]):
            lo, hi = j * block_size, min((j + 1) * block_size, n)
            want = mass[:, lo:hi].amax(-1) if hi > lo else torch.zeros(hk, dtype=torch.float64)
            _close(res.block_max[b, :, j], want)


def test_paged_decode_ref_int8_close_to_float():
    lens, hk, d = [5, 17], 2, 16
    kc, vc, _, _, tables, dk, dv = _paged_setup(lens, hk, d, 8)
    kq, vq, ks, vs, tables_q, _, _ = _paged_setup(lens, hk, d, 8, dtype=torch.int8)
    q = torch.randn(2, 4, d)
    cl = torch.tensor(lens, dtype=torch.int32)
    exact = K.paged_decode_attention(q, kc, vc, tables, cl, 0.25)
    approx = K.paged_decode_attention(q, kq, vq, tables_q, cl, 0.25, ks, vs)
    assert 0 < (exact - approx).abs().max() < 0.05  # int8 noise, not garbage


@pytest.mark.parametrize("hq,hk", [(4, 4), (8, 2)])
def test_paged_prefill_ref_vs_dense_causal(hq, hk):
    lens, qlens, d, scale = [7, 12, 3], [7, 4, 1], 8, 0.35
    kc, vc, _, _, tables, dk, dv = _paged_setup(lens, hk, d, 8)
    starts = torch.tensor([0, 7, 11, 12])
    q = torch.randn(12, hq, d)
    got = K.paged_prefill_attention(q, kc, vc, tables, torch.tensor(lens, dtype=torch.int32),
                                    starts, scale)
    for b, (n, m) in enumerate(zip(lens, qlens)):
        kk = dk[b].double().repeat_interleave(hq // hk, 1)
        vv = dv[b].double().repeat_interleave(hq // hk, 1)
        for i in range(m):
            pos = n - m + i  # absolute position of this query token
            logits = torch.einsum("hd,lhd->hl", q[starts[b] + i].double(), kk[: pos + 1]) * scale
            want = torch.einsum("hl,lhd->hd", torch.softmax(logits, -1), vv[: pos + 1])
            _close(got[starts[b] + i], want)


def test_prefill_single_token_equals_decode():
    lens, hk, d = [9, 16], 2, 16
    kc, vc, _, _, tables, _, _ = _paged_setup(lens, hk, d, 8)
    q = torch.randn(2, 8, d)
    cl = torch.tensor(lens, dtype=torch.int32)
    dec = K.paged_decode_attention(q, kc, vc, tables, cl, 0.25)
    pre = K.paged_prefill_attention(q, kc, vc, tables, cl, torch.tensor([0, 1, 2]), 0.25)
    _close(dec, pre)


# ------------------------------------------------------------ input checks


def _bad_calls():
    x, w = torch.randn(2, 8), torch.randn(8)
    kc = torch.zeros(4, 8, 2, 16)
    tables = torch.zeros(1, 2, dtype=torch.int32)
    cl = torch.ones(1, dtype=torch.int32)
    q = torch.randn(1, 4, 16)
    return {
        "rms_norm dtype": (lambda: K.rms_norm(x.long(), w), "x dtype"),
        "rms_norm weight shape": (lambda: K.rms_norm(x, torch.randn(7)), "weight must have shape"),
        "rms_norm strided": (lambda: K.rms_norm(torch.randn(8, 2).t(), w), "contiguous"),
        "rms_norm residual": (lambda: K.rms_norm(x, w, 1e-6, x.half()), "residual dtype"),
        "rope odd": (lambda: K.rope(torch.randn(2, 1, 7), torch.randn(2, 1, 7), torch.zeros(2, dtype=torch.long),
                                    torch.zeros(4, 7)), "even"),
        "rope positions": (lambda: K.rope(torch.randn(2, 1, 8), torch.randn(2, 1, 8), torch.zeros(2, dtype=torch.int32),
                                          torch.zeros(4, 8)), "positions dtype"),
        "silu odd": (lambda: K.silu_mul(torch.randn(2, 7)), "even"),
        "w8 dtype": (lambda: K.w8a16_matmul(x, torch.zeros(3, 8), torch.ones(3)), "qweight dtype"),
        "w8 K": (lambda: K.w8a16_matmul(x, torch.zeros(3, 9, dtype=torch.int8), torch.ones(3)), "qweight must have"),
        "w4 group": (lambda: K.w4a16_matmul(x, torch.zeros(3, 4, dtype=torch.uint8), torch.ones(3, 1),
                                            torch.ones(3, 1), 3), "group_size"),
        "w4 scales": (lambda: K.w4a16_matmul(x, torch.zeros(3, 4, dtype=torch.uint8), torch.ones(3, 2),
                                             torch.ones(3, 1), 8), "scales must have shape"),
        "w4 K too big": (lambda: K.w4a16_matmul(torch.randn(2, 12), torch.zeros(3, 4, dtype=torch.uint8),
                                                torch.ones(3, 1), torch.ones(3, 1), 8), "Kp=8"),
        "decode gqa": (lambda: K.paged_decode_attention(torch.randn(1, 3, 16), kc, kc, tables, cl, 1.0),
                       "multiple of KV heads"),
        "decode tables dtype": (lambda: K.paged_decode_attention(q, kc, kc, tables.long(), cl, 1.0),
                                "block_tables dtype"),
        "decode int8 no scale": (lambda: K.paged_decode_attention(q, kc.to(torch.int8), kc.to(torch.int8),
                                                                  tables, cl, 1.0), "k_scale is required"),
        "decode cache dtype": (lambda: K.paged_decode_attention(q.half(), kc, kc, tables, cl, 1.0),
                               "must equal q dtype"),
        "decode too long": (lambda: K.paged_decode_attention(q, kc, kc, tables, cl * 17, 1.0), "capacity"),
        "decode partition": (lambda: K.paged_decode_attention(q, kc, kc, tables, cl, 1.0, partition_size=24),
                             "partition_size"),
        "decode impl": (lambda: K.paged_decode_attention(q, kc, kc, tables, cl, 1.0, impl="cuda"), "impl must"),
        "kv_store slots": (lambda: K.kv_store(torch.randn(1, 2, 16), torch.randn(1, 2, 16), kc, kc.clone(),
                                              torch.zeros(1, dtype=torch.int32)), "slot_mapping dtype"),
        "kv_store cache strided": (lambda: K.kv_store(torch.randn(1, 2, 16), torch.randn(1, 2, 16),
                                                      kc.transpose(0, 1), kc.transpose(0, 1),
                                                      torch.zeros(1, dtype=torch.long)), "contiguous"),
        "prefill starts": (lambda: K.paged_prefill_attention(q, kc, kc, tables, cl, torch.tensor([0, 2]), 1.0),
                           "query_start_loc must rise"),
        "prefill triton": (lambda: K.paged_prefill_attention(q, kc, kc, tables, cl, torch.tensor([0, 1]), 1.0,
                                                             impl="triton"), "no Triton prefill"),
    }


@pytest.mark.parametrize("case", sorted(_bad_calls()))
def test_wrappers_reject_bad_inputs(case):
    call, match = _bad_calls()[case]
    with pytest.raises(ValueError, match=match):
        call()


@pytest.mark.skipif(K.interpreter_enabled(), reason="the interpreter makes CPU triton valid")
def test_forcing_triton_on_cpu_raises():
    with pytest.raises(ValueError, match="impl='triton' needs"):
        K.silu_mul(torch.randn(2, 8), impl="triton")


# -------------------------------------------------- layering / no-triton path


def test_works_without_triton():
    """With ``import triton`` failing, the package imports and runs references."""
    code = (
        "import sys; sys.modules['triton'] = None\n"
        "import torch\n"
        "from llmsys import kernels as K\n"
        "assert not K.triton_available()\n"
        "x = torch.randn(3, 8)\n"
        "assert K.rms_norm(x, torch.ones(8)).shape == (3, 8)\n"
        "try:\n"
        "    K.silu_mul(x, impl='triton')\n"
        "except ValueError as e:\n"
        "    assert 'triton available=False' in str(e)\n"
        "else:\n"
        "    raise SystemExit('forcing triton without triton did not raise')\n"
        "assert 'triton' not in sys.modules or sys.modules['triton'] is None\n"
    )
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]


def test_only_kernels_imports_triton():
    """README rule: triton is imported inside ``kernels/`` only."""
    offenders = []
    # The package's own source folders (not build/ or dist/ copies a `pip install .` leaves in the clone).
    sources = [*REPO.glob("*.py"), *(p for top in ("engine", "offload", "quant", "tui") for p in (REPO / top).rglob("*.py"))]
    for path in sources:
        rel = path.relative_to(REPO)
        for line in path.read_text(errors="replace").splitlines():
            s = line.strip()
            if s.startswith(("import triton", "from triton")):
                offenders.append(f"{rel}: {s}")
    assert not offenders, offenders


# ------------------------------------------------ Triton kernels, interpreted


def test_triton_kernels_under_interpreter():
    """Runs tests/test_kernels_interp.py in a fresh process with TRITON_INTERPRET=1.

    A subprocess because the flag must be set before the first ``import
    triton``, which this process may already have done.
    """
    if not K.triton_available():
        pytest.skip("triton is not importable on this machine")
    env = dict(os.environ, TRITON_INTERPRET="1")
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", str(REPO / "tests" / "test_kernels_interp.py"), "-q", "-x",
         "-p", "no:cacheprovider"],
        capture_output=True, text=True, env=env, cwd=REPO, timeout=400,
    )
    assert proc.returncode == 0, proc.stdout[-6000:] + proc.stderr[-3000:]
    summary = proc.stdout.strip().splitlines()[-1]
    assert " passed" in summary and "skipped" not in summary, proc.stdout[-2000:]


@pytest.mark.parametrize("dtype", [torch.float32, torch.int8])
def test_cpu_gathered_attention_mixed_step_equals_reference(dtype):
    """Continuous batching mixes decodes with prompt chunks in one step; the CPU
    fast path runs them as two batches (GatherPlan.split) and must equal the
    reference over the whole mixed batch."""
    from llmsys.kernels.cpu_attention import make_gather_plan, paged_attention_gathered

    lens, qlens, hq, hk, d, bs = [9, 30, 5, 17, 12], [1, 6, 5, 1, 1], 8, 2, 16, 8
    kc, vc, ks, vs, tables, _, _ = _paged_setup(lens, hk, d, bs, dtype=dtype)
    starts = [0]
    for q_ in qlens:
        starts.append(starts[-1] + q_)
    q = torch.randn(starts[-1], hq, d, generator=torch.Generator().manual_seed(3))
    block_lists = [row[: -(-n // bs)].tolist() for row, n in zip(tables, lens)]
    plan = make_gather_plan(qlens, lens, block_lists, bs, torch.device("cpu"))
    assert plan.split is not None and not plan.is_decode
    got = paged_attention_gathered(q, kc, vc, plan, 0.3, ks, vs)
    want = K.paged_prefill_attention(q, kc, vc, tables, torch.tensor(lens, dtype=torch.int32),
                                     torch.tensor(starts), 0.3, ks, vs, impl="reference")
    _close(got, want)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cpu_prompt_attention_does_not_depend_on_the_batch(dtype):
    """A prompt chunk's attention in a step with other (longer, shorter) prompt chunks and decodes
    gives the bits it gets alone: the serving engine's greedy answers must not depend on who else
    is being served (one padded SDPA over the batch did not: 130/180 bf16 outputs equalled the
    sequential ones in benchmarks/bench_server.py)."""
    from llmsys.kernels.cpu_attention import make_gather_plan, paged_attention_gathered

    lens, qlens, hq, hk, d, bs = [40, 9, 300, 17, 120], [40, 1, 37, 17, 5], 8, 2, 64, 16
    prompt = [True, False, True, True, True]
    kc, vc, _, _, tables, _, _ = _paged_setup(lens, hk, d, bs, dtype=dtype, seed=4)
    starts = [0]
    for q_ in qlens:
        starts.append(starts[-1] + q_)
    q = torch.randn(starts[-1], hq, d, generator=torch.Generator().manual_seed(5)).to(dtype)
    block_lists = [row[: -(-n // bs)].tolist() for row, n in zip(tables, lens)]
    cpu = torch.device("cpu")
    together = paged_attention_gathered(q, kc, vc, make_gather_plan(qlens, lens, block_lists, bs, cpu, prompt=prompt), 0.125)
    for b in range(len(lens)):
        alone_plan = make_gather_plan([qlens[b]], [lens[b]], [block_lists[b]], bs, cpu, prompt=[prompt[b]])
        alone = paged_attention_gathered(q[starts[b] : starts[b + 1]], kc, vc, alone_plan, 0.125)
        assert torch.equal(together[starts[b] : starts[b + 1]], alone), b
    want = K.paged_prefill_attention(q.float(), kc.float(), vc.float(), tables, torch.tensor(lens, dtype=torch.int32),
                                     torch.tensor(starts), 0.125, impl="reference")
    tol = 2e-2 if dtype == torch.bfloat16 else 1e-5
    _close(together.float(), want, atol=tol, rtol=tol)


def test_cpu_prompt_attention_needs_context_lengths():
    """A hand-built prompt plan without lengths fails with a message naming what is missing."""
    import dataclasses

    from llmsys.kernels.cpu_attention import make_gather_plan, paged_attention_gathered

    kc, vc, _, _, tables, _, _ = _paged_setup([12], 2, 16, 8, seed=6)
    plan = make_gather_plan([12], [12], [tables[0][:2].tolist()], 8, torch.device("cpu"), prompt=[True])
    q = torch.randn(12, 4, 16)
    with pytest.raises(ValueError, match="prompt plan needs its context lengths"):
        paged_attention_gathered(q, kc, vc, dataclasses.replace(plan, lens=None, row_seq=None, row_lens=None), 0.25)


# ------------------------------------------------- sliding window, soft-capping, LongRoPE


def _dense_attention(q, k, v, pos, scale, window=None, softcap=None, sinks=None):
    """One query ``[Hq, D]`` at ``pos`` over dense ``k, v [L, Hk, D]`` in float64 (the definition); ``sinks``
    ``[Hq]``: a last logit column per head in the softmax, dropped after it (gpt-oss)."""
    hq, hk = q.shape[0], k.shape[1]
    kk = k[: pos + 1].double().repeat_interleave(hq // hk, 1)
    vv = v[: pos + 1].double().repeat_interleave(hq // hk, 1)
    logits = torch.einsum("hd,lhd->hl", q.double(), kk) * scale
    if softcap is not None:
        logits = torch.tanh(logits / softcap) * softcap
    if window is not None:
        logits[:, : max(0, pos + 1 - window)] = float("-inf")
    if sinks is None:
        return torch.einsum("hl,lhd->hd", torch.softmax(logits, -1), vv)
    probs = torch.softmax(torch.cat([logits, sinks.double()[:, None]], -1), -1)[:, :-1]
    return torch.einsum("hl,lhd->hd", probs, vv)


@pytest.mark.parametrize("window,softcap", [(None, None), (5, None), (6, 1.5)])
def test_reference_attention_sinks_vs_dense(window, softcap):
    """Attention sinks (gpt-oss: one logit per head in each softmax's denominator, no value) in the reference
    prefill and decode attention, with a window and soft-capping too, against the float64 definition."""
    lens, qlens, hq, hk, d, scale = [9, 14, 3], [9, 4, 1], 4, 2, 8, 0.4
    kc, vc, _, _, tables, dk, dv = _paged_setup(lens, hk, d, 8)
    starts = [0, 9, 13, 14]
    q = torch.randn(14, hq, d, generator=torch.Generator().manual_seed(2))
    sinks = torch.tensor([2.0, -1.0, 0.5, 4.0])
    cl = torch.tensor(lens, dtype=torch.int32)
    kw = dict(window=window, softcap=softcap, sinks=sinks)
    got = K.paged_prefill_attention(q, kc, vc, tables, cl, torch.tensor(starts), scale, **kw)
    dec = K.paged_decode_attention(q[[8, 12, 13]], kc, vc, tables, cl, scale, **kw)
    for b, (n, m) in enumerate(zip(lens, qlens)):
        for i in range(m):
            _close(got[starts[b] + i], _dense_attention(q[starts[b] + i], dk[b], dv[b], n - m + i, scale, **kw))
        _close(dec[b], _dense_attention(q[starts[b + 1] - 1], dk[b], dv[b], n - 1, scale, **kw))
    with pytest.raises(ValueError, match="sinks"):
        K.paged_decode_attention(q[[8, 12, 13]], kc, vc, tables, cl, scale, sinks=sinks[:3])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.int8])
@pytest.mark.parametrize("window", [None, 7])
@pytest.mark.parametrize("qlens", [[1, 1, 1, 1, 1], [1, 6, 5, 1, 1]])
def test_cpu_attention_with_sinks_equals_reference(dtype, window, qlens):
    """Attention sinks through the CPU paths: the gathered attention (decode rows take the grouped float32
    matmuls, never the C decode kernel, which has no sinks; prompt chunks explicit float32 logits), the
    int4 pool's ``attend_gathered`` on the same gathered rows, and the scoring path, each equal to the
    reference attention with the sinks; the scores' rows keep the mass the sinks took out (< Hq)."""
    from llmsys.kernels.cpu_attention import (attend_gathered, make_gather_plan, paged_attention_gathered,
                                              paged_attention_gathered_scores, windowed)

    lens, hq, hk, d, bs = [9, 30, 5, 17, 12], 8, 2, 16, 8
    kc, vc, ks, vs, tables, starts, q, qdtype = _paged_case(lens, qlens, hq, hk, d, bs, dtype)
    sinks = torch.linspace(-2.0, 3.0, hq).to(qdtype)
    block_lists = [row[: -(-n // bs)].tolist() for row, n in zip(tables, lens)]
    plan = windowed(make_gather_plan(qlens, lens, block_lists, bs, torch.device("cpu")), window)
    got = paged_attention_gathered(q, kc, vc, plan, 0.3, ks, vs, sinks=sinks)
    kf, vf = (kc, vc) if dtype != torch.bfloat16 else (kc.float(), vc.float())
    want = K.paged_prefill_attention(q.float(), kf, vf, tables, torch.tensor(lens, dtype=torch.int32),
                                     torch.tensor(starts), 0.3, ks, vs, impl="reference", window=window,
                                     sinks=sinks.float())
    tol = 2e-2 if dtype == torch.bfloat16 else 1e-5
    _close(got.float(), want, atol=tol, rtol=tol)
    out, rows = paged_attention_gathered_scores(q, kc, vc, plan, 0.3, [0] * len(lens), ks, vs, sinks=sinks)
    _close(out.float(), want, atol=tol, rtol=tol)
    assert all(bool((r.sum(-1) < hq - 1e-3).all()) for r in rows)
    if dtype == torch.float32 and plan.split is None:  # the int4 pool's path, on the plain rows
        slots = plan.gather_slots
        kg, vg = (c.view(-1, hk, d)[slots] for c in (kc, vc))  # [B, Lmax, Hk, D]
        _close(attend_gathered(q, kg, vg, plan, 0.3, sinks=sinks), want, atol=tol, rtol=tol)


def test_yarn_cache_matches_hf():
    """YaRN (gpt-oss's released parameters, and a truncated ramp): transformers' inverse frequencies bit for bit,
    and its attention factor on cos and sin, as GptOssRotaryEmbedding computes them."""
    transformers = pytest.importorskip("transformers")
    gpt_oss = pytest.importorskip("transformers.models.gpt_oss.modeling_gpt_oss")
    for params in (dict(factor=32.0, beta_fast=32.0, beta_slow=1.0, truncate=False, original_max_position_embeddings=4096),
                   dict(factor=4.0, original_max_position_embeddings=64)):
        scaling = dict(rope_type="yarn", **params)
        cfg = transformers.GptOssConfig(head_dim=64, max_position_embeddings=8192,
                                        rope_parameters=dict(scaling, rope_theta=150000.0))
        emb = gpt_oss.GptOssRotaryEmbedding(cfg)
        factor = K.rope_attention_factor(scaling, 8192)
        assert factor == emb.attention_scaling
        pos = torch.arange(8192)
        cache = K.build_rope_cache(64, 8192, 150000.0, scaling, attention_factor=factor)
        cos, sin = emb(torch.zeros(1), pos[None])  # [1, T, 32]
        assert torch.equal(cache[:, :32], cos[0]) and torch.equal(cache[:, 32:], sin[0])


@pytest.mark.parametrize("window,softcap", [(5, None), (None, 2.0), (6, 1.5)])
def test_reference_attention_window_and_softcap_vs_dense(window, softcap):
    lens, qlens, hq, hk, d, scale = [9, 14, 3], [9, 4, 1], 4, 2, 8, 0.4
    kc, vc, _, _, tables, dk, dv = _paged_setup(lens, hk, d, 8)
    starts = [0, 9, 13, 14]
    q = torch.randn(14, hq, d, generator=torch.Generator().manual_seed(2))
    cl = torch.tensor(lens, dtype=torch.int32)
    got = K.paged_prefill_attention(q, kc, vc, tables, cl, torch.tensor(starts), scale, window=window, softcap=softcap)
    dec = K.paged_decode_attention(q[[8, 12, 13]], kc, vc, tables, cl, scale, window=window, softcap=softcap)
    for b, (n, m) in enumerate(zip(lens, qlens)):
        for i in range(m):
            want = _dense_attention(q[starts[b] + i], dk[b], dv[b], n - m + i, scale, window, softcap)
            _close(got[starts[b] + i], want)
        _close(dec[b], _dense_attention(q[starts[b + 1] - 1], dk[b], dv[b], n - 1, scale, window, softcap))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.int8])
@pytest.mark.parametrize("softcap", [None, 3.0])
@pytest.mark.parametrize("qlens", [[1, 1, 1, 1, 1], [1, 6, 5, 1, 1]])
def test_cpu_windowed_attention_equals_reference(dtype, softcap, qlens):
    """A sliding-window layer through the CPU paths (``kernels.windowed`` plans: decode rows gather each
    sequence's last window of slots, for the C decode attention too; prompt chunks and mixed steps get the
    band in their mask) equals the reference attention with the window, soft-capped or not."""
    from llmsys.kernels.cpu_attention import make_gather_plan, paged_attention_gathered, windowed

    lens, hq, hk, d, bs, window = [9, 30, 5, 17, 12], 8, 2, 16, 8, 7
    kc, vc, ks, vs, tables, starts, q, qdtype = _paged_case(lens, qlens, hq, hk, d, bs, dtype)
    block_lists = [row[: -(-n // bs)].tolist() for row, n in zip(tables, lens)]
    plan = make_gather_plan(qlens, lens, block_lists, bs, torch.device("cpu"))
    wplan = windowed(plan, window)
    assert windowed(plan, max(lens)) is plan  # no context passes the window: the plan itself
    if plan.is_decode:
        assert wplan.gather_slots.shape == (len(lens), window) and wplan.lens.tolist() == [min(n, window) for n in lens]
    got = paged_attention_gathered(q, kc, vc, wplan, 0.3, ks, vs, softcap)
    kf, vf = (kc, vc) if dtype != torch.bfloat16 else (kc.float(), vc.float())
    want = K.paged_prefill_attention(q.float(), kf, vf, tables, torch.tensor(lens, dtype=torch.int32),
                                     torch.tensor(starts), 0.3, ks, vs, impl="reference", window=window,
                                     softcap=softcap)
    tol = 2e-2 if dtype == torch.bfloat16 else 1e-5
    _close(got.float(), want, atol=tol, rtol=tol)


@pytest.mark.parametrize("partial", [1.0, 0.5])
def test_longrope_cache_matches_hf(partial):
    """LongRoPE's two tables (Phi-3): transformers' short and long inverse frequencies and its attention
    factor on cos and sin, for whole and partial rotary heads."""
    transformers = pytest.importorskip("transformers")
    phi3 = pytest.importorskip("transformers.models.phi3.modeling_phi3")
    head_dim, heads, max_pos, orig = 16, 4, 256, 32
    dim = int(head_dim * partial)
    short = [1.0 + 0.1 * i for i in range(dim // 2)]
    long = [1.0 + 2.0 * i for i in range(dim // 2)]
    cfg = transformers.Phi3Config(
        hidden_size=head_dim * heads, num_attention_heads=heads, num_key_value_heads=2, max_position_embeddings=max_pos,
        original_max_position_embeddings=orig, pad_token_id=0, partial_rotary_factor=partial,
        rope_scaling=dict(rope_type="longrope", short_factor=short, long_factor=long),
    )
    emb = phi3.Phi3RotaryEmbedding(cfg)
    scaling = dict(rope_type="longrope", short_factor=short, long_factor=long, original_max_position_embeddings=orig)
    factor = K.rope_attention_factor(scaling, max_pos)
    assert factor == emb.attention_scaling
    x = torch.zeros(1)
    for long_table, pos in ((False, torch.arange(orig)), (True, torch.arange(orig + 8))):  # HF: by the longest
        cache = K.build_rope_cache(dim, max_pos, 10000.0, scaling, long=long_table, attention_factor=factor)
        cos, sin = emb(x, pos[None])  # [1, T, dim]
        assert torch.equal(cache[pos, : dim // 2], cos[0, :, : dim // 2])
        assert torch.equal(cache[pos, dim // 2 :], sin[0, :, : dim // 2])


def test_cpu_prompt_attention_out_of_memory_is_one_line(tmp_path):
    """The C prompt attention's scratch that cannot be allocated is a MemoryError saying what it was for (not
    'bad shapes'): a child process with its address space capped just above what the call's output needs."""
    from llmsys.kernels import cpu_decode

    if not cpu_decode.available():
        pytest.skip(f"the C decode kernels are not loaded: {cpu_decode.kernel_status()}")
    script = tmp_path / "oom.py"
    script.write_text(
        "import resource, torch\n"
        "from llmsys.kernels import cpu_decode\n"
        "torch.set_num_threads(1)\n"
        "hq, hk, d, n = 9, 3, 64, 8192\n"
        "k, v = (torch.randn(1, n, hk, d).bfloat16() for _ in range(2))\n"
        "q = torch.randn(n, hq, d).bfloat16()\n"
        "seq, lens = torch.zeros(n, dtype=torch.int64), torch.arange(1, n + 1)\n"
        "cpu_decode.rows_attention(q[:4], k, v, seq[:4], lens[:4], 0.125)\n"
        "vm = int([l for l in open('/proc/self/status') if l.startswith('VmSize')][0].split()[1]) * 1024\n"
        "resource.setrlimit(resource.RLIMIT_AS, (vm + n * hq * d * 2 + (2 << 20), resource.RLIM_INFINITY))\n"
        "try:\n"
        "    cpu_decode.rows_attention(q, k, v, seq, lens, 0.125)\n"
        "    print('no error')\n"
        "except MemoryError as e:\n"
        "    print('MemoryError:', e)\n")
    out = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=120)
    assert out.stdout.strip() == ("MemoryError: rows_attention: no memory for the scratch of 8192 tokens over up "
                                  "to 8192 keys"), out.stdout + out.stderr
