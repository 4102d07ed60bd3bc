"""What a model name means, decided in one place for every command and the server.

A user types the name their tool taught them: a path (a folder, a ``.gguf``, a llama2.c ``.bin``), a catalog
name (``Qwen2.5-0.5B-Instruct``, any case), an Ollama name (``qwen2.5:0.5b``, or ``qwen2.5-0.5b``), a Hugging
Face repo (``Qwen/Qwen2.5-0.5B-Instruct[@rev]``), a model Ollama already pulled (``ollama:NAME[:TAG]``, or a
plain ``NAME:TAG`` it has), or a synthetic benchmark shape (``llama-8b``). :func:`resolve` turns any of them
into one :class:`ModelName`: what it is, where it lives, whether it must be pulled first, and the name it is
shown and served under, so `run`, `chat`, `serve`, `pull`, `plan`, `bench` and the server's model ids cannot
disagree. It reads files only (the catalog, the Ollama store's manifests, pull manifests); it never touches
the network (pulling is :func:`llmsys.engine.catalog.pull`'s job).

The order, first match wins (each rule says why):

1. an existing path: a local folder that shares a model's name still loads;
2. ``ollama:NAME[:TAG]``: the Ollama store, explicitly;
3. a catalog name or alias; an Ollama-style alias (``NAME:TAG``) is taken from the Ollama store when the
   catalog's copy is not downloaded but Ollama has that model (no second download);
4. a synthetic shape (a config with random weights: `plan` and `bench` take it, loading commands refuse it);
5. ``org/repo[@revision]``: any Hugging Face repo;
6. ``NAME[:TAG]`` that the Ollama store holds;
7. nothing: one line naming what was tried, with "did you mean" for near misses.
"""

from __future__ import annotations

import difflib
from dataclasses import dataclass
from enum import Enum
from pathlib import Path
from typing import TYPE_CHECKING

from llmsys.engine import catalog, hub, ollama_store
from llmsys.kernels.common.errors import InvalidParameterError, ModelNotFoundError
from llmsys.kernels.common.units import format_bytes

if TYPE_CHECKING:
    from llmsys.engine.loader.detect import ModelSource

# Suffixes that make a name a file path, whether or not the file exists (a typo then gets a path's error).
_FILE_SUFFIXES = (".gguf", ".bin", ".safetensors", ".json")
# Near misses a "did you mean" offers at most.
_MAX_SUGGESTED = 3


class NameKind(Enum):
    PATH = "path"  # a file or folder on disk, as typed
    CATALOG = "catalog"  # a models.toml entry, pulled into <home>/models/NAME
    HUB = "hub"  # any Hugging Face repo, pulled into <home>/models/hub/ORG/NAME[@rev]
    OLLAMA = "ollama"  # a model in the local Ollama store, run in place
    SHAPE = "shape"  # a [synthetic.*] shape of models.toml: a config, no weights, no tokenizer


@dataclass(frozen=True)
class ModelName:
    """One resolved model name (see the module docstring for the rules).

    ``name`` is the id the model is shown and served under: the name as the user gave it (in its
    canonical spelling: ``qwen3-0.6b`` gives ``Qwen3-0.6B``), a path's stem, a repo id, an Ollama
    ``NAME:TAG``. ``aliases`` are the other names that mean the same model (the server accepts them
    too). ``path`` is where the weights are, or will be once pulled (None for a shape).
    """

    given: str
    kind: NameKind
    name: str
    path: Path | None
    needs_pull: bool = False
    aliases: tuple[str, ...] = ()
    entry: catalog.CatalogEntry | None = None
    repo: hub.RepoRef | None = None
    ollama: ollama_store.OllamaModel | None = None
    shape: str | None = None  # SHAPE: its name; CATALOG: the entry's shape (plans before a download)

    def local(self) -> Path:
        """The weights on disk, or a one-line error saying how to get them (never downloads)."""
        if self.kind is NameKind.SHAPE:
            raise ModelNotFoundError(_shape_refusal(self))
        if self.needs_pull:
            d = self.download()
            size = f"~{format_bytes(self.entry.size_bytes)} " if self.entry is not None else ""
            what = f"model {self.entry.name}" if self.entry is not None else self.name
            raise ModelNotFoundError(
                f"{what} is not downloaded yet; run `llmsys pull {self.name}` ({size}from {d.repo} into {d.dest})"
            )
        assert self.path is not None
        return self.path

    def source(self) -> ModelSource:
        """The weights' format (engine/loader/detect.py decides it), for a name that is on disk."""
        from llmsys.engine.loader.detect import detect_model

        return detect_model(self.local())

    def download(self) -> hub.Download | None:
        """What `llmsys pull` fetches for this name; None when there is nothing to fetch (a path, the
        Ollama store, a shape)."""
        if self.kind is NameKind.CATALOG and self.entry is not None:
            return catalog.download_for(self.entry, name=self.name)
        if self.kind is NameKind.HUB and self.repo is not None:
            return hub.Download(name=self.name, repo=self.repo.repo, revision=self.repo.revision,
                                dest=self.repo.local_path())
        return None

    def describe(self) -> str:
        """One line: what the name is and where it lives (``llmsys models NAME`` prints it)."""
        state = "not downloaded: `llmsys pull` fetches it" if self.needs_pull else "on disk"
        if self.kind is NameKind.CATALOG:
            e = self.entry
            others = [a for a in self.aliases if a != e.name]
            also = f" (also {', '.join(others)})" if others else ""
            return (f"{self.name}: catalog model {e.name}{also}, {e.params} params, ~{format_bytes(e.size_bytes)} "
                    f"from {e.repo}; {state} at {self.path}")
        if self.kind is NameKind.HUB:
            return f"{self.name}: Hugging Face repo {self.repo.repo}@{self.repo.revision}; {state} at {self.path}"
        if self.kind is NameKind.OLLAMA:
            return (f"{self.name}: in the Ollama store, run in place ({format_bytes(self.ollama.size)} GGUF blob "
                    f"{self.path})")
        if self.kind is NameKind.SHAPE:
            return f"{self.name}: synthetic shape (models.toml [synthetic.{self.shape}]): a config, no weights"
        return f"{self.name}: local path {self.path}"


# --------------------------------------------------------------------------
# Resolving
# --------------------------------------------------------------------------


def resolve(spec: str) -> ModelName:
    """``spec`` as a :class:`ModelName`, or a one-line :class:`ModelNotFoundError` naming what was tried
    and the nearest names. Reads no weights; a catalog model or repo not yet pulled resolves (with
    ``needs_pull``): whether to download is the caller's decision."""
    text = spec.strip()
    if not text:
        raise InvalidParameterError("the model name is empty; give a path, a catalog name (llmsys models) or NAME:TAG")
    path = Path(text).expanduser()
    if path.exists():
        return _path_name(text, path)
    if _looks_like_path(text):
        siblings, missing = _siblings(path)
        hint = _hint(siblings, missing)
        if hint:
            hint = f"{hint[:-1]} (in {path.parent})?"
        raise ModelNotFoundError(f"no such file or directory: {text}{hint}")
    if text.startswith(ollama_store.PREFIX):
        return _ollama_name(text, ollama_store.resolve(text))
    entries = catalog.load_catalog()
    found = _catalog_name(text, entries)
    if found is not None:
        return found
    shapes = catalog.synthetic_configs()
    shape = next((k for k in shapes if k.lower() == text.lower()), None)
    if shape is not None:
        return ModelName(text, NameKind.SHAPE, shape, None, shape=shape)
    ref = hub.RepoRef.parse(text)
    if ref is not None:
        dest = ref.local_path()
        return ModelName(text, NameKind.HUB, ref.spec, dest, needs_pull=not hub.is_complete(dest), repo=ref)
    stored = ollama_store.lookup(text)
    if stored is not None:
        return _ollama_name(text, stored)
    raise ModelNotFoundError(_unknown(text, entries, shapes))


def served_names(spec: str) -> tuple[str, tuple[str, ...]]:
    """The id the server shows for ``spec`` and the other names requests may use for it."""
    found = resolve(spec)
    return found.name, found.aliases


def _path_name(text: str, path: Path) -> ModelName:
    """A path's id is its stem (``SmolLM2-135M-Instruct.Q4_1`` for ``.../SmolLM2-135M-Instruct.Q4_1.gguf``);
    the file name stays an alias, so clients that sent it before still match. The folders above it are
    never a name: the server shows its names to clients, who have no business knowing local paths."""
    resolved = path.resolve()
    stem = resolved.name if path.is_dir() or path.suffix not in _FILE_SUFFIXES else resolved.stem
    stem = stem or str(path)
    aliases = (resolved.name,) if resolved.name != stem else ()
    return ModelName(text, NameKind.PATH, stem, path, aliases=aliases)


def _looks_like_path(text: str) -> bool:
    """A name no catalog, repo or Ollama name can be: absolute, ``./``/``../``/``~``-relative, or with a
    weights or config suffix."""
    return (text.startswith(("/", "./", "../", "~", ".\\")) or text in (".", "..")
            or text.lower().endswith(_FILE_SUFFIXES))


def _catalog_name(text: str, entries: dict[str, catalog.CatalogEntry]) -> ModelName | None:
    folded = text.lower()
    for entry in entries.values():
        names = catalog.names_of(entry)
        match = next((n for n in names if n.lower() == folded), None)
        if match is None:
            continue
        if ":" in text and not catalog.is_downloaded(entry):  # Ollama's name: its copy, if it has one
            stored = ollama_store.lookup(match)
            if stored is not None:
                return _ollama_name(text, stored, also=names)
        dest = catalog.local_path(entry)
        return ModelName(text, NameKind.CATALOG, match, dest, needs_pull=not catalog.is_downloaded(entry),
                         aliases=tuple(n for n in names if n != match), entry=entry, shape=entry.shape)
    return None


def _ollama_name(text: str, model: ollama_store.OllamaModel, also: tuple[str, ...] = ()) -> ModelName:
    """A store model's id is ``NAME:TAG`` as ``ollama list`` shows it; ``ollama:NAME:TAG`` (and plain ``NAME``
    for the ``latest`` tag) are aliases."""
    name = f"{model.name}:{model.tag}"
    names = [model.spec, *([model.name] if model.tag == ollama_store.DEFAULT_TAG else []), *also]
    return ModelName(text, NameKind.OLLAMA, name, model.blob,
                     aliases=tuple(n for n in dict.fromkeys(names) if n != name), ollama=model)


# --------------------------------------------------------------------------
# Errors
# --------------------------------------------------------------------------


def _shape_refusal(found: ModelName) -> str:
    models = [e.name for e in catalog.load_catalog().values() if e.shape == found.shape]
    real = f"; the model itself is {' or '.join(models)} (`llmsys pull {models[0]}`)" if models else ""
    return (f"{found.name} is a synthetic benchmark shape (a config with random weights and no tokenizer), "
            f"not a model to load: `llmsys plan {found.name}` and `llmsys bench --synthetic {found.name}` take it{real}")


def _hint(candidates: dict[str, str], text: str) -> str:
    """``; did you mean X or Y?``: the closest candidate names (case-insensitive), one per model
    (``candidates`` maps each name to what it means), else nothing."""
    folded: dict[str, str] = {}
    for c in candidates:
        folded.setdefault(c.lower(), c)
    close = difflib.get_close_matches(text.lower(), list(folded), n=max(1, len(folded)), cutoff=0.6)
    picked: dict[str, str] = {}
    for c in close:
        picked.setdefault(candidates[folded[c]], folded[c])
    shown = list(picked.values())[:_MAX_SUGGESTED]
    return f"; did you mean {' or '.join(shown)}?" if shown else ""


def _siblings(path: Path) -> tuple[dict[str, str], str]:
    """The entries beside a missing path (by name, each its own target) and the missing name."""
    try:
        found = [p for p in path.parent.iterdir() if not p.name.startswith(".")]
    except OSError:
        found = []
    return {p.name: p.name for p in found}, path.name


def _unknown(text: str, entries: dict[str, catalog.CatalogEntry], shapes: dict[str, dict]) -> str:
    stored = ollama_store.stored_names()
    candidates = {n: f"catalog:{e.name}" for e in entries.values() for n in catalog.names_of(e)}
    candidates |= {n: f"shape:{n}" for n in shapes if n.lower() not in {c.lower() for c in candidates}}
    candidates |= {n: f"ollama:{n}" for n in stored}
    store = ollama_store.store_dir()
    where = f"not in the Ollama store {store}" if stored else f"no Ollama store at {store}"
    return (f"no model named {text}: not a file or directory, a models.toml name or alias (llmsys models lists "
            f"them), a synthetic shape or a Hugging Face org/repo, and {where}{_hint(candidates, text)}")
