"""Decode speed of the chat app (``llmsys chat``) beside ``llmsys run`` on the same prompt.

The app should cost the decode loop nothing noticeable: its screen, its memory panel and
its engine thread share the process (and the GIL) with the model. Each round runs ``llmsys
run --chat`` and the chat app, one after the other (interleaved, so drift on a shared
machine hits both alike), at each thread count; the figure is the median over rounds of
the engine's own decode tok/s (prefill excluded) for the same greedy reply length.

The app runs for real: a child process draws it on a pseudo-terminal (the parent reads
and discards the escape codes as a terminal would), Textual's ``auto_pilot`` types the
prompt, and the child prints the finished reply's decode speed. ``run`` is timed by its
own stats line. Run it alone on the machine (or under a lock shared with other timings)::

    python benchmarks/chat_vs_run.py MODEL.gguf --threads 1 2 --rounds 3 --tokens 200

``--old-tui DIR`` adds an older app to each round, on the same engine: DIR holds an older
``tui`` folder, e.g. ``mkdir /tmp/old && git archive REV tui | tar -x -C /tmp/old``.
"""

from __future__ import annotations

import argparse
import json
import os
import pty
import re
import select
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

PROMPT = "Write a long story about a cat who learns to sail."


def run_cli(model: str, threads: int, tokens: int) -> float:
    """``llmsys run --chat``'s decode tok/s, from its stats line."""
    cmd = [sys.executable, "-c", "from llmsys.engine.cli.main import main; main()", "run", model, "--chat", PROMPT, "-n", str(tokens), "--temp", "0",
           "--ignore-eos", "-t", str(threads)]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    m = re.search(r"decode ([\d.]+) tok/s", out.stdout + out.stderr)
    if out.returncode != 0 or m is None:
        raise SystemExit(f"llmsys run failed (rc {out.returncode}): {(out.stderr or out.stdout)[-400:]}")
    return float(m.group(1))


def run_chat(model: str, threads: int, tokens: int, old_tui: str | None = None,
             size: tuple[int, int] = (160, 48)) -> float:
    """The chat app's decode tok/s: a child draws it on a pseudo-terminal of ``size``."""
    master, slave = pty.openpty()
    import fcntl
    import struct
    import termios

    fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", size[1], size[0], 0, 0))
    env = dict(os.environ, TERM="xterm-256color", COLUMNS=str(size[0]), LINES=str(size[1]))
    fd, result = tempfile.mkstemp(prefix="chat_vs_run", suffix=".json")
    os.close(fd)
    # Textual draws on stderr: every stream goes to the terminal, the result to a file
    child = subprocess.Popen([sys.executable, __file__, "--child", model, "--threads", str(threads),
                              "--tokens", str(tokens), "--result", result, *(["--old-tui", old_tui] if old_tui else [])],
                             stdin=slave, stdout=slave, stderr=slave,
                             env=env, close_fds=True, start_new_session=True)
    os.close(slave)
    deadline = time.monotonic() + 300
    try:
        while child.poll() is None and time.monotonic() < deadline:  # drain the screen as a terminal would
            ready, _, _ = select.select([master], [], [], 0.1)
            if ready:
                try:
                    os.read(master, 1 << 16)
                except OSError:
                    break
    finally:
        if child.poll() is None:
            child.kill()
        os.close(master)
    child.wait()
    text = Path(result).read_text()
    Path(result).unlink()
    if not text:
        raise SystemExit(f"the chat app gave no result (rc {child.returncode})")
    got = json.loads(text)
    if got["completion_tokens"] != tokens:
        raise SystemExit(f"the chat app generated {got['completion_tokens']} tokens, not {tokens}")
    return float(got["decode_tok_s"])


def use_tui_from(folder: str) -> None:
    """Import ``llmsys.tui`` from ``folder``/tui instead of this checkout (the engine stays this one's)."""
    import importlib.util

    import llmsys

    tui = Path(folder) / "tui"
    spec = importlib.util.spec_from_file_location("llmsys.tui", tui / "__init__.py", submodule_search_locations=[str(tui)])
    mod = importlib.util.module_from_spec(spec)
    sys.modules["llmsys.tui"] = mod
    llmsys.tui = mod
    spec.loader.exec_module(mod)


def child(model: str, threads: int, tokens: int, result: str, old_tui: str | None) -> None:
    """Inside the pseudo-terminal: the real app, driven by auto_pilot; the result goes to ``result``."""
    if old_tui:
        use_tui_from(old_tui)
    from llmsys.engine.cli.options import build_engine_config
    from llmsys.engine.llm import LLM
    from llmsys.engine.sampling import SamplingParams
    from llmsys.tui.app import ChatApp
    from llmsys.tui.messages import GenerationDone

    done: list[GenerationDone] = []

    class Timed(ChatApp):
        async def on_generation_done(self, msg: GenerationDone) -> None:
            await super().on_generation_done(msg)
            done.append(msg)

    config = build_engine_config(model, {"threads": threads}).with_(progress=False)
    sampling = SamplingParams(max_tokens=tokens, temperature=0.0, ignore_eos=True)
    app = Timed(lambda: LLM(config), model_name=model, sampling=sampling)

    async def pilot(p) -> None:
        while app.info is None and app.load_error is None:
            await p.pause(0.1)
        if app.load_error:
            app.exit()
            return
        await app.send(PROMPT)
        while not done:
            await p.pause(0.1)
        await p.pause(0.3)  # the last frame drawn
        app.exit()

    app.run(auto_pilot=pilot)
    if done:
        d = done[0]
        Path(result).write_text(json.dumps({"decode_tok_s": d.decode_tok_s, "completion_tokens": d.completion_tokens}))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("model")
    ap.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--tokens", type=int, default=200)
    ap.add_argument("--old-tui", help="a folder holding an older tui/ to measure beside this one")
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--result", help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.child:
        child(a.model, a.threads[0], a.tokens, a.result, a.old_tui)
        return
    for t in a.threads:
        got: dict[str, list[float]] = {"run": [], "chat": []}
        if a.old_tui:
            got["chat (old tui)"] = []
        for i in range(a.rounds):
            got["run"].append(run_cli(a.model, t, a.tokens))
            if a.old_tui:
                got["chat (old tui)"].append(run_chat(a.model, t, a.tokens, a.old_tui))
            got["chat"].append(run_chat(a.model, t, a.tokens))
            print(f"threads {t} round {i + 1}: " + ", ".join(f"{k} {v[-1]:.1f}" for k, v in got.items()) + " tok/s",
                  flush=True)
        med = {k: statistics.median(v) for k, v in got.items()}
        print(f"threads {t}: median of {a.rounds}: " + ", ".join(f"{k} {v:.1f}" for k, v in med.items())
              + " tok/s; " + ", ".join(f"{k}/run {v / med['run']:.3f}" for k, v in med.items() if k != "run"), flush=True)

if __name__ == "__main__":
    main()
