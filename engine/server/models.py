"""The server's models: any name a request gives is loaded on first use and kept for ``keep_alive``.

Ollama's model, in one place for both APIs: a request's ``model`` is looked up among the loaded
models by every name each answers to, else resolved by :mod:`llmsys.engine.names` and loaded off the
event loop (concurrent first requests for one model share its load). Each model has its own
:class:`EngineWorker`, so requests to different models batch separately and run concurrently.
Loaded models share one memory budget: before a load, the new model's size (its weights on disk plus
the KV pool the builder would make) must fit beside the true resident sizes of the loaded ones (their
memory reports); the least recently used idle model is unloaded to make room (logged), or the load
is refused with a 503 naming the sizes. A model idle for its ``keep_alive`` is unloaded by the
reaper thread: its engine thread stopped, its references dropped, the heap trimmed.
"""

from __future__ import annotations

import gc
import logging
import math
import os
import re
import threading
import time
from concurrent.futures import Future
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable

from llmsys.kernels.common.errors import InvalidParameterError, LLMSysError, ModelNotFoundError
from llmsys.kernels.common.units import format_bytes

if TYPE_CHECKING:
    from llmsys.engine.config import EngineConfig
    from llmsys.engine.llm import LLM
    from llmsys.engine.names import ModelName
    from llmsys.engine.server.worker import EngineWorker

log = logging.getLogger("llmsys.server")

DEFAULT_KEEP_ALIVE_S = 300.0  # Ollama's default: 5 minutes
KEEP_ALIVE_ENV = "LLMSYS_KEEP_ALIVE"
_UNITS = {"ns": 1e-9, "us": 1e-6, "µs": 1e-6, "ms": 1e-3, "s": 1.0, "m": 60.0, "h": 3600.0}
_DURATION = re.compile(r"([0-9]+(?:\.[0-9]+)?)(ns|us|µs|ms|s|m|h)")
REAP_INTERVAL_S = 1.0  # the reaper wakes at least this often (sooner when a model's time is up)


def parse_keep_alive(value: Any, what: str = "keep_alive") -> float | None:
    """Seconds a model stays loaded after its last request, or None for ever (Ollama's semantics:
    a duration string like ``"5m"`` or ``"1h30m"``, a number of seconds, ``0`` unloads at once,
    a negative value keeps it loaded)."""
    if isinstance(value, bool):
        raise InvalidParameterError(f"{what} must be a duration like '5m' or a number of seconds, got {value!r}")
    if isinstance(value, (int, float)):
        seconds = float(value)
    else:
        text = str(value).strip()
        sign = -1.0 if text.startswith("-") else 1.0
        body = text.lstrip("+-")
        try:
            seconds = sign * float(body)
        except ValueError:
            parts = _DURATION.findall(body)
            if not body or "".join(a + b for a, b in parts) != body:
                raise InvalidParameterError(
                    f"{what} {value!r} is not a duration; use e.g. '5m', '1h', '30s', 0 (unload) or -1 (keep)"
                ) from None
            seconds = sign * sum(float(a) * _UNITS[b] for a, b in parts)
    if math.isnan(seconds):
        raise InvalidParameterError(f"{what} must be a number of seconds or a duration, got {value!r}")
    return None if seconds < 0 else seconds


def default_keep_alive(flag: str | None = None) -> float | None:
    """``--keep-alive``, else ``$LLMSYS_KEEP_ALIVE``, else 5 minutes."""
    if flag is not None:
        return parse_keep_alive(flag, "--keep-alive")
    env = os.environ.get(KEEP_ALIVE_ENV)
    if env:
        return parse_keep_alive(env, f"${KEEP_ALIVE_ENV}")
    return DEFAULT_KEEP_ALIVE_S


def bare(name: str) -> str:
    """A name as Ollama clients compare it: without ``ollama:`` and ``:latest``."""
    return name.removeprefix("ollama:").removesuffix(":latest")


def _mib(n: int) -> str:
    return f"{n / 2**20:.0f} MiB"


class ModelBusyError(Exception):
    """A model does not fit the budget and nothing idle can be unloaded (the server answers 503)."""


@dataclass(eq=False)
class ModelSlot:
    """One loaded model: its engine, its worker, the names it answers to, and its keep_alive."""

    key: str  # the weights' resolved path: two names of one file share a slot
    name: str
    aliases: tuple[str, ...]
    llm: LLM | None
    worker: EngineWorker | None
    load_s: float
    estimate: int  # bytes estimated before loading
    keep_alive_s: float | None
    last_used: float = field(default_factory=time.monotonic)
    # given at start: kept for ever until a request sets keep_alive (from then on, Ollama's rules)
    pinned: bool = False
    users: int = 0  # requests holding it (preparing, queued, running or streaming)
    closed: bool = False
    loads: int = 1  # times this key was loaded by this registry (a reload after an unload counts)
    cache: dict[str, Any] = field(default_factory=dict)  # per-model views (vocabulary, Ollama's facts)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def answers_to(self, name: str) -> bool:
        b = bare(name)
        return any(b == bare(n) for n in (self.name, *self.aliases))

    def busy(self) -> bool:
        w = self.worker
        return self.users > 0 or (w is not None and w.in_flight > 0)

    def resident(self) -> int:
        """True resident bytes: the engine's memory report (weights, KV pages backed by memory, buffers)."""
        w = self.worker
        rep = w.last_report if w is not None else None
        return sum(rep.resident.values()) if rep is not None else self.estimate

    def resident_vram(self) -> int:
        w = self.worker
        rep = w.last_report if w is not None else None
        return rep.resident.get("gpu", 0) if rep is not None else 0

    def expires_at(self) -> float | None:
        """Wall-clock time this model will be unloaded if no request comes; None: never."""
        if self.keep_alive_s is None:
            return None
        idle_since = time.monotonic() if self.busy() else self.last_used
        return time.time() + (idle_since + self.keep_alive_s - time.monotonic())

    def idle_s(self) -> float:
        return 0.0 if self.busy() else time.monotonic() - self.last_used


@dataclass(frozen=True)
class RegistryHooks:
    """How the registry builds a model (the server passes them: the engine flags live in the CLI)."""

    config_for: Callable[[str], EngineConfig]
    start_worker: Callable[[LLM, str], EngineWorker]  # (the model, its served id: its /metrics label)


class ModelRegistry:
    """The loaded models, the loads under way, LRU eviction and the keep_alive reaper (module docstring)."""

    def __init__(self, hooks: RegistryHooks, budget: int | None, keep_alive_s: float | None = DEFAULT_KEEP_ALIVE_S):
        self.hooks = hooks
        self.budget = budget  # bytes all loaded models may hold together; None: no limit
        self.keep_alive_s = keep_alive_s
        self._lock = threading.Lock()
        self._load_lock = threading.Lock()  # one load at a time: each fits against the models already in
        self._slots: dict[str, ModelSlot] = {}
        self._loading: dict[str, Future] = {}
        self._load_counts: dict[str, int] = {}
        # every name a model was served under -> how to load it again (an unloaded model reloads by its id)
        self._known: dict[str, tuple[EngineConfig, str, tuple[str, ...]]] = {}
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._reaper: threading.Thread | None = None
        self.primary: str | None = None  # the key of the first model given on the command line
        self.primary_name: str | None = None  # ... and its id (a request without a model reloads it)

    # -- what is loaded --------------------------------------------------------
    def loaded(self) -> list[ModelSlot]:
        with self._lock:
            return [s for s in self._slots.values() if not s.closed]

    def find(self, name: str) -> ModelSlot | None:
        with self._lock:
            for slot in self._slots.values():
                if not slot.closed and slot.answers_to(name):
                    return slot
        return None

    def _remember(self, slot: ModelSlot, config: EngineConfig | None) -> None:
        if config is not None:
            for n in (slot.name, *slot.aliases):
                self._known[bare(n)] = (config, slot.name, slot.aliases)

    def default(self) -> ModelSlot | None:
        """The model a request without ``model`` gets: the first one given at start while loaded, else the
        most recently used."""
        with self._lock:
            first = self._slots.get(self.primary) if self.primary is not None else None
            if first is not None and (not first.closed or self._stop.is_set()):
                return first
            slots = sorted((s for s in self._slots.values() if not s.closed), key=lambda s: s.last_used)
        return slots[-1] if slots else None

    def load_count(self, key_or_name: str) -> int:
        slot = self.find(key_or_name)
        return self._load_counts.get(slot.key if slot is not None else key_or_name, 0)

    # -- acquiring (blocking: call it off the event loop) ----------------------
    def acquire(self, spec: str, keep_alive_s: Any = ...) -> ModelSlot:
        """The slot for ``spec``, loaded if need be, with one more user (call :meth:`release` after);
        ``keep_alive_s``: this request's keep_alive (``...``: none given: the server's default, as Ollama
        does, so one request's ``-1`` or ``1h`` does not outlive it; a model given at start keeps its
        "for ever" until some request sets keep_alive)."""
        while True:
            slot = self.find(spec) or self._load_named(spec)
            with self._lock:
                if slot.closed:
                    continue  # unloaded between its load and now: load again
                slot.users += 1
                if keep_alive_s is not ...:  # Ollama: each request's keep_alive replaces the model's
                    slot.keep_alive_s, slot.pinned = keep_alive_s, False
                elif not slot.pinned:
                    slot.keep_alive_s = self.keep_alive_s
                slot.last_used = time.monotonic()
                return slot

    def release(self, slot: ModelSlot) -> None:
        with self._lock:
            slot.users = max(0, slot.users - 1)
            slot.last_used = time.monotonic()
        self._wake.set()

    def adopt(self, llm: LLM, worker: EngineWorker, name: str, aliases: tuple[str, ...] = (),
              keep_alive_s: float | None = None) -> ModelSlot:
        """Register a model loaded elsewhere (the first model of ``serve``, tests): kept for ever by default."""
        key = str(Path(llm.loaded.path).resolve()) if getattr(llm, "loaded", None) is not None else name
        slot = ModelSlot(key, name, aliases, llm, worker, 0.0, 0, keep_alive_s, pinned=keep_alive_s is None)
        with self._lock:
            self._slots[key] = slot
            self._remember(slot, getattr(llm, "config", None))
            self._load_counts[key] = self._load_counts.get(key, 0) + 1
            if self.primary is None:
                self.primary, self.primary_name = key, name
        return slot

    def _load_named(self, spec: str) -> ModelSlot:
        from llmsys.engine import names

        known = self._known.get(bare(spec))
        try:
            found = names.resolve(known[0].model if known is not None else spec)
            if found.kind is names.NameKind.SHAPE:
                raise InvalidParameterError(f"'{spec}' is a synthetic shape (a config without weights); name a model")
            if found.needs_pull:
                raise ModelNotFoundError(f"model '{spec}' is not downloaded; pull it first (POST /api/pull with "
                                         f"{{\"model\": \"{found.name}\"}}, or `llmsys pull {found.name}`)")
            found.source()  # a path that is no model is a 404 here, not a failed load
            key = str(Path(found.local()).resolve())
        except OSError as e:  # a name no file system takes (too long, bad bytes)
            raise ModelNotFoundError(f"'{spec[:80]}' is not a model name or path ({e.strerror or e})") from None
        except (ModelNotFoundError, InvalidParameterError):
            raise
        except LLMSysError as e:
            raise ModelNotFoundError(str(e).splitlines()[0] if str(e) else type(e).__name__) from None
        with self._lock:
            slot = self._slots.get(key)
            if slot is not None and not slot.closed:
                if not slot.answers_to(spec):
                    slot.aliases = (*slot.aliases, spec)
                return slot
            fut = self._loading.get(key)
            owner = fut is None
            if owner:
                fut = self._loading[key] = Future()
        if not owner:
            return fut.result()  # another request is loading it: share that load
        try:
            slot = self._load(found, spec, key, known)
        except BaseException as e:
            fut.set_exception(e)
            raise
        finally:
            with self._lock:
                self._loading.pop(key, None)
        fut.set_result(slot)
        return slot

    def _load(self, found: ModelName, spec: str, key: str,
              known: tuple[EngineConfig, str, tuple[str, ...]] | None = None) -> ModelSlot:
        with self._load_lock:
            config = known[0] if known is not None else self.hooks.config_for(spec)
            est = estimate_bytes(config, found)
            self._make_room(est, found.name)
            t0 = time.perf_counter()
            from llmsys.engine.llm import LLM

            llm = LLM(config)
            if known is not None:  # loaded again: the id and names it had
                _, name, aliases = known
            else:
                name, aliases = found.name, tuple(a for a in (*found.aliases, spec) if a != found.name)
            worker = self.hooks.start_worker(llm, name)
            slot = ModelSlot(key, name, aliases, llm, worker, time.perf_counter() - t0, est, self.keep_alive_s)
            with self._lock:
                self._slots[key] = slot
                self._remember(slot, config)
                slot.loads = self._load_counts[key] = self._load_counts.get(key, 0) + 1
            log.info("loaded %s in %.1f s (%s resident; %s estimated)", slot.name, slot.load_s,
                     _mib(slot.resident()), _mib(est))
            self._start_reaper()
            return slot

    def _make_room(self, need: int, name: str) -> None:
        """Unload least recently used idle models until ``need`` bytes fit the budget, or raise
        :class:`ModelBusyError` naming the sizes."""
        if self.budget is None:
            return
        while True:
            with self._lock:
                slots = [s for s in self._slots.values() if not s.closed]
                used = sum(s.resident() for s in slots)
                if used + need <= self.budget:
                    return
                idle = sorted((s for s in slots if not s.busy()), key=lambda s: s.last_used)
                busy = sum(s.resident() for s in slots if s not in idle)
                # unload nothing when even every idle model's room would not do: the 503 comes at once
                victim = idle[0] if idle and busy + need <= self.budget else None
                if victim is not None:
                    victim.closed = True
                    self._slots.pop(victim.key, None)
            if victim is None:
                held = ", ".join(f"{s.name} ({_mib(s.resident())}, {'busy' if s.busy() else 'idle'})"
                                 for s in slots) or "nothing"
                why = "is more than the budget by itself" if need > self.budget else "does not fit beside the busy ones"
                raise ModelBusyError(f"model {name} needs ~{_mib(need)} and {why}: budget {_mib(self.budget)} "
                                     f"(--cpu-mem), loaded: {held}; retry when they are idle, or raise --cpu-mem")
            log.info("unloading %s (%s, idle %.0f s) to fit %s (%s)", victim.name, _mib(victim.resident()),
                     victim.idle_s(), name, _mib(need))
            _free(victim)

    # -- unloading -------------------------------------------------------------
    def unload(self, name: str, why: str = "asked to") -> bool:
        """Unload ``name`` now if loaded and idle; a busy one is unloaded when its requests end (keep_alive 0)."""
        slot = self.find(name)
        if slot is None:
            return False
        with self._lock:
            slot.keep_alive_s = 0.0
        self._wake.set()
        self._start_reaper()
        return True

    def drop(self, key_or_name: str) -> bool:
        """Unload a model now (its files are about to go); False if it is busy. True when not loaded."""
        with self._lock:
            slot = self._slots.get(key_or_name) or next(
                (s for s in self._slots.values() if s.answers_to(key_or_name)), None)
            if slot is None:
                return True
            if slot.busy():
                return False
            slot.closed = True
            self._slots.pop(slot.key, None)
        log.info("unloading %s (%s): its files are deleted", slot.name, _mib(slot.resident()))
        _free(slot)
        return True

    def _reap(self) -> float:
        """Unload every idle model past its keep_alive; seconds until the next one is due."""
        now = time.monotonic()
        due: list[ModelSlot] = []
        wait = REAP_INTERVAL_S
        with self._lock:
            for s in list(self._slots.values()):
                if s.keep_alive_s is None or s.busy():
                    continue
                left = s.last_used + s.keep_alive_s - now
                if left <= 0:
                    s.closed = True
                    self._slots.pop(s.key, None)
                    due.append(s)
                else:
                    wait = min(wait, left)
        for s in due:
            log.info("unloading %s (%s, idle %.0f s): keep_alive %s is over", s.name, _mib(s.resident()),
                     now - s.last_used, f"{s.keep_alive_s:g} s")
            _free(s)
        return wait

    def _start_reaper(self) -> None:
        with self._lock:
            if self._reaper is not None or self._stop.is_set():
                return
            self._reaper = threading.Thread(target=self._reap_loop, name="llmsys-keepalive", daemon=True)
        self._reaper.start()

    def _reap_loop(self) -> None:
        while not self._stop.is_set():
            try:
                wait = self._reap()
            except Exception:  # noqa: BLE001 - the reaper must outlive one bad unload
                log.exception("unloading an idle model failed")
                wait = REAP_INTERVAL_S
            self._wake.wait(max(0.01, wait))
            self._wake.clear()

    def begin_shutdown(self, grace_s: float) -> None:
        for s in self.loaded():
            if s.worker is not None:
                s.worker.begin_shutdown(grace_s)

    def close(self) -> None:
        self._stop.set()
        self._wake.set()
        with self._lock:
            slots = [s for s in self._slots.values() if not s.closed]
            for s in slots:
                s.closed = True
        for s in slots:  # the slots stay (their names still answer model_name); their engines go
            _free(s, trim=False)


def _free(slot: ModelSlot, trim: bool = True) -> None:
    """Stop the model's engine thread and drop every reference the server holds, so its memory goes."""
    worker, llm = slot.worker, slot.llm
    slot.worker = slot.llm = None
    slot.cache.clear()
    if worker is not None:
        worker.stop()
    core = getattr(llm, "core", None)
    disk = getattr(core, "kv_disk", None)
    if disk is not None and hasattr(disk, "close"):
        try:
            disk.close()
        except Exception:  # noqa: BLE001 - its writes are a cache: losing the queue loses nothing
            log.warning("closing %s's KV disk tier failed", slot.name, exc_info=True)
    del worker, llm, core, disk
    if trim:
        gc.collect()
        from llmsys.kernels.common.memory import release_free_heap

        release_free_heap()


_WEIGHT_SUFFIXES = (".safetensors", ".bin", ".gguf", ".pt", ".pth")


def weights_on_disk(path: Path) -> int:
    """Bytes of the weight files at ``path`` (a file, or a folder's weight files)."""
    if path.is_file():
        return path.stat().st_size
    return sum(p.stat().st_size for p in path.iterdir() if p.is_file() and p.suffix in _WEIGHT_SUFFIXES)


def estimate_bytes(config: EngineConfig, found: ModelName) -> int:
    """A model's resident size before it loads: its weights as stored plus the KV pool
    :func:`llmsys.engine.builder.planned_kv` sizes (the function the engine sizes its pool with).
    The weights alone when the pool cannot be planned from the config (an unusual format)."""
    path = Path(found.local())
    weights = weights_on_disk(path)
    try:
        kv = _planned_kv_bytes(config, found)
    except Exception:  # noqa: BLE001 - an estimate: the weights still bound it from below
        log.debug("no KV estimate for %s", found.name, exc_info=True)
        kv = 0
    return weights + kv


def _planned_kv_bytes(config: EngineConfig, found: ModelName) -> int:
    import json

    from llmsys.engine.builder import kv_probe, planned_kv
    from llmsys.engine.loader import gguf_io
    from llmsys.engine.loader.common import resolve_device, resolve_dtype
    from llmsys.engine.loader.detect import ModelFormat
    from llmsys.engine.models import family_for, text_config
    from llmsys.offload.budgets import resolve_budgets

    src = found.source()
    if src.format is ModelFormat.GGUF:
        cfg = gguf_io.hf_config(src.path, src.gguf_header)
    else:
        cfg = json.loads((Path(src.path) / "config.json").read_text())
    cfg = text_config(cfg, str(src.path))
    args = family_for(cfg, str(src.path)).ModelArgs.from_hf_config(cfg)
    dev = resolve_device(config.device)
    dt = resolve_dtype(config.dtype, dev)
    budgets = resolve_budgets(config.gpu_mem, config.cpu_mem, config.offload_dir, dev)
    _, tokens = planned_kv(args, config, dt, budgets)
    return tokens * kv_probe(args, config, dt).bytes_per_token


def memory_budget(cpu_mem: int | None) -> int:
    """The bytes all loaded models may hold together: ``--cpu-mem``, else the memory available now
    (what a load could take without swapping), read once at start."""
    if cpu_mem:
        return int(cpu_mem)
    try:
        import psutil

        return int(psutil.virtual_memory().available)
    except ImportError:
        return int(os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE"))


def describe(n: int) -> str:
    return format_bytes(n)


@dataclass(frozen=True)
class Listed:
    """One model /api/tags and /v1/models list: loaded, or on disk and loadable by this name."""

    name: str
    path: Path | None
    size: int  # bytes of its weights on disk
    modified: float  # mtime, seconds since the epoch
    loaded: bool
    kind: str  # what engine/names.py calls it: path, catalog, hub, ollama


def available(registry: ModelRegistry) -> list[Listed]:
    """What a request can name without a download: the loaded models, the catalog's downloaded models and
    the Ollama store's models (files only: the catalog, the store's manifests; no weights read)."""
    from llmsys.engine import catalog, ollama_store

    out: dict[str, Listed] = {}
    seen: set[str] = set()
    for slot in registry.loaded():
        p = Path(slot.key)
        out[bare(slot.name)] = Listed(slot.name, p, _size(p), _mtime(p), True, "loaded")
        seen.add(slot.key)
    try:
        entries = catalog.load_catalog().values()
    except Exception:  # noqa: BLE001 - a broken catalog must not break the listing
        log.warning("the model catalog could not be read", exc_info=True)
        entries = []
    for e in entries:
        if catalog.is_downloaded(e):
            p = catalog.local_path(e)
            if str(p.resolve()) not in seen and bare(e.name) not in out:
                out[bare(e.name)] = Listed(e.name, p, _size(p), _mtime(p), False, "catalog")
    try:
        stored = ollama_store.list_models(on_error=lambda _e: None)
    except Exception:  # noqa: BLE001 - no Ollama store is the usual case
        stored = []
    for m in stored:
        name = f"{m.name}:{m.tag}"
        if str(m.blob.resolve()) not in seen and bare(name) not in out:
            out[bare(name)] = Listed(name, m.blob, _size(m.blob), _mtime(m.manifest), False, "ollama")
    return list(out.values())


def _size(p: Path) -> int:
    try:
        return weights_on_disk(p)
    except OSError:
        return 0


def _mtime(p: Path) -> float:
    try:
        return p.stat().st_mtime
    except OSError:
        return time.time()
