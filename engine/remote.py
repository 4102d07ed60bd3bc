"""The thin HTTP client ``llmsys run`` and ``llmsys chat --plain`` use when an ``llmsys serve`` answers.

Why: a server holds the model warm, so a second command answers at once instead of importing torch and
loading weights again (Ollama's CLI works the same way). This module is standard library only (http.client,
json): the whole client path must import neither torch nor the engine. The address is ``--host``, else
``$LLMSYS_HOST``, else where ``llmsys serve`` listens by default; the probe is one TCP connect and
``GET /health`` with a short timeout, so a machine without a server loses almost nothing.
"""

from __future__ import annotations

import http.client
import json
import os
import socket
import sys
from dataclasses import dataclass, field
from typing import Any, Iterator
from urllib.parse import urlsplit

from llmsys.kernels.common.errors import LLMSysError

HOST_ENV = "LLMSYS_HOST"
DEFAULT_HOST = "127.0.0.1"
DEFAULT_PORT = 8000  # llmsys serve's --port default (tests/test_cli_remote.py keeps the two equal)
PROBE_TIMEOUT_S = 0.2


class RemoteError(LLMSysError):
    """The server answered with an error (its message, one line), or the connection failed mid-request."""

    def __init__(self, message: str, status: int = 0, code: str | None = None):
        super().__init__(message)
        self.status = status
        self.code = code


@dataclass(frozen=True)
class ServerAddress:
    """Where a server may listen: ``host:port``, ``http://host:port`` or ``:port`` (as OLLAMA_HOST takes it)."""

    host: str
    port: int
    tls: bool = False

    @property
    def url(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"{'https' if self.tls else 'http'}://{host}:{self.port}"

    def connect(self, timeout: float | None) -> http.client.HTTPConnection:
        cls = http.client.HTTPSConnection if self.tls else http.client.HTTPConnection
        return cls(self.host, self.port, timeout=timeout)


def server_address(host: str | None = None) -> ServerAddress:
    """``--host``, else ``$LLMSYS_HOST``, else llmsys serve's default; a bad value is a one-line error."""
    given = host if host is not None else os.environ.get(HOST_ENV) or ""
    text = given.strip()
    if not text:
        return ServerAddress(DEFAULT_HOST, DEFAULT_PORT)
    if "://" not in text:
        text = "http://" + text
    try:
        parts = urlsplit(text)
        port = parts.port
    except ValueError:
        parts, port = None, -1
    if parts is None or parts.scheme not in ("http", "https") or port == -1 or (parts.path not in ("", "/")):
        where = "--host" if host is not None else f"${HOST_ENV}"
        raise RemoteError(f"{where}={given!r} is not a server address; give HOST:PORT or http://HOST:PORT, "
                          f"e.g. {DEFAULT_HOST}:{DEFAULT_PORT}")
    tls = parts.scheme == "https"
    default_port = 443 if tls else DEFAULT_PORT
    return ServerAddress(parts.hostname or DEFAULT_HOST, port if port is not None else default_port, tls)


def answers(addr: ServerAddress, timeout: float = PROBE_TIMEOUT_S) -> bool:
    """True when an llmsys server there says it is healthy (``GET /health`` 200) within ``timeout``."""
    conn = addr.connect(timeout)
    try:
        conn.request("GET", "/health", headers={"Accept": "application/json"})
        resp = conn.getresponse()
        body = resp.read(4096)
        if resp.status != 200:
            return False
        return json.loads(body or b"{}").get("status") == "ok"
    except (OSError, http.client.HTTPException, ValueError, AttributeError):
        return False
    finally:
        conn.close()


@dataclass(frozen=True)
class RemoteTimings:
    """The server's ``timings`` of one finished request (llama.cpp's field names), as the stats line wants them."""

    prompt_tokens: int
    generated_tokens: int
    ttft_s: float
    prompt_tok_s: float
    decode_tok_s: float

    @classmethod
    def from_json(cls, t: dict[str, Any]) -> RemoteTimings:
        return cls(int(t.get("prompt_n", 0)), int(t.get("predicted_n", 0)), float(t.get("ttft_ms", 0.0)) / 1000,
                   float(t.get("prompt_per_second", 0.0)), float(t.get("predicted_per_second", 0.0)))


@dataclass
class RemoteChunk:
    """One streamed frame's news: text, and on the last one the finish, timings and the extensions."""

    text: str = ""
    finish_reason: str | None = None
    timings: RemoteTimings | None = None
    finish_details: dict[str, Any] | None = None
    chat_template: str | None = None  # the template's label the server rendered with (chat requests)
    error: str | None = None  # the final chunk says why the request ended early
    usage: dict[str, Any] = field(default_factory=dict)


def _error_line(status: int, body: bytes) -> RemoteError:
    try:
        err = json.loads(body).get("error") or {}
        msg = err.get("message") if isinstance(err, dict) else str(err)
        code = err.get("code") if isinstance(err, dict) else None
    except (ValueError, AttributeError):
        msg, code = body.decode("utf-8", "replace").strip()[:300], None
    return RemoteError(" ".join(str(msg or f"HTTP {status}").split()), status, code)


class RemoteStream:
    """One streamed request (``/v1/chat/completions`` or ``/v1/completions``); iterate for chunks.

    :meth:`close` drops the connection, which is how the server learns the client left and frees the
    request's slot and KV blocks (Ctrl-C)."""

    def __init__(self, addr: ServerAddress, path: str, body: dict[str, Any], connect_timeout: float = 5.0):
        self.addr = addr
        self.conn = addr.connect(connect_timeout)
        try:
            self.conn.request("POST", path, body=json.dumps(body).encode(),
                              headers={"Content-Type": "application/json", "Accept": "text/event-stream"})
            if self.conn.sock is not None:
                self.conn.sock.settimeout(None)  # a long prefill sends nothing for a while
            self.resp = self.conn.getresponse()
        except (OSError, http.client.HTTPException) as e:
            self.conn.close()
            raise RemoteError(f"the llmsys server at {addr.url} did not answer: {e}") from None
        if self.resp.status != 200:
            err = _error_line(self.resp.status, self.resp.read())
            self.conn.close()
            raise err

    def __iter__(self) -> Iterator[RemoteChunk]:
        try:
            while True:
                line = self.resp.readline()
                if not line:
                    raise RemoteError(f"the llmsys server at {self.addr.url} closed the stream before it ended")
                if not line.startswith(b"data:"):
                    continue
                data = line[5:].strip()
                if data == b"[DONE]":
                    return
                frame = json.loads(data)
                chunk = _chunk(frame)
                if chunk is not None:
                    yield chunk
        except (OSError, http.client.HTTPException) as e:
            raise RemoteError(f"the llmsys server at {self.addr.url} stopped answering: {e}") from None
        finally:
            self.close()

    def close(self) -> None:
        try:
            if self.conn.sock is not None:
                self.conn.sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self.conn.close()


def _chunk(frame: dict[str, Any]) -> RemoteChunk | None:
    choices = frame.get("choices")
    if not choices:
        if "error" in frame and "usage" not in frame:  # an in-band error after the headers went out
            raise _error_line(500, json.dumps(frame).encode())
        return None  # the usage frame: the final chunk carried the timings already
    c = choices[0]
    text = (c.get("delta") or {}).get("content") or "" if "delta" in c else c.get("text") or ""
    out = RemoteChunk(text=text, finish_reason=c.get("finish_reason"), finish_details=c.get("finish_details"))
    if frame.get("timings"):
        out.timings = RemoteTimings.from_json(frame["timings"])
    out.chat_template = frame.get("chat_template")
    err = frame.get("error")
    if isinstance(err, dict):
        out.error = str(err.get("message") or "")
    return out


def get_json(addr: ServerAddress, method: str, path: str, body: dict[str, Any] | None = None,
             timeout: float = 30.0) -> dict[str, Any]:
    """One small JSON request (``/api/show``, ``/api/ps``); an error status is a :class:`RemoteError`."""
    conn = addr.connect(timeout)
    try:
        conn.request(method, path, body=None if body is None else json.dumps(body).encode(),
                     headers={"Content-Type": "application/json"})
        resp = conn.getresponse()
        data = resp.read()
        if resp.status != 200:
            raise _error_line(resp.status, data)
        return json.loads(data or b"{}")
    except (OSError, http.client.HTTPException, ValueError) as e:
        raise RemoteError(f"the llmsys server at {addr.url} did not answer {path}: {e}") from None
    finally:
        conn.close()


def request_body(model: str, sampling: dict[str, Any], *, messages: list[dict[str, str]] | None = None,
                 prompt: str | None = None) -> dict[str, Any]:
    """The OpenAI request for the CLI's sampling flags (their names as :func:`build_sampling` takes them)."""
    s = dict(sampling)
    body: dict[str, Any] = {"model": model, "stream": True}
    if messages is not None:
        body["messages"] = messages
    else:
        body["prompt"] = prompt
    n = s.get("max_tokens")
    if n is not None and n != -1:
        body["max_tokens"] = n
    for k in ("temperature", "top_k", "top_p", "min_p", "repetition_penalty", "presence_penalty",
              "frequency_penalty", "seed", "ignore_eos"):
        if s.get(k) is not None:
            body[k] = s[k]
    if s.get("stop"):
        body["stop"] = list(s["stop"])
    return body


def model_name(model: str) -> str:
    """The name to send: a path that exists here goes absolute (the server's working folder may differ);
    anything else (catalog names, ``NAME:TAG``, ``org/repo``) as the user gave it."""
    if os.path.exists(model):
        return os.path.abspath(model)
    return model


def say(line: str) -> None:
    sys.stderr.write(line + "\n")
    sys.stderr.flush()
