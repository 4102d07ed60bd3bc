"""`llmsys run` as an Ollama user expects it: chat template by default, a conversation without a prompt,
`--chat-template`, `-n -1`, Ctrl-C as one line, `/bye`, short help, a port in use as one line.

Real subprocesses on the shared models (the SmolLM2 instruct GGUF where the template matters).
"""

from __future__ import annotations

import io
import os
import signal
import socket
import subprocess
import sys
import time

import pytest

from conftest import SHARED, STORIES_C, STORIES_HF, need_shared

SMOLLM2 = SHARED / "models" / "smollm2-135m-instruct" / "SmolLM2-135M-Instruct.Q4_1.gguf"
QUESTION = "What is the capital of France?"
ENV = dict(os.environ, OMP_NUM_THREADS="1", COLUMNS="100")
KNOWN = "chatml, llama3, gemma, phi3, zephyr, llama2, mistral, vicuna, alpaca"


def _sigint_default() -> None:
    # a suite started in the background inherits SIGINT ignored, and Python then installs no handler
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def llmsys(*args: str, timeout: int = 180, **kw) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "llmsys.engine.cli.main", *args], capture_output=True, text=True,
                          timeout=timeout, env=kw.pop("env", ENV), **kw)


def stats_line(stderr: str) -> str:
    return next(line for line in stderr.splitlines() if line.startswith("prompt "))


def one_error_line(r: subprocess.CompletedProcess) -> str:
    lines = r.stderr.strip().splitlines()
    assert r.returncode == 2 and len(lines) == 1, (r.returncode, r.stderr)
    assert lines[0].startswith("error: ") and "Traceback" not in r.stderr
    return lines[0]


def smollm2_tokens(messages: list[dict] | None = None, text: str | None = None, template: str | None = None) -> int:
    from llmsys.engine.tokenizer import Tokenizer
    from llmsys.engine.chat_template import resolve_chat_template

    tok = Tokenizer.load(SMOLLM2, chat_template=resolve_chat_template(template) if template else None)
    return len(tok.encode_chat(messages) if messages is not None else tok.encode(text))


# --------------------------------------------------------------------------
# chat by default
# --------------------------------------------------------------------------


def test_run_answers_through_the_models_template():
    """The instruct model's own template (chatml) renders the question: the prompt is the 37-token conversation
    (its default system message included), the reply is text, and the stats line names the template."""
    need_shared(SMOLLM2)
    r = llmsys("run", str(SMOLLM2), QUESTION, "-n", "12", "--temperature", "0")
    assert r.returncode == 0, r.stderr
    stats = stats_line(r.stderr)
    n = smollm2_tokens([{"role": "user", "content": QUESTION}])
    assert f"prompt {n} tok" in stats and n > 30
    assert stats.endswith("| chat template: chatml"), stats
    assert "generated 12 tok" in stats and len(r.stdout.strip()) > 10, r.stdout  # not the single EOS of raw mode


def test_raw_is_the_plain_completion():
    need_shared(SMOLLM2)
    r = llmsys("run", str(SMOLLM2), QUESTION, "-n", "4", "--temperature", "0", "--raw")
    assert r.returncode == 0, r.stderr
    stats = stats_line(r.stderr)
    assert f"prompt {smollm2_tokens(text=QUESTION)} tok" in stats and stats.endswith("| raw"), stats


def test_system_message_goes_through_the_template():
    need_shared(SMOLLM2)
    r = llmsys("run", str(SMOLLM2), QUESTION, "--system", "Answer in one word.", "-n", "2", "--temperature", "0")
    assert r.returncode == 0, r.stderr
    n = smollm2_tokens([{"role": "system", "content": "Answer in one word."}, {"role": "user", "content": QUESTION}])
    assert f"prompt {n} tok" in stats_line(r.stderr)


def test_a_model_without_template_stays_raw_and_says_so():
    need_shared(STORIES_C)
    r = llmsys("run", str(STORIES_C), "Once upon a time", "-n", "8", "--temperature", "0")
    assert r.returncode == 0, r.stderr
    assert stats_line(r.stderr).endswith("| raw (the model has no chat template; --chat-template FILE|NAME gives one)")
    line = one_error_line(llmsys("run", str(STORIES_C), "Once upon a time", "--chat"))
    assert "has no chat template" in line and KNOWN in line and "drop --chat" in line


@pytest.mark.parametrize("args, needle", [
    (("--chat", "--raw"), "--chat and --raw exclude each other"),
    (("--raw", "--system", "Be brief."), "--system goes through the chat template, which --raw turns off"),
])
def test_contradictory_flags_are_one_line(args, needle):
    need_shared(STORIES_C)
    assert needle in one_error_line(llmsys("run", str(STORIES_C), "hi", *args))


def test_system_without_a_template_is_one_line():
    need_shared(STORIES_C)
    line = one_error_line(llmsys("run", str(STORIES_C), "hi", "--system", "Be brief."))
    assert "--system needs a chat template" in line and "--chat-template" in line


# --------------------------------------------------------------------------
# --chat-template FILE|NAME
# --------------------------------------------------------------------------


def test_chat_template_name_on_a_base_model():
    """A family name gives a template-less model one; the prompt is that family's rendering."""
    need_shared(STORIES_C)
    from llmsys.engine.chat_template import resolve_chat_template
    from llmsys.engine.tokenizer import Tokenizer

    r = llmsys("run", str(STORIES_C), "Tell a story", "--chat-template", "zephyr", "-n", "4", "--temperature", "0")
    assert r.returncode == 0, r.stderr
    tok = Tokenizer.load(STORIES_C)
    rendered = resolve_chat_template("zephyr").render([{"role": "user", "content": "Tell a story"}],
                                                      special_tokens=tok.special_tokens)
    assert rendered == "<|user|>\nTell a story</s>\n<|assistant|>\n"
    stats = stats_line(r.stderr)
    assert f"prompt {len(tok.encode(rendered, add_special_tokens=False))} tok" in stats
    assert stats.endswith("| chat template: zephyr"), stats


def test_chat_template_file_replaces_the_models_own(tmp_path):
    need_shared(SMOLLM2)
    f = tmp_path / "terse.jinja"
    f.write_text("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
                 "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
    r = llmsys("run", str(SMOLLM2), QUESTION, "--chat-template", str(f), "-n", "2", "--temperature", "0")
    assert r.returncode == 0, r.stderr
    stats = stats_line(r.stderr)
    n = smollm2_tokens([{"role": "user", "content": QUESTION}], template=str(f))
    assert n < smollm2_tokens([{"role": "user", "content": QUESTION}])  # no default system message: not the own
    assert f"prompt {n} tok" in stats and stats.endswith("| chat template: terse.jinja"), stats


@pytest.mark.parametrize("command", ["run", "chat", "serve"])
def test_chat_template_errors_are_one_line(command, tmp_path):
    need_shared(STORIES_C)
    extra = ("hi",) if command == "run" else ("--plain",) if command == "chat" else ("--port", "0")
    line = one_error_line(llmsys(command, str(STORIES_C), *extra, "--chat-template", "chatm1", "--no-pull"))
    assert "--chat-template 'chatm1' is neither a file nor a known template name" in line and KNOWN in line
    missing = tmp_path / "nope.jinja"
    line = one_error_line(llmsys(command, str(STORIES_C), *extra, "--chat-template", str(missing), "--no-pull"))
    assert f"--chat-template {missing}: does not exist" in line


def test_family_end_of_turn_stops_generation():
    """chatml given to the instruct model: <|im_end|> (one token there) ends a reply, not only the file's EOS."""
    need_shared(SMOLLM2)
    from llmsys.engine.chat_template import resolve_chat_template
    from llmsys.engine.tokenizer import Tokenizer

    tok = Tokenizer.load(SMOLLM2, chat_template=resolve_chat_template("chatml"))
    assert tok.convert_tokens_to_ids("<|im_end|>") in tok.eos_token_ids
    assert tok.default_chat_template.label == "chatml"
    own = Tokenizer.load(SMOLLM2)
    assert own.default_chat_template.label == "chatml"  # recognised from the file's own text
    assert own.default_chat_template.source != tok.default_chat_template.source


def test_configs_naming_one_template_are_equal():
    """Each config compiles its own template; configs are still compared by what they render."""
    from llmsys.engine.config import EngineConfig

    a, b = (EngineConfig(model="m", chat_template="chatml") for _ in range(2))
    assert a.chat_template is not b.chat_template and a == b
    assert a != EngineConfig(model="m", chat_template="llama3") and a != EngineConfig(model="m")


def test_every_family_renders_a_conversation():
    from llmsys.engine.chat_template import TEMPLATE_FAMILIES, resolve_chat_template, template_family

    conv = [{"role": "system", "content": "SYS"}, {"role": "user", "content": "Q1"},
            {"role": "assistant", "content": "A1"}, {"role": "user", "content": "Q2"}]
    for fam in TEMPLATE_FAMILIES:
        text = resolve_chat_template(fam.name).render(conv, special_tokens={"bos_token": "<s>", "eos_token": "</s>"})
        assert all(t in text for t in ("SYS", "Q1", "A1", "Q2")), fam.name
        assert text.index("Q1") < text.index("A1") < text.index("Q2"), fam.name
        assert fam.end_of_turn in text and template_family(fam.source) == fam.name, fam.name


def test_server_config_carries_the_template():
    """--chat-template reaches the engine through EngineConfig: what the server and the TUI load."""
    need_shared(STORIES_HF)
    from llmsys import LLM

    llm = LLM(str(STORIES_HF), dtype="float32", chat_template="chatml", progress=False)
    assert llm.config.chat_template.name == "chatml"
    ids = llm.tokenizer.encode_chat([{"role": "user", "content": "hi"}])
    assert llm.tokenizer.decode(ids, skip_special_tokens=False).startswith("<|im_start|>user\nhi<|im_end|>")


def test_server_renders_with_the_given_template():
    """What `llmsys serve --chat-template chatml` loads (an LLM of the config the flags make): a base model answers
    /v1/chat/completions through chatml, where without it the same request is a 400 (no chat template)."""
    need_shared(STORIES_HF)
    import httpx

    from llmsys import LLM
    from llmsys.engine.config import EngineConfig
    from llmsys.engine.server.serve import start_server_thread
    from llmsys.engine.server.state import ServerSettings, ServerState

    body = {"model": "stories260k-hf", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2,
            "temperature": 0}
    servers = []
    try:
        for template in ("chatml", None):
            state = ServerState(ServerSettings())
            llm = LLM(EngineConfig(model=str(STORIES_HF), dtype="float32", chat_template=template, progress=False))
            state.attach(llm, "stories260k-hf")
            servers.append(start_server_thread(state))
        with_template, without = (httpx.post(srv.url + "/v1/chat/completions", json=body, timeout=60)
                                  for srv in servers)
        assert without.status_code == 400 and without.json()["error"]["code"] == "no_chat_template", without.text
        assert with_template.status_code == 200, with_template.text
        from llmsys.engine.tokenizer import Tokenizer

        tok = Tokenizer.load(STORIES_HF)
        expected = len(tok.encode("<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n", add_special_tokens=False))
        assert with_template.json()["usage"]["prompt_tokens"] == expected
    finally:
        for srv in servers:
            srv.stop()


# --------------------------------------------------------------------------
# -n -1
# --------------------------------------------------------------------------


def test_n_minus_one_runs_until_the_context_is_full():
    need_shared(STORIES_C)
    r = llmsys("run", str(STORIES_C), "Once upon a time", "-n", "-1", "--ignore-eos", "--max-model-len", "48",
               "--temperature", "0")
    assert r.returncode == 0, r.stderr
    stats = stats_line(r.stderr)
    assert "finish length" in stats and "context full: 48 of 48 tokens" in r.stderr, r.stderr


@pytest.mark.parametrize("n", ["0", "-2"])
def test_other_non_positive_n_is_one_line(n):
    need_shared(STORIES_C)
    line = one_error_line(llmsys("run", str(STORIES_C), "hi", "-n", n))
    assert f"--max-tokens/-n must be >= 1, or -1 for until EOS or the context is full; got {n}" in line
    assert "None" not in line


# --------------------------------------------------------------------------
# no PROMPT: the REPL; /bye and /exit
# --------------------------------------------------------------------------


class Terminal:
    """``llmsys`` with stdin and stdout on a pseudo-terminal (the REPL opens only at a terminal); stderr a pipe."""

    def __init__(self, *args: str):
        import pty

        self.master, slave = pty.openpty()
        self.proc = subprocess.Popen([sys.executable, "-m", "llmsys.engine.cli.main", *args], stdin=slave,
                                     stdout=slave, stderr=subprocess.PIPE, text=True, env=ENV,
                                     preexec_fn=_sigint_default, close_fds=True)
        os.close(slave)
        self.seen = ""

    def read_until(self, marker: str, timeout: float = 120.0) -> str:
        """Everything shown since the last call, up to and including ``marker``."""
        import select

        start = len(self.seen)
        deadline = time.monotonic() + timeout
        while marker not in self.seen[start:]:
            ready, _, _ = select.select([self.master], [], [], max(0.0, deadline - time.monotonic()))
            assert ready, f"no {marker!r} within {timeout} s; shown: {self.seen[start:]!r}"
            try:
                chunk = os.read(self.master, 4096)
            except OSError:  # the process ended: its side closed
                chunk = b""
            assert chunk, f"the process ended before {marker!r}; shown: {self.seen[start:]!r}"
            self.seen += chunk.decode("utf-8", "replace").replace("\r\n", "\n")
        end = self.seen.index(marker, start) + len(marker)
        shown, self.seen = self.seen[start:end], self.seen[:end] + self.seen[end:]
        return shown

    def type(self, line: str) -> None:
        os.write(self.master, (line + "\n").encode())

    def finish(self, timeout: float = 60.0) -> tuple[int, str]:
        try:
            err = self.proc.communicate(timeout=timeout)[1]
        finally:
            os.close(self.master)
        return self.proc.returncode, err


def test_run_without_prompt_opens_a_conversation():
    """At a terminal, `llmsys run FILE` is a conversation: the banner names the template, each entry is a user turn
    answered in the context of the ones before, /bye ends it (exit 0)."""
    need_shared(SMOLLM2)
    t = Terminal("run", str(SMOLLM2), "-n", "6", "--temperature", "0")
    banner = t.read_until("> ")
    assert "llmsys chat (chat template chatml, context " in banner and "/bye" in banner, banner
    t.type(QUESTION)
    first = t.read_until("> ")
    t.type("And of Italy?")
    second = t.read_until("> ")
    t.type("/bye")
    rc, err = t.finish()
    assert rc == 0 and "Traceback" not in err, err
    for shown, asked in ((first, QUESTION), (second, "And of Italy?")):
        reply = shown.split(asked, 1)[1].removesuffix("> ").strip()
        assert reply, shown  # an answer, not the single EOS of raw mode


def test_run_without_prompt_raw_is_completion_mode():
    need_shared(STORIES_C)
    t = Terminal("run", str(STORIES_C), "--raw", "-n", "4")
    assert "llmsys chat (completion mode, " in t.read_until("> ")
    t.type("/exit")
    assert t.finish()[0] == 0


def test_piped_stdin_is_the_prompt():
    """As `ollama run`: no PROMPT with stdin piped in answers that text once (no banner, no REPL)."""
    need_shared(SMOLLM2)
    r = llmsys("run", str(SMOLLM2), "-n", "4", "--temperature", "0", input=QUESTION + "\n")
    assert r.returncode == 0, r.stderr
    n = smollm2_tokens([{"role": "user", "content": QUESTION + "\n"}])
    assert f"prompt {n} tok" in stats_line(r.stderr) and "llmsys chat" not in r.stdout
    assert "nothing on stdin" in one_error_line(llmsys("run", str(SMOLLM2), input=""))


@pytest.mark.parametrize("word", ["/bye", "/exit", "/quit", "/BYE"])
def test_bye_and_exit_end_the_repl(word):
    need_shared(STORIES_HF)
    from llmsys import LLM
    from llmsys.engine.sampling import SamplingParams
    from llmsys.tui.commands import parse_command
    from llmsys.tui.repl import run_repl

    assert parse_command(word).name == "quit"
    llm = LLM(str(STORIES_HF), dtype="float32", kv_cache_tokens=256, progress=False)
    out = io.StringIO()
    rc = run_repl(llm, SamplingParams(max_tokens=3, temperature=0.0), stdin=io.StringIO(f"{word}\n/help\n"), stdout=out)
    assert rc == 0 and "Commands:" not in out.getvalue()  # nothing after the quit word was read


def test_bye_takes_no_argument_and_is_in_help():
    from llmsys.kernels.common.errors import InvalidParameterError
    from llmsys.tui.commands import PLAIN_KEYS, help_text, parse_command

    with pytest.raises(InvalidParameterError, match="takes no arguments"):
        parse_command("/bye now")
    assert "/bye" in help_text(PLAIN_KEYS) and "/exit" in help_text(PLAIN_KEYS)


# --------------------------------------------------------------------------
# Ctrl-C
# --------------------------------------------------------------------------


# What a shell reports as 130: exit(130), or the death by SIGINT that CPython's Py_RunMain chooses after
# finalizing when it counted a KeyboardInterrupt as unhandled (seen now and then for one raised mid-import,
# though llmsys caught it and said "interrupted"; POSIX's own convention for a Ctrl-C'd process).
INTERRUPTED = (130, -signal.SIGINT)


def _in_torch(pid: int) -> bool:
    """Has the process begun importing torch (its library mapped)? From then on llmsys's own code runs:
    before, a Ctrl-C lands in the interpreter's start-up (site packages), which no program can catch."""
    try:
        with open(f"/proc/{pid}/maps") as f:
            return "libtorch" in f.read()
    except OSError:
        return True  # ended (the assertions then say how)


def _interrupt(args: list[str], after: float | None = None, wait_for: str | None = None,
               stdin: str | None = None) -> subprocess.CompletedProcess:
    p = subprocess.Popen([sys.executable, "-m", "llmsys.engine.cli.main", *args], stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, stdin=subprocess.PIPE if stdin is not None else subprocess.DEVNULL,
                         text=True, env=ENV, preexec_fn=_sigint_default)
    if stdin is not None:
        p.stdin.write(stdin)
        p.stdin.flush()
    if wait_for is not None:  # read stdout until the marker: the process is at that point
        seen = ""
        while wait_for not in seen:
            c = p.stdout.read(1)
            assert c, f"the process ended before {wait_for!r}: {seen!r}"
            seen += c
    else:
        while not _in_torch(p.pid):
            time.sleep(0.005)
        time.sleep(after)
    p.send_signal(signal.SIGINT)
    out, err = p.communicate(timeout=120)
    return subprocess.CompletedProcess(p.args, p.returncode, out, err)


@pytest.mark.skipif(not os.path.isdir("/proc/self"), reason="finds the moment torch is imported in /proc/PID/maps")
@pytest.mark.parametrize("after", [0.0, 0.2, 0.5, 1.0, 2.0, 3.5])
def test_ctrl_c_during_start_up_is_one_line(after):
    """Whenever it comes after the interpreter started (importing torch and the engine, loading, prefill, decode:
    seconds after torch's import began), Ctrl-C is one line on stderr and exit 130."""
    need_shared(SMOLLM2)
    r = _interrupt(["run", str(SMOLLM2), QUESTION, "-n", "100000", "--ignore-eos", "--kv-policy", "sink:4,window:64",
                    "--max-model-len", "128"], after=after)
    lines = [line for line in r.stderr.splitlines() if line.strip()]
    assert r.returncode in INTERRUPTED, (after, r.returncode, r.stderr)
    assert len(lines) == 1 and "Traceback" not in r.stderr, (after, r.stderr)
    assert lines[0] == "interrupted" or lines[0].startswith("interrupted after "), lines


def test_ctrl_c_during_decode_keeps_the_text():
    need_shared(SMOLLM2)
    r = _interrupt(["run", str(SMOLLM2), QUESTION, "-n", "100000", "--ignore-eos", "--kv-policy", "sink:4,window:64",
                    "--max-model-len", "128", "--temperature", "0"], wait_for=" ")
    assert r.returncode in INTERRUPTED and r.stderr.strip().startswith("interrupted after "), r.stderr
    assert len(r.stderr.strip().splitlines()) == 1


def test_ctrl_c_at_the_repl_prompt_is_one_line():
    need_shared(STORIES_C)
    t = Terminal("run", str(STORIES_C))
    t.read_until("> ")
    # readline waits in select() for a key; a signal in the microseconds between the prompt and that wait is only
    # seen at the next key (CPython's readline), a window no typist hits but a test would: let it start waiting
    time.sleep(0.3)
    t.proc.send_signal(signal.SIGINT)
    rc, err = t.finish()
    assert rc in INTERRUPTED and err.strip() == "interrupted", err


def test_ctrl_c_during_a_repl_reply_stops_only_that_reply():
    need_shared(STORIES_C)
    t = Terminal("run", str(STORIES_C), "-n", "100000", "--ignore-eos", "--kv-policy", "sink:4,window:64",
                 "--max-model-len", "128")
    t.read_until("> ")
    t.type("Once upon a time")
    t.read_until("Once upon a time\n")  # the terminal's echo
    t.read_until(" ")  # the reply is streaming
    t.proc.send_signal(signal.SIGINT)
    assert "[stopped]" in t.read_until("> ")
    t.type("/bye")
    rc, err = t.finish()
    assert rc == 0 and "Traceback" not in err, err


def test_ctrl_c_inside_a_command_is_one_line(monkeypatch, capsys):
    """typer turns a KeyboardInterrupt into a silent Exit(130); main says it (the load phase, in process)."""
    need_shared(STORIES_C)
    import llmsys.engine.llm as llm_module
    from llmsys.engine.cli.main import main

    def interrupted_load(*a, **k):
        raise KeyboardInterrupt

    monkeypatch.setattr(llm_module, "LLM", interrupted_load)
    assert main(["run", str(STORIES_C), "hi"]) == 130
    assert capsys.readouterr().err.strip() == "interrupted"


# --------------------------------------------------------------------------
# help, perplexity, a port in use
# --------------------------------------------------------------------------


def test_run_help_keeps_engine_flags_in_their_own_panel_last():
    r = llmsys("run", "--help")
    assert r.returncode == 0
    lines = r.stdout.splitlines()
    panels = [line.split("─ ")[1].split(" ─")[0] for line in lines if line.startswith("╭─ ")]
    assert panels == ["Arguments", "Options", "Sampling", "Engine"], panels
    head = lines[:next(i for i, line in enumerate(lines) if line.startswith("╭─ Sampling"))]
    assert len(head) < 40 and not any("--kv-policy" in line or "--device" in line for line in head)
    assert any("--raw" in line for line in head) and any("--chat-template" in line for line in head)


def test_perplexity_help_mentions_gguf():
    r = llmsys("perplexity", "--help")
    assert r.returncode == 0 and ".gguf" in r.stdout and "GGUF" in r.stdout


def test_port_in_use_is_one_line():
    need_shared(STORIES_C)
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        port = holder.getsockname()[1]
        r = llmsys("serve", str(STORIES_C), "--port", str(port), "--no-pull")
    line = one_error_line(r)
    assert f"port {port} on 127.0.0.1 is in use" in line and "--port N" in line, line
    assert "ready" not in r.stdout  # refused before the model was loaded


@pytest.mark.parametrize("word", ["/bye", "/exit"])
def test_bye_and_exit_quit_the_chat_app(word):
    """The Textual app quits on the REPL's words as on Ctrl+Q (its engine thread stopped)."""
    need_shared(STORIES_HF)
    import asyncio

    from llmsys import LLM
    from llmsys.tui.app import ChatApp
    from llmsys.tui.prompt_input import PromptInput

    llm = LLM(str(STORIES_HF), dtype="float32", kv_cache_tokens=256, progress=False)

    async def go() -> bool:
        app = ChatApp(lambda: llm)
        async with app.run_test(size=(100, 30)) as pilot:
            t0 = time.monotonic()
            while app.info is None and time.monotonic() - t0 < 30:
                await pilot.pause(0.05)
            app.query_one(PromptInput).text = word
            await pilot.press("enter")
            t0 = time.monotonic()
            while app.is_running and time.monotonic() - t0 < 10:
                await pilot.pause(0.05)
            return app.is_running

    assert asyncio.run(go()) is False
