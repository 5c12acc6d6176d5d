"""Helpers of the stand-in tests: a command through the real entry point."""

from __future__ import annotations

import sys

import pytest


def run(monkeypatch, capsys, *args: str) -> tuple[int, str, str]:
    """``refusion ARGS`` through the real entry point, in-process: (exit code, stdout, stderr)."""
    from refusion_cli.cli.app import main

    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setattr(sys, "argv", ["refusion", *args])
    with pytest.raises(SystemExit) as exit_info:
        main()
    out = capsys.readouterr()
    return exit_info.value.code, out.out, out.err
