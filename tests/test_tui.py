"""`llmsys chat` / `llmsys monitor`: Textual Pilot tests on the real stories260k engine.

One LLM is loaded per module and lent to each app (``ChatApp(lambda: llm)``);
every app's engine thread is stopped on exit, so the next test finds the core idle.
"""

from __future__ import annotations

import asyncio
import base64
import io
import json
import re
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from rich.cells import cell_len
from textual.geometry import Region

import pytest
import torch
from conftest import STORIES_HF, need_shared

from llmsys.kernels.common.units import format_bytes
from llmsys.kernels.common.errors import InvalidParameterError
from llmsys.engine.kv_cache import blocks_needed
from llmsys.engine.sampling import SamplingParams
from llmsys.tui.app import ChatApp
from llmsys.tui.commands import parse_command
from llmsys.tui.conversation import Conversation, ConversationFileError, apply_settings
from llmsys.tui.memory_panel import SpeedSparkline, describe
from llmsys.tui.messages import GenerationDone, SnapshotUpdated
from llmsys.tui.metrics import MetricsTracker, parse_prometheus
from llmsys.tui.monitor_app import MonitorApp
from llmsys.tui.prompt_input import PromptInput
from llmsys.tui.repl import run_repl
from llmsys.tui.snapshot import plan_phrase, snapshot_from_engine

SIZE = (120, 36)
GREEDY = SamplingParams(max_tokens=40, temperature=0.0)


@pytest.fixture(scope="module")
def llm():
    need_shared(STORIES_HF)
    from llmsys import LLM

    torch.set_num_threads(1)  # 2 shared cores: one engine thread + the UI thread
    return LLM(str(STORIES_HF), dtype="float32", kv_cache_tokens=512, progress=False)


@pytest.fixture(autouse=True)
def _one_thread():
    torch.set_num_threads(1)
    yield


async def wait_for(pilot, cond, timeout: float = 30.0, what: str = "condition") -> None:
    t0 = time.monotonic()
    while not cond():
        if time.monotonic() - t0 > timeout:
            raise AssertionError(f"timed out after {timeout} s waiting for {what}")
        await pilot.pause(0.02)


async def type_and_send(pilot, text: str) -> None:
    pilot.app.query_one(PromptInput).text = text
    await pilot.press("enter")


async def send_and_wait_reply(pilot, text: str) -> None:
    """Send ``text`` and wait until the whole reply has streamed."""
    await type_and_send(pilot, text)
    await wait_for(pilot, lambda: pilot.app.generating is None, timeout=60, what="the reply")


async def ready(pilot) -> None:
    await wait_for(pilot, lambda: pilot.app.info is not None or pilot.app.load_error is not None, what="model load")


def reference(llm, prompt: str, params: SamplingParams) -> str:
    return llm.generate(prompt, params)[0].text


# -- pure pieces -----------------------------------------------------------------


def test_slash_command_parsing_and_settings():
    assert parse_command("hello /set") is None
    assert parse_command("/save 'my file.json'").args == ("my file.json",)
    with pytest.raises(InvalidParameterError, match="unknown command"):
        parse_command("/frobnicate")
    with pytest.raises(InvalidParameterError, match="usage: /load FILE"):
        parse_command("/load")
    p = apply_settings(SamplingParams(), ["temperature=0.7", "top_p=0.9", "max_tokens=256", "seed=1"])
    assert (p.temperature, p.top_p, p.max_tokens, p.seed) == (0.7, 0.9, 256, 1)
    with pytest.raises(InvalidParameterError):
        apply_settings(p, ["top_p=1.5"])  # SamplingParams' own validation
    with pytest.raises(InvalidParameterError, match="unknown setting"):
        apply_settings(p, ["warp=9"])


def test_conversation_files_roundtrip_and_errors(tmp_path):
    c = Conversation(system="be brief")
    c.add("user", "hi")
    c.add("assistant", "```python\nprint(1)\n```")
    path = c.save(tmp_path / "c.json", SamplingParams(temperature=0.5, stop=("x",)), "m")
    back, sampling = Conversation.load(path)
    assert back == c and sampling["temperature"] == 0.5 and sampling["stop"] == ["x"]
    (tmp_path / "bad.json").write_text('{"messages": [{"role": "robot", "content": "x"}]}')
    with pytest.raises(ConversationFileError, match="role"):
        Conversation.load(tmp_path / "bad.json")
    with pytest.raises(ConversationFileError, match="does not exist"):
        Conversation.load(tmp_path / "missing.json")
    # base models continue one document
    assert Conversation(messages=[{"role": "user", "content": "Once"}, {"role": "assistant", "content": " upon"}, {"role": "user", "content": "a"}]).completion_text() == "Once upon a"


def test_plan_phrase():
    assert plan_phrase(("cpu",) * 5, (False,) * 5, "cpu") == "all 5 layers resident on CPU"
    tiers = ("gpu",) * 12 + ("cpu",) * 20
    streamed = (False,) * 12 + (True,) * 20
    assert plan_phrase(tiers, streamed, "gpu") == "layers 0-11 GPU, 12-31 CPU->GPU streamed"


def test_prometheus_parsing_tolerates_missing_metrics():
    text = """# HELP x
llmsys_requests_running 2
llmsys_queue_depth 3
llmsys_kv_blocks_used{tier="gpu"} 10
llmsys_kv_blocks_total{tier="gpu"} 40
llmsys_weight_bytes{tier="gpu"} 1048576
llmsys_generation_tokens_total 100
llmsys_time_to_first_token_seconds_sum 0.5
llmsys_time_to_first_token_seconds_count 2
weird line that is not a metric
"""
    s = parse_prometheus(text)
    tr = MetricsTracker()
    tr.update(s, 0.0)
    s2 = parse_prometheus(text.replace("llmsys_generation_tokens_total 100", "llmsys_generation_tokens_total 150"))
    snap = tr.update(s2, 0.5)
    assert snap.tok_s == pytest.approx(100.0) and snap.per_request_tok_s == pytest.approx(50.0)
    assert (snap.requests_running, snap.requests_waiting, snap.ttft_s) == (2, 3, 0.25)
    gpu = snap.tier("gpu")
    assert (gpu.kv_blocks_used, gpu.kv_blocks_total, gpu.weights) == (10, 40, 1 << 20)
    lines = "\n".join(describe(snap))
    assert "n/a" in lines  # evicted tokens are not exported here
    assert "2 running · 3 queued" in lines


# -- the app ---------------------------------------------------------------------


def test_stream_tokens_then_stop_with_escape(llm, monkeypatch):
    params = SamplingParams(max_tokens=None, temperature=0.0, ignore_eos=True)
    # The reference runs to the context limit, like the app's request, so the
    # stopped reply is a strict prefix of it however fast the machine is.
    ref = reference(llm, "Once upon a time", params)
    # stories260k fills its 512-token context in about a second, faster than the
    # UI can be driven to press Escape mid-stream; pace the engine like a bigger model.
    step = llm.core.step

    def paced_step():
        time.sleep(0.01)
        return step()

    monkeypatch.setattr(llm.core, "step", paced_step)

    async def go():
        app = ChatApp(lambda: llm, sampling=params)
        async with app.run_test(size=SIZE) as pilot:
            await ready(pilot)
            assert app.info.is_chat is False  # base model: completion mode
            await pilot.press(*"Once upon a time")
            await pilot.press("enter")
            await wait_for(pilot, lambda: app._reply is not None and len(app._reply.raw) > 0, what="first tokens")
            seen = {len(app._reply.raw)}
            await wait_for(pilot, lambda: seen.add(len(app._reply.raw)) or len(seen) >= 3, what="more tokens")
            await pilot.press("escape")
            await wait_for(pilot, lambda: app.generating is None, what="the stop")
            assert app.last_finish == "abort"
            turns = app.conversation.messages
            assert [m["role"] for m in turns] == ["user", "assistant"]
            text = turns[1]["content"]
            assert 0 < len(text) < len(ref) and ref.startswith(text)  # what was produced is kept, exactly
            shown = app.transcript.messages()
            assert [m.role for m in shown] == ["user", "assistant"] and shown[1].raw == text
            assert any("stopped after" in n for _, n in app.notices)
            return len(seen)

    assert asyncio.run(go()) >= 3  # the reply grew in several steps: it streamed


def test_panel_numbers_equal_engine_accounting(llm):
    snaps = []

    class Recording(ChatApp):
        def on_snapshot_updated(self, msg: SnapshotUpdated) -> None:
            super().on_snapshot_updated(msg)
            snaps.append((msg.snapshot, self.panel.figures_text, self.panel.query_one("#tier-cpu").render().plain))

    spec = llm.core.kv.spec
    per_block = spec.bytes_per_token * spec.block_size

    async def go():
        # 480 tokens at 100 Hz: stories260k decodes a token in ~0.3 ms (the C decode stack), so 200 at 20 Hz
        # could finish between two snapshots
        app = Recording(lambda: llm, sampling=SamplingParams(max_tokens=480, temperature=0.0, ignore_eos=True),
                        refresh_hz=100)
        async with app.run_test(size=SIZE) as pilot:
            await ready(pilot)
            await send_and_wait_reply(pilot, "Once upon a time")
            mid = [s for s in snaps if s[0].generating]
            assert len(mid) >= 2, "the panel should update while generating"
            for snap, figures, bar in mid:
                cpu = snap.tier("cpu")
                # independent accounting: KV blocks hold the computed tokens (the last sampled one is not computed yet)
                assert cpu.kv_blocks_used == blocks_needed(snap.tokens_in_context - 1, spec.block_size)
                # in use: the live blocks and any cached prefixes; resident: pages written; reserved: the pool
                assert cpu.kv_blocks_used * per_block <= cpu.kv_used <= cpu.kv_resident <= cpu.kv_reserved
                assert cpu.kv_reserved == spec.nbytes and cpu.weights == llm.loaded.weight_bytes
                assert cpu.used == cpu.weights + cpu.kv_resident + cpu.workspace
                assert cpu.kv_blocks_total == spec.num_blocks - 1 and snap.context_budget == llm.max_model_len
                assert f"CPU {cpu.kv_blocks_used}/{cpu.kv_blocks_total}" in figures
                assert f"context    {snap.tokens_in_context} / {llm.max_model_len} tokens" in figures
                assert f"W {format_bytes(cpu.weights)}" in bar and f"KV {format_bytes(cpu.kv_resident)} of {format_bytes(cpu.kv_reserved)}" in bar
                assert (f"{format_bytes(cpu.kv_used)} in use · {format_bytes(cpu.kv_resident)} resident · "
                        f"{format_bytes(cpu.kv_reserved)} reserved") in figures
            # idle: the engine thread is parked, so reading the core here is safe
            rep = llm.memory_report()
            final = app.panel.snapshot.tier("cpu")
            assert (final.weights, final.kv_reserved, final.kv_resident, final.kv_used, final.kv_blocks_used) == (
                rep.weights["cpu"], rep.kv_total["cpu"], rep.kv_resident["cpu"], rep.kv_in_use["cpu"],
                rep.kv_blocks_used)
            assert app.panel.snapshot.tok_s_history and app.panel.snapshot.ttft_s is not None
            assert "all 5 layers resident on CPU" in str(app.status.render())

    asyncio.run(go())


def test_slash_commands_save_and_reload(llm, tmp_path):
    path = tmp_path / "conv.json"

    async def go():
        app = ChatApp(lambda: llm, sampling=GREEDY)
        async with app.run_test(size=SIZE) as pilot:
            await ready(pilot)
            await type_and_send(pilot, "/help")
            assert "/system TEXT" in app.transcript.messages()[-1].raw
            await type_and_send(pilot, "/system You tell short stories.")
            assert app.conversation.system == "You tell short stories."
            await type_and_send(pilot, "/set temperature=0.7 top_p=0.9 max_tokens=12 seed=1")
            assert (app.sampling.temperature, app.sampling.top_p, app.sampling.max_tokens, app.sampling.seed) == (0.7, 0.9, 12, 1)
            await type_and_send(pilot, "/set top_p=7")
            assert app.sampling.top_p == 0.9 and app.notices[-1][0] == "error"
            await type_and_send(pilot, "/set temperature=0")
            await type_and_send(pilot, "Once upon a time")
            await wait_for(pilot, lambda: app.generating is None and len(app.conversation.messages) == 2, what="reply")
            saved = [dict(m) for m in app.conversation.messages]
            await type_and_send(pilot, f"/save {path}")
            data = json.loads(path.read_text())
            assert data["messages"] == saved and data["system"] == "You tell short stories."
            assert data["sampling"]["max_tokens"] == 12
            await type_and_send(pilot, "/reset")
            await pilot.pause(0.05)
            assert app.conversation.messages == [] and app.transcript.messages() == []
            await type_and_send(pilot, "/set max_tokens=99")
            await type_and_send(pilot, f"/load {path}")
            await pilot.pause(0.05)
            assert app.conversation.messages == saved and app.conversation.system == "You tell short stories."
            assert [(m.role, m.raw) for m in app.transcript.messages()] == [(m["role"], m["content"]) for m in saved]
            assert app.sampling.max_tokens == 12  # the saved settings come back too
            await type_and_send(pilot, f"/load {tmp_path / 'nope.json'}")
            assert app.notices[-1][0] == "error" and "does not exist" in app.notices[-1][1]
            assert app.conversation.messages == saved  # a failed load changes nothing

    asyncio.run(go())


def test_input_history_and_multiline(llm):
    async def go():
        app = ChatApp(lambda: llm, sampling=GREEDY)
        async with app.run_test(size=SIZE) as pilot:
            await ready(pilot)
            box = app.query_one(PromptInput)
            for cmd in ("/system a", "/system b"):
                await type_and_send(pilot, cmd)
            await pilot.press(*"dra")
            await pilot.press("up")
            assert box.text == "/system b"
            await pilot.press("up")
            assert box.text == "/system a"
            await pilot.press("down")
            assert box.text == "/system b"
            await pilot.press("down")
            assert box.text == "dra"  # the unfinished draft comes back
            box.text = ""
            await pilot.press("x", "ctrl+j", "y")
            assert box.text == "x\ny"
            await pilot.press("backslash", "enter", "z")
            assert box.text == "x\ny\nz"

    asyncio.run(go())


def test_errors_are_notices_and_the_app_stays_usable(llm, tmp_path):
    async def bad_model():
        from llmsys import LLM

        app = ChatApp(lambda: LLM(str(tmp_path / "no-such-model"), progress=False))
        async with app.run_test(size=SIZE) as pilot:
            await ready(pilot)
            assert app.load_error and "Traceback" not in app.load_error
            assert app.transcript.messages()[-1].role == "error"
            await type_and_send(pilot, "hello")
            assert "cannot generate" in app.notices[-1][1]
            await type_and_send(pilot, "/help")  # still answers
            assert "/reset" in app.transcript.messages()[-1].raw

    async def context_full():
        app = ChatApp(lambda: llm, sampling=GREEDY)
        async with app.run_test(size=SIZE) as pilot:
            await ready(pilot)
            await type_and_send(pilot, "Once upon a time " * 150)  # > 512 tokens
            await wait_for(pilot, lambda: app.generating is None and app.notices, what="the error")
            sev, text = app.notices[-1]
            assert sev == "error" and "512" in text
            assert app.conversation.messages == []  # the failed turn is not kept
            await type_and_send(pilot, "Once upon a time")
            await wait_for(pilot, lambda: len(app.conversation.messages) == 2, what="a normal reply")

    asyncio.run(bad_model())
    asyncio.run(context_full())


def test_panel_refresh_costs_under_five_percent_of_decode(llm):
    """Everything the live panel costs (building snapshots on the engine thread,
    updating and rendering the widgets on the UI thread) against decode time."""

    async def go():
        app = ChatApp(lambda: llm, sampling=SamplingParams(max_tokens=300, temperature=0.0, ignore_eos=True), refresh_hz=4)
        async with app.run_test(size=SIZE) as pilot:
            await ready(pilot)
            await send_and_wait_reply(pilot, "Once upon a time")
            c = app.worker.costs
            panel_s = c.snapshot_s + app.panel.update_s + app.panel.render_s
            return panel_s, c.decode_s, app.panel.updates

    panel_s, decode_s, updates = asyncio.run(go())
    assert updates >= 2
    # per refresh, against the decode time between two refreshes (300 stories260k tokens now decode in ~0.15 s,
    # so the whole reply holds about one 0.25 s refresh period and the first render's fixed cost)
    per_refresh = panel_s / updates
    assert per_refresh / 0.25 < 0.05, f"panel {per_refresh * 1000:.1f} ms a refresh vs 250 ms between refreshes"


def test_snapshot_reads_an_offload_plan(llm):
    class Placement:
        def __init__(self, kind):
            self.kind = kind
            self.tier = {"cpu->gpu": "cpu"}.get(kind, kind)

    class Plan:
        layers = [Placement("gpu")] * 2 + [Placement("cpu->gpu")] * 3
        staging = {"gpu": 4096}
        activations = {"gpu": 1024}

    class WithPlan:
        plan = Plan()
        loaded, config, max_model_len = llm.loaded, llm.config, llm.max_model_len

        def memory_report(self):
            return llm.memory_report()

    snap = snapshot_from_engine(WithPlan(), {"gpu": None, "cpu": 1 << 30, "disk": None})
    assert snap.layer_tiers == ("gpu", "gpu", "cpu", "cpu", "cpu") and snap.layer_streamed == (False, False, True, True, True)
    assert snap.plan_phrase == "layers 0-1 GPU, 2-4 CPU->CPU streamed"  # device is CPU here
    # workspace: the engine's own staging buffers (none: nothing streams here), as /metrics says, not the plan's estimate
    assert snap.tier("gpu").workspace == llm.memory_report().staging.get("gpu", 0) == 0


# -- plain REPL and monitor ----------------------------------------------------------


def test_plain_repl(llm, tmp_path):
    out = io.StringIO()
    path = tmp_path / "r.json"
    script = f"/set max_tokens=20\nOnce upon a time\n/save {path}\n/bogus\n"
    rc = run_repl(llm, SamplingParams(max_tokens=5, temperature=0.0), stdin=io.StringIO(script), stdout=out)
    assert rc == 0
    ref = reference(llm, "Once upon a time", SamplingParams(max_tokens=20, temperature=0.0))
    text = out.getvalue()
    assert ref in text and "unknown command /bogus" in text
    assert json.loads(path.read_text())["messages"][1]["content"] == ref


class _Metrics(BaseHTTPRequestHandler):
    tokens = 0

    def do_GET(self):  # noqa: N802
        if self.path != "/metrics":
            self.send_error(404)
            return
        type(self).tokens += 50
        body = (
            "llmsys_requests_running 1\nllmsys_requests_waiting 4\n"
            'llmsys_kv_blocks_used{tier="cpu"} 7\nllmsys_kv_blocks_total{tier="cpu"} 32\n'
            'llmsys_weight_bytes{tier="cpu"} 520080\n'
            f"llmsys_generation_tokens_total {type(self).tokens}\n"
        ).encode()
        self.send_response(200)
        self.send_header("Content-Type", "text/plain")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *a):
        pass


def test_monitor_reads_server_metrics():
    srv = ThreadingHTTPServer(("127.0.0.1", 0), _Metrics)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    url = f"http://127.0.0.1:{srv.server_address[1]}"

    async def go():
        app = MonitorApp(url, interval=0.05)
        async with app.run_test(size=SIZE) as pilot:
            await wait_for(pilot, lambda: app.scrapes >= 3, what="scrapes")
            snap = app.panel.snapshot
            cpu = snap.tier("cpu")
            assert (cpu.kv_blocks_used, cpu.kv_blocks_total, cpu.weights) == (7, 32, 520080)
            assert (snap.requests_running, snap.requests_waiting) == (1, 4)
            assert snap.tok_s is not None and snap.tok_s > 0 and snap.per_request_tok_s == snap.tok_s
            figures = app.panel.figures_text
            assert "1 running · 4 queued" in figures and "evicted    n/a" in figures

        down = MonitorApp("http://127.0.0.1:9", interval=0.05)  # nothing listens on port 9
        async with down.run_test(size=SIZE) as pilot:
            await wait_for(pilot, lambda: down.last_error is not None, what="the error")
            assert down.is_running

    try:
        asyncio.run(go())
    finally:
        srv.shutdown()


# -- resize, speed, sparkline, /retry /copy /info, the panel toggle ------------------


def rendered_text(widget) -> str:
    """What the widget draws, as plain text (every cell of its region)."""
    strips = widget.render_lines(Region(0, 0, widget.size.width, widget.size.height))
    return "\n".join("".join(seg.text for seg in strip) for strip in strips)


def at_end(transcript) -> bool:
    return transcript.max_scroll_y > 0 and transcript.scroll_y == transcript.max_scroll_y


def test_layout_reflows_on_resize_and_keeps_the_end_in_view(llm):
    async def go():
        app = ChatApp(lambda: llm, sampling=GREEDY)
        async with app.run_test(size=(160, 48)) as pilot:
            await ready(pilot)
            for _ in range(3):
                await send_and_wait_reply(pilot, "Once upon a time")
            await type_and_send(pilot, "/help")
            await pilot.pause(0.2)
            tr = app.transcript
            assert app.screen.has_class("-wide")
            assert app.panel.display and app.panel.outer_size.width == 46
            assert at_end(tr), (tr.scroll_y, tr.max_scroll_y)
            before = tr.max_scroll_y

            await pilot.resize_terminal(100, 30)
            await pilot.pause(0.3)
            assert app.screen.has_class("-medium")
            assert app.panel.display and app.panel.outer_size.width == 34  # narrowed, not hidden
            assert tr.max_scroll_y > before and at_end(tr), (tr.scroll_y, tr.max_scroll_y)  # still at the end after rewrapping
            assert app.panel.region.right <= 100
            status = app.status.text
            assert status.endswith("/help · Ctrl+Q quit") and cell_len(status) <= app.status.content_size.width
            help_msg = tr.messages()[-1]
            assert "Ctrl+Q" in help_msg.raw and help_msg.region.right <= tr.region.right  # the help is inside the chat column
            # every figure of the panel fits its width (wrapped at the separators, not cut)
            figures = app.panel.query_one("#panel-figures")
            assert max(cell_len(x) for x in rendered_text(figures).splitlines()) <= figures.size.width
            assert "TTFT" in rendered_text(figures)

            await pilot.resize_terminal(80, 30)
            await pilot.pause(0.3)
            assert app.screen.has_class("-narrow") and not app.panel.display  # hidden when too narrow
            assert at_end(tr)

            # a reader who scrolled up is not pulled back to the end by a resize
            tr.scroll_home(animate=False)
            await pilot.pause(0.1)
            await pilot.resize_terminal(160, 48)
            await pilot.pause(0.3)
            assert tr.scroll_y == 0 and tr.max_scroll_y > 0
            assert app.panel.display and app.panel.outer_size.width == 46

    asyncio.run(go())


def test_panel_toggle_key(llm):
    async def go():
        app = ChatApp(lambda: llm, sampling=GREEDY)
        async with app.run_test(size=(160, 48)) as pilot:
            await ready(pilot)
            chat = app.query_one("#chat")
            wide = chat.outer_size.width
            await pilot.press("ctrl+b")
            await pilot.pause(0.1)
            assert not app.panel.display and chat.outer_size.width == 160
            await pilot.resize_terminal(100, 30)  # the choice holds across a resize
            await pilot.pause(0.2)
            assert not app.panel.display
            await pilot.resize_terminal(160, 48)
            await pilot.pause(0.2)
            await pilot.press("ctrl+b")
            await pilot.pause(0.1)
            assert app.panel.display and chat.outer_size.width == wide
            await pilot.resize_terminal(80, 30)  # too narrow: hidden, but Ctrl+B shows it
            await pilot.pause(0.2)
            assert not app.panel.display
            await pilot.press("ctrl+b")
            await pilot.pause(0.1)
            assert app.panel.display and app.panel.region.right <= 80
            await type_and_send(pilot, "/help")
            assert "Ctrl+B" in app.transcript.messages()[-1].raw

    asyncio.run(go())


def test_speed_after_a_reply_is_that_replys_speed(llm):
    done = []

    class Recording(ChatApp):
        async def on_generation_done(self, msg: GenerationDone) -> None:
            done.append(msg)
            await super().on_generation_done(msg)

    async def go():
        # refresh every 10 s: the reply ends before any live speed window, which
        # used to leave the panel at "n/a"
        app = Recording(lambda: llm, sampling=SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True), refresh_hz=0.1)
        async with app.run_test(size=SIZE) as pilot:
            await ready(pilot)
            assert "speed      n/a tok/s" in app.panel.figures_text  # nothing measured yet
            await send_and_wait_reply(pilot, "Once upon a time")
            await pilot.pause(0.1)
            snap = app.panel.snapshot
            assert not snap.generating and snap.tok_s is not None and snap.tok_s > 0
            assert snap.tok_s == pytest.approx(done[-1].decode_tok_s)  # the engine's own decode timing
            m = re.search(r"speed      ([0-9.]+) tok/s", app.panel.figures_text)
            assert m and float(m.group(1)) == pytest.approx(snap.tok_s, abs=0.05)

    asyncio.run(go())


def test_sparkline_is_blank_without_data(llm):
    async def go():
        app = ChatApp(lambda: llm, sampling=SamplingParams(max_tokens=300, temperature=0.0, ignore_eos=True), refresh_hz=20)
        async with app.run_test(size=SIZE) as pilot:
            await ready(pilot)
            spark = app.panel.query_one(SpeedSparkline)
            assert spark.size.width > 10 and spark.size.height == 2
            assert rendered_text(spark).strip() == ""  # no data: nothing drawn
            spark.data = [42.0]
            await pilot.pause(0.05)
            one = rendered_text(spark)
            assert "█" not in one and one.strip()  # one value: a flat line, not a solid block
            await send_and_wait_reply(pilot, "Once upon a time")
            await pilot.pause(0.1)
            assert len(app.panel.snapshot.tok_s_history) >= 2
            assert rendered_text(spark).strip()  # real data draws bars

    asyncio.run(go())


def test_retry_copy_and_info(llm):
    prompt = "Once upon a time"
    out = llm.generate(prompt, GREEDY)[0]
    ref, n_context = out.text, len(out.prompt_token_ids) + len(out.token_ids)

    async def go():
        app = ChatApp(lambda: llm, sampling=GREEDY)
        async with app.run_test(size=SIZE) as pilot:
            await ready(pilot)
            await type_and_send(pilot, "/retry")
            assert "nothing to retry" in app.notices[-1][1]
            await type_and_send(pilot, "/copy")
            assert "nothing to copy" in app.notices[-1][1] and app.clipboard == ""
            await send_and_wait_reply(pilot, prompt)
            old = app.transcript.messages()[-1]
            assert old.raw == ref
            await type_and_send(pilot, "/retry")
            await wait_for(pilot, lambda: app.generating is None, timeout=60, what="the new reply")
            await pilot.pause(0.05)
            shown = app.transcript.messages()
            assert [m.role for m in shown] == ["user", "assistant"] and shown[1] is not old
            assert app._gen_ids == 2  # a second generation ran
            # generated from the same user turn alone: the greedy reply to the prompt, once
            assert app.conversation.messages == [{"role": "user", "content": prompt}, {"role": "assistant", "content": ref}]
            assert shown[1].raw == ref

            await type_and_send(pilot, "/copy")
            assert app.clipboard == ref and "copied" in app.notices[-1][1]

            await type_and_send(pilot, "/info")
            info = app.transcript.messages()[-1].raw
            assert app.info.name in info and "stories260k-hf" in info
            assert f"{n_context} / {llm.max_model_len} tokens used" in info  # prompt + reply tokens
            assert "Hugging Face safetensors, float32" in info and "all 5 layers resident on CPU" in info

            await type_and_send(pilot, "/reset")
            await pilot.pause(0.2)
            await type_and_send(pilot, "/info")
            assert f"0 / {llm.max_model_len} tokens used" in app.transcript.messages()[-1].raw

    asyncio.run(go())


def test_plain_repl_help_retry_copy_info(llm, tmp_path):
    out = io.StringIO()
    path = tmp_path / "r.json"
    params = SamplingParams(max_tokens=20, temperature=0.0)
    gen = llm.generate("Once upon a time", params)[0]
    ref = gen.text
    script = f"/help\n/retry\nOnce upon a time\n/retry\n/copy\n/info\n/save {path}\n"
    assert run_repl(llm, params, stdin=io.StringIO(script), stdout=out, model_name="stories260k-hf") == 0
    text = out.getvalue()
    help_part = text[: text.index("nothing to retry")]
    assert "Ctrl+D" in help_part and "Ctrl+C" in help_part and "/retry" in help_part
    for key in ("Ctrl+Q", "Esc", "Ctrl+J", "Ctrl+B"):
        assert key not in help_part
    assert text.count(ref) == 2  # the reply, then the retried one
    assert json.loads(path.read_text())["messages"] == [{"role": "user", "content": "Once upon a time"}, {"role": "assistant", "content": ref}]
    osc = "\x1b]52;c;" + base64.b64encode(ref.encode()).decode() + "\a"
    assert osc in text
    assert "model      stories260k-hf" in text
    n_ctx = re.search(r"context    (\d+) / (\d+) tokens used", text)
    assert n_ctx and int(n_ctx.group(2)) == llm.max_model_len
    assert int(n_ctx.group(1)) == len(gen.prompt_token_ids) + len(gen.token_ids)  # prompt + reply tokens


def test_tui_help_lists_the_apps_keys(llm):
    async def go():
        app = ChatApp(lambda: llm, sampling=GREEDY)
        async with app.run_test(size=SIZE) as pilot:
            await ready(pilot)
            await type_and_send(pilot, "/help")
            raw = app.transcript.messages()[-1].raw
            assert all(k in raw for k in ("Ctrl+Q", "Esc", "Ctrl+J", "Ctrl+B", "/retry", "/copy", "/info"))
            assert "Ctrl+D" not in raw

    asyncio.run(go())
