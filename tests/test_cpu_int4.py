"""The CPU int4 dequantization kernel (kernels/cpu_int4.c) against its torch definition.

Dequantization is deterministic, so the C kernel must match the torch
reference bit for bit, at any thread count, for every group size, padded rows
and columns, bf16 / fp16 / fp32 scales and row ranges; without a compiler (or
when the build fails) the torch path runs with the same results.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest
import torch
import torch.nn.functional as F

from conftest import A8_REL_ERR, other_isa_build, x86_levels
from llmsys.kernels import cpu_int4, cpu_qgemv
from llmsys.kernels.cpu_int4 import dequant_cpu_int4
from llmsys.quant import int4 as int4_mod
from llmsys.kernels.cpu_linear import mm_bf16
from llmsys.quant.int4 import Int4Linear, dequantize_int4, quantize_int4

KERNEL = cpu_int4.kernel_status().startswith("ok")


def _layer(n: int, k: int, g: int, seed: int = 0, scale_dtype=torch.bfloat16) -> Int4Linear:
    torch.manual_seed(seed)
    qweight, scales, zeros = quantize_int4(torch.randn(n, k) * 0.02, g)
    return Int4Linear(qweight, scales.to(scale_dtype), zeros.to(scale_dtype), in_features=k)


def _args(lin: Int4Linear):
    n = lin.out_features
    scales = lin.scales_orig if lin.scales_orig is not None else lin.scales_zeros[:, :n, 0].t()
    return lin.packed, scales, lin.zeros_u8, lin.in_features, lin.group_size


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.int16)


@pytest.mark.skipif(not KERNEL, reason=f"C kernel not built: {cpu_int4.kernel_status()}")
@pytest.mark.parametrize("n,k,g", [(64, 64, 32), (200, 172, 64), (96, 256, 128), (130, 1000, 32),
                                   (4864, 896, 64), (896, 4864, 64), (100, 172, 32)])
@pytest.mark.parametrize("threads", [1, 2])
def test_kernel_bit_exact(n, k, g, threads):
    lin = _layer(n, k, g)
    ref = dequant_cpu_int4(*_args(lin), impl="reference")
    assert torch.equal(_bits(ref), _bits(lin.dequantize(torch.bfloat16)))  # the reference is the canonical formula
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        out = dequant_cpu_int4(*_args(lin), impl="c")
    finally:
        torch.set_num_threads(before)
    assert out.shape == (n, k) and out.dtype == torch.bfloat16
    assert torch.equal(_bits(out), _bits(ref))


@pytest.mark.skipif(not KERNEL, reason=f"C kernel not built: {cpu_int4.kernel_status()}")
@pytest.mark.parametrize("scale_dtype", [torch.float16, torch.float32])
def test_kernel_other_scale_dtypes(scale_dtype):
    lin = _layer(192, 320, 64, seed=1, scale_dtype=scale_dtype)  # AWQ/GPTQ checkpoints carry fp16 scales
    assert lin.scales_orig is not None and lin.scales_orig.dtype == scale_dtype
    out = dequant_cpu_int4(*_args(lin), impl="c")
    assert torch.equal(_bits(out), _bits(dequant_cpu_int4(*_args(lin), impl="reference")))
    assert torch.equal(_bits(out), _bits(lin.dequantize(torch.bfloat16)))


@pytest.mark.skipif(not KERNEL, reason=f"C kernel not built: {cpu_int4.kernel_status()}")
def test_kernel_row_ranges_and_odd_values():
    lin = _layer(300, 200, 32, seed=2)
    full = dequant_cpu_int4(*_args(lin), impl="reference")
    for rows in [(0, 64), (64, 300), (128, 130), (256, 300)]:
        for impl in ("c", "reference"):
            part = dequant_cpu_int4(*_args(lin), rows=rows, impl=impl)
            assert torch.equal(_bits(part), _bits(full[rows[0]:rows[1]])), (rows, impl)
    # Extreme and odd scales (ties, tiny, huge, negative, zero) still round like torch.
    packed, _, zeros, k, g = _args(lin)
    torch.manual_seed(3)
    scales = (torch.randn(300, zeros.shape[1]) * torch.logspace(-42, 30, 300)[:, None]).float()  # subnormal too
    scales[0] = 0.0
    scales[1] = 1.0 + 2**-8  # (q - z) * s lands on bf16 ties
    assert torch.equal(_bits(dequant_cpu_int4(packed, scales, zeros, k, g, impl="c")),
                       _bits(dequant_cpu_int4(packed, scales, zeros, k, g, impl="reference")))


@pytest.mark.skipif(not KERNEL, reason=f"C kernel not built: {cpu_int4.kernel_status()}")
@pytest.mark.parametrize("level", x86_levels())
def test_other_code_paths_bit_exact(level, tmp_path):
    """Every ISA level's build this CPU can run (AVX512-BF16, AVX-512, AVX2, SSE2 code paths): the same bits."""
    lib = other_isa_build(cpu_int4._SOURCE, cpu_int4._SIGNATURES, level, tmp_path)
    for n, k, g, seed in [(200, 172, 64, 0), (130, 1000, 32, 1), (96, 256, 128, 2)]:
        lin = _layer(n, k, g, seed=seed)
        args = _args(lin)
        ref = dequant_cpu_int4(*args, impl="reference")
        assert torch.equal(_bits(cpu_int4.run_kernel(lib, *args)), _bits(ref)), (level, n, k, g)
        assert torch.equal(_bits(cpu_int4.run_kernel(lib, *args, rows=(64, n))), _bits(ref[64:]))
    packed, _, zeros, k, g = _args(lin)
    scales = (torch.rand(96, zeros.shape[1]) * torch.logspace(-42, 30, 96)[:, None]).float()  # subnormal too
    assert torch.equal(_bits(cpu_int4.run_kernel(lib, packed, scales, zeros, k, g)),
                       _bits(dequant_cpu_int4(packed, scales, zeros, k, g, impl="reference")))


def test_argument_checks():
    packed, scales, zeros, k, g = _args(_layer(64, 64, 32))
    with pytest.raises(ValueError, match="rows"):
        dequant_cpu_int4(packed, scales, zeros, k, g, rows=(10, 20))
    with pytest.raises(ValueError, match="scales"):
        dequant_cpu_int4(packed, scales[:, :1], zeros, k, g)
    with pytest.raises(ValueError, match="packed"):
        dequant_cpu_int4(packed[:-1], scales, zeros, k, g)
    with pytest.raises(ValueError, match="impl"):
        dequant_cpu_int4(packed, scales, zeros, k, g, impl="triton")


def _run_isolated(env_extra: dict, tmp_path) -> str:
    """Run a fresh interpreter with a private kernel cache; return its report line."""
    code = textwrap.dedent("""
        import torch
        from llmsys.kernels import cpu_int4
        from llmsys.kernels.cpu_linear import mm_bf16
        from llmsys.quant.int4 import Int4Linear
        torch.manual_seed(0)
        lin = Int4Linear.from_float(torch.randn(200, 172) * 0.02, group_size=32)
        n = lin.out_features
        args = (lin.packed, lin.scales_zeros[:, :n, 0].t(), lin.zeros_u8, lin.in_features, lin.group_size)
        same = torch.equal(cpu_int4.dequant_cpu_int4(*args).view(torch.int16),
                           lin.dequantize(torch.bfloat16).view(torch.int16))
        x = torch.randn(40, 172)
        y = lin._dequant_matmul(x.bfloat16()).float()  # the dense prefill path: dequantize + GEMM
        ref = mm_bf16(lin.dequantize(torch.bfloat16), x.bfloat16().t()).t().float()
        print(cpu_int4.kernel_status().split(":")[0], same, torch.equal(y, ref))
    """)
    env = {**os.environ, "LLMSYS_HOME": str(tmp_path), **env_extra}
    res = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=240)
    assert res.returncode == 0, res.stderr
    return res.stdout.strip().splitlines()[-1]


def test_fallback_without_compiler(tmp_path):
    """No compiler, a failing compiler, or the kernels switched off: the torch path, same bits."""
    for env, status in [({"CC": str(tmp_path / "no-such-cc")}, "build or load failed"),
                        ({"CC": "false"}, "false failed"),
                        ({"LLMSYS_NO_CKERNELS": "1"}, "disabled by LLMSYS_NO_CKERNELS")]:
        assert _run_isolated(env, tmp_path) == f"{status} True True", env
    assert not list(tmp_path.glob("kernels/*.so"))


@pytest.mark.skipif(not KERNEL, reason=f"C kernel not built: {cpu_int4.kernel_status()}")
def test_build_is_cached_by_source_hash(tmp_path):
    assert _run_isolated({}, tmp_path) == "ok True True"
    built = list(tmp_path.glob(f"kernels/{cpu_int4._SOURCE.name}-*.so"))  # the one kernel library
    assert len(built) == 1
    stamp = built[0].stat().st_mtime_ns
    assert _run_isolated({}, tmp_path) == "ok True True"  # second process reuses the build
    assert built[0].stat().st_mtime_ns == stamp and len(list(tmp_path.glob(f"kernels/{cpu_int4._SOURCE.name}*"))) == 1
    assert all(p.suffix == ".so" for p in tmp_path.glob("kernels/*"))  # no temporary files left (other kernels too)


@pytest.mark.parametrize("n,k,g", [(4864, 896, 64), (200, 172, 32), (96, 256, 128)])
def test_layer_prefill_path(n, k, g):
    """Prompt-sized inputs: the C a8 GEMV as for one row (every row's bits its own), or without the C
    kernels a dense bf16 GEMM on exactly dequantize(bf16) (tested directly, as is its error)."""
    lin = _layer(n, k, g, seed=4)
    wq = lin.dequantize(torch.bfloat16)
    kernel = cpu_qgemv.available()
    for m in (int4_mod.PACKED_MAX_ROWS + 1, 128):
        x = torch.randn(m, k)
        y = lin(x)
        assert y.dtype == torch.float32
        dense = lin._dequant_matmul(x.bfloat16()).float()
        assert torch.equal(dense, mm_bf16(wq, x.bfloat16().t()).t().float())  # the weight as oneDNN's first operand
        assert torch.allclose(dense, F.linear(x.bfloat16(), wq).float(), rtol=1e-2, atol=1e-3)
        assert torch.equal(y, cpu_qgemv.int4_a8_def(x.bfloat16(), *_args(lin)[:3], g).float() if kernel else dense)
        if kernel:
            assert torch.equal(y[m - 1 :], lin(x[m - 1 :]))  # the last row alone: its bits in the batch
        ref = x @ dequantize_int4(*[lin.canonical_tensors()[t] for t in ("qweight", "scales", "zeros")], k).t()
        assert (dense - ref).norm() / ref.norm() < 3e-3  # bf16 activations, as on the packed path
        assert (y - ref).norm() / ref.norm() < (A8_REL_ERR if kernel else 3e-3)  # + x's int8 rounding
    x = torch.randn(int4_mod.PACKED_MAX_ROWS, k)
    if cpu_qgemv.available():  # the C a8 GEMV (tests/test_cpu_qgemv.py)
        small = cpu_qgemv.int4_a8_def(x.bfloat16(), *_args(lin)[:3], g)
    else:
        small = lin._dequant_matmul(x.bfloat16())
    assert torch.equal(lin(x), small.float())


def test_layer_chunks_big_weights(monkeypatch):
    """A weight bigger than DEQUANT_CHUNK_BYTES is dequantized and multiplied in row chunks."""
    lin = _layer(1000, 256, 64, seed=5)
    x = torch.randn(48, 256).bfloat16()
    whole = lin._dequant_matmul(x)
    monkeypatch.setattr(int4_mod, "DEQUANT_CHUNK_BYTES", 300 * 256 * 2)  # 256-row chunks: 4 GEMMs
    chunked = lin._dequant_matmul(x)
    assert torch.allclose(chunked.float(), whole.float(), rtol=1e-2, atol=1e-3)
    assert torch.equal(chunked[:, 256:512], mm_bf16(lin.dequantize(torch.bfloat16)[256:512], x.t()).t())


@pytest.mark.parametrize("shape", [(4864, 128), (896, 33), (100, 37), (17, 4864), (1, 5)])
def test_transpose_bf16(shape):
    x = torch.randn(shape).bfloat16()
    out = cpu_int4.transpose_bf16(x)
    assert out.is_contiguous() and torch.equal(out, x.t())
    h = torch.randn(shape).half()
    assert torch.equal(cpu_int4.transpose_bf16(h), h.t())


@pytest.mark.skipif(not KERNEL, reason=f"C kernel not built: {cpu_int4.kernel_status()}")
def test_prefill_through_a_shared_scratch_buffer_gives_the_same_bits():
    """Layers of an engine share one dequantization buffer (``Scratch``) on the dense prefill path
    (the one that runs where the C GEMM is not native): same results, one buffer."""
    from llmsys.kernels.cpu_int4 import Scratch

    a, b = _layer(896, 512, 64, seed=5), _layer(256, 512, 64, seed=6)
    x = torch.randn(100, 512).bfloat16()
    ref = [a._dequant_matmul(x), b._dequant_matmul(x)]
    shared = Scratch()
    a.scratch = b.scratch = shared
    assert torch.equal(a._dequant_matmul(x), ref[0]) and torch.equal(b._dequant_matmul(x), ref[1])
    assert torch.equal(a._dequant_matmul(x), ref[0])
    assert shared.nbytes == 896 * 512 * 2  # grown to the largest layer, then reused
    with pytest.raises(ValueError, match="out must be"):
        dequant_cpu_int4(*_args(a), out=torch.empty(10, 10, dtype=torch.bfloat16))
