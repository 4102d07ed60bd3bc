"""NF4: brute-force nearest-code reference, and (when installed) bit-compatibility with bitsandbytes."""

from __future__ import annotations

import pytest
import torch

from llmsys.quant import NF4Linear, parse_quant
from llmsys.quant.nf4 import NF4_BLOCK, dequantize_nf4, dynamic_map, nf4_absmax, nf4_code, quantize_nf4

torch.set_num_threads(1)


def test_nf4_codes_are_nearest_and_layout():
    gen = torch.Generator().manual_seed(0)
    w = torch.randn(20, 100, generator=gen)  # numel 2000: last absmax block is partial
    t = quantize_nf4(w)
    flat = w.reshape(-1)
    absmax = torch.nn.functional.pad(flat.abs(), (0, 48)).view(-1, NF4_BLOCK).amax(1)
    assert torch.equal(t["absmax"], absmax)
    scaled = flat / absmax.repeat_interleave(NF4_BLOCK)[:2000]
    nearest = (scaled[:, None] - nf4_code()[None, :]).abs().argmin(1)  # brute force
    q = torch.stack([t["qweight"] >> 4, t["qweight"] & 15], -1).reshape(-1)  # high nibble first
    assert (q.long() == nearest).float().mean() > 0.999  # ties at exact midpoints may differ
    deq = dequantize_nf4(t, (20, 100))
    assert torch.equal(NF4Linear.from_float(w).dequantize(), deq)
    assert (deq - w).abs().max() <= 0.5 * (1.0 - 0.7229568362236023) * absmax.max() + 1e-6  # widest gap


def test_double_quant_absmax_error_small():
    gen = torch.Generator().manual_seed(1)
    w = torch.randn(256, 512, generator=gen) * 0.02
    t = quantize_nf4(w, double_quant=True)
    assert t["absmax_q"].dtype == torch.uint8 and t["absmax2"].numel() == -(-(256 * 512 // 64) // 256)
    plain = quantize_nf4(w)["absmax"]
    assert ((nf4_absmax(t) - plain).abs() / plain).max() < 0.02
    assert dynamic_map().shape == (256,) and dynamic_map()[-1] == 1.0
    m = NF4Linear.from_float(w, spec=parse_quant("nf4:dq"))
    assert m.double_quant and set(m.state_dict()) == {"qweight", "absmax_q", "absmax2", "absmax_offset"}


@pytest.mark.parametrize("dq", [False, True])
def test_matches_bitsandbytes(dq):
    bnbf = pytest.importorskip("bitsandbytes.functional", reason="bitsandbytes not installed")
    gen = torch.Generator().manual_seed(2)
    w = torch.randn(128, 256, generator=gen) * 0.05
    qb, state = bnbf.quantize_4bit(w, blocksize=64, quant_type="nf4", compress_statistics=dq)
    ours = quantize_nf4(w, double_quant=dq)
    assert (qb.reshape(-1) == ours["qweight"]).float().mean() > 0.999
    if dq:
        assert (state.absmax.reshape(-1) == ours["absmax_q"]).float().mean() > 0.99
        assert torch.allclose(state.state2.absmax, ours["absmax2"])
        assert torch.allclose(state.offset, ours["absmax_offset"])
    else:
        assert torch.allclose(state.absmax, ours["absmax"])
    ref = bnbf.dequantize_4bit(qb, state).float()
    ours_deq = dequantize_nf4(ours, (128, 256))
    assert ((ours_deq - ref).norm() / ref.norm()) < 2e-3


@pytest.mark.parametrize("dq", [False, True])
def test_bitsandbytes_matmul_on_our_tensors(dq):
    """The CUDA path hands the layer's tensors to bitsandbytes.matmul_4bit unchanged; on CPU the same
    call must reproduce the plain dequantize + GEMM path (odd sizes: a partial last block)."""
    pytest.importorskip("bitsandbytes", reason="bitsandbytes not installed")
    gen = torch.Generator().manual_seed(3)
    lin = NF4Linear.from_float(torch.randn(96, 200, generator=gen) * 0.05, spec=parse_quant("nf4:dq" if dq else "nf4"))
    x = torch.randn(3, 200, generator=gen)
    y = lin.matmul_bitsandbytes(x)
    assert y.shape == (3, 96)
    assert torch.allclose(y, lin(x), rtol=1e-5, atol=1e-6)


def test_without_bitsandbytes_the_plain_path_runs(monkeypatch):
    from llmsys.quant import nf4

    monkeypatch.setattr(nf4, "_bitsandbytes", lambda: None)
    lin = NF4Linear.from_float(torch.randn(64, 64) * 0.05)
    x = torch.randn(2, 64)
    assert torch.allclose(lin(x), x @ lin.dequantize().t(), rtol=1e-5, atol=1e-6)
    with pytest.raises(RuntimeError, match="bitsandbytes is not installed"):
        lin.matmul_bitsandbytes(x)
