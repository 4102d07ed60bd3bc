"""The grouped expert kernel (``kernels/moe_experts.c``) against its definition, on every ISA build this CPU runs:
each routed expert's projections by the a8 GEMVs' torch definitions, the activation by the C row code (the same
bits on every build: tests/test_cpu_decode.py), the products and their sum in slot order as ``MoE.forward`` takes
them. Model-level equality with the per-expert path: tests/test_moe_grouped.py."""

from __future__ import annotations

import pytest
import torch

from conftest import other_isa_build, x86_levels
from llmsys.kernels import _cbuild, cpu_decode, cpu_moe, cpu_qgemv
from llmsys.quant.int4 import Int4Linear
from llmsys.quant.int8_fp8 import quantize_int8

pytestmark = pytest.mark.skipif(not cpu_moe.available(), reason=f"C kernel not built: {cpu_qgemv.kernel_status()}")
D, I, E, K = 96, 64, 6, 2  # hidden, expert width, experts, experts per token


def _int4_def(x: torch.Tensor, lin: Int4Linear) -> torch.Tensor:
    scales = lin.scales_orig if lin.scales_orig is not None else lin.scales_zeros[:, : lin.out_features, 0].t()
    return cpu_qgemv.int4_a8_def(x, lin.packed, scales, lin.zeros_u8, lin.group_size)


def _experts(fmt: str, seed: int = 0):
    """E experts, each ``((gate|up decode weights, down decode weight), its projections' tensors, the a8 GEMV
    definition applying one of them: f(x, tensors) -> [n, out])``."""
    torch.manual_seed(seed)
    out = []
    for _ in range(E):
        if fmt == "int4":  # gate|up as one weight of 2I rows (fused), as the engine fuses them
            gu, dn = Int4Linear.from_float(torch.randn(2 * I, D) * 0.05, group_size=32), \
                Int4Linear.from_float(torch.randn(D, I) * 0.05, group_size=32)
            out.append((([gu.decode_weight()], dn.decode_weight()), (gu, dn), _int4_def))
        else:  # int8: gate and up as two weights side by side
            (gq, gs), (uq, us), (dq, ds) = (quantize_int8(torch.randn(n, k) * 0.05) for n, k in ((I, D), (I, D), (D, I)))
            ws = ([cpu_qgemv.int8_decode_weight(gq, gs, None), cpu_qgemv.int8_decode_weight(uq, us, None)],
                  cpu_qgemv.int8_decode_weight(dq, ds, None))
            out.append((ws, ((gq, gs), (uq, us), (dq, ds)), lambda x, qs: cpu_qgemv.int8_a8_def(x, *qs)))
    return out


def _expert_out(experts, fmt: str, e: int, xt: torch.Tensor) -> torch.Tensor:
    """Expert ``e``'s SwiGLU of ``xt [1, D]`` by the definitions -> ``[1, D]`` bf16."""
    _, mods, proj = experts[e]
    if fmt == "int4":
        g = proj(xt, mods[0])
        return proj(cpu_decode.silu_mul(g[:, :I], g[:, I:]), mods[1])
    return proj(cpu_decode.silu_mul(proj(xt, mods[0]), proj(xt, mods[1])), mods[2])


def _products(experts, fmt: str, x: torch.Tensor, chosen: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """Row ``t K + j``: token t's slot j product ``y * w`` (bf16, as MoE.forward rounds it) -> ``[T K, D]``."""
    T = x.shape[0]
    return torch.cat([_expert_out(experts, fmt, int(chosen.view(-1)[r]), x[r // K : r // K + 1]) * w.view(-1)[r]
                      for r in range(T * K)])


@pytest.mark.parametrize("level", [None, *x86_levels()])  # None: the build this CPU loads
@pytest.mark.parametrize("fmt", ["int4", "int8"])
def test_grouped_experts_are_the_definition_on_every_build(fmt, level, tmp_path):
    """1 token and 7 (rows gathered per expert, the VNNI tiles), threads 2 and 1, and a max_rows that leaves the
    busiest experts to the caller: out is the definition bit for bit, or None with the other experts' products in
    rows and every expert's count."""
    lib = None if level is None else other_isa_build(_cbuild.KERNELS, cpu_moe._SIGNATURES, level, tmp_path)
    experts = _experts(fmt)
    g = torch.Generator().manual_seed(3)
    x = (torch.randn(7, D, generator=g) * 2).bfloat16()
    chosen = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(7)])  # [7, K] distinct per token
    w = torch.softmax(torch.randn(7, K, generator=g), -1).bfloat16()
    m = cpu_moe.moe_experts_args([e[0][0] for e in experts], [e[0][1] for e in experts], max_rows=64)
    for t in (1, 7):
        want = _products(experts, fmt, x[:t], chosen[:t], w[:t]).view(t, K, D).sum(dim=1)  # slot order, one rounding
        for threads in (2, 1):
            before = torch.get_num_threads()
            torch.set_num_threads(threads)
            try:
                got, rows, counts = cpu_moe.moe_experts(m, x[:t].contiguous(), chosen[:t], w[:t], lib=lib)
            finally:
                torch.set_num_threads(before)
            assert rows is None and torch.equal(got.view(torch.int16), want.view(torch.int16)), (t, threads)
    few = cpu_moe.moe_experts_args([e[0][0] for e in experts], [e[0][1] for e in experts], max_rows=2)
    got, rows, counts = cpu_moe.moe_experts(few, x, chosen, w, lib=lib)
    n = torch.bincount(chosen.flatten(), minlength=E)
    assert got is None and torch.equal(counts, n) and int(n.max()) > 2
    mine = n[chosen.view(-1)] <= 2  # [T K]: the products the kernel wrote (the rest are the caller's)
    want = _products(experts, fmt, x, chosen, w)
    assert mine.any() and torch.equal(rows[mine].view(torch.int16), want[mine].view(torch.int16))


def test_bad_arguments_are_one_line_errors():
    experts = _experts("int8")
    m = cpu_moe.moe_experts_args([e[0][0] for e in experts], [e[0][1] for e in experts], max_rows=64)
    x = torch.randn(2, D).bfloat16()
    w = torch.full((2, K), 0.5).bfloat16()
    with pytest.raises(ValueError, match="rejected the layer"):
        cpu_moe.moe_experts(m, x, torch.full((2, K), E), w)
    with pytest.raises(ValueError, match="routing weights must be bfloat16 or float32"):
        cpu_moe.moe_experts(m, x, torch.zeros(2, K, dtype=torch.int64), w.half())
    with pytest.raises(ValueError, match="moe_experts_args"):
        cpu_moe.moe_experts_args([], [], max_rows=1)
