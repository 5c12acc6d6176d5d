"""What the bench tests share: `refusion bench --tps` run in-process, its one error line, a previous run's files
to check that nothing overwrote them, the CSV files read back, and a watch on BenchRun's progress hooks."""

from __future__ import annotations

import contextlib
import csv
import io
import subprocess
import sys
from pathlib import Path

import pytest

from refusion_cli.bench.plots import FRONTIER_FILE, LENGTH_FILE
from refusion_cli.cli.bench_run import BenchRun

PREVIOUS_RUN = {"bench.csv": "old rows\n", "samples.csv": "old samples\n", "bench.md": "# old report\n",
                "machine.json": "{}\n", FRONTIER_FILE: "old plot", LENGTH_FILE: "old plot"}


def bench(patch: pytest.MonkeyPatch, args: list[str]) -> int:
    """``refusion bench --tps ARGS`` in this process; its exit code."""
    from refusion_cli.cli.app import main

    patch.setattr(sys, "argv", ["refusion", "bench", "--tps", *args])
    with pytest.raises(SystemExit) as exit_info:
        main()
    return exit_info.value.code


def bench_captured(args: list[str], interrupt_after_rows: int | None = None) -> subprocess.CompletedProcess:
    """``refusion bench --tps ARGS`` in this process, its streams captured off a terminal without pytest's
    fixtures (a module fixture has none): its exit code, stdout and stderr; with ``interrupt_after_rows``, Ctrl-C
    after that many rows."""
    stdout, stderr = io.StringIO(), io.StringIO()
    with pytest.MonkeyPatch.context() as patch, contextlib.redirect_stdout(stdout), \
            contextlib.redirect_stderr(stderr):
        if interrupt_after_rows is not None:
            watch(patch, "row_done", interrupt_at=interrupt_after_rows)
        code = bench(patch, args)
    return subprocess.CompletedProcess(["refusion", "bench", "--tps", *args], code, stdout.getvalue(),
                                       stderr.getvalue())


def run_bench_cli(args: list[str], monkeypatch, capsys) -> tuple[int, str, str]:
    """``refusion bench --tps ARGS`` in this process: its exit code, stdout and stderr."""
    code = bench(monkeypatch, args)
    out = capsys.readouterr()
    return code, out.out, out.err


def error_line(err: str) -> str:
    """The one ``error:`` line of stderr (asserting there is exactly one and no traceback)."""
    errors = [line for line in err.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "Traceback" not in err, err
    return errors[0]


def previous_run(folder: Path) -> dict[str, bytes]:
    """A finished run's files in ``folder``; returns what they hold."""
    folder.mkdir(parents=True, exist_ok=True)
    for name, text in PREVIOUS_RUN.items():
        (folder / name).write_text(text)
    return files_in(folder)


def files_in(folder: Path) -> dict[str, bytes]:
    return {path.name: path.read_bytes() for path in sorted(folder.iterdir())}


def read_csv(path: Path) -> list[dict[str, str]]:
    with path.open(newline="", encoding="utf-8") as handle:
        return list(csv.DictReader(handle))


def watch(patch: pytest.MonkeyPatch, hook: str, interrupt_at: int | None = None) -> list:
    """What BenchRun's ``hook`` (sample_done or row_done) is given, in order; with ``interrupt_at``, Ctrl-C
    (a KeyboardInterrupt) right after that many calls."""
    original = getattr(BenchRun, hook)
    seen = []

    def hooked(run: BenchRun, item) -> None:
        original(run, item)
        seen.append(item)
        if len(seen) == interrupt_at:
            raise KeyboardInterrupt

    patch.setattr(BenchRun, hook, hooked)
    return seen
