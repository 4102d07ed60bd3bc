"""``llmsys monitor [URL]``: the memory panel of a running ``llmsys serve``."""

from __future__ import annotations

from typing import Annotated

import typer


def monitor_command(
    url: Annotated[str, typer.Argument(help="base URL of a running llmsys serve")] = "http://127.0.0.1:8000",
    interval: Annotated[float, typer.Option("--interval", help="seconds between scrapes of /metrics")] = 0.5,
    theme: Annotated[str, typer.Option("--theme", help="Textual theme, e.g. textual-dark, textual-light")] = "textual-dark",
) -> int:
    from llmsys.tui.monitor_app import MonitorApp

    MonitorApp(url, interval=interval, theme=theme).run()
    return 0
