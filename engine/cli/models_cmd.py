"""`llmsys models` and `llmsys pull`: list the catalog, download a model.

`llmsys models` lists the models Ollama has pulled too (when its store
exists), as the ``ollama:NAME:TAG`` names `llmsys run` takes, so a user sees
every runnable name in one table.

Only the command functions live here; `llmsys.engine.cli.main` registers
them on the Typer app and turns raised :class:`LLMSysError`s into
``error: <message>`` lines, so these functions never print errors or exit.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Optional

import typer

from llmsys.engine import ollama_store
from llmsys.engine.catalog import (
    CatalogEntry,
    download_for,
    find_entry,
    is_downloaded,
    load_catalog,
    local_path,
    pull,
)
from llmsys.engine.hub import RepoRef, is_complete, plan_download, pulled_repos
from llmsys.kernels.common.paths import llmsys_home
from llmsys.kernels.common.units import format_bytes
from llmsys.kernels.common.errors import LLMSysError, ModelNotFoundError

_COLUMNS = ("NAME", "PARAMS", "ARCHITECTURE", "SIZE", "LICENCE", "DOWNLOADED")
IN_OLLAMA = "in the Ollama store"


def _row(entry: CatalogEntry) -> tuple[str, ...]:
    licence = entry.licence + (" (gated)" if entry.gated else "")
    downloaded = f"yes  {local_path(entry)}" if is_downloaded(entry) else "no"
    return (
        entry.name,
        entry.params,
        entry.architecture,
        format_bytes(entry.size_bytes),
        licence,
        downloaded,
    )


def _ollama_row(model: ollama_store.OllamaModel) -> tuple[str, ...]:
    """A store model's row: what the manifest knows (name, size); the rest is in the GGUF."""
    return (model.spec, "-", "-", format_bytes(model.size), "-", IN_OLLAMA)


def _repo_row(spec: str, path: Path) -> tuple[str, ...]:
    """A pulled Hub repo's row: its architecture from config.json, its size on disk."""
    try:
        archs = json.loads((path / "config.json").read_text()).get("architectures") or ["-"]
    except (OSError, ValueError, AttributeError):
        archs = ["-"]
    size = sum(p.stat().st_size for p in path.iterdir() if p.is_file())
    return (spec, "-", str(archs[0]), format_bytes(size), "-", f"yes  {path}")


def format_table(rows: list[tuple[str, ...]]) -> str:
    """Left-aligned plain-text columns (no colour: it is also piped to files)."""
    table = [_COLUMNS, *rows]
    widths = [max(len(row[i]) for row in table) for i in range(len(_COLUMNS))]
    lines = [
        "  ".join(cell.ljust(width) for cell, width in zip(row, widths)).rstrip()
        for row in table
    ]
    return "\n".join(lines)


def models_command() -> None:
    """List the models in the catalog and whether each is downloaded."""
    entries = list(load_catalog().values())
    broken: list[LLMSysError] = []
    pulled = ollama_store.list_models(on_error=broken.append)  # [] without a store
    repos = [_repo_row(spec, path) for spec, path in pulled_repos()]
    typer.echo(format_table([_row(entry) for entry in entries] + repos + [_ollama_row(m) for m in pulled]))
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
    name: str = typer.Argument(..., help="catalog name (llmsys models) or any Hugging Face repo: org/name[@revision]"),
    endpoint: Optional[str] = typer.Option(
        None, "--endpoint", help="Hub URL (default: $HF_ENDPOINT or https://huggingface.co)."
    ),
) -> None:
    """Download a catalog model, or any Hugging Face repo llmsys can run, into $LLMSYS_HOME/models."""
    d = download_for(name)
    if is_complete(d.dest, d.files):
        typer.echo(f"{d.name} is already downloaded: {d.dest}")
        return
    entry = find_entry(name)
    if entry is not None:
        typer.echo(
            f"pulling {entry.name} ({entry.params} params, ~{format_bytes(entry.size_bytes)}, "
            f"licence {entry.licence}) from {entry.repo}",
            err=True,
        )
    path = pull(name, endpoint=endpoint)
    typer.echo(f"{d.name} downloaded to {path}")


def ensure_pulled(model: str, allowed: bool, endpoint: str | None = None) -> None:
    """Pull ``model`` first when it names a catalog model or a Hub repo not yet downloaded.

    Why here and not in the loader: asking before a multi-GB download is the
    CLI's job (a confirmation on a TTY, none in a pipe, ``--no-pull`` to
    refuse); ``LLM(...)`` itself never touches the network.
    """
    if Path(model).expanduser().exists() or model.startswith(ollama_store.PREFIX):
        return
    entry = find_entry(model)
    if entry is None and RepoRef.parse(model) is None:
        return  # not a downloadable name: resolve_model says what it is
    d = download_for(model)
    if is_complete(d.dest, d.files):
        return
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
    pull(model, endpoint=endpoint)
