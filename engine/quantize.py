"""Load-time weight quantization: the ``make_linear`` hook the loader calls.

The loader (``engine/loader/common.materialize``) hands each linear weight and the token embedding here
one tensor at a time and drops the float tensor after, so peak memory is the quantized model plus one
float tensor (quantizers' temporaries bounded by ``quant.base.quantize_rows``). ``--quant`` applies to
every decoder ``nn.Linear``, the token embedding (:class:`~llmsys.quant.embedding.QuantEmbedding`,
dequantizing only looked-up rows) and the LM head (one table when tied): on small models the embedding
is a large share of the bytes (docs/benchmarks.md). ``keep_float=("lm_head", "model.embed_tokens")`` opts out.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass, field
from typing import Any, Callable

import torch
import torch.nn.functional as F
from torch import nn

from llmsys.engine.config import DEFAULT_TUNE_STEPS
from llmsys.engine.progress import bar, track
from llmsys.kernels.common.errors import InvalidParameterError
from llmsys.quant import QuantSpec, quantize_linear
from llmsys.quant.embedding import QuantEmbedding
from llmsys.quant.int8_fp8 import fp8_gemm_supported

EMBED = "model.embed_tokens"

def fallback_notice(spec: QuantSpec, device: torch.device) -> str | None:
    """One line when ``spec`` cannot use its fast kernel on ``device`` (it still runs)."""
    if spec.method == "fp8" and not fp8_gemm_supported(device):
        where = "this GPU" if device.type == "cuda" else "the CPU"
        return (f"notice: fp8 matmul needs a GPU with FP8 tensor cores (sm >= 8.9); on {where} fp8 weights "
                "are dequantized per layer and multiplied in the model dtype (same results, slower)")
    if spec.method == "nf4" and device.type == "cpu":
        return None  # NF4 is documented as a storage format (dequant + GEMM) everywhere
    return None


@dataclass
class WeightQuantizer:
    """``make_linear`` hook: ``(name, weight [N, K], bias) -> quantized module | None``.

    ``weight`` arrives in its checkpoint dtype and is quantized from that
    precision (not after rounding to the model dtype). On CUDA it is moved to
    the GPU first so layers are built in their GPU layout (the CPU packed
    int4 layout is CPU-only).
    """

    spec: QuantSpec
    device: torch.device
    dtype: torch.dtype
    keep_float: tuple[str, ...] = ()
    notice: bool = True
    count: int = 0
    _noticed: bool = field(default=False, repr=False)

    def __call__(self, name: str, weight: torch.Tensor, bias: torch.Tensor | None) -> nn.Module | None:
        if self.spec.method == "none" or name in self.keep_float:
            return None
        if self.notice and not self._noticed:
            self._noticed = True
            line = fallback_notice(self.spec, self.device)
            if line:
                print(line, file=sys.stderr)
        w = weight.to(self.device)
        b = None if bias is None else bias.to(self.device)
        q = quantize_linear(w, b, self.spec)
        self.count += 1
        if name == EMBED:
            return QuantEmbedding(q, self.dtype)
        return q


def loader_quantizer(config) -> WeightQuantizer | None:
    """The ``make_linear`` hook for an :class:`~llmsys.engine.config.EngineConfig`."""
    from llmsys.engine.loader.common import resolve_device, resolve_dtype

    if config.quant.method == "none":
        return None
    dev = resolve_device(config.device)
    return WeightQuantizer(config.quant, dev, resolve_dtype(config.dtype, dev), config.quant_keep_float)


# ------------------------------------------------------------------ calibration (GPTQ)


def _require_llama_layers(a: Any, what: str, fix: str) -> None:
    """Raise unless the layers are Llama's: q/k/v and gate/up stored apart, one plain RMSNorm before
    attention and one before the MLP, a dense MLP (Phi-3 stores them fused; Gemma's (1 + w) norms sit on
    both sides; an MoE layer's MLP is a router over experts)."""
    if a.fused_qkv or a.fused_gate_up or a.sandwich_norms or a.norm_offset:
        raise InvalidParameterError(f"{what} needs Llama-shaped layers, which this model does not have; {fix}")
    if a.num_experts:
        raise InvalidParameterError(f"{what} needs dense MLP layers, and this model's are mixture-of-experts "
                                    f"({a.num_experts} experts); {fix}")


def _calib_layout(lens: list[int], block_size: int) -> list[list[int]]:
    tables, nxt = [], 1  # block 0 is the scratch block
    for n in lens:
        nb = -(-n // block_size)
        tables.append(list(range(nxt, nxt + nb)))
        nxt += nb
    return tables


def _scratch_pool(model: nn.Module, lens: list[int], dtype: torch.dtype, one_scratch: bool):
    """A fresh KV pool behind the engine's attention backend, and prefill metadata for sequences
    of ``lens`` tokens packed into one step: ``(backend, meta, positions [T])``.

    Fresh per call: the forward writes K/V into the pool in place, and autograd (the refinement)
    needs the pool of one graph untouched until its backward has run. ``one_scratch``: every
    layer shares one K/V pair (the layer-by-layer calibration pass; memory of one layer).
    """
    from llmsys.engine.attention import make_backend
    from llmsys.engine.kv_cache import KVCacheSpec, PlainKVPool

    a = model.args
    dev = model.rope_cache.device
    bs = 16
    tables = _calib_layout(lens, bs)
    spec = KVCacheSpec(num_layers=a.num_hidden_layers, num_blocks=sum(len(t) for t in tables) + 1, block_size=bs,
                       num_kv_heads=a.num_key_value_heads, head_dim=a.head_dim, dtype=dtype)
    attn = make_backend(PlainKVPool(spec, dev, one_scratch=one_scratch), dev, bs)
    pos = torch.cat([torch.arange(n) for n in lens]).to(dev)
    return attn, attn.metadata(lens, lens, tables), pos


def _calib_batch(model: nn.Module, seqs: list[list[int]]):
    """All calibration sequences as one batch: ``(h [T, hidden], run_layer)``.

    ``run_layer(layer, h)`` runs one decoder layer of the model (its own forward, as
    ``DecoderModel.forward`` calls it) on the whole batch and returns the next hidden states.
    Layer by layer (GPTQ and AWQ calibrate layer i on what the quantized layers before it
    produce), so one layer's K/V at a time: each writes its K/V before it attends.
    Sequences of one length (self-generated text, a file's windows) attend side by side
    (:class:`_BatchedAttention`: statistics, not inference; on stories260k's 512 x 128 tokens the
    per-sequence prefill through a paged pool was 5 of GPTQ's 8 s); others as one packed prefill.
    """
    dtype = next(model.parameters()).dtype
    lens = [len(s) for s in seqs]
    if len(set(lens)) == 1:
        b, n = len(seqs), lens[0]
        attn, meta = _BatchedAttention(b), _BatchMeta(b, n, n)
        pos = torch.arange(n, device=model.rope_cache.device).repeat(b)
    else:
        attn, meta, pos = _scratch_pool(model, lens, dtype, one_scratch=True)
    ids = torch.tensor([t for s in seqs for t in s], device=pos.device)

    def run_layer(layer: nn.Module, h: torch.Tensor) -> torch.Tensor:
        y, res = layer(h, None, pos, model.rope_cache, attn, meta)
        return res + y  # the layer's hidden state

    return model.embed(ids), run_layer  # [T, hidden]


def _input_stats(layer: nn.Module, h: torch.Tensor, run_layer, names: tuple[str, ...] | None = None,
                 abs_sum: bool = True):
    """Run ``layer`` on ``h`` once, summing each linear's inputs: ``({name: [X^T X, sum |X|, n]}, output)``.

    ``names``: only these linears (default every ``nn.Linear`` of the layer). ``abs_sum``: also sum ``|X|``
    (AWQ's activation statistic; GPTQ only needs ``X^T X``, and its sum is zeros).
    """
    stats: dict[str, list] = {}
    hooks = []
    seen: list = [None, None]  # (input, its sums): q/k/v and gate/up read one input, summed once

    for name, mod in layer.named_modules():
        if isinstance(mod, nn.Linear) and (names is None or name in names):
            def hook(m, inp, name=name):
                if seen[0] is not inp[0]:
                    x = inp[0].reshape(-1, inp[0].shape[-1]).float()
                    xabs = x.abs().sum(0) if abs_sum else x.new_zeros(x.shape[1])
                    seen[0], seen[1] = inp[0], (x.t() @ x, xabs, x.shape[0])
                xtx, xabs, n = seen[1]
                s = stats.setdefault(name, [torch.zeros_like(xtx), torch.zeros_like(xabs), 0])
                s[0] += xtx
                s[1] += xabs
                s[2] += n
            hooks.append(mod.register_forward_pre_hook(hook))
    try:
        out = run_layer(layer, h)
    finally:
        for hk in hooks:
            hk.remove()
    return stats, out


@torch.inference_mode()
def gptq_calibrate(model: nn.Module, seqs: list[list[int]], spec: QuantSpec, damp: float = 0.01,
                   progress: bool = False, act_order: bool = True, mse: bool = True) -> int:
    """Quantize a float ``model`` in place with GPTQ, layer by layer; returns layers quantized.

    Sequential, as in the GPTQ paper: layer i is calibrated on the inputs
    produced by the already-quantized layers 0..i-1, so later layers learn to
    absorb earlier rounding. Within a layer all linears see the float layer's
    inputs (one pass collects every Hessian), then the quantized layer is
    re-run to produce the next layer's inputs. The LM head (the tied table
    too) is calibrated on the final normed hidden states; an untied embedding
    is round-to-nearest (it has no input to weight the error by).
    """
    from llmsys.engine.models.decode_plan import clear_decode_plan
    from llmsys.quant.calibrate import gptq_quantize
    from llmsys.quant.int4 import Int4Linear

    if spec.method != "int4":
        raise InvalidParameterError(f"--method gptq quantizes int4 weights; got --quant {spec.name} (use --method rtn)")
    clear_decode_plan(model)  # its modules are replaced: the fused decode kernels would read the old weights
    a = model.args
    if a.num_experts:
        # An expert no calibration token is routed to has no Hessian: it would stay float.
        raise InvalidParameterError(f"--method gptq calibrates dense layers; this model's MLPs are mixtures of "
                                    f"{a.num_experts} experts (use --method rtn)")
    h, run_layer = _calib_batch(model, seqs)
    dev, dtype = h.device, h.dtype

    def quantize_module(parent: nn.Module, child: str, lin: nn.Linear, H: torch.Tensor,
                        order: bool = act_order) -> Int4Linear:
        t = gptq_quantize(lin.weight.float(), H, spec.group_size, damp, act_order=order, mse=mse)
        if lin.bias is not None:
            t["bias"] = lin.bias.detach()
        q = Int4Linear.from_quantized({k: v.to(dev) for k, v in t.items()}, in_features=lin.in_features)
        setattr(parent, child, q)
        return q

    for layer in track(model.model.layers, "gptq", progress, unit="layer"):
        stats, _ = _input_stats(layer, h, run_layer, abs_sum=False)
        dense = {}
        for name, (xtx, _, n) in stats.items():
            parent_name, _, child = name.rpartition(".")
            parent = layer.get_submodule(parent_name) if parent_name else layer
            q = quantize_module(parent, child, getattr(parent, child), 2.0 * xtx / n)
            dense[name] = _FixedLinear(q.dequantize(dtype), q.bias)
        with _Swap(layer, dense, {}):  # the next layer's inputs, from the quantized weights
            h = run_layer(layer, h)
    x = model.model.norm(h).float()  # [T, hidden]
    H = 2.0 * (x.t() @ x) / x.shape[0]
    # A tied table also serves embedding lookups, which gather rows fast only without a permutation.
    head = quantize_module(model, "lm_head", model.lm_head, H, act_order and not a.tie_word_embeddings)
    _quantize_embedding(model, head, spec, dtype)
    return len(model.model.layers)


class _FixedLinear(nn.Module):
    """``F.linear(x, weight, bias)`` with a fixed dense weight in the activations' dtype: a quantized layer's
    dequantized weight, while calibration runs a layer over every calibration token.

    Why: the int4 kernel's many-row path costs about twice a float GEMM, a large share of GPTQ's time
    (docs/benchmarks.md). The outputs agree with the int4 layer's to float rounding.
    """

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
        super().__init__()
        self.weight_t, self.bias_t = weight, bias

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [T, K] -> [T, N]
        b = None if self.bias_t is None else self.bias_t.to(x.dtype)
        return F.linear(x, self.weight_t.to(x.dtype), b)


def _quantize_embedding(model: nn.Module, head: nn.Module, spec: QuantSpec, dtype: torch.dtype) -> None:
    """After calibrating the LM head: a tied embedding reads the quantized head, an untied one is RTN."""
    if model.args.tie_word_embeddings:
        model.model.embed_tokens = QuantEmbedding(head, dtype)
    else:
        emb = model.model.embed_tokens.weight.detach()
        model.model.embed_tokens = QuantEmbedding(quantize_linear(emb, None, spec), dtype)


@torch.inference_mode()
def awq_calibrate(model: nn.Module, seqs: list[list[int]], spec: QuantSpec, progress: bool = False,
                  clip: bool = True) -> int:
    """Quantize a float ``model`` in place with AWQ (``llmsys.quant.awq``); returns layers quantized.

    Per decoder layer, one float pass collects ``X^T X`` and ``mean|x|`` per group of linears reading one
    input; each group's scale ``s`` (``quant.awq.search_scale``) multiplies the readers' columns and is
    divided out of the producer: ``input_layernorm`` (q, k, v), ``post_attention_layernorm`` (gate, up),
    ``up_proj``'s rows (down), ``v_proj``'s rows (o, without GQA; with it o_proj keeps ``input_scale``). Then
    every linear is rounded to int4 with AWQ's clip search (not q/k, whose errors attention amplifies); the
    next layer calibrates on the float layer's outputs. The LM head is scaled into the final norm when
    untied, only clip-searched when tied; an untied embedding is round-to-nearest.
    """
    from llmsys.engine.models.decode_plan import clear_decode_plan
    from llmsys.quant.awq import quantize_int4_clipped, search_clip, search_scale
    from llmsys.quant.int4 import Int4Linear

    if spec.method != "int4":
        raise InvalidParameterError(f"--method awq quantizes int4 weights; got --quant {spec.name} (use --method rtn)")
    clear_decode_plan(model)  # its modules and norms are replaced: the fused decode kernels would read the old ones
    a = model.args
    _require_llama_layers(a, "--method awq (its scales fold into q/k/v, gate/up and the (w) norm before each)",
                          "use --method gptq or rtn")
    g = spec.group_size
    h, run_layer = _calib_batch(model, seqs)
    dev, dtype = h.device, h.dtype

    def quantize(parent: nn.Module, child: str, w: torch.Tensor, H: torch.Tensor, bias: torch.Tensor | None,
                 input_scale: torch.Tensor | None = None, search: bool = clip) -> Int4Linear:
        t = quantize_int4_clipped(w, g, search_clip(w, H, g) if search else None)
        if bias is not None:
            t["bias"] = bias.to(dtype)
        if input_scale is not None:
            t["input_scale"] = input_scale
        q = Int4Linear.from_quantized({k: v.to(dev) for k, v in t.items()}, in_features=w.shape[1])
        setattr(parent, child, q)
        return q

    for layer in track(model.model.layers, "awq", progress, unit="layer"):
        mha = layer.self_attn.n_heads == layer.self_attn.n_kv
        # (linears reading one input, where its 1/s goes: a norm, a linear's output rows, or None = input_scale)
        groups = [(("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"), "input_layernorm"),
                  (("self_attn.o_proj",), "self_attn.v_proj" if mha else None),
                  (("mlp.gate_proj", "mlp.up_proj"), "post_attention_layernorm"),
                  (("mlp.down_proj",), "mlp.up_proj")]
        stats, h_next = _input_stats(layer, h, run_layer, tuple(names[0] for names, _ in groups))
        lins = {n: layer.get_submodule(n) for names, _ in groups for n in names}
        w = {n: m.weight.detach().float().clone() for n, m in lins.items()}
        b = {n: None if m.bias is None else m.bias.detach().float().clone() for n, m in lins.items()}
        hs, input_scale = {}, {}
        for names, prev in groups:
            xtx, absum, n = stats[names[0]]
            s, _ = search_scale([w[m] for m in names], absum / n, xtx / n, g)
            for m in names:
                w[m] *= s
                hs[m] = xtx / n / (s[:, None] * s[None, :])  # second moments of the scaled input x / s
            if prev is None:
                input_scale[names[0]] = 1.0 / s
            elif prev in w:  # a linear: its output rows (and bias) carry 1/s
                w[prev] /= s[:, None]
                if b[prev] is not None:
                    b[prev] /= s
            else:
                norm = layer.get_submodule(prev)
                norm.weight.copy_((norm.weight.float() / s).to(norm.weight.dtype))
        for n, m in lins.items():
            parent_name, _, child = n.rpartition(".")
            quantize(layer.get_submodule(parent_name), child, w[n], hs[n], b[n], input_scale.get(n),
                     clip and child not in ("q_proj", "k_proj"))
        h = h_next
    x = model.model.norm(h).float()  # [T, hidden]
    H = x.t() @ x / x.shape[0]
    w_head = model.lm_head.weight.detach().float().clone()
    if not a.tie_word_embeddings:
        s, _ = search_scale([w_head], x.abs().mean(0), H, g)
        w_head *= s
        H = H / (s[:, None] * s[None, :])
        norm = model.model.norm
        norm.weight.copy_((norm.weight.float() / s).to(norm.weight.dtype))
    _quantize_embedding(model, quantize(model, "lm_head", w_head, H, None), spec, dtype)
    return len(model.model.layers)


# ------------------------------------------------------------------ refinement (distillation)

_LINEARS = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
            "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")


@dataclass(frozen=True)
class TuneReport:
    """KL(float || quantized) per token on the calibration sequences, before and after refinement."""

    kl_before: float
    kl_after: float
    steps: int


class _DenseLinear(nn.Module):
    """A differentiable stand-in for a linear layer while refining: ``F.linear(x, weight(), bias)``.

    ``weight`` is called on every forward (a :class:`~llmsys.quant.calibrate.TunableInt4`'s
    ``weight``, so the graph reaches its parameters; or the teacher's fixed float weight).
    """

    def __init__(self, weight, bias: torch.Tensor | None) -> None:
        super().__init__()
        self.weight_fn = weight
        self.bias_f = None if bias is None else bias.float()

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [T, K] -> [T, N] float32
        # Autograd keeps the dense [N, K] weight the matmul needs, not the code/scale temporaries it was
        # built from (~16 bytes per weight: 8 GB on Qwen2.5-0.5B, the difference between refining in
        # 24 GB of RAM and being killed): TunableInt4's weight is one autograd Function that recomputes
        # them in its backward (it replaced torch.utils.checkpoint around the formula, which did the
        # same at three times the ops).
        return F.linear(x.float(), self.weight_fn(), self.bias_f)


class _DenseEmbedding(nn.Module):
    """The token embedding as ``rows(ids)``: the looked-up rows of the tied head's tunable weight (only
    those: the whole [V, hidden] table and its temporaries are 3 GB on a 151,936-token vocabulary), or of a
    fixed table."""

    def __init__(self, rows) -> None:
        super().__init__()
        self.rows_fn = rows

    def forward(self, ids: torch.Tensor) -> torch.Tensor:  # [T] -> [T, hidden] float32
        return self.rows_fn(ids)


class _Swap:
    """Context manager: put ``modules`` (name -> module) and RMSNorm ``weights`` (module name ->
    float32 Parameter) into ``model`` and put the originals back on exit, so the model's own
    forward (``DecoderModel.forward``) runs the refinement's float32, differentiable weights."""

    def __init__(self, model: nn.Module, modules: dict[str, nn.Module], weights: dict[str, nn.Parameter]) -> None:
        self.model, self.modules, self.weights = model, modules, weights
        self.saved_modules: dict[str, nn.Module] = {}
        self.saved_weights: dict[str, nn.Parameter] = {}

    def _owner(self, name: str) -> tuple[nn.Module, str]:
        parent, _, child = name.rpartition(".")
        return (self.model.get_submodule(parent) if parent else self.model), child

    def __enter__(self) -> "_Swap":
        for name, mod in self.modules.items():
            owner, child = self._owner(name)
            self.saved_modules[name] = getattr(owner, child)
            setattr(owner, child, mod)
        for name, w in self.weights.items():
            norm = self.model.get_submodule(name)
            self.saved_weights[name] = norm.weight
            norm.weight = w
        return self

    def __exit__(self, *exc) -> None:
        for name, w in self.saved_weights.items():
            self.model.get_submodule(name).weight = w
        for name, mod in self.saved_modules.items():
            owner, child = self._owner(name)
            setattr(owner, child, mod)


def model_hidden(model: nn.Module, ids: torch.Tensor) -> torch.Tensor:
    """The model's own forward on whole sequences: ``ids [B, L] -> hidden [B*L, hidden]`` (before the head).

    One packed prefill step over a fresh KV pool of float32 (:func:`_scratch_pool`). On the CPU
    with float32 activations every op of the prefill is a torch op (RMSNorm and RoPE run their
    torch references, only bf16 takes the C kernels; attention gathers the pool and runs SDPA per
    sequence), so autograd sees through it, the in-place K/V writes included; the refinement
    swaps the int4 layers for :class:`_DenseLinear` first (:class:`_Swap`).
    """
    b, length = ids.shape
    attn, meta, pos = _scratch_pool(model, [length] * b, torch.float32, one_scratch=False)
    return model(ids.reshape(-1), pos, attn, meta)


class _BatchMeta:
    """The few :class:`~llmsys.engine.attention.AttentionMetadata` fields the model's forward reads, for
    :class:`_BatchedAttention`: ``b`` sequences of ``n`` new tokens each, ``ctx`` tokens of context after
    the step (``n == 1``: a decode step of every sequence)."""

    plan = None  # no gather plan: no decode stack (CpuBackend.decode_pools), each layer runs its own attention
    cold = scores = seq_lens = None

    def __init__(self, b: int, n: int, ctx: int) -> None:
        self.is_decode = n == 1
        self.ctx = ctx
        self.context_lens = [ctx] * b
        self.query_start = list(range(0, b * n + 1, n))


class _BatchedAttention:
    """A training / calibration-only attention backend: ``b`` sequences of equal length side by side,
    their K/V in plain ``[b, Hk, L, D]`` tensors, one batched attention per layer.

    Why not the engine's backend (``engine/attention.py``): its paged pool attends one prompt at a time so a
    sequence's bits never depend on its batch, and autograd through that per-sequence gather made refinement
    steps many times slower (docs/benchmarks.md); a training objective needs no batch invariance.
    Every other op is the model's own, and ``refine_quantized`` checks the two forwards agree on its first
    batch (falling back to ``model_hidden`` if not). ``cache``: the generation mode
    (``self_generated_calibration``): K/V kept in ``[b, Hk, cache, D]`` tensors, one token per row per step.
    """

    def __init__(self, b: int, cache: int = 0) -> None:
        self.b, self.cache = b, cache
        self.k: dict[int, torch.Tensor] = {}
        self.v: dict[int, torch.Tensor] = {}

    def for_step(self, meta):
        return self

    def rope_store(self, layer, q, k, v, positions, rope_cache, meta):
        from llmsys import kernels

        q, k = kernels.rope(q, k, positions, rope_cache)
        self.store(layer, k, v, meta)
        return q

    def store(self, layer, k, v, meta):
        b = self.b
        k = k.view(b, -1, *k.shape[1:]).transpose(1, 2)  # [b, Hk, n, D]
        v = v.view(b, -1, *v.shape[1:]).transpose(1, 2)
        if not self.cache:  # whole sequences: only this layer's K/V (autograd keeps what it needs)
            self.k, self.v = {layer: k}, {layer: v}
            return
        if layer not in self.k:
            shape = (b, k.shape[1], self.cache, k.shape[3])
            self.k[layer], self.v[layer] = k.new_zeros(shape), v.new_zeros(shape)
        start = meta.ctx - k.shape[2]
        self.k[layer][:, :, start:meta.ctx] = k
        self.v[layer][:, :, start:meta.ctx] = v

    def rope_attend(self, layer, qkv, hq, hk, positions, rope_cache, meta, scale, window=None, softcap=None,
                    sinks=None):
        from llmsys.engine.attention import rope_attend_ops

        return rope_attend_ops(self, layer, qkv, hq, hk, positions, rope_cache, meta, scale, window, softcap, sinks)

    def attend(self, layer, q, meta, scale, window=None, softcap=None, sinks=None):  # q [b*n, Hq, D] -> [b*n, Hq, D]
        b, ctx = self.b, meta.ctx
        t, hq, d = q.shape
        n = t // b
        k, v = self.k[layer][:, :, :ctx], self.v[layer][:, :, :ctx]  # [b, Hk, ctx, D]
        hk = k.shape[1]
        plain = softcap is None and sinks is None and (window is None or window >= ctx)
        if n == 1 and plain:
            # A decode row sees every cached key: the g = Hq / Hk query heads of a K/V head as SDPA's
            # query rows (q head h reads K/V head h // g, as transformers' repeat_kv), no mask.
            # (Two matmuls and a softmax: SDPA's kernel took 7 ms a call at b = 512, these 4.)
            s = torch.matmul(q.view(b, hk, hq // hk, d), k.transpose(-1, -2)).mul_(scale)  # [b, Hk, g, ctx]
            return torch.matmul(torch.softmax(s, -1), v).reshape(t, hq, d)
        q = q.view(b, n, hq, d).transpose(1, 2)  # [b, Hq, n, D]
        if plain and n == ctx:  # whole sequences (training, calibration statistics, a prompt)
            o = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale, enable_gqa=hk != hq)
        else:
            k, v = k.repeat_interleave(hq // hk, 1), v.repeat_interleave(hq // hk, 1)
            s = (q @ k.transpose(-1, -2)) * scale  # [b, Hq, n, ctx]
            if softcap is not None:
                s = torch.tanh(s / softcap) * softcap
            qpos = torch.arange(ctx - n, ctx, device=q.device)[:, None]
            kpos = torch.arange(ctx, device=q.device)[None, :]
            keep = kpos <= qpos
            if window is not None:
                keep = keep & (kpos > qpos - window)
            from llmsys.kernels import softmax_with_sinks

            head_sinks = None if sinks is None else sinks.view(hq, 1, 1)  # gpt-oss: a logit per head, no value
            o = softmax_with_sinks(s.masked_fill(~keep, float("-inf")), head_sinks) @ v
        return o.transpose(1, 2).reshape(t, hq, d)


def train_hidden(model: nn.Module, ids: torch.Tensor) -> torch.Tensor:
    """:func:`model_hidden` with batched attention (:class:`_BatchedAttention`): ``ids [B, L] -> [B*L, hidden]``.

    The model's own forward; only attention is the batched training-only one."""
    b, length = ids.shape
    pos = torch.arange(length, device=ids.device).repeat(b)
    return model(ids.reshape(-1), pos, _BatchedAttention(b), _BatchMeta(b, length, length))


def _kl_sum(teacher_logp: torch.Tensor, logits: torch.Tensor) -> torch.Tensor:
    """Summed KL(teacher || student) over the rows: ``[T, V], [T, V] -> []``."""
    lp = torch.log_softmax(logits.float(), dim=-1)
    return (teacher_logp.exp() * (teacher_logp - lp)).sum()


SMALL_MODEL_WEIGHTS = 1 << 20  # refinement of fewer int4 weights than this runs on one thread
TEACHER_CACHE_BYTES = 2 << 30  # keep the teacher's log-probabilities in memory up to this size
LOGIT_CHUNK_BYTES = 256 << 20  # float32 logits per chunk of the distillation loss


def _token_chunks(tokens: int, vocab: int, chunk_bytes: int) -> list[slice]:
    """Row ranges of ``tokens`` rows whose ``[rows, vocab]`` float32 logits fit ``chunk_bytes`` (>= 1 row)."""
    rows = max(1, chunk_bytes // (vocab * 4))
    return [slice(i, min(i + rows, tokens)) for i in range(0, tokens, rows)]


def refine_quantized(model: nn.Module, float_weights: dict[str, torch.Tensor], seqs: list[list[int]],
                     steps: int = DEFAULT_TUNE_STEPS, lr: float = 4e-3, round_lr: float = 0.015, batch: int = 8,
                     seed: int = 0, progress: bool = False, teacher_cache_bytes: int = TEACHER_CACHE_BYTES,
                     logit_chunk_bytes: int = LOGIT_CHUNK_BYTES, report_seqs: int | None = None) -> TuneReport:
    """Refine a GPTQ-quantized ``model`` in place by distilling the float model on ``seqs``.

    Learns, against KL(float || quantized), every int4 layer's scales and one-step code moves
    (:class:`~llmsys.quant.calibrate.TunableInt4`) and the RMSNorm weights; formats and bytes are unchanged.
    The training forward is the model's own with a batched attention (:func:`train_hidden`), checked against
    the engine's forward on the first batch. Defaults (:data:`DEFAULT_TUNE_STEPS` steps of 8 sequences, Adam
    ``lr`` 4e-3, ``round_lr`` 0.015) come from the "quantize-cost" sweep (docs/benchmarks.md).
    ``float_weights``: the teacher's state dict, taken before quantizing. ``teacher_cache_bytes`` and
    ``logit_chunk_bytes`` trade memory for time, never the result beyond float summation order.
    """
    from llmsys.quant.calibrate import TunableInt4
    from llmsys.quant.int4 import Int4Linear

    a = model.args
    _require_llama_layers(a, "refinement (it tunes q/k/v, gate/up and the two (w) norms of each layer)",
                          "quantize it without --refine")
    n_layers = len(model.model.layers)
    tun: dict[str, TunableInt4] = {}
    for i, layer in enumerate(model.model.layers):
        for name in _LINEARS:
            mod = layer.get_submodule(name)
            if not isinstance(mod, Int4Linear):
                raise InvalidParameterError(f"refinement needs int4 layers; model.layers.{i}.{name} is {type(mod).__name__}")
            tun[f"model.layers.{i}.{name}"] = TunableInt4(mod)
    if not isinstance(model.lm_head, Int4Linear):
        raise InvalidParameterError(f"refinement needs an int4 LM head, got {type(model.lm_head).__name__}")
    tun["lm_head"] = TunableInt4(model.lm_head)
    norm_names = ["model.norm"] + [f"model.layers.{i}.{n}" for i in range(n_layers)
                                   for n in ("input_layernorm", "post_attention_layernorm")]
    norms = {n: nn.Parameter(model.get_submodule(n).weight.detach().float().clone()) for n in norm_names}
    # q/k norms (Qwen3) are not learned; float32 copies so the whole forward runs in float32.
    qk_norms = {f"model.layers.{i}.self_attn.{n}": nn.Parameter(
                    layer.self_attn.get_submodule(n).weight.detach().float().clone(), requires_grad=False)
                for i, layer in enumerate(model.model.layers) if layer.self_attn.q_norm is not None
                for n in ("q_norm", "k_norm")}
    teacher = {n: float_weights[n + ".weight"].float() for n in [*tun, *norm_names] if n != "lm_head"}
    teacher["lm_head"] = float_weights.get("lm_head.weight", float_weights["model.embed_tokens.weight"]).float()
    t_embed = float_weights["model.embed_tokens.weight"].float()
    t_norms = {n: nn.Parameter(teacher.pop(n), requires_grad=False) for n in norm_names}
    emb = model.model.embed_tokens
    fixed_embed = None if a.tie_word_embeddings else emb.table.dequantize().float() if hasattr(emb, "table") else emb.weight.float()
    # The model's own forward twice over: with the float teacher's weights, and with the student's
    # (each int4 layer's differentiable weight; a tied embedding reads the tunable head).
    teacher_swap = _Swap(model, {**{n: _DenseLinear(lambda w=teacher[n]: w, tun[n].lin.bias) for n in tun},
                                 EMBED: _DenseEmbedding(lambda ids: t_embed[ids])}, {**t_norms, **qk_norms})
    student_swap = _Swap(model, {**{n: _DenseLinear(tv.weight, tv.lin.bias) for n, tv in tun.items()},
                                 EMBED: _DenseEmbedding(tun["lm_head"].weight_rows if fixed_embed is None
                                                        else lambda ids: fixed_embed[ids])}, {**norms, **qk_norms})

    length = min(len(s) for s in seqs)
    data = torch.tensor([s[:length] for s in seqs], device=t_embed.device)  # [S, L]
    # The batched training forward where it agrees with the engine's on the teacher (it does, to float
    # rounding, unless a model needs something _BatchedAttention does not know).
    with torch.no_grad(), teacher_swap:
        probe = data[:2]
        want, got = model_hidden(model, probe), train_hidden(model, probe)
    hidden = train_hidden if torch.allclose(got, want, rtol=1e-4, atol=1e-4 * float(want.abs().max())) else model_hidden

    def teacher_logp_run(rows: torch.Tensor) -> Callable[[slice], torch.Tensor]:
        """The teacher's log-probabilities of ``data[rows]``, a chunk of tokens at a time: ``slice -> [t, V]``."""
        with torch.no_grad(), teacher_swap:  # nests inside student_swap: its exit puts the student back
            h_t = hidden(model, data[rows])  # [b*L, hidden]

        def chunk(c: slice) -> torch.Tensor:
            with torch.no_grad(), teacher_swap:
                return torch.log_softmax(model.compute_logits(h_t[c]).float(), -1)

        return chunk

    # The teacher's log-probabilities of every calibration token, kept when they fit (stories260k: 512 x 128 x
    # 512 floats, 128 MiB); a real vocabulary does not (Qwen2.5, 151,936 tokens: 40 GB), so there the teacher
    # runs again for each batch: the same numbers, one more forward per step.
    rows_all = torch.arange(len(data), device=data.device)
    # Passes without gradients (the teacher, the KL report) take more rows at a time, up to one chunk of
    # logits: fewer, larger ops (the same numbers, to float rounding).
    eval_batch = max(batch, min(64, len(data), logit_chunk_bytes // max(1, length * a.vocab_size * 4)))
    cached = None
    if data.numel() * a.vocab_size * 4 <= teacher_cache_bytes:
        cached = torch.empty(data.numel(), a.vocab_size)  # [S*L, V]
        for j in range(0, len(data), eval_batch):
            run = teacher_logp_run(rows_all[j:j + eval_batch])
            for c in _token_chunks(len(rows_all[j:j + eval_batch]) * length, a.vocab_size, logit_chunk_bytes):
                cached[j * length + c.start: j * length + c.stop] = run(c)

    def teacher_logp(rows: torch.Tensor) -> Callable[[slice], torch.Tensor]:
        if cached is None:
            return teacher_logp_run(rows)
        flat = cached.view(len(data), length, -1)[rows].view(len(rows) * length, -1)  # [b*L, V]
        return lambda c: flat[c]

    def batch_kl(rows: torch.Tensor, train: bool) -> float:
        """Mean KL per token over ``data[rows]``; with ``train``, its gradients accumulated too.

        The loss goes a chunk of tokens at a time through the head (its [T, V] logits are the largest
        tensors here: 8 x 128 x 151,936 floats, 622 MB, several times over in autograd): each chunk's
        backward runs at once into the hidden states' gradient, and the decoder's backward runs once
        at the end from it, so the peak holds one chunk's logits.
        """
        teacher = teacher_logp(rows)
        h = hidden(model, data[rows])  # [b*L, hidden]
        tokens = h.shape[0]
        h_in = h.detach().requires_grad_(train)
        total = 0.0
        for c in _token_chunks(tokens, a.vocab_size, logit_chunk_bytes):
            loss = _kl_sum(teacher(c), model.compute_logits(h_in[c])) / tokens
            if train:
                loss.backward()
            total += loss.item()
        if train:
            h.backward(h_in.grad)
        return total

    # The report's KL on the first report_seqs sequences (all of them by default; llmsys quantize: 64 of 512,
    # two passes of 1 s each instead of 8 s on stories260k).
    shown = rows_all[: report_seqs or len(data)]

    def full_kl() -> float:
        with torch.no_grad(), student_swap:
            return sum(batch_kl(shown[j:j + eval_batch], train=False) * len(shown[j:j + eval_batch])
                       for j in range(0, len(shown), eval_batch)) / len(shown)

    # A small model's ops are too small to split: on stories260k 40 steps took 8.1 s wall / 14.1 s CPU on 2
    # threads and 8.4 s / 8.4 s on one (Zen 3), and 2 threads with the other core busy ran 1.5x slower.
    threads = torch.get_num_threads()
    if sum(tv.n * tv.k for tv in tun.values()) < SMALL_MODEL_WEIGHTS:
        torch.set_num_threads(1)
    try:
        before, after = _refine_loop(full_kl, batch_kl, tun, norms, data, steps, lr, round_lr, batch, seed,
                                     progress, student_swap)
    finally:
        torch.set_num_threads(threads)
    with torch.no_grad():
        for name, tv in tun.items():
            parent, _, child = name.rpartition(".")
            setattr(model.get_submodule(parent) if parent else model, child, tv.to_linear())
        for n, w in norms.items():
            model.get_submodule(n).weight.copy_(w)
        if a.tie_word_embeddings:
            model.model.embed_tokens = QuantEmbedding(model.lm_head, emb.out_dtype)
    return TuneReport(before, after, steps)


def _refine_loop(full_kl, batch_kl, tun, norms, data, steps, lr, round_lr, batch, seed, progress, student_swap):
    """:func:`refine_quantized`'s optimization: ``(KL before, KL after)``."""
    from llmsys.quant.calibrate import round_steps

    before = full_kl()
    opt = _Adam([tv.log_s for tv in tun.values()] + list(norms.values()))
    rounders = list(tun.values())
    gen = torch.Generator().manual_seed(seed)
    with torch.enable_grad(), student_swap, bar(steps, "refine", progress, unit="step") as b:
        for step in range(steps):
            idx = torch.randperm(len(data), generator=gen)[:batch].to(data.device)
            loss = batch_kl(idx, train=True)
            decay = 1.0 - step / steps  # linear decay: large moves early, settle at the end
            opt.step(lr * decay)
            round_steps(rounders, round_lr * decay)
            b.update()
            if step % 20 == 0:
                b.set_postfix(kl=f"{loss:.4f}", refresh=False)
    return before, full_kl()


class _Adam:
    """Adam over a list of tensors: torch.optim.Adam(fused=True)'s update (betas 0.9 / 0.999, eps 1e-8, the
    same aten kernel), taking the learning rate per step; gradients are cleared after each step.

    Why not torch.optim.Adam: building one imports torch._dynamo (seconds), longer than a small model's
    whole refinement.
    """

    def __init__(self, params: list[torch.Tensor]) -> None:
        self.params = params
        self.exp_avg = [torch.zeros_like(p) for p in params]
        self.exp_avg_sq = [torch.zeros_like(p) for p in params]
        self.steps = [torch.zeros((), dtype=torch.float32) for _ in params]

    @torch.no_grad()
    def step(self, lr: float) -> None:
        live = [i for i, p in enumerate(self.params) if p.grad is not None]
        if not live:
            return
        steps = [self.steps[i] for i in live]
        torch._foreach_add_(steps, 1)
        torch._fused_adam_([self.params[i] for i in live], [self.params[i].grad for i in live],
                           [self.exp_avg[i] for i in live], [self.exp_avg_sq[i] for i in live], [], steps,
                           lr=lr, beta1=0.9, beta2=0.999, weight_decay=0.0, eps=1e-8, amsgrad=False,
                           maximize=False)
        for i in live:
            self.params[i].grad = None


GEN_BATCH_BYTES = 256 << 20  # self-generated calibration text: K/V and logits of the rows sampled together


def self_generated_calibration(llm, n: int, length: int, seed: int = 0, progress: bool = False) -> list[list[int]]:
    """Calibration sequences the float model writes itself (temperature 1 from BOS).

    Why: in-distribution for the model, and by construction disjoint from any
    evaluation text (the tinystories-valid.txt perplexity rows).

    How: every sequence side by side through the model's own forward with :class:`_BatchedAttention`
    and one draw per step for all rows from one generator seeded by ``seed`` (:func:`_sample_batched`).
    Why not ``llm.generate``: its per-sequence scheduling, sampler and detokenizing cost ~28x more for
    hundreds of equal-length rows that need none of it; the text is a different draw from the same
    distribution. A model whose layers stream from disk (an offload plan) still goes through the engine.
    """
    from llmsys.engine.sampling import SamplingParams

    bos = llm.tokenizer.bos_token_id
    start = [bos] if bos is not None else llm.encode(" ")
    if llm.offload is None and len(start) < length:
        return _sample_batched(llm.loaded.model, n, length, start, seed, progress)
    params = [SamplingParams(max_tokens=length - len(start), temperature=1.0, seed=seed + i, ignore_eos=True)
              for i in range(n)]
    # In rounds of the engine's batch (what it decodes together anyway), so the bar moves; each sequence's
    # seed fixes its text whatever the round.
    chunk = llm.config.max_num_seqs
    outs = []
    with bar(n, "calibration text", progress, unit="seq") as b:
        for j in range(0, n, chunk):
            outs += llm.generate([list(start) for _ in params[j:j + chunk]], params[j:j + chunk])
            b.update(len(params[j:j + chunk]))
    return [list(start) + o.token_ids for o in outs]


@torch.inference_mode()
def _sample_batched(model: nn.Module, n: int, length: int, start: list[int], seed: int, progress: bool,
                    batch_bytes: int = GEN_BATCH_BYTES) -> list[list[int]]:
    """``n`` sequences of ``length`` tokens sampled at temperature 1 after ``start``, as many rows at a time
    as ``batch_bytes`` of K/V and logits allow (all 512 of stories260k; ~70 of Qwen2.5-0.5B)."""
    a = model.args
    dev = model.rope_cache.device
    item = next(model.parameters()).element_size()
    per_row = a.num_hidden_layers * 2 * a.num_key_value_heads * a.head_dim * length * item + a.vocab_size * 8
    rows = max(1, min(n, batch_bytes // per_row))
    gen = torch.Generator(device=dev).manual_seed(seed)
    s = len(start)
    out: list[list[int]] = []
    with bar(n, "calibration text", progress, unit="seq") as pb:
        for j in range(0, n, rows):
            b = min(rows, n - j)
            attn = _BatchedAttention(b, cache=length)
            toks = torch.tensor(start, device=dev).repeat(b, 1)  # [b, s]
            h = model(toks.reshape(-1), torch.arange(s, device=dev).repeat(b), attn, _BatchMeta(b, s, s))
            h = h.view(b, s, -1)[:, -1]  # [b, hidden]
            picked = [toks]
            for ctx in range(s, length):
                probs = torch.softmax(model.compute_logits(h).float(), -1)  # [b, V]
                # a draw from probs: argmax of p / Exp(1) (one pass; torch.multinomial took 8 ms a step at b = 512)
                nxt = (probs / torch.empty_like(probs).exponential_(generator=gen)).argmax(-1, keepdim=True)  # [b, 1]
                picked.append(nxt)
                if ctx + 1 < length:
                    h = model(nxt.reshape(-1), torch.full((b,), ctx, device=dev), attn, _BatchMeta(b, 1, ctx + 1))
            out += torch.cat(picked, 1).tolist()
            pb.update(b)
    return out


def file_calibration(llm, path: str, n: int, length: int) -> list[list[int]]:
    """``n`` windows of ``length`` tokens from a text file (BOS first when the model has one)."""
    from pathlib import Path

    from llmsys.kernels.common.errors import ModelNotFoundError

    p = Path(path)
    if not p.is_file():
        raise ModelNotFoundError(f"no such calibration text file: {p}")
    ids = llm.tokenizer.encode(p.read_text(encoding="utf-8", errors="replace"), add_special_tokens=False)
    bos = llm.tokenizer.bos_token_id
    body = length - (1 if bos is not None else 0)
    seqs = [([bos] if bos is not None else []) + ids[i : i + body] for i in range(0, len(ids) - body + 1, body)]
    if not seqs:
        raise InvalidParameterError(f"{p} has fewer than {length} tokens; give a longer calibration text")
    return seqs[:n]


def format_memory(report) -> str:
    """One line from a :class:`~llmsys.engine.core.MemoryReport`: bytes per tier and kind."""
    def tiers(d: dict[str, int]) -> str:
        return ", ".join(f"{t} {n:,} B" for t, n in sorted(d.items())) or "0 B"

    swap = (f" | KV swap {tiers(report.kv_swap_total)} ({tiers(report.kv_swap_used)} in use)"
            if report.kv_swap_total else "")
    return (f"memory: weights {tiers(report.weights)} | KV pool {tiers(report.kv_total)} "
            f"({report.kv_blocks_total} blocks x {report.block_size} tokens, {tiers(report.kv_used)} in use){swap}")
