"""``llmsys serve MODEL``: a local OpenAI-compatible HTTP server."""

from __future__ import annotations

import os
from typing import Annotated, Any, Optional

import typer

from llmsys.engine.cli.options import build_engine_config, engine_command, pulling_command
from llmsys.kernels.common.units import parse_size
from llmsys.kernels.common.errors import InvalidParameterError


@pulling_command
@engine_command
def serve_command(
    model: Annotated[str, typer.Argument(help="model directory, .gguf or llama2.c file, catalog name, org/repo or ollama:NAME")],
    host: Annotated[str, typer.Option("--host", help="address to bind (loopback by default)")] = "127.0.0.1",
    port: Annotated[int, typer.Option("--port", help="TCP port")] = 8000,
    api_key: Annotated[
        Optional[str], typer.Option("--api-key", help="require 'Authorization: Bearer KEY' on /v1 (or $LLMSYS_API_KEY)")
    ] = None,
    max_concurrency: Annotated[
        Optional[int], typer.Option("--max-concurrency", help="requests decoded at once (default: --max-num-seqs)")
    ] = None,
    max_queue: Annotated[int, typer.Option("--max-queue", help="requests waiting beyond that; more get HTTP 429")] = 256,
    max_body: Annotated[str, typer.Option("--max-body", help="largest request body; bigger gets HTTP 413")] = "4MiB",
    served_name: Annotated[
        Optional[str], typer.Option("--served-model-name", help="model id shown by /v1/models")
    ] = None,
    shutdown_timeout: Annotated[
        float, typer.Option("--shutdown-timeout", help="seconds in-flight requests get to finish on Ctrl+C/SIGTERM")
    ] = 10.0,
    log_level: Annotated[str, typer.Option("--log-level", help="uvicorn log level")] = "info",
    *,
    engine_flags: dict[str, Any],
    auto_pull: bool,
) -> int:
    from llmsys.engine.cli.models_cmd import ensure_pulled
    from llmsys.engine.server.serve import serve
    from llmsys.engine.server.state import ServerSettings

    if not 0 <= port <= 65535:
        raise InvalidParameterError(f"--port must be in 0..65535, got {port}")
    if max_concurrency is not None and max_concurrency < 1:
        raise InvalidParameterError(f"--max-concurrency must be >= 1, got {max_concurrency}")
    if max_queue < 0:
        raise InvalidParameterError(f"--max-queue must be >= 0, got {max_queue}")
    body = parse_size(max_body)
    if not body or body < 1024:
        raise InvalidParameterError(f"--max-body must be at least 1KiB, got {max_body}")
    settings = ServerSettings(
        api_key=api_key or os.environ.get("LLMSYS_API_KEY") or None,
        max_concurrency=max_concurrency,
        max_queue=max_queue,
        max_body_bytes=body,
        model_name=served_name,
        shutdown_timeout_s=shutdown_timeout,
    )
    ensure_pulled(model, auto_pull)
    return serve(build_engine_config(model, engine_flags), settings, host=host, port=port, log_level=log_level)
