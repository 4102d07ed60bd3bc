"""The fused a8 decode layer kernels (``kernels.layer_attn_in``, ``kernels.layer_mlp``; fused_layer.c) against
the same layer run op by op: the C RMSNorm, each quantized layer's own a8 GEMV, its bias, the C
silu * mul. Bit for bit, on every x86 ISA level this CPU runs; weights fused into one or apart."""

from __future__ import annotations

import ctypes

import pytest
import torch

from conftest import other_isa_build, x86_levels
from llmsys import kernels
from llmsys.engine.models.base import Linear
from llmsys.kernels import cpu_decode, cpu_qgemv
from llmsys.quant.int4 import Int4Linear
from llmsys.quant.int8_fp8 import Int8Linear

needs_kernel = pytest.mark.skipif(not (cpu_qgemv.available() and cpu_decode.available()),
                                  reason=f"C kernels not built: {cpu_qgemv.kernel_status()}")
BF = torch.bfloat16
D, HQ, HK, HD, INTER = 192, 6, 2, 32, 320  # INTER: not a multiple of 64 (row tails) nor of the group


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.int16 if t.dtype == BF else torch.int32)


def _dt(fmt: str) -> torch.dtype:
    """The activations' dtype of a layer of ``fmt`` weights (float32 weights: a float32 model's layer)."""
    return torch.float32 if fmt == "f32" else BF


def _layer(fmt: str, n: int, k: int, seed: int, bias: bool = False):
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(n, k, generator=g) * 0.05
    b = (torch.randn(n, generator=g) * 0.1).to(_dt(fmt)) if bias else None
    if fmt in ("bf16", "f32"):  # the engine's Linear: the C bf16 / float32 GEMV at decode sizes
        lin = Linear(k, n, bias=bias, dtype=_dt(fmt))
        with torch.no_grad():
            lin.weight.copy_(w)
            if bias:
                lin.bias.copy_(b)
        return lin
    if fmt == "int8":
        return Int8Linear.from_float(w, b)
    lin = Int4Linear.from_float(w, b, group_size=64 if fmt == "int4" else 32)
    if fmt == "int4-offsets":  # GGUF Q4_K / Q4_1 as kept: float32 scales and offsets, w = q * scale + offset
        t = lin.canonical_tensors()
        scales = t["scales"].float()
        offsets = -t["zeros"].float() * scales + torch.rand(scales.shape, generator=g) * 1e-3
        return Int4Linear(t["qweight"], scales, torch.zeros_like(scales), b, k, offsets=offsets)
    return lin


def _cat(*mods):
    """The layers' rows in one layer (DecoderModel.fuse_projections' result for them)."""
    if isinstance(mods[0], Linear):
        lin = Linear(mods[0].in_features, sum(m.out_features for m in mods), bias=mods[0].bias is not None, dtype=BF)
        with torch.no_grad():
            lin.weight.copy_(torch.cat([m.weight for m in mods]))
            if lin.bias is not None:
                lin.bias.copy_(torch.cat([m.bias for m in mods]))
        return lin
    return type(mods[0]).cat_rows(list(mods))


def _ws(mods):
    ws = [m.decode_weight() for m in mods]
    assert all(w is not None for w in ws)
    return ws


def _a8(qkv, o_proj, gu, down, ln1, ln2):
    return kernels.decode_layer_args(_ws(qkv), _ws([o_proj])[0], _ws(gu), _ws([down])[0], ln1, 1e-5, ln2, 1e-5)


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
@pytest.mark.parametrize("fmt", ["int8", "int4", "int4-g32", "int4-offsets", "bf16", "f32"])
@pytest.mark.parametrize("rows", [1, 5])
@torch.inference_mode()  # as the engine runs (kernels.linear keeps autograd's F.linear otherwise)
def test_fused_layer_equals_op_by_op(fmt, rows):
    g, dt = torch.Generator().manual_seed(rows), _dt(fmt)
    x, res = torch.randn(rows, D, generator=g).to(dt), torch.randn(rows, D, generator=g).to(dt)
    attn_out = torch.randn(rows, HQ * HD, generator=g).to(dt)
    ln1, ln2 = (torch.rand(D, generator=g) + 0.5).to(dt), (torch.rand(D, generator=g) + 0.5).to(dt)
    q, k, v = (_layer(fmt, h * HD, D, s, bias=True) for s, h in ((1, HQ), (2, HK), (3, HK)))
    o_proj, gate, up = _layer(fmt, D, HQ * HD, 4), _layer(fmt, INTER, D, 5), _layer(fmt, INTER, D, 6)
    down = _layer(fmt, D, INTER, 7)
    want = _op_by_op(x, res, ln1, ln2, [q, k, v], o_proj, [gate, up], down, attn_out)
    # apart, and fused into one weight (small float32 weights are never fused: together they would be packed)
    ways = [([q, k, v], [gate, up])] + ([([_cat(q, k, v)], [_cat(gate, up)])] if fmt != "f32" else [])
    for qkv, gu in ways:
        layer = _a8(qkv, o_proj, gu, down, ln1, ln2)
        out, new_res = kernels.layer_attn_in(layer, x, res)
        assert torch.equal(_bits(out), _bits(want[0])) and torch.equal(_bits(new_res), _bits(want[1]))
        y, res2 = kernels.layer_mlp(layer, attn_out, new_res)
        assert torch.equal(_bits(y), _bits(want[2])) and torch.equal(_bits(res2), _bits(want[3]))
    # layer 0: no residual yet, the input itself is the residual
    out0, r0 = kernels.layer_attn_in(layer, x, None)
    assert r0 is x and torch.equal(_bits(out0), _bits(_op_by_op(x, None, ln1, ln2, [q, k, v], o_proj, [gate, up],
                                                                 down, attn_out)[0]))


@needs_kernel
def test_a8_weight_only_where_the_layer_runs_the_a8_gemv():
    lin4, lin8 = _layer("int4", 128, 192, 0), _layer("int8", 128, 192, 0)
    assert (lin4.DECODE_MAX_ROWS, lin8.DECODE_MAX_ROWS) == (28, 32)  # the formats' PACKED_MAX_ROWS
    assert lin4.decode_weight() is not None and lin8.decode_weight() is not None
    w = torch.randn(64, 192) * 0.05
    f32_bias = Int8Linear.from_float(w, torch.randn(64))  # a float32 bias: the layer adds bf16(bias), not fused
    assert f32_bias.decode_weight() is None
    lin4._buffers["packed"] = lin4._buffers["packed"].clone()  # bound elsewhere, as offload binds streamed views
    assert lin4.decode_weight().q == lin4._buffers["packed"].data_ptr()  # built from what is bound when asked


@needs_kernel
def test_decoder_layer_plan_is_made_once_and_taken_only_where_it_applies(tmp_path):
    """The engine plans each layer's fused a8 kernels once (engine/models/decode_plan.py); a step takes them only
    with autograd off, within the formats' rows and in the plan's dtype, and otherwise runs op by op with the
    same bits. The plan keeps what it points into alive."""
    import gc

    from llmsys import LLM
    from llmsys.engine.models.decode_plan import layer_plan
    from tiny_models import make_hf_model

    path = make_hf_model("llama", tmp_path / "m", hidden_size=128, intermediate_size=320)
    llm = LLM(str(path), dtype="bfloat16", progress=False, kv_cache_tokens=64, quant="int4")
    layer = llm.loaded.model.model.layers[0]
    lp = layer.decode
    assert lp is not None and lp.max_rows == 28 and lp.dtype == BF  # int4's PACKED_MAX_ROWS
    down = layer.mlp.down_proj
    held = down._buffers["packed"]
    assert lp.fused.arrays[3][0].q == held.data_ptr() and any(t is held for t in lp.holds)
    down._buffers["packed"] = held.clone()  # rebound: the plan still reads (and holds) the old tensor
    del held
    gc.collect()
    assert any(t.data_ptr() == lp.fused.arrays[3][0].q for t in lp.holds)
    fresh = layer_plan(layer, BF)  # what building the plan again gives: the new tensor
    assert fresh.fused.arrays[3][0].q == down._buffers["packed"].data_ptr()
    assert layer_plan(layer, torch.float32) is None  # float32 activations read float32 weights only


@needs_kernel
@pytest.mark.parametrize("level", x86_levels())
def test_other_isas_give_the_same_bits(level, tmp_path):
    lib = other_isa_build(cpu_qgemv._SOURCE, cpu_qgemv._SIGNATURES, level, tmp_path)
    rows = 3
    g = torch.Generator().manual_seed(9)
    x, res = torch.randn(rows, D, generator=g).to(BF), torch.randn(rows, D, generator=g).to(BF)
    attn_out = torch.randn(rows, HQ * HD, generator=g).to(BF)
    for fmt in ("int8", "int4", "int4-offsets", "bf16", "f32"):
        dt = _dt(fmt)
        x, res, attn_out, ln = x.to(dt), res.to(dt), attn_out.to(dt), (torch.rand(D, generator=g) + 0.5).to(dt)
        qkv, o_proj = _layer(fmt, (HQ + 2 * HK) * HD, D, 1, bias=True), _layer(fmt, D, HQ * HD, 2)
        gu = [_layer(fmt, INTER, D, 3), _layer(fmt, INTER, D, 5)]
        down = _layer(fmt, D, INTER, 4)
        layer = _a8([qkv], o_proj, gu, down, ln, ln)
        args = ctypes.byref(layer.args)
        want, want_res = kernels.layer_mlp(layer, attn_out, res)
        got, got_res = torch.empty_like(want), torch.empty_like(want)
        assert lib.llmsys_layer_mlp(args, attn_out.data_ptr(), res.data_ptr(), got.data_ptr(), got_res.data_ptr(), rows,
                                 2) == 0
        assert torch.equal(_bits(got), _bits(want)) and torch.equal(_bits(got_res), _bits(want_res))
        want_qkv, _ = kernels.layer_attn_in(layer, x, res)
        got_qkv, new_res = torch.empty_like(want_qkv), torch.empty_like(x)
        assert lib.llmsys_layer_attn_in(args, x.data_ptr(), res.data_ptr(), got_qkv.data_ptr(), new_res.data_ptr(), rows,
                                     2) == 0
        assert torch.equal(_bits(got_qkv), _bits(want_qkv))


@needs_kernel
def test_bad_arguments_are_one_line_errors():
    x = torch.randn(2, D).to(BF)
    ln = torch.ones(D, dtype=BF)
    qkv, o_proj = _layer("int4", 128, D, 0), _layer("int8", D, 128, 1)
    gu, down = _layer("int8", 2 * INTER, D, 2), _layer("int8", D, INTER, 3)
    layer = _a8([qkv], o_proj, [gu], down, ln, ln)
    with pytest.raises(ValueError, match=r"layer_attn_in: expected a contiguous CPU bf16 \[M, 192\] tensor, got torch.float32"):
        kernels.layer_attn_in(layer, x.float(), None)
    o = torch.randn(2, 128).to(BF)
    with pytest.raises(ValueError, match=r"layer_mlp: expected a contiguous CPU bf16 \[2, 192\] tensor, got .* \(3, 192\)"):
        kernels.layer_mlp(layer, o, torch.randn(3, D).to(BF))
    with pytest.raises(ValueError, match=r"decode_layer_args: ln2 must be a contiguous CPU bf16 \[192\] tensor, got torch.float32"):
        kernels.decode_layer_args(_ws([qkv]), _ws([o_proj])[0], _ws([gu]), _ws([down])[0], ln, 1e-5, ln.float(), 1e-5)
    with pytest.raises(ValueError, match=r"decode_layer_args: q\|k\|v and gate\|up take 1-4 weights each, got 5 and 1"):
        kernels.decode_layer_args(_ws([qkv] * 5), _ws([o_proj])[0], _ws([gu]), _ws([down])[0], ln, 1e-5, ln, 1e-5)
    f32_o = _layer("f32", D, 128, 5)  # a float32 weight among a8 ones: the layer's rows cannot be both dtypes
    with pytest.raises(ValueError, match=r"decode_layer_args: float32 weights cannot be mixed with bf16 or quantized"):
        kernels.decode_layer_args(_ws([qkv]), _ws([f32_o])[0], _ws([gu]), _ws([down])[0], ln, 1e-5, ln, 1e-5)
    wide = _layer("int8", D, 2 * INTER, 4)  # a down_proj reading 2 I columns where silu * mul gives I
    bad = _a8([qkv], o_proj, [gu], wide, ln, ln)
    with pytest.raises(ValueError, match=r"layer_mlp: the C kernel rejected the layer \(code 1; 2: out of memory\): "
                                         r"D=192, q\|k\|v \[128\] rows, o_proj 192x128, gate\|up \[640\] rows, down 192x640"):
        kernels.layer_mlp(bad, o, x)
    with pytest.raises(ValueError, match="layer_attn_in: the C kernel rejected the layer"):
        kernels.layer_attn_in(bad, x, None)


@needs_kernel
def test_decode_stack_errors_name_the_layer_and_what_does_not_fit():
    """The decode stack's arguments are checked in Python (each layer's pools and heads against its fused
    layer), and a step the C attention rejects (here a context length past the gather plan) is a one-line
    error naming the layer and the attention's code."""
    ln = torch.ones(D, dtype=BF)
    qkv, o_proj = _layer("int8", (HQ + 2 * HK) * HD, D, 0), _layer("int8", D, HQ * HD, 1)
    gu, down = _layer("int8", 2 * INTER, D, 2), _layer("int8", D, INTER, 3)
    layer = _a8([qkv], o_proj, [gu], down, ln, ln)
    pool = torch.zeros(16, HK, HD, dtype=BF)
    with pytest.raises(ValueError, match="decode_stack_args: no layers"):
        kernels.decode_stack_args([])
    with pytest.raises(ValueError, match=r"decode_stack_args: layer 0's k_pool must be a contiguous bf16 "
                                         r"\[slots, 2, 32\] tensor, got torch.float32 \(16, 2, 32\)"):
        kernels.decode_stack_args([kernels.StackLayer(layer, pool.float(), pool, HQ, HK, HD, 1.0)])
    with pytest.raises(ValueError, match=r"decode_stack_args: layer 0 \(D=192, .*\) does not fit 7 query and 2 K/V "
                                         r"heads of 32 in a hidden size of 192"):
        kernels.decode_stack_args([kernels.StackLayer(layer, pool, pool, HQ + 1, HK, HD, 1.0)])
    stack = kernels.decode_stack_args([kernels.StackLayer(layer, pool, pool, HQ, HK, HD, 1.0)] * 2)
    h, cache = torch.randn(1, D).to(BF), torch.zeros(32, HD)
    pos, slots, gather = torch.tensor([3]), torch.tensor([3]), torch.tensor([[0, 1, 2, 3]])
    out, res = kernels.decode_stack(stack, h, pos, cache, slots, gather, torch.tensor([4]))  # a valid step
    assert out.shape == res.shape == (1, D)
    # A layer of the second of two stacked RoPE tables rotates with rows + half the cache (Attention.rope_positions)
    cache2 = torch.randn(64, HD)
    got = [kernels.decode_stack(kernels.decode_stack_args([kernels.StackLayer(layer, p.clone(), p.clone(), HQ, HK, HD,
                                                                               1.0, table, tables)]),
                                h, pos + shift, cache2, slots, gather, torch.tensor([4]))
           for p in (torch.randn(16, HK, HD).to(BF),) for table, tables, shift in ((1, 2, 0), (0, 1, 32))]
    assert torch.equal(_bits(got[0][0]), _bits(got[1][0])) and torch.equal(_bits(got[0][1]), _bits(got[1][1]))
    with pytest.raises(ValueError, match=r"decode_stack: the C kernel rejected the step at layer 0 "
                                         r"\(attention code \d+\) \(code 1\d\d; 2: out of memory\)"):
        kernels.decode_stack(stack, h, pos, cache, slots, gather, torch.tensor([9]))  # 9 keys in a 4-slot plan
