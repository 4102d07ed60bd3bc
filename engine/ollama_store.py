"""Models already pulled by Ollama, run in place (``llmsys run ollama:qwen2.5:0.5b``): no second download.

The store (``$OLLAMA_MODELS``, else ``~/.ollama/models``, read at call time) is content-addressed, so a
model is found through ``manifests/<host>/<namespace>/<name>/<tag>`` (JSON layers: ``mediaType``,
``digest``, ``size``) and ``blobs/sha256-<hex>``, never by guessing names. The ``...image.model`` layer
is the GGUF; params (stop strings, system message applied; other params named, not guessed), template
(not run: ``--chat`` uses the GGUF's Jinja template) and system layers are read too. Names are
``[host/][namespace/]name[:tag]`` (defaults ``registry.ollama.ai``, ``library``, ``latest``). Blobs are
checked for presence, recorded size and GGUF magic, not re-hashed (that would read gigabytes).
"""

from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from types import MappingProxyType
from typing import Any, Callable, Mapping

from llmsys.kernels.common.errors import CheckpointError, InvalidParameterError, LLMSysError, ModelNotFoundError

PREFIX = "ollama:"
DEFAULT_HOST = "registry.ollama.ai"
DEFAULT_NAMESPACE = "library"
DEFAULT_TAG = "latest"
MEDIA_PREFIX = "application/vnd.ollama.image."
MODEL_MEDIA = MEDIA_PREFIX + "model"
GGUF_MAGIC = b"GGUF"  # as engine.loader.gguf_header.MAGIC; not imported: that package pulls in torch
# Where Ollama's Linux service (installed by its script) keeps the store: named in the
# "no store" error because it is the usual reason ~/.ollama/models is absent on Linux.
SYSTEM_STORE = Path("/usr/share/ollama/.ollama/models")
# Small text layers read into OllamaModel; anything larger is not a prompt template.
_MAX_TEXT_LAYER = 1 << 20
# Names a "not in the store" error lists before "and N more": one line stays readable.
_MAX_LISTED = 20
# Ollama params (its Modelfile PARAMETERs) -> the llmsys flag that sets the same thing. llmsys's own flags and
# defaults decide those (a flag left at its default cannot be told from one given), so they are named, not applied.
PARAM_FLAGS = MappingProxyType({
    "temperature": "--temperature", "top_k": "--top-k", "top_p": "--top-p", "min_p": "--min-p",
    "repeat_penalty": "--repeat-penalty", "presence_penalty": "--presence-penalty",
    "frequency_penalty": "--frequency-penalty", "seed": "--seed", "num_predict": "-n", "num_ctx": "--max-model-len",
})

# Ollama's own rules for name parts (host may carry a port). Each part starts with a letter or
# digit, so none can be "." or ".." and lead outside the store.
_PART = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,79}$")
_HOST = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,349}(:[0-9]{1,5})?$")
_TAG = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9._-]{0,79}$")
_DIGEST = re.compile(r"^sha256[:-]([0-9a-f]{64})$")


@dataclass(frozen=True)
class OllamaName:
    """A parsed model name: the four parts that make up its manifest's path."""

    host: str
    namespace: str
    model: str
    tag: str

    @property
    def short(self) -> str:
        """The name without its tag, defaults dropped, as ``ollama list`` shows it."""
        if self.host != DEFAULT_HOST:
            return f"{self.host}/{self.namespace}/{self.model}"
        if self.namespace != DEFAULT_NAMESPACE:
            return f"{self.namespace}/{self.model}"
        return self.model

    @property
    def spec(self) -> str:
        """What to pass to ``llmsys run``: ``ollama:NAME:TAG``."""
        return f"{PREFIX}{self.short}:{self.tag}"

    @property
    def pull_name(self) -> str:
        """The name ``ollama pull`` takes (no ``ollama:`` prefix)."""
        return f"{self.short}:{self.tag}"

    def manifest_path(self, store: Path) -> Path:
        return store / "manifests" / self.host / self.namespace / self.model / self.tag


@dataclass(frozen=True)
class OllamaModel:
    """One model in the store, its weights blob verified present and complete.

    ``name`` is the short name (``qwen2.5``, ``user/model``); ``blob`` is the
    GGUF weights file (named by its digest, with no ``.gguf`` suffix).
    ``params`` is the read-only JSON of the params layer; ``template`` and
    ``system`` are the text layers. Each is ``None`` when the manifest has no
    such layer.
    """

    name: str
    tag: str
    manifest: Path
    blob: Path
    size: int  # bytes of the weights blob
    digest: str  # "sha256:<hex>" of the weights blob
    params: Mapping[str, Any] | None = field(default=None, hash=False, compare=False)
    template: str | None = None
    system: str | None = None

    @property
    def spec(self) -> str:
        """What to pass to ``llmsys run``: ``ollama:NAME:TAG``."""
        return f"{PREFIX}{self.name}:{self.tag}"


# --------------------------------------------------------------------------
# Names and the store
# --------------------------------------------------------------------------


def store_dir() -> Path:
    """``$OLLAMA_MODELS`` if set (and non-empty), else ``~/.ollama/models``: Ollama's own rule."""
    env = os.environ.get("OLLAMA_MODELS", "").strip()
    return Path(env).expanduser() if env else Path.home() / ".ollama" / "models"


def parse_name(name: str) -> OllamaName:
    """``[ollama:][host/][namespace/]model[:tag]`` into its parts, defaults filled in.

    The tag is what follows the last ``:`` of the last path part, so a host
    with a port (``localhost:5000/me/m:v1``) parses too.
    """
    text = name[len(PREFIX):] if name.startswith(PREFIX) else name
    head, slash, last = text.rpartition("/")
    model, colon, tag = last.partition(":")
    if not colon:
        tag = DEFAULT_TAG
    parts = head.split("/") if slash else []
    if len(parts) > 2:
        raise _bad_name(name, "it has more than three '/'-separated parts")
    host = parts[0] if len(parts) == 2 else DEFAULT_HOST
    namespace = parts[-1] if parts else DEFAULT_NAMESPACE
    if not _HOST.match(host):
        raise _bad_name(name, f"host {host!r} is not a host name")
    for what, value, pattern in (("namespace", namespace, _PART), ("model", model, _PART), ("tag", tag, _TAG)):
        if not pattern.match(value):
            raise _bad_name(name, f"{what} {value!r} is empty or has characters other than letters, digits, '.', '_', '-'")
    return OllamaName(host, namespace, model, tag)


def _bad_name(name: str, why: str) -> InvalidParameterError:
    return InvalidParameterError(
        f"{name!r} is not an Ollama model name ({why}); write it as ollama:NAME[:TAG], "
        "e.g. ollama:qwen2.5:0.5b or ollama:user/model:tag"
    )


def _require_store() -> Path:
    store = store_dir()
    if not (store / "manifests").is_dir():
        source = "$OLLAMA_MODELS" if os.environ.get("OLLAMA_MODELS", "").strip() else "the default, ~/.ollama/models"
        system = f" (Ollama's Linux service keeps it in {SYSTEM_STORE})" if SYSTEM_STORE != store else ""
        raise ModelNotFoundError(
            f"no Ollama model store at {store} (no manifests directory there; looked at {source}); "
            f"set OLLAMA_MODELS to the directory holding Ollama's manifests/ and blobs/{system}, "
            "or install Ollama and `ollama pull NAME`"
        )
    return store


def _manifest_files(store: Path) -> list[Path]:
    """Every ``manifests/<host>/<namespace>/<model>/<tag>`` file, in the order of their names."""
    found = [p for p in (store / "manifests").glob("*/*/*/*") if p.is_file() and not p.name.startswith(".")]
    return sorted(found, key=lambda p: _name_of(store, p).pull_name.lower())


def _name_of(store: Path, manifest: Path) -> OllamaName:
    host, namespace, model, tag = manifest.relative_to(store / "manifests").parts
    return OllamaName(host, namespace, model, tag)


# --------------------------------------------------------------------------
# Reading a manifest
# --------------------------------------------------------------------------


def _layers(manifest: Path, name: OllamaName) -> list[dict[str, Any]]:
    try:
        data = json.loads(manifest.read_bytes())
    except OSError as exc:
        raise CheckpointError(f"cannot read the Ollama manifest {manifest}: {exc.strerror or exc}") from None
    except (ValueError, UnicodeDecodeError) as exc:
        raise CheckpointError(
            f"the Ollama manifest {manifest} of {name.spec} is not valid JSON ({exc}); "
            f"re-download it with `ollama pull {name.pull_name}`"
        ) from None
    layers = data.get("layers") if isinstance(data, dict) else None
    if not isinstance(layers, list) or not all(isinstance(layer, dict) for layer in layers):
        raise CheckpointError(
            f"the Ollama manifest {manifest} of {name.spec} has no 'layers' list; "
            f"re-download it with `ollama pull {name.pull_name}`"
        )
    return layers


def _media(layer: dict[str, Any]) -> str:
    """The media type without parameters (``...template; name=x`` -> ``...template``)."""
    media = layer.get("mediaType")
    return media.split(";", 1)[0].strip() if isinstance(media, str) else ""


def _blob_path(store: Path, manifest: Path, layer: dict[str, Any]) -> Path:
    digest = layer.get("digest")
    m = _DIGEST.match(digest) if isinstance(digest, str) else None
    if m is None:
        raise CheckpointError(
            f"the Ollama manifest {manifest} has a {_media(layer) or 'layer'} with digest {digest!r}, "
            "not sha256:<64 hex digits>; re-download the model with `ollama pull`"
        )
    return store / "blobs" / f"sha256-{m.group(1)}"


def _text_layer(store: Path, manifest: Path, layer: dict[str, Any], name: OllamaName) -> str:
    blob = _blob_path(store, manifest, layer)
    try:
        if blob.stat().st_size > _MAX_TEXT_LAYER:
            raise CheckpointError(f"the {_media(layer)} blob {blob} of {name.spec} is over 1 MiB: not a text layer")
        return blob.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise CheckpointError(
            f"the {_media(layer)} blob {blob} of {name.spec} (manifest {manifest}) is missing; "
            f"re-download it with `ollama pull {name.pull_name}`"
        ) from None
    except (OSError, UnicodeDecodeError) as exc:
        raise CheckpointError(f"cannot read the {_media(layer)} blob {blob} of {name.spec}: {exc}") from None


def _check_weights(blob: Path, manifest: Path, layer: dict[str, Any], name: OllamaName) -> int:
    """The blob's size, after checking it is there, as long as the manifest says, and GGUF."""
    fix = f"re-download it with `ollama pull {name.pull_name}`"
    try:
        size = blob.stat().st_size
        with open(blob, "rb") as fh:
            magic = fh.read(4)
    except FileNotFoundError:
        raise CheckpointError(f"the weights blob {blob} of {name.spec} (manifest {manifest}) is missing; {fix}") from None
    except OSError as exc:
        raise CheckpointError(f"cannot read the weights blob {blob} of {name.spec}: {exc.strerror or exc}") from None
    expected = layer.get("size")
    if isinstance(expected, int) and not isinstance(expected, bool) and size != expected:
        state = "truncated (or still downloading)" if size < expected else "longer than recorded"
        raise CheckpointError(
            f"the weights blob {blob} of {name.spec} is {size} bytes but its manifest {manifest} says "
            f"{expected}: it is {state}; {fix}"
        )
    if magic != GGUF_MAGIC:
        raise CheckpointError(
            f"the weights blob {blob} of {name.spec} does not start with the GGUF magic (got {magic!r}); "
            f"llmsys runs GGUF models only; {fix}"
        )
    return size


def _load(store: Path, manifest: Path, name: OllamaName) -> OllamaModel:
    layers = _layers(manifest, name)
    by_media: dict[str, dict[str, Any]] = {}
    for layer in layers:
        by_media.setdefault(_media(layer), layer)  # the first of each kind (a template's default)
    weights = by_media.get(MODEL_MEDIA)
    if weights is None:
        kinds = ", ".join(sorted(k.removeprefix(MEDIA_PREFIX) for k in by_media if k)) or "none"
        raise CheckpointError(
            f"the Ollama manifest {manifest} of {name.spec} has no {MODEL_MEDIA} layer (it has: {kinds}), "
            "so there is no GGUF weights file to run; pull a GGUF model with `ollama pull NAME`"
        )
    blob = _blob_path(store, manifest, weights)
    size = _check_weights(blob, manifest, weights, name)
    params = None
    if (layer := by_media.get(MEDIA_PREFIX + "params")) is not None:
        text = _text_layer(store, manifest, layer, name)
        try:
            loaded = json.loads(text)
        except ValueError as exc:
            raise CheckpointError(
                f"the params blob {_blob_path(store, manifest, layer)} of {name.spec} is not valid JSON ({exc}); "
                f"re-download it with `ollama pull {name.pull_name}`"
            ) from None
        if not isinstance(loaded, dict):
            raise CheckpointError(
                f"the params blob {_blob_path(store, manifest, layer)} of {name.spec} is not a JSON object"
            )
        params = MappingProxyType(loaded)
    texts = {
        kind: _text_layer(store, manifest, layer, name)
        for kind in ("template", "system")
        if (layer := by_media.get(MEDIA_PREFIX + kind)) is not None
    }
    return OllamaModel(
        name=name.short,
        tag=name.tag,
        manifest=manifest,
        blob=blob,
        size=size,
        digest=str(weights["digest"]).replace("-", ":", 1),
        params=params,
        template=texts.get("template"),
        system=texts.get("system"),
    )


# --------------------------------------------------------------------------
# Public lookups
# --------------------------------------------------------------------------


def resolve(name: str) -> OllamaModel:
    """The store's model called ``name`` (``ollama:`` prefix optional), blob verified.

    The manifest path is tried as written, then case-insensitively, since
    Ollama treats names case-insensitively but the file system may not.
    """
    wanted = parse_name(name)
    store = _require_store()
    found = lookup(name)
    if found is not None:
        return found
    manifest = wanted.manifest_path(store)
    names = stored_names()
    present = ", ".join(names[:_MAX_LISTED]) + (f" and {len(names) - _MAX_LISTED} more" if len(names) > _MAX_LISTED else "")
    near = _near_misses(wanted, names)
    hint = f"did you mean {' or '.join(PREFIX + n for n in near)}? else " if near else ""
    raise ModelNotFoundError(
        f"{wanted.spec} is not in the Ollama store {store} (no manifest {manifest}; models there: {present or 'none'}); "
        f"{hint}fetch it with `ollama pull {wanted.pull_name}`"
    )


def lookup(name: str) -> OllamaModel | None:
    """The store's model called ``name`` (a plain ``NAME[:TAG]`` a user typed, no prefix needed), or None when
    there is no store, ``name`` is no Ollama name, or the store does not hold it. A model it holds but cannot
    run (a missing or truncated blob) still raises, naming the fix: the user asked for that model."""
    try:
        wanted = parse_name(name)
    except InvalidParameterError:
        return None
    store = store_dir()
    if not (store / "manifests").is_dir():
        return None
    manifest = wanted.manifest_path(store)
    if manifest.is_file():
        return _load(store, manifest, wanted)
    folded = str(wanted.manifest_path(Path())).lower()
    for path in _manifest_files(store):
        if str(path.relative_to(store)).lower() == folded:
            return _load(store, path, _name_of(store, path))
    return None


def stored_names() -> list[str]:
    """Every ``NAME:TAG`` the store holds (from the manifests' paths alone: nothing is read), for near-miss hints."""
    store = store_dir()
    if not (store / "manifests").is_dir():
        return []
    return [_name_of(store, p).pull_name for p in _manifest_files(store)]


def _near_misses(wanted: OllamaName, names: list[str]) -> list[str]:
    """Store names a typo or a left-out tag likely meant: the same model at other tags, else close spellings."""
    import difflib

    same = [n for n in names if n.rpartition(":")[0].lower() == wanted.short.lower()]
    return (same or difflib.get_close_matches(wanted.pull_name, names, n=3, cutoff=0.75))[:3]


def list_models(on_error: Callable[[LLMSysError], None] | None = None) -> list[OllamaModel]:
    """Every model in the store, sorted by name; ``[]`` when there is no store.

    A broken entry (bad JSON, no weights layer, missing or truncated blob)
    raises, unless ``on_error`` is given: then it is passed the error and
    the listing goes on, so one bad manifest does not hide the others.
    """
    store = store_dir()
    if not (store / "manifests").is_dir():
        return []
    models = []
    for manifest in _manifest_files(store):
        try:
            models.append(_load(store, manifest, _name_of(store, manifest)))
        except LLMSysError as exc:
            if on_error is None:
                raise
            on_error(exc)
    return models


# --------------------------------------------------------------------------
# What `llmsys run` takes from the manifest
# --------------------------------------------------------------------------


@dataclass(frozen=True)
class RunSettings:
    """The manifest's say in a run: ``stop`` (the user's ``--stop`` strings, then the params layer's, which end
    the text as they do in Ollama), ``system`` (the user's ``--system``, else the system layer, as Ollama uses
    it) and ``note``: one line naming the params llmsys does not apply, or ``None``."""

    stop: tuple[str, ...]
    system: str | None
    note: str | None


def run_settings(model: OllamaModel, stop: tuple[str, ...] = (), system: str | None = None) -> RunSettings:
    """How ``model``'s params and system layers combine with the user's flags (see :class:`RunSettings`).

    Why not the template layer: it is a Go template (Ollama's own), which llmsys does not run; ``--chat`` uses
    the GGUF's ``tokenizer.chat_template`` as for any GGUF file (:func:`require_chat_template`).
    """
    params = dict(model.params or {})
    wanted = params.pop("stop", None)
    wanted = [wanted] if isinstance(wanted, str) else wanted
    extra: list[str] = []
    if isinstance(wanted, list) and all(isinstance(s, str) and s for s in wanted):
        extra = wanted
    elif wanted is not None:
        params["stop"] = wanted  # malformed: reported below rather than half applied
    merged = tuple(dict.fromkeys([*stop, *extra]))
    ignored = []
    for key, value in params.items():
        shown = json.dumps(value, ensure_ascii=False)
        flag = PARAM_FLAGS.get(key)
        ignored.append(f"{key}={shown} ({flag} {shown} to match)" if flag and not isinstance(value, (list, dict))
                       else f"{key}={shown} (no llmsys equivalent)")
    note = None
    if ignored:
        applied = "its stop strings are applied; " if extra else ""
        note = (f"note: {model.spec}: {applied}Ollama params not applied (llmsys's flags decide): "
                + ", ".join(ignored))
    return RunSettings(merged, system if system is not None else model.system, note)


def require_chat_template(model: OllamaModel, fields: Mapping[str, Any]) -> None:
    """Refuse ``--chat`` in one line, before loading, when ``model``'s GGUF (``fields``: its header's metadata)
    has no chat template: Ollama's template layer is Go, which llmsys does not run, so there is nothing to use."""
    if isinstance(fields.get("tokenizer.chat_template"), str):
        return
    why = ("its Ollama template layer is a Go template, which llmsys does not run" if model.template is not None
           else "Ollama's manifest has no template either")
    raise InvalidParameterError(
        f"{model.spec} cannot take --chat: its GGUF {model.blob} has no tokenizer.chat_template and {why}; "
        "drop --chat and write the prompt in the model's own format"
    )
