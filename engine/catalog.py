"""The model catalog (models.toml) and downloads from the Hugging Face Hub.

Why a catalog at all: a user should be able to type ``llmsys run
Qwen2.5-0.5B-Instruct`` without knowing the repo id, which files matter, or
how large the download is. The catalog pins exactly which files a model
needs (weights, config, tokenizer), so a pull never fetches duplicate
``.bin``/``original/`` weights, and ``llmsys models`` can show sizes and
licences before anything is downloaded.

The download itself (atomic, resumable, the same for a catalog name and an
arbitrary ``org/repo``) lives in :mod:`llmsys.engine.hub`; this module says
what an entry holds: which repo, which files, which local directory, which
other names (aliases) mean it. What any name a user types means (a path, an
alias, a repo, the Ollama store) is :mod:`llmsys.engine.names`'s one rule.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

try:  # Python >= 3.11
    import tomllib
except ModuleNotFoundError:  # pragma: no cover - Python 3.10
    import tomli as tomllib  # type: ignore[no-redef]

from llmsys.engine import hub
from llmsys.kernels.common.errors import LLMSysError, ModelNotFoundError
from llmsys.kernels.common.paths import llmsys_home

CATALOG_FILENAME = "models.toml"
_REQUIRED = {
    "repo": str,
    "architecture": str,
    "params": str,
    "size_bytes": int,
    "licence": str,
    "default_dtype": str,
    "chat": bool,
    "description": str,
}
_OPTIONAL = {
    "format": str, "subfolder": str, "gated": bool, "revision": str, "files": list, "aliases": list, "shape": str,
}
_FORMATS = ("hf", "llama2c")
_ALIAS = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*(:[A-Za-z0-9_][A-Za-z0-9._-]*)?$")


@dataclass(frozen=True)
class CatalogEntry:
    """One downloadable model, as listed in models.toml.

    ``files`` are paths inside the repo (relative to ``subfolder`` when set);
    they are stored flat under :func:`local_path` with the same names. None:
    chosen when pulling from the repo's file list, as for an ``org/repo`` pull
    (``hub.choose_files``: config, tokenizer and safetensors at its top level;
    the architecture checked before the weights): for large sharded repos whose
    shard list is best read from the Hub itself.
    """

    name: str
    repo: str  # Hugging Face repo id, "owner/name"
    files: tuple[str, ...] | None
    architecture: str  # HF `architectures[0]`, e.g. "LlamaForCausalLM"
    params: str  # human-readable parameter count, e.g. "1.24B"
    size_bytes: int  # approximate bf16 weight bytes (the download size)
    licence: str
    default_dtype: str
    chat: bool  # has a chat template / instruction tuned
    description: str
    format: str = "hf"  # "hf" (config.json + safetensors) or "llama2c"
    subfolder: str | None = None  # repo folder holding `files`
    gated: bool = False  # licence must be accepted on the Hub first
    revision: str = "main"
    # Other names for the same model, Ollama style (``qwen2.5:0.5b``): `llmsys.engine.names` also takes
    # each with ``-`` for ``:`` (``qwen2.5-0.5b``) and a ``NAME:latest`` as plain ``NAME``.
    aliases: tuple[str, ...] = ()
    # The [synthetic.NAME] table with this model's shape: `llmsys plan` plans from it before a download.
    shape: str | None = None


# --------------------------------------------------------------------------
# Reading the catalog
# --------------------------------------------------------------------------


def catalog_path() -> Path:
    """Where models.toml lives: package data of `llmsys`, else the repo root."""
    try:
        from importlib.resources import files

        candidate = files("llmsys") / CATALOG_FILENAME
        if candidate.is_file():
            return Path(str(candidate))
    except (ImportError, ModuleNotFoundError, TypeError):
        pass
    return Path(__file__).resolve().parents[1] / CATALOG_FILENAME


def _read_toml(path: Path | None) -> dict[str, Any]:
    path = Path(path) if path is not None else catalog_path()
    try:
        with open(path, "rb") as fh:
            return tomllib.load(fh)
    except FileNotFoundError:
        raise LLMSysError(
            f"model catalog {path} is missing; reinstall llmsys (pip install -e .)"
        ) from None
    except tomllib.TOMLDecodeError as exc:
        raise LLMSysError(f"model catalog {path} is not valid TOML: {exc}") from None


def _entry_from_table(name: str, table: dict[str, Any], path: Path | None) -> CatalogEntry:
    where = f"models.toml entry [{name}]" if path is None else f"{path} entry [{name}]"
    for key, typ in _REQUIRED.items():
        if key not in table:
            raise LLMSysError(f"{where} lacks the '{key}' field")
        if not isinstance(table[key], typ) or (typ is int and isinstance(table[key], bool)):
            raise LLMSysError(f"{where}: '{key}' must be a {typ.__name__}")
    for key, typ in _OPTIONAL.items():
        if key in table and not isinstance(table[key], typ):
            raise LLMSysError(f"{where}: '{key}' must be a {typ.__name__}")
    unknown = set(table) - set(_REQUIRED) - set(_OPTIONAL)
    if unknown:
        raise LLMSysError(f"{where} has unknown fields {sorted(unknown)}")
    files = table.get("files")
    if files is not None and (not files or not all(isinstance(f, str) and f for f in files)):
        raise LLMSysError(f"{where}: 'files' must be a non-empty list of file names (or left out)")
    aliases = table.get("aliases", [])
    if not all(isinstance(a, str) and _ALIAS.match(a) for a in aliases):
        raise LLMSysError(f"{where}: 'aliases' must be names like qwen2.5:0.5b (letters, digits, '.', '_', '-', one ':')")
    fmt = table.get("format", "hf")
    if fmt not in _FORMATS:
        raise LLMSysError(f"{where}: format must be one of {_FORMATS}, not {fmt!r}")
    return CatalogEntry(
        name=name,
        repo=table["repo"],
        files=tuple(files) if files is not None else None,
        architecture=table["architecture"],
        params=table["params"],
        size_bytes=table["size_bytes"],
        licence=table["licence"],
        default_dtype=table["default_dtype"],
        chat=table["chat"],
        description=table["description"],
        format=fmt,
        subfolder=table.get("subfolder"),
        gated=table.get("gated", False),
        revision=table.get("revision", "main"),
        aliases=tuple(aliases),
        shape=table.get("shape"),
    )


def load_catalog(path: Path | None = None) -> dict[str, CatalogEntry]:
    """All models in the catalog, keyed by name, in file order.

    Parsed afresh on each call (the file is tiny) so that no module-level
    cache can go stale.
    """
    data = _read_toml(path)
    catalog = {
        name: _entry_from_table(name, table, path)
        for name, table in data.items()
        if name != "synthetic"
    }
    _check_names(catalog, data.get("synthetic", {}), path or catalog_path())
    return catalog


def names_of(entry: CatalogEntry) -> tuple[str, ...]:
    """Every name that means ``entry``, its own first: each alias as written, with ``-`` for its ``:``
    (``qwen2.5-0.5b``, the spelling a shell user or a file name uses), and ``NAME:latest`` as ``NAME``
    (Ollama's default tag)."""
    out = [entry.name]
    for alias in entry.aliases:
        base, _, tag = alias.partition(":")
        out += [alias, base if tag == "latest" else f"{base}-{tag}" if tag else alias]
    return tuple(dict.fromkeys(out))


def _check_names(catalog: dict[str, CatalogEntry], shapes: dict[str, Any], path: Path) -> None:
    """One name, one model: a name or alias (any case, any derived spelling) may mean one entry only, and
    a ``shape`` must name a [synthetic.*] table."""
    owner: dict[str, str] = {}
    for entry in catalog.values():
        for name in names_of(entry):
            other = owner.setdefault(name.lower(), entry.name)
            if other != entry.name:
                raise LLMSysError(f"{path}: the name {name!r} means both [{other}] and [{entry.name}]; "
                                  "give each alias to one entry")
        if entry.shape is not None and entry.shape not in shapes:
            raise LLMSysError(f"{path} entry [{entry.name}]: shape {entry.shape!r} is not a [synthetic.*] table "
                              f"(there are: {', '.join(shapes) or 'none'})")


def synthetic_configs(path: Path | None = None) -> dict[str, dict]:
    """Benchmark shapes ([synthetic.NAME]) as HF config.json dicts."""
    return dict(_read_toml(path).get("synthetic", {}))


def find_entry(name: str, catalog: dict[str, CatalogEntry] | None = None) -> CatalogEntry | None:
    """Look a name up exactly, then case-insensitively ("qwen3-0.6b")."""
    catalog = load_catalog() if catalog is None else catalog
    if name in catalog:
        return catalog[name]
    folded = {key.lower(): entry for key, entry in catalog.items()}
    return folded.get(name.lower())


# --------------------------------------------------------------------------
# Local storage
# --------------------------------------------------------------------------


def local_path(entry: CatalogEntry) -> Path:
    """Directory a pulled model lives in: ``<home>/models/<name>``."""
    return llmsys_home() / "models" / entry.name


def is_downloaded(entry: CatalogEntry) -> bool:
    """All of the entry's files are present and complete in :func:`local_path`."""
    return hub.is_complete(local_path(entry), entry.files)


def resolve_model(spec: str) -> Path:
    """Turn what the user typed into a local path (file or directory), or a one-line error saying how
    to get it: :func:`llmsys.engine.names.resolve` decides what the name means (imported here, not at
    the top: names builds on this module)."""
    from llmsys.engine import names

    return names.resolve(spec).local()


# --------------------------------------------------------------------------
# Downloading
# --------------------------------------------------------------------------


def download_for(model: str | CatalogEntry, name: str | None = None) -> hub.Download:
    """What pulling ``model`` fetches: a catalog entry's files, or an ``org/repo[@rev]``'s.

    A string is any name :func:`llmsys.engine.names.resolve` takes (``qwen2.5:0.5b``, a catalog name, a
    repo id); one with nothing to download (a path, a model in the Ollama store, a shape) is a one-line
    error. ``name``: what the messages and the rerun hint call it (default: the entry's name).
    """
    if isinstance(model, CatalogEntry):
        return hub.Download(
            name=name or model.name, repo=model.repo, revision=model.revision, dest=local_path(model),
            files=model.files, subfolder=model.subfolder,
        )
    from llmsys.engine import names

    found = names.resolve(model)
    d = found.download()
    if d is None:
        raise ModelNotFoundError(f"{model} has nothing to download: it is {found.describe().partition(': ')[2]}")
    return d


def is_pulled(model: str) -> bool:
    """``model`` (catalog name, alias or repo id) is downloaded completely."""
    d = download_for(model)
    return hub.is_complete(d.dest, d.files)


def pull(
    model: str | CatalogEntry,
    *,
    endpoint: str | None = None,
    progress: bool = True,
) -> Path:
    """Download a catalog model or a Hugging Face repo; return its local directory.

    ``model`` is a catalog name or alias, an ``org/repo[@revision]`` of any repo
    with a supported architecture, or an explicit :class:`CatalogEntry` (tests and
    custom catalogs). A model already complete on disk is not fetched again.
    """
    d = download_for(model)
    if hub.is_complete(d.dest, d.files):
        return d.dest
    return hub.download(d, endpoint=endpoint, progress=progress)
