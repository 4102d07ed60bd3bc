"""The CPU decode step of a float32 or bfloat16 model with fewer calls, same bits.

A one-token step of a small model is bound by per-op overhead, not by math:
stories260k (5 layers, hidden 64) spends ~1.8 ms per token in ~45 small torch
ops per layer, module calls and input checks, and a bfloat16 SmolLM2-135M
spent about as long (~15 ms per token) outside its GEMVs as in them.
:class:`FastDecode` runs the same decoder for a pure-decode step (every
sequence feeds one token; CPU gather plan; plain KV pool of the model's dtype;
no attention override, no offload hook). What it saves:

* float32: one GEMM for q|k|v and one for gate|up where the layers' weights go
  through ``F.linear`` anyway (plain weights too small to pack; bigger ones are
  fused by ``DecoderModel.fuse_projections`` for both paths): the weights are
  concatenated once; each output row of the fused GEMM equals the separate
  GEMMs' bit for bit. RoPE's rotate-half is folded into that GEMM: the q and k
  weights are also stored with the two halves of every head swapped, so the
  GEMM yields ``[x2, x1]`` directly, and RoPE is three elementwise ops over q|k
  at once, with the ``[cos, cos]`` / ``[-sin, sin]`` rows read from a table
  built once (``kernels.rope``'s reference does the same products and sums);
  attention is the C decode kernel reading the pool by slot, as on the module path;
* bfloat16 (with the C kernels of ``kernels/cpu_decode.c``): RMSNorm fused with
  the residual add before it, RoPE writing K/V straight into the pool, and
  attention reading the pool by slot -- the kernels ``kernels.rms_norm``,
  ``kernels.rope`` and the CPU decode attention call on the module path, so
  the bits agree; ~10 calls per layer instead of ~60. Without the C kernels,
  the reference RMSNorm as ``F.rms_norm`` on the float32 upcast plus one
  multiply (the fused op computes the same float32 ``x * rsqrt(mean(x^2) +
  eps)``, tested), RoPE over q|k in one float32 pass, and attention's upcast
  done by the head-major copy;
* the cos/sin rows, K/V slots and gather layout taken once per step, not per
  layer; no ``nn.Module.__call__`` and no wrapper checks inside the loop (the
  shapes are the engine's own).

Everything else calls what the module path calls (the layers' own
``project`` / ``act`` / ``forward`` for packed, fused or quantized weights), so
the hidden states equal ``DecoderModel.forward``'s exactly
(``tests/test_fast_decode.py``). Built by the engine after prepacking (an
inference engine whose weights are no longer rewritten);
``DecoderModel.forward`` uses it for the steps it accepts.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from llmsys import kernels
from llmsys.kernels import cpu_decode
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


_DTYPES = (torch.float32, torch.bfloat16)  # the model dtypes whose module path this reproduces


class FastDecode:
    """Decode steps of one float32 or bfloat16 CPU :class:`DecoderModel` (see the module doc)."""

    def __init__(self, model: Any, dtype: torch.dtype):
        a = model.args
        self.model = model
        self.dtype = dtype  # of the weights, norms and KV pool (the model's dtype)
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
        """None when the model is not a float32 or bfloat16 CPU decoder with plain RMSNorms."""
        from llmsys.engine.models.base import RMSNorm

        p = next(model.parameters(), None)
        norms = [m for layer in model.model.layers for m in (layer.input_layernorm, layer.post_attention_layernorm)]
        norms.append(model.model.norm)
        dtype = norms[0].weight.dtype
        ok = (
            p is not None
            and p.device.type == "cpu"
            and dtype in _DTYPES
            and model.rope_cache.dtype == torch.float32
            and all(type(n) is RMSNorm and n.weight.dtype == dtype for n in norms)
        )
        return cls(model, dtype) if ok else None

    def accepts(self, kv: Any, meta: Any) -> bool:
        """A pure-decode CPU step on a plain pool of the model's dtype, nothing overriding attention or layers."""
        plan = meta.plan
        return (
            plan is not None
            and plan.is_decode
            and plan.lens is not None
            and meta.policy_attn is None
            and self.model.layer_hook is None
            and not kv.quantized
            and kv.spec.dtype == self.dtype
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

    def _norm(self, h: torch.Tensor, weight_eps: tuple[torch.Tensor, float]) -> torch.Tensor:  # [T, hidden]
        """``kernels.rms_norm``'s result: float32 fused; bfloat16 the reference's roundings (module doc)."""
        w, eps = weight_eps
        if self.dtype == torch.float32:
            return F.rms_norm(h, (self.hidden,), w, eps)
        return w * F.rms_norm(h.float(), (self.hidden,), None, eps).to(self.dtype)

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
        if self.dtype == torch.bfloat16 and cpu_decode.available():
            return self._call_c(input_ids, positions, kv, meta)
        T = input_ids.shape[0]
        hq, hk, d, inter, dtype = self.hq, self.hk, self.d, self.inter, self.dtype
        f32 = dtype == torch.float32
        c_attn = f32 and cpu_decode.available()  # bf16 without the C kernels: torch's grouped matmuls
        g, nqk = hq // hk, (hq + hk) * d
        cos2, sin2 = self._rope_rows(positions)
        slots, plan = meta.slot_mapping, meta.plan
        # Decode attention as kernels.cpu_attention computes it: the C kernel (kernels/cpu_decode.c),
        # or without it a head-major gather and two grouped float32 matmuls, minus no-op casts.
        L = plan.gather_slots.shape[1]
        neg_mask = None if c_attn or plan.attn_mask is None else ~plan.attn_mask.transpose(0, 1)  # torch path only
        emb = self.model.model.embed_tokens
        plain = type(emb) is torch.nn.Embedding and emb.max_norm is None
        h = F.embedding(input_ids, emb.weight) if plain else emb(input_ids)
        for fl, (kf, vf) in zip(self.layers, self._pool(kv)):
            x = self._norm(h, fl.norm1)
            if fl.qkv is not None:
                out = F.linear(x, fl.qkv)
                qk, sw = out[:, :nqk].view(T, hq + hk, d), out[:, nqk : 2 * nqk].view(T, hq + hk, d)
                v = out[:, 2 * nqk :].view(T, hk, d)
            else:  # packed / quantized / biased projections, or per-head norms: the layer's own
                q, k, v = fl.attn.project(x)
                qk = torch.cat([q, k], dim=1).float()  # [T, Hq + Hk, D] float32
                sw = torch.cat([qk[..., d // 2 :], qk[..., : d // 2]], dim=-1)
            r = qk * cos2 + sw * sin2  # [T, Hq + Hk, D]: RoPE, as kernels.rope's reference computes it
            if not f32:
                r = r.to(dtype)
            kf.index_copy_(0, slots, r[:, hq:])
            vf.index_copy_(0, slots, v)
            if c_attn:  # the C decode attention, as paged_attention_gathered calls it
                if plan.cold is None:
                    o = cpu_decode.decode_attention(r[:, :hq].contiguous(), kf, vf, plan.lens, fl.scale, plan.gather_slots)
                else:
                    kg, vg = (gather_rows(c, plan).view(T, L, hk, d) for c in (kf, vf))
                    o = cpu_decode.decode_attention(r[:, :hq].contiguous(), kg, vg, plan.lens, fl.scale)
                o = o.view(T, hq * d)
            else:
                kg, vg = (self._heads_first(gather_rows(c, plan), T, L) for c in (kf, vf))  # [Hk, B, L, D] f32
                qg = r[:, :hq].contiguous().view(T, hk, g, d).transpose(0, 1).float()  # [Hk, B, G, D]
                s = torch.matmul(qg, kg.transpose(-1, -2)) * fl.scale
                if neg_mask is not None:
                    s = s.masked_fill(neg_mask, float("-inf"))
                o = torch.matmul(torch.softmax(s, dim=-1), vg)
                o = (o if f32 else o.to(dtype)).transpose(0, 1).reshape(T, hq * d)
            a = F.linear(o, fl.o) if fl.o is not None else fl.attn.o_proj.forward(o)
            h = a + h
            x = self._norm(h, fl.norm2)
            if fl.gate_up is not None:
                gu = F.linear(x, fl.gate_up)
                # contiguous: silu's vectorized and scalar loops round differently, so the
                # gate must sit in memory as the unfused GEMM's output did.
                y = F.silu(gu[:, :inter].contiguous()) * gu[:, inter:]
            else:
                y = fl.mlp.act(x)
            h = h + (F.linear(y, fl.down) if fl.down is not None else fl.mlp.down_proj.forward(y))
        return self._norm(h, self.final_norm)

    def _call_c(self, input_ids: torch.Tensor, positions: torch.Tensor, kv: Any, meta: Any) -> torch.Tensor:
        """The bfloat16 step on ``kernels.cpu_decode``'s C kernels, which the module path also calls.

        Per layer: RMSNorm (fused with the residual add before it), the q|k|v GEMV, RoPE with
        the K/V stores, attention reading the pool by slot, the o GEMV, RMSNorm + residual,
        and the MLP's gate|up GEMV, SiLU and product, down GEMV -- ~10 calls where the
        module path makes ~60.
        The residual add after the MLP is fused into the next layer's RMSNorm (the module
        path adds, then normalizes: the same bf16 sum).
        """
        T = input_ids.shape[0]
        hq, hk, d = self.hq, self.hk, self.d
        plan, slots, rope = meta.plan, meta.slot_mapping, self.model.rope_cache
        L = plan.gather_slots.shape[1]
        emb = self.model.model.embed_tokens
        plain = type(emb) is torch.nn.Embedding and emb.max_norm is None
        h = F.embedding(input_ids, emb.weight) if plain else emb(input_ids)
        x = cpu_decode.rms_norm(h, *self.layers[0].norm1)
        last = len(self.layers) - 1
        for i, (fl, (kf, vf)) in enumerate(zip(self.layers, self._pool(kv))):
            at, mlp = fl.attn, fl.mlp
            q, k, v = at.project(x)
            q = cpu_decode.rope_store(q, k, v, positions, rope, kf, vf, slots)  # k, v into the pool
            if plan.cold is None:  # attention reads the pool rows by slot
                o = cpu_decode.decode_attention(q, kf, vf, plan.lens, fl.scale, plan.gather_slots)  # [T, Hq, D]
            else:  # hot and staged cold rows gathered into one tensor first
                kg, vg = (gather_rows(c, plan).view(T, L, hk, d) for c in (kf, vf))
                o = cpu_decode.decode_attention(q, kg, vg, plan.lens, fl.scale)
            x, h = cpu_decode.rms_norm(at.o_proj.forward(o.view(T, hq * d)), *fl.norm2, residual=h)
            y = mlp.down_proj.forward(mlp.act(x))
            x, h = cpu_decode.rms_norm(y, *(self.final_norm if i == last else self.layers[i + 1].norm1), residual=h)
        return x

    def _heads_first(self, rows: torch.Tensor, T: int, L: int) -> torch.Tensor:  # [T * L, Hk, D] -> [Hk, T, L, D]
        """Gathered K or V as the contiguous float32 ``[Hk, B, L, D]`` the grouped matmuls read.

        One copy: the permute and (for bfloat16) the upcast that the module path
        does as two (``_gather_heads_first`` then ``.float()``), same values, same layout.
        """
        src = rows.view(T, L, self.hk, self.d).permute(2, 0, 1, 3)
        if self.dtype == torch.float32:
            return src.contiguous()
        return torch.empty(src.shape, dtype=torch.float32).copy_(src)
