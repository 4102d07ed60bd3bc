"""``llmsys serve [MODEL...]``: a local OpenAI- and Ollama-compatible HTTP server.

The models given are loaded at start; any other a request names is loaded on first use and unloaded after
``--keep-alive`` (engine/server/models.py), all within one memory budget (``--cpu-mem``, else the RAM free)."""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Annotated, Any, Optional

import typer

from llmsys.engine.cli.options import ChatTemplateOption, build_engine_config, engine_command, pulling_command
from llmsys.engine.cli.options import kv_disk_on
from llmsys.kernels.common.units import parse_size
from llmsys.kernels.common.errors import InvalidParameterError


@pulling_command
@engine_command
def serve_command(
    model: Annotated[Optional[list[str]], typer.Argument(help="models loaded at start (none: requests load what they "
                     "name): model folder, .gguf or llama2.c file, catalog name or alias (qwen2.5:0.5b), org/repo or "
                     "Ollama NAME:TAG")] = None,
    host: Annotated[str, typer.Option("--host", help="address to bind (loopback by default)")] = "127.0.0.1",
    port: Annotated[int, typer.Option("--port", help="TCP port")] = 8000,
    api_key: Annotated[
        Optional[str], typer.Option("--api-key", help="require 'Authorization: Bearer KEY' on /v1; other users can "
                                    "read it in the process list, so prefer $LLMSYS_API_KEY or --api-key-file")
    ] = None,
    api_key_file: Annotated[
        Optional[Path], typer.Option("--api-key-file", help="read the API key from this file (first line)")
    ] = None,
    allowed_hosts: Annotated[
        Optional[str], typer.Option("--allowed-hosts", help="comma-separated Host names to answer besides loopback "
                                    "names and IP addresses ('*': any); others get 403 (DNS rebinding)")
    ] = None,
    cors_origin: Annotated[
        Optional[str], typer.Option("--cors-origin", help="comma-separated browser origins allowed to call the API "
                                    "(e.g. http://localhost:3000, '*': any); none by default")
    ] = None,
    max_concurrency: Annotated[
        Optional[int], typer.Option("--max-concurrency", help="requests decoded at once (default: --max-num-seqs)")
    ] = None,
    max_queue: Annotated[int, typer.Option("--max-queue", help="requests waiting beyond that; more get HTTP 429")] = 256,
    max_body: Annotated[str, typer.Option("--max-body", help="largest request body; bigger gets HTTP 413")] = "4MiB",
    served_name: Annotated[
        Optional[str], typer.Option("--served-model-name", help="model id shown by /v1/models")
    ] = None,
    model_alias: Annotated[
        Optional[str], typer.Option("--model-alias", help="comma-separated more names clients may ask for "
                                    "(e.g. gpt-4o-mini,llama3); other names get 404 model_not_found")
    ] = None,
    shutdown_timeout: Annotated[
        float, typer.Option("--shutdown-timeout", help="seconds in-flight requests get to finish on Ctrl+C/SIGTERM")
    ] = 10.0,
    body_deadline: Annotated[
        float, typer.Option("--body-deadline", help="seconds a whole request body may take to arrive; slower "
                            "senders get 408 and are closed")
    ] = 60.0,
    max_connections: Annotated[
        Optional[int], typer.Option("--max-connections", help="open connections at once; more get 503 and are "
                                    "closed (default: min(1024, open-file limit - 64))")
    ] = None,
    max_connections_per_client: Annotated[
        Optional[int], typer.Option("--max-connections-per-client",
                                    help="open connections per client address (default: min(256, --max-connections))")
    ] = None,
    max_prompt_tokens: Annotated[
        Optional[int], typer.Option("--max-prompt-tokens", help="tokens one prompt may have, whatever the KV policy; "
                                    "longer is a 400 (default: the context length)")
    ] = None,
    send_timeout: Annotated[
        float, typer.Option("--send-timeout", help="seconds a stream waits for a client that reads nothing before "
                            "it is aborted and its slot freed")
    ] = 30.0,
    log_level: Annotated[str, typer.Option("--log-level", help="uvicorn log level")] = "info",
    keep_alive: Annotated[
        Optional[str], typer.Option("--keep-alive", help="how long a model stays loaded after its last request: a "
                                    "duration (5m, 1h), 0 (unload at once) or -1 (for ever); default $LLMSYS_KEEP_ALIVE "
                                    "or 5m; the models given here stay until a request sets keep_alive")
    ] = None,
    chat_template: ChatTemplateOption = None,
    *,
    engine_flags: dict[str, Any],
    auto_pull: bool,
) -> int:
    if not 0 <= port <= 65535:
        raise InvalidParameterError(f"--port must be in 0..65535, got {port}")
    if max_concurrency is not None and max_concurrency < 1:
        raise InvalidParameterError(f"--max-concurrency must be >= 1, got {max_concurrency}")
    if max_queue < 0:
        raise InvalidParameterError(f"--max-queue must be >= 0, got {max_queue}")
    body = parse_size(max_body)
    if not body or body < 1024:
        raise InvalidParameterError(f"--max-body must be at least 1KiB, got {max_body}")
    if shutdown_timeout < 0:
        raise InvalidParameterError(f"--shutdown-timeout must be >= 0 seconds, got {shutdown_timeout:g}")
    if body_deadline <= 0:
        raise InvalidParameterError(f"--body-deadline must be > 0 seconds, got {body_deadline:g}")
    if send_timeout <= 0:
        raise InvalidParameterError(f"--send-timeout must be > 0 seconds, got {send_timeout:g}")
    for flag, v in (("--max-connections", max_connections), ("--max-connections-per-client", max_connections_per_client),
                    ("--max-prompt-tokens", max_prompt_tokens)):
        if v is not None and v < 1:
            raise InvalidParameterError(f"{flag} must be >= 1, got {v}")
    check_port(host, port)  # before the server's imports, a download or a load: uvicorn would fail only then
    from llmsys.engine.cli.models_cmd import ensure_pulled
    from llmsys.engine.server.models import default_keep_alive, memory_budget

    keep = default_keep_alive(keep_alive)
    for m in model or []:
        ensure_pulled(m, auto_pull)
    engine_flags = kv_disk_on(engine_flags)  # a restarted server reads its prompts' KV back from disk
    flags = dict(engine_flags, chat_template=chat_template)
    configs = [build_engine_config(m, flags) for m in model or []]
    budget = memory_budget(configs[0].cpu_mem if configs else build_engine_config("", flags).cpu_mem)
    from llmsys.engine.server.serve import serve
    from llmsys.engine.server.state import ServerSettings

    settings = ServerSettings(
        api_key=_api_key(api_key, api_key_file),
        allowed_hosts=_names(allowed_hosts),
        cors_origins=_names(cors_origin),
        max_concurrency=max_concurrency,
        max_queue=max_queue,
        max_body_bytes=body,
        model_name=served_name,
        model_aliases=_names(model_alias),
        shutdown_timeout_s=shutdown_timeout,
        body_deadline_s=body_deadline,
        max_connections=max_connections,
        max_connections_per_client=max_connections_per_client,
        max_prompt_tokens=max_prompt_tokens,
        send_timeout_s=send_timeout,
    )
    return serve(configs, settings, host=host, port=port, log_level=log_level,
                 config_for=lambda spec: build_engine_config(spec, flags), budget=budget, keep_alive_s=keep)


def check_port(host: str, port: int) -> None:
    """Bind ``host:port`` as uvicorn will (SO_REUSEADDR) and let go: a port in use is one line that names
    it and the fix, where uvicorn logs four. Port 0 (any free one) is not checked."""
    import errno
    import socket

    if port == 0:
        return
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except socket.gaierror as e:
        raise InvalidParameterError(f"--host {host}: not an address this machine can bind ({e.strerror}); "
                                    "try 127.0.0.1 or 0.0.0.0") from None
    family, kind, proto, _, addr = infos[0]
    with socket.socket(family, kind, proto) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind(addr)
        except OSError as e:
            if e.errno == errno.EADDRINUSE:
                raise InvalidParameterError(
                    f"port {port} on {host} is in use (another llmsys serve or server?); pick another with "
                    f"--port N, or stop the process holding it (ss -ltnp 'sport = :{port}' shows it)") from None
            if e.errno == errno.EACCES:
                raise InvalidParameterError(f"port {port} needs privileges to bind; use --port 1024 or above") from None
            raise InvalidParameterError(f"cannot bind {host}:{port} ({e.strerror}); check --host and --port") from None


def _names(text: str | None) -> tuple[str, ...]:
    return tuple(x.strip() for x in (text or "").split(",") if x.strip())


def _api_key(flag: str | None, path: Path | None) -> str | None:
    """The key from --api-key-file, --api-key or $LLMSYS_API_KEY (one of them)."""
    if flag and path:
        raise InvalidParameterError("give the key once: --api-key or --api-key-file, not both")
    if path is not None:
        try:
            key = path.read_text(encoding="utf-8").strip().splitlines()
        except (OSError, UnicodeDecodeError) as e:
            raise InvalidParameterError(f"--api-key-file {path}: cannot read it ({e})") from None
        if not key or not key[0].strip():
            raise InvalidParameterError(f"--api-key-file {path} is empty; write the key on its first line")
        return key[0].strip()
    if flag:
        print("warning: --api-key is visible to other users in the process list; "
              "prefer LLMSYS_API_KEY or --api-key-file", file=sys.stderr)
        return flag
    return os.environ.get("LLMSYS_API_KEY") or None
