"""Attention over the paged KV pool: one backend per engine, chosen once.

Tokens of all sequences are packed into one ``[T, ...]`` tensor so the linears run once per batch; only
attention needs the boundaries, from each step's :class:`AttentionMetadata` (which tokens belong to which
sequence, where their K/V go, which blocks hold each history). An :class:`AttentionBackend` owns a step's
attention (metadata builder, RoPE + K/V store, ``attend``, ``attend_with_scores``); :func:`make_backend`
picks it once from the device and the pool's kind, so no call asks. :class:`CpuBackend` (plain CPU pool:
one gather plan a step, the C decode attention by slot, per-sequence prompts, RoPE + K/V store in one C
call), :class:`CpuInt8Backend`, :class:`Int4Backend` (KIVI, any device), :class:`CudaBackend` /
:class:`CudaInt8Backend` (Triton). Each applies a layer's ``window``, ``softcap`` and ``sinks`` itself (a
window no context exceeds changes nothing); Quest applies none, so it is refused for such models
(``DecoderModel.kv_policy_blocker``). Decorators: :class:`ScoringBackend` (H2O / SnapKV rows),
:class:`QuestBackend`, :class:`RingBackend` (sliding layers in rings, ``engine/sliding_kv.py``).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Protocol

import torch

from llmsys import kernels
from llmsys.kernels import (
    ColdBlocks,
    GatherPlan,
    attend_gathered,
    cpu_fused_available,
    cpu_fused_decode_attention,
    cpu_fused_rope_store,
    cpu_fused_rope_store_attend,
    make_gather_plan,
    paged_attention_gathered,
    paged_attention_gathered_scores,
    windowed,
)

if TYPE_CHECKING:
    from llmsys.engine.kv_cache import KVPool
    from llmsys.offload.eviction.quest import QuestAttention


@dataclass(frozen=True)
class StepScores:
    """What a :class:`ScoringBackend` step collects: attention rows of the sequences that score.

    ``score_from[b]``: first new token of sequence ``b`` whose row is kept, or
    None for a sequence that needs no scores (another policy, or ``full``):
    those attend through the plain path, batched apart from the scoring ones,
    exactly as they would without a scoring neighbour. ``rows[b]``:
    ``[nq_b, context_len_b]`` mass summed over heads and layers (filled during the step).
    """

    score_from: list[int | None]
    context_lens: list[int]
    rows: list[torch.Tensor | None]
    # Mixed steps: (scoring rows, their metadata, their tokens [Ts], the others' metadata, their tokens [To]).
    split: tuple[list[int], "AttentionMetadata", torch.Tensor, "AttentionMetadata", torch.Tensor] | None = None

    def add(self, seqs, rows: list[torch.Tensor]) -> None:
        for b, r in zip(seqs, rows):
            r = r[:, : self.context_lens[b]].float().cpu()
            self.rows[b] = r if self.rows[b] is None else self.rows[b] + r


@dataclass
class AttentionMetadata:
    """Per-step layout of the packed batch (``B`` sequences, ``T`` new tokens).

    Sequence ``b`` owns packed tokens ``query_start[b]:query_start[b+1]``;
    after this step its context (cached prefix + new tokens) holds
    ``context_lens[b]`` tokens, stored in the blocks ``block_tables[b]``.
    Built by the engine's backend (:meth:`AttentionBackend.metadata`).
    """

    slot_mapping: torch.Tensor  # [T] int64: KV slot (block * block_size + offset) of each new token
    query_start: list[int]  # B + 1 offsets into the packed tokens
    context_lens: list[int]  # [B]
    block_tables: torch.Tensor  # [B, max_blocks] int32
    context_lens_t: torch.Tensor  # [B] int32
    query_start_loc: torch.Tensor  # [B + 1] int32
    is_decode: bool  # every sequence has exactly one new token
    plan: GatherPlan | None  # CPU gather layout (None on CUDA unless the step reads cold blocks)
    # The step's cold KV blocks (llmsys.offload.kv_tier): block-table ids >= cold.first live outside
    # the pool; the gather plan reads them from the tier's staging (None: every block is in the pool).
    cold: ColdBlocks | None = None
    scores: StepScores | None = None  # set by ScoringBackend.metadata when some sequence scores
    # [B] each sequence's context once all its known tokens are in, where a prompt chunk stops short of
    # its prompt's end (set by the runner; None: context_lens). LongRoPE picks its table by it.
    seq_lens: list[int] | None = None
    # The sliding layers' own addressing where they keep only their window (engine/sliding_kv.py): this
    # step's metadata over their ring tables, set by the runner; :class:`RingBackend` hands it to those
    # layers. None: every layer's KV is in the block tables.
    ring: AttentionMetadata | None = None

    @property
    def num_seqs(self) -> int:
        return len(self.context_lens)


def build_metadata(
    query_lens: list[int],
    context_lens: list[int],
    block_tables: list[list[int]],
    block_size: int,
    device: torch.device,
    cold: ColdBlocks | None = None,
    prompt: list[bool] | None = None,
    plan: bool = True,
) -> AttentionMetadata:
    """Tensors attention needs, from plain Python lists (the backends' shared builder).

    Sequence ``b``'s new tokens are positions ``context_lens[b] -
    query_lens[b] .. context_lens[b] - 1`` of its context; ``block_tables[b]``
    must cover ``context_lens[b]`` tokens. ``plan``: make the gather plan
    (always with ``cold``: the plan reads cold blocks from the tier's staging;
    new tokens must land in pool blocks). ``prompt[b]``: sequence b's new
    tokens are prompt tokens (the plan gives them the prefill attention even
    one at a time, see ``make_gather_plan``).
    """
    B = len(query_lens)
    nblk = max(len(t) for t in block_tables)
    table = torch.zeros((B, nblk), dtype=torch.int32)
    slots: list[torch.Tensor] = []
    starts = [0]
    for b, t in enumerate(block_tables):
        tt = torch.as_tensor(t, dtype=torch.int64)
        table[b, : len(t)] = tt.to(torch.int32)
        pos = torch.arange(context_lens[b] - query_lens[b], context_lens[b])
        slots.append(tt[pos // block_size] * block_size + pos % block_size)
        starts.append(starts[-1] + query_lens[b])
    gp = None
    if plan or cold is not None:
        gp = make_gather_plan(query_lens, context_lens, block_tables, block_size, device, cold, prompt)
    return AttentionMetadata(
        slot_mapping=torch.cat(slots).to(device),
        query_start=starts,
        context_lens=list(context_lens),
        block_tables=table.to(device),
        context_lens_t=torch.tensor(context_lens, dtype=torch.int32, device=device),
        query_start_loc=torch.tensor(starts, dtype=torch.int32, device=device),
        is_decode=max(query_lens) == 1,
        plan=gp,
        cold=cold,
    )


class AttentionBackend(Protocol):
    """A step's attention over one KV pool (see the module doc); ``layer`` indexes the pool."""

    pool: KVPool
    block_size: int
    selects_pages: bool  # decode reads only the pages it selects (Quest): the cold tier does not prefetch

    def metadata(self, query_lens: list[int], context_lens: list[int], block_tables: list[list[int]],
                 cold: ColdBlocks | None = None, prompt: list[bool] | None = None,
                 score_from: list[int | None] | None = None) -> AttentionMetadata:
        """The step's metadata (``score_from``: per sequence, see :class:`StepScores`)."""
        ...

    def for_step(self, meta: AttentionMetadata) -> AttentionBackend:
        """The backend this step's layers call: a decorator with nothing to do this step hands back
        its inner backend, so the per-layer calls skip it (asked once per step, not per layer)."""
        ...

    def rope_store(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, positions: torch.Tensor,
                   rope_cache: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        """RoPE q ``[T, Hq, D]`` and k ``[T, Hk, D]`` at ``positions``; k, v into the pool -> roped q."""
        ...

    def store(self, layer: int, k: torch.Tensor, v: torch.Tensor, meta: AttentionMetadata) -> None:
        """Write already-roped k and v ``[T, Hk, D]`` at the step's slots."""
        ...

    def rope_attend(self, layer: int, qkv: torch.Tensor, hq: int, hk: int, positions: torch.Tensor,
                    rope_cache: torch.Tensor, meta: AttentionMetadata, scale: float, window: int | None = None,
                    softcap: float | None = None, sinks: torch.Tensor | None = None) -> torch.Tensor:
        """:meth:`rope_store` then :meth:`attend` from a q|k|v projection ``[T, (Hq + 2 Hk) D]`` -> ``[T, Hq D]``."""
        ...

    def attend(self, layer: int, q: torch.Tensor, meta: AttentionMetadata, scale: float, window: int | None = None,
               softcap: float | None = None, sinks: torch.Tensor | None = None) -> torch.Tensor:
        """Each new token over its sequence's cached context: q ``[T, Hq, D]`` -> ``[T, Hq, D]``.

        ``window``: the layer attends only to keys less than ``window`` positions behind each query
        (sliding-window layers); ``softcap``: its logits are ``cap * tanh(logits / cap)`` (Gemma 2);
        ``sinks`` ``[Hq]``: each head's softmax has one more logit, with no value (gpt-oss)."""
        ...

    def attend_with_scores(self, layer: int, q: torch.Tensor, meta: AttentionMetadata, scale: float,
                           score_from: list[int], window: int | None = None, softcap: float | None = None,
                           sinks: torch.Tensor | None = None) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """:meth:`attend`, also returning per sequence the attention rows from ``score_from[b]`` on."""
        ...

    def on_demote(self, pairs: list[tuple[int, int]]) -> None:
        """Pool blocks moved to cold ids (pool id, cold id) before the step (``llmsys.offload.kv_tier``)."""
        ...


def rope_attend_ops(backend: AttentionBackend, layer: int, qkv: torch.Tensor, hq: int, hk: int,
                    positions: torch.Tensor, rope_cache: torch.Tensor, meta: AttentionMetadata,
                    scale: float, window: int | None = None, softcap: float | None = None,
                    sinks: torch.Tensor | None = None) -> torch.Tensor:
    """``rope_attend`` as ``backend``'s own ``rope_store`` then ``attend`` on views of ``qkv``."""
    t = qkv.shape[0]
    d = qkv.shape[1] // (hq + 2 * hk)
    q = qkv[:, : hq * d].view(t, hq, d)
    k = qkv[:, hq * d : (hq + hk) * d].view(t, hk, d)
    v = qkv[:, (hq + hk) * d :].view(t, hk, d)
    q = backend.rope_store(layer, q, k, v, positions, rope_cache, meta)
    return backend.attend(layer, q, meta, scale, window, softcap, sinks).reshape(t, hq * d)


class _PagedBackend:
    """What every base backend shares: the builder, RoPE then store, no page bookkeeping."""

    selects_pages = False
    plans = True  # the metadata carries a gather plan

    def __init__(self, pool: KVPool, block_size: int, device: torch.device):
        self.pool = pool
        self.block_size = block_size
        self.device = device
        self._window: tuple[GatherPlan | None, int | None, GatherPlan | None] = (None, None, None)  # _windowed's last

    def _windowed(self, plan: GatherPlan, window: int | None) -> GatherPlan:
        """``kernels.windowed(plan, window)``, made once per step: every sliding layer of a model has one window."""
        if window is None:
            return plan
        src, w, out = self._window
        if src is not plan or w != window:
            out = windowed(plan, window)
            self._window = (plan, window, out)
        return out

    def metadata(self, query_lens, context_lens, block_tables, cold=None, prompt=None, score_from=None):
        return build_metadata(query_lens, context_lens, block_tables, self.block_size, self.device, cold, prompt,
                              self.plans)

    def for_step(self, meta):
        return self

    def rope_store(self, layer, q, k, v, positions, rope_cache, meta):
        q, k = kernels.rope(q, k, positions, rope_cache)
        self.pool.store(layer, k, v, meta.slot_mapping)
        return q

    def store(self, layer, k, v, meta):
        self.pool.store(layer, k, v, meta.slot_mapping)

    def rope_attend(self, layer, qkv, hq, hk, positions, rope_cache, meta, scale, window=None, softcap=None,
                    sinks=None):
        return rope_attend_ops(self, layer, qkv, hq, hk, positions, rope_cache, meta, scale, window, softcap, sinks)

    def on_demote(self, pairs):
        pass


class CpuBackend(_PagedBackend):
    """Plain pool on the CPU (see the module doc)."""

    def __init__(self, pool: KVPool, block_size: int, device: torch.device):
        super().__init__(pool, block_size, device)
        s = pool.spec
        # bfloat16 and float32 with the C kernels: RoPE writes K/V into the pool in the same call (the bits of
        # kernels.rope + kernels.kv_store, kernels/cpu_decode.py), and decode attention reads the pool by slot
        # (q has the pool's dtype). The pool's flat [slots, Hk, D] views.
        self._c_rope = self._c_decode = s.dtype in (torch.bfloat16, torch.float32) and cpu_fused_available()
        self._flat = [(k.view(-1, s.num_kv_heads, s.head_dim), v.view(-1, s.num_kv_heads, s.head_dim))
                      for k, v in zip(pool.k, pool.v)]

    def decode_pools(self) -> list[tuple[torch.Tensor, torch.Tensor]] | None:
        """Each layer's flat K/V pools ``[slots, Hk, D]`` when :meth:`rope_attend` runs a plain decode step
        (``GatherPlan.one_call``) as one C call of RoPE, the K/V store and decode attention (a bf16 or float32
        pool with the C kernels), else None. The decode plan (``engine/models/decode_plan.py``) then runs
        those calls for all layers in one (``kernels.decode_stack``, the same bits)."""
        return self._flat if self._c_rope else None

    def rope_store(self, layer, q, k, v, positions, rope_cache, meta):
        d = q.shape[-1]
        if (self._c_rope and q.stride(1) == d and k.stride(1) == d and v.stride(1) == d
                and not (torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad))):
            kf, vf = self._flat[layer]  # (the C call records no autograd: a training forward runs the ops)
            return cpu_fused_rope_store(q, k, v, positions, rope_cache, kf, vf, meta.slot_mapping)
        q, k = kernels.rope(q, k, positions, rope_cache)
        self.store(layer, k, v, meta)
        return q

    def store(self, layer, k, v, meta):
        # kernels.kv_store's CPU path (one index_copy_ per side into its flat slot view) without its
        # checks: the engine's own shapes and dtypes, slots from build_metadata (never -1).
        kf, vf = self._flat[layer]
        kf.index_copy_(0, meta.slot_mapping, k)
        vf.index_copy_(0, meta.slot_mapping, v)

    def rope_attend(self, layer, qkv, hq, hk, positions, rope_cache, meta, scale, window=None, softcap=None,
                    sinks=None):
        plan = self._windowed(meta.plan, window)
        if (self._c_rope and plan.one_call and softcap is None and sinks is None and qkv.dtype == self.pool.spec.dtype
                and qkv.stride(1) == 1):
            # rope_store's and attend's C calls below in one (the same bits)
            kf, vf = self._flat[layer]
            return cpu_fused_rope_store_attend(qkv, hq, hk, positions, rope_cache, kf, vf, meta.slot_mapping,
                                               plan.lens, scale, plan.gather_slots)
        return rope_attend_ops(self, layer, qkv, hq, hk, positions, rope_cache, meta, scale, window, softcap, sinks)

    def attend(self, layer, q, meta, scale, window=None, softcap=None, sinks=None):
        plan = self._windowed(meta.plan, window)
        if self._c_decode and plan.one_call and softcap is None and sinks is None and q.dtype == self.pool.spec.dtype:
            # What paged_attention_gathered runs for this step (the C decode attention reading the
            # pool by slot), without its dispatch: asked per layer, the same answer every layer.
            kf, vf = self._flat[layer]
            return cpu_fused_decode_attention(q.contiguous(), kf, vf, plan.lens, scale, plan.gather_slots)
        return paged_attention_gathered(q, self.pool.k[layer], self.pool.v[layer], plan, scale, softcap=softcap,
                                        sinks=sinks)

    def attend_with_scores(self, layer, q, meta, scale, score_from, window=None, softcap=None, sinks=None):
        return paged_attention_gathered_scores(q, self.pool.k[layer], self.pool.v[layer],
                                               self._windowed(meta.plan, window), scale, score_from, softcap=softcap,
                                               sinks=sinks)


class CpuInt8Backend(_PagedBackend):
    """int8 pool on the CPU: the plain path with codes and per (slot, head) scales."""

    def attend(self, layer, q, meta, scale, window=None, softcap=None, sinks=None):
        k, v = self.pool.k[layer], self.pool.v[layer]
        return paged_attention_gathered(q, k.codes, v.codes, self._windowed(meta.plan, window), scale, k.scale,
                                        v.scale, softcap, sinks)

    def attend_with_scores(self, layer, q, meta, scale, score_from, window=None, softcap=None, sinks=None):
        k, v = self.pool.k[layer], self.pool.v[layer]
        return paged_attention_gathered_scores(q, k.codes, v.codes, self._windowed(meta.plan, window), scale,
                                               score_from, k.scale, v.scale, softcap=softcap, sinks=sinks)


class Int4Backend(_PagedBackend):
    """KIVI int4 pool (any device): dequantizing gather, then ``attend_gathered``.

    Prompt chunks take the unpadded per-sequence attention of the other pools, so an
    int4 prompt's bits do not depend on what else is in the step (batch-invariant);
    decodes and prompt chunks of a mixed step run as two batches (``GatherPlan.split``).
    """

    def attend(self, layer, q, meta, scale, window=None, softcap=None, sinks=None):
        return self._attend(layer, q, self._windowed(meta.plan, window), scale, softcap, sinks)

    def _attend(self, layer: int, q: torch.Tensor, plan: GatherPlan, scale: float,
                softcap: float | None, sinks: torch.Tensor | None) -> torch.Tensor:
        if plan.split is not None:
            dplan, dtok, pplan, ptok = plan.split
            out = q.new_empty(q.shape)
            for sub, tok in ((dplan, dtok), (pplan, ptok)):
                out.index_copy_(0, tok, self._attend(layer, q.index_select(0, tok), sub, scale, softcap, sinks))
            return out
        k, v = self.pool.gather(layer, plan.gather_slots, q.dtype)  # [B, Lmax, Hk, D]
        return attend_gathered(q, k, v, plan, scale, softcap, sinks)

    def attend_with_scores(self, layer, q, meta, scale, score_from, window=None, softcap=None, sinks=None):
        raise ValueError("attention scores need a float KV pool (KV policies run on kv_dtype auto)")


class CudaBackend(_PagedBackend):
    """Plain pool on CUDA: the Triton paged kernels; a step with cold blocks takes the gather plan.

    The Triton decode kernel takes no window, no soft-capping and no attention sinks: a decode step
    of a layer whose window some context exceeds, whose logits are capped or that has sinks (gpt-oss)
    runs the torch reference attention (``kernels.paged_decode_attention`` with them; correct, not
    fast). Prompt steps run the torch attention anyway (``kernels.paged_prefill_attention``)."""

    plans = False

    def _caches(self, layer: int):
        return self.pool.k[layer], self.pool.v[layer], None, None

    def attend(self, layer, q, meta, scale, window=None, softcap=None, sinks=None):
        kc, vc, ks, vs = self._caches(layer)
        if meta.plan is not None:  # the step reads cold blocks: staged rows over the gathered pool rows
            return paged_attention_gathered(q, kc, vc, self._windowed(meta.plan, window), scale, ks, vs, softcap,
                                            sinks)
        if window is not None and max(meta.context_lens) <= window:
            window = None  # no context of the step reaches past it: the Triton kernel runs the step
        if meta.is_decode:
            return kernels.paged_decode_attention(q, kc, vc, meta.block_tables, meta.context_lens_t, scale, ks, vs,
                                                  window=window, softcap=softcap, sinks=sinks)
        return kernels.paged_prefill_attention(
            q, kc, vc, meta.block_tables, meta.context_lens_t, meta.query_start_loc, scale, ks, vs,
            window=window, softcap=softcap, sinks=sinks
        )

    def attend_with_scores(self, layer, q, meta, scale, score_from, window=None, softcap=None, sinks=None):
        kc, vc, ks, vs = self._caches(layer)
        if window is not None and max(meta.context_lens) <= window:
            window = None
        if (meta.is_decode and ks is None and meta.plan is None and window is None and softcap is None
                and sinks is None):
            res = kernels.paged_decode_attention(q, kc, vc, meta.block_tables, meta.context_lens_t, scale,
                                                 return_scores=True)
            return res.out, [res.token_mass[b].sum(0, keepdim=True) for b in range(q.shape[0])]  # [1, cap]
        plan = meta.plan
        if plan is None:  # a scoring prefill: ScoringBackend asked for the plan in its metadata
            raise ValueError("attend_with_scores: the step's metadata has no gather plan")
        return paged_attention_gathered_scores(q, kc, vc, self._windowed(plan, window), scale, score_from, ks, vs,
                                               softcap=softcap, sinks=sinks)

    def metadata(self, query_lens, context_lens, block_tables, cold=None, prompt=None, score_from=None):
        # A scoring step's prompt rows need the gather layout (explicit softmax rows).
        want = score_from is not None and any(f is not None for f in score_from) and max(query_lens) > 1
        return build_metadata(query_lens, context_lens, block_tables, self.block_size, self.device, cold, prompt,
                              want)


class CudaInt8Backend(CudaBackend):
    """int8 pool on CUDA: the Triton kernels dequantize inside."""

    def _caches(self, layer: int):
        k, v = self.pool.k[layer], self.pool.v[layer]
        return k.codes, v.codes, k.scale, v.scale


class BackendDecorator:
    """A backend wrapping another: everything it does not change is the inner backend's."""

    selects_pages = False

    def __init__(self, inner: AttentionBackend):
        self.inner = inner
        self.pool = inner.pool
        self.block_size = inner.block_size

    def metadata(self, query_lens, context_lens, block_tables, cold=None, prompt=None, score_from=None):
        return self.inner.metadata(query_lens, context_lens, block_tables, cold, prompt, score_from)

    def for_step(self, meta):
        return self

    def rope_store(self, layer, q, k, v, positions, rope_cache, meta):
        return self.inner.rope_store(layer, q, k, v, positions, rope_cache, meta)

    def store(self, layer, k, v, meta):
        self.inner.store(layer, k, v, meta)

    def rope_attend(self, layer, qkv, hq, hk, positions, rope_cache, meta, scale, window=None, softcap=None,
                    sinks=None):
        # this decorator's ops
        return rope_attend_ops(self, layer, qkv, hq, hk, positions, rope_cache, meta, scale, window, softcap, sinks)

    def attend(self, layer, q, meta, scale, window=None, softcap=None, sinks=None):
        return self.inner.attend(layer, q, meta, scale, window, softcap, sinks)

    def attend_with_scores(self, layer, q, meta, scale, score_from, window=None, softcap=None, sinks=None):
        return self.inner.attend_with_scores(layer, q, meta, scale, score_from, window, softcap, sinks)

    def on_demote(self, pairs):
        self.inner.on_demote(pairs)


class RingBackend(BackendDecorator):
    """Sliding layers whose KV lives in per-sequence rings (``engine/sliding_kv.py``): every call on one
    of ``layers`` reaches the inner backend with the step's ring metadata (``meta.ring``: the ring
    pool's slots, tables and gather plan), every other call with the metadata as it is. The one place
    a layer's addressing is chosen; the inner backend's paths (the C decode attention, fused RoPE +
    store, windowed plans) run unchanged on the layer's tensors."""

    def __init__(self, inner: AttentionBackend, layers: frozenset[int]):
        super().__init__(inner)
        self.layers = layers

    def _meta(self, layer: int, meta: AttentionMetadata) -> AttentionMetadata:
        if layer not in self.layers:
            return meta
        if meta.ring is None:
            raise ValueError("this engine keeps its sliding layers' KV in per-sequence rings, and the step's "
                             "metadata has no ring tables; run sequences through the scheduler, or build the "
                             "engine with sliding_kv='full'")
        return meta.ring

    def rope_store(self, layer, q, k, v, positions, rope_cache, meta):
        return self.inner.rope_store(layer, q, k, v, positions, rope_cache, self._meta(layer, meta))

    def store(self, layer, k, v, meta):
        self.inner.store(layer, k, v, self._meta(layer, meta))

    def rope_attend(self, layer, qkv, hq, hk, positions, rope_cache, meta, scale, *args):
        return self.inner.rope_attend(layer, qkv, hq, hk, positions, rope_cache, self._meta(layer, meta), scale,
                                      *args)

    def attend(self, layer, q, meta, scale, *args):
        return self.inner.attend(layer, q, self._meta(layer, meta), scale, *args)

    def attend_with_scores(self, layer, q, meta, scale, score_from, *args):
        return self.inner.attend_with_scores(layer, q, self._meta(layer, meta), scale, score_from, *args)


class ScoringBackend(BackendDecorator):
    """Sums attention rows over layers for the sequences whose policy needs scores (H2O, SnapKV).

    A step whose ``score_from`` names no sequence gets the inner backend's metadata and
    attention unchanged; otherwise its metadata carries a :class:`StepScores` that
    :meth:`attend` fills and ``PolicyRuntime.after_forward`` reads.
    """

    def metadata(self, query_lens, context_lens, block_tables, cold=None, prompt=None, score_from=None):
        meta = self.inner.metadata(query_lens, context_lens, block_tables, cold, prompt, score_from)
        if score_from is None or all(f is None for f in score_from):
            return meta
        split = None
        if any(f is None for f in score_from):  # scoring rows and the others as two sub-batches
            bs, qs, dev = self.block_size, meta.query_start, meta.slot_mapping.device
            tables = [t[: -(-n // bs)] for t, n in zip(block_tables, context_lens)]
            parts: list = []
            for want in (True, False):
                rows = [b for b, f in enumerate(score_from) if (f is not None) == want]
                sub = self.inner.metadata([qs[b + 1] - qs[b] for b in rows], [context_lens[b] for b in rows],
                                          [tables[b] for b in rows], cold,  # a full neighbour may be cold
                                          score_from=[score_from[b] for b in rows])
                tok = torch.tensor([t for b in rows for t in range(qs[b], qs[b + 1])], dtype=torch.int64, device=dev)
                parts += [rows, sub, tok]
            split = (parts[0], parts[1], parts[2], parts[4], parts[5])
        return replace(meta, scores=StepScores(list(score_from), list(context_lens), [None] * len(score_from), split))

    def for_step(self, meta):
        return self.inner.for_step(meta) if meta.scores is None else self

    def attend(self, layer, q, meta, scale, window=None, softcap=None, sinks=None):
        sc = meta.scores
        if sc is None:
            return self.inner.attend(layer, q, meta, scale, window, softcap, sinks)
        if sc.split is None:
            out, rows = self.inner.attend_with_scores(layer, q, meta, scale, sc.score_from, window, softcap, sinks)
            sc.add(range(len(rows)), rows)
            return out
        srows, smeta, stok, ometa, otok = sc.split
        out = q.new_empty(q.shape)
        res, rows = self.inner.attend_with_scores(layer, q.index_select(0, stok), smeta, scale,
                                                  [sc.score_from[b] for b in srows], window, softcap, sinks)
        out.index_copy_(0, stok, res)
        out.index_copy_(0, otok, self.inner.attend(layer, q.index_select(0, otok), ometa, scale, window, softcap,
                                                   sinks))
        sc.add(srows, rows)
        return out


class QuestBackend(BackendDecorator):
    """Quest page selection (``llmsys.offload.eviction.quest``): decode attends over the top pages only.

    Keys stored this step are folded into their pages' min/max summaries;
    prompt chunks attend as the inner backend does.
    """

    selects_pages = True

    def __init__(self, inner: AttentionBackend, quest: QuestAttention):
        super().__init__(inner)
        self.quest = quest

    def rope_store(self, layer, q, k, v, positions, rope_cache, meta):
        q = self.inner.rope_store(layer, q, k, v, positions, rope_cache, meta)
        self.quest.update(self.pool.k[layer], meta.slot_mapping)
        return q

    def store(self, layer, k, v, meta):
        self.inner.store(layer, k, v, meta)
        self.quest.update(self.pool.k[layer], meta.slot_mapping)

    def attend(self, layer, q, meta, scale, window=None, softcap=None, sinks=None):
        if meta.is_decode:
            if window is not None or softcap is not None or sinks is not None:  # refused at build (kv_policy_blocker)
                raise ValueError("quest: page selection does not apply a sliding window, soft-capped logits or "
                                 "attention sinks")
            return self.quest.decode(q, self.pool.k[layer], self.pool.v[layer], meta.block_tables,
                                     meta.context_lens_t, scale)
        return self.inner.attend(layer, q, meta, scale, window, softcap, sinks)

    def on_demote(self, pairs):
        self.quest.move_pages(pairs)  # the demoted pages' summaries follow them


def make_backend(pool: KVPool, device: torch.device, block_size: int,
                 quest: QuestAttention | None = None) -> AttentionBackend:
    """The engine's attention backend, chosen once from the pool's kind and the device.

    ``quest``: the engine runs Quest (engine-wide page selection); else a float pool
    gets the scoring decorator, since any request may ask for H2O or SnapKV.
    """
    if pool.kind == "int4":
        base: AttentionBackend = Int4Backend(pool, block_size, device)
    elif device.type == "cuda":
        base = (CudaInt8Backend if pool.kind == "int8" else CudaBackend)(pool, block_size, device)
    else:
        base = (CpuInt8Backend if pool.kind == "int8" else CpuBackend)(pool, block_size, device)
    if pool.spec is not None and pool.spec.sliding is not None:  # sliding layers in rings (engine/sliding_kv.py)
        base = RingBackend(base, pool.spec.sliding.layers)
    if quest is not None:
        if pool.quantized:
            raise ValueError("quest: quantized KV pools are not supported (use kv_dtype auto)")
        return QuestBackend(base, quest)
    return base if pool.quantized else ScoringBackend(base)
