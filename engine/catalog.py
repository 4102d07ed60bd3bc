"""The model catalog (models.toml) and downloads from the Hugging Face Hub.

Why a catalog at all: a user should be able to type ``llmsys run
Qwen2.5-0.5B-Instruct`` without knowing the repo id, which files matter, or
how large the download is. The catalog pins exactly which files a model
needs (weights, config, tokenizer), so a pull never fetches duplicate
``.bin``/``original/`` weights, and ``llmsys models`` can show sizes and
licences before anything is downloaded.

Downloads are atomic: files land in a temporary directory next to the final
one and are renamed into place only when every file is complete, so a failed
or interrupted pull never leaves a half-populated model directory that a
later ``llmsys run NAME`` would mistake for a usable checkpoint.
"""

from __future__ import annotations

import difflib
import importlib
import inspect
import json
import os
import shutil
import struct
import sys
import tempfile
import urllib.error
import urllib.request
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any

try:  # Python >= 3.11
    import tomllib
except ModuleNotFoundError:  # pragma: no cover - Python 3.10
    import tomli as tomllib  # type: ignore[no-redef]

from llmsys.engine import ollama_store
from llmsys.kernels.common.units import format_bytes
from llmsys.kernels.common.errors import HubError, LLMSysError, ModelNotFoundError
from llmsys.kernels.common.paths import llmsys_home

CATALOG_FILENAME = "models.toml"
DEFAULT_ENDPOINT = "https://huggingface.co"
# Written into a model directory once every file has arrived; records the
# sizes so that `is_downloaded` can spot a file truncated or replaced later.
PULL_MANIFEST = ".llmsys-pull.json"
_REQUIRED = {
    "repo": str,
    "files": list,
    "architecture": str,
    "params": str,
    "size_bytes": int,
    "licence": str,
    "default_dtype": str,
    "chat": bool,
    "description": str,
}
_OPTIONAL = {"format": str, "subfolder": str, "gated": bool, "revision": str}
_FORMATS = ("hf", "llama2c")


@dataclass(frozen=True)
class CatalogEntry:
    """One downloadable model, as listed in models.toml.

    ``files`` are paths inside the repo (relative to ``subfolder`` when set);
    they are stored flat under :func:`local_path` with the same names.
    """

    name: str
    repo: str  # Hugging Face repo id, "owner/name"
    files: tuple[str, ...]
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
    files = table["files"]
    if not files or not all(isinstance(f, str) and f for f in files):
        raise LLMSysError(f"{where}: 'files' must be a non-empty list of file names")
    fmt = table.get("format", "hf")
    if fmt not in _FORMATS:
        raise LLMSysError(f"{where}: format must be one of {_FORMATS}, not {fmt!r}")
    return CatalogEntry(
        name=name,
        repo=table["repo"],
        files=tuple(files),
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
    )


def load_catalog(path: Path | None = None) -> dict[str, CatalogEntry]:
    """All models in the catalog, keyed by name, in file order.

    Parsed afresh on each call (the file is tiny) so that no module-level
    cache can go stale.
    """
    data = _read_toml(path)
    return {
        name: _entry_from_table(name, table, path)
        for name, table in data.items()
        if name != "synthetic"
    }


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


def _safetensors_complete(path: Path) -> bool:
    """True when the file is as long as its own header says it should be.

    A truncated download is the common corruption; checking the header's
    largest data offset against the file size catches it without reading
    the weights.
    """
    try:
        size = path.stat().st_size
        with open(path, "rb") as fh:
            (n,) = struct.unpack("<Q", fh.read(8))
            if n <= 0 or 8 + n > size:
                return False
            header = json.loads(fh.read(n))
        ends = [
            info["data_offsets"][1]
            for key, info in header.items()
            if key != "__metadata__"
        ]
        return size == 8 + n + max(ends, default=0)
    except (OSError, ValueError, KeyError, TypeError, IndexError, struct.error):
        return False


def is_downloaded(entry: CatalogEntry) -> bool:
    """All of the entry's files are present and complete in :func:`local_path`."""
    root = local_path(entry)
    if not root.is_dir():
        return False
    try:
        manifest = json.loads((root / PULL_MANIFEST).read_text()).get("files", {})
    except (OSError, ValueError, AttributeError):
        manifest = {}  # placed there by hand (e.g. `hf download --local-dir`)
    for name in entry.files:
        path = root / name
        if not path.is_file():
            return False
        size = path.stat().st_size
        if name in manifest and manifest[name] != size:
            return False
        if size == 0 and not name.endswith(".json"):
            return False
        if name.endswith(".safetensors") and not _safetensors_complete(path):
            return False
    return True


def resolve_model(spec: str) -> Path:
    """Turn what the user typed into a local path (file or directory).

    An existing path wins over a catalog name, so a local directory that
    happens to share a model's name is still loadable. ``ollama:NAME[:TAG]``
    is a model Ollama has pulled: its GGUF weights blob in the Ollama store
    (a file named by its digest, with no ``.gguf`` suffix).
    """
    path = Path(spec).expanduser()
    if path.exists():
        return path
    if spec.startswith(ollama_store.PREFIX):
        return ollama_store.resolve(spec).blob
    catalog = load_catalog()
    entry = find_entry(spec, catalog)
    if entry is not None:
        if is_downloaded(entry):
            return local_path(entry)
        raise ModelNotFoundError(
            f"model {entry.name} is not downloaded yet; run `llmsys pull {entry.name}` "
            f"(~{format_bytes(entry.size_bytes)} from {entry.repo} into {local_path(entry)})"
        )
    folded = {key.lower(): key for key in catalog}
    close = difflib.get_close_matches(spec.lower(), list(folded), n=1, cutoff=0.6)
    hint = f"; did you mean {folded[close[0]]}?" if close else ""
    raise ModelNotFoundError(
        f"no such file or directory: {spec}, and {spec} is not a model name in "
        f"models.toml (llmsys models lists them){hint}"
    )


# --------------------------------------------------------------------------
# Downloading
# --------------------------------------------------------------------------


def _resolve_endpoint(endpoint: str | None) -> str:
    """--endpoint, else $HF_ENDPOINT, else the public Hub (read at call time)."""
    return (endpoint or os.environ.get("HF_ENDPOINT") or DEFAULT_ENDPOINT).rstrip("/")


def _unreachable(endpoint: str, reason: str) -> HubError:
    return HubError(
        f"cannot reach the hub at {endpoint} ({reason}); check the network or "
        "--endpoint/HF_ENDPOINT, or load a local directory instead: "
        "llmsys run /path/to/model-dir ..."
    )


def _offline_requested() -> bool:
    flags = (os.environ.get("HF_HUB_OFFLINE"), os.environ.get("TRANSFORMERS_OFFLINE"))
    return any((v or "").strip().upper() in ("1", "ON", "YES", "TRUE") for v in flags)


def _check_reachable(endpoint: str, timeout: float = 10.0) -> None:
    """Fail fast when the endpoint does not answer at all.

    huggingface_hub retries connection errors with back-off for ~25 s per
    file before giving up; one direct probe (honouring proxy variables) turns
    "offline" into an immediate, clear error. Any HTTP answer counts as
    reachable: the per-file requests report what is actually missing.
    """
    request = urllib.request.Request(endpoint + "/", method="HEAD")
    try:
        with urllib.request.urlopen(request, timeout=timeout):
            pass
    except urllib.error.HTTPError:
        return  # the server answered
    except urllib.error.URLError as exc:
        raise _unreachable(endpoint, str(getattr(exc, "reason", exc))) from None
    except (OSError, ValueError) as exc:  # timeouts, resets, malformed URLs
        raise _unreachable(endpoint, str(exc) or type(exc).__name__) from None


def _network_errors() -> tuple[type[BaseException], ...]:
    """Transport-level exception types of whichever HTTP client hf uses."""
    found: list[type[BaseException]] = [ConnectionError, TimeoutError]
    for module, names in (
        ("httpx2", ("TransportError",)),
        ("httpx", ("TransportError",)),
        ("requests", ("ConnectionError", "Timeout")),
    ):
        mod = sys.modules.get(module)  # only clients already in use
        for attr in names:
            cls = getattr(mod, attr, None) if mod is not None else None
            if isinstance(cls, type) and issubclass(cls, BaseException):
                found.append(cls)
    return tuple(found)


def _hf_errors() -> Any:
    try:
        return importlib.import_module("huggingface_hub.errors")
    except ModuleNotFoundError:  # huggingface_hub < 0.24
        return importlib.import_module("huggingface_hub.utils")


def _quiet_tqdm() -> type:
    from tqdm.auto import tqdm

    class QuietTqdm(tqdm):  # a non-HF tqdm class: hf passes no `disable`
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            kwargs["disable"] = True
            super().__init__(*args, **kwargs)

    return QuietTqdm


def _download_one(
    entry: CatalogEntry, remote: str, directory: Path, endpoint: str, show_progress: bool
) -> Path:
    """hf_hub_download one file, mapping hub failures onto one-line HubErrors."""
    from huggingface_hub import hf_hub_download

    errors = _hf_errors()
    kwargs: dict[str, Any] = {}
    if "tqdm_class" in inspect.signature(hf_hub_download).parameters and not show_progress:
        kwargs["tqdm_class"] = _quiet_tqdm()
    where = f"{entry.repo}/{remote}"
    local_missing = getattr(errors, "LocalEntryNotFoundError")
    remote_missing = getattr(errors, "RemoteEntryNotFoundError", None) or errors.EntryNotFoundError
    offline = getattr(errors, "OfflineModeIsEnabled", ConnectionError)
    try:
        got = hf_hub_download(
            repo_id=entry.repo,
            filename=remote,
            revision=entry.revision,
            local_dir=directory,
            endpoint=endpoint,
            **kwargs,
        )
    except errors.GatedRepoError:
        raise HubError(
            f"{entry.repo} is gated: accept its licence at {endpoint}/{entry.repo}, log in with "
            f"`hf auth login` (or set HF_TOKEN), then rerun `llmsys pull {entry.name}`"
        ) from None
    except errors.RepositoryNotFoundError:
        raise HubError(
            f"repository {entry.repo} not found at {endpoint} (or it is private and no token "
            f"was given); check its repo id in models.toml or log in with `hf auth login`"
        ) from None
    except errors.RevisionNotFoundError:
        raise HubError(
            f"revision {entry.revision} of {entry.repo} not found at {endpoint}; "
            "fix 'revision' in models.toml"
        ) from None
    except (local_missing, offline) as exc:
        raise _unreachable(endpoint, f"while fetching {where}: {type(exc).__name__}") from None
    except remote_missing:
        raise HubError(
            f"file {remote} not found in repo {entry.repo} at {endpoint}; the models.toml "
            f"entry {entry.name} lists a file the repo does not have"
        ) from None
    except errors.HfHubHTTPError as exc:
        status = getattr(getattr(exc, "response", None), "status_code", "?")
        raise HubError(
            f"the hub at {endpoint} answered HTTP {status} for {where}; retry later"
        ) from None
    except _network_errors() as exc:
        raise _unreachable(endpoint, f"while fetching {where}: {type(exc).__name__}") from None
    return Path(got)


def _remove_empty_dirs(path: Path, stop: Path) -> None:
    """rmdir `path` and its parents up to (not including) `stop` while empty."""
    while path != stop and stop in path.parents:
        try:
            path.rmdir()
        except OSError:
            return
        path = path.parent


def _replace_dir(src: Path, dest: Path) -> None:
    """Move the finished download into place, swapping out any stale copy."""
    if not dest.exists():
        src.rename(dest)
        return
    stale = dest.with_name(f".stale-{dest.name}-{uuid.uuid4().hex[:8]}")
    dest.rename(stale)
    src.rename(dest)
    shutil.rmtree(stale, ignore_errors=True)


def pull(
    model: str | CatalogEntry,
    *,
    endpoint: str | None = None,
    progress: bool = True,
) -> Path:
    """Download a catalog model into :func:`local_path` and return that path.

    ``model`` is a catalog name or an explicit :class:`CatalogEntry` (tests
    and custom catalogs). A model already complete on disk is not fetched
    again. Progress bars appear only when ``progress`` and stderr is a TTY.
    """
    if isinstance(model, CatalogEntry):
        entry = model
    else:
        catalog = load_catalog()
        found = find_entry(model, catalog)
        if found is None:
            raise ModelNotFoundError(
                f"{model} is not a model name in models.toml; `llmsys models` lists them"
            )
        entry = found
    dest = local_path(entry)
    if is_downloaded(entry):
        return dest
    url = _resolve_endpoint(endpoint)
    if _offline_requested():
        raise _unreachable(url, "HF_HUB_OFFLINE is set")
    _check_reachable(url)

    show = progress and sys.stderr.isatty()
    try:
        dest.parent.mkdir(parents=True, exist_ok=True)
        # Same directory as `dest` so the final rename is atomic (one filesystem).
        tmp = Path(tempfile.mkdtemp(prefix=f".pull-{entry.name}-", dir=dest.parent))
    except OSError as exc:
        raise LLMSysError(
            f"cannot create {dest.parent}: {exc.strerror or exc}; set LLMSYS_HOME to a writable directory"
        ) from None
    try:
        sizes: dict[str, int] = {}
        for i, name in enumerate(entry.files, 1):
            remote = f"{entry.subfolder}/{name}" if entry.subfolder else name
            if show:
                print(f"[{i}/{len(entry.files)}] {entry.repo}/{remote}", file=sys.stderr)
            got = _download_one(entry, remote, tmp, url, show)
            target = tmp / name
            if got.resolve() != target.resolve():
                target.parent.mkdir(parents=True, exist_ok=True)
                shutil.move(str(got), target)
            sizes[name] = target.stat().st_size
        # hf's local_dir bookkeeping (.cache/huggingface) and emptied subfolders.
        shutil.rmtree(tmp / ".cache", ignore_errors=True)
        if entry.subfolder:
            _remove_empty_dirs(tmp / entry.subfolder, stop=tmp)
        manifest = {"repo": entry.repo, "revision": entry.revision, "endpoint": url, "files": sizes}
        (tmp / PULL_MANIFEST).write_text(json.dumps(manifest, indent=1))
        if is_downloaded(entry):  # a concurrent pull finished first
            shutil.rmtree(tmp, ignore_errors=True)
            return dest
        _replace_dir(tmp, dest)
    except OSError as exc:
        shutil.rmtree(tmp, ignore_errors=True)
        raise LLMSysError(
            f"cannot write {entry.name} under {dest.parent}: {exc.strerror or exc}; "
            "free disk space or set LLMSYS_HOME to another disk"
        ) from None
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return dest
