"""The checks every checkpoint passes before anything big is allocated.

Every format becomes an HF config dict and a meta skeleton beside the stored shapes before its weights
are read, so one set of rules covers them all; unchecked, a bad value surfaces far from its cause
(``hidden_size`` 0 as a ZeroDivisionError, ``max_position_embeddings`` 10^12 as an 8 TB RoPE table). Each
failure is one line (:mod:`llmsys.kernels.common.errors`) naming file, field or tensor, value, limit and
fix. The limits sit far above every supported model (Llama 3.1 405B's sizes, Qwen2.5-1M's 1,010,000
positions, 262,144-token vocabularies): they stop only values that would allocate without bound.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from llmsys.kernels.common.errors import CheckpointError, UnsupportedModelError

# Integer fields: (required, upper limit). Optional ones may be absent or null (then derived as HF does).
INT_FIELDS: dict[str, tuple[bool, int]] = {
    "vocab_size": (True, 1 << 22),
    "hidden_size": (True, 1 << 16),
    "intermediate_size": (True, 1 << 18),
    "num_hidden_layers": (True, 1 << 12),
    "num_attention_heads": (True, 1 << 12),
    "num_key_value_heads": (False, 1 << 12),
    "head_dim": (False, 1 << 12),
    # The RoPE table is built for every position (rope_cache): 2^24 x head_dim 128 float32 is 8 GiB.
    "max_position_embeddings": (False, 1 << 24),
    "sliding_window": (False, 1 << 30),
    # Mixture of experts (Qwen2/3-MoE: num_experts; Mixtral: num_local_experts). Qwen3-235B: 128 experts of 1536.
    "num_experts": (False, 1 << 12),
    "num_local_experts": (False, 1 << 12),
    "num_experts_per_tok": (False, 1 << 12),
    "moe_intermediate_size": (False, 1 << 18),
    "shared_expert_intermediate_size": (False, 1 << 18),
    "decoder_sparse_step": (False, 1 << 12),
}
BOOL_FIELDS = ("tie_word_embeddings", "attention_bias")
# The MLP is gated: act(gate) * up with silu (SwiGLU; transformers' ACT2FN maps "swish" to the same
# function) or gelu_pytorch_tanh (GeGLU: Gemma); engine.models.base.GATE_ACTIVATIONS implements them.
ACTIVATIONS = ("silu", "swish", "gelu_pytorch_tanh")
MAX_RMS_EPS = 1.0  # real models use 1e-6 .. 1e-5; eps >= 1 swamps the mean square of unit-scale activations


@dataclass(frozen=True)
class Origin:
    """Where a config came from, for messages: the file, how to fix it, and each HF field's name in that
    file where it differs (a GGUF key, a llama2.c header field)."""

    path: Path | str
    fix: str = "fix config.json or download the model again"
    keys: Mapping[str, str] = field(default_factory=dict)

    def label(self, name: str) -> str:
        key = self.keys.get(name)
        return name if key is None or key == name else f"{name} ({key})"

    def error(self, name: str, value: Any, limit: str, exc: type[Exception] = CheckpointError) -> Exception:
        """``<file>: <field> is <value>; <limit>; <fix>`` as ``exc``."""
        shown = repr(value)
        if len(shown) > 60:
            shown = shown[:57] + "..."
        return exc(f"{self.path}: {self.label(name)} is {shown}; {limit}; {self.fix}")


def config_object(cfg: Any, path: Path | str) -> dict[str, Any]:
    """``config.json`` must hold a JSON object (a list or a string has no fields to read)."""
    if not isinstance(cfg, dict):
        raise CheckpointError(f"{path}: holds a JSON {type(cfg).__name__}, not an object of model fields; "
                              "fix config.json or download the model again")
    return cfg


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_number(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def check_config(cfg: Mapping[str, Any], origin: Origin) -> None:
    """Types, ranges and divisibility of the raw fields, before any is computed with (``TransformerArgs._common``
    divides ``hidden_size`` by ``num_attention_heads``)."""
    for name, (required, limit) in INT_FIELDS.items():
        v = cfg.get(name)
        if name == "sliding_window" and v == 0 and cfg.get("use_sliding_window") is False:
            continue  # transformers 5 writes Qwen2-MoE's unused window as 0
        if v is None:
            if required:
                raise CheckpointError(f"{origin.path}: {origin.label(name)} is missing; {origin.fix}")
            continue
        if not _is_int(v):
            raise origin.error(name, v, "it must be a whole number (JSON integer)")
        if not 1 <= v <= limit:
            raise origin.error(name, v, f"it must be between 1 and {limit}")
    for name in BOOL_FIELDS:
        v = cfg.get(name)
        if v is not None and not isinstance(v, bool):
            raise origin.error(name, v, "it must be true or false")
    heads = cfg["num_attention_heads"]
    kv = cfg.get("num_key_value_heads") or heads
    if heads % kv:
        raise origin.error("num_key_value_heads", kv, f"it must divide num_attention_heads ({heads})")
    head_dim = cfg.get("head_dim")
    if head_dim is None and cfg["hidden_size"] % heads:
        raise origin.error("hidden_size", cfg["hidden_size"],
                           f"without head_dim it must be a multiple of num_attention_heads ({heads})")
    head_dim = head_dim or cfg["hidden_size"] // heads
    if head_dim % 2:
        raise origin.error("head_dim", head_dim, "RoPE rotates pairs of dimensions, so it must be even")
    for name in ("hidden_act", "hidden_activation"):  # Gemma 2/3 name it hidden_activation
        act = cfg.get(name)
        if act is not None and act not in ACTIVATIONS:
            raise origin.error(name, act, "llmsys implements the gated MLP with silu (SwiGLU) or gelu_pytorch_tanh "
                               "(GeGLU) only", UnsupportedModelError)
    dense = cfg.get("mlp_only_layers")
    if dense is not None and not (isinstance(dense, list) and all(_is_int(i) for i in dense)):
        raise origin.error("mlp_only_layers", dense, "it must be a list of layer numbers")
    for name in ("rms_norm_eps", "rope_theta"):
        v = cfg.get(name)
        if v is not None and not _is_number(v):
            raise origin.error(name, v, "it must be a number")
    for name in ("rope_scaling", "rope_parameters"):
        v = cfg.get(name)
        if v is not None and not isinstance(v, dict):
            raise origin.error(name, v, "it must be an object (or null)")
    for name in ("bos_token_id", "eos_token_id"):
        v = cfg.get(name)
        ids = v if isinstance(v, list) else [v]
        if v is not None and not all(_is_int(i) for i in ids):
            raise origin.error(name, v, "it must be a token id (an integer) or a list of them")


def check_args(a: Any, origin: Origin) -> None:
    """The values as the model uses them (after defaults and ``rope_parameters`` are applied): norm epsilon,
    RoPE frequencies and scaling, special token ids inside the vocabulary."""
    from llmsys.kernels import rope_attention_factor, rope_inv_freq

    eps = a.rms_norm_eps
    if not _is_number(eps) or not (0 < eps <= MAX_RMS_EPS):
        raise origin.error("rms_norm_eps", eps, f"it must be a number above 0 and at most {MAX_RMS_EPS:g}")
    theta = a.rope_theta
    if not _is_number(theta) or not math.isfinite(theta) or theta <= 1:
        raise origin.error("rope_theta", theta, "it must be a finite number above 1 (models use 1e4 to 1e7)")
    _check_rope_scaling(a.rope_scaling, origin)
    if a.rotary_dim < 2 or a.rotary_dim % 2:
        raise origin.error("partial_rotary_factor", a.partial_rotary_factor,
                           f"it must rotate an even number of each head's {a.head_dim} dims")
    for t_theta, scaling, long in a.rope_tables:  # LongRoPE's short and long factors, Gemma 3's local table
        if not _is_number(t_theta) or not math.isfinite(t_theta) or t_theta <= 1:
            raise origin.error("rope_local_base_freq", t_theta, "it must be a finite number above 1")
        try:
            inv = rope_inv_freq(a.rotary_dim, float(t_theta), scaling, long)
            rope_attention_factor(scaling, a.max_position_embeddings)
        except ValueError as e:
            raise UnsupportedModelError(f"{origin.path}: {e}") from None
        except (TypeError, KeyError, ZeroDivisionError) as e:
            raise origin.error("rope_scaling", scaling, f"its parameters are not usable ({e!r})") from None
        if not bool(torch.isfinite(inv).all()) or not bool((inv > 0).all()):
            raise origin.error("rope_scaling", scaling, "it gives RoPE frequencies that are not finite and "
                               "positive (a zero or negative factor?)")
    window = a.sliding_window
    if window is not None and (not _is_int(window) or window < 1):
        raise origin.error("sliding_window", window, "it must be a whole number of positions above 0")
    for name in ("query_pre_attn_scalar", "attn_logit_softcapping", "final_logit_softcapping"):
        v = getattr(a, name)
        if v is not None and (not _is_number(v) or not math.isfinite(v) or v <= 0):
            raise origin.error(name, v, "it must be a finite number above 0 (or null)")
    if a.num_experts:
        if not 1 <= a.num_experts_per_tok <= a.num_experts:
            raise origin.error("num_experts_per_tok", a.num_experts_per_tok,
                               f"each token needs 1 to num_experts ({a.num_experts}) experts")
        if a.moe_intermediate_size < 1:
            raise origin.error("moe_intermediate_size", a.moe_intermediate_size, "it must be a whole number above 0")
    bos = a.bos_token_id
    if bos is not None and not 0 <= bos < a.vocab_size:
        raise origin.error("bos_token_id", bos, f"it must be an id below vocab_size ({a.vocab_size})")
    bad = [i for i in a.eos_token_id if not 0 <= i < a.vocab_size]
    if bad:
        raise origin.error("eos_token_id", bad[0], f"it must be an id below vocab_size ({a.vocab_size})")


def _check_rope_scaling(sc: Mapping[str, Any] | None, origin: Origin) -> None:
    """Each numeric RoPE scaling parameter is a finite positive number (a factor of 0 divides by zero)."""
    for key in ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings",
                "attention_factor"):
        v = (sc or {}).get(key)
        if v is not None and (not _is_number(v) or not math.isfinite(v) or v <= 0):
            raise origin.error(f"rope_scaling.{key}", v, "it must be a finite number above 0")
    for key in ("factors", "short_factor", "long_factor"):  # freq_factors; LongRoPE's two sets
        factors = (sc or {}).get(key)
        if factors is not None and not (isinstance(factors, (list, tuple)) and all(
                _is_number(f) and math.isfinite(f) and f > 0 for f in factors)):
            raise origin.error(f"rope_scaling.{key}", factors,
                               "every RoPE frequency divisor must be finite and above 0")


def _layer_of(name: str, prefix: str) -> int | None:
    """The layer number of a tensor name ``<prefix>N.*``, None for any other name."""
    if not name.startswith(prefix):
        return None
    head = name[len(prefix):].split(".", 1)[0]
    return int(head) if head.isdigit() else None


def layer_indices(names: Iterable[str], prefix: str = "model.layers.") -> set[int]:
    """The layer numbers the checkpoint's tensor names hold (``model.layers.N.*``; GGUF: ``blk.N.*``)."""
    return {i for i in (_layer_of(n, prefix) for n in names) if i is not None}


def _layers_held(found: set[int]) -> str:
    """``2 layers, 0-1``; ``2 layers: 0, 2`` where numbers are skipped (the first eight)."""
    if not found:
        return "no layer tensors"
    low, high = min(found), max(found)
    if len(found) == high - low + 1:
        return f"{len(found)} layers, {low}-{high}"
    shown = ", ".join(str(i) for i in sorted(found)[:8])
    return f"{len(found)} layers: {shown}{', ...' if len(found) > 8 else ''}"


def check_layers(n_layers: int, found: set[int], origin: Origin, names: Iterable[str] = (),
                 prefix: str = "model.layers.") -> None:
    """The config's layer count against the layers the checkpoint's tensors hold, both ways, before the skeleton
    is built. More than held: a million layers would be built first and fail only when their tensors are found
    missing; the first missing layer is named. Fewer than held (``names``: the stored tensor names, ``prefix``
    their layer prefix): a config or GGUF ``block_count`` that lies about the depth would run the first
    layers only and produce wrong text with no error -- refused, as llama.cpp refuses a file with tensors it
    did not use, naming the first tensor of the first layer past the count."""
    span = _layers_held(found)
    missing = next((i for i in range(n_layers) if i not in found), None)
    if missing is not None:
        raise origin.error("num_hidden_layers", n_layers,
                           f"the checkpoint holds no tensor of layer {missing} ({prefix}{missing}.*; it holds {span})")
    past = sorted(i for i in found if i >= n_layers)
    if past:
        name = next((n for n in names if _layer_of(n, prefix) == past[0]), f"{prefix}{past[0]}.*")
        raise origin.error("num_hidden_layers", n_layers, f"the checkpoint holds tensor {name} of layer {past[0]} "
                           f"({span}), past the last layer {n_layers - 1}")


def model_args(family: Any, cfg: Mapping[str, Any], origin: Origin, layers: set[int] | None = None,
               names: Iterable[str] = (), prefix: str = "model.layers.") -> Any:
    """``family.ModelArgs`` of a checked config: the one way every loader builds model arguments.

    ``layers``: the layer numbers the checkpoint's tensors hold (None: the format guarantees them, a llama2.c
    file whose size was checked against its header); ``names``, ``prefix``: the stored tensor names and
    their layer prefix, to name a tensor past the config's layer count (:func:`check_layers`)."""
    check_config(cfg, origin)
    args = family.ModelArgs.from_hf_config(dict(cfg))
    check_args(args, origin)
    if layers is not None:
        check_layers(args.num_hidden_layers, layers, origin, names, prefix)
    return args


def _is_float(dtype: Any) -> bool:
    """A stored torch dtype the loader converts to the engine's float dtype (a GGUF's types are checked by
    ``gguf_io``, which knows which of them it decodes)."""
    return not isinstance(dtype, torch.dtype) or dtype.is_floating_point


def check_tensors(model: torch.nn.Module, stored: Callable[[str], Any | None], path: Path | str,
                  label: Callable[[str], str] = str) -> None:
    """Every stored float parameter of the skeleton against its tensor in the checkpoint, before one is read.

    ``stored(name)``: the tensor's info (``.shape``; ``.dtype``, a torch dtype, where the format has one) or None when
    the checkpoint does not hold it (missing ones are :func:`common.materialize`'s error; quantized layers store
    ``qweight`` instead and are checked by ``quantized.py``). ``label(name)``: the tensor as messages name it
    (a GGUF's own name beside the HF one)."""
    for name, p in model.named_parameters():
        info = stored(name)
        if info is None:
            continue
        dtype = getattr(info, "dtype", None)
        if p.dtype.is_floating_point and dtype is not None and not _is_float(dtype):
            raise CheckpointError(f"{path}: tensor {label(name)} is stored as {_dtype_name(dtype)}, expected a float "
                                  "type (F32, F16, BF16); the checkpoint is corrupt or not a model of this config")
        found, want = tuple(info.shape), tuple(p.shape)
        if found != want:
            raise CheckpointError(f"{path}: tensor {label(name)} has shape {list(found)}, expected {list(want)} from "
                                  "the config; the checkpoint does not match its config (or is corrupt)")


def _dtype_name(dtype: torch.dtype) -> str:
    from llmsys.engine.loader.safetensors_io import DTYPE_NAMES

    return DTYPE_NAMES.get(dtype, str(dtype))


def check_finite(name: str, t: torch.Tensor, path: Path | str) -> None:
    """A float tensor as read must hold no NaN or infinity: one would spread through every later activation
    and come out as garbage text, with nothing naming its cause.

    Why a sum first: any NaN or infinity makes the sum non-finite, and the sum is one pass with no temporary,
    where ``torch.isfinite(t).all()`` allocated a float and a bool copy (docs/benchmarks.md). Only a
    non-finite sum (a bad tensor, or finite values so large that their sum overflows) pays for the exact count."""
    if not t.is_floating_point() or t.device.type == "meta" or not t.numel():
        return
    if t.element_size() == 1:  # float8: no sum kernel; fp16 holds every e4m3 / e5m2 value (and e5m2's inf)
        t = t.to(torch.float16)
    if math.isfinite(float(t.sum())):
        return
    bad = int(t.numel() - torch.isfinite(t).sum())
    if bad:
        raise CheckpointError(f"{path}: tensor {name} holds {bad} NaN or infinite values (of {t.numel()}); "
                              "the checkpoint is corrupt, download it again")
