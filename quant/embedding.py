"""Quantized token embeddings that share their table with a (tied) LM head.

Why quantize the embedding at all: on small models with big vocabularies the
table is a large share of the weights (Qwen2.5-0.5B: 151936 x 896 = 28% of
its parameters), so leaving it in bf16 caps int4 at ~0.48x of bf16 instead of
~0.28x. A lookup only needs M rows per step, so :class:`QuantEmbedding`
dequantizes just those rows from the compact table (``QuantLinear.rows``);
with tied embeddings the same quantized table serves as the LM head
(``as_linear()``), through the fast quantized matmul.
"""

from __future__ import annotations

import torch
from torch import nn

from llmsys.quant.base import QuantLinear


class QuantEmbedding(nn.Module):
    """``ids [...] -> [..., D]`` from a quantized ``[V, D]`` table."""

    def __init__(self, table: QuantLinear, dtype: torch.dtype) -> None:
        super().__init__()
        self.table = table
        self.num_embeddings = table.out_features
        self.embedding_dim = table.in_features
        self.out_dtype = dtype

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        flat = ids.reshape(-1)
        return self.table.rows(flat, self.out_dtype).view(*ids.shape, self.embedding_dim)

    def as_linear(self) -> QuantLinear:
        """The table as the (tied) LM head: ``hidden [.., D] -> logits [.., V]``."""
        return self.table

    def nbytes(self) -> int:
        return self.table.nbytes()

    def extra_repr(self) -> str:
        return f"{self.num_embeddings}, {self.embedding_dim}, table={type(self.table).__name__}"
