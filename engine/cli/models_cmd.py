"""`llmsys models` and `llmsys pull`: list the catalog, download a model.

`llmsys models` lists the models Ollama has pulled too (when its store
exists), as the ``ollama:NAME:TAG`` names `llmsys run` takes, so a user sees
every runnable name in one table. A store model's architecture, parameter
count and quant type come from its GGUF header (metadata and tensor table,
no tensor data read), since Ollama's manifest does not say them reliably.

Only the command functions live here; `llmsys.engine.cli.main` registers
them on the Typer app and turns raised :class:`LLMSysError`s into
``error: <message>`` lines, so these functions never print errors or exit.
"""

from __future__ import annotations

import json
import sys
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from types import MappingProxyType
from typing import Any, Mapping, Optional

import typer

from llmsys.engine import hub, names, ollama_store
from llmsys.engine.catalog import CatalogEntry, is_downloaded, load_catalog, local_path
from llmsys.engine.hub import is_complete, plan_download, pulled_repos
from llmsys.kernels.common.paths import llmsys_home
from llmsys.kernels.common.units import format_bytes
from llmsys.kernels.common.errors import CheckpointError, LLMSysError, ModelNotFoundError

_COLUMNS = ("NAME", "PARAMS", "ARCHITECTURE", "QUANT", "SIZE", "LICENCE", "DOWNLOADED")
IN_OLLAMA = "in the Ollama store"
# llama.cpp's general.architecture -> the family name shown (a llama file with experts is Mixtral). The keys are
# the architectures llmsys loads (engine.loader.gguf_io.ARCHS; a test keeps the two in step); others show as is.
FAMILIES = MappingProxyType({
    "llama": "Llama", "qwen2": "Qwen2", "qwen3": "Qwen3", "gemma2": "Gemma-2", "gemma3": "Gemma-3",
    "phi3": "Phi-3", "qwen2moe": "Qwen2-MoE", "qwen3moe": "Qwen3-MoE", "gpt-oss": "GPT-OSS",
})
MOE_FAMILIES = MappingProxyType({"llama": "Mixtral"})
# Catalog / Hub dtypes as the QUANT column spells stored types (GGUF's names).
_DTYPES = MappingProxyType({"bfloat16": "BF16", "float16": "F16", "float32": "F32"})


@dataclass(frozen=True)
class GGUFSummary:
    """What ``llmsys models`` shows of a GGUF file: ``architecture`` as llama.cpp names it, ``family`` as shown,
    ``params`` (every tensor's elements), ``quant`` (llama.cpp's file type name, e.g. ``Q4_K_M``) and
    ``licence`` (``general.license``, or ``None``)."""

    architecture: str
    family: str
    params: int
    quant: str
    licence: str | None
    active: int | None = None  # parameters one token uses, for a mixture of experts (None: all of them)


def family_name(fields: Mapping[str, Any]) -> str:
    """``general.architecture`` as a family name (``qwen3moe`` -> ``Qwen3-MoE``; llama with experts -> Mixtral);
    one llmsys does not load is shown as written, marked so."""
    arch = str(fields.get("general.architecture", "?"))
    if arch in MOE_FAMILIES and fields.get(f"{arch}.expert_count"):
        return MOE_FAMILIES[arch]
    return FAMILIES.get(arch, f"{arch} (not supported)")


def quant_name(fields: Mapping[str, Any], qtypes: list[int]) -> str:
    """llama.cpp's ``general.file_type`` by name (``MOSTLY_Q4_K_M`` -> ``Q4_K_M``); without one, the type of
    most tensors of two or more dimensions (the weights) hold."""
    import gguf

    ftype = fields.get("general.file_type")
    if isinstance(ftype, int) and not isinstance(ftype, bool):
        try:
            name = gguf.LlamaFileType(ftype & ~gguf.LlamaFileType.GUESSED).name
            return name.removeprefix("MOSTLY_").removeprefix("ALL_")
        except ValueError:
            pass
    if not qtypes:
        return "-"
    common = Counter(qtypes).most_common(1)[0][0]
    try:
        return gguf.GGMLQuantizationType(common).name
    except ValueError:
        return f"type {common}"


def gguf_summary(path: Path) -> GGUFSummary:
    """``path``'s :class:`GGUFSummary`, from its header alone (one-line :class:`CheckpointError` if unreadable)."""
    from llmsys.engine.loader.gguf_header import read_header

    header = read_header(path)
    fields = header.fields
    arch = str(fields.get("general.architecture", "?"))
    licence = fields.get("general.license")
    total = sum(t.n_elements for t in header.tensors)
    # llama.cpp stacks each layer's routed experts in one "*_exps" tensor; a token uses expert_used_count of them.
    experts, used = fields.get(f"{arch}.expert_count"), fields.get(f"{arch}.expert_used_count")
    active = None
    if isinstance(experts, int) and isinstance(used, int) and 0 < used < experts:
        routed = sum(t.n_elements for t in header.tensors if "_exps." in t.name)
        active = total - routed + routed * used // experts if routed else None
    return GGUFSummary(
        architecture=arch,
        family=family_name(fields),
        params=total,
        quant=quant_name(fields, [t.qtype for t in header.tensors if len(t.shape) >= 2]),
        licence=licence if isinstance(licence, str) and licence else None,
        active=active,
    )


def format_count(n: int) -> str:
    """A parameter count with three significant digits, as catalog entries write it: 1.31M, 494M, 7.62B."""
    for unit, scale in (("T", 1e12), ("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if n >= scale * 0.9995:
            v = n / scale
            return f"{v:.2f}{unit}" if v < 10 else f"{v:.1f}{unit}" if v < 100 else f"{v:.0f}{unit}"
    return str(n)


def _row(entry: CatalogEntry) -> tuple[str, ...]:
    licence = entry.licence + (" (gated)" if entry.gated else "")
    downloaded = f"yes  {local_path(entry)}" if is_downloaded(entry) else "no"
    return (
        entry.name,
        entry.params,
        entry.architecture,
        _DTYPES.get(entry.default_dtype, entry.default_dtype.upper()),
        format_bytes(entry.size_bytes),
        licence,
        downloaded,
    )


def _ollama_row(model: ollama_store.OllamaModel) -> tuple[str, ...]:
    """A store model's row: name and size from the manifest, the rest from the GGUF header.

    Raises a one-line :class:`CheckpointError` naming the blob and ``ollama pull`` when the header is unreadable
    (the listing reports it and goes on).
    """
    try:
        s = gguf_summary(model.blob)
    except LLMSysError as exc:
        raise CheckpointError(
            f"the weights blob of {model.spec} is not a readable GGUF ({exc}); re-download it with "
            f"`ollama pull {model.spec.removeprefix(ollama_store.PREFIX)}`"
        ) from None
    params = format_count(s.params) + (f" ({format_count(s.active)} active)" if s.active is not None else "")
    return (model.spec, params, s.family, s.quant, format_bytes(model.size), s.licence or "-",
            IN_OLLAMA)


def _repo_row(spec: str, path: Path) -> tuple[str, ...]:
    """A pulled Hub repo's row: its architecture and stored dtype (or quantization) from config.json, its size."""
    try:
        config = json.loads((path / "config.json").read_text())
        archs = config.get("architectures") or ["-"]
    except (OSError, ValueError, AttributeError):
        config, archs = {}, ["-"]
    qc = config.get("quantization_config")
    dtype = config.get("torch_dtype") or config.get("dtype")
    if isinstance(qc, dict) and isinstance(qc.get("quant_method"), str):
        quant = qc["quant_method"].upper()
    else:
        quant = _DTYPES.get(dtype, str(dtype).upper()) if isinstance(dtype, str) else "-"
    size = sum(p.stat().st_size for p in path.iterdir() if p.is_file())
    return (spec, "-", str(archs[0]), quant, format_bytes(size), "-", f"yes  {path}")


def format_table(rows: list[tuple[str, ...]]) -> str:
    """Left-aligned plain-text columns (no colour: it is also piped to files)."""
    table = [_COLUMNS, *rows]
    widths = [max(len(row[i]) for row in table) for i in range(len(_COLUMNS))]
    lines = [
        "  ".join(cell.ljust(width) for cell, width in zip(row, widths)).rstrip()
        for row in table
    ]
    return "\n".join(lines)


def models_command(
    name: Optional[str] = typer.Argument(None, help="say what this one name means (path, catalog name or alias, "
                                         "NAME:TAG, org/repo) instead of listing"),
) -> None:
    """List the models in the catalog and whether each is downloaded (or, given NAME, what it resolves to)."""
    if name is not None:
        typer.echo(names.resolve(name).describe())
        return
    entries = list(load_catalog().values())
    broken: list[LLMSysError] = []
    pulled = ollama_store.list_models(on_error=broken.append)  # [] without a store
    repos = [_repo_row(spec, path) for spec, path in pulled_repos()]
    stored = []
    for model in pulled:
        try:
            stored.append(_ollama_row(model))
        except LLMSysError as exc:
            broken.append(exc)
    typer.echo(format_table([_row(entry) for entry in entries] + repos + stored))
    typer.echo(
        f"\nModels are stored under {llmsys_home() / 'models'} (set LLMSYS_HOME to move them). "
        "Download one with `llmsys pull NAME` (or any Hugging Face repo: `llmsys pull org/name`), "
        "or run any local directory with "
        "`llmsys run /path/to/model-dir`."
    )
    if pulled or broken:
        typer.echo(
            f"Models {IN_OLLAMA} {ollama_store.store_dir()} (set OLLAMA_MODELS to use another) "
            "run by the name listed: `llmsys run ollama:NAME:TAG`."
        )
    for exc in broken:  # one bad manifest must not hide the rest of the listing
        typer.echo(f"warning: skipped: {exc}", err=True)


def pull_command(
    name: str = typer.Argument(..., help="catalog name or alias (qwen2.5:0.5b; llmsys models lists them) or any "
                               "Hugging Face repo: org/name[@revision]"),
    endpoint: Optional[str] = typer.Option(
        None, "--endpoint", help="Hub URL (default: $HF_ENDPOINT or https://huggingface.co)."
    ),
) -> None:
    """Download a catalog model, or any Hugging Face repo llmsys can run, into $LLMSYS_HOME/models."""
    found = names.resolve(name)
    d = found.download()
    if d is None:  # a path, a model in the Ollama store: already here; a shape: nothing to fetch
        if found.kind is names.NameKind.SHAPE:
            found.local()  # raises: what a shape is and which model has it
        typer.echo(f"nothing to pull: {found.describe()}")
        return
    if is_complete(d.dest, d.files):
        typer.echo(f"{d.name} is already downloaded: {d.dest}")
        return
    if found.entry is not None:
        entry = found.entry
        typer.echo(
            f"pulling {entry.name} ({entry.params} params, ~{format_bytes(entry.size_bytes)}, "
            f"licence {entry.licence}) from {entry.repo}",
            err=True,
        )
    path = hub.download(d, endpoint=endpoint)
    typer.echo(f"{d.name} downloaded to {path}")


def ensure_pulled(model: str, allowed: bool, endpoint: str | None = None) -> names.ModelName:
    """Resolve ``model`` (:func:`llmsys.engine.names.resolve`) and pull it first when it is a catalog model
    or a Hub repo not yet downloaded; return what it resolved to.

    Why here and not in the loader: asking before a multi-GB download is the
    CLI's job (a confirmation on a TTY, none in a pipe, ``--no-pull`` to
    refuse); ``LLM(...)`` itself never touches the network. A name that means
    nothing fails here, in one line with its near misses, before anything loads.
    """
    found = names.resolve(model)
    if found.kind is names.NameKind.SHAPE:
        found.local()  # raises: a shape has no weights to load (plan and bench --synthetic take it)
    if not found.needs_pull:
        return found
    d = found.download()
    assert d is not None
    if not allowed:
        raise ModelNotFoundError(
            f"{d.name} is not downloaded and --no-pull was given; run `llmsys pull {d.name}` first"
        )
    if sys.stdin.isatty() and sys.stderr.isatty():
        _, files = plan_download(d, endpoint)
        size = format_bytes(sum(files.values()))
        if not typer.confirm(f"{d.name} is not downloaded: pull {size} from {d.repo} into {d.dest}?", default=True, err=True):
            raise ModelNotFoundError(f"{d.name} is not downloaded; run `llmsys pull {d.name}` when you want it")
    else:
        typer.echo(f"{d.name} is not downloaded: pulling it from {d.repo} (--no-pull refuses)", err=True)
    hub.download(d, endpoint=endpoint)
    return names.resolve(model)
