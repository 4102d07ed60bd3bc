"""GGUF files of a Hugging Face safetensors folder, so ``--vs llama.cpp`` runs llama.cpp on the same weights.

f32/f16 are written here with the ``gguf`` package; q8_0, q4_0 and q4_K_M come from that file through
llama.cpp's own quantizer (``llama_cpp.llama_model_quantize``), so the baseline runs its real formats.
Exported: ``llama`` (SmolLM2, Llama 3.x) and ``mistral`` as ``llama``, ``qwen2``, ``qwen3``, ``qwen3_moe``
as ``qwen3moe`` and ``gpt_oss`` as ``gpt-oss`` (experts stacked into ``ffn_{gate,up,down}_exps``, their
biases likewise, as plain float tensors llama.cpp's quantizer takes; gpt-oss's fused or MXFP4 experts are read
through the loader's per-expert views); tied embeddings once. Tensor names are the GGUF reader's
(``gguf_io.stored_name``), so the two directions cannot disagree. llama.cpp's ``llama`` rotates adjacent
pairs, so q/k rows are reordered from rotate-half (:func:`hf_to_interleaved`; the others stay NEOX).
llama.cpp's gpt-oss always rounds YaRN's correction range out to whole dimensions (a checkpoint's
``truncate: false`` cannot be written), so on such a config its RoPE differs from transformers' in the one
or two dimensions at the range's ends. A SentencePiece-style ``tokenizer.json`` becomes a real SPM
vocabulary; any other gets ``<tok_N>`` placeholders (benches feed ids). Cached under
``$LLMSYS_HOME/gguf/<folder>-<key>/``, the key hashing the folder's path, config, tokenizer and each shard's
name, size and mtime.
"""

from __future__ import annotations

import contextlib
import ctypes
import hashlib
import json
import logging
import os
import re
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import TYPE_CHECKING, Iterator

import numpy as np
import torch

from llmsys.engine.loader import gguf_io
from llmsys.engine.loader.gguf_io import hf_to_interleaved
from llmsys.engine.models.base import TransformerArgs
from llmsys.kernels.common.errors import CheckpointError, InvalidParameterError, LLMSysError, UnsupportedModelError

if TYPE_CHECKING:  # imported where used: only the export needs it
    import gguf

FLOAT_FORMATS = ("f32", "f16")
QUANT_FORMATS = ("q8_0", "q4_0", "q4_K_M")
GGUF_FORMATS = FLOAT_FORMATS + QUANT_FORMATS
# llama.cpp's ftype constant per quantized format (names in llama_cpp).
_FTYPES = {"q8_0": "LLAMA_FTYPE_MOSTLY_Q8_0", "q4_0": "LLAMA_FTYPE_MOSTLY_Q4_0", "q4_K_M": "LLAMA_FTYPE_MOSTLY_Q4_K_M"}
# HF model_type -> (llama.cpp architecture, q/k rows reordered for interleaved RoPE)
_ARCHS = {"llama": ("llama", True), "mistral": ("llama", True), "qwen2": ("qwen2", False), "qwen3": ("qwen3", False),
          "qwen3_moe": ("qwen3moe", False), "gpt_oss": ("gpt-oss", False)}
# Experts as a checkpoint may store them (fused, MXFP4, Mixtral's or gpt-oss's router names): written through
# the loader's per-expert views of them instead.
_FUSED_EXPERTS = re.compile(r"\.mlp\.experts\.(gate_up|down)_proj(_bias|_blocks|_scales)?$|\.block_sparse_moe\."
                            r"|\.mlp\.router\.")
# One expert's matrix or bias: stacked over the experts ([E, rows, cols] / [E, rows]) into the layer's *_exps.
_EXPERT = re.compile(r"^model\.layers\.\d+\.mlp\.experts\.(\d+)\.(gate|up|down)_proj\.(weight|bias)$")
# llama.cpp's gpt-oss hard-codes the clamped SwiGLU's constants (alpha, limit).
_GPT_OSS_SWIGLU = (1.702, 7.0)
_EXPORT_VERSION = 2  # part of the cache key: bump when the written bytes change
_INSTALL = 'pip install -e ".[llamacpp]" (builds llama.cpp, ~15 min)'

@dataclass(frozen=True)
class GGUFSource:
    """What the exporter reads from a folder: the config, the llama.cpp architecture, the layout."""

    folder: Path
    args: TransformerArgs  # the family's reading of config.json (head counts, rope, eps, tying)
    arch: str  # llama.cpp's architecture: "llama", "qwen2", "qwen3", "qwen3moe" or "gpt-oss"
    interleave_qk: bool  # reorder q/k rows for llama.cpp's interleaved RoPE


def open_source(folder: str | Path) -> GGUFSource:
    """Read config.json and pick the llama.cpp architecture, or fail naming what is handled."""
    from llmsys.engine.loader.common import read_json
    from llmsys.engine.models import family_for

    folder = Path(folder)
    if not (folder / "config.json").exists() or not any(folder.glob("*.safetensors")):
        raise UnsupportedModelError(f"{folder}: --vs llama.cpp needs a Hugging Face safetensors folder (config.json)")
    cfg = read_json(folder / "config.json")
    mt = cfg.get("model_type")
    if mt not in _ARCHS:
        raise UnsupportedModelError(
            f"{folder}: the GGUF export for llama.cpp handles model_type {', '.join(_ARCHS)}, not {mt!r}"
        )
    args = family_for(cfg).ModelArgs.from_hf_config(cfg)
    rope_type = (args.rope_scaling or {}).get("rope_type", (args.rope_scaling or {}).get("type", "default"))
    if (rope_type not in ("default", "linear", "llama3", "yarn") or (rope_type == "llama3" and mt in ("qwen2", "qwen3"))
            or (rope_type == "yarn" and mt != "gpt_oss")):
        raise UnsupportedModelError(f"{folder}: the GGUF export does not handle rope scaling {rope_type!r} for {mt}")
    arch, interleave = _ARCHS[mt]
    if mt == "gpt_oss" and ((args.swiglu_alpha, args.swiglu_limit) != _GPT_OSS_SWIGLU or not args.o_proj_bias):
        raise UnsupportedModelError(
            f"{folder}: llama.cpp's gpt-oss has attention biases and a clamped SwiGLU of alpha {_GPT_OSS_SWIGLU[0]}, "
            f"limit {_GPT_OSS_SWIGLU[1]}; this config has attention_bias {args.o_proj_bias}, swiglu_alpha "
            f"{args.swiglu_alpha}, swiglu_limit {args.swiglu_limit}")
    if arch == "qwen3moe" and (not args.norm_topk_prob or args.sparse_layers is not None
                               and len(args.sparse_layers) != args.num_hidden_layers):
        # llama.cpp's qwen3moe renormalises the top-k weights and has an MoE block in every layer.
        raise UnsupportedModelError(f"{folder}: the GGUF export handles {mt} with norm_topk_prob true and every "
                                    "layer sparse (no mlp_only_layers / decoder_sparse_step), as llama.cpp reads it")
    return GGUFSource(folder, args, arch, interleave)


def gguf_name(hf_name: str, arch: str = "llama") -> str | None:
    """llama.cpp's name for an HF tensor name in a file of architecture ``arch`` (the GGUF reader's tables,
    ``gguf_io.stored_name``); None for a tensor llama.cpp does not read (RoPE buffers).

    An expert's matrix or bias maps to its layer's stacked tensor (``blk.N.ffn_gate_exps.weight``: every
    expert's gate rows, :func:`_plan`), the router to ``blk.N.ffn_gate_inp.weight`` (and ``.bias``).
    """
    if hf_name.endswith("rotary_emb.inv_freq"):
        return None
    g = gguf_io.stored_name(hf_name, arch)
    if g is None:
        raise UnsupportedModelError(f"tensor {hf_name!r} has no llama.cpp counterpart in the GGUF export")
    return g


def _source_key(src: GGUFSource) -> str:
    h = hashlib.sha256(f"v{_EXPORT_VERSION}|{src.folder.resolve()}|".encode())
    for meta in ("config.json", "tokenizer.json"):  # shapes, and the vocabulary written
        if (src.folder / meta).exists():
            h.update((src.folder / meta).read_bytes())
    for p in sorted(src.folder.glob("*.safetensors")):
        st = p.stat()
        h.update(f"|{p.name}:{st.st_size}:{st.st_mtime_ns}".encode())
    return f"{src.folder.name}-{h.hexdigest()[:16]}"


def cache_path(folder: str | Path, fmt: str) -> Path:
    """Where the ``fmt`` GGUF of ``folder`` lives (written or not)."""
    from llmsys.kernels.common.paths import llmsys_home

    _check_format(fmt)
    return llmsys_home() / "gguf" / _source_key(open_source(folder)) / f"{fmt}.gguf"


def _check_format(fmt: str) -> None:
    if fmt not in GGUF_FORMATS:
        raise InvalidParameterError(f"GGUF format {fmt!r}: choose one of {', '.join(GGUF_FORMATS)}")


def gguf_file(folder: str | Path, fmt: str, threads: int | None = None) -> Path:
    """The cached ``fmt`` GGUF of ``folder``, written first if missing.

    Quantized formats are made from the f16 file (f32 when the checkpoint is
    float32), itself cached, by llama.cpp's quantizer on ``threads`` threads.
    """
    out = cache_path(folder, fmt)
    if out.exists():
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    if fmt in FLOAT_FORMATS:
        export_float(folder, out, fmt)
    else:
        base = "f32" if _stored_dtype(folder) == torch.float32 else "f16"
        quantize(gguf_file(folder, base, threads), out, fmt, threads)
    return out


def _stored_dtype(folder: str | Path) -> torch.dtype:
    """The dtype the checkpoint's embedding is stored in (what the quantizer's input keeps)."""
    from llmsys.engine.loader.safetensors_io import CheckpointIndex

    return CheckpointIndex.open_dir(Path(folder)).info("model.embed_tokens.weight").dtype


# --------------------------------------------------------------------------
# Writing the float file
# --------------------------------------------------------------------------


def export_float(folder: str | Path, out: Path, fmt: str = "f32", matrices: str | None = None) -> Path:
    """Write ``folder`` as a GGUF of ``fmt`` (f32, or f16 with 1-D tensors kept f32) at ``out``.

    ``matrices`` (a gguf block type, e.g. ``"Q8_0"``, ``"Q4_0"``): every 2-D tensor whose rows
    are whole blocks is quantized to it by the ``gguf`` package's own quantizer (no llama.cpp
    needed; a file made of llama.cpp's formats for readers' tests), the others kept in ``fmt``.
    Tensors are streamed one at a time (the header and tensor table first),
    so peak memory is one tensor, not the model.
    """
    import gguf

    from llmsys.engine.loader.safetensors_io import CheckpointIndex

    if fmt not in FLOAT_FORMATS:
        raise InvalidParameterError(f"export_float: {fmt!r} is not one of {', '.join(FLOAT_FORMATS)}")
    qtype = None if matrices is None else gguf.GGMLQuantizationType[matrices]
    src = open_source(folder)
    a = src.args
    index = CheckpointIndex.open_dir(src.folder)
    plan = _plan(src, index)
    if "token_embd.weight" not in {g for _, g in plan}:
        raise CheckpointError(f"{src.folder}: no model.embed_tokens.weight in the safetensors files")
    extra = _rope_freqs(a) if src.arch == "llama" else None  # [head_dim/2] float32 or None

    tmp = out.with_name(out.name + f".tmp{os.getpid()}")
    w = gguf.GGUFWriter(str(tmp), src.arch)
    _write_metadata(w, src, fmt)

    def quantized(g: str, shape: tuple[int, ...]) -> bool:  # a matrix, never a stack of experts' biases
        return (qtype is not None and len(shape) == 2 and g.endswith(".weight")
                and shape[1] % gguf.GGML_QUANT_SIZES[qtype][0] == 0)

    def target(g: str, shape: tuple[int, ...]) -> torch.dtype:
        # Matrices (and stacked experts) in the file's format; norms and biases (stacked experts' too) f32, as
        # llama.cpp wants them.
        return torch.float16 if fmt == "f16" and len(shape) >= 2 and g.endswith(".weight") else torch.float32

    for names, g in plan:
        shape = _stacked_shape(index, names)
        if quantized(g, shape):
            block, size = gguf.GGML_QUANT_SIZES[qtype]
            w.add_tensor_info(g, shape, np.dtype(np.float32), shape[0] * shape[1] // block * size, raw_dtype=qtype)
            continue
        dt = np.dtype(np.float16 if target(g, shape) == torch.float16 else np.float32)
        w.add_tensor_info(g, shape, dt, int(np.prod(shape)) * dt.itemsize)
    if extra is not None:
        w.add_tensor_info("rope_freqs.weight", tuple(extra.shape), np.dtype(np.float32), extra.numel() * 4)
    try:
        w.write_header_to_file()
        w.write_kv_data_to_file()
        w.write_ti_data_to_file()
        for names, g in plan:
            t = _layout(src, names[0], torch.stack([index.read(n) for n in names]) if len(names) > 1
                        else index.read(names[0]))
            if quantized(g, tuple(t.shape)):
                x = t.float().numpy()
                own = {gguf.GGMLQuantizationType.Q4_K: quantize_q4_k, gguf.GGMLQuantizationType.Q5_K: quantize_q5_k,
                       gguf.GGMLQuantizationType.Q6_K: quantize_q6_k}
                w.write_tensor_data(own[qtype](x) if qtype in own else gguf.quants.quantize(x, qtype))
            else:
                w.write_tensor_data(t.to(target(g, tuple(t.shape))).contiguous().numpy())  # bf16 -> f16 rounds once
        if extra is not None:
            w.write_tensor_data(extra.numpy())
        w.close()
        os.replace(tmp, out)
    finally:
        w.close()  # idempotent; closes the file when a write failed
        tmp.unlink(missing_ok=True)
    return out


def _plan(src: GGUFSource, index) -> list[tuple[tuple[str, ...], str]]:
    """The file's tensors in order: (the HF names written as one tensor, its llama.cpp name).

    One name each, except an MoE layer's experts: each of gate / up / down is one ``[E, rows, cols]``
    tensor of the E experts' matrices in expert order, as llama.cpp's ``*_exps`` tensors hold them (their
    biases one ``[E, rows]``). Experts stored fused, as MXFP4 or under Mixtral's names are read through the
    loader's views of them.
    """
    a = src.args
    if a.num_experts:
        from llmsys.engine.bench.synthetic import _param_shapes
        from llmsys.engine.loader.experts import add_expert_views

        cfg = json.loads((src.folder / "config.json").read_text())
        shapes = dict(_param_shapes(cfg))
        add_expert_views(index, shapes, shapes, src.folder, a.experts_layout)
    groups: dict[str, list[tuple[int, str]]] = {}
    for name in sorted({*index.where, *index.derived}, key=_order):
        if a.num_experts and _FUSED_EXPERTS.search(name):
            continue  # stored fused / Mixtral-named: written through the views added above
        g = gguf_name(name, src.arch)
        if g is None or (g == "output.weight" and a.tie_word_embeddings):
            continue
        m = _EXPERT.match(name)
        groups.setdefault(g, []).append((int(m.group(1)) if m is not None else 0, name))
    plan = []
    for g, members in groups.items():
        members.sort()
        if "_exps." in g and [e for e, _ in members] != list(range(a.num_experts)):
            raise CheckpointError(f"{src.folder}: {g} needs experts 0..{a.num_experts - 1}, "
                                  f"the checkpoint has {len(members)} of them")
        plan.append((tuple(n for _, n in members), g))
    return plan


def _stacked_shape(index, names: tuple[str, ...]) -> tuple[int, ...]:
    shape = tuple(index.info(names[0]).shape)
    return (len(names), *shape) if len(names) > 1 else shape


def _k_quant(x: np.ndarray, levels: int) -> tuple[np.ndarray, np.ndarray]:
    """Q4_K / Q5_K's scale part: ``x [rows, K]`` -> (codes ``uint8 [R, S, 8, 32]`` in 0..levels, the 16 bytes of
    ``d``, ``dmin`` and the packed 6-bit scales and minimums ``[R, S, 16]``), round to nearest."""
    rows, k = x.shape
    xs = x.reshape(rows, k // 256, 8, 32).astype(np.float32)
    lo = np.minimum(xs.min(-1), 0.0)  # [R, S, 8]: the minimum subtracted is >= 0
    scale = (xs.max(-1) - lo) / levels
    d = (scale.max(-1, keepdims=True) / 63.0).astype(np.float16)  # [R, S, 1]
    dmin = ((-lo).max(-1, keepdims=True) / 63.0).astype(np.float16)
    df, dminf = d.astype(np.float32), dmin.astype(np.float32)
    sc = np.clip(np.rint(np.divide(scale, df, out=np.zeros_like(scale), where=df > 0)), 0, 63).astype(np.uint8)
    m = np.clip(np.rint(np.divide(-lo, dminf, out=np.zeros_like(lo), where=dminf > 0)), 0, 63).astype(np.uint8)
    s_eff, m_eff = (df * sc)[..., None], (dminf * m)[..., None]  # the decoder's float32 products
    q = np.clip(np.rint(np.divide(xs + m_eff, s_eff, out=np.zeros_like(xs), where=s_eff > 0)), 0, levels)
    packed = np.empty((rows, k // 256, 12), dtype=np.uint8)
    packed[..., 0:4] = sc[..., :4] | ((sc[..., 4:] >> 4) << 6)
    packed[..., 4:8] = m[..., :4] | ((m[..., 4:] >> 4) << 6)
    packed[..., 8:12] = (sc[..., 4:] & 15) | ((m[..., 4:] & 15) << 4)
    head = np.concatenate([d.view(np.uint8), dmin.view(np.uint8), packed], axis=-1)  # [R, S, 16]
    return q.astype(np.uint8), head


def quantize_q5_k(x: np.ndarray) -> np.ndarray:
    """``float32 [rows, K]`` (K a multiple of 256) -> Q5_K blocks ``uint8 [rows, K / 256 * 176]``, round to
    nearest (as :func:`quantize_q4_k`): 5-bit codes, their low nibbles as Q4_K's and their 5th bits in 32
    bytes (column 64j + l: bit 2j of byte l; column 64j + 32 + l: bit 2j + 1)."""
    rows, k = x.shape
    q, head = _k_quant(x, 31)
    q = q.reshape(rows, k // 256, 4, 2, 32)  # 4 pairs of sub-blocks: low nibble, high nibble
    qs = ((q[:, :, :, 0] & 15) | ((q[:, :, :, 1] & 15) << 4)).reshape(rows, k // 256, 128)
    shifts = (2 * np.arange(4, dtype=np.uint8))[None, None, :, None]  # [1, 1, 4, 1]
    qh = (((q[:, :, :, 0] >> 4) << shifts) | ((q[:, :, :, 1] >> 4) << (shifts + 1))).sum(axis=2, dtype=np.uint8)
    return np.concatenate([head, qh, qs], axis=-1).reshape(rows, -1)


def quantize_q4_k(x: np.ndarray) -> np.ndarray:
    """``float32 [rows, K]`` (K a multiple of 256) -> Q4_K blocks ``uint8 [rows, K / 256 * 144]``.

    The ``gguf`` package decodes Q4_K but cannot write it, and the readers' tests need Q4_K files
    without llama.cpp: a plain round-to-nearest quantizer (llama.cpp's searches each sub-block's
    scale and minimum; this takes min/max), writing the real format -- per 256 weights ``d``,
    ``dmin`` (fp16), eight 6-bit scales and minimums packed as ``get_scale_min_k4`` reads them,
    128 bytes of codes (32 per 64 columns: low nibbles the first 32, high nibbles the next 32).
    """
    rows, k = x.shape
    q, head = _k_quant(x, 15)
    q = q.reshape(rows, k // 256, 4, 2, 32)  # 4 pairs of sub-blocks: low nibble, high nibble
    qs = (q[:, :, :, 0] | (q[:, :, :, 1] << 4)).reshape(rows, k // 256, 128)
    return np.concatenate([head, qs], axis=-1).reshape(rows, -1)  # [R, S, 144] per row


def quantize_q6_k(x: np.ndarray) -> np.ndarray:
    """``float32 [rows, K]`` (K a multiple of 256) -> Q6_K blocks ``uint8 [rows, K / 256 * 210]``, round to
    nearest (as :func:`quantize_q4_k`, for files the ``gguf`` package cannot write): per 16 weights an int8
    scale ``sc`` of one fp16 ``d`` per 256, codes ``q = round(x / (d * sc)) + 32`` in 0..63, packed as
    ``dequantize_row_q6_K`` reads them (128 bytes of low nibbles, 64 of high bit pairs, the scales, d)."""
    rows, k = x.shape
    xs = x.reshape(rows, k // 256, 16, 16).astype(np.float32)
    amax = np.abs(xs).max(-1)  # [R, S, 16]
    sub = amax / 31.0
    d = (sub.max(-1, keepdims=True) / 127.0).astype(np.float16)  # [R, S, 1]
    df = d.astype(np.float32)
    sc = np.clip(np.rint(np.divide(sub, df, out=np.zeros_like(sub), where=df > 0)), -128, 127).astype(np.int8)
    eff = (df * sc.astype(np.float32))[..., None]
    v = (np.clip(np.rint(np.divide(xs, eff, out=np.zeros_like(xs), where=eff != 0)), -32, 31) + 32).astype(np.uint8)
    v = v.reshape(rows, k // 256, 2, 128)  # two halves of 128 columns
    c = [v[..., 0:32], v[..., 32:64], v[..., 64:96], v[..., 96:128]]
    ql = np.concatenate([(c[0] & 15) | ((c[2] & 15) << 4), (c[1] & 15) | ((c[3] & 15) << 4)], axis=-1)  # [R, S, 2, 64]
    qh = (c[0] >> 4) | ((c[1] >> 4) << 2) | ((c[2] >> 4) << 4) | ((c[3] >> 4) << 6)  # [R, S, 2, 32]
    out = np.concatenate([ql.reshape(rows, k // 256, 128), qh.reshape(rows, k // 256, 64), sc.view(np.uint8),
                          d.view(np.uint8)], axis=-1)  # [R, S, 210]
    return out.reshape(rows, -1)


def _order(name: str) -> tuple[int, int, str]:
    """Embedding first, then layers by number, then the final norm and head (llama.cpp's usual order)."""
    parts = name.split(".")
    if len(parts) > 2 and parts[1] == "layers" and parts[2].isdigit():
        return (1, int(parts[2]), name)
    return (0 if "embed_tokens" in name else 2, 0, name)


def _layout(src: GGUFSource, name: str, t: torch.Tensor) -> torch.Tensor:
    """The tensor as llama.cpp wants it: q/k rows interleaved for the llama architecture."""
    if src.interleave_qk:
        if ".self_attn.q_proj." in name:
            return hf_to_interleaved(t, src.args.num_attention_heads)
        if ".self_attn.k_proj." in name:
            return hf_to_interleaved(t, src.args.num_key_value_heads)
    return t


def _rope_freqs(a: TransformerArgs) -> torch.Tensor | None:
    """Llama 3 rope scaling as llama.cpp's per-frequency divisors ``[head_dim/2]`` (None without it)."""
    from llmsys.kernels import rope_inv_freq

    scaling = a.rope_scaling or {}
    if scaling.get("rope_type", scaling.get("type")) != "llama3":
        return None
    base = rope_inv_freq(a.head_dim, a.rope_theta, None)
    return (base / rope_inv_freq(a.head_dim, a.rope_theta, scaling)).float().contiguous()


def _write_metadata(w: gguf.GGUFWriter, src: GGUFSource, fmt: str) -> None:
    import gguf

    a = src.args
    w.add_name(src.folder.name)
    w.add_file_type(gguf.LlamaFileType.ALL_F32 if fmt == "f32" else gguf.LlamaFileType.MOSTLY_F16)
    w.add_context_length(a.max_position_embeddings)
    w.add_embedding_length(a.hidden_size)
    w.add_block_count(a.num_hidden_layers)
    w.add_feed_forward_length(a.intermediate_size)
    w.add_head_count(a.num_attention_heads)
    w.add_head_count_kv(a.num_key_value_heads)
    w.add_key_length(a.head_dim)
    w.add_value_length(a.head_dim)
    w.add_rope_dimension_count(a.head_dim)
    w.add_rope_freq_base(float(a.rope_theta))
    w.add_layer_norm_rms_eps(float(a.rms_norm_eps))
    w.add_vocab_size(a.vocab_size)
    if a.num_experts:
        w.add_expert_count(a.num_experts)
        w.add_expert_used_count(a.num_experts_per_tok)
        w.add_expert_feed_forward_length(a.moe_intermediate_size)
    if src.arch == "gpt-oss":  # llama.cpp reads a window and which layers use it (no window: none does)
        w.add_sliding_window(a.sliding_window or a.max_position_embeddings)
        w.add_sliding_window_pattern([a.sliding(i) for i in range(a.num_hidden_layers)])
    scaling = a.rope_scaling or {}
    kind = scaling.get("rope_type", scaling.get("type"))
    if kind == "linear":
        w.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        w.add_rope_scaling_factor(float(scaling["factor"]))
    elif kind == "yarn":  # llama.cpp derives YaRN's attention factor (0.1 ln(factor) + 1) as transformers does
        w.add_rope_scaling_type(gguf.RopeScalingType.YARN)
        w.add_rope_scaling_factor(float(scaling["factor"]))
        w.add_rope_scaling_orig_ctx_len(int(scaling["original_max_position_embeddings"]))
        w.add_rope_scaling_yarn_beta_fast(float(scaling.get("beta_fast", 32.0)))
        w.add_rope_scaling_yarn_beta_slow(float(scaling.get("beta_slow", 1.0)))
    _write_vocab(w, src)


# --------------------------------------------------------------------------
# Vocabulary
# --------------------------------------------------------------------------


@dataclass(frozen=True)
class Vocab:
    """A "llama" (SPM) vocabulary as llama.cpp reads it."""

    tokens: list[str]
    scores: list[float]
    types: list[int]  # gguf.TokenType values
    real: bool  # the model's own pieces (else placeholders)


def vocab_for(src: GGUFSource) -> Vocab:
    """The model's SentencePiece-style BPE vocabulary when it has one, else placeholders."""
    import gguf

    n = src.args.vocab_size
    specials = {i for i in (src.args.bos_token_id, *src.args.eos_token_id) if i is not None and 0 <= i < n}
    spm = _spm_pieces(src.folder / "tokenizer.json", n)
    if spm is None:
        types = [int(gguf.TokenType.CONTROL if i in specials else gguf.TokenType.NORMAL) for i in range(n)]
        return Vocab([f"<tok_{i}>" for i in range(n)], [0.0] * n, types, real=False)
    tokens, scores, control = spm
    types = []
    for i, t in enumerate(tokens):
        if i in control or i in specials:
            types.append(int(gguf.TokenType.UNKNOWN if t == "<unk>" else gguf.TokenType.CONTROL))
        elif len(t) == 6 and t.startswith("<0x") and t.endswith(">"):
            types.append(int(gguf.TokenType.BYTE))
        elif t.startswith("<tok_"):
            types.append(int(gguf.TokenType.UNUSED))  # padding past the tokenizer's pieces
        else:
            types.append(int(gguf.TokenType.NORMAL))
    return Vocab(tokens, scores, types, real=True)


def _spm_pieces(path: Path, n: int) -> tuple[list[str], list[float], set[int]] | None:
    """(pieces, scores, special ids) of a SentencePiece-converted BPE tokenizer.json, or None.

    llama.cpp's SPM tokenizer merges the adjacent pair whose joined piece
    scores highest, so a piece's score is minus the rank of the merge that
    makes it (earlier merges win, as in BPE); unmerged pieces score 0.
    """
    try:
        tj = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    model = tj.get("model") or {}
    norm = json.dumps(tj.get("normalizer"))
    if model.get("type") != "BPE" or not model.get("byte_fallback") or '"Prepend"' not in norm:
        return None
    vocab: dict[str, int] = dict(model.get("vocab") or {})
    for t in tj.get("added_tokens") or []:
        vocab.setdefault(t["content"], t["id"])
    if not vocab or max(vocab.values()) >= n or len(set(vocab.values())) != len(vocab):
        return None
    tokens = [f"<tok_{i}>" for i in range(n)]
    for piece, i in vocab.items():
        tokens[i] = piece
    scores = [0.0] * n
    for rank, m in enumerate(model.get("merges") or []):
        a, b = m.split(" ", 1) if isinstance(m, str) else m
        i = vocab.get(a + b)
        if i is not None and scores[i] == 0.0:
            scores[i] = -float(rank + 1)
    control = {t["id"] for t in tj.get("added_tokens") or [] if t.get("special")}
    return tokens, scores, control


def _write_vocab(w: gguf.GGUFWriter, src: GGUFSource) -> None:
    v = vocab_for(src)
    a = src.args
    w.add_tokenizer_model("llama")
    w.add_token_list(v.tokens)
    w.add_token_scores(v.scores)
    w.add_token_types(v.types)
    if a.bos_token_id is not None and 0 <= a.bos_token_id < a.vocab_size:
        w.add_bos_token_id(a.bos_token_id)
    if a.eos_token_id and 0 <= a.eos_token_id[0] < a.vocab_size:
        w.add_eos_token_id(a.eos_token_id[0])
    if v.real and "<unk>" in v.tokens:
        w.add_unk_token_id(v.tokens.index("<unk>"))
    w.add_add_bos_token(bool(v.real and _tokenizer_adds_bos(src.folder)))
    w.add_add_eos_token(False)


def _tokenizer_adds_bos(folder: Path) -> bool:
    try:
        return bool(json.loads((folder / "tokenizer_config.json").read_text()).get("add_bos_token", False))
    except (OSError, ValueError):
        return False


# --------------------------------------------------------------------------
# Quantized files: llama.cpp's quantizer
# --------------------------------------------------------------------------


def import_llama_cpp() -> ModuleType:
    """``llama_cpp``, or the one-line error saying what to install."""
    try:
        import llama_cpp
    except ImportError:
        raise LLMSysError(f"llama-cpp-python is not installed: {_INSTALL}") from None
    return llama_cpp


def quantize(src: Path, out: Path, fmt: str, threads: int | None = None, allow_requantize: bool = False) -> Path:
    """``out`` = llama.cpp's ``fmt`` quantization of the float GGUF ``src`` (or of a quantized one with
    ``allow_requantize``, as llama.cpp's ``--allow-requantize``)."""
    llama_cpp = import_llama_cpp()
    if fmt not in QUANT_FORMATS:
        raise InvalidParameterError(f"quantize: {fmt!r} is not one of {', '.join(QUANT_FORMATS)}")
    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = getattr(llama_cpp, _FTYPES[fmt])
    params.nthread = threads or torch.get_num_threads()
    params.allow_requantize = allow_requantize
    tmp = out.with_name(out.name + f".tmp{os.getpid()}")
    # llama.cpp logs a line per tensor and a warning per block-size fallback (through
    # llama-cpp-python's log callback or straight from C) on stderr: captured, the last
    # line goes into the error message if quantizing fails. The callback prints only what
    # the "llama-cpp-python" logger's level lets through (a Llama(verbose=False) raises
    # it past llama.cpp's errors): all of it, while captured.
    log = logging.getLogger("llama-cpp-python")
    level = log.level
    try:
        with _captured_stderr() as captured:
            log.setLevel(logging.DEBUG)
            try:
                rc = llama_cpp.llama_model_quantize(str(src).encode(), str(tmp).encode(), ctypes.byref(params))
            finally:
                log.setLevel(level)
        if rc != 0 or not tmp.exists():
            said = next((ln.strip() for ln in reversed(captured) if ln.strip()), "")
            raise CheckpointError(f"{src}: llama.cpp could not quantize it to {fmt} (returned {rc}) {said}".rstrip())
        os.replace(tmp, out)
    finally:
        tmp.unlink(missing_ok=True)
    return out


@contextlib.contextmanager
def _captured_stderr() -> Iterator[list[str]]:
    """File descriptor 2 (where C code writes) and ``sys.stderr`` (where llama-cpp-python's
    log callback prints) redirected to a temporary file; the yielded list gets the lines
    written, on exit."""
    sys.stderr.flush()
    lines: list[str] = []
    saved = os.dup(2)
    with tempfile.TemporaryFile(mode="w+", errors="replace") as f:
        os.dup2(f.fileno(), 2)
        try:
            with contextlib.redirect_stderr(f):
                yield lines
        finally:
            os.dup2(saved, 2)
            os.close(saved)
            f.seek(0)
            lines.extend(f.read().splitlines())
