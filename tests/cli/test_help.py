"""The help: every command's fits 100 columns with its option names whole, ``-h`` is ``--help``, ``--version``
prints the version, and ``refusion --help`` / ``refusion bench --help`` import neither torch nor the libraries
behind it (the commands' modules load when a command runs)."""

from __future__ import annotations

import json
import re
import subprocess
import sys

import pytest
import typer

from refusion_cli import __version__
from refusion_cli.cli.app import COMMANDS, app, load_command

HEAVY = ("torch", "transformers", "lm_eval")
HELP_COMMANDS = [name for name in COMMANDS if name != "lm-eval"]  # lm-eval's help is lm-eval's own


@pytest.fixture
def run_app(monkeypatch, capsys):
    """``run_app(*args)``: ``refusion ARGS`` in this process at 100 columns; its exit code and stdout."""

    def run(*args: str) -> tuple[int, str]:
        monkeypatch.setenv("COLUMNS", "100")
        monkeypatch.delenv("TERMINAL_WIDTH", raising=False)
        try:
            code = app(args=list(args), prog_name="refusion", standalone_mode=False)
        except SystemExit as exc:  # pragma: no cover (click exits only in standalone mode)
            code = exc.code
        return code or 0, capsys.readouterr().out

    return run


@pytest.mark.parametrize("command", ["", *HELP_COMMANDS])
def test_the_help_fits_100_columns_with_every_option_name_whole(command, run_app):
    args = [command, "--help"] if command else ["--help"]
    code, out = run_app(*args)
    assert code == 0
    assert "…" not in out and "<bool>" not in out
    assert all(len(line) <= 100 for line in out.splitlines())
    group = typer.main.get_command(app)
    params = load_command(command).params if command else group.params
    names = [name for param in params if not getattr(param, "hidden", False) and param.param_type_name == "option"
             for name in (*param.opts, *param.secondary_opts)]
    assert names
    for name in names:  # whole: followed by a space, a comma or the panel's edge, never cut short
        assert re.search(re.escape(name) + r"(?=[ ,│\n])", out), name


@pytest.mark.parametrize("command", ["", *HELP_COMMANDS])
def test_dash_h_is_help(command, run_app):
    args = [command] if command else []
    assert run_app(*args, "-h") == run_app(*args, "--help")


def test_version_prints_the_package_version(run_app):
    assert run_app("--version") == (0, f"refusion {__version__}\n")


def test_the_list_of_commands_says_what_each_command_says_of_itself():
    for name, entry in COMMANDS.items():
        assert load_command(name).help.split("\n\n")[0].strip() == entry.summary, name


def test_the_help_names_the_registry_decoders_and_the_bench_defaults(run_app):
    from refusion_cli.bench.runner import DEFAULT_GEN_LENGTH
    from refusion_cli.cli.options import DECODER_NAMES
    from refusion_cli.decoding.registry import DECODERS

    assert DECODER_NAMES == ", ".join(DECODERS)
    assert f"(default {DEFAULT_GEN_LENGTH})" in " ".join(run_app("bench", "--help")[1].split())


def test_help_imports_neither_torch_nor_transformers_nor_lm_eval():
    """In a fresh process, as a user's shell starts it: `refusion --help` and `refusion bench --help`."""
    script = (
        "import contextlib, io, json, sys, time\n"
        "start = time.perf_counter()\n"
        "from refusion_cli.cli.app import app\n"
        "for args in (['--help'], ['bench', '--help'], ['-h']):\n"
        "    with contextlib.redirect_stdout(io.StringIO()):\n"
        "        app(args=args, prog_name='refusion', standalone_mode=False)\n"
        f"print(json.dumps([[m for m in {HEAVY!r} if m in sys.modules], time.perf_counter() - start]))\n")
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    imported, seconds = json.loads(out.stdout.splitlines()[-1])
    assert imported == [], f"--help imported {imported} ({seconds:.2f} s)"
