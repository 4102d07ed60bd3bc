"""Quantized linear layers: error bounds, sizes, state round trips, CPU fast paths."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from llmsys.kernels.common.errors import CheckpointError, InvalidParameterError
from llmsys.quant import (
    FP8Linear, Int4Linear, Int8Linear, NF4Linear, QuantSpec, parse_quant, quantize_linear, swap_linears,
)
from conftest import A8_REL_ERR, C_KERNEL
from llmsys.kernels import pack_cpu_int4
from llmsys.quant.int4 import dequantize_int4, quantize_int4, unpack_cpu_int4, unpack_int4

torch.set_num_threads(1)

# Relative Frobenius error bounds for Gaussian weights (measured ~0.7%, ~9%, ~8%, ~10%, ~9%, ~2.6%).
WEIGHT_REL_ERR = {"int8": 0.01, "int4:g64": 0.10, "int4:g32": 0.09, "int4:g128": 0.11, "nf4": 0.10,
                  "nf4:dq": 0.10, "fp8": 0.035}
SHAPES = [(128, 256), (200, 172)]  # aligned, and stories260k-like ragged K (172) / N not /64


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


def _rebuild(m: nn.Module) -> nn.Module:
    sd = dict(m.state_dict())
    if isinstance(m, Int4Linear):
        return Int4Linear.from_quantized(sd, in_features=m.in_features)
    if isinstance(m, NF4Linear):
        return NF4Linear.from_quantized(sd, m.in_features, m.out_features)
    return type(m).from_quantized(sd)


def test_parse_quant():
    assert parse_quant("none") == QuantSpec("none")
    assert parse_quant("int8") == QuantSpec("int8")
    assert parse_quant("int4") == QuantSpec("int4", 64)
    assert parse_quant("int4:g32").group_size == 32
    assert parse_quant("INT4:g128") == QuantSpec("int4", 128)
    assert parse_quant("nf4:dq") == QuantSpec("nf4", 64, True)
    assert parse_quant("fp8").method == "fp8"
    for spec in ("int4:g128", "nf4:dq", "int8"):
        assert parse_quant(parse_quant(spec).name) == parse_quant(spec)
    for bad in ("int3", "int4:g48", "int4:x", "nf4:q", "fp8:dq", "gguf"):
        with pytest.raises(InvalidParameterError, match="valid|int4:g"):
            parse_quant(bad)


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("name", list(WEIGHT_REL_ERR))
def test_layer_error_roundtrip_and_state(name, shape):
    torch.manual_seed(0)
    n, k = shape
    w = torch.randn(n, k) * 0.02
    b = torch.randn(n) * 0.1
    x = torch.randn(2, 3, k)
    m = quantize_linear(w, b, parse_quant(name))
    assert (m.in_features, m.out_features) == (k, n)
    wq = m.dequantize()
    assert wq.shape == (n, k)
    assert _rel(wq, w) < WEIGHT_REL_ERR[name]
    y = m(x)
    assert y.shape == (2, 3, n) and y.dtype == x.dtype
    # The layer computes what its own dequantized weight says, up to its activation rounding (int8 per 32
    # columns on the CPU's decode-sized paths, the six rows here).
    assert _rel(y, F.linear(x, wq, b)) < A8_REL_ERR
    # And approximates the float layer within the weight error.
    assert _rel(y, F.linear(x, w, b)) < WEIGHT_REL_ERR[name]
    m2 = _rebuild(m)
    assert torch.equal(m2(x), y)
    assert torch.equal(m2.dequantize(), wq)


def test_worst_case_elementwise_bounds():
    torch.manual_seed(1)
    w = torch.randn(64, 256)
    q8 = Int8Linear.from_float(w)
    step8 = w.abs().amax(1, keepdim=True) / 127
    assert torch.all((q8.dequantize() - w).abs() <= 0.5 * step8 * 1.01 + 1e-7)
    q4 = Int4Linear.from_float(w, group_size=64)
    g = w.view(64, 4, 64)
    step4 = (g.amax(-1).clamp(min=0) - g.amin(-1).clamp(max=0)) / 15  # [N, G]
    err = (q4.dequantize() - w).abs().view(64, 4, 64)
    assert torch.all(err <= 0.5 * step4[..., None] * 1.01 + 1e-7)


def test_nbytes_ratios():
    n, k = 512, 1024
    w = torch.randn(n, k)
    bf16 = n * k * 2
    assert Int8Linear.from_float(w).nbytes() <= 0.53 * bf16
    assert Int4Linear.from_float(w, group_size=64).nbytes() <= 0.30 * bf16  # incl. scales & zeros
    canonical = Int4Linear.from_quantized(dict(Int4Linear.from_float(w).state_dict()), prefer_packed=False)
    assert canonical.mode == "canonical" and canonical.nbytes() <= 0.30 * bf16
    assert NF4Linear.from_float(w).nbytes() <= 0.29 * bf16
    assert NF4Linear.from_float(w, spec=parse_quant("nf4:dq")).nbytes() < NF4Linear.from_float(w).nbytes()
    assert FP8Linear.from_float(w).nbytes() <= 0.51 * bf16


@pytest.mark.parametrize("n,k,g", [(64, 64, 32), (128, 96, 32), (200, 172, 64), (96, 256, 128)])
def test_int4_cpu_packed_matches_canonical(n, k, g):
    torch.manual_seed(2)
    w = torch.randn(n, k)
    qweight, scales, zeros = quantize_int4(w, g)
    packed = Int4Linear(qweight, scales, zeros, in_features=k)
    canon = Int4Linear(qweight, scales, zeros, in_features=k, prefer_packed=False)
    assert packed.mode == "packed_cpu" and canon.mode == "canonical"
    assert not hasattr(packed, "qweight")  # only the repacked buffer is held at run time
    # Exact unpacking of the CPU tiling back to canonical.
    sd = packed.state_dict()
    assert torch.equal(sd["qweight"], qweight) and torch.equal(sd["scales"], scales) and torch.equal(sd["zeros"], zeros)
    for m in (1, 5, 40):
        x = torch.randn(m, k)
        ref = x @ dequantize_int4(qweight, scales, zeros, k).t()
        assert _rel(canon(x), ref) < 1e-5
        # the C kernel runs every row with x in int8 (a8); without it, a dense GEMM on bf16 x
        assert _rel(packed(x), ref) < (A8_REL_ERR if C_KERNEL else 3e-3)
        assert _rel(packed(x.bfloat16()).float(), ref) < 1e-2


def test_cpu_int4_tiling_is_fixed_and_inverted():
    """The CPU tiling is llmsys's own, the same bytes on every CPU (torch's repack differs by ISA):
    byte (b, k, j) holds row 64b+j low and row 64b+32+j high; unpack inverts it exactly."""
    torch.manual_seed(3)
    for n, kp in [(64, 64), (128, 96), (640, 128)]:
        q = torch.randint(0, 16, (n, kp), dtype=torch.uint8)
        p = pack_cpu_int4(q)
        assert p.shape == (n, kp // 2) and p.dtype == torch.uint8
        b3 = p.view(n // 64, kp, 32)
        for b, k, j in [(0, 0, 0), (n // 64 - 1, kp - 1, 31), (n // 64 // 2, kp // 3, 17)]:
            assert int(b3[b, k, j]) == int(q[64 * b + j, k]) | int(q[64 * b + 32 + j, k]) << 4
        assert torch.equal(unpack_cpu_int4(p, n, kp), q)


def test_int8_fast_path_matches_dequant():
    torch.manual_seed(4)
    w = torch.randn(96, 128)
    m = Int8Linear.from_float(w)
    for dt in (torch.float32, torch.bfloat16):
        x = torch.randn(3, 128, dtype=dt)
        ref = x.float() @ m.dequantize().t()
        assert _rel(m(x), ref) < 1e-2
    x = torch.randn(64, 128)  # prefill-sized: a8 with the C kernel, else the fp32 dequant path (exact-ish)
    assert _rel(m(x), x @ m.dequantize().t()) < (A8_REL_ERR if C_KERNEL else 1e-5)


def test_int4_pack_layout_is_canonical():
    q = torch.tensor([[1, 2, 3, 4, 15, 0]], dtype=torch.uint8)
    w = torch.zeros(1, 64)
    qweight, _, _ = quantize_int4(w, 32)
    assert qweight.shape == (1, 32) and qweight.dtype == torch.uint8
    from llmsys.quant.int4 import pack_int4
    packed = pack_int4(q)
    assert packed.tolist() == [[1 | (2 << 4), 3 | (4 << 4), 15]]
    assert torch.equal(unpack_int4(packed), q)


def test_errors_are_user_facing():
    with pytest.raises(CheckpointError, match="missing scales"):
        Int8Linear.from_quantized({"qweight": torch.zeros(2, 2, dtype=torch.int8)})
    with pytest.raises(CheckpointError):
        Int4Linear(torch.zeros(4, 32, dtype=torch.uint8), torch.ones(4, 3), torch.zeros(4, 3))
    with pytest.raises(CheckpointError):
        quantize_linear(torch.zeros(3), None, parse_quant("int8"))


def test_swap_linears_in_place_and_skip():
    torch.manual_seed(5)
    model = nn.Sequential()
    model.add_module("proj", nn.Linear(64, 128))
    model.add_module("act", nn.GELU())
    model.add_module("down", nn.Linear(128, 64, bias=False))
    model.add_module("lm_head", nn.Linear(64, 32, bias=False))
    x = torch.randn(4, 64)
    with torch.no_grad():
        ref = model(x)
    old = model.proj
    assert swap_linears(model, parse_quant("int4:g32")) == 2
    assert isinstance(model.proj, Int4Linear) and isinstance(model.down, Int4Linear)
    assert type(model.lm_head) is nn.Linear
    assert old.weight is None  # the float weight was released
    with torch.no_grad():
        y = model(x)
        deq = F.linear(F.gelu(model.proj.dequantize() @ x.t() + model.proj.bias[:, None]).t(), model.down.dequantize())
        assert _rel(model.lm_head(deq), y) < 2 * A8_REL_ERR  # the dequantized network (two a8 layers)
        assert _rel(y, ref) < 0.2  # two stacked int4 layers (~9% each)
    assert swap_linears(model, parse_quant("none")) == 0


def test_quantizing_in_row_chunks_gives_the_same_tensors(monkeypatch):
    """Big weights are quantized (and, for int4 on CPU, repacked) in row chunks so the float32
    temporaries stay small; every per-row format must give the tensors of the one-piece run."""
    from llmsys.quant import base
    from llmsys.quant.int8_fp8 import quantize_fp8, quantize_int8

    torch.manual_seed(0)
    w = (torch.randn(1000, 200) * 0.02).bfloat16()  # not a multiple of any chunk below
    whole = {"int8": quantize_int8(w), "int4": quantize_int4(w, 64), "fp8": quantize_fp8(w)}
    lin = Int4Linear.from_float(w, group_size=64)
    monkeypatch.setattr(base, "QUANT_CHUNK_BYTES", 3 * 64 * 200 * 4 + 12)  # 192 rows; int4 repack: 128 rows
    chunked = {"int8": quantize_int8(w), "int4": quantize_int4(w, 64), "fp8": quantize_fp8(w)}
    for name in whole:
        for a, b in zip(whole[name], chunked[name]):
            assert a.dtype == b.dtype and torch.equal(a.view(torch.uint8), b.view(torch.uint8)), name
    small = Int4Linear.from_float(w, group_size=64)  # the CPU tiling, in 64-row chunks
    for name in ("packed", "scales_zeros", "zeros_u8"):
        assert torch.equal(getattr(small, name), getattr(lin, name)), name


def test_int8_block_layer_rows_cat_and_both_kernels(monkeypatch):
    """Int8BlockLinear (GGUF Q8_0 kept as stored): exact rows, fused rows side by side with the same bits,
    the C a8 GEMV and the torch fallback both close to the float product of the dequantized weight."""
    from llmsys.quant import Int8BlockLinear, int8_block
    from llmsys.quant.base import KernelFamily

    torch.manual_seed(0)
    ws = [torch.randn(n, 200) * 0.05 for n in (64, 48, 16)]  # K = 200: a tail block of 8 columns
    layers = [Int8BlockLinear.from_float(w) for w in ws]
    one = layers[0]
    d = one.block_scales.float().repeat_interleave(32, 0)[:200].t()  # [N, K]
    assert ((one.dequantize() - ws[0]).abs() <= d / 2 + 1e-7).all()  # Q8_0's rounding: half a step
    assert torch.equal(one.rows(torch.tensor([5, 0, 5])), one.dequantize()[[5, 0, 5]])
    x = torch.randn(7, 200).bfloat16()
    cat = Int8BlockLinear.cat_rows(layers)
    assert torch.equal(cat(x), torch.cat([m(x) for m in layers], dim=1))
    ref = x.float() @ one.dequantize().t()
    err = ((one(x).float() - ref).abs().max() / ref.abs().max()).item()
    assert err < (A8_REL_ERR if one.kernel.family is KernelFamily.C_INT8_BLOCK else 1e-2), err
    monkeypatch.setattr(int8_block, "quant_matmul_support", lambda: type("S", (), {"available": False})())
    plain = Int8BlockLinear(one.qweight, one.block_scales, None)
    assert plain.kernel.family is KernelFamily.TORCH_DEQUANT
    assert ((plain(x).float() - ref).abs().max() / ref.abs().max()).item() < 1e-2
    assert torch.equal(plain(x.float()), x.float() @ one.dequantize().t())
