"""Running the app: the blocking CLI entry and an in-process thread runner.

``serve`` binds first and loads the model on a thread (``/health`` answers 503 meanwhile). On
SIGINT/SIGTERM queued requests get 503 at once, running ones ``shutdown_timeout_s`` and then a final
chunk (``finish_reason`` "abort" with an ``error``; uvicorn's cancel is only a backstop); the process
exits 0 (:class:`_Server` does not re-raise the signal as uvicorn does). :class:`_Protocol` is uvicorn's
h11 protocol hardened for a public server: a ``head_timeout_s`` for the request head, connection caps
with spare ``/health`` places (:class:`ConnectionGate`, below the open-file limit), a bounded send
buffer (``BoundedStream``) and OpenAI-shaped 400s; :class:`AcceptErrorLog` rate-limits ``accept()`` errors.
"""

from __future__ import annotations

import asyncio
import enum
import json
import logging
import socket
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable

import h11
import uvicorn
from uvicorn.protocols.http.h11_impl import H11Protocol

from llmsys.engine.config import EngineConfig
from llmsys.engine.server.app import create_app
from llmsys.engine.server.metrics import Metrics
from llmsys.engine.server.protocol import APIError, redact_paths
from llmsys.engine.server.models import DEFAULT_KEEP_ALIVE_S
from llmsys.engine.server.state import ConnectionCaps, ServerSettings, ServerState

log = logging.getLogger("llmsys.server")


BACKSTOP_S = 5.0  # uvicorn cancels what is still open this long after the worker's grace period


class _Server(uvicorn.Server):
    def __init__(self, config: uvicorn.Config, state: ServerState):
        super().__init__(config)
        self.llmsys_state = state

    def handle_exit(self, sig: int, frame) -> None:  # type: ignore[override]
        self.llmsys_state.begin_shutdown()  # first: refuse, 503 the queue, start the grace period
        super().handle_exit(sig, frame)
        self._captured_signals.clear()  # a signal-initiated graceful stop is a normal exit

    async def startup(self, sockets: list[socket.socket] | None = None) -> None:
        loop = asyncio.get_running_loop()
        loop.set_exception_handler(AcceptErrorLog(loop.get_exception_handler()))
        await super().startup(sockets)


SEND_BUFFER_BYTES = 128 * 1024  # a connection's kernel send buffer: what a non-reading client can pile up
ACCEPT_LOG_INTERVAL_S = 10.0  # accept() failures and refused connections are logged at most this often
_OVER_CAP = "503 Service Unavailable"


HEALTH_SLOTS = 16  # connections beyond the caps that may still ask /health (then closed)
HEALTH_HEAD_S = 1.0  # ... and must send their request head within this


class Admission(enum.Enum):
    ADMITTED = "admitted"
    HEALTH_ONLY = "health_only"  # over a cap, in a spare slot: /health is answered, anything else 503
    REFUSED = "refused"  # over a cap, no spare slot: 503 at once, closed


@dataclass
class ConnectionGate:
    """Counts open connections, in total and per client address, against the caps. Over a
    cap a connection gets one of :data:`HEALTH_SLOTS` spare places, where only ``/health`` is
    answered (so a monitor can tell a full server from a dead one), else a 503 at once. One per
    server; the event loop is its only user (no lock)."""

    caps: ConnectionCaps
    metrics: Metrics | None = None
    total: int = 0
    per_client: dict[str, int] = field(default_factory=dict)
    health_only: int = 0
    refused: int = 0  # since the last log line
    _logged_at: float = -ACCEPT_LOG_INTERVAL_S

    def admit(self, host: str) -> tuple[Admission, str]:
        """Count the connection in; (how, why it is over a cap or "")."""
        if self.total >= self.caps.total:
            limit, why = "max_connections", f"the server holds its limit of {self.caps.total} connections (--max-connections)"
        elif self.per_client.get(host, 0) >= self.caps.per_client:
            limit, why = "max_connections_per_client", (f"this client address holds its limit of {self.caps.per_client} "
                                                        "connections (--max-connections-per-client)")
        else:
            self.total += 1
            self.per_client[host] = self.per_client.get(host, 0) + 1
            return Admission.ADMITTED, ""
        self.refused += 1
        if self.metrics is not None:
            self.metrics.count_limit(limit)
        now = time.monotonic()
        if now - self._logged_at >= ACCEPT_LOG_INTERVAL_S:
            log.warning("connections over the cap: %d since the last such line (at most one per %g s): %s "
                        "(the latest from %s)", self.refused, ACCEPT_LOG_INTERVAL_S, why, host)
            self._logged_at, self.refused = now, 0
        if self.health_only < HEALTH_SLOTS:
            self.health_only += 1
            return Admission.HEALTH_ONLY, why
        return Admission.REFUSED, why

    def release(self, host: str, how: Admission) -> None:
        if how is Admission.HEALTH_ONLY:
            self.health_only -= 1
        elif how is Admission.ADMITTED:
            self.total -= 1
            left = self.per_client.get(host, 1) - 1
            if left > 0:
                self.per_client[host] = left
            else:
                self.per_client.pop(host, None)


def _over_cap_body(why: str) -> bytes:
    return json.dumps(APIError(503, f"too many connections: {why}; retry later", type="server_error",
                               code="too_many_connections").body()).encode()


class AcceptErrorLog:
    """An event-loop exception handler that logs accept() failures once per interval.

    Out of file descriptors, asyncio's accept loop reports every failed ``accept()`` with a
    traceback (a log of tens of megabytes in seconds); here they are counted and one line per
    ``ACCEPT_LOG_INTERVAL_S`` says how many and what to change. Everything else goes to the
    handler that was there before."""

    def __init__(self, previous: Any):
        self.previous = previous
        self.count = 0
        self.logged_at = -ACCEPT_LOG_INTERVAL_S

    def __call__(self, loop: asyncio.AbstractEventLoop, context: dict[str, Any]) -> None:
        if context.get("message") != "socket.accept() out of system resource":
            if self.previous is not None:
                self.previous(loop, context)
            else:
                loop.default_exception_handler(context)
            return
        self.count += 1
        now = time.monotonic()
        if now - self.logged_at >= ACCEPT_LOG_INTERVAL_S:
            exc = context.get("exception")
            log.error("accept() failed %d time(s) since the last such line (at most one per %g s: %s): the process "
                      "is out of file descriptors; lower --max-connections or raise the open-file limit (ulimit -n)",
                      self.count, ACCEPT_LOG_INTERVAL_S, exc.strerror if isinstance(exc, OSError) else exc)
            self.logged_at, self.count = now, 0


def _protocol(settings: ServerSettings, gate: ConnectionGate) -> type[H11Protocol]:
    head_timeout_s = settings.head_timeout_s

    class _Protocol(H11Protocol):
        """See the module docstring."""

        def __init__(self, *args: Any, **kwargs: Any):
            super().__init__(*args, **kwargs)
            app = self.app

            async def with_transport(scope: dict, receive: Any, send: Any) -> None:
                scope["llmsys.transport"] = self.transport  # a stalled stream drops its connection with it
                await self._guarded(scope, receive, send, app)

            self.app = with_transport
            self._admission = Admission.REFUSED
            self._why = ""
            self._host = ""
            self._head_timer: asyncio.TimerHandle | None = None

        async def _guarded(self, scope: dict, receive: Any, send: Any, app: Any) -> None:
            if self._admission is Admission.HEALTH_ONLY and scope.get("path") != "/health":
                body = _over_cap_body(self._why)
                await send({"type": "http.response.start", "status": 503, "headers": [
                    (b"content-type", b"application/json"), (b"retry-after", b"1"), (b"connection", b"close"),
                    (b"content-length", str(len(body)).encode())]})
                await send({"type": "http.response.body", "body": body})
                return
            await app(scope, receive, send)

        def connection_made(self, transport: Any) -> None:  # type: ignore[override]
            super().connection_made(transport)
            peer = transport.get_extra_info("peername")
            self._host = str(peer[0]) if isinstance(peer, tuple) and peer else ""
            self._admission, self._why = gate.admit(self._host)
            if self._admission is Admission.REFUSED:  # over a cap, no spare place: a 503 now, and closed
                body = _over_cap_body(self._why)
                transport.write(f"HTTP/1.1 {_OVER_CAP}\r\ncontent-type: application/json\r\nretry-after: 1\r\n"
                                f"connection: close\r\ncontent-length: {len(body)}\r\n\r\n".encode() + body)
                transport.close()
                return
            sock = transport.get_extra_info("socket")
            if sock is not None:
                try:  # bounded, so a client that stops reading blocks the sender soon (see BoundedStream)
                    sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, SEND_BUFFER_BYTES)
                except OSError:
                    pass
            wait = HEALTH_HEAD_S if self._admission is Admission.HEALTH_ONLY else head_timeout_s
            self._head_timer = self.loop.call_later(wait, self._head_overdue)

        def data_received(self, data: bytes) -> None:
            if self._admission is not Admission.REFUSED:
                super().data_received(data)

        def _head_overdue(self) -> None:
            waiting = self.cycle is None or self.cycle.response_complete  # no request head since the last answer
            if waiting and not self.transport.is_closing():
                self.transport.close()

        def on_response_complete(self) -> None:
            super().on_response_complete()  # keep-alive: the next head has the same deadline
            if self._head_timer is not None:
                self._head_timer.cancel()
            if self._admission is Admission.HEALTH_ONLY:  # one answer per spare place
                self.transport.close()
                return
            self._head_timer = self.loop.call_later(head_timeout_s, self._head_overdue)

        def connection_lost(self, exc: Exception | None) -> None:
            if self._head_timer is not None:
                self._head_timer.cancel()
            gate.release(self._host, self._admission)
            self._admission = Admission.REFUSED  # released once
            super().connection_lost(exc)

        def send_400_response(self, msg: str) -> None:
            body = json.dumps(APIError(400, f"malformed HTTP request: {msg}", code="bad_http").body()).encode()
            headers = [(b"content-type", b"application/json"), (b"connection", b"close"),
                       (b"content-length", str(len(body)).encode())]
            try:
                for event in (h11.Response(status_code=400, headers=headers, reason=b"Bad Request"),
                              h11.Data(data=body), h11.EndOfMessage()):
                    self.transport.write(self.conn.send(event))
            except h11.LocalProtocolError:  # h11 cannot answer in this state: just close
                pass
            self.transport.close()

    return _Protocol


def _backlog(caps: ConnectionCaps) -> int:
    """The listen backlog, which is also how many connections asyncio accepts in one go: kept
    near the file descriptors left above the connection cap (at least 64, so a burst of clients
    is not made to retry its handshake), so a burst of connects seldom runs the process out of
    them before the over-cap ones are closed (and when it does, AcceptErrorLog keeps it quiet)."""
    try:
        import resource

        soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    except (ImportError, OSError, ValueError):
        return 2048
    if soft == resource.RLIM_INFINITY:
        return 2048
    return max(64, min(2048, soft - caps.total - HEALTH_SLOTS - 16))


def log_config(log_level: str) -> dict[str, Any]:
    """uvicorn's logging setup plus this server's loggers (``llmsys.*``: one line per request,
    warnings, recoveries) on the same stderr handler, with the time, at ``log_level``. Without
    it they had no handler, and Python's last-resort one shows warnings only."""
    import copy

    from uvicorn.config import LOGGING_CONFIG

    cfg = copy.deepcopy(LOGGING_CONFIG)
    cfg["formatters"]["llmsys"] = {"()": "uvicorn.logging.DefaultFormatter", "fmt": "%(levelprefix)s %(asctime)s %(message)s",
                                   "datefmt": "%Y-%m-%d %H:%M:%S", "use_colors": None}
    cfg["handlers"]["llmsys"] = {"formatter": "llmsys", "class": "logging.StreamHandler", "stream": "ext://sys.stderr"}
    level = log_level.upper()
    cfg["loggers"]["llmsys"] = {"handlers": ["llmsys"], "level": "DEBUG" if level == "TRACE" else level,
                                "propagate": False}
    return cfg


def _uvicorn_config(state: ServerState, host: str, port: int, log_level: str,
                    logging_config: dict[str, Any] | None = None) -> uvicorn.Config:
    """``logging_config``: None keeps uvicorn's (the in-process test server leaves the process's logging alone)."""
    caps = ConnectionCaps.of(state.settings)
    extra = {} if logging_config is None else {"log_config": logging_config}
    return uvicorn.Config(
        create_app(state),
        host=host,
        port=port,
        log_level=log_level,
        **extra,
        http=_protocol(state.settings, ConnectionGate(caps, state.metrics)),
        backlog=_backlog(caps),
        timeout_graceful_shutdown=state.settings.shutdown_timeout_s + BACKSTOP_S,
        access_log=log_level == "debug",
        lifespan="on",
    )


def serve(config: EngineConfig | list[EngineConfig], settings: ServerSettings, host: str = "127.0.0.1",
          port: int = 8000, log_level: str = "info", config_for: Callable[[str], EngineConfig] | None = None,
          budget: int | None = None, keep_alive_s: float | None = DEFAULT_KEEP_ALIVE_S) -> int:
    """Serve until SIGINT/SIGTERM; 0 on a clean stop, 2 if a model given at start failed to load.

    ``config``: the models loaded at start (none is fine: requests load what they name, through
    ``config_for``); ``budget``: bytes all loaded models may hold together; ``keep_alive_s``: how long a
    model loaded on demand stays after its last request (None: for ever)."""
    configs = config if isinstance(config, list) else [config]
    state = ServerState(settings, config_for=config_for, budget=budget, keep_alive_s=keep_alive_s)
    server = _Server(_uvicorn_config(state, host, port, log_level, log_config(log_level)), state)
    if not settings.api_key and not _is_loopback(host):
        log.warning("serving on %s without an API key: anyone who can reach this address can use the model; "
                    "set LLMSYS_API_KEY or --api-key-file", host)

    def load() -> None:
        for cfg in configs:
            t0 = time.perf_counter()
            try:
                state.load(cfg)
            except Exception as e:  # LLMSysError or worse: report and stop serving
                first = str(e).splitlines()[0] if str(e) else type(e).__name__
                print(f"error: {first}", flush=True)  # the operator sees the paths; clients do not
                state.load_error = redact_paths(first)
                server.should_exit = True
                return
            print(f"llmsys: model '{state.models.loaded()[-1].name}' ready in {time.perf_counter() - t0:.1f} s; "
                  f"OpenAI API at http://{host}:{port}/v1", flush=True)
        state.mark_started()
        if not configs:
            print(f"llmsys: serving models on demand (budget {budget / 2**20:.0f} MiB); OpenAI API at "
                  f"http://{host}:{port}/v1, Ollama API at http://{host}:{port}/api" if budget else
                  f"llmsys: serving models on demand; OpenAI API at http://{host}:{port}/v1", flush=True)

    threading.Thread(target=load, name="llmsys-load", daemon=True).start()
    server.run()
    state.close()
    return 2 if state.load_error else 0


def _is_loopback(host: str) -> bool:
    import ipaddress

    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


@dataclass
class ServerThread:
    """A server on a free loopback port inside this process (tests, benchmark)."""

    state: ServerState
    server: uvicorn.Server
    thread: threading.Thread
    port: int

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(30)
        self.state.close()


def start_server_thread(state: ServerState, log_level: str = "warning") -> ServerThread:
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    server = _Server(_uvicorn_config(state, "127.0.0.1", port, log_level), state)
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, name="llmsys-http", daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        if not thread.is_alive() or time.monotonic() > deadline:
            raise RuntimeError("the test server did not start")
        time.sleep(0.02)
    return ServerThread(state, server, thread, port)


def wait_until_healthy(url: str, proc=None, timeout_s: float = 60.0, poll_s: float = 0.1) -> bool:
    """Poll ``url/health`` until it answers 200 (the model is loaded).

    Returns False when ``proc`` (a ``subprocess.Popen`` running the server)
    exits first or ``timeout_s`` passes. Used by tests and benchmarks that
    start ``llmsys serve`` as a child process.
    """
    import urllib.error
    import urllib.request

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            with urllib.request.urlopen(url + "/health", timeout=5) as r:
                if r.status == 200:
                    return True
        except (urllib.error.URLError, ConnectionError, OSError):
            pass  # not listening yet, or 503 while loading
        if proc is not None and proc.poll() is not None:
            return False
        time.sleep(poll_s)
    return False

