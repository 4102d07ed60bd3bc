"""The CPU decode step of a float32 model with fewer torch ops, same bits.

A one-token step of a small model is bound by per-op overhead, not by math:
stories260k (5 layers, hidden 64) spends ~1.8 ms per token in ~45 small torch
ops per layer, module calls and input checks. :class:`FastDecode` runs the
same decoder for a pure-decode step (every sequence feeds one token; CPU
gather plan; plain float32 KV pool; no attention override, no offload hook)
with:

* one GEMM for q|k|v and one for gate|up where the layers' weights go through
  ``F.linear`` anyway (plain float32 weights too small to pack): the weights
  are concatenated once; each output row of the fused GEMM equals the
  separate GEMMs' bit for bit (MKL reduces each output over K the same way
  whatever N is; ``tests/test_fast_decode.py`` checks the whole step);
* RoPE's rotate-half folded into that GEMM: the q and k weights are also
  stored with the two halves of every head swapped, so the GEMM yields
  ``[x2, x1]`` directly, and RoPE is three elementwise ops over q|k at once,
  with the ``[cos, cos]`` / ``[-sin, sin]`` rows read from a table built once
  (``kernels.rope``'s reference does the same products and sums);
* the cos/sin rows, K/V slots and gather layout taken once per step, not per
  layer; no ``nn.Module.__call__`` and no wrapper checks inside the loop (the
  shapes are the engine's own).

Everything else calls what the module path calls (``F.rms_norm`` as
``kernels.rms_norm`` does for float32, the CPU attention fast path, the
layers' own ``forward`` for weights that are packed or quantized), so the
hidden states equal ``DecoderModel.forward``'s exactly. Built by the engine
after prepacking (an inference engine whose weights are no longer rewritten);
``DecoderModel.forward`` uses it for the steps it accepts.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from llmsys import kernels
from llmsys.kernels.cpu_attention import gather_rows


def _plain_gemm(mod: Any) -> torch.Tensor | None:
    """The weight of a layer that ``kernels.linear`` sends to ``F.linear`` with no bias, else None."""
    from llmsys.engine.models.base import Linear

    if type(mod) is not Linear or mod.bias is not None:
        return None
    w = mod.weight
    if w.is_mkldnn or w.device.type != "cpu" or w.dtype != torch.float32 or kernels.packable(w):
        return None
    return w


def _swap_halves(w: torch.Tensor, heads: int, head_dim: int) -> torch.Tensor:
    """Rows of a [heads * D, K] projection reordered so each head's output reads ``[x2, x1]``."""
    half = head_dim // 2
    w = w.view(heads, head_dim, -1)
    return torch.cat([w[:, half:], w[:, :half]], dim=1).reshape(heads * head_dim, -1)


@dataclass
class _Layer:
    """What one decoder layer's step reads, looked up once (no ``nn.Module.__getattr__`` per token)."""

    attn: Any  # the Attention module (unfused projections, per-head norms)
    mlp: Any  # the MLP module (unfused projections)
    norm1: tuple[torch.Tensor, float]  # input_layernorm (weight, eps)
    norm2: tuple[torch.Tensor, float]  # post_attention_layernorm
    scale: float
    qkv: torch.Tensor | None  # [(2 (Hq + Hk) + Hk) D, hidden]: q | k | q swapped | k swapped | v
    o: torch.Tensor | None  # o_proj weight when it goes through F.linear
    gate_up: torch.Tensor | None  # [2 I, hidden]
    down: torch.Tensor | None


class FastDecode:
    """Decode steps of one float32 CPU :class:`DecoderModel` (see the module doc)."""

    def __init__(self, model: Any):
        a = model.args
        self.model = model
        self.hidden = a.hidden_size
        self.hq, self.hk, self.d = a.num_attention_heads, a.num_key_value_heads, a.head_dim
        self.inter = a.intermediate_size
        self.final_norm = (model.model.norm.weight, model.model.norm.eps)
        self.layers = []
        for layer in model.model.layers:
            at, mlp = layer.self_attn, layer.mlp
            q, k, v = (_plain_gemm(m) for m in (at.q_proj, at.k_proj, at.v_proj))
            qkv = None
            if q is not None and k is not None and v is not None and at.q_norm is None:
                qkv = torch.cat([q, k, _swap_halves(q, self.hq, self.d), _swap_halves(k, self.hk, self.d), v])
            g, u = _plain_gemm(mlp.gate_proj), _plain_gemm(mlp.up_proj)
            n1, n2 = layer.input_layernorm, layer.post_attention_layernorm
            self.layers.append(_Layer(
                at, mlp, (n1.weight, n1.eps), (n2.weight, n2.eps), at.scale, qkv, _plain_gemm(at.o_proj),
                torch.cat([g, u]) if g is not None and u is not None else None, _plain_gemm(mlp.down_proj),
            ))
        self._rope_src: torch.Tensor | None = None
        self._rope: torch.Tensor | None = None  # [max_pos, 2, D]: [cos, cos] and [-sin, sin] per position
        self._kv_src: Any = None
        self._flat: list[tuple[torch.Tensor, torch.Tensor]] = []  # per layer [slots, Hk, D] views of the pool

    @classmethod
    def build(cls, model: Any) -> "FastDecode | None":
        """None when the model is not a float32 CPU decoder with plain RMSNorms."""
        from llmsys.engine.models.base import RMSNorm

        p = next(model.parameters(), None)
        norms = [m for layer in model.model.layers for m in (layer.input_layernorm, layer.post_attention_layernorm)]
        norms.append(model.model.norm)
        ok = (
            p is not None
            and p.device.type == "cpu"
            and model.rope_cache.dtype == torch.float32
            and all(type(n) is RMSNorm and n.weight.dtype == torch.float32 for n in norms)
        )
        return cls(model) if ok else None

    def accepts(self, kv: Any, meta: Any) -> bool:
        """A pure-decode CPU step on a plain float32 pool, nothing overriding attention or layers."""
        plan = meta.plan
        return (
            plan is not None
            and plan.is_decode
            and meta.policy_attn is None
            and self.model.layer_hook is None
            and not kv.quantized
            and kv.spec.dtype == torch.float32
        )

    def _rope_rows(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``[T, 1, D]`` rows ``[cos, cos]`` and ``[-sin, sin]`` (the table is rebuilt if RoPE grew)."""
        src = self.model.rope_cache
        if self._rope_src is not src:
            half = self.d // 2
            cos, sin = src[:, :half], src[:, half:]
            self._rope = torch.stack([torch.cat([cos, cos], -1), torch.cat([-sin, sin], -1)], dim=1)
            self._rope_src = src
        rows = self._rope.index_select(0, positions)  # [T, 2, D]
        return rows[:, :1], rows[:, 1:]

    def _pool(self, kv: Any) -> list[tuple[torch.Tensor, torch.Tensor]]:
        if self._kv_src is not kv:
            self._flat = [(k.view(-1, self.hk, self.d), v.view(-1, self.hk, self.d)) for k, v in zip(kv.k, kv.v)]
            self._kv_src = kv
        return self._flat

    def __call__(
        self,
        input_ids: torch.Tensor,  # [T]: one token per sequence
        positions: torch.Tensor,  # [T]
        kv: Any,
        meta: Any,
    ) -> torch.Tensor:  # [T, hidden], equal to DecoderModel.forward's
        T = input_ids.shape[0]
        hq, hk, d, hidden, inter = self.hq, self.hk, self.d, self.hidden, self.inter
        g, nqk = hq // hk, (hq + hk) * d
        cos2, sin2 = self._rope_rows(positions)
        slots, plan = meta.slot_mapping, meta.plan
        # Decode attention as kernels.cpu_attention computes it for a float32 pool (gather each
        # sequence's K/V head-major, two grouped matmuls), minus its no-op casts and re-views.
        L = plan.gather_slots.shape[1]
        neg_mask = None if plan.attn_mask is None else ~plan.attn_mask.transpose(0, 1)
        emb = self.model.model.embed_tokens
        plain = type(emb) is torch.nn.Embedding and emb.max_norm is None
        h = F.embedding(input_ids, emb.weight) if plain else emb(input_ids)
        for fl, (kf, vf) in zip(self.layers, self._pool(kv)):
            x = F.rms_norm(h, (hidden,), *fl.norm1)
            if fl.qkv is not None:
                out = F.linear(x, fl.qkv)
                qk, sw = out[:, :nqk].view(T, hq + hk, d), out[:, nqk : 2 * nqk].view(T, hq + hk, d)
                v = out[:, 2 * nqk :].view(T, hk, d)
            else:  # packed / quantized / biased projections, or per-head norms: the layer's own forward
                at = fl.attn
                q = at.q_proj.forward(x).view(T, hq, d)
                k = at.k_proj.forward(x).view(T, hk, d)
                v = at.v_proj.forward(x).view(T, hk, d)
                if at.q_norm is not None:
                    q, k = at.q_norm.forward(q), at.k_norm.forward(k)
                qk = torch.cat([q, k], dim=1)
                sw = torch.cat([qk[..., d // 2 :], qk[..., : d // 2]], dim=-1)
            r = qk * cos2 + sw * sin2  # [T, Hq + Hk, D]: RoPE, as kernels.rope's reference computes it
            kf.index_copy_(0, slots, r[:, hq:])
            vf.index_copy_(0, slots, v)
            kg = gather_rows(kf, plan).view(T, L, hk, d).permute(2, 0, 1, 3).contiguous()  # [Hk, B, L, D]
            vg = gather_rows(vf, plan).view(T, L, hk, d).permute(2, 0, 1, 3).contiguous()
            s = torch.matmul(r[:, :hq].contiguous().view(T, hk, g, d).transpose(0, 1), kg.transpose(-1, -2)) * fl.scale
            if neg_mask is not None:
                s = s.masked_fill(neg_mask, float("-inf"))
            o = torch.matmul(torch.softmax(s, dim=-1), vg).transpose(0, 1).reshape(T, hq * d)
            a = F.linear(o, fl.o) if fl.o is not None else fl.attn.o_proj.forward(o)
            h = a + h
            x = F.rms_norm(h, (hidden,), *fl.norm2)
            if fl.gate_up is not None:
                gu = F.linear(x, fl.gate_up)
                # contiguous: silu's vectorized and scalar loops round differently, so the
                # gate must sit in memory as the unfused GEMM's output did.
                y = F.silu(gu[:, :inter].contiguous()) * gu[:, inter:]
            else:
                y = F.silu(fl.mlp.gate_proj.forward(x)) * fl.mlp.up_proj.forward(x)
            h = h + (F.linear(y, fl.down) if fl.down is not None else fl.mlp.down_proj.forward(y))
        return F.rms_norm(h, (hidden,), *self.final_norm)
