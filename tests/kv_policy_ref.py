"""Plain reference for the KV-policy tests: a token-by-token decoder over kept tokens.

Written for obviousness, independent of the engine's paged cache: per layer a
Python list of *pre-RoPE* keys and values of the kept tokens; RoPE is applied
at attention time with positions = index within the kept list (StreamingLLM),
attention is an explicit softmax, and which tokens stay is decided by plain
Python over lists (no torch.topk / max_pool).
"""

from __future__ import annotations

import torch


def rms(x, w, eps):
    return w * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))


def rope_at(x, pos, table):  # x [H, D], pos int
    half = x.shape[-1] // 2
    cos, sin = table[pos, :half], table[pos, half:]
    x1, x2 = x[..., :half], x[..., half:]
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)


def keep_ref(kind, L, target, *, sinks=0, recent=0, obs_w=16, pool=7, score=None, obs=None):
    """Sorted indices to keep out of L (plain Python)."""
    idx = list(range(L))
    if kind == "window":
        return idx[L - target :]
    if kind == "sink":
        s = min(sinks, target)
        return idx[:s] + (idx[L - (target - s) :] if target > s else [])
    if kind == "h2o":
        r = min(recent, target)
        older = idx[: L - r]
        best = sorted(older, key=lambda j: (-score[j], j))[: target - r]
        return sorted(best) + idx[L - r :]
    if kind == "snapkv":
        w = min(obs_w, target, L)
        agg = [sum(row[j] for row in obs) for j in range(L)] if obs else [0.0] * L
        h = pool // 2
        pooled = [max(agg[max(0, j - h) : j + h + 1]) for j in range(L)]
        older = idx[: L - w]
        best = sorted(older, key=lambda j: (-pooled[j], j))[: target - w]
        return sorted(best) + idx[L - w :]
    raise ValueError(kind)


class RefDecoder:
    """Token-by-token Llama decoder over a kept set, with the engine's eviction rule."""

    def __init__(self, model, kind, budget, chunk, **kw):
        self.m, self.kind, self.budget, self.chunk, self.kw = model, kind, budget, chunk, kw
        self.a = model.args
        n = self.a.num_hidden_layers
        self.K = [[] for _ in range(n)]  # pre-RoPE keys [Hk, D] per kept token
        self.V = [[] for _ in range(n)]
        self.score: list[float] = []  # h2o: accumulated mass per kept token
        self.obs: list[list[float]] = []  # snapkv: attention rows of the last queries
        self.evicted = 0

    def _evict(self):
        L = len(self.K[0])
        if L + 1 <= self.budget:
            return
        min_keep = max(self.kw.get("sinks", 0), 1)
        target = max(min(self.budget - 1 - (self.chunk - 1), L), min(min_keep, self.budget - 1))
        target = min(target, self.budget - 1)
        keep = keep_ref(self.kind, L, target, score=self.score, obs=self.obs, **self.kw)
        for lst in self.K + self.V:
            lst[:] = [lst[j] for j in keep]
        self.score = [self.score[j] for j in keep] if self.score else []
        self.obs = [[row[j] for j in keep] for row in self.obs]
        self.evicted += L - len(keep)

    @torch.inference_mode()
    def step(self, tok: int, evict: bool = True) -> torch.Tensor:  # -> logits [V]
        if evict:
            self._evict()
        m, a = self.m, self.a
        table = m.rope_cache
        h = m.model.embed_tokens.weight[tok].float()
        L = len(self.K[0]) + 1
        mass = torch.zeros(L)
        G = a.num_attention_heads // a.num_key_value_heads
        for i, layer in enumerate(m.model.layers):
            at = layer.self_attn
            x = rms(h, layer.input_layernorm.weight, a.rms_norm_eps)
            q = (at.q_proj.weight @ x).view(a.num_attention_heads, a.head_dim)
            k = (at.k_proj.weight @ x).view(a.num_key_value_heads, a.head_dim)
            v = (at.v_proj.weight @ x).view(a.num_key_value_heads, a.head_dim)
            self.K[i].append(k)
            self.V[i].append(v)
            qr = rope_at(q, L - 1, table)
            keys = torch.stack([rope_at(kk, j, table) for j, kk in enumerate(self.K[i])])  # [L, Hk, D]
            vals = torch.stack(self.V[i])
            keys = keys.repeat_interleave(G, dim=1)
            vals = vals.repeat_interleave(G, dim=1)
            p = torch.softmax(torch.einsum("hd,lhd->hl", qr, keys) * at.scale, dim=-1)  # [Hq, L]
            mass += p.sum(0)
            o = torch.einsum("hl,lhd->hd", p, vals).reshape(-1)
            h = h + at.o_proj.weight @ o
            x = rms(h, layer.post_attention_layernorm.weight, a.rms_norm_eps)
            mlp = layer.mlp
            h = h + mlp.down_proj.weight @ (torch.nn.functional.silu(mlp.gate_proj.weight @ x) * (mlp.up_proj.weight @ x))
        self.score = [s + float(mass[j]) for j, s in enumerate(self.score)] + [float(mass[-1])]
        if self.kind == "snapkv":
            self.obs = [row + [0.0] for row in self.obs] + [mass.tolist()]
            self.obs = self.obs[-self.kw.get("obs_w", 16) :]
        return m.lm_head.weight @ rms(h, m.model.norm.weight, a.rms_norm_eps)
