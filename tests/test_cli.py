"""The `llmsys` console script as a user runs it (real subprocesses)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest

from conftest import CORPUS, STORIES_HF, need_shared

ENV = dict(os.environ, OMP_NUM_THREADS="1")


def llmsys(*args: str, timeout: int = 120, **kw) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "llmsys.engine.cli.main", *args],
        capture_output=True, text=True, timeout=timeout, env=kw.pop("env", ENV), **kw,
    )


def test_run_streams_story_and_prints_stats():
    need_shared(STORIES_HF)
    r = llmsys("run", str(STORIES_HF), "Once upon a time", "--temperature", "0", "-n", "30", "--dtype", "float32")
    assert r.returncode == 0, r.stderr
    assert r.stdout.startswith(", there was a little girl named Lily")
    assert "prompt 5 tok" in r.stderr and "generated 30 tok" in r.stderr and "decode" in r.stderr


@pytest.mark.parametrize(
    "args, needle",
    [
        (("run", "/no/such/model", "hi"), "no such file or directory: /no/such/model"),
        (("run", "{stories}", "hi", "--temperature", "-1"), "temperature"),
        (("run", "{stories}", "hi", "--top-p", "0"), "top_p"),
        (("run", "{stories}", "hi", "--dtype", "float8"), "dtype"),
        (("run", "{stories}", "Once " * 600, "--dtype", "float32"), "512"),
        (("run", "llama-3.1-8b-instruct", "hi", "--no-pull"), "llmsys pull"),
        (("perplexity", "{stories}", "/no/such/file.txt"), "no such text file"),
    ],
)
def test_errors_are_one_line_with_exit_2(args, needle):
    need_shared(STORIES_HF)
    args = tuple(a.replace("{stories}", str(STORIES_HF)) for a in args)
    r = llmsys(*args)
    assert r.returncode == 2, (r.stdout, r.stderr)
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and needle.lower() in lines[0].lower(), r.stderr
    assert "Traceback" not in r.stderr


def test_debug_env_shows_traceback():
    r = llmsys("run", "/no/such/model", "hi", env=dict(ENV, LLMSYS_DEBUG="1"))
    assert r.returncode != 0 and "Traceback" in r.stderr


def test_perplexity_reports_tokens_scored():
    need_shared(STORIES_HF)
    r = llmsys("perplexity", str(STORIES_HF), str(CORPUS / "tinystories-valid.txt"), "--ctx", "128",
               "--limit", "2000", "--dtype", "float32")
    assert r.returncode == 0, r.stderr
    words = r.stdout.split()
    ppl = float(words[words.index("perplexity") + 1])
    assert 3.0 < ppl < 7.0  # stories260k is in-domain on TinyStories (fp32 ~4.6)
    assert "tokens scored 2000" in r.stdout


def test_ctrl_c_stops_cleanly_and_keeps_the_text():
    need_shared(STORIES_HF)
    p = subprocess.Popen(
        [sys.executable, "-m", "llmsys.engine.cli.main", "run", str(STORIES_HF), "Once upon a time",
         "--temperature", "0", "-n", "100000", "--ignore-eos", "--dtype", "float32", "--max-model-len", "512",
         "--kv-policy", "sink:4,window:256"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=ENV,
        # Ctrl-C's default: a suite started in the background (`cmd &` in a script) inherits SIGINT ignored, and
        # Python then installs no KeyboardInterrupt handler: the run went on to its end and exited 0
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    )
    # wait for the first streamed bytes, then interrupt at once. The KV policy lets the run go on past its
    # 512-token context, so it cannot end before the interrupt whatever the speed (~1700-2900 tok/s on a Zen 5)
    first = p.stdout.read(10)
    time.sleep(0.02)
    p.send_signal(signal.SIGINT)
    out, err = p.communicate(timeout=60)
    assert first.startswith(", there")
    assert p.returncode == 130, err
    assert "interrupted after" in err and "Traceback" not in err


def test_models_lists_catalog():
    r = llmsys("models")
    assert r.returncode == 0
    for name in ("stories260k", "Qwen2.5-0.5B-Instruct", "Llama-3.2-1B-Instruct", "Mistral-7B-Instruct-v0.3"):
        assert name.lower() in r.stdout.lower()


def test_context_full_is_said_not_silent():
    need_shared(STORIES_HF)
    r = llmsys("run", str(STORIES_HF), "Once upon a time", "--temperature", "0", "-n", "1000", "--ignore-eos",
               "--dtype", "float32", "--max-model-len", "40")
    assert r.returncode == 0, r.stderr
    assert "finish length" in r.stderr and "context full: 40 of 40 tokens" in r.stderr
