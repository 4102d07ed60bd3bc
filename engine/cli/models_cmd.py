"""`llmsys models` and `llmsys pull`: list the catalog, download a model.

`llmsys models` lists the models Ollama has pulled too (when its store
exists), as the ``ollama:NAME:TAG`` names `llmsys run` takes, so a user sees
every runnable name in one table.

Only the command functions live here; `llmsys.engine.cli.main` registers
them on the Typer app and turns raised :class:`LLMSysError`s into
``error: <message>`` lines, so these functions never print errors or exit.
"""

from __future__ import annotations

from typing import Optional

import typer

from llmsys.engine import ollama_store
from llmsys.engine.catalog import (
    CatalogEntry,
    find_entry,
    is_downloaded,
    load_catalog,
    local_path,
    pull,
)
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
    typer.echo(format_table([_row(entry) for entry in entries] + [_ollama_row(m) for m in pulled]))
    typer.echo(
        f"\nModels are stored under {llmsys_home() / 'models'} (set LLMSYS_HOME to move them). "
        "Download one with `llmsys pull NAME`, or run any local directory with "
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
    name: str,
    endpoint: Optional[str] = typer.Option(
        None, "--endpoint", help="Hub URL (default: $HF_ENDPOINT or https://huggingface.co)."
    ),
) -> None:
    """Download a catalog model into $LLMSYS_HOME/models/NAME."""
    entry = find_entry(name)
    if entry is None:
        raise ModelNotFoundError(
            f"{name} is not a model name in models.toml; `llmsys models` lists them"
        )
    if is_downloaded(entry):
        typer.echo(f"{entry.name} is already downloaded: {local_path(entry)}")
        return
    typer.echo(
        f"pulling {entry.name} ({entry.params} params, ~{format_bytes(entry.size_bytes)}, "
        f"licence {entry.licence}) from {entry.repo}",
        err=True,
    )
    path = pull(entry, endpoint=endpoint)
    typer.echo(f"{entry.name} downloaded to {path}")
