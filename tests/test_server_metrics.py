"""``/metrics`` of a real ``llmsys serve`` (prometheus_client), read back by the library's parser
and by ``llmsys monitor``: the bytes per memory tier are the engine's own ``memory_report()``.

Two in-process servers on stories260k-hf: A resident under ``--cpu-mem 256MiB``, B with two
layers streamed from the offload folder under ``--cpu-mem 64MiB`` (a plan and a runtime).
"""

from __future__ import annotations

import asyncio
import os
import shutil
import subprocess
import sys
import time
import uuid
from pathlib import Path

import httpx
import pytest

from conftest import STORIES_HF, need_shared
from llmsys.engine.server.metrics import Metrics, parse_metrics
from llmsys.kernels.common.units import format_bytes
from llmsys.tui.snapshot import plan_phrase

ROOT = Path(__file__).resolve().parents[1]
MiB = 1 << 20


@pytest.fixture(scope="module")
def servers(tmp_path_factory):
    need_shared(STORIES_HF)
    import torch

    from llmsys import LLM
    from llmsys.engine.server.serve import start_server_thread
    from llmsys.engine.server.state import ServerSettings, ServerState

    torch.set_num_threads(2)
    out = {}
    for name, kw in (("a", dict(cpu_mem="256MiB")),
                     ("b", dict(cpu_mem="64MiB", placement={"cpu": 3, "disk": 2},
                                offload_dir=str(tmp_path_factory.mktemp("off"))))):
        state = ServerState(ServerSettings())
        llm = LLM(str(STORIES_HF), dtype="float32", progress=False, **kw)
        state.attach(llm, f"stories-{name}")
        out[name] = (start_server_thread(state), llm)
    yield out
    for srv, _ in out.values():
        srv.stop()


def _complete(srv, n: int = 1) -> None:
    for _ in range(n):
        r = httpx.post(srv.url + "/v1/completions", timeout=60,
                       json={"model": srv.state.model_name, "prompt": "Once upon a time", "max_tokens": 8, "temperature": 0})
        assert r.status_code == 200, r.text


def _idle_metrics(srv, model: str | None = None) -> dict[str, float]:
    """/metrics once the request has finished (the gauges are updated after the step that ends it)."""
    t0 = time.monotonic()
    while True:
        m = parse_metrics(httpx.get(srv.url + "/metrics").text, model)
        if m["llmsys_requests_running"] == 0 and sum(v for k, v in m.items() if k.startswith("llmsys_request_finished")):
            return m
        assert time.monotonic() - t0 < 30, "the server did not go idle"
        time.sleep(0.05)


def _tiers(m: dict[str, float], name: str) -> dict[str, int]:
    prefix = name + '{tier="'
    return {k[len(prefix):-2]: int(v) for k, v in m.items() if k.startswith(prefix)}


def test_metrics_export_the_engines_bytes_per_tier(servers):
    for name, (srv, llm) in servers.items():
        _complete(srv)
        r = httpx.get(srv.url + "/metrics")
        assert r.headers["content-type"].startswith("text/plain; version=0.0.4")
        m = _idle_metrics(srv)
        rep = llm.core.memory_report()  # the engine is idle: nothing changes under this read
        assert _tiers(m, "llmsys_weight_bytes") == rep.weights, name
        assert _tiers(m, "llmsys_kv_bytes_total") == rep.kv_total, name
        assert _tiers(m, "llmsys_kv_bytes_used") == rep.kv_used, name
        assert _tiers(m, "llmsys_kv_bytes_reserved") == rep.kv_total == rep.kv_reserved, name
        assert _tiers(m, "llmsys_kv_bytes_resident") == rep.kv_resident, name
        assert _tiers(m, "llmsys_kv_bytes_in_use") == rep.kv_in_use, name
        assert _tiers(m, "llmsys_memory_resident_bytes") == rep.resident, name
        # a request ran: its blocks were written (resident; this tiny pool's tensors are allocated whole)
        assert 0 < rep.kv_in_use["cpu"] + rep.kv_resident["cpu"] and rep.kv_in_use["cpu"] <= rep.kv_resident["cpu"]
        assert rep.kv_resident["cpu"] <= rep.kv_total["cpu"], name
        assert _tiers(m, "llmsys_staging_bytes") == rep.staging, name
        assert _tiers(m, "llmsys_memory_budget_bytes") == {"cpu": llm.config.cpu_mem}, name
        assert m["llmsys_kv_blocks_total"] == rep.kv_blocks_total
        # the names the dashboards and tests know, with no _created series beside them
        assert m["llmsys_generation_tokens_total"] > 0 and m['llmsys_requests_total{endpoint="/v1/completions",status="200"}'] >= 1
        assert m["llmsys_time_to_first_token_seconds_count"] >= 1
        assert m['llmsys_e2e_request_latency_seconds_bucket{le="+Inf"}'] == m["llmsys_e2e_request_latency_seconds_count"] >= 1
        assert 'llmsys_e2e_request_latency_seconds_bucket{le="30.0"}' in m
        assert not [k for k in m if k.startswith("llmsys_") and "_created" in k]
        assert m["process_resident_memory_bytes"] > 0 and any(k.startswith("python_info{") for k in m)
    _, a = servers["a"]
    assert a.offload is None and _tiers(m, "llmsys_weight_bytes")  # B: m is the last one read
    srv_b, b = servers["b"]
    rep = b.core.memory_report()
    assert rep.weights["disk"] > 0 and rep.staging["cpu"] > 0  # B really streams
    layers = {k: v for k, v in m.items() if k.startswith("llmsys_layer_info")}
    kinds = [p.kind for p in b.plan.layers]
    assert len(layers) == len(kinds) == 5 and kinds.count("disk") == 2
    for i, kind in enumerate(kinds):
        tier, streamed = ("disk", "true") if kind == "disk" else ("cpu", "false")
        assert layers[f'llmsys_layer_info{{layer="{i}",streamed="{streamed}",tier="{tier}"}}'] == 1


def test_two_metrics_do_not_share_counts(servers):
    a, b = Metrics(), Metrics()
    a.count_request("/v1/completions", 200)
    a.on_tokens(5, 0.01, None)
    a.on_finish("stop", 3, 0, 0.1)
    ma, mb = parse_metrics(a.render()), parse_metrics(b.render())
    assert ma["llmsys_generation_tokens_total"] == 5 and mb["llmsys_generation_tokens_total"] == 0
    assert 'llmsys_requests_total{endpoint="/v1/completions",status="200"}' not in mb
    assert mb["llmsys_time_to_first_token_seconds_count"] == 0
    # and two live servers in this process: each counts its own requests
    (sa, _), (sb, _) = servers["a"], servers["b"]
    key = 'llmsys_requests_total{endpoint="/v1/completions",status="200"}'
    before = [parse_metrics(httpx.get(s.url + "/metrics").text).get(key, 0) for s in (sa, sb)]
    _complete(sa, 2)
    after = [parse_metrics(httpx.get(s.url + "/metrics").text).get(key, 0) for s in (sa, sb)]
    assert after == [before[0] + 2, before[1]]


def test_monitor_shows_a_live_servers_bytes(servers):
    """The monitor app (what ``llmsys monitor URL`` runs) on the live servers: bytes, budget, layers."""
    from llmsys.tui.monitor_app import MonitorApp

    async def go(srv, llm):
        rep = llm.core.memory_report()
        app = MonitorApp(srv.url, interval=0.05)
        async with app.run_test(size=(120, 36)) as pilot:
            t0 = time.monotonic()
            while app.scrapes < 2:
                assert time.monotonic() - t0 < 30, "no scrape"
                await pilot.pause(0.05)
            snap = app.panel.snapshot
            cpu = snap.tier("cpu")
            assert (cpu.budget, cpu.weights, cpu.kv_reserved) == (llm.config.cpu_mem, rep.weights["cpu"], rep.kv_total["cpu"])
            assert (cpu.kv_resident, cpu.kv_used) == (rep.kv_resident["cpu"], rep.kv_in_use["cpu"])
            assert cpu.workspace == rep.staging.get("cpu", 0)
            assert snap.tier("disk").weights == rep.weights.get("disk", 0)
            assert snap.layer_tiers == tuple(p.tier for p in llm.plan.layers)
            assert snap.layer_streamed == tuple(p.kind == "disk" for p in llm.plan.layers)
            return snap.plan_phrase

    assert asyncio.run(go(*servers["a"])) == "all 5 layers resident on CPU"
    b = servers["b"][1]
    streamed = tuple(p.kind == "disk" for p in b.plan.layers)
    assert asyncio.run(go(*servers["b"])) == plan_phrase(tuple(p.tier for p in b.plan.layers), streamed, "cpu")
    assert "disk->CPU streamed" in plan_phrase(tuple(p.tier for p in b.plan.layers), streamed, "cpu")


@pytest.mark.skipif(shutil.which("tmux") is None, reason="tmux is not installed (apt-get install -y tmux)")
def test_llmsys_monitor_in_a_terminal_shows_the_bytes(servers):
    """The real ``llmsys monitor URL`` in tmux against the live server A."""
    srv, llm = servers["a"]
    rep = llm.core.memory_report()
    session = f"llmsys-test-{uuid.uuid4().hex[:8]}"
    cmd = f"{sys.executable} -m llmsys.engine.cli.main monitor {srv.url} --interval 0.2"
    env = dict(os.environ, TERM=os.environ.get("TERM") or "xterm-256color")
    subprocess.run(["tmux", "new-session", "-d", "-s", session, "-x", "120", "-y", "36", "-c", str(ROOT), cmd],
                   check=True, env=env, timeout=20)
    want = (f"W {format_bytes(rep.weights['cpu'])} · KV {format_bytes(rep.kv_resident['cpu'])} of "
            f"{format_bytes(rep.kv_total['cpu'])}", f"/ {format_bytes(llm.config.cpu_mem)}",
            "all 5 layers resident on CPU")
    screen = ""
    try:
        t0 = time.monotonic()
        while time.monotonic() - t0 < 60:
            screen = subprocess.run(["tmux", "capture-pane", "-p", "-t", session], capture_output=True,
                                    text=True, timeout=20).stdout
            if all(w in screen for w in want):
                break
            time.sleep(0.25)
        else:
            raise AssertionError(f"the monitor did not show {want}; the screen was:\n{screen}")
        assert "no layers yet" not in screen
        cpu = next(line for line in screen.splitlines() if "CPU  " in line)
        assert "n/a" not in cpu and ("█" in cpu or "▆" in cpu or "▒" in cpu), cpu
    finally:
        subprocess.run(["tmux", "kill-session", "-t", session], capture_output=True)


def test_each_loaded_model_has_its_own_series(tmp_path):
    """Two models in one server: every per-engine gauge carries ``model``, each series is that engine's
    own report (not whichever updated last), the monitor adds them up, and an unloaded model's go."""
    from test_server_multi import tiny_random

    from llmsys import LLM
    from llmsys.engine.server.serve import start_server_thread
    from llmsys.engine.server.state import ServerSettings, ServerState
    from llmsys.tui.metrics import MetricsTracker, parse_prometheus

    state = ServerState(ServerSettings())
    big = LLM(str(STORIES_HF), dtype="float32", progress=False, cpu_mem="256MiB")
    small = LLM(str(tiny_random(tmp_path / "tiny-a", 1)), dtype="float32", progress=False, cpu_mem="128MiB")
    state.attach(big, "stories")
    state.attach(small, "tiny-a")
    srv = start_server_thread(state)
    try:
        for model in ("stories", "tiny-a"):
            r = httpx.post(srv.url + "/v1/completions", timeout=60,
                           json={"model": model, "prompt": "Once upon a time", "max_tokens": 4, "temperature": 0})
            assert r.status_code == 200, r.text
        for model in ("stories", "tiny-a"):
            _idle_metrics(srv, model)
        text = httpx.get(srv.url + "/metrics").text
        both = parse_metrics(text)  # two models: the label stays in the keys
        assert 'llmsys_memory_resident_bytes{model="stories",tier="cpu"}' in both
        assert not any(k.startswith("llmsys_memory_resident_bytes{tier=") for k in both)
        for model, llm in (("stories", big), ("tiny-a", small)):
            m = parse_metrics(text, model=model)
            rep = llm.core.memory_report()
            assert _tiers(m, "llmsys_memory_resident_bytes") == rep.resident, model
            assert _tiers(m, "llmsys_kv_bytes_reserved") == rep.kv_total, model
            assert _tiers(m, "llmsys_kv_bytes_resident") == rep.kv_resident, model
            assert _tiers(m, "llmsys_kv_bytes_in_use") == rep.kv_in_use, model
            assert _tiers(m, "llmsys_weight_bytes") == rep.weights, model
            assert _tiers(m, "llmsys_memory_budget_bytes") == {"cpu": llm.config.cpu_mem}, model
            assert m["llmsys_kv_blocks_total"] == rep.kv_blocks_total, model
            layers = [k for k in m if k.startswith("llmsys_layer_info")]
            assert len(layers) == llm.loaded.args.num_hidden_layers, model
        assert big.core.memory_report().resident != small.core.memory_report().resident
        # the monitor: bytes add up over the models, the budget is not counted twice
        snap = MetricsTracker().update(parse_prometheus(text), 0.0)
        cpu = snap.tier("cpu")
        assert cpu.weights == sum(llm.core.memory_report().weights["cpu"] for llm in (big, small))
        assert cpu.budget == 256 * MiB
        # unloaded: its series go, the other model's stay
        assert state.models.drop("tiny-a")
        m = parse_metrics(httpx.get(srv.url + "/metrics").text)
        assert not [k for k in m if 'model="tiny-a"' in k]
        assert _tiers(m, "llmsys_memory_resident_bytes") == big.core.memory_report().resident  # one model again
    finally:
        srv.stop()
