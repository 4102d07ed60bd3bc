"""GGUF files (llama.cpp, LM Studio, the Ollama store) opened as llmsys checkpoints: no second download.

Header: :mod:`gguf_header`; tensors are read with ``preadv`` into fresh buffers one at a time (peak = the
model plus one tensor; nothing mapped after load); ``gguf`` supplies the type tables and decoders.

* Config: ``<arch>.*`` keys become HF ``config.json`` fields (:func:`hf_config`, llama.cpp's defaults for
  absent keys) for ``llama``, ``qwen2``, ``qwen3``, ``gemma2``, ``gemma3``, ``phi3``, ``qwen2moe``, ``qwen3moe``, ``gpt-oss``.
* Names: ``blk.N.attn_q.weight`` -> HF names (:data:`ARCH_LAYER_NAMES`); ``llama``'s interleaved q/k rows go
  back to rotate-half (``interleaved_to_hf``; the others are NEOX, as stored); Gemma's ``1 + w`` norms read
  as ``w``; stacked experts are read per expert at their offsets (:func:`expert_slice`).
* Kept as stored, bit for bit: Q4_0 (canonical int4, group 32, zero 8), Q4_1 and Q4_K (with float offsets)
  -> ``Int4Linear``; Q8_0, Q5_0, Q6_K, Q5_K -> ``Int8BlockLinear``; the embedding too (``QuantEmbedding``).
  Other types are dequantized to the engine dtype or re-quantized to ``--quant`` (:func:`conversions`).
"""

from __future__ import annotations

import re
from collections import Counter
from dataclasses import dataclass, replace
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from llmsys.engine.loader import validate
from llmsys.engine.loader.gguf_header import MAGIC, GGUFHeader, TensorEntry, check_end, read_bytes, read_header
from llmsys.kernels import KScales, pack_int4, repack_q4_0, repack_q4k, repack_q6k, repack_q8_0, unpack_int4
from llmsys.kernels.common.errors import CheckpointError, UnsupportedModelError

if TYPE_CHECKING:
    from llmsys.offload.plan import WeightBytes

# llama.cpp architecture -> (HF model_type, HF architectures entry, q/k rows interleaved in the file). A
# ``llama`` file with ``llama.expert_count`` is Mixtral (:data:`MOE_ARCHS`).
ARCHS: dict[str, tuple[str, str, bool]] = {
    "llama": ("llama", "LlamaForCausalLM", True),
    "qwen2": ("qwen2", "Qwen2ForCausalLM", False),
    "qwen3": ("qwen3", "Qwen3ForCausalLM", False),
    "gemma2": ("gemma2", "Gemma2ForCausalLM", False),
    "gemma3": ("gemma3_text", "Gemma3ForCausalLM", False),
    "phi3": ("phi3", "Phi3ForCausalLM", False),
    "qwen2moe": ("qwen2_moe", "Qwen2MoeForCausalLM", False),
    "qwen3moe": ("qwen3_moe", "Qwen3MoeForCausalLM", False),
    "gpt-oss": ("gpt_oss", "GptOssForCausalLM", False),
}
MOE_ARCHS = {"llama": ("mixtral", "MixtralForCausalLM", True)}  # the same file layout with experts
# llama.cpp's converter stores Gemma's RMSNorm weights as 1 + w (GemmaRMSNorm scales by 1 + w): the reader
# takes the 1 back off, so the family code (which adds it in float32) computes the file's own factor.
NORM_SHIFT_ARCHS = frozenset({"gemma2", "gemma3"})
# Gemma's attention scale is 1/sqrt(head_dim), except the 27B models' 1/sqrt(hidden / heads) (llama.cpp
# decides it by the layer count, as here: Gemma 2 27B has 46 layers, Gemma 3 27B 62).
GEMMA_27B_LAYERS = {"gemma2": 46, "gemma3": 62}
# HF config field -> the GGUF metadata key (after "<arch>.") it is read from (hf_config), for messages.
_GGUF_KEYS = {
    "hidden_size": "embedding_length", "intermediate_size": "feed_forward_length", "num_hidden_layers": "block_count",
    "num_attention_heads": "attention.head_count", "num_key_value_heads": "attention.head_count_kv",
    "head_dim": "attention.key_length", "rms_norm_eps": "attention.layer_norm_rms_epsilon",
    "rope_theta": "rope.freq_base", "max_position_embeddings": "context_length", "vocab_size": "vocab_size",
    "rope_scaling": "rope.scaling.factor",
}
# llama.cpp per-layer tensor suffix (after "blk.N.") -> HF suffix (after "model.layers.N.")
LAYER_NAMES = {
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_output.weight": "self_attn.o_proj.weight",
    "attn_q.bias": "self_attn.q_proj.bias",
    "attn_k.bias": "self_attn.k_proj.bias",
    "attn_v.bias": "self_attn.v_proj.bias",
    "attn_q_norm.weight": "self_attn.q_norm.weight",
    "attn_k_norm.weight": "self_attn.k_norm.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
    "attn_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
}
LAYER_PREFIX = "blk."  # llama.cpp's layer tensors: blk.N.<suffix>
TOP_NAMES = {"token_embd.weight": "model.embed_tokens.weight", "output_norm.weight": "model.norm.weight",
             "output.weight": "lm_head.weight"}
# Per-architecture names that differ from (or add to) LAYER_NAMES. Gemma's four norms around attention and the
# MLP; gpt-oss's pre-MLP norm is llama.cpp's post_attention_norm; Phi-3's fused q|k|v and gate|up (llama.cpp's
# ffn_up holds gate then up, as the checkpoint's gate_up_proj); Qwen2-MoE's shared expert and its gate.
_GEMMA_NAMES = {
    "post_attention_norm.weight": "post_attention_layernorm.weight",
    "ffn_norm.weight": "pre_feedforward_layernorm.weight",
    "post_ffw_norm.weight": "post_feedforward_layernorm.weight",
}
ARCH_LAYER_NAMES: dict[str, dict[str, str]] = {
    "gemma2": _GEMMA_NAMES,
    "gemma3": _GEMMA_NAMES,
    "phi3": {"attn_qkv.weight": "self_attn.qkv_proj.weight", "attn_qkv.bias": "self_attn.qkv_proj.bias",
             "ffn_up.weight": "mlp.gate_up_proj.weight"},
    "gpt-oss": {"post_attention_norm.weight": "post_attention_layernorm.weight",
                "attn_sinks.weight": "self_attn.sinks", "attn_output.bias": "self_attn.o_proj.bias"},
}
# Mixture-of-experts tensors (every MoE architecture): the router and Qwen2-MoE's shared expert ...
MOE_NAMES = {
    "ffn_gate_inp.weight": "mlp.gate.weight",
    "ffn_gate_inp.bias": "mlp.gate.bias",
    "ffn_gate_shexp.weight": "mlp.shared_expert.gate_proj.weight",
    "ffn_up_shexp.weight": "mlp.shared_expert.up_proj.weight",
    "ffn_down_shexp.weight": "mlp.shared_expert.down_proj.weight",
    "ffn_gate_inp_shexp.weight": "mlp.shared_expert_gate.weight",
}
# ... and the experts, stacked in one tensor per projection (ggml ``ne`` = [in, out, experts]): expert e of
# ``ffn_gate_exps.weight`` is HF's ``mlp.experts.{e}.gate_proj.weight`` (its bias likewise, gpt-oss).
EXPERT_NAMES = {"ffn_gate_exps": "gate_proj", "ffn_up_exps": "up_proj", "ffn_down_exps": "down_proj"}
INTEGER_TYPES = ("I8", "I16", "I32", "I64")  # ggml's plain integer tensors: never a weight of these models
PLAIN_TYPES = {"F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16}  # read in place (locate)
_EXPERT = re.compile(r"^model\.layers\.(\d+)\.mlp\.experts\.(\d+)\.")  # an expert's tensor (HF name)
# read into the config (rope scaling), not model tensors
IGNORED = {"rope_freqs.weight", "rope_factors_long.weight", "rope_factors_short.weight"}
# Rows dequantized per piece: bounds the float32 transient of a big table (a 151936-row embedding).
DEQUANT_ROWS = 8192
# The block formats kept as codes, and what they become: Q4_0 is int4 with group 32, zero 8 and fp16 scales
# (Int4Linear), Q8_0 int8 with an fp16 scale per 32 (Int8BlockLinear). Run-time bytes per weight: int4 codes 1/2,
# scales 2/32, zeros as uint8 twice (row- and group-major) 2/32 (llama.cpp's Q4_0: 18/32); int8 1 + 2/32 (= Q8_0).
# Q5_0 (5-bit codes q, w = (q - 16) * d per 32) fits int8 exactly too: its codes minus 16 are the int8 codes.
# Q4_1 and Q4_K are int4 with group 32 and a float minimum (w = q * scale + offset): Q4_1 with float32 scales and
# offsets (1/2 + 8/32 bytes per weight; the file's 20/32), Q4_K with its 6-bit scales and minimums and fp16 d, dmin
# per 256 as stored (kernels.KScales: 1/2 + 2/32 + 4/256; the file's 144/256). Neither is an int8 code of a scale.
# Q6_K (6-bit codes, an int8 scale per 16 times an fp16 d per 256) is int8 with those scales as stored
# ("int8:g16", Int8BlockLinear): 1 + 1/16 + 2/256 bytes per weight (the file's 210/256).
# Q5_K (5-bit codes with a scale and a float minimum per 32, like Q4_K) is int8 with float32 scales and offsets
# per 32 columns (Int8BlockLinear with offsets): 1 + 8/32 bytes per weight (the file's 176/256).
KEPT = {"Q4_0": "int4:g32", "Q8_0": "int8:g32", "Q5_0": "int8:g32", "Q4_1": "int4:g32", "Q4_K": "int4:g32",
        "Q6_K": "int8:g16", "Q5_K": "int8:g32"}
KEPT_BYTES = {"Q4_0": 0.5 + 2 / 32 + 2 / 32, "Q8_0": 1 + 2 / 32, "Q5_0": 1 + 2 / 32,
              "Q4_1": 0.5 + 8 / 32, "Q4_K": 0.5 + 2 / 32 + 4 / 256, "Q6_K": 1 + 1 / 16 + 2 / 256, "Q5_K": 1 + 8 / 32}
OFFSET_KINDS = ("Q4_1", "Q4_K")  # kept as int4 with float offsets
# The stored format each kept type runs as (the planner's calibrated costs are per format: offload.kernel_probe).
KEPT_FORMATS = {"Q4_0": "int4", "Q4_1": "int4+offset", "Q4_K": "int4:k", "Q8_0": "int8:g32", "Q5_0": "int8:g32",
                "Q6_K": "int8:g16", "Q5_K": "int8:g32+offset"}
KSCALE_KEYS = ("k_sc", "k_m", "k_d", "k_dmin")  # Q4_K's stored scales, as Int4Linear.from_quantized takes them
# The float factors of kept block formats, checked finite at load (int8 / uint8 ones cannot be otherwise).
BLOCK_FACTORS = {"scales": "block scales", "block_scales": "block scales", "offsets": "block minimums",
                 "k_d": "super-block scales", "k_dmin": "super-block minimums", "super_scales": "super-block scales"}
# The kept types whose run-time layer tensors one C pass writes from the stored blocks (GGUFIndex._fill_from), by
# the layer's buffer names: an expert read at run time is rebuilt so (the torch rebuild cost several reads' time).
FILLED = {"Q4_K": ("packed", "zeros_u8", "zeros_gm", "k_sc", "k_m", "k_d", "k_dmin"),
          "Q6_K": ("qweight", "block_scales", "super_scales"),
          "Q4_0": ("packed", "zeros_u8", "zeros_gm", "scales_orig"),  # scales_orig: an [N, G] view of [G, N]
          "Q8_0": ("qweight", "block_scales")}
Q4K_BLOCK = 144  # bytes of one Q4_K super-block of 256 weights: d, dmin (fp16), 12 bytes of 6-bit sc/m, 128 of codes
Q6K_BLOCK = 210  # Q6_K: 128 bytes of low 4 bits, 64 of high 2 bits, 16 int8 scales, d (fp16)
Q5K_BLOCK = 176  # Q5_K: d, dmin (fp16), 12 bytes of 6-bit sc/m (as Q4_K), 32 bytes of 5th bits, 128 of low nibbles


def kept_as(kind: str | None, spec: Any) -> str | None:
    """The llmsys format a matrix of GGUF type ``kind`` keeps its codes in under ``--quant spec`` (None: no
    flag), or None when it is dequantized. ``int8:g32`` also takes Q4_0's codes (``q - 8``, exactly) and
    keeps Q6_K's (exact with their scales per 16)."""
    if kind not in KEPT:
        return None
    if spec is None or spec.name == KEPT[kind]:
        return KEPT[kind]
    if spec.name == "int8:g32" and kind not in OFFSET_KINDS:
        return KEPT[kind] if KEPT[kind].startswith("int8") else "int8:g32"
    return None


def is_gguf(path: Path) -> bool:
    """A file that starts with the GGUF magic (Ollama's blobs have no suffix)."""
    try:
        with open(path, "rb") as f:
            return path.is_file() and f.read(4) == MAGIC
    except OSError:
        return False


def hf_name(name: str, arch: str = "llama") -> str | None:
    """The HF name of a llama.cpp tensor name of architecture ``arch``; None for one llmsys does not map (or
    a stacked expert tensor: :func:`expert_names`)."""
    if name in TOP_NAMES:
        return TOP_NAMES[name]
    parts = name.split(".", 2)  # blk.N.<suffix>
    if len(parts) != 3 or parts[0] != "blk" or not parts[1].isdigit():
        return None
    suffix = parts[2]
    hf = ARCH_LAYER_NAMES.get(arch, {}).get(suffix) or MOE_NAMES.get(suffix) or LAYER_NAMES.get(suffix)
    return f"model.layers.{parts[1]}.{hf}" if hf else None


def stored_name(hf: str, arch: str = "llama") -> str | None:
    """llama.cpp's name of the HF tensor name ``hf`` in a file of architecture ``arch`` (the inverse of
    :func:`hf_name`; an expert's matrix is its stacked tensor), for messages; None where there is none."""
    top = next((g for g, h in TOP_NAMES.items() if h == hf), None)
    m = re.fullmatch(r"model\.layers\.(\d+)\.(.+)", hf)
    if top is not None or m is None:
        return top
    layer, suffix = m.groups()
    e = re.fullmatch(r"mlp\.experts\.\d+\.(gate|up|down)_proj\.(weight|bias)", suffix)
    if e is not None:
        return f"blk.{layer}.ffn_{e[1]}_exps.{e[2]}"
    for table in (ARCH_LAYER_NAMES.get(arch, {}), MOE_NAMES, LAYER_NAMES):  # hf_name's precedence
        g = next((g for g, h in table.items() if h == suffix), None)
        if g is not None:
            return f"blk.{layer}.{g}"
    return None


def check_complete(path: Path, index: "GGUFIndex", model: torch.nn.Module) -> None:
    """Every parameter of the skeleton the metadata describes is a tensor of the file (the head may be absent
    when tied), checked before anything is read, the first missing one named as llama.cpp names it
    (``materialize`` would say the same later, under the HF name only)."""
    tied = model.args.tie_word_embeddings
    missing = [n for n, _ in model.named_parameters(remove_duplicate=False)
               if n not in index and not (tied and n == "lm_head.weight")]
    if missing:
        first = missing[0]
        stored = stored_name(first, index.arch)
        shown = f"{stored} ({first})" if stored else first
        more = f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""
        raise CheckpointError(f"{path}: missing tensor {shown}{more}, which {index.arch} with "
                              f"{model.args.num_hidden_layers} layers needs; convert or download the GGUF again")


def expert_names(name: str, n_experts: int) -> list[str] | None:
    """HF names of the experts stacked in llama.cpp tensor ``name`` (``blk.N.ffn_gate_exps.weight`` -> expert e's
    ``model.layers.N.mlp.experts.{e}.gate_proj.weight``), or None for any other tensor."""
    parts = name.split(".")  # blk, N, ffn_gate_exps, weight|bias
    if len(parts) != 4 or parts[0] != "blk" or not parts[1].isdigit() or parts[2] not in EXPERT_NAMES:
        return None
    return [f"model.layers.{parts[1]}.mlp.experts.{e}.{EXPERT_NAMES[parts[2]]}.{parts[3]}" for e in range(n_experts)]


def expert_slice(path: Path, t: TensorEntry, e: int, n_experts: int) -> TensorEntry:
    """Expert ``e``'s part of a stacked expert tensor (ggml ``ne`` = ``[in, out, experts]`` or ``[out, experts]``
    for a bias): the experts lie one after the other, so it is a plain tensor at an offset."""
    if t.shape[-1] != n_experts or t.nbytes % n_experts:
        raise CheckpointError(f"{path}: tensor {t.name} has shape {list(t.shape)}; its last dimension must be the "
                              f"{n_experts} experts the metadata states; convert or download the GGUF again")
    size = t.nbytes // n_experts
    return replace(t, name=f"{t.name}[{e}]", shape=tuple(t.shape[:-1]), offset=t.offset + e * size, nbytes=size)


def hf_to_interleaved(w: torch.Tensor, n_heads: int) -> torch.Tensor:
    """Reorder q/k rows per head from rotate-half to adjacent-pair RoPE order (llama.cpp's ``llama``).

    ``w``: ``[n_heads * d, ...]`` (a weight ``[n_heads * d, in]``, a bias ``[n_heads * d]``, or
    per-row int4 codes/scales). Row ``i`` of a head's first half and row ``i`` of its second half
    (the pair HF rotates together) become rows ``2i`` and ``2i+1``.
    """
    d = w.shape[0] // n_heads
    rest = w.shape[1:]
    return w.reshape(n_heads, 2, d // 2, *rest).transpose(1, 2).reshape(w.shape)  # [H, 2, d/2, ...] -> [H, d/2, 2, ...]


def interleaved_to_hf(w: torch.Tensor, n_heads: int) -> torch.Tensor:
    """Inverse of :func:`hf_to_interleaved`: a GGUF ``llama`` file's q/k rows in HF order."""
    d = w.shape[0] // n_heads
    rest = w.shape[1:]
    return w.reshape(n_heads, d // 2, 2, *rest).transpose(1, 2).reshape(w.shape)  # [H, d/2, 2, ...] -> [H, 2, d/2, ...]


def _qtype(t: TensorEntry) -> str:
    """ggml's name of a tensor's type: F32, F16, Q4_0, Q6_K, ..."""
    import gguf

    return gguf.GGMLQuantizationType(t.qtype).name


def _f32(v: Any) -> Any:
    """A float32 metadata value as the shortest decimal that rounds to it (1e-05, not
    9.999999747378752e-06): what the HF config held, where it was exported from one. Anything but a
    number is returned as it is, for ``validate`` to name."""
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        return v
    return float(np.format_float_positional(np.float32(v), unique=True, trim="-"))


def origin(path: Path, arch: str) -> validate.Origin:
    """Messages about a GGUF's config values name the metadata key each HF field came from."""
    keys = {name: f"{arch}.{key}" for name, key in _GGUF_KEYS.items()}
    keys.update(bos_token_id="tokenizer.ggml.bos_token_id", eos_token_id="tokenizer.ggml.eos_token_id")
    return validate.Origin(path, "the file's metadata is wrong; convert or download the GGUF again", keys)


@dataclass(frozen=True)
class GGUFTensorInfo:
    """One tensor of the file, in HF terms: ``shape`` is ``[out, in]`` (row-major, as torch holds it)."""

    gguf_name: str
    qtype: str  # gguf.GGMLQuantizationType name: F32, F16, Q4_0, Q6_K, ...
    shape: tuple[int, ...]
    offset: int
    nbytes: int


def hf_config(path: Path, header: GGUFHeader | None = None) -> dict[str, Any]:
    """The HF ``config.json`` fields of a GGUF's metadata (what the model families read)."""
    h = header or read_header(path)
    meta = h.fields
    arch = meta.get("general.architecture")
    if not isinstance(arch, str) or arch not in ARCHS:
        raise UnsupportedModelError(
            f"{path}: GGUF architecture {arch!r} is not supported; supported: {', '.join(ARCHS)}"
        )
    model_type, hf_arch, _ = arch_spec(arch, meta)

    def need(key: str) -> Any:
        v = meta.get(f"{arch}.{key}")
        if v is None:
            raise CheckpointError(f"{path}: GGUF metadata lacks {arch}.{key}; the file is incomplete")
        return v

    names = {t.name for t in h.tensors}
    heads = need("attention.head_count")
    tokens = meta.get("tokenizer.ggml.tokens")
    vocab = meta.get(f"{arch}.vocab_size")
    if vocab is None:
        emb = next((t for t in h.tensors if t.name == "token_embd.weight"), None)
        vocab = int(emb.shape[1]) if emb is not None else (len(tokens) if tokens is not None else None)
    if vocab is None:
        raise CheckpointError(f"{path}: cannot tell the vocabulary size (no token_embd.weight, no tokens)")
    # Values as stored (GGUF integers are Python ints already): a string or a float where a count belongs is
    # validate.check_config's one-line error, not a ValueError here or a silent truncation by int().
    cfg: dict[str, Any] = {
        "architectures": [hf_arch],
        "model_type": model_type,
        "hidden_size": need("embedding_length"),
        "intermediate_size": meta.get(f"{arch}.feed_forward_length") if arch in _MOE_ONLY else need("feed_forward_length"),
        "num_hidden_layers": need("block_count"),
        "num_attention_heads": heads,
        "num_key_value_heads": meta.get(f"{arch}.attention.head_count_kv", heads),
        "head_dim": meta.get(f"{arch}.attention.key_length"),
        "rms_norm_eps": _f32(meta.get(f"{arch}.attention.layer_norm_rms_epsilon", 1e-5)),
        "rope_theta": _f32(meta.get(f"{arch}.rope.freq_base", 10000.0)),
        "max_position_embeddings": meta.get(f"{arch}.context_length", 2048),
        "vocab_size": vocab,
        "tie_word_embeddings": "output.weight" not in names,
        "attention_bias": "blk.0.attn_q.bias" in names,
    }
    bos, eos = meta.get("tokenizer.ggml.bos_token_id"), meta.get("tokenizer.ggml.eos_token_id")
    if bos is not None:
        cfg["bos_token_id"] = bos
    eos_ids = [v for v in (eos, meta.get("tokenizer.ggml.eot_token_id")) if v is not None]
    if eos_ids:
        ints = all(isinstance(v, int) for v in eos_ids)
        cfg["eos_token_id"] = sorted(set(eos_ids), key=eos_ids.index) if ints else eos_ids
    cfg.update(_family_fields(path, arch, meta, cfg, {t.name: t for t in h.tensors}))
    validate.check_config(cfg, origin(path, arch))
    _check_sizes(path, arch, meta, cfg, h.tensors)
    head_dim = cfg["head_dim"] or cfg["hidden_size"] // heads
    rope_dims = meta.get(f"{arch}.rope.dimension_count")
    if rope_dims is not None and rope_dims != head_dim:
        if arch != "phi3":  # Phi-4-mini rotates part of each head (partial_rotary_factor, set above)
            raise UnsupportedModelError(f"{path}: partial RoPE ({rope_dims} of {head_dim} dims) is not supported")
    scaling = meta.get(f"{arch}.rope.scaling.type")
    if scaling == "linear":
        cfg["rope_scaling"] = {"rope_type": "linear", "factor": _f32(need("rope.scaling.factor"))}
    elif scaling == "yarn" and arch == "gpt-oss":
        cfg["rope_scaling"] = {
            "rope_type": "yarn", "factor": _f32(need("rope.scaling.factor")),
            "beta_fast": _f32(meta.get(f"{arch}.rope.scaling.yarn_beta_fast", 32.0)),
            "beta_slow": _f32(meta.get(f"{arch}.rope.scaling.yarn_beta_slow", 1.0)),
            "original_max_position_embeddings": need("rope.scaling.original_context_length"), "truncate": False}
    elif scaling not in (None, "none"):
        raise UnsupportedModelError(f"{path}: GGUF rope scaling {scaling!r} is not supported (linear and llama3 are"
                                    ", and yarn for gpt-oss)")
    if "rope_freqs.weight" in names:  # Llama 3.x: llama.cpp's per-frequency divisors
        t = next(t for t in h.tensors if t.name == "rope_freqs.weight")
        cfg["rope_scaling"] = {"rope_type": "freq_factors",
                               "factors": [float(v) for v in read_bytes(path, t).view(np.float32)]}
    return cfg


def _check_sizes(path: Path, arch: str, meta: dict[str, Any], cfg: dict[str, Any],
                 tensors: tuple[TensorEntry, ...]) -> None:
    """The header's sizes against the tensors that embody them, naming the metadata key: ``embedding_length``
    and ``vocab_size`` against ``token_embd.weight`` (ggml ``ne`` = [embedding, vocabulary]), the
    tokenizer's token list against its rows (llama.cpp makes the table one row per token, so a file whose
    tokenizer can emit an id the table lacks, or the reverse, is refused there too), the head counts and
    ``key_length`` against layer 0's ``attn_q`` / ``attn_k`` rows. The later shape check of every tensor
    (``validate.check_tensors``) would catch most of these too, but could name only the tensor, not the key
    that lies. Header values only (``check_config`` has made them whole numbers)."""
    by_name = {t.name: t for t in tensors}
    where = origin(path, arch)

    def refuse(key: str, value: Any, t: TensorEntry, dim: str) -> CheckpointError:
        return CheckpointError(f"{path}: {key} is {value} but tensor {t.name} has shape {list(t.shape)} "
                               f"(ggml order), {dim}; {where.fix}")

    emb = by_name.get("token_embd.weight")
    if emb is not None and len(emb.shape) == 2:
        width, rows = emb.shape
        if width != cfg["hidden_size"]:
            raise refuse(f"{arch}.embedding_length", cfg["hidden_size"], emb, f"{width} wide")
        vocab = meta.get(f"{arch}.vocab_size")
        if vocab is not None and vocab != rows:
            raise refuse(f"{arch}.vocab_size", vocab, emb, f"{rows} rows, one per token")
        tokens = meta.get("tokenizer.ggml.tokens")
        if isinstance(tokens, list) and len(tokens) != rows:
            raise refuse("the token count of tokenizer.ggml.tokens", len(tokens), emb, f"{rows} rows, one per token")
    heads, kv = cfg["num_attention_heads"], cfg["num_key_value_heads"] or cfg["num_attention_heads"]
    head_dim = cfg["head_dim"] or cfg["hidden_size"] // heads
    per_head = (f"{arch}.attention.key_length ({head_dim})" if cfg["head_dim"] else
                f"{arch}.embedding_length / head_count ({head_dim})")
    for name, n, which in (("blk.0.attn_q.weight", heads, ""), ("blk.0.attn_k.weight", kv, "_kv")):
        t = by_name.get(name)
        if t is not None and len(t.shape) == 2 and t.shape[1] != n * head_dim:
            raise refuse(f"{arch}.attention.head_count{which} ({n}) x {per_head}", n * head_dim, t,
                         f"{t.shape[1]} rows")


_MOE_ONLY = frozenset({"qwen2moe", "qwen3moe", "gpt-oss"})  # no dense MLP width needed


def arch_spec(arch: str, meta: dict[str, Any]) -> tuple[str, str, bool]:
    """(HF model_type, HF architecture, q/k rows interleaved) of a file of llama.cpp architecture ``arch``."""
    if arch in MOE_ARCHS and meta.get(f"{arch}.expert_count"):
        return MOE_ARCHS[arch]
    return ARCHS[arch]


def _family_fields(path: Path, arch: str, meta: dict[str, Any], cfg: dict[str, Any],
                   tensors: dict[str, TensorEntry]) -> dict[str, Any]:
    """The HF config fields one family reads beyond the common ones, from ``<arch>.*`` keys as llama.cpp's
    converter writes them and llama.cpp reads them (its defaults where a key is absent)."""
    def get(key: str, default: Any = None) -> Any:
        return meta.get(f"{arch}.{key}", default)

    heads, hidden = cfg["num_attention_heads"], cfg["hidden_size"]
    head_dim = cfg["head_dim"] or (hidden // heads if isinstance(hidden, int) and isinstance(heads, int) else None)
    out: dict[str, Any] = {}
    experts = get("expert_count")
    if experts:
        out.update(num_local_experts=experts, num_experts=experts, num_experts_per_tok=get("expert_used_count"),
                   moe_intermediate_size=get("expert_feed_forward_length", cfg["intermediate_size"]))
    if arch in ("gemma2", "gemma3"):
        big = cfg["num_hidden_layers"] == GEMMA_27B_LAYERS[arch]
        out.update(hidden_activation="gelu_pytorch_tanh", sliding_window=get("attention.sliding_window"),
                   query_pre_attn_scalar=hidden // heads if big else head_dim,
                   final_logit_softcapping=_f32(get("final_logit_softcapping")),
                   attn_logit_softcapping=_f32(get("attn_logit_softcapping")))
        if arch == "gemma3":  # llama.cpp's Gemma 3: five sliding layers to one global, the local RoPE base apart
            out.update(sliding_window_pattern=6, layer_types=None,
                       rope_local_base_freq=_f32(get("rope.freq_base_swa", 10000.0)))
    elif arch == "phi3":
        rope_dims = get("rope.dimension_count")
        if rope_dims and head_dim:
            out["partial_rotary_factor"] = rope_dims / head_dim
        out["sliding_window"] = get("attention.sliding_window")
        if "rope_factors_long.weight" in tensors:  # LongRoPE (Phi-3.5 / Phi-4-mini): the tables are tensors
            out["original_max_position_embeddings"] = get("rope.scaling.original_context_length")
            out["rope_scaling"] = {"rope_type": "longrope",
                                   "long_factor": _tensor_list(path, tensors, "rope_factors_long.weight"),
                                   "short_factor": _tensor_list(path, tensors, "rope_factors_short.weight"),
                                   "original_max_position_embeddings": out["original_max_position_embeddings"]}
    elif arch == "qwen2moe":  # llama.cpp: every layer sparse, top-k weights not renormalised
        out.update(decoder_sparse_step=1, mlp_only_layers=[], norm_topk_prob=False, qkv_bias=True,
                   shared_expert_intermediate_size=get("expert_shared_feed_forward_length"))
    elif arch == "qwen3moe":  # llama.cpp: every layer sparse, top-k weights renormalised
        out.update(decoder_sparse_step=1, mlp_only_layers=[], norm_topk_prob=True)
    elif arch == "gpt-oss":
        out.update(intermediate_size=get("expert_feed_forward_length"), sliding_window=get("attention.sliding_window"),
                   attention_bias=True, layer_types=None)
    elif arch == "llama" and experts:  # Mixtral: no sliding window in llama.cpp's llama graph
        out.update(intermediate_size=cfg["intermediate_size"], sliding_window=None)
    return {k: v for k, v in out.items() if v is not None or k in ("layer_types", "sliding_window")}


def _tensor_list(path: Path, tensors: dict[str, TensorEntry], name: str) -> list[float]:
    """A small float32 tensor's values (Phi-3's LongRoPE factor tables)."""
    t = tensors.get(name)
    if t is None:
        raise CheckpointError(f"{path}: LongRoPE needs both rope_factors_long and rope_factors_short; {name} is absent")
    return [float(v) for v in read_bytes(path, t).view(np.float32)]


class GGUFIndex:
    """The tensors of one GGUF file by HF name: read dequantized, or as codes where they are exact (:data:`KEPT`).

    The loader's ``read(name)``/``name in index`` pair (``materialize``), plus
    :meth:`int4_tensors` / :meth:`int8_block_tensors` for the matrices :meth:`kept` names. :meth:`locate`
    says where a tensor's bytes are for the offload runtime: float ones are streamed as stored (or converted
    as read), block-format matrices are rebuilt from their stored bytes by the loader's own code (only experts
    on disk do so, in their cache slot; an offloaded whole layer of them is written to the offload file once
    loaded, as for converted checkpoints).
    """

    def __init__(self, path: Path, header: GGUFHeader, config: dict[str, Any]):
        check_end(header)  # a model's last tensor must hold the bytes after it (a listing reads headers only)
        self.path = path
        self.config = config
        self.arch = header.fields["general.architecture"]  # llama.cpp's name: llama, qwen2, gemma3, qwen3moe ...
        self._interleaved = arch_spec(self.arch, header.fields)[2]
        self._heads = config["num_attention_heads"]
        self._kv_heads = config["num_key_value_heads"]
        # Gemma's norms are stored as 1 + w (NORM_SHIFT_ARCHS)
        self._norm_shift = 1.0 if self.arch in NORM_SHIFT_ARCHS else 0.0
        n_experts = config.get("num_local_experts") or 0
        self._tensors: dict[str, TensorEntry] = {}
        unknown = []
        for t in header.tensors:
            h = hf_name(t.name, self.arch)
            stacked = expert_names(t.name, n_experts) if n_experts else None
            if stacked is not None:
                for e, name in enumerate(stacked):
                    self._tensors[name] = expert_slice(path, t, e, n_experts)
                continue
            if h is None:
                if t.name not in IGNORED:
                    unknown.append(t.name)
                continue
            if h.endswith("mlp.shared_expert_gate.weight") and len(t.shape) == 1:
                t = replace(t, shape=(t.shape[0], 1))  # llama.cpp's quantizer writes the [1, hidden] gate as 1-D
            self._tensors[h] = t
        if unknown:
            more = f" (and {len(unknown) - 1} more)" if len(unknown) > 1 else ""
            raise UnsupportedModelError(f"{path}: tensor {unknown[0]}{more} has no llmsys counterpart")
        for t in self._tensors.values():  # integer tensors are not weights llmsys decodes: say so before reading
            if _qtype(t) in INTEGER_TYPES:
                raise _undecodable(path, t.name, _qtype(t))

    def __contains__(self, name: str) -> bool:
        return name in self._tensors

    def names(self) -> list[str]:
        """Every HF tensor name the file holds (each expert of a stacked tensor apart)."""
        return list(self._tensors)

    def info(self, name: str) -> GGUFTensorInfo:
        t = self._tensors[name]
        return GGUFTensorInfo(t.name, _qtype(t), tuple(reversed(t.shape)), t.offset, t.nbytes)

    def locate(self, name: str) -> tuple[Path, Any] | None:
        """Where ``name``'s bytes are, for the offload runtime to read them from this file at run time: a
        ``TensorInfo`` where they are the HF tensor in a float type (read as stored, or converted as read); an
        ``offload.experts.StoredTensor`` for a matrix in a block format (rebuilt from its codes as the resident
        load rebuilds it, :meth:`kept_layer`, or dequantized as it dequantizes it); None where the stored layout
        is another (``llama``'s interleaved q/k rows, Gemma's ``1 + w`` norms, block-format vectors)."""
        from llmsys.engine.loader.safetensors_io import TensorInfo
        from llmsys.offload.experts import StoredTensor

        t = self._tensors.get(name)
        if t is None or (self._interleaved and (".self_attn.q_proj." in name or ".self_attn.k_proj." in name)):
            return None
        if self._norm_shift and name.endswith("norm.weight"):
            return None
        kind, shape = _qtype(t), tuple(reversed(t.shape))
        if kind in PLAIN_TYPES:
            return self.path, TensorInfo(name, PLAIN_TYPES[kind], shape, t.offset, t.nbytes)
        if len(shape) != 2:
            return None
        if kind in KEPT:  # as materialize_gguf without --quant: the codes kept (a run with --quant loads in memory)
            fill = partial(self._fill_from, name) if kind in FILLED else None
            return self.path, StoredTensor(t.offset, t.nbytes, shape, layer=partial(self._layer_from, name, KEPT[kind]),
                                           fill=fill)
        return self.path, StoredTensor(t.offset, t.nbytes, shape, decode=partial(self._tensor_from, name))

    def _layer_from(self, name: str, target: str, raw: torch.Tensor, bias: torch.Tensor | None) -> Any:
        """``StoredTensor.layer``: :meth:`kept_layer` of ``name``'s stored bytes ``raw`` (``uint8 [nbytes]``)."""
        return self.kept_layer(name, target, bias, raw=raw)

    def _fill_from(self, name: str, raw: torch.Tensor, out: dict[str, torch.Tensor]) -> bool:
        """``StoredTensor.fill``: :meth:`kept_layer`'s tensors of ``name`` written from its stored bytes ``raw``
        straight into ``out`` (the layer's buffers by name, in its own dtypes, shapes and strides) by one C pass
        (``kernels.repack_q4k`` / ``repack_q6k`` / ``repack_q4_0`` / ``repack_q8_0``), their float factors checked
        finite as ``kept_layer`` checks them.
        False, with nothing written, where ``out`` is not the layout this writes (another kernel build's layer,
        no C library): the caller builds the layer instead."""
        t = self._tensors[name]
        n, k = int(t.shape[1]), int(t.shape[0])
        kind = _qtype(t)
        reordered = self._interleaved and (".self_attn.q_proj." in name or ".self_attn.k_proj." in name)
        if kind not in FILLED or set(out) != set(FILLED[kind]) or reordered:
            return False
        o = out
        try:
            if kind == "Q4_K":
                if any(s != 0 for z in ("zeros_u8", "zeros_gm") for s in o[z].stride()):
                    return False  # offsets layers hold their all-zero zeros as one byte
                if not repack_q4k(raw, n, k, o["packed"], o["k_sc"], o["k_m"], o["k_d"], o["k_dmin"]):
                    return False
                for z in ("zeros_u8", "zeros_gm"):
                    o[z].as_strided((1,), (1,)).zero_()
            elif kind == "Q4_0":  # zeros 8, as two uint8 tables (row- and group-major)
                scales, zeros = o["scales_orig"], (o["zeros_u8"], o["zeros_gm"])
                if scales.stride() != (1, n) or not all(z.is_contiguous() for z in zeros):
                    return False
                if not repack_q4_0(raw, n, k, o["packed"], scales.t()):
                    return False
                for z in zeros:
                    z.fill_(8)
            elif kind == "Q8_0":
                if not repack_q8_0(raw, n, k, o["qweight"], o["block_scales"]):
                    return False
            elif not repack_q6k(raw, n, k, o["qweight"], o["block_scales"], o["super_scales"]):
                return False
        except ValueError:  # a dtype, shape or stride the kernel does not write
            return False
        for key in FILLED[kind]:  # the blocks' float factors, as kept_layer checks them (its "scales": scales_orig)
            what = BLOCK_FACTORS.get(key.removesuffix("_orig"))
            if what is not None and o[key].is_floating_point():
                validate.check_finite(f"{self.info(name).gguf_name} ({what})", o[key], self.path)
        return True

    def _tensor_from(self, name: str, raw: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """``StoredTensor.decode``: :meth:`read` of ``name``'s stored bytes ``raw`` (``uint8 [nbytes]``)."""
        return self._rows_in_hf_order(name, self._dequantize(self._tensors[name], dtype, raw))

    def kept_layer(self, name: str, target: str, bias: torch.Tensor | None, check_finite: bool = True,
                   raw: torch.Tensor | None = None) -> Any:
        """The quantized layer matrix ``name`` becomes with its codes kept (``target``: :func:`kept_as`'s
        ``int4:g32`` / ``int8:g32`` / ``int8:g16``), read from the file or from its stored bytes ``raw``; the
        blocks' float factors checked finite (a one-line error naming the tensor)."""
        from llmsys.quant import Int4Linear, Int8BlockLinear

        if target == "int4:g32":
            t = self.int4_tensors(name, raw)
        else:
            t = self.int8_block_tensors(name, raw)
        if check_finite:
            for key, what in BLOCK_FACTORS.items():
                if key in t and t[key].is_floating_point():
                    validate.check_finite(f"{self.info(name).gguf_name} ({what})", t[key], self.path)
        if target == "int4:g32":
            return Int4Linear.from_quantized({**t, "bias": bias}, in_features=self.info(name).shape[1])
        return Int8BlockLinear.from_quantized({**t, "bias": bias})

    def _bytes(self, t: TensorEntry, start: int = 0, length: int | None = None,
               raw: torch.Tensor | None = None) -> np.ndarray:
        """``read_bytes`` of ``t``, or the same bytes of its stored copy ``raw`` (``uint8 [t.nbytes]``)."""
        if raw is None:
            return read_bytes(self.path, t, start, length)
        if raw.numel() != t.nbytes:
            raise CheckpointError(f"{self.path}: tensor {t.name} holds {t.nbytes} bytes, {raw.numel()} were handed in")
        return raw[start : t.nbytes if length is None else start + length].numpy()

    def qtypes(self, matrices_only: bool = False) -> Counter[str]:
        """How many tensors (or 2-D ones only) of each GGUF type the model reads."""
        return Counter(_qtype(t) for t in self._tensors.values() if not matrices_only or len(t.shape) == 2)

    def weight_bytes(self, dtype: torch.dtype) -> WeightBytes:
        """Run-time bytes per weight of the matrices as loaded without ``--quant`` (Q4_0 kept as
        int4:g32 codes, the rest dequantized to ``dtype``), per part of the model, for the planner."""
        from llmsys.offload.plan import ExpertBytes, WeightBytes

        elt = torch.tensor([], dtype=dtype).element_size()

        def part(names: list[str]) -> float:
            sized = [(float(self._tensors[n].n_elements), KEPT_BYTES[self.kept(n)] if self.kept(n) else elt)
                     for n in names if len(self._tensors[n].shape) == 2]
            total = sum(n for n, _ in sized)
            return sum(n * b for n, b in sized) / total if total else float(elt)

        def formats(names: list[str]) -> tuple[tuple[str, float], ...]:  # (format, share of the part's weights)
            count: dict[str, float] = {}
            for n in names:
                if len(self._tensors[n].shape) == 2:
                    f = KEPT_FORMATS[self.kept(n)] if self.kept(n) else str(dtype).removeprefix("torch.")
                    count[f] = count.get(f, 0.0) + float(self._tensors[n].n_elements)
            total = sum(count.values())
            return tuple((f, c / total) for f, c in sorted(count.items())) if total else ()

        # Experts counted exactly per sparse layer: run-time bytes (kept codes, or dequantized / converted to
        # dtype) and the bytes the file stores, which a read of an expert on disk takes (locate's StoredTensor).
        run: dict[tuple[int, int], float] = {}
        stored: dict[tuple[int, int], int] = {}
        for n, t in self._tensors.items():
            m = _EXPERT.match(n)
            if m is None:
                continue
            key = (int(m.group(1)), int(m.group(2)))
            per = KEPT_BYTES[self.kept(n)] if self.kept(n) else elt
            run[key] = run.get(key, 0.0) + float(t.n_elements) * per
            stored[key] = stored.get(key, 0) + t.nbytes
        experts: dict[int, ExpertBytes] = {}
        for (layer, e), b in run.items():  # the largest expert of a layer (a stacked tensor's are all alike)
            had = experts.get(layer)
            experts[layer] = ExpertBytes(layer, max(int(b), had.run_bytes if had else 0),
                                         max(stored[(layer, e)], had.stored_bytes if had else 0))
        layers = [n for n in self._tensors if n.startswith("model.layers.") and _EXPERT.match(n) is None]
        embed = ["model.embed_tokens.weight"]
        head = ["lm_head.weight"] if "lm_head.weight" in self else embed
        return WeightBytes(part(layers), part(embed), part(head), tuple(experts[i] for i in sorted(experts)),
                           formats(layers), formats(embed), formats(head))

    def kept(self, name: str) -> str | None:
        """The GGUF type of ``name`` (a matrix) when its codes are kept as they are (:data:`KEPT`), else None."""
        t = self._tensors.get(name)
        kind = None if t is None else _qtype(t)
        return kind if kind in KEPT and len(t.shape) == 2 else None

    # -- reading ------------------------------------------------------------------
    def read(self, name: str, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """``name`` as a float tensor of ``dtype`` in HF layout (q/k rows in rotate-half order)."""
        t = self._tensors[name]
        if self._norm_shift and name.endswith("norm.weight"):  # the file's 1 + w, as float32, less the 1
            return (self._dequantize(t, torch.float32) - self._norm_shift).to(dtype)
        return self._rows_in_hf_order(name, self._dequantize(t, dtype))

    def int4_tensors(self, name: str, raw: torch.Tensor | None = None) -> dict[str, torch.Tensor]:
        """A Q4_0, Q4_1 or Q4_K matrix as canonical int4 tensors (``quant/README.md``), codes as stored,
        group 32, rows in HF order: ``qweight uint8 [N, K/2]`` and ``[N, K/32]`` scales and zeros --
        Q4_0: the blocks' fp16 scales, zeros 8; Q4_1 / Q4_K: float32 scales, zeros 0 and float32
        ``offsets`` (``w = q * scale + offset``: Q4_1's ``d`` and ``m``; Q4_K's ``d * sc`` and
        ``-(dmin * m)``, the products llama.cpp's dequantization rounds to float32). ``raw``: the stored bytes,
        already read (an expert read at run time, ``locate``)."""
        t = self._tensors[name]
        n, k = int(t.shape[1]), int(t.shape[0])
        kind = _qtype(t)
        qweight = torch.empty(n, k // 2, dtype=torch.uint8)
        stored = scales = offsets = None
        if kind == "Q4_K":  # sc, m [N, G] uint8 and d, dmin [N, G / 8] fp16, as the file holds them
            stored = [torch.empty(n, k // 32, dtype=torch.uint8) for _ in range(2)]
            stored += [torch.empty(n, k // 256, dtype=torch.float16) for _ in range(2)]
        else:  # Q4_1: float32 scales and offsets; Q4_0: fp16 scales, zero 8
            scales = torch.empty(n, k // 32, dtype=torch.float32 if kind == "Q4_1" else torch.float16)
            offsets = torch.empty(n, k // 32) if kind == "Q4_1" else None
        for r0, r1, piece in self._row_pieces(t, n, raw):  # a piece at a time: an embedding's temporaries are GBs
            rows = r1 - r0
            if kind == "Q4_K":
                codes, *parts = _q4k_parts(piece.view(rows, k // 256, Q4K_BLOCK))
                for dst, src in zip(stored, parts):
                    dst[r0:r1] = src
            else:
                width = 20 if kind == "Q4_1" else 18
                blocks = piece.view(rows, k // 32, width)  # [rows, G, bytes]: d (fp16)[, m (fp16)], 16 bytes of codes
                scales[r0:r1] = blocks[..., :2].contiguous().view(torch.float16).view(rows, k // 32)
                if offsets is not None:
                    offsets[r0:r1] = blocks[..., 2:4].contiguous().view(torch.float16).view(rows, k // 32)
                qs = blocks[..., width - 16 :]  # [rows, G, 16]: byte i holds code i (low nibble), i + 16 (high)
                codes = torch.cat([qs & 15, qs >> 4], dim=-1).reshape(rows, k)  # [rows, K] in k order
            qweight[r0:r1] = pack_int4(codes)
        if stored is not None:  # Int4Linear keeps these (kernels.KScales) and derives the float scales from them
            out = {"qweight": qweight, "zeros": torch.zeros(n, k // 32), **dict(zip(KSCALE_KEYS, stored))}
        elif offsets is None:
            out = {"qweight": qweight, "scales": scales, "zeros": torch.full_like(scales, 8.0)}
        else:
            out = {"qweight": qweight, "scales": scales, "zeros": torch.zeros_like(scales), "offsets": offsets}
        out = {key: self._rows_in_hf_order(name, v) for key, v in out.items()}
        for key in KSCALE_KEYS if stored is not None else ():
            out[key] = out[key].t().contiguous()  # group-major, as the kernels read them
        return out

    def _row_pieces(self, t: TensorEntry, n: int, raw: torch.Tensor | None = None):
        """``(r0, r1, uint8 [r1 - r0, row bytes])`` over the rows of a block-quantized matrix, read
        :data:`DEQUANT_ROWS` rows at a time (from ``raw``, its stored bytes, when given)."""
        row_bytes = t.nbytes // n
        for r0 in range(0, n, DEQUANT_ROWS):
            r1 = min(n, r0 + DEQUANT_ROWS)
            yield r0, r1, torch.from_numpy(self._bytes(t, r0 * row_bytes, (r1 - r0) * row_bytes, raw))

    def int8_block_tensors(self, name: str, raw: torch.Tensor | None = None) -> dict[str, torch.Tensor]:
        """A Q8_0, Q5_0, Q4_0, Q6_K or Q5_K matrix as :class:`Int8BlockLinear` tensors (Q5_K: codes 0..31, float32
        ``block_scales`` and ``offsets`` ``[K/32, N]``, see :func:`_q5k_parts`): ``qweight int8 [N, K]`` (Q8_0's
        codes as stored, Q5_0's 5-bit codes minus 16, Q4_0's minus 8, Q6_K's 6-bit codes minus 32) and the
        blocks' scales group-major: fp16 ``block_scales [K/32, N]``; Q6_K's int8 ``sc`` per 16 columns
        ``block_scales [K/16, N]`` and fp16 ``d`` per 256 ``super_scales [K/256, N]``; rows in HF order.
        ``raw``: the stored bytes, already read (as :meth:`int4_tensors`)."""
        t = self._tensors[name]
        n, k = int(t.shape[1]), int(t.shape[0])
        kind = _qtype(t)
        if kind == "Q5_K":  # a piece of rows at a time, as Q4_K in int4_tensors
            q, fs, fo = torch.empty(n, k, dtype=torch.int8), torch.empty(n, k // 32), torch.empty(n, k // 32)
            for r0, r1, piece in self._row_pieces(t, n, raw):
                q[r0:r1], fs[r0:r1], fo[r0:r1] = _q5k_parts(piece.view(r1 - r0, k // 256, Q5K_BLOCK))
            q, fs, fo = (self._rows_in_hf_order(name, v) for v in (q, fs, fo))
            return {"qweight": q.contiguous(), "block_scales": fs.t().contiguous(), "offsets": fo.t().contiguous()}
        if kind == "Q6_K":  # a piece of rows at a time, as Q4_K in int4_tensors
            q, sc = torch.empty(n, k, dtype=torch.int8), torch.empty(n, k // 16, dtype=torch.int8)
            d = torch.empty(n, k // 256, dtype=torch.float16)
            for r0, r1, piece in self._row_pieces(t, n, raw):
                q[r0:r1], sc[r0:r1], d[r0:r1] = _q6k_parts(piece.view(r1 - r0, k // 256, Q6K_BLOCK))
            q, sc, d = (self._rows_in_hf_order(name, v) for v in (q, sc, d))
            return {"qweight": q.contiguous(), "block_scales": sc.t().contiguous(), "super_scales": d.t().contiguous()}
        if kind == "Q4_0":
            c = self.int4_tensors(name, raw)
            q = (unpack_int4(c["qweight"]).to(torch.int16) - 8).to(torch.int8)  # [N, K]
            return {"qweight": q.contiguous(), "block_scales": c["scales"].t().contiguous()}
        q5 = kind == "Q5_0"
        raw = torch.from_numpy(self._bytes(t, raw=raw)).view(n, k // 32, 22 if q5 else 34)  # [N, G, bytes]
        d = raw[..., :2].contiguous().view(torch.float16).view(n, k // 32)  # [N, G]
        if q5:  # d, qh (bit j: code j's 5th bit), qs (code j's low 4 bits: byte j % 16, low nibble for j < 16)
            qh = raw[..., 2:6].contiguous().view(torch.int32)  # [N, G, 1]
            bits = (qh >> torch.arange(32, dtype=torch.int32)) & 1  # [N, G, 32]
            qs = raw[..., 6:].to(torch.int32)
            low = torch.cat([qs & 15, qs >> 4], dim=-1)  # [N, G, 32]
            q = ((low | (bits << 4)) - 16).to(torch.int8).reshape(n, k)
        else:
            q = raw[..., 2:].contiguous().view(torch.int8).reshape(n, k)  # [N, K]
        q, d = self._rows_in_hf_order(name, q), self._rows_in_hf_order(name, d)
        return {"qweight": q.contiguous(), "block_scales": d.t().contiguous()}

    def _rows_in_hf_order(self, name: str, t: torch.Tensor) -> torch.Tensor:
        if not self._interleaved:
            return t
        if ".self_attn.q_proj." in name:
            return interleaved_to_hf(t, self._heads).contiguous()
        if ".self_attn.k_proj." in name:
            return interleaved_to_hf(t, self._kv_heads).contiguous()
        return t

    def _dequantize(self, t: TensorEntry, dtype: torch.dtype, stored: torch.Tensor | None = None) -> torch.Tensor:
        """The tensor as ``dtype`` ``[out, in]``, read and decoded :data:`DEQUANT_ROWS` rows at a time (the
        raw bytes of one piece, not of the whole tensor, beside the output; ``stored``: its bytes, already read)."""
        import gguf

        kind = gguf.GGMLQuantizationType(t.qtype)
        shape = tuple(reversed(t.shape))  # [out, in]
        rows = shape[0] if len(shape) == 2 else 1
        row_bytes = t.nbytes // rows
        out = torch.empty(shape, dtype=dtype)
        flat = out.view(rows, -1)
        for r0 in range(0, rows, DEQUANT_ROWS):
            r1 = min(rows, r0 + DEQUANT_ROWS)
            raw = self._bytes(t, r0 * row_bytes, (r1 - r0) * row_bytes, stored).reshape(r1 - r0, row_bytes)
            if kind == gguf.GGMLQuantizationType.F32:
                piece = torch.from_numpy(raw.view(np.float32))
            elif kind == gguf.GGMLQuantizationType.F16:
                piece = torch.from_numpy(raw.view(np.float16))
            elif kind == gguf.GGMLQuantizationType.BF16:
                piece = torch.from_numpy(raw.view(np.uint16)).view(torch.bfloat16)
            else:
                piece = _dequant_rows(raw, kind, self.path, t.name)
            flat[r0:r1] = piece
        return out


def _q4k_parts(blocks: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """Q4_K super-blocks ``uint8 [N, S, 144]`` -> codes ``uint8 [N, S * 256]`` in k order, and the scales as
    stored (:func:`_k_scales`): ``sc``, ``m`` per 32 columns, ``d``, ``dmin`` per 256.

    A super-block: ``d``, ``dmin`` (fp16), 12 bytes holding eight 6-bit ``sc`` and eight 6-bit ``m``
    (sub-blocks 0-3 in the low 6 bits of bytes 0-3 / 4-7; 4-7 in the nibbles of bytes 8-11 with their top
    2 bits in the high bits of bytes 0-3 / 4-7: llama.cpp's ``get_scale_min_k4``), then 128 bytes of
    codes: 32 bytes per 64 columns, low nibbles the first 32 columns, high nibbles the next 32."""
    n, sb, _ = blocks.shape
    qs = blocks[..., 16:].reshape(n, sb, 4, 32)  # [N, S, 4 pairs of sub-blocks, 32]
    codes = torch.stack([qs & 15, qs >> 4], dim=3).reshape(n, sb * 256)  # [N, S, 4, 2, 32] -> k order
    return codes, *_k_scales(blocks)


def _k_scales(blocks: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Q4_K / Q5_K super-blocks ``uint8 [N, S, bytes]`` (``d``, ``dmin``, 12 bytes of 6-bit ``sc`` / ``m`` first)
    -> ``sc``, ``m`` uint8 ``[N, S * 8]`` (one per 32 columns, ``get_scale_min_k4``) and ``d``, ``dmin`` fp16
    ``[N, S]``."""
    n, sb, _ = blocks.shape
    d = blocks[..., 0:2].contiguous().view(torch.float16).view(n, sb)
    dmin = blocks[..., 2:4].contiguous().view(torch.float16).view(n, sb)
    sm = blocks[..., 4:16]  # [N, S, 12]
    lo_sc, lo_m = sm[..., 0:4] & 63, sm[..., 4:8] & 63  # sub-blocks 0-3
    hi_sc = (sm[..., 8:12] & 15) | ((sm[..., 0:4] >> 6) << 4)  # sub-blocks 4-7
    hi_m = (sm[..., 8:12] >> 4) | ((sm[..., 4:8] >> 6) << 4)
    sc = torch.cat([lo_sc, hi_sc], dim=-1).reshape(n, sb * 8)
    m = torch.cat([lo_m, hi_m], dim=-1).reshape(n, sb * 8)
    return sc, m, d, dmin


def _k_floats(sc: torch.Tensor, m: torch.Tensor, d: torch.Tensor, dmin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """float32 ``d * sc`` and ``-(dmin * m)`` per 32 columns ``[N, G]`` from :func:`_k_scales`' row-major parts
    (``kernels.KScales``' products; Q5_K keeps these floats)."""
    ks = KScales(sc.t(), m.t(), d.t(), dmin.t())
    return ks.scales(), ks.offsets()


def _q5k_parts(blocks: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Q5_K super-blocks ``uint8 [N, S, 176]`` -> codes ``int8 [N, S * 256]`` (0..31) in k order and per 32
    columns float32 scales and offsets ``[N, S * 8]`` (``dequantize_row_q5_K``: per 64 columns 32 bytes of
    codes, low nibbles the first 32 columns, high nibbles the next 32; the 5th bit of column 64j + l is bit 2j
    of byte l of the 32 high-bit bytes, of column 64j + 32 + l bit 2j + 1)."""
    n, sb, _ = blocks.shape
    scales, offsets = _k_floats(*_k_scales(blocks))
    qh = blocks[..., 16:48].to(torch.int16)  # [N, S, 32]
    qs = blocks[..., 48:].reshape(n, sb, 4, 32).to(torch.int16)  # [N, S, 4, 32]
    bits = torch.arange(8, dtype=torch.int16).view(4, 2, 1)  # [pair j, half h, 1]: bit 2j + h
    high = ((qh[:, :, None, None, :] >> bits) & 1) << 4  # [N, S, 4, 2, 32]
    codes = torch.stack([qs & 15, qs >> 4], dim=3) | high  # [N, S, 4, 2, 32]
    return codes.to(torch.int8).reshape(n, sb * 256), scales, offsets


def _q6k_parts(blocks: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Q6_K super-blocks ``uint8 [N, S, 210]`` -> codes minus 32 ``int8 [N, S * 256]`` in k order, the int8
    scales ``sc`` per 16 columns ``[N, S * 16]`` and fp16 ``d`` per 256 ``[N, S]`` as stored (the weight is
    ``(d * sc) * (q - 32)``; llama.cpp's ``dequantize_row_q6_K``: per 128 columns,
    64 bytes of low nibbles -- columns l and 64 + l in byte l, 32 + l and 96 + l in byte 32 + l -- and 32
    bytes whose bit pairs 0-1, 2-3, 4-5, 6-7 are the high bits of columns l, 32 + l, 64 + l, 96 + l; the
    16 int8 scales go to the 16 runs of 16 columns in order)."""
    n, sb, _ = blocks.shape
    ql = blocks[..., 0:128].reshape(n, sb, 2, 64).to(torch.int16)  # [N, S, half, 64]
    qh = blocks[..., 128:192].reshape(n, sb, 2, 32).to(torch.int16)
    lo, hi = ql[..., :32], ql[..., 32:]
    cols = [(lo & 15) | ((qh & 3) << 4), (hi & 15) | (((qh >> 2) & 3) << 4),
            (lo >> 4) | (((qh >> 4) & 3) << 4), (hi >> 4) | (((qh >> 6) & 3) << 4)]
    q = (torch.stack(cols, dim=3) - 32).to(torch.int8).reshape(n, sb * 256)  # [N, S, 2, 4, 32] in k order
    sc = blocks[..., 192:208].contiguous().view(torch.int8).reshape(n, sb * 16)
    d = blocks[..., 208:210].contiguous().view(torch.float16).reshape(n, sb)
    return q, sc, d


def _dequant_rows(blocks: np.ndarray, kind: Any, path: Path, name: str) -> torch.Tensor:
    """Rows of one block-quantized tensor ``uint8 [rows, row bytes] -> float32 [rows, in]``.

    Q8_0 and Q4_0 are decoded in torch (the gguf package's numpy decoder took 5.6 s on a
    151936-row Q8_0 embedding); the rest through ``gguf.quants.dequantize``."""
    import gguf

    rows = blocks.shape[0]
    if kind in (gguf.GGMLQuantizationType.Q8_0, gguf.GGMLQuantizationType.Q4_0):
        width = 34 if kind == gguf.GGMLQuantizationType.Q8_0 else 18
        raw = torch.from_numpy(blocks).view(rows, -1, width)  # [rows, G, block bytes]
        d = raw[..., :2].contiguous().view(torch.float16).float()  # [rows, G, 1]
        if width == 34:
            q = raw[..., 2:].contiguous().view(torch.int8).float()  # [rows, G, 32]
        else:
            qs = raw[..., 2:]
            q = torch.cat([qs & 15, qs >> 4], dim=-1).float() - 8.0  # [rows, G, 32]
        return (q * d).reshape(rows, -1)
    try:
        return torch.from_numpy(gguf.quants.dequantize(blocks, kind))
    except NotImplementedError:
        raise _undecodable(path, name, kind.name) from None


def _undecodable(path: Path, name: str, kind: str) -> UnsupportedModelError:
    return UnsupportedModelError(
        f"{path}: tensor {name} is stored as {kind}, which llmsys cannot decode; supported: "
        f"F32, F16, BF16, Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, Q2_K, Q3_K, Q4_K, Q5_K, Q6_K and the others "
        "the gguf package decodes"
    )


def open_index(path: Path) -> GGUFIndex:
    """The config and tensor index of a GGUF file (nothing dequantized yet)."""
    h = read_header(path)
    return GGUFIndex(path, h, hf_config(path, h))


def materialize_gguf(model: Any, index: GGUFIndex, dtype: torch.dtype, device: torch.device,
                     make_linear: Any = None, progress: bool = True, offload: Any = None,
                     check_finite: bool = True) -> None:
    """Fill ``model``'s meta tensors from the GGUF (``common.materialize`` with a GGUF hook).

    Q4_0, Q4_1 and Q4_K matrices become :class:`Int4Linear` layers from their codes (never dequantized) unless
    ``make_linear`` asks for another format than int4:g32; other tensors arrive dequantized to
    ``dtype`` and go to ``make_linear`` (``--quant``) or stay float. The read of a Q4_0 matrix
    hands the hook a meta tensor of its shape (no bytes decoded), since the hook rebuilds it
    from the codes."""
    from llmsys.engine.loader.common import materialize
    from llmsys.quant.embedding import QuantEmbedding

    spec = getattr(make_linear, "spec", None)

    def exact(name: str) -> str | None:
        return kept_as(index.kept(name), spec)

    def read(name: str) -> torch.Tensor:
        if exact(name):
            return torch.empty(index.info(name).shape, device="meta")
        return index.read(name, dtype if dtype.is_floating_point else torch.float32)

    def hook(mod_name: str, w: torch.Tensor, b: torch.Tensor | None) -> Any:
        name = mod_name + ".weight"
        target = exact(name)
        if target not in ("int4:g32", "int8:g32", "int8:g16"):
            return make_linear(mod_name, w, b) if make_linear is not None else None
        # (the layer an expert read at run time becomes too: locate's StoredTensor, the same call)
        layer = index.kept_layer(name, target, b, check_finite)
        return QuantEmbedding(layer, dtype) if mod_name == "model.embed_tokens" else layer

    materialize(model, read, index.__contains__, dtype, device, index.path, hook, progress, offload, check_finite)


def conversions(index: GGUFIndex, dtype: torch.dtype, make_linear: Any = None) -> dict[str, str]:
    """What each GGUF tensor type of the file became at load, for reports: e.g.
    ``{"Q4_0 (168)": "int4:g32, codes as stored", "Q6_K (1)": "dequantized to bfloat16"}`` (1-D tensors
    of a kept type, if any, are dequantized like the rest)."""
    spec = getattr(make_linear, "spec", None)
    dt = str(dtype).removeprefix("torch.")
    out: dict[str, str] = {}
    matrices = index.qtypes(matrices_only=True)
    for qtype, n in sorted(index.qtypes().items()):
        target = kept_as(qtype, spec)
        if target is not None:
            what = f"{target}, codes as stored"
        elif qtype in ("F32", "F16", "BF16"):
            what = dt if spec is None or not matrices[qtype] else f"{dt}; matrices quantized to {spec.name} (--quant)"
        elif spec is None:
            what = f"dequantized to {dt}"
        else:
            what = f"dequantized, matrices re-quantized to {spec.name} (--quant)"
        out[f"{qtype} ({n})"] = what
    return out
