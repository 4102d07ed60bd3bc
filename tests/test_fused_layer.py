"""The fused a8 decode layer kernels (``kernels.attn_in_a8``, ``kernels.mlp_a8``; cpu_qgemv.c) against
the same layer run op by op: the C RMSNorm, each quantized layer's own a8 GEMV, its bias, the C
silu * mul. Bit for bit, on every x86 ISA level this CPU runs; weights fused into one or apart."""

from __future__ import annotations

import ctypes

import pytest
import torch

from conftest import other_isa_build, x86_levels
from llmsys import kernels
from llmsys.kernels import cpu_decode, cpu_qgemv
from llmsys.quant.int4 import Int4Linear
from llmsys.quant.int8_fp8 import Int8Linear

needs_kernel = pytest.mark.skipif(not (cpu_qgemv.available() and cpu_decode.available()),
                                  reason=f"C kernels not built: {cpu_qgemv.kernel_status()}")
BF = torch.bfloat16
D, HQ, HK, HD, INTER = 192, 6, 2, 32, 320  # INTER: not a multiple of 64 (row tails) nor of the group


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.int16)


def _layer(fmt: str, n: int, k: int, seed: int, bias: bool = False):
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(n, k, generator=g) * 0.05
    b = (torch.randn(n, generator=g) * 0.1).to(BF) if bias else None
    if fmt == "int8":
        return Int8Linear.from_float(w, b)
    return Int4Linear.from_float(w, b, group_size=64 if fmt == "int4" else 32)


def _weights(mods, rows):
    ws = [m.a8_weight(rows) for m in mods]
    assert all(w is not None for w in ws)
    return kernels.a8_proj(ws)


def _op_by_op(x, res, ln1, ln2, qkv, o_proj, gu, down, attn_out):
    """The layer as separate ops (what DecoderLayer.forward runs without the fused kernels)."""
    xn, new_res = (cpu_decode.rms_norm(x, ln1, 1e-5), x) if res is None else cpu_decode.rms_norm(x, ln1, 1e-5, res)
    y_qkv = torch.cat([m(xn) for m in qkv], dim=1)
    a = o_proj(attn_out)
    xn2, res2 = cpu_decode.rms_norm(a, ln2, 1e-5, new_res)
    g_u = torch.cat([m(xn2) for m in gu], dim=1)
    y = cpu_decode.silu_mul(g_u[:, :INTER], g_u[:, INTER:])
    return y_qkv, new_res, down(y), res2


@needs_kernel
@pytest.mark.parametrize("fmt", ["int8", "int4", "int4-g32"])
@pytest.mark.parametrize("rows", [1, 5])
def test_fused_layer_equals_op_by_op(fmt, rows):
    g = torch.Generator().manual_seed(rows)
    x, res = torch.randn(rows, D, generator=g).to(BF), torch.randn(rows, D, generator=g).to(BF)
    attn_out = torch.randn(rows, HQ * HD, generator=g).to(BF)
    ln1, ln2 = (torch.rand(D, generator=g) + 0.5).to(BF), (torch.rand(D, generator=g) + 0.5).to(BF)
    q, k, v = (_layer(fmt, h * HD, D, s, bias=True) for s, h in ((1, HQ), (2, HK), (3, HK)))
    o_proj, gate, up = _layer(fmt, D, HQ * HD, 4), _layer(fmt, INTER, D, 5), _layer(fmt, INTER, D, 6)
    down = _layer(fmt, D, INTER, 7)
    want = _op_by_op(x, res, ln1, ln2, [q, k, v], o_proj, [gate, up], down, attn_out)
    fused_qkv, fused_gu = type(q).cat_rows([q, k, v]), type(gate).cat_rows([gate, up])
    for qkv, gu in (([q, k, v], [gate, up]), ([fused_qkv], [fused_gu])):  # apart, and fused into one weight
        out, new_res = kernels.attn_in_a8(x, res, ln1, 1e-5, _weights(qkv, rows))
        assert torch.equal(_bits(out), _bits(want[0])) and torch.equal(_bits(new_res), _bits(want[1]))
        y, res2 = kernels.mlp_a8(attn_out, new_res, _weights([o_proj], rows), ln2, 1e-5, _weights(gu, rows),
                                 _weights([down], rows))
        assert torch.equal(_bits(y), _bits(want[2])) and torch.equal(_bits(res2), _bits(want[3]))
    # layer 0: no residual yet, the input itself is the residual
    out0, r0 = kernels.attn_in_a8(x, None, ln1, 1e-5, _weights([fused_qkv], rows))
    assert r0 is x and torch.equal(_bits(out0), _bits(_op_by_op(x, None, ln1, ln2, [q, k, v], o_proj, [gate, up],
                                                                 down, attn_out)[0]))


@needs_kernel
def test_a8_weight_only_where_the_layer_runs_the_a8_gemv():
    lin4, lin8 = _layer("int4", 128, 192, 0), _layer("int8", 128, 192, 0)
    assert lin4.a8_weight(28) is not None and lin4.a8_weight(29) is None  # int4 PACKED_MAX_ROWS: 28
    assert lin8.a8_weight(32) is not None and lin8.a8_weight(33) is None  # int8: 32
    w = lin4.a8_weight(1)
    assert lin4.a8_weight(1) is w  # reused while the buffers stay in place
    lin4._buffers["packed"] = lin4._buffers["packed"].clone()  # bound elsewhere, as offload binds streamed views
    w2 = lin4.a8_weight(1)
    assert w2 is not w and w2.q == lin4._buffers["packed"].data_ptr()
    w = torch.randn(64, 192) * 0.05
    f32_bias = Int8Linear.from_float(w, torch.randn(64))  # a float32 bias: the layer adds bf16(bias), not fused
    assert f32_bias.a8_weight(1) is None


@needs_kernel
@pytest.mark.parametrize("level", x86_levels())
def test_other_isas_give_the_same_bits(level, tmp_path):
    lib = other_isa_build(cpu_qgemv._SOURCE, cpu_qgemv._SIGNATURES, level, tmp_path)
    rows = 3
    g = torch.Generator().manual_seed(9)
    x, res = torch.randn(rows, D, generator=g).to(BF), torch.randn(rows, D, generator=g).to(BF)
    attn_out = torch.randn(rows, HQ * HD, generator=g).to(BF)
    ln = (torch.rand(D, generator=g) + 0.5).to(BF)
    for fmt in ("int8", "int4"):
        qkv, o_proj = _layer(fmt, (HQ + 2 * HK) * HD, D, 1, bias=True), _layer(fmt, D, HQ * HD, 2)
        gu, down = _layer(fmt, 2 * INTER, D, 3), _layer(fmt, D, INTER, 4)
        want, want_res = kernels.mlp_a8(attn_out, res, _weights([o_proj], rows), ln, 1e-5, _weights([gu], rows),
                                        _weights([down], rows))
        got, got_res = torch.empty_like(want), torch.empty_like(want)
        assert lib.llmsys_mlp_a8(attn_out.data_ptr(), HQ * HD, res.data_ptr(), ctypes.byref(o_proj.a8_weight(rows)),
                                 ln.data_ptr(), 1e-5, (cpu_qgemv.QW * 1)(gu.a8_weight(rows)), 1,
                                 ctypes.byref(down.a8_weight(rows)), got.data_ptr(), got_res.data_ptr(), rows, D,
                                 2) == 0
        assert torch.equal(_bits(got), _bits(want)) and torch.equal(_bits(got_res), _bits(want_res))
        want_qkv, _ = kernels.attn_in_a8(x, res, ln, 1e-5, _weights([qkv], rows))
        got_qkv, new_res = torch.empty_like(want_qkv), torch.empty_like(x)
        assert lib.llmsys_attn_in_a8(x.data_ptr(), res.data_ptr(), ln.data_ptr(), 1e-5, new_res.data_ptr(),
                                     (cpu_qgemv.QW * 1)(qkv.a8_weight(rows)), 1, got_qkv.data_ptr(), rows, D, 2) == 0
        assert torch.equal(_bits(got_qkv), _bits(want_qkv))


@needs_kernel
def test_bad_arguments_are_one_line_errors():
    x = torch.randn(2, D).to(BF)
    ln = torch.ones(D, dtype=BF)
    qkv = _layer("int4", 128, D, 0)
    with pytest.raises(ValueError, match=r"attn_in_a8: expected a contiguous CPU bf16 \[M, K\] tensor, got torch.float32"):
        kernels.attn_in_a8(x.float(), None, ln, 1e-5, _weights([qkv], 2))
    with pytest.raises(ValueError, match=r"attn_in_a8: the C kernel rejected its weights \(code 1; 2: out of memory\): "
                                         r"1 weight\(s\) of \[128\] rows for D=100"):
        kernels.attn_in_a8(x[:, :100].contiguous(), None, ln[:100].contiguous(), 1e-5, _weights([qkv], 2))
    o_proj, gu, down = _layer("int8", D, 128, 1), _layer("int8", 2 * INTER, D, 2), _layer("int8", D, INTER, 3)
    o = torch.randn(2, 128).to(BF)
    with pytest.raises(ValueError, match="mlp_a8: o has 2 rows, residual 3"):
        kernels.mlp_a8(o, torch.randn(3, D).to(BF), _weights([o_proj], 2), ln, 1e-5, _weights([gu], 2),
                       _weights([down], 2))
    wide = _layer("int8", D, 2 * INTER, 4)  # a down_proj reading 2 I columns where silu * mul gives I
    with pytest.raises(ValueError, match=r"mlp_a8: the C kernel rejected .* gate\|up \[640\] rows, down 192x640"):
        kernels.mlp_a8(o, x, _weights([o_proj], 2), ln, 1e-5, _weights([gu], 2), _weights([wide], 2))
    with pytest.raises(ValueError, match="mlp_a8: o_proj and down are one weight each, got 2 and 1"):
        kernels.mlp_a8(o, x, _weights([o_proj, o_proj], 2), ln, 1e-5, _weights([gu], 2), _weights([down], 2))
