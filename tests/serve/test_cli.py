"""``refusion serve``'s command line: a mistake is one ``error:`` line and exit code 2, before any model loads."""

from __future__ import annotations

import socket
import sys

import pytest

from refusion_cli.cli.app import main

BAD = [
    (["--decoder", "rnn"], "unknown decoder 'rnn'"),
    (["--model", "refusion-tiny", "--decoder", "llada"], "llada"),  # a causal model: llada does not fit it
    (["--decoder", "ar", "--recheck"], "--recheck"),
    (["--set", "slot_threshold=2"], "slot_threshold"),
    (["--set", "nope=1"], "nope"),
    (["--port", "70000"], "--port"),
    (["--max-batch", "0"], "--max-batch"),
    (["--api-key", " "], "--api-key is empty"),
    (["--max-memory", "lots"], "--max-memory: cannot read 'lots' as a memory size"),
    (["--model", "/no/such/folder"], "/no/such/folder"),
]


def serve(capsys, monkeypatch, *args: str) -> tuple[int, str]:
    monkeypatch.setattr(sys, "argv", ["refusion", "serve", *args])
    monkeypatch.delenv("REFUSION_DEBUG", raising=False)
    with pytest.raises(SystemExit) as exit_info:
        main()
    return exit_info.value.code, " ".join(capsys.readouterr().err.split())


@pytest.mark.parametrize("args,words", BAD)
def test_a_bad_command_line_is_one_error_line_and_exit_2(capsys, monkeypatch, args, words):
    code, err = serve(capsys, monkeypatch, *args)
    assert code == 2 and err.startswith("error:") and words in err, err
    assert "Traceback" not in err


def test_a_taken_port_is_one_error_line(capsys, monkeypatch):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        code, err = serve(capsys, monkeypatch, "--decoder", "ar", "--port", str(taken.getsockname()[1]))
    assert code == 2 and "cannot listen on" in err and "--port" in err, err
