"""Build a model on the meta device, then materialize it tensor by tensor.

The model skeleton costs no memory (meta device); each checkpoint tensor is
read, converted to the target dtype (or handed to a ``make_linear`` hook that
quantizes it) and moved to its device before the next is read, so peak memory
is the finished model plus one tensor.
"""

from __future__ import annotations

import contextlib
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Iterator

import torch
from torch import nn

from llmsys.kernels.common.errors import CheckpointError, ModelNotFoundError, UnsupportedModelError
from llmsys.kernels.common.memory import release_free_heap
from llmsys.engine.loader import validate
from llmsys.engine.loader.detect import ModelFormat, ModelSource, detect_model
from llmsys.engine.models import family_for, is_multimodal, text_config
from llmsys.engine.models.base import DecoderModel, TransformerArgs, rope_cache

if TYPE_CHECKING:
    from llmsys.offload.runtime import OffloadRuntime

# A hook that may replace an nn.Linear when its weight arrives, e.g. with a
# quantized layer: (qualified name, weight [N, K], bias | None) -> module or None.
MakeLinear = Callable[[str, torch.Tensor, "torch.Tensor | None"], "nn.Module | None"]
EMBED = "model.embed_tokens.weight"
TRIM_EVERY_BYTES = 32 << 20  # quantizing at load: the C heap handed back after this many bytes of weights


@dataclass
class LoadedModel:
    """What the loader hands to the engine."""

    model: DecoderModel
    args: TransformerArgs
    family: str
    path: Path  # the checkpoint file or directory
    tokenizer_path: Path  # where the tokenizer files live
    dtype: torch.dtype
    device: torch.device
    config: dict[str, Any] = field(default_factory=dict)
    generation_config: dict[str, Any] = field(default_factory=dict)
    # What each stored tensor type became, where the checkpoint mixes them (a GGUF):
    # {"Q4_0 (168)": "int4:g32, codes as stored", "Q8_0 (1)": "dequantized to bfloat16"}
    stored_formats: dict[str, str] = field(default_factory=dict)
    # One line each about what the load left out, shown once by the engine (a multimodal checkpoint's
    # image part: loader.multimodal).
    notices: tuple[str, ...] = ()

    @property
    def weight_bytes(self) -> int:
        # Parameters and persistent buffers (quantized layers keep their codes
        # and scales as buffers); non-persistent ones such as the RoPE table
        # are workspace, not weights.
        seen: set[int] = set()
        total = 0
        persistent = [
            b
            for mod in self.model.modules()
            for name, b in mod.named_buffers(recurse=False)
            if name not in mod._non_persistent_buffers_set
        ]
        for t in list(self.model.parameters()) + persistent:
            if id(t) in seen or t.device.type == "meta":
                continue
            seen.add(id(t))
            total += t.numel() * t.element_size()
        return total


def resolve_device(device: str) -> torch.device:
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise ModelNotFoundError("--device cuda requested but no CUDA GPU is available; use --device cpu")
    return torch.device(device)


def _cpu_has_fast_bf16() -> bool:
    """Does bf16 beat float32 here? With AVX512-BF16 / AMX (native bf16 matmuls), and with AVX2 too:
    bf16 weights stream at half the bytes (decode) and prefill runs float32 sgemm on upcast chunks
    (``kernels.cpu_linear``), as fast as float32 at half the memory (docs/benchmarks.md).
    Older CPUs (no AVX2) keep float32. By cpuid (torch's cpuinfo), not /proc/cpuinfo text."""
    return bool(torch.cpu._is_avx512_bf16_supported() or torch.cpu._is_amx_tile_supported()
                or torch.cpu._is_avx2_supported())


def resolve_dtype(dtype: str, device: torch.device) -> torch.dtype:
    """``auto``: bf16 where the hardware computes it well (:func:`_cpu_has_fast_bf16`), else float32.

    On CUDA bf16 needs compute capability >= 8.0 (else fp16).
    """
    if dtype != "auto":
        return getattr(torch, dtype)
    if device.type == "cuda":
        return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16
    return torch.bfloat16 if _cpu_has_fast_bf16() else torch.float32


def read_json(path: Path) -> dict[str, Any]:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise CheckpointError(f"{path}: cannot parse JSON ({e})") from None


def _progress(items: list[str], enabled: bool, label: str) -> Iterator[str]:
    """Yield items, drawing a progress bar (with an ETA) on stderr only when it is a TTY."""
    from llmsys.engine.progress import bar

    with bar(len(items), label, enabled, unit="tensor") as b:
        for item in items:
            yield item
            b.update()


@contextlib.contextmanager
def skip_init() -> Iterator[None]:
    """Skip weight init while building a meta skeleton (the checkpoint overwrites it).

    Why: ``normal_`` on a meta tensor makes torch import its symbolic-shape
    stack (sympy, ~900 modules, ~150 MiB of RSS) -- a third of a 512 MiB
    memory cap, for values that are never used.
    """
    names = ("normal_", "uniform_", "kaiming_uniform_", "trunc_normal_")
    saved = {n: getattr(nn.init, n) for n in names}
    try:
        for n in names:
            setattr(nn.init, n, lambda t, *a, **k: t)
        yield
    finally:
        for n, f in saved.items():
            setattr(nn.init, n, f)


def set_tensor(model: nn.Module, name: str, value: torch.Tensor) -> None:
    """Replace parameter/buffer ``name`` (dotted) with ``value``."""
    mod_name, _, leaf = name.rpartition(".")
    mod = model.get_submodule(mod_name) if mod_name else model
    if leaf in mod._parameters:
        mod._parameters[leaf] = nn.Parameter(value, requires_grad=False)
    else:
        mod._buffers[leaf] = value


def materialize(
    model: DecoderModel,
    read: Callable[[str], torch.Tensor],
    available: Callable[[str], bool],
    dtype: torch.dtype,
    device: torch.device,
    source: Path,
    make_linear: MakeLinear | None = None,
    progress: bool = True,
    offload: OffloadRuntime | None = None,
    check_finite: bool = True,
) -> None:
    """Fill every meta tensor of ``model`` from ``read(name)``.

    ``offload`` (an ``llmsys.offload.runtime.OffloadRuntime``) may leave a
    tensor on disk (``skip``), place it in CPU RAM (``device_for``) and is told
    when one is placed (``loaded``), so a streamed layer never becomes resident.
    ``check_finite=False`` skips the NaN/inf check of each tensor read (one pass over it at memory
    speed, small next to the read: docs/benchmarks.md).
    """
    names = [n for n, _ in model.named_parameters(remove_duplicate=False)]
    tied = model.args.tie_word_embeddings
    wanted = [n for n in names if not (tied and n == "lm_head.weight")]
    missing = [n for n in wanted if not available(n)]
    if tied and not available("model.embed_tokens.weight"):
        missing.append("model.embed_tokens.weight")
    if missing:
        more = f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""
        raise CheckpointError(f"{source}: missing tensor {missing[0]}{more}; the checkpoint does not match its config")
    linears = {n for n, m in model.named_modules() if isinstance(m, nn.Linear)}
    read = _checked_reader(model, read, source, check_finite)
    done: set[str] = set()
    sizes = {n: p.numel() * p.element_size() for n, p in model.named_parameters(remove_duplicate=False)}
    untrimmed = 0  # bytes of weights converted since the C heap was last handed back
    for name in _progress(wanted, progress, "loading"):
        if name in done:
            continue
        if offload is not None and offload.skip(name):
            continue
        dev = offload.device_for(name, device) if offload is not None else device
        before = set(done)
        _materialize_one(model, name, names, linears, done, read, dtype, dev, make_linear)
        untrimmed += sizes.get(name, 0)
        if make_linear is not None and untrimmed >= TRIM_EVERY_BYTES:
            # Quantizing at load frees float32 temporaries of up to QUANT_CHUNK_BYTES a piece; glibc keeps them
            # (its mmap threshold rises as they are freed), so the load's peak RSS depended on the heap's luck:
            # a bf16 SmolLM2-135M to int8 peaked at 406-815 MiB over runs, 404-447 with this.
            release_free_heap()
            untrimmed = 0
        if offload is not None:
            for n in [name, *sorted(done - before - {name})]:
                offload.loaded(n, model)
    model.rope_cache = rope_cache(model.args, device)
    model.tie_weights()


def _checked_reader(model: nn.Module, read: Callable[[str], torch.Tensor], source: Path,
                    finite: bool = True) -> Callable[[str], torch.Tensor]:
    """``read`` with each tensor checked as it arrives: the skeleton's shape (the format-level checks,
    ``validate.check_tensors``, ran on the stored shapes; this covers every reader, llama2.c's too) and no
    NaN/inf (``validate.check_finite``), so a bad tensor is named at load, not met as garbage text later."""
    shapes = {n: tuple(p.shape) for n, p in model.named_parameters(remove_duplicate=False)}

    def checked(name: str) -> torch.Tensor:
        t = read(name)
        want = shapes.get(name)
        if want is not None and tuple(t.shape) != want:
            raise CheckpointError(f"{source}: tensor {name} has shape {list(t.shape)}, expected {list(want)} from "
                                  "the config; the checkpoint does not match its config (or is corrupt)")
        if finite:
            validate.check_finite(name, t, source)
        return t

    return checked


def _materialize_one(model, name, names, linears, done, read, dtype, device, make_linear) -> None:
    mod_name, _, leaf = name.rpartition(".")
    t = None
    if make_linear is not None and name == "model.embed_tokens.weight":
        # The hook may quantize the embedding too (a module with forward(ids) and,
        # for tied models, as_linear() -> the LM head; see DecoderModel.tie_weights).
        t = read(name)
        new = make_linear(mod_name, t, None)
        if new is not None:
            model.model.embed_tokens = new.to(device)
            done.add(name)
            return
    if make_linear is not None and mod_name in linears and leaf == "weight":
        w = read(name)
        bname = mod_name + ".bias"
        b = read(bname).to(dtype) if bname in names else None
        new = make_linear(mod_name, w, b)
        if new is not None:
            parent, _, child = mod_name.rpartition(".")
            setattr(model.get_submodule(parent) if parent else model, child, new.to(device))
            done.update({name, bname})
            return
        set_tensor(model, name, w.to(device=device, dtype=dtype))
        if b is not None:
            set_tensor(model, bname, b.to(device))
            done.add(bname)
        return
    t = read(name) if t is None else t
    want = dtype if t.is_floating_point() else t.dtype
    set_tensor(model, name, t.to(device=device, dtype=want))


def embed_file(args: TransformerArgs, path: Path, info: Any) -> tuple[Any, torch.dtype] | None:
    """Where a tied model's embedding table lies in its checkpoint (``DecoderModel.embed_file``).

    ``info``: ``.dtype .shape .offset .nbytes`` of the stored tensor (any float
    dtype: rows are converted as they are read). None when the head is not tied
    or the table is not a plain ``[vocab, hidden]`` float matrix.
    """
    from llmsys.offload.streamer import TensorSource

    if not args.tie_word_embeddings or not info.dtype.is_floating_point:
        return None
    if tuple(info.shape) != (args.vocab_size, args.hidden_size):
        return None
    return TensorSource(str(path), info.offset, info.nbytes), info.dtype


@dataclass
class Checkpoint:
    """A Hugging Face checkpoint opened, nothing read yet: the model's skeleton on the meta
    device and where each tensor lies. Placement is planned on this (``llmsys.offload``)
    before :func:`materialize_checkpoint` reads a weight."""

    path: Path
    model: DecoderModel  # meta tensors
    family: str
    config: dict[str, Any]
    index: Any  # safetensors_io.CheckpointIndex, or gguf_io.GGUFIndex for a GGUF file
    dtype: torch.dtype
    device: torch.device
    format: ModelFormat = ModelFormat.HF  # HF (a directory of safetensors) or GGUF (one GGUF file)
    notices: tuple[str, ...] = ()  # LoadedModel.notices

    @property
    def is_gguf(self) -> bool:
        return self.format is ModelFormat.GGUF

    @property
    def prequantized(self) -> bool:
        """Stored quantized (llmsys / AWQ / GPTQ): rebuilt as stored, always resident (not MXFP4 experts:
        decoded as they are read, ``engine/loader/experts.py``)."""
        from llmsys.engine.loader.quantized import stored_quantized

        return stored_quantized(self.config)

    def locate(self, name: str) -> tuple[Path, Any] | None:
        """``name``'s file and TensorInfo, or None when it cannot be streamed from the file as stored."""
        return self.index.locate(name)


def load_model(
    path: str | Path,
    dtype: str = "auto",
    device: str = "auto",
    make_linear: MakeLinear | None = None,
    progress: bool = True,
    check_finite: bool = True,
) -> LoadedModel:
    """Load a Hugging Face directory or a llama2.c ``.bin`` checkpoint, every weight resident.

    The engine builder (``llmsys.engine.builder``) takes the two steps itself
    (:func:`open_checkpoint`, then :func:`materialize_checkpoint` with an
    offload runtime planned in between).
    """
    src = detect_model(path)
    dev = resolve_device(device)
    dt = resolve_dtype(dtype, dev)
    if src.format is ModelFormat.LLAMA2C:
        from llmsys.engine.loader import llama2c

        return llama2c.load(src.path, dt, dev, make_linear, progress, check_finite)
    return materialize_checkpoint(open_checkpoint(src, dt, dev), make_linear, progress, check_finite=check_finite)


def open_checkpoint(path: str | Path | ModelSource, dt: torch.dtype, dev: torch.device) -> Checkpoint:
    """Read a Hugging Face directory's (or a GGUF file's) config and tensor index; build the meta model.
    ``path``: a :class:`ModelSource` from :func:`detect_model` (its GGUF header is used, not parsed again)."""
    from llmsys.engine.loader.safetensors_io import CheckpointIndex

    src = detect_model(path)
    p = src.path
    if src.format is ModelFormat.GGUF:
        return _open_gguf(src, dt, dev)
    if src.format is ModelFormat.LLAMA2C:
        raise CheckpointError(f"{p}: a llama2.c checkpoint has no tensor index to open; load it with load_model")
    cfg_path = p / "config.json"
    raw = validate.config_object(read_json(cfg_path), cfg_path)
    cfg = text_config(raw, str(cfg_path))  # a multimodal checkpoint's language model
    family = family_for(cfg, str(cfg_path))
    index = CheckpointIndex.open_dir(p)
    bare = _bare_decoder_views(index, cfg)
    notices, origin = _text_of_multimodal(raw, index, cfg_path)
    notices += bare
    # The config's values, and its layer count against the tensors held, before the skeleton is built.
    args = validate.model_args(family, cfg, origin, validate.layer_indices(index.where), index.where)
    from llmsys.engine.loader.quantized import decoded_at_load, stored_quantized

    decoded = decoded_at_load(cfg)
    if decoded is not None and args.experts_layout != "gpt_oss":
        raise UnsupportedModelError(f"{cfg_path}: quant_method {decoded!r} is supported for gpt-oss's experts only; "
                                    "use a float checkpoint of this model")
    emb = None
    if not stored_quantized(cfg) and EMBED in index:
        emb = embed_file(args, index.where[EMBED].path, index.info(EMBED))
    with torch.device("meta"), skip_init():
        model = family.Model(args, embed_file=emb)
    if args.num_experts:  # Mixtral's, fused and gpt-oss's expert tensors under the engine's per-expert names
        from llmsys.engine.loader.experts import add_expert_views

        shapes = {n: tuple(t.shape) for n, t in model.named_parameters()}
        add_expert_views(index, shapes, shapes, p, args.experts_layout)
    validate.check_tensors(model, lambda n: index.info(n) if n in index else None, p)
    return Checkpoint(p, model, family.__name__.rsplit(".", 1)[1], cfg, index, dt, dev, notices=notices)


def _bare_decoder_views(index: Any, cfg: dict[str, Any]) -> tuple[str, ...]:
    """A checkpoint saved from the bare decoder (transformers' ``*Model``, as sentence-transformers saves
    Qwen3-Embedding): body tensors without the ``model.`` prefix and no LM head. Each is added to ``index`` under
    the engine's name (a view: nothing copied). An untied one has no head at all: the embedding matrix stands
    in, so the model loads for embeddings, and the load's notice says its text would be meaningless."""
    if "embed_tokens.weight" not in index or EMBED in index:
        return ()
    for name in list(index.where):
        if name.startswith(("embed_tokens.", "layers.", "norm.")):
            index.add_view("model." + name, name, 0, index.info(name).shape)
    if "lm_head.weight" in index or cfg.get("tie_word_embeddings", False):
        return ()
    index.add_view("lm_head.weight", "embed_tokens.weight", 0, index.info("embed_tokens.weight").shape)
    return ("no LM head (a bare decoder, as embedding models are saved): the embedding matrix stands in for it, "
            "so generated text is meaningless; use the model for embeddings",)


def _text_of_multimodal(raw: dict[str, Any], index: Any, cfg_path: Path) -> tuple[tuple[str, ...], validate.Origin]:
    """For a multimodal checkpoint (``raw``, its config.json as written): its text tensors added to ``index`` under
    the engine's names (before the layers are counted), the load's notice that the image part is left out, and
    an Origin naming each nested field where it is written (``text_config.num_hidden_layers``)."""
    if not is_multimodal(raw):
        return (), validate.Origin(cfg_path)
    from llmsys.engine.loader.multimodal import add_text_views, image_notice

    notice = image_notice(add_text_views(index))
    return (notice,), validate.Origin(cfg_path, keys={k: f"text_config.{k}" for k in raw.get("text_config") or {}})


def _decoded_formats(ck: Checkpoint, dt: torch.dtype, make_linear: MakeLinear | None) -> dict[str, str]:
    """What the tensors decoded at load (MXFP4 experts) became, for reports (as ``gguf_io.conversions``)."""
    from llmsys.engine.loader.quantized import decoded_at_load

    method = decoded_at_load(ck.config)
    if method is None:
        return {}
    n = sum(1 for name in ck.index.where if name.endswith("_blocks"))
    spec = getattr(make_linear, "spec", None)
    dtype = str(dt).removeprefix("torch.")
    what = f"dequantized to {dtype}" if spec is None else f"dequantized, matrices re-quantized to {spec.name} (--quant)"
    return {f"{method.upper()} ({n})": what}


def _open_gguf(src: ModelSource, dt: torch.dtype, dev: torch.device) -> Checkpoint:
    """A GGUF file's meta model (its config from the GGUF metadata, ``gguf_io.hf_config``)."""
    from llmsys.engine.loader import gguf_io

    p, header = src.path, src.gguf_header
    index = gguf_io.GGUFIndex(p, header, gguf_io.hf_config(p, header))  # gguf_io.open_index, header kept
    family = family_for(index.config, str(p))
    names = [t.name for t in header.tensors]  # llama.cpp's names: a tensor past block_count is named as stored
    args = validate.model_args(family, index.config, gguf_io.origin(p, index.arch),
                               validate.layer_indices(names, gguf_io.LAYER_PREFIX), names, gguf_io.LAYER_PREFIX)
    with torch.device("meta"), skip_init():
        model = family.Model(args)
    gguf_io.check_complete(p, index, model)
    validate.check_tensors(model, lambda n: index.info(n) if n in index else None, p,
                           lambda n: f"{index.info(n).gguf_name} ({n})")
    return Checkpoint(p, model, family.__name__.rsplit(".", 1)[1], index.config, index, dt, dev, ModelFormat.GGUF)


def materialize_checkpoint(ck: Checkpoint, make_linear: MakeLinear | None = None, progress: bool = True,
                           offload: OffloadRuntime | None = None, check_finite: bool = True) -> LoadedModel:
    """Read the weights into ``ck.model``; ``offload`` (an OffloadRuntime planned on the meta
    model) leaves streamed tensors on disk (see :func:`materialize`, also for ``check_finite``)."""
    p, model, dt, dev = ck.path, ck.model, ck.dtype, ck.device
    formats: dict[str, str] = {}
    if ck.is_gguf:  # Q4_0 / Q8_0 / Q5_0 matrices keep their codes, every other tensor dequantized (gguf_io)
        from llmsys.engine.loader.gguf_io import conversions, materialize_gguf

        materialize_gguf(model, ck.index, dt, dev, make_linear, progress, offload, check_finite)
        formats = conversions(ck.index, dt, make_linear)
    elif ck.prequantized:  # llmsys / AWQ / GPTQ: rebuild quantized layers as stored
        from llmsys.engine.loader.quantized import load_quantized_into

        load_quantized_into(model, ck.config, ck.index, dt, dev, p, make_linear, check_finite)
        model.rope_cache = rope_cache(model.args, dev)
        model.tie_weights()
    else:
        materialize(model, ck.index.read, ck.index.__contains__, dt, dev, p, make_linear, progress, offload,
                    check_finite)
        formats = _decoded_formats(ck, dt, make_linear)
    model.eval()
    a = model.args
    if ck.is_gguf:  # the special ids come from the file's metadata (its config)
        gen = {"bos_token_id": a.bos_token_id, "eos_token_id": list(a.eos_token_id)}
    else:
        gen = read_json(p / "generation_config.json") if (p / "generation_config.json").exists() else {}
    return LoadedModel(model, model.args, ck.family, p, p, dt, dev, ck.config, gen, formats, ck.notices)
