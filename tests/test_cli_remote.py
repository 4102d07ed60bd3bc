"""``llmsys run`` / ``chat --plain`` through a running ``llmsys serve`` (engine/remote.py).

A real server subprocess on the SmolLM2 instruct GGUF serves on a free port; the client commands find it
through ``$LLMSYS_HOST``. Greedy output through the server must be the tokens ``--local`` makes.
"""

from __future__ import annotations

import inspect
import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

from llmsys.engine import remote
from tests.conftest import SHARED

SMOLLM = SHARED / "models" / "smollm2-135m-instruct" / "SmolLM2-135M-Instruct.Q4_1.gguf"
STATS = re.compile(r"^prompt (\d+) tok \| generated (\d+) tok \| ttft \d+ ms \| prefill [\d.]+ tok/s \| "
                   r"decode [\d.]+ tok/s \| finish (\w+) \| (.+)$", re.M)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _env(host: str | None) -> dict[str, str]:
    env = dict(os.environ, OMP_NUM_THREADS="1")
    env.pop(remote.HOST_ENV, None)
    if host is not None:
        env[remote.HOST_ENV] = host
    return env


def llmsys(*args: str, host: str | None, timeout: int = 180) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "llmsys.engine.cli.main", *args], capture_output=True, text=True,
                          timeout=timeout, env=_env(host), stdin=subprocess.DEVNULL)


def _get(url: str) -> tuple[int, bytes]:
    try:
        with urllib.request.urlopen(url, timeout=5) as r:
            return r.status, r.read()
    except urllib.error.HTTPError as e:
        return e.code, e.read()
    except OSError:
        return 0, b""


@pytest.fixture(scope="module")
def server():
    """``host:port`` of an ``llmsys serve`` on the SmolLM2 GGUF (one sequence at a time: a slot left busy shows)."""
    if not SMOLLM.exists():
        pytest.skip(f"{SMOLLM} is absent: the SmolLM2 instruct GGUF lives in ../shared/models")
    port = _free_port()
    log = open(Path(os.environ.get("TMPDIR", "/tmp")) / f"llmsys-remote-test-{port}.log", "w")
    p = subprocess.Popen([sys.executable, "-m", "llmsys.engine.cli.main", "serve", str(SMOLLM), "--port", str(port),
                          "--kv-disk", "0", "--max-num-seqs", "1"], stdout=log, stderr=subprocess.STDOUT,
                         env=_env(None))
    host = f"127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 180
        while not remote.answers(remote.server_address(host), timeout=1.0):
            if p.poll() is not None or time.monotonic() > deadline:
                pytest.fail(f"llmsys serve did not come up (exit {p.poll()}); see {log.name}")
            time.sleep(0.3)
        yield host
    finally:
        p.send_signal(signal.SIGINT)
        try:
            p.wait(30)
        except subprocess.TimeoutExpired:
            p.kill()
        log.close()


def test_default_address_is_where_serve_listens():
    from llmsys.engine.cli.serve_cmd import serve_command

    params = inspect.signature(serve_command).parameters
    assert params["port"].default == remote.DEFAULT_PORT
    assert params["host"].default == remote.DEFAULT_HOST


@pytest.mark.parametrize("given,expect", [
    ("127.0.0.1:9000", "http://127.0.0.1:9000"),
    ("http://localhost:1234", "http://localhost:1234"),
    ("https://example.org", "https://example.org:443"),
    ("somehost", "http://somehost:8000"),
    ("[::1]:9000", "http://[::1]:9000"),
])
def test_server_address_forms(given, expect):
    assert remote.server_address(given).url == expect


@pytest.mark.parametrize("bad", ["ftp://h:1", "h:99999", "h:port", "http://h:1/some/path"])
def test_bad_server_address_is_one_line(bad):
    with pytest.raises(remote.RemoteError) as e:
        remote.server_address(bad)
    assert "--host" in str(e.value) and "\n" not in str(e.value)


def test_env_gives_the_address(monkeypatch):
    monkeypatch.setenv(remote.HOST_ENV, "10.1.2.3:7777")
    assert remote.server_address().url == "http://10.1.2.3:7777"
    assert remote.server_address("127.0.0.1:1").port == 1  # --host wins


def test_probe_of_a_silent_listener_gives_up_at_its_timeout():
    """A port that accepts but never answers (a hung process, another program) is 'no server', not a hang."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen(1)
        addr = remote.ServerAddress("127.0.0.1", s.getsockname()[1])
        assert remote.answers(addr, timeout=0.2) is False
    assert remote.answers(addr, timeout=0.2) is False  # closed: refused


def test_request_body_maps_the_sampling_flags():
    from llmsys.engine.cli.options import SAMPLING_PARAMS

    values = {p.name: p.default for p in SAMPLING_PARAMS}
    values.update(max_tokens=-1, temperature=0.0, top_k=5, stop=["\n\n"], seed=3)
    body = remote.request_body("m", values, prompt="x")
    assert "max_tokens" not in body  # -1: until EOS or the context
    assert body["temperature"] == 0.0 and body["top_k"] == 5 and body["stop"] == ["\n\n"] and body["seed"] == 3
    assert body["stream"] is True and body["prompt"] == "x"
    # every sampling flag the CLI has reaches the request (or is knowingly left out: max_tokens -1)
    assert set(values) - set(body) == {"max_tokens"}


def test_run_through_the_server_is_local_greedy(server):
    args = ("run", str(SMOLLM), "Name three colours.", "-n", "24", "--temperature", "0")
    via = llmsys(*args, host=server)
    here = llmsys(*args, "--local", host=server)
    assert via.returncode == 0 and here.returncode == 0, via.stderr + here.stderr
    assert f"using the llmsys server at http://{server} (--local runs in-process)" in via.stderr
    assert "using the llmsys server" not in here.stderr
    assert via.stdout == here.stdout and via.stdout.strip()
    a, b = STATS.search(via.stderr), STATS.search(here.stderr)
    assert a and b, via.stderr + here.stderr
    assert a.groups() == b.groups()  # prompt and generated tokens, finish, "chat template: chatml"
    assert a.group(4) == "chat template: chatml"


def test_raw_through_the_server_is_local_greedy(server):
    args = ("run", str(SMOLLM), "The capital of France is", "--raw", "-n", "16", "--temperature", "0")
    via = llmsys(*args, host=server)
    here = llmsys(*args, "--local", host=server)
    assert via.returncode == 0 and here.returncode == 0, via.stderr + here.stderr
    assert "using the llmsys server" in via.stderr
    assert via.stdout == here.stdout
    assert STATS.search(via.stderr).groups() == STATS.search(here.stderr).groups()
    assert STATS.search(via.stderr).group(4) == "raw"


def test_engine_flags_run_locally_with_one_line(server):
    r = llmsys("run", str(SMOLLM), "Hi", "-n", "4", "--temperature", "0", "--kv-dtype", "int8", host=server)
    assert r.returncode == 0, r.stderr
    assert "--kv-dtype configure an engine of this process: running locally" in r.stderr
    assert "using the llmsys server" not in r.stderr


def test_a_model_nobody_knows_is_one_error_line(server):
    missing = "no-such-model-anywhere:7b"
    r = llmsys("run", missing, "Hi", "-n", "4", "--no-pull", host=server)
    assert r.returncode == 2 and "Traceback" not in r.stderr
    errors = [ln for ln in r.stderr.splitlines() if ln.startswith("error:")]
    assert len(errors) == 1 and missing in errors[0], r.stderr


def test_server_404_falls_back_to_this_process(server, monkeypatch, capsys):
    """A name this process resolves but the server does not serve: one line, then the local run (stubbed)."""
    from llmsys.engine.cli import run_cmd

    monkeypatch.setattr(run_cmd.remote, "RemoteStream", _NotServed)
    rv = run_cmd._run_remote(remote.server_address(server), str(SMOLLM), "Hi", run_cmd.PromptMode.AUTO, None,
                             {"max_tokens": 2})
    assert rv is None  # the caller runs it in this process
    err = capsys.readouterr().err
    assert f"the llmsys server at http://{server} does not serve {SMOLLM}" in err and "running in this process" in err


class _NotServed:
    def __init__(self, *a, **kw):
        raise remote.RemoteError("model 'x' not found", 404, "model_not_found")


def test_dead_host_falls_back_with_one_line():
    if not SMOLLM.exists():
        pytest.skip(f"{SMOLLM} is absent: the SmolLM2 instruct GGUF lives in ../shared/models")
    dead = f"127.0.0.1:{_free_port()}"
    r = llmsys("run", str(SMOLLM), "Hi", "-n", "4", "--temperature", "0", host=dead)
    assert r.returncode == 0, r.stderr
    assert f"no llmsys server answers at http://{dead}: running in this process" in r.stderr
    assert STATS.search(r.stderr)


def test_client_path_imports_no_torch(server):
    code = ("import sys; from llmsys.engine.cli.main import main; "
            f"rc = main(['run', {str(SMOLLM)!r}, 'Hi', '-n', '4', '--temperature', '0']); "
            "print('\\nRC', rc, 'torch' in sys.modules, 'numpy' in sys.modules, 'llmsys.engine.llm' in sys.modules)")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, env=_env(server))
    assert "using the llmsys server" in r.stderr, r.stderr
    assert r.stdout.strip().splitlines()[-1] == "RC 0 False False False", r.stdout + r.stderr


def _running(host: str) -> int:
    status, body = _get(f"http://{host}/health")
    return json.loads(body)["running"] if status == 200 else -1


def test_ctrl_c_closes_the_stream_and_frees_the_slot(server):
    p = subprocess.Popen([sys.executable, "-m", "llmsys.engine.cli.main", "run", str(SMOLLM), "Tell a long story.",
                          "-n", "4000", "--ignore-eos", "--temperature", "0"],
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=_env(server),
                         stdin=subprocess.DEVNULL, preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    first = p.stdout.read(8)
    assert _running(server) == 1  # the request holds the server's one slot
    p.send_signal(signal.SIGINT)
    out, err = p.communicate(timeout=60)
    assert first
    assert p.returncode == 130, err
    assert "interrupted after" in err and "Traceback" not in err
    deadline = time.monotonic() + 20
    while _running(server) != 0 and time.monotonic() < deadline:
        time.sleep(0.2)
    assert _running(server) == 0
    # and the freed slot serves the next request at once (--max-num-seqs 1)
    r = llmsys("run", str(SMOLLM), "Hi", "-n", "3", "--temperature", "0", host=server)
    assert r.returncode == 0 and STATS.search(r.stderr), r.stderr


def test_plain_chat_repl_through_the_server(server):
    p = subprocess.run([sys.executable, "-m", "llmsys.engine.cli.main", "chat", str(SMOLLM), "--plain", "-n", "12",
                        "--temperature", "0"], input="Name a fruit.\n/info\n/bye\n", capture_output=True, text=True,
                       timeout=120, env=_env(server))
    assert p.returncode == 0, p.stderr
    assert f"served by http://{server}" in p.stdout
    assert "loaded: " in p.stdout and "resident" in p.stdout  # /info: the server's /api/ps
    assert "using the llmsys server" in p.stderr
    # the reply is the one `run` gets for the same single turn
    r = llmsys("run", str(SMOLLM), "Name a fruit.", "-n", "12", "--temperature", "0", host=server)
    assert r.stdout.strip() and r.stdout.strip() in p.stdout


def test_server_error_is_one_line(server):
    r = llmsys("run", str(SMOLLM), "Hi", "--top-p", "0", host=server)  # SamplingParams refuses it locally too
    assert r.returncode != 0
    assert "Traceback" not in r.stderr
    errors = [ln for ln in r.stderr.splitlines() if ln.startswith("error:")]
    assert len(errors) == 1 and "top_p" in errors[0], r.stderr


def test_stream_close_mid_reply_is_seen_by_the_server(server):
    """The client function itself: closing a stream after its first chunk leaves the slot free."""
    addr = remote.server_address(server)
    body = remote.request_body(str(SMOLLM), {"max_tokens": 4000, "temperature": 0.0, "ignore_eos": True},
                               prompt="Once upon a time")
    stream = remote.RemoteStream(addr, "/v1/completions", body)
    it = iter(stream)
    assert next(it).text is not None
    stream.close()
    deadline = time.monotonic() + 20
    while _running(server) != 0 and time.monotonic() < deadline:
        time.sleep(0.2)
    assert _running(server) == 0
