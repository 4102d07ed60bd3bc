"""The CPU GEMV kernels (kernels/a8_gemv.c, kernels/dense_gemv.c) against their torch definitions.

The kernels' arithmetic is fixed (kernels/cpu_qgemv.py), so they must match
the definitions bit for bit at any M, N, K, group size and thread count (the
a8 GEMVs on x quantized per 32 columns, the bf16 and float32 GEMVs), give row m
of an M-row call the bits of the 1-row call on that row, stay close to the float
matmul on the dequantized weight, and give the same bits at every ISA level.
"""

from __future__ import annotations

import pytest
import torch

from conftest import A8_REL_ERR, other_isa_build, x86_levels
from llmsys.kernels import cpu_qgemv
from llmsys.quant import int4 as int4_mod
from llmsys.quant.base import PACKED_MAX_ROWS
from llmsys.quant.int4 import Int4Linear
from llmsys.quant.int8_fp8 import Int8Linear, quantize_int8

KERNEL = cpu_qgemv.kernel_status().startswith("ok")
needs_kernel = pytest.mark.skipif(not KERNEL, reason=f"C kernel not built: {cpu_qgemv.kernel_status()}")


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.int16)


def _int8(n: int, k: int, seed: int = 0):
    torch.manual_seed(seed)
    return quantize_int8(torch.randn(n, k) * 0.02)


def _int4(n: int, k: int, g: int, seed: int = 0, scale_dtype=torch.bfloat16) -> Int4Linear:
    torch.manual_seed(seed)
    lin = Int4Linear.from_float(torch.randn(n, k) * 0.02, group_size=g)
    if scale_dtype != torch.bfloat16:  # AWQ/GPTQ checkpoints carry fp16 scales
        t = lin.canonical_tensors()
        lin = Int4Linear(t["qweight"], t["scales"].to(scale_dtype), t["zeros"].to(scale_dtype), in_features=k)
    return lin


def _int4_args(lin: Int4Linear):
    n = lin.out_features
    scales = lin.scales_orig if lin.scales_orig is not None else lin.scales_zeros[:, :n, 0].t()
    return lin.packed, scales, lin.zeros_u8, lin.group_size


def _threads(n: int):
    class _Ctx:
        def __enter__(self):
            self.before = torch.get_num_threads()
            torch.set_num_threads(n)

        def __exit__(self, *exc):
            torch.set_num_threads(self.before)

    return _Ctx()


@needs_kernel
@pytest.mark.parametrize("n,k", [(200, 172), (64, 32), (130, 1000), (7, 16), (896, 896), (9, 65)])
@pytest.mark.parametrize("threads", [1, 2])
def test_int8_a8_bit_exact(n, k, threads):
    """The a8 GEMV: its definition's bits at any shape (K tails, row tails of the 8- and 16-row tiles, x
    rows in passes of 8, 4, 2 and 1 on AVX512-VNNI), every row of an M-row call the 1-row call's bits."""
    q, s = _int8(n, k, seed=n + k)
    torch.manual_seed(k)
    x = torch.randn(PACKED_MAX_ROWS + 13, k).bfloat16()
    with _threads(threads):
        for m in (1, 3, 7, 13, PACKED_MAX_ROWS + 13):
            assert torch.equal(_bits(cpu_qgemv.int8_gemv_a8(x[:m], q, s)), _bits(cpu_qgemv.int8_a8_def(x[:m], q, s)))
        full = cpu_qgemv.int8_gemv_a8(x, q, s)
        for m in (0, 5, PACKED_MAX_ROWS + 12):
            assert torch.equal(_bits(full[m : m + 1]), _bits(cpu_qgemv.int8_gemv_a8(x[m : m + 1], q, s)))


@needs_kernel
@pytest.mark.parametrize("scale_dtype", [torch.float16, torch.float32])
@pytest.mark.parametrize("threads", [1, 2])
def test_int4_a8_group_major_scales_bit_exact(scale_dtype, threads):
    """fp16 / float32 scales laid out group-major (an [N, G] view of [G, N]: Int4Linear's scales_orig, GGUF
    Q4_0's fp16) take the kernels' vector loads: the definition's bits, as the row-major layout gives."""
    for n, k, g in [(192, 250, 32), (130, 300, 64), (64, 64, 32)]:
        lin = _int4(n, k, g, seed=n)
        packed, zeros = lin.packed, lin.zeros_gm.t()  # group-major zeros too: the vector path needs both
        n_groups = zeros.shape[1]
        scales = (torch.rand(n, n_groups) * torch.logspace(-4, 0, n)[:, None] + 1e-3).to(scale_dtype)
        gm = scales.t().contiguous().t()  # [N, G], strides (1, N)
        x = torch.randn(9, k).bfloat16()
        with _threads(threads):
            for m in (1, 2, 5, 9):
                want = _bits(cpu_qgemv.int4_a8_def(x[:m], packed, scales, zeros, g))
                assert torch.equal(_bits(cpu_qgemv.int4_gemv_a8(x[:m], packed, gm, zeros, g)), want), (n, k, g, m)
                assert torch.equal(_bits(cpu_qgemv.int4_gemv_a8(x[:m], packed, scales, zeros, g)), want), (n, k, g, m)


@needs_kernel
@pytest.mark.parametrize("n,k", [(200, 172), (64, 64), (19, 96), (130, 1000), (4864, 96), (70, 896)])
@pytest.mark.parametrize("threads", [1, 2])
def test_int8_block_scaled_a8_bit_exact(n, k, threads):
    """The int8 GEMV with a scale per 32 columns (GGUF Q8_0): its definition's bits (K tails, row tails of
    the 8- and 16-row tiles, every pass size of x rows), batch-invariant, and within the a8 error of the
    float product of its dequantized weight."""
    torch.manual_seed(n + k)
    q = torch.randint(-127, 128, (n, k), dtype=torch.int8)
    bs = (torch.rand(-(-k // 32), n) * 0.01 + 1e-4).half()  # [nb, N]
    x = torch.randn(PACKED_MAX_ROWS + 13, k).bfloat16()
    with _threads(threads):
        for m in (1, 2, 3, 7, 13, PACKED_MAX_ROWS + 13):
            got = cpu_qgemv.int8g_gemv_a8(x[:m], q, bs)
            assert torch.equal(_bits(got), _bits(cpu_qgemv.int8g_a8_def(x[:m], q, bs))), m
        full = cpu_qgemv.int8g_gemv_a8(x, q, bs)
        for m in (0, 5, PACKED_MAX_ROWS + 12):
            assert torch.equal(_bits(full[m : m + 1]), _bits(cpu_qgemv.int8g_gemv_a8(x[m : m + 1], q, bs)))
    w = q.float() * bs.float().repeat_interleave(32, 0)[:k].t()  # [N, K]
    ref = x.float() @ w.t()
    assert ((full.float() - ref).abs().max() / ref.abs().max()).item() < A8_REL_ERR
    with pytest.raises(ValueError, match="block_scales contiguous fp16"):
        cpu_qgemv.int8g_gemv_a8(x, q, bs.float())


@needs_kernel
@pytest.mark.parametrize("n,k,g", [(200, 172, 64), (64, 64, 32), (130, 1000, 32), (96, 256, 128), (4864, 96, 64),
                                   (70, 896, 64)])
@pytest.mark.parametrize("threads", [1, 2])
def test_int4_a8_bit_exact(n, k, g, threads):
    """The int4 a8 GEMV: its definition's bits (padded rows and columns, every group size, scales as
    the layer holds them and as a plain [N, G] tensor), batch-invariant."""
    lin = _int4(n, k, g, seed=n + g)
    torch.manual_seed(n)
    x = torch.randn(20, k).bfloat16()
    with _threads(threads):
        for args in (_int4_args(lin), (lin.packed, lin.scales_zeros, lin.zeros_gm.t(), g)):
            # AVX512-VNNI: x rows in passes of 3, 2 and 1; from 16 rows on 2 threads an odd number of 64-row
            # blocks (130 rows: 3) has each block's rows split between the threads
            for m in (1, 3, 7, 12, 17, 20):
                want = _bits(cpu_qgemv.int4_a8_def(x[:m], *args))
                assert torch.equal(_bits(cpu_qgemv.int4_gemv_a8(x[:m], *args)), want), (m, args[1].shape)
        args = _int4_args(lin)
        full = cpu_qgemv.int4_gemv_a8(x, *args)
        for m in (0, 11):
            assert torch.equal(_bits(full[m : m + 1]), _bits(cpu_qgemv.int4_gemv_a8(x[m : m + 1], *args)))


def _offsets(n: int, k: int, g: int, seed: int = 0):
    """GGUF Q4_K-like float32 scales and offsets (w = scale * q + offset), group-major as the layer holds them."""
    gen = torch.Generator().manual_seed(seed)
    groups = -(-k // g)
    scales = (torch.rand(groups, n, generator=gen) * 0.01).t()  # [N, G] view of a [G, N] tensor
    offsets = (-torch.rand(groups, n, generator=gen) * 0.05).t()
    return scales, offsets


@needs_kernel
@pytest.mark.parametrize("n,k,g", [(200, 172, 32), (64, 64, 32), (130, 1000, 32), (70, 896, 64)])
@pytest.mark.parametrize("threads", [1, 2])
def test_int4_a8_offsets_bit_exact(n, k, g, threads):
    """Float offsets instead of integer zeros (GGUF Q4_K / Q4_1): the definition's bits for group-major and
    row-major offsets, zeros never read (given as a stride-0 tensor), batch-invariant."""
    lin = _int4(n, k, g, seed=n + g)
    scales, offsets = _offsets(n, k, g, seed=n)
    zeros = torch.zeros(1, dtype=torch.uint8).expand(n, -(-k // g))
    torch.manual_seed(n)
    x = torch.randn(12, k).bfloat16()
    with _threads(threads):
        for offs in (offsets, offsets.contiguous()):
            for m in (1, 3, 12):
                want = _bits(cpu_qgemv.int4_a8_def(x[:m], lin.packed, scales, zeros, g, offsets=offs))
                got = cpu_qgemv.int4_gemv_a8(x[:m], lin.packed, scales, zeros, g, offsets=offs)
                assert torch.equal(_bits(got), want), (m, offs.stride())
        full = cpu_qgemv.int4_gemv_a8(x, lin.packed, scales, zeros, g, offsets=offsets)
        for m in (0, 11):
            one = cpu_qgemv.int4_gemv_a8(x[m : m + 1], lin.packed, scales, zeros, g, offsets=offsets)
            assert torch.equal(_bits(full[m : m + 1]), _bits(one))
    # Close to the float matmul on the weight w = scale * q + offset (the a8 rounding of x only).
    q = cpu_qgemv.unpack_cpu_int4(lin.packed, lin.packed.shape[0], lin.padded_in_features)[:n].float()
    w = (q.view(n, -1, g) * scales[..., None] + offsets[..., None]).view(n, -1)[:, :k]
    ref = x.float() @ w.t()
    err = (full.float() - ref).abs().max() / ref.abs().max()
    assert err < A8_REL_ERR, err


def _q6k_scales(n: int, k: int, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """GGUF Q6_K's scales as stored: int8 sc per 16 columns [K/16, N], fp16 d per 256 [K/256, N]."""
    return (torch.randint(-128, 128, (k // 16, n), generator=gen, dtype=torch.int8),
            (torch.rand(k // 256, n, generator=gen) * 1e-3).half())


@needs_kernel
@pytest.mark.parametrize("n,k", [(200, 256), (64, 512), (7, 768), (130, 1024)])
@pytest.mark.parametrize("threads", [1, 2])
def test_int8_k_quant_layouts_bit_exact(n, k, threads):
    """int8 codes with Q6_K's scales as stored (int8 sc per 16 columns times fp16 d per 256) and with float32
    scales and offsets per 32 (Q5_K): the definitions' bits at any row count, batch-invariant; a K that is no
    multiple of 32 is refused."""
    gen = torch.Generator().manual_seed(n + k)
    q6 = torch.randint(-32, 32, (n, k), generator=gen, dtype=torch.int8)
    q5 = torch.randint(0, 32, (n, k), generator=gen, dtype=torch.int8)
    sc, d = _q6k_scales(n, k, gen)
    fs, fo = torch.rand(k // 32, n, generator=gen) * 0.01, -torch.rand(k // 32, n, generator=gen) * 0.05
    x = torch.randn(9, k, generator=gen).bfloat16()
    with _threads(threads):
        for m in (1, 4, 9):
            assert torch.equal(_bits(cpu_qgemv.int8g_gemv_a8(x[:m], q6, sc, super_scales=d)),
                               _bits(cpu_qgemv.int8g_a8_def(x[:m], q6, sc, super_scales=d))), m
            assert torch.equal(_bits(cpu_qgemv.int8g_gemv_a8(x[:m], q5, fs, offsets=fo)),
                               _bits(cpu_qgemv.int8g_a8_def(x[:m], q5, fs, offsets=fo))), m
        full = cpu_qgemv.int8g_gemv_a8(x, q5, fs, offsets=fo)
        assert torch.equal(_bits(full[3:4]), _bits(cpu_qgemv.int8g_gemv_a8(x[3:4], q5, fs, offsets=fo)))
    w = q5.float() * fs.t().repeat_interleave(32, 1) + fo.t().repeat_interleave(32, 1)
    ref = x.float() @ w.t()
    assert ((full.float() - ref).abs().max() / ref.abs().max()) < A8_REL_ERR
    with pytest.raises(ValueError, match="multiple of 32"):
        cpu_qgemv.int8g_gemv_a8(torch.randn(1, 48).bfloat16(), q5[:, :48].contiguous(), fs[:1], offsets=fo[:1])


def _kscales(n: int, k: int, seed: int = 0):
    """GGUF Q4_K's scales as stored: 6-bit sc, m per 32 columns, fp16 d, dmin per 256 (group-major)."""
    from llmsys.kernels import KScales

    gen = torch.Generator().manual_seed(seed)
    g = k // 32
    return KScales(torch.randint(0, 64, (g, n), generator=gen, dtype=torch.uint8),
                   torch.randint(0, 64, (g, n), generator=gen, dtype=torch.uint8),
                   (torch.rand(g // 8, n, generator=gen) * 1e-3).half(), (torch.rand(g // 8, n, generator=gen) * 1e-3).half())


@needs_kernel
@pytest.mark.parametrize("n,k", [(200, 512), (64, 256), (130, 1024), (70, 250)])
@pytest.mark.parametrize("threads", [1, 2])
def test_int4_q4k_stored_scales_bit_exact(n, k, threads):
    """Q4_K's scales read as stored (d * sc, -(dmin * m) formed in the kernel) give the bits of the float
    scales and offsets they multiply out to, batch-invariant; K within the last super-block (250 of 256)."""
    kp = -(-k // 256) * 256
    lin = _int4(n, kp, 32, seed=n)
    ks = _kscales(n, kp, seed=k)
    zeros = torch.zeros(1, dtype=torch.uint8).expand(n, kp // 32)
    x = torch.randn(9, k, generator=torch.Generator().manual_seed(1)).bfloat16()
    with _threads(threads):
        for m in (1, 4, 9):
            want = cpu_qgemv.int4_a8_def(x[:m], lin.packed, ks.scales(), zeros, 32, offsets=ks.offsets())
            assert torch.equal(_bits(cpu_qgemv.int4k_gemv_a8(x[:m], lin.packed, ks, k)), _bits(want)), m


def test_a8_quantization():
    """x's int8 blocks: codes within +-127 with one at +-127 per nonzero block, zero blocks give zero codes
    and scale, code sums are the sums, and the dequantized x is within half a step of x."""
    torch.manual_seed(3)
    x = torch.randn(3, 100).bfloat16()
    x[1, 32:64] = 0
    q, d, sx = cpu_qgemv.quantize_a8(x)
    assert q.shape == (3, 4, 32) and d.shape == (3, 4)
    assert int(q.abs().max()) == 127 and torch.equal(q[1, 1], torch.zeros(32, dtype=torch.int8)) and d[1, 1] == 0
    assert torch.equal(sx, q.long().sum(-1))
    xr = (q.float() * d[..., None]).view(3, -1)[:, :100]
    assert bool(((xr - x.float()).abs() <= d.repeat_interleave(32, 1)[:, :100] / 2 + 1e-7).all())


@needs_kernel
def test_a8_close_to_float_matmul():
    """The a8 GEMVs approximate the float matmul on the dequantized weight: the error of x's int8 rounding,
    well under 1% of the output's scale on Gaussian activations of a real hidden size."""
    torch.manual_seed(8)
    x = torch.randn(4, 896).bfloat16()
    q, s = _int8(512, 896, seed=2)
    exact, a8 = x.float() @ (q.float() * s.float()[:, None]).t(), cpu_qgemv.int8_gemv_a8(x, q, s).float()
    assert (a8 - exact).abs().max() / exact.abs().max() < 0.01
    lin = _int4(512, 896, 64, seed=2)
    exact, a8 = x.float() @ lin.dequantize().float().t(), cpu_qgemv.int4_gemv_a8(x, *_int4_args(lin)).float()
    assert (a8 - exact).abs().max() / exact.abs().max() < 0.01


@needs_kernel
@pytest.mark.parametrize("scale_dtype", [torch.float16, torch.float32])
def test_int4_other_scale_dtypes(scale_dtype):
    lin = _int4(192, 320, 64, seed=3, scale_dtype=scale_dtype)
    args = _int4_args(lin)
    assert args[1].dtype == scale_dtype
    x = torch.randn(3, 320).bfloat16()
    y = cpu_qgemv.int4_gemv_a8(x, *args)
    assert torch.equal(_bits(y), _bits(cpu_qgemv.int4_a8_def(x, *args)))
    # fp16 subnormal and odd scales read exactly
    scales = (torch.rand(192, 5) * torch.logspace(-7, 2, 192)[:, None]).to(scale_dtype)
    y = cpu_qgemv.int4_gemv_a8(x, args[0], scales, args[2], 64)
    assert torch.equal(_bits(y), _bits(cpu_qgemv.int4_a8_def(x, args[0], scales, args[2], 64)))


@needs_kernel
@pytest.mark.parametrize("level", x86_levels())
def test_other_code_paths_bit_exact(level, tmp_path):
    """Every ISA level's build this CPU can run gives the same bits as the definitions."""
    lib = other_isa_build(cpu_qgemv._SOURCE, cpu_qgemv._SIGNATURES, level, tmp_path)
    xb, wb = torch.randn(8, 203).bfloat16(), torch.randn(70, 203).bfloat16()  # the bf16 GEMV: K and N tails
    for m in (1, 3, 8):  # AVX512-BF16: up to 6 rows of x per weight pass, then the rest
        assert torch.equal(_bits(cpu_qgemv.bf16_gemv(xb[:m], wb, lib=lib)), _bits(cpu_qgemv.bf16_gemv_def(xb[:m], wb)))
        xf, wf = xb[:m].float() * 1.1, wb.float() * 0.9  # the float32 GEMV: every bit of the product counts
        assert torch.equal(cpu_qgemv.f32_gemv(xf, wf, lib=lib).view(torch.int32),
                           cpu_qgemv.f32_gemv_def(xf, wf).view(torch.int32))
    torch.manual_seed(4)
    x = torch.randn(5, 300).bfloat16()
    for n, k, g in [(130, 300, 32), (70, 250, 128)]:
        args = _int4_args(_int4(n, k, g))
        for m in (1, 5):
            assert torch.equal(_bits(cpu_qgemv.int4_gemv_a8(x[:m, :k], *args, lib=lib)),
                               _bits(cpu_qgemv.int4_a8_def(x[:m, :k], *args))), (level, n, k, g, m)
        lin = _int4(n, k, g)
        for dt in (torch.float16, torch.float32):  # group-major scales and zeros: the vector loads
            gm = (args[1].float() * 1.5).to(dt).t().contiguous().t()
            for m in (1, 5):
                assert torch.equal(_bits(cpu_qgemv.int4_gemv_a8(x[:m, :k], lin.packed, gm, lin.zeros_gm.t(), g, lib=lib)),
                                   _bits(cpu_qgemv.int4_a8_def(x[:m, :k], lin.packed, gm, lin.zeros_u8, g))), (level, dt, m)
        scales, offsets = _offsets(n, k, g)  # float offsets (GGUF Q4_K / Q4_1)
        zeros = torch.zeros(1, dtype=torch.uint8).expand(n, -(-k // g))
        for m in (1, 5):
            assert torch.equal(
                _bits(cpu_qgemv.int4_gemv_a8(x[:m, :k], lin.packed, scales, zeros, g, offsets=offsets, lib=lib)),
                _bits(cpu_qgemv.int4_a8_def(x[:m, :k], lin.packed, scales, zeros, g, offsets=offsets))), (level, m)
    for n in (130, 9):  # GGUF Q4_K's stored scales
        lin, ks = _int4(n, 256, 32), _kscales(n, 256)
        zeros = torch.zeros(1, dtype=torch.uint8).expand(n, 8)
        for m in (1, 5):
            assert torch.equal(_bits(cpu_qgemv.int4k_gemv_a8(x[:m, :250], lin.packed, ks, 250, lib=lib)),
                               _bits(cpu_qgemv.int4_a8_def(x[:m, :250], lin.packed, ks.scales(), zeros, 32,
                                                           offsets=ks.offsets()))), (level, n, m)
    for n, k in [(130, 300), (9, 37)]:
        q, s = _int8(n, k)
        for m in (1, 5):
            assert torch.equal(_bits(cpu_qgemv.int8_gemv_a8(x[:m, :k], q, s, lib=lib)),
                               _bits(cpu_qgemv.int8_a8_def(x[:m, :k], q, s))), (level, n, k, m)
        bs = (torch.rand(-(-k // 32), n) * 0.01).half()  # block scales (GGUF Q8_0)
        for m in (1, 5):
            assert torch.equal(_bits(cpu_qgemv.int8g_gemv_a8(x[:m, :k], q, bs, lib=lib)),
                               _bits(cpu_qgemv.int8g_a8_def(x[:m, :k], q, bs))), (level, n, k, m)
    for n in (130, 9):  # GGUF Q6_K's stored scales (K a multiple of 256), Q5_K's scales and offsets per 32
        q, k = _int8(n, 256)[0], 256
        sc, d = _q6k_scales(n, k, torch.Generator().manual_seed(n))
        fs, fo = torch.rand(k // 32, n) * 0.01, -torch.rand(k // 32, n) * 0.05
        for m in (1, 5):
            assert torch.equal(_bits(cpu_qgemv.int8g_gemv_a8(x[:m, :k], q, sc, super_scales=d, lib=lib)),
                               _bits(cpu_qgemv.int8g_a8_def(x[:m, :k], q, sc, super_scales=d))), (level, n, m)
            assert torch.equal(_bits(cpu_qgemv.int8g_gemv_a8(x[:m, :k], q, fs, offsets=fo, lib=lib)),
                               _bits(cpu_qgemv.int8g_a8_def(x[:m, :k], q, fs, offsets=fo))), (level, n, m)


@needs_kernel
def test_a8_argument_checks():
    """The a8 GEMVs check their arguments and name themselves; unchecked, what the kernel refuses
    (a row stride below K, a group that is not whole activation blocks) is a RuntimeError naming it."""
    q, s = _int8(64, 64)
    with pytest.raises(ValueError, match="int8_gemv_a8: x must be a CPU bf16 or float32"):
        cpu_qgemv.int8_gemv_a8(torch.randn(1, 64, dtype=torch.float64), q, s)  # (float32 x: the LM head's)
    with pytest.raises(ValueError, match="int8_gemv_a8: qweight must .* got torch.int8 .* torch.float32"):
        cpu_qgemv.int8_gemv_a8(torch.randn(1, 64).bfloat16(), q, s.float())
    with pytest.raises(RuntimeError, match=r"int8_gemv_a8: the C kernel failed \(code 1\) on M=1 N=64 K=64"):
        # a row stride below K (unchecked): the kernel refuses it
        cpu_qgemv.int8_gemv_a8(torch.randn(64).bfloat16().as_strided((1, 64), (0, 1)), q, s, check=False)
    packed, scales, zeros, g = _int4_args(_int4(64, 64, 32))
    x = torch.randn(1, 64).bfloat16()
    with pytest.raises(ValueError, match="int4_gemv_a8: packed"):
        cpu_qgemv.int4_gemv_a8(x, packed[:-1], scales, zeros, g)
    with pytest.raises(ValueError, match="K=20"):
        cpu_qgemv.int4_gemv_a8(x[:, :20], packed, scales, zeros, g)
    # the same bytes read as 4 groups of 16 columns: a valid int4 layout, but half an activation block per group
    z16, s16 = zeros.repeat_interleave(2, 1), scales.repeat_interleave(2, 1)
    with pytest.raises(ValueError, match=r"int4_gemv_a8: group_size 16 \(32, 64 or 128\)"):
        cpu_qgemv.int4_gemv_a8(x, packed, s16, z16, 16)
    with pytest.raises(RuntimeError, match="int4_gemv_a8: the C kernel failed \\(code 1\\) .* group=16"):
        cpu_qgemv.int4_gemv_a8(x, packed, s16, z16, 16, check=False)


@needs_kernel
def test_int8_layer_uses_kernel():
    """Any input: the a8 kernel's bits (float32 inputs through bf16), at any K."""
    q, s = _int8(300, 176)
    lin = Int8Linear(q, s, None)
    x = torch.randn(PACKED_MAX_ROWS, 176)
    y = lin(x)
    assert y.dtype == torch.float32
    assert torch.equal(y, cpu_qgemv.int8_a8_def(x.bfloat16(), q, s).float())
    q, s = _int8(300, 172)
    lin = Int8Linear(q, s, None)
    xb = torch.randn(3, 172).bfloat16()  # any K in bf16
    assert torch.equal(_bits(lin(xb)), _bits(cpu_qgemv.int8_a8_def(xb, q, s)))
    x = torch.randn(3, 172)  # float32 at K % 16 != 0 too (torch's packed op, without the kernel, needs K % 16 == 0)
    assert torch.equal(lin(x), cpu_qgemv.int8_a8_def(x.bfloat16(), q, s).float())


@needs_kernel
def test_int4_layer_uses_kernel():
    lin = _int4(200, 172, 32, seed=5)
    x = torch.randn(int4_mod.PACKED_MAX_ROWS, 172)
    y = lin(x)
    assert y.dtype == torch.float32
    assert torch.equal(y, cpu_qgemv.int4_a8_def(x.bfloat16(), *_int4_args(lin)).float())


@needs_kernel
def test_int4_layer_every_row_is_a8():
    """A prompt-sized input gets the a8 GEMV's bits, as one row (a decode step) does: a row's bits
    never depend on its batch."""
    lin = _int4(200, 172, 32, seed=12)
    x = torch.randn(int4_mod.PACKED_MAX_ROWS + 20, 172).bfloat16()
    y = lin(x)
    assert torch.equal(_bits(y), _bits(cpu_qgemv.int4_a8_def(x, *_int4_args(lin))))
    for m in (0, 47):
        assert torch.equal(_bits(lin(x[m : m + 1])), _bits(y[m : m + 1]))


@needs_kernel
def test_int4_scales_zeros_in_place():
    """torch's scales_zeros [G, Np, 2] as the scales: the same bits as its [N, G] view."""
    lin = _int4(100, 200, 32, seed=6)
    packed, scales, zeros, g = _int4_args(lin)
    x = torch.randn(2, 200).bfloat16()
    ref = cpu_qgemv.int4_a8_def(x, packed, scales, zeros, g)
    assert torch.equal(_bits(cpu_qgemv.int4_a8_def(x, packed, lin.scales_zeros, zeros, g)), _bits(ref))
    assert torch.equal(_bits(cpu_qgemv.int4_gemv_a8(x, packed, lin.scales_zeros, zeros, g)), _bits(ref))
    assert torch.equal(_bits(cpu_qgemv.int4_gemv_a8(x, packed, lin.scales_zeros, lin.zeros_gm.t(), g)), _bits(ref))
    with pytest.raises(ValueError, match="scales_zeros"):
        cpu_qgemv.int4_gemv_a8(x, packed, lin.scales_zeros[:1], zeros, g)


def test_int8_layer_prefill_path(monkeypatch):
    """More than PACKED_MAX_ROWS bf16 rows: the a8 GEMV's bits with the C kernel, as one row (a decode
    step) gets (float32 inputs too, through bf16); without it the dense path bf16(bf16(q @ x^T)^T * scales)
    with q exact in bf16, in row chunks for big weights (tested here directly), and float32 inputs
    the float32 path."""
    from llmsys.quant import int8_fp8

    q, s = _int8(300, 176, seed=7)
    lin = Int8Linear(q, s, None)
    xb = torch.randn(PACKED_MAX_ROWS + 5, 176).bfloat16()
    want = torch.mm(q.bfloat16(), xb.t()).t() * s
    y = lin(xb)
    assert torch.equal(_bits(y), _bits(cpu_qgemv.int8_a8_def(xb, q, s) if KERNEL else want))
    for m in (0, 3):
        assert torch.equal(_bits(lin(xb[m : m + 1])), _bits(y[m : m + 1]))
    assert torch.equal(_bits(lin._dequant_matmul(xb)), _bits(want))
    ref = xb.float() @ (q.float() * s.float()[:, None]).t()
    assert (want.float() - ref).norm() / ref.norm() < 5e-3
    assert (y.float() - ref).norm() / ref.norm() < A8_REL_ERR
    monkeypatch.setattr(int8_fp8, "DEQUANT_CHUNK_BYTES", 128 * 176 * 2)  # 128-row chunks: 3 GEMMs
    chunked = lin._dequant_matmul(xb)
    assert torch.allclose(chunked.float(), want.float(), rtol=1e-2, atol=1e-3)
    assert torch.equal(_bits(chunked[:, 128:256]), _bits(torch.mm(q[128:256].bfloat16(), xb.t()).t() * s[128:256]))
    x = torch.randn(PACKED_MAX_ROWS + 5, 176)
    want32 = cpu_qgemv.int8_a8_def(x.bfloat16(), q, s).float() if KERNEL else torch.nn.functional.linear(
        x, q.float()) * s.float()
    assert torch.equal(lin(x), want32)


@needs_kernel
@pytest.mark.parametrize("m,n,k", [(1, 64, 576), (3, 130, 200), (7, 257, 1000), (2, 5, 16), (1, 3, 7), (13, 70, 33)])
def test_bf16_gemv_is_its_definition(m, n, k):
    """The C bf16 GEMV (the decode GEMV of bf16 layers): its definition bit for bit,
    with row tails (N % 4), K tails (K % 16) and strided rows of x; close to the float64 product."""
    g = torch.Generator().manual_seed(m * n + k)
    x, w = torch.randn(m, k + 3, generator=g).bfloat16()[:, :k], torch.randn(n, k, generator=g).bfloat16()
    y = cpu_qgemv.bf16_gemv(x, w)
    assert torch.equal(_bits(y), _bits(cpu_qgemv.bf16_gemv_def(x, w)))
    ref = x.double() @ w.double().t()
    assert (y.double() - ref).abs().max() <= 2**-7 * ref.abs().max() + 1e-6
    with pytest.raises(ValueError, match="bf16_gemv: weight must be a CPU bf16"):
        cpu_qgemv.bf16_gemv(x, w.float())
    with pytest.raises(ValueError, match=r"bf16_gemv: x must be a CPU bf16 \[\d+, \d+\] tensor"):
        cpu_qgemv.bf16_gemv(x.float(), w)


@needs_kernel
@pytest.mark.parametrize("level", [None, *x86_levels()])  # None: the build this CPU loads
@pytest.mark.parametrize("k", [1100, 16, 40])  # 512-column blocks and a tail; one block; a tail only past 16
def test_bf16_gemv_batches_are_its_definition_and_batch_invariant(level, k, tmp_path):
    """bf16 batches (prompts: the AVX2 builds' register-blocked tile of 3 rows of x by 2 weight rows, the
    AVX512-BF16 build's lane tiles): the GEMV's definition bit for bit, bf16 and float32 out, with row tails,
    48-row weight blocks and strided x; a row's bits are the same alone, in any batch and on one thread."""
    lib = None if level is None else other_isa_build(cpu_qgemv._SOURCE, cpu_qgemv._SIGNATURES, level, tmp_path)
    g = torch.Generator().manual_seed(k)
    x = torch.randn(37, k + 3, generator=g).bfloat16()[:, :k]
    w = torch.randn(101, k, generator=g).bfloat16()
    for out in (torch.bfloat16, torch.float32):
        y = cpu_qgemv.bf16_gemv(x, w, out_dtype=out, lib=lib)
        assert torch.equal(_bits(y), _bits(cpu_qgemv.bf16_gemv_def(x, w, out_dtype=out)))
        for rows in (slice(0, 1), slice(0, 4), slice(5, 12), slice(30, 37)):
            assert torch.equal(_bits(cpu_qgemv.bf16_gemv(x[rows], w, out_dtype=out, lib=lib)), _bits(y[rows]))
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        assert torch.equal(_bits(cpu_qgemv.bf16_gemv(x, w, out_dtype=torch.float32, lib=lib)), _bits(y))
    finally:
        torch.set_num_threads(threads)


@needs_kernel
@pytest.mark.parametrize("level", [None, *x86_levels()])  # None: the build this CPU loads
def test_bf16_gemm_is_its_definition_and_batch_invariant(level, tmp_path):
    """The C bf16 GEMM (bf16 prompts where oneDNN has no bf16): its definition bit for bit (one float32 FMA
    chain per output over k in order, + bias, one rounding) on every AVX2 + FMA build this CPU runs, with M,
    N and K tails (6-row panels, 16-row blocks, 256-column blocks) and strided rows of x; a row's bits are
    the same alone, in any batch, from a row chunk of the weight and on one thread. Builds without AVX2 +
    FMA say so and refuse."""
    lib = None if level is None else other_isa_build(cpu_qgemv._SOURCE, cpu_qgemv._SIGNATURES, level, tmp_path)
    g = torch.Generator().manual_seed(5)
    x = torch.randn(23, 300 + 5, generator=g).bfloat16()[:, :300]
    w, b = (torch.randn(37, 300, generator=g) * 0.1).bfloat16(), torch.randn(37, generator=g).bfloat16()
    if not cpu_qgemv.bf16_gemm_native(lib):
        with pytest.raises(RuntimeError, match="not an AVX2 \\+ FMA build"):
            cpu_qgemv.bf16_gemm(x, w, b, lib=lib)
        return
    y = cpu_qgemv.bf16_gemm(x, w, b, lib=lib)
    assert torch.equal(_bits(y), _bits(cpu_qgemv.bf16_gemm_def(x, w, b)))
    assert torch.equal(_bits(cpu_qgemv.bf16_gemm(x, w, lib=lib)), _bits(cpu_qgemv.bf16_gemm_def(x, w)))
    for rows in (slice(0, 1), slice(5, 12), slice(17, 23)):
        assert torch.equal(_bits(cpu_qgemv.bf16_gemm(x[rows], w, b, lib=lib)), _bits(y[rows]))
    parts = [cpu_qgemv.bf16_gemm(x, w[r0:r1], b[r0:r1], lib=lib) for r0, r1 in ((0, 16), (16, 21), (21, 37))]
    assert torch.equal(_bits(torch.cat(parts, 1)), _bits(y))
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        assert torch.equal(_bits(cpu_qgemv.bf16_gemm(x, w, b, lib=lib)), _bits(y))
    finally:
        torch.set_num_threads(threads)
    ref = x.double() @ w.double().t() + b.double()
    assert (y.double() - ref).abs().max() <= 2**-7 * ref.abs().max()
    with pytest.raises(ValueError, match="bf16_gemm: bias must be a contiguous bfloat16 \\[37\\]"):
        cpu_qgemv.bf16_gemm(x, w, b.float(), lib=lib)
    with pytest.raises(ValueError, match=r"bf16_gemm: weight must be a CPU bfloat16 \[37, 300\]"):
        cpu_qgemv.bf16_gemm(x, w.float(), lib=lib)


@needs_kernel
@pytest.mark.parametrize("level", [None, *x86_levels()])  # None: the build this CPU loads
@pytest.mark.parametrize("k", [96, 100])  # whole 32-column blocks, and a tail block
def test_a8_edge_values_are_the_definition_on_every_build(k, level, tmp_path):
    """x with NaN, infinities, all-zero blocks, subnormals and huge values: the C a8 quantization (vector
    code for whole blocks, scalar for the tail) gives quantize_a8's codes, so the GEMVs give the definitions'
    bits, at 1 row and at 4 (the VNNI tiles), on every ISA build this CPU runs."""
    g = torch.Generator().manual_seed(k)
    x = torch.randn(4, k, generator=g) * 3
    x[0, 5], x[0, 40] = float("nan"), float("inf")
    x[1, :32] = 0.0  # a zero block: d = 0, codes 0
    x[1, 33], x[1, 70] = -float("inf"), 1e-40
    x[2, :] = x[2, :] * 1e30
    x[3, 64:] = float("nan")
    x = x.bfloat16()
    q, s = _int8(40, k)
    lin = _int4(64, k, 32, seed=2)
    lib = None if level is None else other_isa_build(cpu_qgemv._SOURCE, cpu_qgemv._SIGNATURES, level, tmp_path)
    for rows in (slice(0, 1), slice(0, 4)):
        args = _int4_args(lin)
        for got, want in ((cpu_qgemv.int8_gemv_a8(x[rows], q, s, lib=lib), cpu_qgemv.int8_a8_def(x[rows], q, s)),
                          (cpu_qgemv.int4_gemv_a8(x[rows], *args, lib=lib), cpu_qgemv.int4_a8_def(x[rows], *args))):
            # an infinite x makes its row's block scale infinite: NaN outputs (the C rounds any NaN to 0x7fc0)
            nan = want.isnan()
            assert torch.equal(got.isnan(), nan) and torch.equal(_bits(got[~nan]), _bits(want[~nan]))
            assert nan[0].all() and (rows.stop == 1 or (nan[1].all() and not nan[2:].any()))  # rows 0, 1 hold an inf


@needs_kernel
@pytest.mark.parametrize("m,n,k", [(1, 64, 576), (3, 130, 200), (7, 257, 1000), (2, 5, 16), (1, 3, 7), (11, 70, 33)])
def test_f32_gemv_is_its_definition(m, n, k):
    """The C float32 GEMV (the decode GEMV of small float32 layers): its definition bit for bit (16 lanes,
    the product rounded before the add, the lanes' tree), with row and K tails and strided rows of x; close
    to the float64 product."""
    g = torch.Generator().manual_seed(m * n + k)
    x, w = torch.randn(m, k + 3, generator=g)[:, :k], torch.randn(n, k, generator=g)
    y = cpu_qgemv.f32_gemv(x, w)
    assert torch.equal(y.view(torch.int32), cpu_qgemv.f32_gemv_def(x, w).view(torch.int32))
    ref = x.double() @ w.double().t()
    assert (y.double() - ref).abs().max() <= 1e-5 * ref.abs().max()
    with pytest.raises(ValueError, match=r"f32_gemv: weight must be a CPU float32 \[\d+, \d+\] tensor"):
        cpu_qgemv.f32_gemv(x, w.bfloat16())
    with pytest.raises(ValueError, match=r"f32_gemv: x must be a CPU float32"):
        cpu_qgemv.f32_gemv(x.bfloat16(), w)


@needs_kernel
def test_k_quant_layout_argument_errors_name_what_is_wrong():
    """Offsets, Q4_K's and Q6_K's stored scales given in the wrong shape or dtype: a ValueError (kernels) or a
    one-line CheckpointError (layers) naming it, before any C kernel reads memory it should not."""
    from llmsys.kernels import pack_int4
    from llmsys.kernels.common.errors import CheckpointError
    from llmsys.quant.int8_block import Int8BlockLinear

    lin = _int4(64, 256, 32)
    x = torch.randn(1, 256).bfloat16()
    zeros = torch.zeros(1, dtype=torch.uint8).expand(64, 8)
    with pytest.raises(ValueError, match=r"int4_gemv_a8: offsets must be float32 \(64, 8\)"):
        cpu_qgemv.int4_gemv_a8(x, lin.packed, torch.rand(64, 8), zeros, 32, offsets=torch.rand(64, 8).half())
    ks = _kscales(64, 256)
    bad = type(ks)(ks.sc[:4], ks.m[:4], ks.d, ks.dmin)  # 4 groups: not whole 256-column super-blocks
    with pytest.raises(RuntimeError, match=r"int4_gemv_a8: the C kernel failed \(code 1\) .*Q4_K scales"):
        cpu_qgemv.int4k_gemv_a8(torch.randn(1, 128).bfloat16(), lin.packed, bad, 128)
    q = torch.zeros(64, 256, dtype=torch.int8)
    sc, d = _q6k_scales(64, 256, torch.Generator().manual_seed(0))
    with pytest.raises(ValueError, match=r"int8 \[K/16, N\] with fp16 super_scales \[K/256, N\]"):
        cpu_qgemv.int8g_gemv_a8(x, q, sc, super_scales=d.float())
    codes = pack_int4(torch.zeros(64, 256, dtype=torch.uint8))
    with pytest.raises(CheckpointError, match=r"int4 offsets torch.float16 \(64, 8\) need float32"):
        Int4Linear(codes, torch.rand(64, 8), torch.zeros(64, 8), offsets=torch.rand(64, 8).half())
    with pytest.raises(CheckpointError, match=r"int4 tensors disagree"):  # Q4_K scales of another row count
        Int4Linear(codes, None, torch.zeros(64, 8), kscales=_kscales(32, 256))
    with pytest.raises(CheckpointError, match=r"expected int8 \[N, K\] and \[16, 64\] \(int8 scales per 16 columns"):
        Int8BlockLinear(q, sc, None, super_scales=d[:, :32])
    with pytest.raises(CheckpointError, match=r"\(float32 scales and offsets, one per 32 columns"):
        Int8BlockLinear(q, torch.rand(8, 64), None, offsets=torch.rand(8, 32))


def test_weight_and_scale_kinds_are_the_c_enums():
    """WeightKind / ScaleKind hold the values of fused_layer.h's enum weight_kind and gemv_common.h's enum
    scale_kind, name for name (the fused kernels read DecodeWeight.kind and .scale_kind as those)."""
    import re

    here = cpu_qgemv._SOURCE.sources[0].parent
    for enum_cls, header, prefix in ((cpu_qgemv.WeightKind, "fused_layer.h", "WEIGHT_"),
                                     (cpu_qgemv.ScaleKind, "gemv_common.h", "SCALE_")):
        c = {name: int(v) for name, v in re.findall(prefix + r"(\w+) = (\d+)", (here / header).read_text())}
        assert c == {m.name: m.value for m in enum_cls}, header


def test_decode_weights_carry_their_kind():
    """Each decode-weight builder names its format and its scales' storage with the enums."""
    q, s = _int8(64, 96)
    w = cpu_qgemv.int8_decode_weight(q, s, None)
    assert (w.kind, w.n, w.k, w.kp, w.q, w.scales, w.bias) == (cpu_qgemv.WeightKind.INT8, 64, 96, 96, q.data_ptr(),
                                                                s.data_ptr(), None)
    bs = torch.rand(3, 64).half()
    assert cpu_qgemv.int8g_decode_weight(q, bs, None).scale_kind == cpu_qgemv.ScaleKind.F16
    assert cpu_qgemv.int8g_decode_weight(q, bs, None).kind == cpu_qgemv.WeightKind.INT8_BLOCK
    assert cpu_qgemv.int8g_decode_weight(q, bs.float(), None, offsets=bs.float()).kind == cpu_qgemv.WeightKind.INT8_Q5K
    lin = _int4(64, 96, 32)
    packed, scales, zeros, g = _int4_args(lin)
    w4 = cpu_qgemv.int4_decode_weight(packed, scales, zeros, g, 96, None)
    assert (w4.kind, w4.scale_kind, w4.gs, w4.kp) == (cpu_qgemv.WeightKind.INT4, cpu_qgemv.ScaleKind.BF16, 32, 96)
    assert cpu_qgemv.int4_decode_weight(packed, scales.double(), zeros, g, 96, None) is None  # not read in place
    wb = torch.randn(8, 96).bfloat16()
    assert cpu_qgemv.bf16_decode_weight(wb, None).kind == cpu_qgemv.WeightKind.BF16
    assert cpu_qgemv.f32_decode_weight(wb.float(), None).kind == cpu_qgemv.WeightKind.F32


@needs_kernel
@pytest.mark.parametrize("level", x86_levels())
def test_int8_code_minus_128_at_every_level(level, tmp_path):
    """A weight code of -128 (which a GGUF Q8_0 file may hold; llama.cpp's quantizer writes none) against
    negative activations: every level's int8 dots give the definition's bits. The byte dots take |w| as the
    unsigned operand and the activation signed by w (activation codes stay within +-127), so no negation of
    -128 overflows."""
    lib = other_isa_build(cpu_qgemv._SOURCE, cpu_qgemv._SIGNATURES, level, tmp_path)
    g = torch.Generator().manual_seed(128)
    for n, k in [(64, 256), (9, 37)]:
        q = torch.randint(-128, 128, (n, k), dtype=torch.int8, generator=g)
        q[:, ::3] = -128
        s = (torch.rand(n, generator=g) * 0.01 + 0.001).bfloat16()
        x = -torch.rand(5, k, generator=g).bfloat16()  # all negative: every -128 code meets a negative x
        bs = (torch.rand(-(-k // 32), n, generator=g) * 0.01).half()
        for m in (1, 5):
            assert torch.equal(_bits(cpu_qgemv.int8_gemv_a8(x[:m], q, s, lib=lib)),
                               _bits(cpu_qgemv.int8_a8_def(x[:m], q, s))), (level, n, k, m)
            assert torch.equal(_bits(cpu_qgemv.int8g_gemv_a8(x[:m], q, bs, lib=lib)),
                               _bits(cpu_qgemv.int8g_a8_def(x[:m], q, bs))), (level, n, k, m)
