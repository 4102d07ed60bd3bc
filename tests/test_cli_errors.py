"""Usage errors of the `llmsys` CLI: one `error:` line, one --help hint, exit 2, no traceback.

The commands and their options are discovered from the Typer app after
registration, so a new command (or a new numeric option) is covered without
editing this file. None of these runs loads a model: click rejects the
arguments while parsing, before a command body runs (a model path of "x"
would otherwise fail differently, with a "no such file" error).
"""

from __future__ import annotations

import importlib.metadata
import os
import shutil
import subprocess
import sys
import typing

import pytest
import typer

import llmsys
from llmsys.engine.cli.main import build_app, click_errors, main

KNOWN_COMMANDS = {"run", "chat", "serve", "bench", "plan", "perplexity", "quantize", "models", "pull", "monitor"}


def _commands() -> dict[str, typing.Any]:
    return dict(typer.main.get_command(build_app()).commands)


def _options(command) -> list[typing.Any]:
    return [p for p in command.params if p.param_type_name == "option"]


def _long_flag(param) -> str | None:
    return next((o for o in param.opts if o.startswith("--")), None)


def _required_args(command) -> list[str]:
    return ["x" for p in command.params if p.param_type_name == "argument" and p.required]


def _is_number_option(param) -> bool:
    """An int/float option, read from standalone click's ``type`` or typer's bundled click annotation."""
    if param.param_type_name != "option" or getattr(param, "is_flag", False):
        return False
    click_type = getattr(param, "type", None)
    if click_type is not None:  # typer on the standalone click package
        return getattr(click_type, "name", "").split(" ")[0] in ("integer", "float")
    annotation = param.type_descriptor.annotation  # typer >= 0.16 (typer._click)
    return any(t in (int, float) for t in (annotation, *typing.get_args(annotation)))


def _typo(flag: str) -> str:
    """Swap the last two letters: --temperature -> --temperatuer (close enough for click's suggestion)."""
    return flag[:-2] + flag[-1] + flag[-2]


def _typo_cases() -> list[tuple[str, str, list[str]]]:
    cases = []
    for name, command in _commands().items():
        flags = [f for f in map(_long_flag, _options(command)) if f] or ["--help"]
        valid = {o for p in _options(command) for o in (*p.opts, *p.secondary_opts)} | {"--help"}
        flag = next(f for f in flags if _typo(f) not in valid)
        cases.append((name, flag, [name, _typo(flag), *_required_args(command)]))
    return cases


def _bad_type_cases() -> list[tuple[str, str, list[str]]]:
    cases = []
    for name, command in _commands().items():
        number = next((p for p in _options(command) if _is_number_option(p) and _long_flag(p)), None)
        if number is not None:
            flag = _long_flag(number)
            cases.append((name, flag, [name, flag, "abc", *_required_args(command)]))
    return cases


def _missing_arg_cases() -> list[str]:
    return [name for name, command in _commands().items() if _required_args(command)]


def _assert_usage_error(rc: int, out: str, err: str, command: str | None, needle: str) -> str:
    """Exit 2, nothing on stdout, exactly `error: ...` + the hint on stderr; returns the error line."""
    assert rc == 2, (out, err)
    assert "Traceback" not in out + err, err
    assert out == "", out
    lines = err.splitlines()
    hint = f"Try 'llmsys {command} --help' for help." if command else "Try 'llmsys --help' for help."
    assert len(lines) == 2 and lines[0].startswith("error: ") and lines[1] == hint, err
    assert needle in lines[0], err
    return lines[0]


def test_discovery_sees_every_command():
    assert KNOWN_COMMANDS <= set(_commands())
    # every command but `models`/`pull` has a numeric option to feed a bad value
    assert {c for c, _, _ in _bad_type_cases()} >= KNOWN_COMMANDS - {"models", "pull"}


@pytest.mark.parametrize("command, flag, argv", _typo_cases(), ids=lambda v: v if isinstance(v, str) else None)
def test_typoed_flag_is_one_line_with_the_suggestion(command, flag, argv, capsys):
    rc = main(argv)
    out, err = capsys.readouterr()
    line = _assert_usage_error(rc, out, err, command, f"No such option: {_typo(flag)}")
    assert flag in line.removeprefix(f"error: No such option: {_typo(flag)}"), line  # click's suggestion kept


@pytest.mark.parametrize("command, flag, argv", _bad_type_cases(), ids=lambda v: v if isinstance(v, str) else None)
def test_bad_value_type_is_one_line(command, flag, argv, capsys):
    rc = main(argv)
    out, err = capsys.readouterr()
    line = _assert_usage_error(rc, out, err, command, "Invalid value for")
    assert flag in line, line


@pytest.mark.parametrize("command", _missing_arg_cases())
def test_missing_argument_is_one_line(command, capsys):
    rc = main([command])
    out, err = capsys.readouterr()
    _assert_usage_error(rc, out, err, command, "Missing argument")


def test_unknown_command_is_one_line(capsys):
    rc = main(["bogus"])
    out, err = capsys.readouterr()
    _assert_usage_error(rc, out, err, None, "No such command 'bogus'")


def test_unknown_top_level_option_is_one_line(capsys):
    rc = main(["--verison"])
    out, err = capsys.readouterr()
    _assert_usage_error(rc, out, err, None, "No such option: --verison")


@pytest.mark.parametrize("flag", ["--version", "-V"])
def test_version(flag, capsys):
    assert main([flag]) == 0
    out, err = capsys.readouterr()
    assert out == f"llmsys {importlib.metadata.version('llmsys')}\n" and err == ""


def test_version_falls_back_to_the_package_when_not_installed(monkeypatch, capsys):
    def not_installed(name: str) -> str:
        raise importlib.metadata.PackageNotFoundError(name)

    monkeypatch.setattr(importlib.metadata, "version", not_installed)
    assert main(["--version"]) == 0
    assert capsys.readouterr().out == f"llmsys {llmsys.__version__}\n"


def test_no_args_shows_help(capsys):
    assert main([]) == 0
    out, err = capsys.readouterr()
    assert "Usage" in out and "Traceback" not in out + err
    assert all(name in out for name in KNOWN_COMMANDS) and "--version" in out


def test_debug_env_raises_the_usage_error(monkeypatch):
    monkeypatch.setenv("LLMSYS_DEBUG", "1")
    with pytest.raises(click_errors().usage):
        main(["run", "--temprature", "0", "x"])


def test_click_errors_match_what_typer_raises():
    errors = click_errors()
    assert issubclass(typer.BadParameter, errors.usage)
    assert typer.Exit in errors.exit and typer.Abort in errors.abort
    try:
        import click
    except ImportError:
        return
    assert issubclass(click.UsageError, errors.usage)  # the standalone click too, when installed


def _entry_points() -> list[list[str]]:
    points = [[sys.executable, "-m", "llmsys.engine.cli.main"]]
    script = shutil.which("llmsys", path=os.path.dirname(sys.executable) + os.pathsep + os.environ.get("PATH", ""))
    if script:
        points.append([script])
    return points


@pytest.mark.parametrize("entry", _entry_points(), ids=lambda e: "console-script" if len(e) == 1 else "python-m")
def test_real_entry_point_gives_the_same_two_lines(entry):
    r = subprocess.run([*entry, "run", "--temprature", "0", "x"], capture_output=True, text=True, timeout=120,
                       env=dict(os.environ, OMP_NUM_THREADS="1"))
    line = _assert_usage_error(r.returncode, r.stdout, r.stderr, "run", "No such option: --temprature")
    assert "--temperature" in line
