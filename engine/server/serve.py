"""Running the app: the blocking CLI entry and an in-process thread runner.

``serve`` binds the socket first and loads the model on a background thread,
so ``/health`` answers 503 while weights load. On SIGINT/SIGTERM the engine
worker refuses new requests and answers the queued ones 503 at once, running
requests get ``shutdown_timeout_s`` to finish, and then each is ended by the
worker with a final chunk (``finish_reason`` "abort" and an ``error`` object
saying why) -- uvicorn's own cancel, which cuts streams mid-body, comes a few
seconds after that only as a backstop. The lifespan hook then stops the engine
thread; the process exits 0. uvicorn re-raises the caught signal after a
graceful stop by default (exit 130 / killed by SIGTERM), which would make a
clean shutdown look like a crash, so :class:`_Server` does not.

:class:`_Protocol` is uvicorn's h11 protocol with two changes a public-facing
server needs: a connection must send its request head within
``head_timeout_s`` (uvicorn waits forever, so half-sent requests pile up), and
the 400 for a malformed request is OpenAI-shaped JSON, not plain text.
"""

from __future__ import annotations

import json
import logging
import socket
import threading
import time
from dataclasses import dataclass
from typing import Any

import h11
import uvicorn
from uvicorn.protocols.http.h11_impl import H11Protocol

from llmsys.engine.config import EngineConfig
from llmsys.engine.server.app import create_app
from llmsys.engine.server.protocol import APIError
from llmsys.engine.server.state import ServerSettings, ServerState

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


def _protocol(head_timeout_s: float) -> type[H11Protocol]:
    class _Protocol(H11Protocol):
        """See the module docstring."""

        def connection_made(self, transport: Any) -> None:  # type: ignore[override]
            super().connection_made(transport)
            self._head_timer = self.loop.call_later(head_timeout_s, self._head_overdue)

        def _head_overdue(self) -> None:
            waiting = self.cycle is None or self.cycle.response_complete  # no request head since the last answer
            if waiting and not self.transport.is_closing():
                self.transport.close()

        def on_response_complete(self) -> None:
            super().on_response_complete()  # keep-alive: the next head has the same deadline
            self._head_timer.cancel()
            self._head_timer = self.loop.call_later(head_timeout_s, self._head_overdue)

        def connection_lost(self, exc: Exception | None) -> None:
            self._head_timer.cancel()
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


def _uvicorn_config(state: ServerState, host: str, port: int, log_level: str) -> uvicorn.Config:
    return uvicorn.Config(
        create_app(state),
        host=host,
        port=port,
        log_level=log_level,
        http=_protocol(state.settings.head_timeout_s),
        timeout_graceful_shutdown=state.settings.shutdown_timeout_s + BACKSTOP_S,
        access_log=log_level == "debug",
        lifespan="on",
    )


def serve(config: EngineConfig, settings: ServerSettings, host: str = "127.0.0.1", port: int = 8000,
          log_level: str = "info") -> int:
    """Serve until SIGINT/SIGTERM; 0 on a clean stop, 2 if the model failed to load."""
    state = ServerState(settings)
    server = _Server(_uvicorn_config(state, host, port, log_level), state)
    if not settings.api_key and not _is_loopback(host):
        log.warning("serving on %s without an API key: anyone who can reach this address can use the model; "
                    "set LLMSYS_API_KEY or --api-key-file", host)

    def load() -> None:
        t0 = time.perf_counter()
        try:
            state.load(config)
        except Exception as e:  # LLMSysError or worse: report and stop serving
            state.load_error = str(e).splitlines()[0] if str(e) else type(e).__name__
            print(f"error: {state.load_error}", flush=True)
            server.should_exit = True
            return
        print(f"llmsys: model '{state.model_name}' ready in {time.perf_counter() - t0:.1f} s; "
              f"OpenAI API at http://{host}:{port}/v1", flush=True)

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
    server = uvicorn.Server(_uvicorn_config(state, "127.0.0.1", port, log_level))
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

