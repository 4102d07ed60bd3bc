"""KIVI KV-cache quantization round trips, and GPTQ beating round-to-nearest."""

from __future__ import annotations

import pytest
import torch

from conftest import A8_REL_ERR
from llmsys.kernels.common.errors import InvalidParameterError
from llmsys.quant.calibrate import gptq_linear, gptq_quantize, hessian_from_inputs
from llmsys.quant.int4 import Int4Linear
from llmsys.quant.kv import dequantize_kv_block, kv_bytes_per_token, quantize_kv_block

torch.set_num_threads(1)


def _kv(seed: int = 0, outlier: bool = True) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(3, 16, 4, 64, generator=gen)  # [blocks, T, H, D]
    if outlier:
        x[..., 5] *= 20.0  # a key-style outlier channel
    return x


@pytest.mark.parametrize("bits", [8, 4])
@pytest.mark.parametrize("kind", ["key", "value"])
def test_kv_roundtrip_elementwise_bound(bits, kind):
    x = _kv(outlier=kind == "key")
    qb = quantize_kv_block(x, kind, bits)
    d = 64
    assert qb.data.dtype == torch.uint8
    assert qb.data.shape == (3, 16, 4, d if bits == 8 else d // 2)
    assert qb.scale.shape == ((3, 1, 4, d) if kind == "key" else (3, 16, 4, 1))
    y = dequantize_kv_block(qb)
    assert y.shape == x.shape
    s = qb.scale.float() if kind == "key" else qb.scale.float().expand(3, 16, 4, d)
    # |x - x^| <= scale/2 (+ fp16 rounding of min/scale: <0.1% of the range).
    assert torch.all((y - x).abs() <= 0.5 * s * 1.02 + 1e-3)
    rel = ((y - x).norm() / x.norm()).item()
    assert rel < (0.01 if bits == 8 else 0.15)


def test_keys_per_channel_beat_per_token_on_outlier_channels():
    x = _kv(1)
    key_err = (dequantize_kv_block(quantize_kv_block(x, "key", 4)) - x).norm()
    tok_err = (dequantize_kv_block(quantize_kv_block(x, "value", 4)) - x).norm()
    assert key_err < 0.5 * tok_err  # why KIVI quantizes keys per channel


def test_value_groups_and_sizes():
    x = _kv(2, outlier=False)
    coarse = quantize_kv_block(x, "value", 4)
    fine = quantize_kv_block(x, "value", 4, group_size=32)
    assert fine.scale.shape == (3, 16, 4, 2)
    assert (dequantize_kv_block(fine) - x).norm() <= (dequantize_kv_block(coarse) - x).norm()
    # 4-bit keys, T=16: 0.5 B/elt data + fp16 scale/min per channel per block (0.25 B/elt).
    assert quantize_kv_block(x, "key", 4).nbytes() <= 0.375 * x.numel() * 2
    assert kv_bytes_per_token(4, 64, 8, 16) < 0.6 * (2 * 4 * 64 * 2)
    with pytest.raises(InvalidParameterError):
        quantize_kv_block(x, "value", 3)
    with pytest.raises(InvalidParameterError):
        quantize_kv_block(x, "value", 4, group_size=48)


def test_gptq_beats_rtn_on_correlated_inputs():
    gen = torch.Generator().manual_seed(0)
    n, k, samples = 96, 192, 1024
    basis = torch.randn(k, 24, generator=gen)
    x = torch.randn(samples, 24, generator=gen) @ basis.t() + 0.1 * torch.randn(samples, k, generator=gen)
    w = torch.randn(n, k, generator=gen) * 0.05
    ref = x @ w.t()
    gptq = gptq_linear(w, None, x, group_size=64)
    rtn = Int4Linear.from_float(w, group_size=64)
    e_gptq = ((x @ gptq.dequantize().t() - ref).norm() / ref.norm()).item()
    e_rtn = ((x @ rtn.dequantize().t() - ref).norm() / ref.norm()).item()
    assert e_gptq < 0.5 * e_rtn, (e_gptq, e_rtn)
    # The layer really runs what it stores (8 rows: the a8 GEMV, x rounded to int8 per 32 columns).
    assert ((gptq(x[:8]) - x[:8] @ gptq.dequantize().t()).norm() / (x[:8] @ gptq.dequantize().t()).norm()) < A8_REL_ERR


def test_gptq_ragged_k_and_identity_hessian_matches_rtn():
    gen = torch.Generator().manual_seed(1)
    w = torch.randn(32, 172, generator=gen)  # stories260k FFN width: padded to 192
    t = gptq_quantize(w, torch.eye(172), group_size=64)
    assert t["qweight"].shape == (32, 96) and t["scales"].shape == (32, 3)
    # With H = I there is nothing to compensate: GPTQ reduces to round-to-nearest.
    rtn = Int4Linear.from_float(w, group_size=64).state_dict()
    assert torch.equal(t["qweight"], rtn["qweight"])
    assert torch.equal(hessian_from_inputs(torch.eye(4) * 2), torch.eye(4) * 2)
