"""Load-time weight quantization: the ``make_linear`` hook the loader calls.

The loader (``engine/loader/common.materialize``) reads one checkpoint tensor
at a time and hands every linear weight (and the token embedding) to this
hook, which returns the quantized module; the float tensor is dropped right
after, so peak memory is the quantized model plus one float tensor, never the
full-precision model.

What gets quantized (the ``--quant`` format applies to all of them):

* every ``nn.Linear`` of the decoder layers;
* the token embedding (a :class:`~llmsys.quant.embedding.QuantEmbedding`
  that dequantizes only the looked-up rows) and the LM head. With tied
  embeddings the one quantized table serves both. Why: on the Qwen2.5-0.5B
  shape the 151936 x 896 table is 28% of the weights; keeping it in bf16 would
  leave int4 at ~0.48x of bf16 (target <= 0.30x) and the LM head — the
  biggest single matmul of a decode step — on the slow dense path.
  ``keep_float=("lm_head", "model.embed_tokens")`` opts out.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass, field

import torch
from torch import nn

from llmsys.engine.errors import InvalidParameterError
from llmsys.quant import QuantSpec, parse_quant, quantize_linear
from llmsys.quant.embedding import QuantEmbedding
from llmsys.quant.int4 import cpu_int4_available
from llmsys.quant.int8_fp8 import fp8_gemm_supported

EMBED = "model.embed_tokens"

# Formats accepted by --quant, for error messages.
QUANT_NAMES = ("none", "int8", "int4", "int4:g32", "int4:g64", "int4:g128", "nf4", "nf4:dq", "fp8")


def parse_quant_flag(text: str | None) -> QuantSpec:
    """``--quant`` -> QuantSpec; unknown names list the valid ones."""
    try:
        return parse_quant(text)
    except InvalidParameterError:
        raise InvalidParameterError(
            f"unknown --quant {text!r}; valid: {', '.join(QUANT_NAMES)}"
        ) from None


def fallback_notice(spec: QuantSpec, device: torch.device) -> str | None:
    """One line when ``spec`` cannot use its fast kernel on ``device`` (it still runs)."""
    if spec.method == "fp8" and not fp8_gemm_supported(device):
        where = "this GPU" if device.type == "cuda" else "the CPU"
        return (f"notice: fp8 matmul needs a GPU with FP8 tensor cores (sm >= 8.9); on {where} fp8 weights "
                "are dequantized per layer and multiplied in the model dtype (same results, slower)")
    if spec.method == "int4" and device.type == "cpu" and not cpu_int4_available():
        return "notice: this torch build lacks the CPU int4 matmul ops; int4 layers dequantize per call (slower)"
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


def make_weight_quantizer(quant: str | None, device: torch.device, dtype: torch.dtype,
                          keep_float: tuple[str, ...] = ()) -> WeightQuantizer | None:
    """The loader hook for ``--quant`` (None for float models)."""
    spec = parse_quant_flag(quant)
    if spec.method == "none":
        return None
    return WeightQuantizer(spec, device, dtype, keep_float)


KV_DTYPE_NAMES = ("auto", "int8", "int4")


def parse_kv_dtype(text: str | None, head_dim: int | None = None) -> str:
    """``--kv-dtype`` -> "auto" | "int8" | "int4"; unknown names list the valid ones."""
    raw = "auto" if text is None else str(text).strip().lower()
    if raw in ("", "none", "float", "model"):
        raw = "auto"
    if raw not in KV_DTYPE_NAMES:
        raise InvalidParameterError(f"unknown --kv-dtype {text!r}; valid: {', '.join(KV_DTYPE_NAMES)}")
    if raw == "int4" and head_dim is not None and head_dim % 2:
        raise InvalidParameterError(f"--kv-dtype int4 needs an even head_dim (this model has {head_dim}); use int8")
    return raw


def loader_quantizer(config) -> WeightQuantizer | None:
    """The ``make_linear`` hook for an :class:`~llmsys.engine.config.EngineConfig`."""
    from llmsys.engine.loader.common import resolve_device, resolve_dtype

    spec = parse_quant_flag(config.quant)
    if spec.method == "none":
        return None
    dev = resolve_device(config.device)
    extra = getattr(config, "extra", None) or {}
    keep = tuple(extra.get("quant_keep_float", ()))
    return WeightQuantizer(spec, dev, resolve_dtype(config.dtype, dev), keep)


# ------------------------------------------------------------------ calibration (GPTQ)


def _calib_layout(lens: list[int], block_size: int) -> list[list[int]]:
    tables, nxt = [], 1  # block 0 is the scratch block
    for n in lens:
        nb = -(-n // block_size)
        tables.append(list(range(nxt, nxt + nb)))
        nxt += nb
    return tables


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
    from llmsys.engine.attention import build_metadata
    from llmsys.quant.calibrate import gptq_quantize, hessian_from_inputs  # noqa: F401 - documents the method
    from llmsys.quant.int4 import Int4Linear

    if spec.method != "int4":
        raise InvalidParameterError(f"--method gptq quantizes int4 weights; got --quant {spec.name} (use --method rtn)")
    a = model.args
    dev = next(model.parameters()).device
    dtype = next(model.parameters()).dtype
    bs = 16
    lens = [len(s) for s in seqs]
    tables = _calib_layout(lens, bs)
    nblocks = sum(len(t) for t in tables) + 1
    kc = torch.zeros((nblocks, bs, a.num_key_value_heads, a.head_dim), dtype=dtype, device=dev)
    vc = torch.zeros_like(kc)
    meta = build_metadata(lens, lens, tables, bs, dev)
    ids = torch.tensor([t for s in seqs for t in s], device=dev)
    pos = torch.cat([torch.arange(n) for n in lens]).to(dev)
    h = model.model.embed_tokens(ids)  # [T, hidden]

    def quantize_module(parent: nn.Module, child: str, lin: nn.Linear, H: torch.Tensor,
                        order: bool = act_order) -> Int4Linear:
        t = gptq_quantize(lin.weight.float(), H, spec.group_size, damp, act_order=order, mse=mse)
        if lin.bias is not None:
            t["bias"] = lin.bias.detach()
        q = Int4Linear.from_quantized({k: v.to(dev) for k, v in t.items()}, in_features=lin.in_features)
        setattr(parent, child, q)
        return q

    for i, layer in enumerate(model.model.layers):
        stats: dict[str, list] = {}
        hooks = []
        for name, mod in layer.named_modules():
            if isinstance(mod, nn.Linear):
                def hook(m, inp, name=name):
                    x = inp[0].reshape(-1, inp[0].shape[-1]).float()
                    s = stats.setdefault(name, [torch.zeros(x.shape[1], x.shape[1], device=dev), 0])
                    s[0] += x.t() @ x
                    s[1] += x.shape[0]
                hooks.append(mod.register_forward_pre_hook(hook))
        layer(h, pos, model.rope_cache, kc, vc, meta)
        for hk in hooks:
            hk.remove()
        for name, (xtx, n) in stats.items():
            parent_name, _, child = name.rpartition(".")
            parent = layer.get_submodule(parent_name) if parent_name else layer
            quantize_module(parent, child, getattr(parent, child), 2.0 * xtx / n)
        h = layer(h, pos, model.rope_cache, kc, vc, meta)
        if progress:
            print(f"gptq: layer {i + 1}/{len(model.model.layers)}", file=sys.stderr)
    x = model.model.norm(h).float()  # [T, hidden]
    H = 2.0 * (x.t() @ x) / x.shape[0]
    # A tied table also serves embedding lookups, which gather rows fast only without a permutation.
    head = quantize_module(model, "lm_head", model.lm_head, H, act_order and not a.tie_word_embeddings)
    emb = model.model.embed_tokens
    if a.tie_word_embeddings:
        model.model.embed_tokens = QuantEmbedding(head, dtype)
    else:
        model.model.embed_tokens = QuantEmbedding(quantize_linear(emb.weight.detach(), None, spec), dtype)
    return len(model.model.layers)


def self_generated_calibration(llm, n: int, length: int, seed: int = 0) -> list[list[int]]:
    """Calibration sequences the float model writes itself (temperature 1 from BOS).

    Why: in-distribution for the model, and by construction disjoint from any
    evaluation text (the tinystories-valid.txt perplexity rows).
    """
    from llmsys.engine.sampling import SamplingParams

    bos = llm.tokenizer.bos_token_id
    start = [bos] if bos is not None else llm.encode(" ")
    params = [SamplingParams(max_tokens=length - len(start), temperature=1.0, seed=seed + i, ignore_eos=True)
              for i in range(n)]
    outs = llm.generate([list(start) for _ in range(n)], params)
    return [list(start) + o.token_ids for o in outs]


def file_calibration(llm, path: str, n: int, length: int) -> list[list[int]]:
    """``n`` windows of ``length`` tokens from a text file (BOS first when the model has one)."""
    from pathlib import Path

    from llmsys.engine.errors import ModelNotFoundError

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

    return (f"memory: weights {tiers(report.weights)} | KV pool {tiers(report.kv_total)} "
            f"({report.kv_blocks_total} blocks x {report.block_size} tokens, {tiers(report.kv_used)} in use)")
