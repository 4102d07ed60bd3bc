"""kernels.linear: the per-shape CPU GEMM choice computes F.linear."""

import pytest
import torch
import torch.nn.functional as F

from llmsys import kernels


@pytest.mark.parametrize("m", [1, 2, 8, 33])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_linear_matches_f_linear(m, dtype):
    g = torch.Generator().manual_seed(m)
    x = torch.randn(m, 72, generator=g).to(dtype)
    w = torch.randn(130, 72, generator=g).to(dtype)
    b = torch.randn(130, generator=g).to(dtype)
    with torch.inference_mode():
        got = kernels.linear(x, w, b)
    ref = F.linear(x.double(), w.double(), b.double())
    tol = 1e-4 if dtype == torch.float32 else 5e-2
    assert got.dtype == dtype and got.shape == (m, 130)
    assert (got.double() - ref).abs().max().item() < tol * ref.abs().max().item()
