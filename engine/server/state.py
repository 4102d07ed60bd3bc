"""What the HTTP app needs at hand: settings, the loaded model, the worker.

The model loads after the HTTP socket is up (``/health`` answers 503 until
``ready``), so everything model-dependent is optional here.
"""

from __future__ import annotations

import asyncio
import functools
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, TypeVar

from llmsys.engine.config import EngineConfig
from llmsys.engine.server.metrics import Metrics

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
    def __init__(self, settings: ServerSettings):
        self.settings = settings
        self.metrics = Metrics()
        self.llm: LLM | None = None
        self.worker: EngineWorker | None = None
        self.model_name = settings.model_name or "model"
        self.name_aliases: tuple[str, ...] = ()  # what else the model is called (engine/names.py)
        self.load_error: str | None = None
        self.created = int(time.time())
        self._vocab_lock = threading.Lock()
        self._token_strings: list[str | None] | None = None
        self._grammar_vocab: GrammarVocab | None = None
        self._max_token_chars: int | None = None
        # Tokenizing and rendering chat templates is CPU work: it runs here, never on the event
        # loop (a 4 MB prompt would freeze every stream for a second). One thread, so preparing
        # requests takes at most one core from the engine thread.
        self._prep = ThreadPoolExecutor(max_workers=1, thread_name_prefix="llmsys-prep")

    @property
    def ready(self) -> bool:
        return self.worker is not None

    def load(self, config: EngineConfig) -> None:
        """Load the model and start the engine thread (blocking; run it in a thread)."""
        from llmsys.engine.llm import LLM

        from llmsys.engine import names

        # The id is the name the user gave (catalog name, NAME:TAG, a path's stem), never a blob's file
        # name; the names that mean the same model are accepted too (engine/names.py decides both).
        name, aliases = names.served_names(config.model)
        llm = LLM(config)
        given = self.settings.model_name
        self.attach(llm, given or name, aliases=aliases + ((name,) if given and given != name else ()))

    def attach(self, llm: LLM, name: str, aliases: tuple[str, ...] = ()) -> None:
        """Serve an already loaded :class:`LLM` (tests, the benchmark); ``aliases``: other names requests
        may use for it (besides --model-alias)."""
        from llmsys.engine.server.worker import EngineWorker

        self.llm = llm
        self.model_name = name
        self.name_aliases = aliases
        s = self.settings
        worker = EngineWorker(llm.core, self.metrics, s.max_concurrency or llm.config.max_num_seqs, s.max_queue)
        worker.start()
        self.worker = worker

    def prompt_limit(self) -> int:
        """The most tokens one prompt may have (--max-prompt-tokens, default the context length),
        checked whatever the KV policy: a sliding window would otherwise accept a multi-megabyte
        prompt and queue a prefill of hundreds of thousands of tokens."""
        return self.settings.max_prompt_tokens or self.llm.max_model_len

    def model_names(self) -> set[str]:
        """Every name a request's ``model`` may use: the served name, ``name:latest`` (Ollama
        clients add the tag), the names that mean the same model, and the --model-alias names."""
        return {self.model_name, f"{self.model_name}:latest", *self.name_aliases, *self.settings.model_aliases}

    async def off_loop(self, fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
        """Run ``fn`` on the request-preparation thread and await its result (exceptions included)."""
        return await asyncio.get_running_loop().run_in_executor(self._prep, functools.partial(fn, *args, **kwargs))

    def begin_shutdown(self) -> None:
        """SIGTERM: refuse new requests, 503 the queued ones, give running ones the grace period."""
        if self.worker is not None:
            self.worker.begin_shutdown(self.settings.shutdown_timeout_s)

    def close(self) -> None:
        if self.worker is not None:
            self.worker.stop()
        self._prep.shutdown(wait=False, cancel_futures=True)

    # -- vocabulary views (computed once, on first use) -----------------------
    def token_strings(self) -> list[str | None]:
        with self._vocab_lock:
            if self._token_strings is None:
                self._token_strings = token_strings(self.llm.tokenizer)
            return self._token_strings

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
        with self._vocab_lock:
            if self._max_token_chars is None:
                tok = self.llm.tokenizer
                raw = tok.convert_ids_to_tokens(list(range(tok.vocab_size)))
                self._max_token_chars = 1 + max([len(x) for x in strings if x] + [len(x) for x in raw if x] + [1])
            return self._max_token_chars

    def grammar_vocab(self) -> GrammarVocab:
        """The model's vocabulary for constrained decoding (llmsys.engine.grammar), built on first use."""
        from llmsys.engine.grammar import GrammarVocab

        with self._vocab_lock:
            if self._grammar_vocab is None:
                llm = self.llm
                self._grammar_vocab = GrammarVocab(llm.tokenizer, llm.loaded.args.vocab_size, llm.core.eos_token_ids)
            return self._grammar_vocab


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
