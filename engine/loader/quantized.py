"""Quantized checkpoints (``llmsys quantize`` output, AWQ and GPTQ directories), rebuilt from stored tensors.

A ``config.json`` with a ``quantization_config`` loads here: each quantized linear comes from its
tensors (``from_quantized``: no re-quantization, no full-precision copy), each shape checked so a bad
file fails naming the tensor. ``quant_method``: ``llmsys`` (:func:`save_quantized`: ``{name}.qweight``
plus the layer's state_dict, ``quant/README.md`` layouts; a quantized embedding is also the tied head),
``awq`` (AutoAWQ GEMM, 4 bits, ``awq_to_canonical``), ``gptq`` (AutoGPTQ/optimum, 4 bits, act-order;
``checkpoint_format`` ``gptq`` v1 or ``gptq_v2``).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from llmsys.kernels.common.errors import CheckpointError, InvalidParameterError
from llmsys.engine.loader import validate
from llmsys.engine.loader.safetensors_io import CheckpointIndex, save_file
from llmsys.quant import FP8Linear, Int4Linear, Int8BlockLinear, Int8Linear, NF4Linear, QuantLinear, parse_quant

if TYPE_CHECKING:
    from llmsys.engine.loader.common import MakeLinear
from llmsys.quant.awq_gptq import awq_to_canonical, gptq_to_canonical
from llmsys.quant.embedding import QuantEmbedding

EMBED = "model.embed_tokens"
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "tokenizer.model",
                   "generation_config.json", "chat_template.jinja", "vocab.json", "merges.txt")


# quant_methods whose tensors the float loader decodes as it reads them (gpt-oss's MXFP4 experts:
# engine/loader/experts.py), so the model loads as a float one and --quant applies as to any.
DECODED_AT_LOAD = ("mxfp4",)


def decoded_at_load(cfg: dict[str, Any]) -> str | None:
    """The config's quant_method when the float loader decodes it (:data:`DECODED_AT_LOAD`), else None."""
    qc = cfg.get("quantization_config")
    method = str(qc.get("quant_method", "")).lower() if isinstance(qc, dict) else None
    return method if method in DECODED_AT_LOAD else None


def stored_quantized(cfg: dict[str, Any]) -> bool:
    """Are the config's layers stored quantized and rebuilt as stored (llmsys / AWQ / GPTQ, or an unsupported
    method, which :func:`validate_quant_config` names)? Not for a method decoded at load."""
    return cfg.get("quantization_config") is not None and decoded_at_load(cfg) is None


def stored_format(cfg: dict[str, Any]) -> str:
    """The ``--quant`` name a quantized checkpoint holds (e.g. ``int4:g128`` for AWQ g128)."""
    qc = cfg["quantization_config"]
    method = str(qc.get("quant_method", "")).lower()
    if method == "llmsys":
        return str(qc.get("format"))
    return f"int4:g{qc.get('group_size')}"


def _check_request(cfg: dict[str, Any], make_linear: MakeLinear | None, path: Path) -> None:
    """A --quant that differs from what the directory holds is an error, not a silent re-quantization."""
    spec = getattr(make_linear, "spec", None)
    if spec is None:
        return
    have = stored_format(cfg)
    if spec.name != have:
        raise InvalidParameterError(
            f"{path} is already quantized ({have}); drop --quant {spec.name} (or pass --quant {have})"
        )


def _need(index: CheckpointIndex, name: str, path: Path) -> torch.Tensor:
    if name not in index:
        raise CheckpointError(f"{path}: missing tensor {name}; the quantized checkpoint does not match its config")
    return index.read(name)


def _expect(name: str, t: torch.Tensor, shape: tuple[int, ...], path: Path) -> None:
    if tuple(t.shape) != tuple(shape):
        raise CheckpointError(
            f"{path}: tensor {name} has shape {tuple(t.shape)}, expected {tuple(shape)} for this model; "
            "the checkpoint is corrupt or belongs to another model"
        )


# The integer type each llmsys format stores its codes in (quant/README.md); a float qweight is not codes.
QWEIGHT_DTYPES = {"int4": torch.uint8, "nf4": torch.uint8, "int8": torch.int8, "fp8": torch.float8_e4m3fn}
# Float tensors beside the codes; "scales" of the per-row int8/fp8 formats are never 0 as llmsys writes them
# (the row maximum is clamped first), while int4 groups and int8 blocks kept from a GGUF's codes may be.
SCALE_NAMES = ("scales", "zeros", "block_scales", "absmax", "absmax2", "absmax_offset", "input_scale")


def _check_codes(prefix: str, t: dict[str, torch.Tensor], want: torch.dtype, nonzero_scales: bool,
                 path: Path) -> None:
    """A quantized layer's tensors hold what the format says: codes of its integer type, finite scales
    (non-zero where the quantizer never writes 0), so garbage fails at load naming the tensor."""
    q = t["qweight"]
    if q.dtype != want:
        raise CheckpointError(f"{path}: tensor {prefix}.qweight is {q.dtype}, expected {want} codes for this "
                              "quantization_config; the checkpoint is corrupt or its config describes another format")
    for key in SCALE_NAMES:
        x = t.get(key)
        if x is None or (key == "absmax" and not x.is_floating_point()):
            continue
        if not x.is_floating_point():
            raise CheckpointError(f"{path}: tensor {prefix}.{key} is {x.dtype}, expected a float type; "
                                  "the checkpoint is corrupt")
        validate.check_finite(f"{prefix}.{key}", x, path)
        if nonzero_scales and key in ("scales", "absmax") and x.numel() and not bool((x != 0).all()):
            raise CheckpointError(f"{path}: tensor {prefix}.{key} holds {int((x == 0).sum())} zero scales; "
                                  "a quantizer never writes one, the checkpoint is corrupt: re-quantize it")


def _llmsys_layer(fmt: str, prefix: str, index: CheckpointIndex, n: int, k: int, path: Path,
                  device: torch.device) -> QuantLinear:
    spec = parse_quant(fmt)
    names = [x for x in index.where if x.startswith(prefix + ".") and "." not in x[len(prefix) + 1:]]
    t = {x[len(prefix) + 1:]: index.read(x).to(device) for x in names}
    if "qweight" not in t:
        raise CheckpointError(f"{path}: missing tensor {prefix}.qweight")
    q = t["qweight"]
    _check_codes(prefix, t, QWEIGHT_DTYPES[spec.method], spec.method in ("int8", "fp8") and not spec.int8_blocks,
                 path)
    try:
        if spec.int8_blocks:
            _expect(prefix + ".qweight", q, (n, k), path)
            _expect(prefix + ".block_scales", t.get("block_scales", torch.empty(0)), (-(-k // 32), n), path)
            return Int8BlockLinear.from_quantized(t)
        if spec.method in ("int8", "fp8"):
            _expect(prefix + ".qweight", q, (n, k), path)
            _expect(prefix + ".scales", t.get("scales", torch.empty(0)), (n,), path)
            return (Int8Linear if spec.method == "int8" else FP8Linear).from_quantized(t)
        if spec.method == "int4":
            g = spec.group_size
            kp = -(-k // g) * g
            _expect(prefix + ".qweight", q, (n, kp // 2), path)
            for s in ("scales", "zeros"):
                _expect(f"{prefix}.{s}", t.get(s, torch.empty(0)), (n, kp // g), path)
            return Int4Linear.from_quantized(t, in_features=k)
        if spec.method == "nf4":
            _expect(prefix + ".qweight", q, (-(-n * k // 2),), path)
            return NF4Linear.from_quantized(t, k, n)
    except CheckpointError as e:
        if str(path) in str(e):
            raise
        raise CheckpointError(f"{path}: module {prefix}: {e}") from None
    raise CheckpointError(f"{path}: unknown llmsys quantized format {fmt!r} in config.json")


def _awq_gptq_layer(qc: dict[str, Any], prefix: str, index: CheckpointIndex, n: int, k: int,
                    path: Path, device: torch.device) -> QuantLinear:
    method = str(qc.get("quant_method")).lower()
    g = int(qc.get("group_size", 128))
    if g <= 0 or k % g:
        raise CheckpointError(f"{path}: {method} group_size {g} does not divide {prefix} in_features {k}")
    qweight = _need(index, prefix + ".qweight", path)
    qzeros = _need(index, prefix + ".qzeros", path)
    scales = _need(index, prefix + ".scales", path)
    for name, x in (("qweight", qweight), ("qzeros", qzeros)):
        if x.dtype != torch.int32:
            raise CheckpointError(f"{path}: tensor {prefix}.{name} is {x.dtype}, expected int32 (packed {method} "
                                  "4-bit codes); the checkpoint is corrupt")
    _check_codes(prefix, {"qweight": qweight, "scales": scales}, torch.int32, True, path)
    _expect(prefix + ".scales", scales, (k // g, n), path)
    _expect(prefix + ".qzeros", qzeros, (k // g, n // 8), path)
    if method == "awq":
        _expect(prefix + ".qweight", qweight, (k, n // 8), path)
        t = awq_to_canonical(qweight, qzeros, scales)
    else:
        _expect(prefix + ".qweight", qweight, (k // 8, n), path)
        g_idx = index.read(prefix + ".g_idx") if prefix + ".g_idx" in index else None
        if g_idx is not None:
            _expect(prefix + ".g_idx", g_idx, (k,), path)
            if g_idx.is_floating_point() or (k and not 0 <= int(g_idx.min()) <= int(g_idx.max()) < k // g):
                raise CheckpointError(f"{path}: tensor {prefix}.g_idx must hold group numbers 0..{k // g - 1}; "
                                      "the checkpoint is corrupt")
        v2 = str(qc.get("checkpoint_format", "gptq")).lower() == "gptq_v2"
        try:
            t = gptq_to_canonical(qweight, qzeros, scales, g_idx, zero_offset=0 if v2 else 1)
        except CheckpointError as e:
            raise CheckpointError(f"{path}: module {prefix}: {e}") from None
    if prefix + ".bias" in index:
        t["bias"] = index.read(prefix + ".bias")
    t = {name: x.to(device) for name, x in t.items()}
    return Int4Linear.from_quantized(t, in_features=k)


def _qc_int(qc: dict[str, Any], key: str, default: int, path: Path) -> int:
    """An integer field of quantization_config (a string or a float there is a broken config, not a value)."""
    v = qc.get(key, default)
    if not isinstance(v, int) or isinstance(v, bool):
        raise CheckpointError(f"{path}/config.json: quantization_config.{key} is {v!r}; it must be an integer; "
                              "fix config.json or quantize the model again")
    return v


def _llmsys_format(qc: dict[str, Any], path: Path) -> None:
    """``format`` names a stored llmsys layout, and ``bits``, where given, agrees with it."""
    fmt = qc.get("format")
    try:
        spec = parse_quant(str(fmt)) if isinstance(fmt, str) else None
    except InvalidParameterError as e:
        raise CheckpointError(f"{path}/config.json: quantization_config.format {fmt!r} is not a llmsys format "
                              f"({e}); fix config.json or quantize the model again") from None
    if spec is None or spec.method == "none":
        raise CheckpointError(f"{path}/config.json: quantization_config.format is {fmt!r}; expected a stored format "
                              "such as int8, int8:g32, int4:g64, nf4 or fp8; fix config.json or quantize again")
    if "bits" in qc:
        bits = _qc_int(qc, "bits", 0, path)
        want = 4 if spec.method in ("int4", "nf4") else 8
        if bits != want:
            raise CheckpointError(f"{path}/config.json: quantization_config.bits is {bits} but format {fmt!r} stores "
                                  f"{want}-bit codes; fix config.json or quantize the model again")


def validate_quant_config(cfg: dict[str, Any], path: Path) -> dict[str, Any]:
    qc = cfg.get("quantization_config")
    if not isinstance(qc, dict):
        raise CheckpointError(f"{path}/config.json: quantization_config must be an object")
    method = str(qc.get("quant_method", "")).lower()
    if method == "llmsys":
        _llmsys_format(qc, path)
        return qc
    if method not in ("awq", "gptq"):
        raise CheckpointError(
            f"{path}/config.json: quant_method {method!r} is not supported; llmsys loads llmsys, awq and gptq checkpoints"
        )
    bits = _qc_int(qc, "bits", _qc_int(qc, "w_bit", 4, path), path)
    if bits != 4:
        raise CheckpointError(f"{path}/config.json: {method} with bits={bits} is not supported (4 bits only)")
    if "group_size" not in qc and "q_group_size" in qc:
        qc = dict(qc, group_size=qc["q_group_size"])
    if _qc_int(qc, "group_size", 128, path) not in (32, 64, 128):
        raise CheckpointError(
            f"{path}/config.json: {method} group_size {qc.get('group_size')} unsupported (32, 64 or 128)"
        )
    if method == "awq" and str(qc.get("version", "gemm")).lower() != "gemm":
        raise CheckpointError(f"{path}/config.json: AWQ version {qc.get('version')!r} unsupported (GEMM layout only)")
    return qc


def _check_written_format(index: CheckpointIndex, fmt: str, path: Path) -> None:
    """The format ``save_quantized`` wrote into each file's metadata must be the one config.json names: a
    config edited (or copied from another directory) to say int4 over int8 codes would read them wrongly."""
    for f in index.files:
        written = f.metadata.get("llmsys_quant")
        if written is not None and written != fmt:
            raise CheckpointError(f"{f.path}: written as {written!r} but {path}/config.json says quantization_config "
                                  f"format {fmt!r}; fix config.json (format {written!r}) or quantize again")


def load_quantized_into(model: nn.Module, cfg: dict[str, Any], index: CheckpointIndex, dtype: torch.dtype,
                        device: torch.device, path: Path, make_linear: MakeLinear | None = None,
                        check_finite: bool = True) -> None:
    """Fill the meta ``model`` from a quantized checkpoint (see the module docstring); ``check_finite=False``
    skips the NaN/inf check of the float tensors (``common.materialize``; scales are always checked)."""
    from llmsys.engine.loader.common import set_tensor

    qc = validate_quant_config(cfg, path)
    _check_request(cfg, make_linear, path)
    method = str(qc.get("quant_method")).lower()
    fmt = str(qc.get("format", ""))
    if method == "llmsys":
        _check_written_format(index, fmt, path)
    tied = bool(model.args.tie_word_embeddings)
    done: set[str] = set()
    targets = [(n, m) for n, m in model.named_modules() if isinstance(m, nn.Linear)]
    for name, lin in targets:
        if tied and name == "lm_head":
            continue
        if name + ".qweight" not in index:
            continue  # stored in float (e.g. AWQ/GPTQ keep lm_head float)
        n, k = lin.out_features, lin.in_features
        if method == "llmsys":
            q = _llmsys_layer(fmt, name, index, n, k, path, device)
        else:
            q = _awq_gptq_layer(qc, name, index, n, k, path, device)
        parent, _, child = name.rpartition(".")
        setattr(model.get_submodule(parent) if parent else model, child, q)
        done.update(x for x in index.where if x.startswith(name + "."))
    if not done and EMBED + ".qweight" not in index:
        raise CheckpointError(f"{path}/config.json: quantization_config says {method} but the checkpoint holds no "
                              "quantized tensors (*.qweight); remove quantization_config or use the quantized files")
    if method == "llmsys" and EMBED + ".qweight" in index:
        emb = model.model.embed_tokens
        table = _llmsys_layer(fmt, EMBED, index, emb.num_embeddings, emb.embedding_dim, path, device)
        model.model.embed_tokens = QuantEmbedding(table, dtype)
        done.update(x for x in index.where if x.startswith(EMBED + "."))
    for name, p in list(model.named_parameters(remove_duplicate=False)):
        if name in done or p.device.type != "meta" or (tied and name == "lm_head.weight"):
            continue
        t = _need(index, name, path)
        _expect(name, t, tuple(p.shape), path)
        if check_finite:
            validate.check_finite(name, t, path)
        set_tensor(model, name, t.to(device=device, dtype=dtype if t.is_floating_point() else t.dtype))


# ------------------------------------------------------------------ writing


def quantized_state(model: nn.Module) -> dict[str, torch.Tensor]:
    """Every tensor to save: quantized layers' canonical state + float parameters (ties stored once)."""
    out: dict[str, torch.Tensor] = {}
    seen: set[int] = set()
    for mname, mod in model.named_modules():
        if isinstance(mod, (QuantLinear, QuantEmbedding)):
            table = mod.table if isinstance(mod, QuantEmbedding) else mod
            if id(table) in seen:
                continue  # the tied LM head is the embedding table
            seen.add(id(table))
            for k, v in table.state_dict().items():
                out[f"{mname}.{k}"] = v.contiguous()
    for name, p in model.named_parameters():  # quantized layers hold buffers only
        if id(p) in seen:
            continue
        seen.add(id(p))
        out[name] = p.detach().contiguous()
    return out


def save_quantized(model: nn.Module, cfg: dict[str, Any], out_dir: Path, fmt: str, method: str,
                   tokenizer_dir: Path | None, extra: dict[str, Any] | None = None) -> Path:
    """Write ``model.safetensors`` + ``config.json`` (+ tokenizer files) that ``llmsys run`` loads."""
    out_dir.mkdir(parents=True, exist_ok=True)
    state = quantized_state(model)
    save_file(state, out_dir / "model.safetensors", metadata={"format": "pt", "llmsys_quant": fmt})
    new_cfg = dict(cfg)
    new_cfg["quantization_config"] = {"quant_method": "llmsys", "format": fmt, "method": method, **(extra or {})}
    (out_dir / "config.json").write_text(json.dumps(new_cfg, indent=2) + "\n")
    if tokenizer_dir is not None:
        for f in TOKENIZER_FILES:
            src = tokenizer_dir / f
            if src.is_file() and src.resolve() != (out_dir / f).resolve():
                shutil.copyfile(src, out_dir / f)
    return out_dir / "model.safetensors"

