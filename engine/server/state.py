"""What the HTTP app needs at hand: settings, the models (engine/server/models.py), the request's model.

The models given at start load after the HTTP socket is up (``/health`` answers 503 until
``ready``), and others load when a request names them, so everything model-dependent is optional here.
"""

from __future__ import annotations

import asyncio
import contextvars
import dataclasses
import functools
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, TypeVar

from llmsys.engine.config import EngineConfig
from llmsys.engine.server import request_log
from llmsys.engine.server.metrics import Metrics
from llmsys.engine.server.models import DEFAULT_KEEP_ALIVE_S, ModelRegistry, ModelSlot, RegistryHooks

if TYPE_CHECKING:
    from llmsys.engine.tokenizer import Tokenizer
    from llmsys.engine.llm import LLM
    from llmsys.engine.grammar import GrammarVocab
    from llmsys.engine.server.worker import EngineWorker

DEFAULT_MAX_BODY = 4 * 1024 * 1024
T = TypeVar("T")


@dataclass(frozen=True)
class ServerSettings:
    api_key: str | None = None
    max_concurrency: int | None = None  # None: the engine's max_num_seqs
    max_queue: int = 256
    max_body_bytes: int = DEFAULT_MAX_BODY
    model_name: str | None = None  # the id /v1/models shows; default: the model argument
    model_aliases: tuple[str, ...] = ()  # more names requests may use for the served model (--model-alias)
    shutdown_timeout_s: float = 10.0  # in-flight requests get this long to finish on SIGTERM
    # Host header names accepted besides loopback names and IP literals ("*": any). A browser
    # page can reach a loopback server through a DNS name it rebinds to 127.0.0.1; refusing
    # unknown names closes that door (an IP literal cannot be rebound).
    allowed_hosts: tuple[str, ...] = ()
    cors_origins: tuple[str, ...] = ()  # browser origins allowed to call the API ("*": any); none by default
    body_timeout_s: float = 30.0  # a request body that sends nothing for this long gets 408
    # The whole body must arrive within this (a sender trickling one byte per body_timeout_s
    # would otherwise hold its connection and slot for ever): 408 and the connection closed.
    body_deadline_s: float = 60.0
    # Open connections: None sizes the cap below the open-file soft limit (default_max_connections),
    # so accept() never meets EMFILE; connections over either cap get a 503 and are closed at once.
    max_connections: int | None = None
    max_connections_per_client: int | None = None  # per client address; None: min(256, max_connections)
    max_prompt_tokens: int | None = None  # per prompt, whatever the KV policy; None: the context length
    # A stream whose client reads nothing for this long (its socket buffers full) is aborted
    # and its engine slot freed, instead of decoding to max_tokens for nobody.
    send_timeout_s: float = 30.0
    head_timeout_s: float = 10.0  # a request head must arrive within this after connecting (else closed)
    stall_timeout_s: float = 120.0  # /health answers 503 when one engine step has run longer


FD_RESERVE = 64  # open files kept free for the model, logs and the process's own use
MAX_CONNECTIONS = 1024
MAX_CONNECTIONS_PER_CLIENT = 256


def default_max_connections() -> int:
    """The connection cap when none is given: ``min(1024, soft RLIMIT_NOFILE - 64)`` (at least 8),
    so the server refuses connections itself before the kernel refuses it file descriptors."""
    try:
        import resource

        soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    except (ImportError, OSError, ValueError):  # no resource module (Windows): the plain cap
        return MAX_CONNECTIONS
    if soft == resource.RLIM_INFINITY:
        return MAX_CONNECTIONS
    return max(8, min(MAX_CONNECTIONS, soft - FD_RESERVE))


@dataclass(frozen=True)
class ConnectionCaps:
    """The resolved connection caps (settings' None filled in)."""

    total: int
    per_client: int

    @classmethod
    def of(cls, settings: ServerSettings) -> ConnectionCaps:
        total = settings.max_connections or default_max_connections()
        per = settings.max_connections_per_client or min(MAX_CONNECTIONS_PER_CLIENT, total)
        return cls(total, per)


class ServerState:
    """Settings, metrics and the models (:class:`ModelRegistry`). A request names its model once
    (:meth:`use`); from then on ``state.llm``, ``state.worker``, ``state.model_name`` and the vocabulary
    views mean that model for the rest of the request (a context variable, which the request's tasks
    and :meth:`off_loop` inherit). Outside a request they mean the default model (the first one
    given at start while it is loaded), so a one-model server reads as before."""

    def __init__(self, settings: ServerSettings, config_for: Callable[[str], EngineConfig] | None = None,
                 budget: int | None = None, keep_alive_s: float | None = DEFAULT_KEEP_ALIVE_S):
        self.settings = settings
        self.metrics = Metrics()
        self._config_for = config_for
        self.models = ModelRegistry(RegistryHooks(self._model_config, self._start_worker), budget, keep_alive_s)
        self._current: contextvars.ContextVar[ModelSlot | None] = contextvars.ContextVar("llmsys_model", default=None)
        self._leases: contextvars.ContextVar[list[ModelSlot] | None] = contextvars.ContextVar("llmsys_leases",
                                                                                              default=None)
        self._load_s: contextvars.ContextVar[float] = contextvars.ContextVar("llmsys_load_s", default=0.0)
        self._started = False  # the models given at start are loaded (or there were none)
        self.load_error: str | None = None
        self.created = int(time.time())
        # Tokenizing and rendering chat templates is CPU work: it runs here, never on the event
        # loop (a 4 MB prompt would freeze every stream for a second). One thread, so preparing
        # requests takes at most one core from the engine thread.
        self._prep = ThreadPoolExecutor(max_workers=1, thread_name_prefix="llmsys-prep")

    # -- the request's model ---------------------------------------------------
    @property
    def slot(self) -> ModelSlot | None:
        return self._current.get() or self.models.default()

    @property
    def llm(self) -> LLM | None:
        slot = self.slot
        return slot.llm if slot is not None else None

    @property
    def worker(self) -> EngineWorker | None:
        slot = self.slot
        return slot.worker if slot is not None else None

    @property
    def model_name(self) -> str:
        slot = self.slot
        return slot.name if slot is not None else (self.settings.model_name or "model")

    @property
    def name_aliases(self) -> tuple[str, ...]:
        slot = self.slot
        return slot.aliases if slot is not None else ()

    @property
    def ready(self) -> bool:
        """The models given at start are loaded (a server started without any is ready at once)."""
        return (self._started or self.models.primary is not None) and self.load_error is None

    def mark_started(self) -> None:
        self._started = True

    def begin_request(self) -> contextvars.Token:
        """Called by the app for each HTTP request: the models it uses are held (never unloaded) until
        :meth:`end_request`, which runs after the last byte of a stream."""
        return self._leases.set([])

    def end_request(self, token: contextvars.Token) -> str | None:
        """Release the request's models; the name of the last one it used (for its log line)."""
        held = self._leases.get() or []
        self._leases.reset(token)
        for slot in held:
            self.models.release(slot)
        return held[-1].name if held else None

    async def use(self, model: str | None, keep_alive_s: Any = ...) -> ModelSlot:
        """Make ``model`` (any name :mod:`llmsys.engine.names` takes; None or "": the default model) this
        request's model, loading it first if need be (off the event loop; /health keeps answering).
        ``keep_alive_s``: the request's keep_alive in seconds (None: for ever; ``...``: none given, the default)."""
        from llmsys.engine.server.models import ModelBusyError
        from llmsys.engine.server.protocol import APIError
        from llmsys.kernels.common.errors import InvalidParameterError, ModelNotFoundError

        if not model:
            default = self.models.default()
            model = default.name if default is not None else self.models.primary_name
            if model is None:
                raise APIError(400, "no model is loaded; name one in 'model' (GET /v1/models lists those this "
                                    "server can load)", param="model", code="model_required")
        try:
            if self.models.find(model) is not None:
                slot = self.models.acquire(model, keep_alive_s)  # loaded: a lock, no I/O
            else:
                ctx = contextvars.copy_context()
                t0 = time.perf_counter()
                slot = await asyncio.get_running_loop().run_in_executor(
                    None, ctx.run, functools.partial(self.models.acquire, model, keep_alive_s))
                self._load_s.set(time.perf_counter() - t0)
        except (ModelNotFoundError, InvalidParameterError) as e:  # a name that means no model here
            loaded = ", ".join(f"'{s.name}'" for s in self.models.loaded()) or "none"
            raise APIError(404, f"model '{model[:200]}' not found: {e} (loaded: {loaded}; GET /v1/models lists "
                                "what this server can load)", param="model", code="model_not_found") from None
        except ModelBusyError as e:
            raise APIError(503, str(e), type="server_error", code="model_busy", headers={"Retry-After": "5"}) from None
        held = self._leases.get()
        if held is None:  # outside an HTTP request (tests): nothing to hold it for
            self.models.release(slot)
        else:
            held.append(slot)
        self._current.set(slot)
        rec = request_log.current()
        if rec is not None:  # the request's log line names the model it used, whatever its route
            rec.model = slot.name
        return slot

    def load_seconds(self) -> float:
        """How long this request waited for its model to load (0 when it was loaded): Ollama's load_duration."""
        return self._load_s.get()

    def load(self, config: EngineConfig) -> None:
        """Load a model given at start and start its engine thread (blocking; run it in a thread)."""
        from llmsys.engine.llm import LLM

        from llmsys.engine import names

        # The id is the name the user gave (catalog name, NAME:TAG, a path's stem), never a blob's file
        # name; the names that mean the same model are accepted too (engine/names.py decides both).
        name, aliases = names.served_names(config.model)
        llm = LLM(config)
        given = self.settings.model_name if self.models.primary is None else None
        self.attach(llm, given or name, aliases=aliases + ((name,) if given and given != name else ()),
                    started=False)

    def attach(self, llm: LLM, name: str, aliases: tuple[str, ...] = (), started: bool = True) -> ModelSlot:
        """Serve an already loaded :class:`LLM` (tests, the benchmark, models given at start), kept loaded
        until a request's keep_alive says otherwise; ``aliases``: other names requests may use for it
        (the first model also answers to --model-alias)."""
        first = self.models.primary is None
        extra = self.settings.model_aliases if first else ()
        slot = self.models.adopt(llm, self._start_worker(llm, name), name, (*aliases, *extra), keep_alive_s=None)
        if started:
            self._started = True
        return slot

    def _start_worker(self, llm: LLM, name: str) -> EngineWorker:
        from llmsys.engine.server.worker import EngineWorker

        s = self.settings
        worker = EngineWorker(llm.core, self.metrics, s.max_concurrency or llm.config.max_num_seqs, s.max_queue,
                              model=name)
        worker.start()
        return worker

    def _model_config(self, spec: str) -> EngineConfig:
        """The engine config for a model loaded on demand: the server's engine flags with that model."""
        if self._config_for is not None:
            return self._config_for(spec)
        first = self.models.default()
        if first is not None and first.llm is not None:
            return dataclasses.replace(first.llm.config, model=spec)
        return EngineConfig(model=spec)

    def prompt_limit(self) -> int | None:
        """The most tokens one prompt may have (--max-prompt-tokens, default the context length),
        checked whatever the KV policy: a sliding window would otherwise accept a multi-megabyte
        prompt and queue a prefill of hundreds of thousands of tokens."""
        llm = self.llm
        return self.settings.max_prompt_tokens or (llm.max_model_len if llm is not None else None)

    def model_names(self) -> set[str]:
        """Every name a request's ``model`` may use for the current model: its name, ``name:latest``
        (Ollama clients add the tag), the names that mean the same model, and the --model-alias names."""
        return {self.model_name, f"{self.model_name}:latest", *self.name_aliases}

    async def off_loop(self, fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
        """Run ``fn`` on the request-preparation thread (in this request's context: its model) and await
        its result (exceptions included)."""
        ctx = contextvars.copy_context()
        return await asyncio.get_running_loop().run_in_executor(
            self._prep, ctx.run, functools.partial(fn, *args, **kwargs))

    def begin_shutdown(self) -> None:
        """SIGTERM: refuse new requests, 503 the queued ones, give running ones the grace period."""
        self.models.begin_shutdown(self.settings.shutdown_timeout_s)

    def close(self) -> None:
        self.models.close()
        self._prep.shutdown(wait=False, cancel_futures=True)

    def select(self, slot: ModelSlot) -> None:
        """Make an already held ``slot`` the current model of this context (listing several models)."""
        self._current.set(slot)

    # -- vocabulary views of the current model (computed once per model, on first use) ----
    def per_model(self, key: str, make: Callable[[], T]) -> T:
        """``make()`` computed once per loaded model (dropped with it when it unloads)."""
        slot = self.slot
        with slot.lock:
            if key not in slot.cache:
                slot.cache[key] = make()
            return slot.cache[key]

    def token_strings(self) -> list[str | None]:
        llm = self.llm
        return self.per_model("token_strings", lambda: token_strings(llm.tokenizer))

    def token_text(self, token_id: int) -> str:
        strings = self.token_strings()
        s = strings[token_id] if 0 <= token_id < len(strings) else None
        if s is not None:
            return s
        return self.llm.tokenizer.convert_ids_to_tokens(token_id) or ""

    def max_token_chars(self) -> int:
        """The most characters one token can stand for (its decoded text or its raw name, which is
        how a special token is typed), plus one: a text of ``c`` characters has at least
        ``c // max_token_chars()`` tokens, so a prompt that cannot fit is refused before tokenizing."""
        strings = self.token_strings()
        tok = self.llm.tokenizer

        def make() -> int:
            raw = tok.convert_ids_to_tokens(list(range(tok.vocab_size)))
            return 1 + max([len(x) for x in strings if x] + [len(x) for x in raw if x] + [1])

        return self.per_model("max_token_chars", make)

    def grammar_vocab(self) -> GrammarVocab:
        """The model's vocabulary for constrained decoding (llmsys.engine.grammar), built on first use."""
        from llmsys.engine.grammar import GrammarVocab

        llm = self.llm
        return self.per_model("grammar_vocab", lambda: GrammarVocab(llm.tokenizer, llm.loaded.args.vocab_size,
                                                                  llm.core.eos_token_ids))


def token_strings(tokenizer: Tokenizer) -> list[str | None]:
    """Each token id's text as it appears mid-sequence (logprobs show it); None for special
    tokens, lone bytes of a multi-byte character and tokens that decode to nothing.

    A token's text is ``decode([anchor, id]) - decode([anchor])``: decoding a
    token alone would drop a SentencePiece leading space.
    """
    special = set(tokenizer.all_special_ids)
    anchor_ids = tokenizer.encode("a", add_special_tokens=False)
    anchor = anchor_ids[-1:] if anchor_ids else []
    base = tokenizer.decode(anchor, skip_special_tokens=False)
    out: list[str | None] = []
    for i in range(tokenizer.vocab_size):
        if i in special:
            out.append(None)
            continue
        s = tokenizer.decode(anchor + [i], skip_special_tokens=False)
        if not s.startswith(base):
            out.append(None)
            continue
        s = s[len(base):]
        out.append(s if s and "\ufffd" not in s else None)
    return out
