"""Downloads from the Hugging Face Hub: catalog models and any ``org/repo``, one way.

A catalog pull (models.toml names the files) and ``llmsys pull org/repo@rev`` differ only in which
files they fetch. Both list the repo through the Hub API first, so a missing repo, gated licence, bad
revision or missing file is one line before any byte is written; ``huggingface_hub.snapshot_download``
then fetches. Atomic and resumable: files land in ``.pull-NAME`` beside the target and are renamed into
place only when complete (never a half directory ``llmsys run`` would take for a model); rerun resumes.
"""

from __future__ import annotations

import fnmatch
import importlib
import inspect
import json
import os
import re
import shutil
import struct
import sys
import urllib.error
import urllib.request
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

from llmsys.kernels.common.errors import HubError, LLMSysError, UnsupportedModelError
from llmsys.kernels.common.paths import llmsys_home
from llmsys.kernels.common.units import format_bytes

DEFAULT_ENDPOINT = "https://huggingface.co"
# Written into a model directory once every file has arrived; records the
# sizes so that a file truncated or replaced later is noticed.
PULL_MANIFEST = ".llmsys-pull.json"
HUB_DIR = "hub"  # <home>/models/hub/<org>/<repo>: arbitrary repos, apart from catalog names
# What a Hugging Face model directory needs, at the repo's top level: weights
# as safetensors (never the .bin/.pth/original/ duplicates), config, tokenizer
# and chat template files.
REPO_PATTERNS = (
    "config.json", "generation_config.json", "*.safetensors", "*.safetensors.index.json",
    "tokenizer.json", "tokenizer_config.json", "tokenizer.model", "special_tokens_map.json",
    "added_tokens.json", "vocab.json", "merges.txt", "chat_template.jinja", "chat_template.json",
)
_REPO_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")


@dataclass(frozen=True)
class RepoRef:
    """``org/repo[@revision]`` as typed on the command line."""

    repo: str
    revision: str = "main"

    @classmethod
    def parse(cls, spec: str) -> RepoRef | None:
        """The repo named by ``spec``, or None when ``spec`` is not shaped like a repo id."""
        repo, _, revision = spec.partition("@")
        if not _REPO_ID.match(repo) or ".." in repo or (spec.count("@") and not revision):
            return None
        return cls(repo, revision or "main")

    @property
    def spec(self) -> str:
        return self.repo if self.revision == "main" else f"{self.repo}@{self.revision}"

    def local_path(self) -> Path:
        """Where this repo's pull lives: ``<home>/models/hub/<org>/<repo>`` (one per revision)."""
        name = self.repo.split("/")[1] + ("" if self.revision == "main" else f"@{self.revision}")
        return llmsys_home() / "models" / HUB_DIR / self.repo.split("/")[0] / name


@dataclass(frozen=True)
class Download:
    """One pull: which repo, which files, where they land.

    ``files`` are exact paths inside the repo (relative to ``subfolder``; they
    are stored flat in ``dest``), or None to choose them from the repo's listing
    (:data:`REPO_PATTERNS`, an architecture llmsys runs, safetensors weights).
    """

    name: str  # what the user typed: shown in messages and the rerun hint
    repo: str
    revision: str
    dest: Path
    files: tuple[str, ...] | None = None
    subfolder: str | None = None


# --------------------------------------------------------------------------
# Reachability and error mapping
# --------------------------------------------------------------------------


def resolve_endpoint(endpoint: str | None) -> str:
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
    reachable: the API calls report what is actually missing.
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


def _hub_call(d: Download, endpoint: str, what: str, call: Callable[[], Any]) -> Any:
    """Run one huggingface_hub call, mapping its failures onto one-line HubErrors."""
    errors = _hf_errors()
    local_missing = getattr(errors, "LocalEntryNotFoundError")
    remote_missing = getattr(errors, "RemoteEntryNotFoundError", None) or errors.EntryNotFoundError
    offline = getattr(errors, "OfflineModeIsEnabled", ConnectionError)
    try:
        return call()
    except errors.GatedRepoError:
        raise HubError(
            f"{d.repo} is gated: accept its licence at {endpoint}/{d.repo}, log in with "
            f"`hf auth login` (or set HF_TOKEN), then rerun `llmsys pull {d.name}`"
        ) from None
    except errors.RepositoryNotFoundError:
        raise HubError(
            f"repository {d.repo} not found at {endpoint} (or it is private and no token "
            f"was given); check the repo id or log in with `hf auth login`"
        ) from None
    except errors.RevisionNotFoundError:
        raise HubError(
            f"revision {d.revision} of {d.repo} not found at {endpoint}; "
            f"name a branch, tag or commit that exists: {d.repo}@REVISION"
        ) from None
    except (local_missing, offline) as exc:
        raise _unreachable(endpoint, f"while fetching {what}: {type(exc).__name__}") from None
    except remote_missing:
        raise HubError(f"{what} not found in repo {d.repo} at {endpoint}") from None
    except errors.HfHubHTTPError as exc:
        status = getattr(getattr(exc, "response", None), "status_code", "?")
        raise HubError(f"the hub at {endpoint} answered HTTP {status} for {what}; retry later") from None
    except _network_errors() as exc:
        raise _unreachable(
            endpoint, f"while fetching {what}: {type(exc).__name__}; rerun to resume"
        ) from None


def _quiet_tqdm() -> type:
    from tqdm.auto import tqdm

    class QuietTqdm(tqdm):  # a non-HF tqdm class: hf passes no `disable`
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            kwargs["disable"] = True
            super().__init__(*args, **kwargs)

    return QuietTqdm


# --------------------------------------------------------------------------
# Choosing the files
# --------------------------------------------------------------------------


def _repo_files(d: Download, endpoint: str) -> tuple[str, dict[str, int]]:
    """(commit sha, {path: size}) of the repo at ``d.revision``, from the Hub API."""
    from huggingface_hub import HfApi
    from huggingface_hub.hf_api import RepoFile

    api = HfApi(endpoint=endpoint)
    info = _hub_call(d, endpoint, f"{d.repo}@{d.revision}", lambda: api.model_info(d.repo, revision=d.revision))
    sha = info.sha or d.revision
    tree = _hub_call(
        d, endpoint, f"the file list of {d.repo}",
        lambda: list(api.list_repo_tree(d.repo, revision=sha, recursive=True)),
    )
    return sha, {f.path: int(f.size or 0) for f in tree if isinstance(f, RepoFile)}


def choose_files(repo: str, listing: dict[str, int]) -> list[str]:
    """The files of an arbitrary repo llmsys needs (top level, :data:`REPO_PATTERNS`)."""
    top = [p for p in listing if "/" not in p]
    chosen = sorted(p for p in top if any(fnmatch.fnmatch(p, pat) for pat in REPO_PATTERNS))
    if "config.json" not in chosen:
        gguf = [p for p in listing if p.endswith(".gguf")]
        hint = (
            f"; it holds GGUF files ({', '.join(gguf[:3])}{', ...' if len(gguf) > 3 else ''}): download "
            "one and run it directly, `llmsys run FILE.gguf`" if gguf else ""
        )
        raise HubError(f"{repo} has no config.json, so it is not a Hugging Face model llmsys can run{hint}")
    if not any(p.endswith(".safetensors") for p in chosen):
        raise HubError(
            f"{repo} has no safetensors weights at its top level (llmsys reads safetensors and GGUF, "
            "not .bin/.pth); pick a repo that ships model.safetensors"
        )
    return chosen


def check_architecture(repo: str, config_path: Path) -> None:
    """Refuse a repo whose config.json names an architecture llmsys does not run."""
    from llmsys.engine.models import ARCHITECTURES, FAMILIES

    try:
        cfg = json.loads(config_path.read_text())
    except (OSError, ValueError) as exc:
        raise HubError(f"{repo}: config.json is not readable JSON ({exc})") from None
    if not isinstance(cfg, dict):
        raise HubError(f"{repo}: config.json is not a JSON object")
    archs = cfg.get("architectures") or []
    if cfg.get("model_type") in FAMILIES or any(a in ARCHITECTURES for a in archs):
        return
    what = ", ".join(map(str, archs)) or str(cfg.get("model_type") or "no architecture")
    raise UnsupportedModelError(
        f"{repo} is a {what} model; llmsys runs {', '.join(ARCHITECTURES)} (nothing was downloaded)"
    )


# --------------------------------------------------------------------------
# The download
# --------------------------------------------------------------------------


def is_complete(root: Path, files: tuple[str, ...] | None = None) -> bool:
    """Every file of a pull is present and as large as when it arrived.

    ``files`` are the names the directory must hold (a catalog entry's); None
    takes them from the pull manifest (an arbitrary repo's pull).
    """
    if not root.is_dir():
        return False
    try:
        manifest = json.loads((root / PULL_MANIFEST).read_text()).get("files", {})
    except (OSError, ValueError, AttributeError):
        manifest = {}  # placed there by hand (e.g. `hf download --local-dir`)
    names = files if files is not None else tuple(manifest)
    if not names:
        return False
    for name in names:
        path = root / name
        if not path.is_file():
            return False
        size = path.stat().st_size
        if name in manifest and manifest[name] != size:
            return False
        if size == 0 and not name.endswith(".json"):
            return False
        if name.endswith(".safetensors") and not safetensors_complete(path):
            return False
    return True


def safetensors_complete(path: Path) -> bool:
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
        ends = [info["data_offsets"][1] for key, info in header.items() if key != "__metadata__"]
        return size == 8 + n + max(ends, default=0)
    except (OSError, ValueError, KeyError, TypeError, IndexError, struct.error, AttributeError):
        return False


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


def _work_dir(dest: Path) -> Path:
    """The stable staging folder of a pull: the same path on a rerun, so it resumes."""
    try:
        dest.parent.mkdir(parents=True, exist_ok=True)
        work = dest.with_name(f".pull-{dest.name}")
        work.mkdir(exist_ok=True)
        return work
    except OSError as exc:
        raise LLMSysError(
            f"cannot create {dest.parent}: {exc.strerror or exc}; set LLMSYS_HOME to a writable directory"
        ) from None


def plan_download(d: Download, endpoint: str | None = None) -> tuple[str, dict[str, int]]:
    """(commit, {repo path: size}) of what :func:`download` would fetch; nothing is written.

    Raises the one-line HubError for a missing repo, revision or file, a gated
    repo, or a repo without what llmsys needs.
    """
    url = resolve_endpoint(endpoint)
    if _offline_requested():
        raise _unreachable(url, "HF_HUB_OFFLINE is set")
    _check_reachable(url)
    sha, listing = _repo_files(d, url)
    if d.files is None:
        wanted = choose_files(d.repo, listing)
    else:
        wanted = [f"{d.subfolder}/{name}" if d.subfolder else name for name in d.files]
        missing = [p for p in wanted if p not in listing]
        if missing:
            raise HubError(
                f"file {missing[0]} not found in repo {d.repo} at {url}; the models.toml "
                f"entry {d.name} lists a file the repo does not have"
            )
    return sha, {p: listing[p] for p in wanted}


def download(d: Download, *, endpoint: str | None = None, progress: bool = True) -> Path:
    """Fetch ``d`` into ``d.dest`` (atomic, resumable) and return ``d.dest``.

    Progress bars (huggingface_hub's) appear only when ``progress`` and stderr
    is a TTY.
    """
    from huggingface_hub import hf_hub_download, snapshot_download

    url = resolve_endpoint(endpoint)
    sha, wanted = plan_download(d, url)
    show = progress and sys.stderr.isatty()
    if show:
        print(
            f"pulling {d.repo}@{sha[:12]}: {len(wanted)} files, {format_bytes(sum(wanted.values()))}",
            file=sys.stderr,
        )
    quiet: dict[str, Any] = {} if show else {"tqdm_class": _quiet_tqdm()}
    work = _work_dir(d.dest)
    try:
        if d.files is None:  # an arbitrary repo: its architecture is checked before the weights come
            cfg_kwargs = {k: v for k, v in quiet.items() if k in inspect.signature(hf_hub_download).parameters}
            got = _hub_call(d, url, f"{d.repo}/config.json", lambda: hf_hub_download(
                d.repo, "config.json", revision=sha, local_dir=work, endpoint=url, **cfg_kwargs))
            check_architecture(d.repo, Path(got))
        _hub_call(d, url, f"{len(wanted)} files of {d.repo}", lambda: snapshot_download(
            d.repo, revision=sha, local_dir=work, allow_patterns=list(wanted), endpoint=url, **quiet))
        sizes: dict[str, int] = {}
        for remote in wanted:
            name = remote[len(d.subfolder) + 1:] if d.subfolder else remote
            if name != remote:
                shutil.move(str(work / remote), work / name)
            sizes[name] = (work / name).stat().st_size
        shutil.rmtree(work / ".cache", ignore_errors=True)  # hf's local_dir bookkeeping
        if d.subfolder:
            _remove_empty_dirs(work / d.subfolder, stop=work)
        manifest = {"repo": d.repo, "revision": d.revision, "commit": sha, "endpoint": url, "files": sizes}
        (work / PULL_MANIFEST).write_text(json.dumps(manifest, indent=1))
        if is_complete(d.dest, tuple(sizes)):  # a concurrent pull finished first
            shutil.rmtree(work, ignore_errors=True)
            return d.dest
        _replace_dir(work, d.dest)
    except UnsupportedModelError:
        shutil.rmtree(work, ignore_errors=True)
        raise
    except OSError as exc:
        raise LLMSysError(
            f"cannot write {d.name} under {d.dest.parent}: {exc.strerror or exc}; "
            "free disk space or set LLMSYS_HOME to another disk, then rerun to resume"
        ) from None
    return d.dest


def pulled_repos() -> list[tuple[str, Path]]:
    """(``org/name[@rev]``, directory) of every complete repo pull, for ``llmsys models``."""
    root = llmsys_home() / "models" / HUB_DIR
    if not root.is_dir():
        return []
    found = []
    for path in sorted(root.glob("*/*")):
        if path.name.startswith(".") or not is_complete(path):
            continue
        found.append((f"{path.parent.name}/{path.name}", path))
    return found
