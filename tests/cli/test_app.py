"""The command line: commands listed, user errors as one line with a non-zero exit.

The first test starts ``python -m refusion_cli`` as a user's shell does; the others call the same entry
point in-process (``main``, with ``sys.argv`` and the streams captured), which is what the process runs. A
user error in a process of its own, its stderr exactly the one line: tests/models/test_device.py.
"""

import os
import subprocess
import sys

import pytest

from refusion_cli.cli.output import DEBUG_ENV
from tests.envs import cache_env


def refusion(*args: str) -> subprocess.CompletedProcess:
    env = {"PATH": "/usr/bin:/bin", "HF_HUB_OFFLINE": "1", **cache_env()}
    return subprocess.run([sys.executable, "-m", "refusion_cli", *args], capture_output=True, text=True, env=env,
                          timeout=120)


@pytest.fixture
def main_of(monkeypatch, capsys):
    """``main_of(*args, env_debug=False)``: ``refusion ARGS`` through the console entry point, in-process, as a
    CompletedProcess (exit code, stdout, stderr)."""
    from refusion_cli.cli.app import main

    def run(*args: str, env_debug: bool = False) -> subprocess.CompletedProcess:
        monkeypatch.delenv(DEBUG_ENV, raising=False)
        if env_debug:
            monkeypatch.setenv(DEBUG_ENV, "1")
        monkeypatch.setattr(sys, "argv", ["refusion", *args])
        with pytest.raises(SystemExit) as exit_info:
            main()
        out = capsys.readouterr()
        os.environ.pop(DEBUG_ENV, None)  # main sets it for --debug; monkeypatch would put it back at teardown
        return subprocess.CompletedProcess(["refusion", *args], exit_info.value.code, out.out, out.err)

    return run


def test_help_lists_the_commands():
    out = refusion("--help")
    assert out.returncode == 0
    for command in ("chat", "eval", "bench", "train"):
        assert f" {command} " in out.stdout


def test_a_user_error_is_one_line_without_traceback(main_of):
    out = main_of("bench", "--tps", "--gen-length", "0")
    assert out.returncode == 2
    assert out.stderr.startswith("error:") and "Traceback" not in out.stderr
    assert len(out.stderr.splitlines()) == 1
    assert out.stdout == ""


def test_debug_shows_the_traceback_and_keeps_the_exit_code(main_of):
    for out in (main_of("bench", "--tps", "--gen-length", "0", "--debug"),
                main_of("bench", "--tps", "--gen-length", "0", env_debug=True)):
        assert out.returncode == 2 and "Traceback" in out.stderr
        assert out.stderr.splitlines()[-1].startswith("error: ")
    out = main_of("bench", "--tps", "--bogus", "--debug")
    assert out.returncode == 2 and "Traceback" in out.stderr
    assert out.stderr.splitlines()[-1].startswith("error: No such option: --bogus")


def test_unknown_command_is_one_clear_error(main_of):
    out = main_of("frobnicate")
    assert out.returncode == 2 and "Traceback" not in out.stderr
    assert out.stderr.splitlines() == ["error: No such command 'frobnicate'. (hint: refusion --help lists the commands)"]


def test_option_parser_errors_are_one_line_too(main_of):
    out = main_of("train", "--objective", "foo", "--data", "x", "--output", "y")
    assert out.returncode == 2 and out.stdout == ""
    assert out.stderr.splitlines() == ["error: Invalid value for '--objective': 'foo' is not one of 'refusion', "
                                       "'ar', 'llada', 'dream'. (hint: refusion train --help lists the options)"]
    out = main_of("bench", "--tps", "--xyzzy")
    assert out.returncode == 2
    assert out.stderr.splitlines() == ["error: No such option: --xyzzy (hint: refusion bench --help lists the options)"]


def test_no_command_shows_the_help(main_of):
    out = main_of()
    assert out.returncode == 2 and "Usage: refusion" in out.stdout + out.stderr


def test_an_empty_path_is_refused_not_taken_for_the_working_directory(tmp_path, monkeypatch, capsys):
    """`Path("")` is ".": `refusion train --output ""` would have put a run's checkpoints in the working directory."""
    from refusion_cli.cli.app import main

    monkeypatch.chdir(tmp_path)
    (tmp_path / "train.jsonl").write_text('{"question": "1 + 1?", "answer": "#### 2"}\n')
    for option, args in (("--output", ["--data", "train.jsonl", "--output", ""]),
                         ("--data", ["--data", "", "--output", "run"])):
        monkeypatch.setattr(sys, "argv", ["refusion", "train", "--init", "tiny", "--tokenizer", "refusion-tiny",
                                          "--steps", "1", *args])
        with pytest.raises(SystemExit) as exit_info:
            main()
        err = capsys.readouterr().err
        assert exit_info.value.code == 2 and err.splitlines() == [
            f"error: Invalid value for '{option}': the path is empty (use '.' for the working directory) "
            "(hint: refusion train --help lists the options)"]
        assert [path.name for path in tmp_path.iterdir()] == ["train.jsonl"]


def test_libraries_a_block_imports_are_frozen_out_of_the_collectors_scans(tmp_path, monkeypatch):
    """What a command imports lives as long as the process: a full collection then scans only what the command
    made (a bench row's memory window collects once: 0.3 s each before, in a sweep of 74 rows)."""
    import gc

    from refusion_cli.cli.libraries import libraries_imported

    (tmp_path / "fresh_library.py").write_text("TABLE = [{'entry': i} for i in range(1000)]\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, "fresh_library", raising=False)
    frozen = gc.get_freeze_count()
    with libraries_imported():
        assert not gc.isenabled()
        import fresh_library
    assert gc.isenabled() and gc.get_freeze_count() >= frozen + len(fresh_library.TABLE)
    frozen = gc.get_freeze_count()
    with libraries_imported():
        import fresh_library  # noqa: F811  (imported before: nothing new to freeze)
    assert gc.get_freeze_count() == frozen
    gc.disable()
    try:
        with libraries_imported():
            pass
        assert not gc.isenabled()  # the collector's state before the block is kept
    finally:
        gc.enable()
