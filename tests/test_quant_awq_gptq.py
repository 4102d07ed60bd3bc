"""AWQ/GPTQ -> canonical int4: pack synthetic tensors by each format's definition, convert, compare."""

from __future__ import annotations

import pytest
import torch

from llmsys.kernels.common.errors import CheckpointError
from llmsys.quant.awq_gptq import awq_to_canonical, gptq_to_canonical
from llmsys.quant.int4 import Int4Linear

from conftest import A8_REL_ERR


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / b.norm())

torch.set_num_threads(1)
AWQ_ORDER = [0, 2, 4, 6, 1, 3, 5, 7]


def _to_int32(v: torch.Tensor) -> torch.Tensor:
    """uint32 bit pattern held in int64 -> int32 (two's complement), like the checkpoints."""
    return torch.where(v >= 2**31, v - 2**32, v).to(torch.int32)


def pack_awq_cols(v: torch.Tensor) -> torch.Tensor:
    """``[R, N]`` 4-bit -> ``int32 [R, N/8]``: nibble i of word c holds column 8c + AWQ_ORDER[i]."""
    r, n = v.shape
    out = torch.zeros(r, n // 8, dtype=torch.int64)
    for c in range(n // 8):
        for i in range(8):
            out[:, c] |= v[:, 8 * c + AWQ_ORDER[i]].long() << (4 * i)
    return _to_int32(out)


def pack_seq(v: torch.Tensor, dim: int) -> torch.Tensor:
    """Pack 8 consecutive entries along ``dim`` (entry i at bits 4i), GPTQ style."""
    v = v.long().movedim(dim, 0)
    out = torch.zeros(v.shape[0] // 8, *v.shape[1:], dtype=torch.int64)
    for i in range(8):
        out |= v[i::8] << (4 * i)
    return _to_int32(out).movedim(0, dim)


def _random(k: int, n: int, g: int, seed: int):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randint(0, 16, (k, n), generator=gen)  # [K, N]
    z = torch.randint(0, 16, (k // g, n), generator=gen)  # [G, N]
    s = (torch.rand(k // g, n, generator=gen) * 0.02 + 1e-3).half()  # [G, N]
    return q, z, s


def _canonical_dequant(t: dict[str, torch.Tensor], k: int) -> torch.Tensor:
    return Int4Linear.from_quantized(t, in_features=k).dequantize()  # [N, K], original feature order


@pytest.mark.parametrize("g", [32, 64, 128])
def test_awq_gemm_exact(g):
    k, n = 256, 48
    q, z, s = _random(k, n, g, seed=g)
    t = awq_to_canonical(pack_awq_cols(q), pack_awq_cols(z), s)
    # Reference from the AWQ definition: w[n, k] = (q[k, n] - z[k//g, n]) * s[k//g, n].
    gi = torch.arange(k) // g
    ref = ((q.float() - z[gi].float()) * s[gi].float()).t()
    assert torch.equal(_canonical_dequant(t, k), ref)
    x = torch.randn(3, k)
    assert _rel(Int4Linear.from_quantized(t, in_features=k)(x), x @ ref.t()) < A8_REL_ERR  # 3 rows: the a8 GEMV


@pytest.mark.parametrize("zero_offset", [1, 0])
def test_gptq_exact(zero_offset):
    k, n, g = 256, 64, 64
    q, z, s = _random(k, n, g, seed=7)
    stored_z = (z - zero_offset).clamp(min=0)  # v1 stores zero - 1, v2 stores the zero
    t = gptq_to_canonical(pack_seq(q, 0), pack_seq(stored_z, 1), s,
                          g_idx=torch.arange(k, dtype=torch.int32) // g, zero_offset=zero_offset)
    assert "perm" not in t
    zz = stored_z + zero_offset
    gi = torch.arange(k) // g
    ref = ((q.float() - zz[gi].float()) * s[gi].float()).t()
    assert torch.equal(_canonical_dequant(t, k), ref)


def test_gptq_symmetric_v1_zero_is_8():
    k, n, g = 128, 32, 32
    q, _, s = _random(k, n, g, seed=3)
    stored = torch.full((k // g, n), 7)  # sym=True v1 checkpoints store 8 - 1
    t = gptq_to_canonical(pack_seq(q, 0), pack_seq(stored, 1), s)
    assert torch.all(t["zeros"] == 8)
    gi = torch.arange(k) // g
    assert torch.equal(_canonical_dequant(t, k), ((q.float() - 8) * s[gi].float()).t())


def test_gptq_act_order_permutation():
    k, n, g = 256, 32, 64
    q, z, s = _random(k, n, g, seed=11)
    gen = torch.Generator().manual_seed(0)
    g_idx = (torch.arange(k) // g)[torch.randperm(k, generator=gen)].to(torch.int32)  # desc_act
    t = gptq_to_canonical(pack_seq(q, 0), pack_seq(z, 1), s, g_idx=g_idx, zero_offset=0)
    assert "perm" in t
    gl = g_idx.long()
    ref = ((q.float() - z[gl].float()) * s[gl].float()).t()  # [N, K] with per-row g_idx
    m = Int4Linear.from_quantized(t, in_features=k)
    assert torch.equal(m.dequantize(), ref)
    x = torch.randn(2, k)
    assert _rel(m(x), x @ ref.t()) < A8_REL_ERR
    m2 = Int4Linear.from_quantized(dict(m.state_dict()), in_features=k)
    assert torch.equal(m2(x), m(x))


def test_gptq_v1_zero_wraps_to_16_like_reference_kernels():
    k, n, g = 64, 8, 32
    q, _, s = _random(k, n, g, seed=5)
    stored = torch.full((k // g, n), 15)  # v1: zero 0 was written as -1 -> 0xF; loaders read 16
    t = gptq_to_canonical(pack_seq(q, 0), pack_seq(stored, 1), s)
    m = Int4Linear.from_quantized(t, in_features=k)
    assert m.mode == "canonical"  # 16 is outside 0..15, so no CPU-packed path
    gi = torch.arange(k) // g
    assert torch.equal(m.dequantize(), ((q.float() - 16) * s[gi].float()).t())


def test_bad_shapes_raise_checkpoint_error():
    q, z, s = _random(64, 16, 32, seed=1)
    with pytest.raises(CheckpointError):
        awq_to_canonical(pack_awq_cols(q), pack_awq_cols(z), s[:, :8])
    with pytest.raises(CheckpointError, match="do not split"):
        awq_to_canonical(pack_awq_cols(q), pack_awq_cols(torch.zeros(3, 16)), torch.ones(3, 16).half())
    with pytest.raises(CheckpointError, match="group size 16"):
        awq_to_canonical(pack_awq_cols(q), pack_awq_cols(torch.zeros(4, 16)), torch.ones(4, 16).half())
    g_idx = torch.zeros(64, dtype=torch.int32)  # every row in group 0: not representable
    with pytest.raises(CheckpointError, match="g_idx"):
        gptq_to_canonical(pack_seq(q, 0), pack_seq(z, 1), s, g_idx=g_idx)
