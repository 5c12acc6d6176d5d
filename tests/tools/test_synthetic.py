"""`python -m tools.synthetic`: writes both splits where it is told, and refuses bad counts and folders in one line."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tools.synthetic import main

REPO = Path(__file__).resolve().parents[2]


def test_cli_writes_both_splits(tmp_path: Path) -> None:
    main(["--out", str(tmp_path / "out"), "--n-train", "20", "--n-test", "10", "--seed", "3",
          "--train-out", str(tmp_path / "elsewhere" / "train.jsonl")])
    test_lines = (tmp_path / "out" / "test.jsonl").read_text(encoding="utf-8").splitlines()
    train_lines = (tmp_path / "elsewhere" / "train.jsonl").read_text(encoding="utf-8").splitlines()
    assert (len(train_lines), len(test_lines)) == (20, 10)
    assert list(json.loads(test_lines[0])) == ["question", "answer", "target"]
    assert not (tmp_path / "out" / "train.jsonl").exists()


@pytest.mark.parametrize("args, message", [
    (["--n-test", "-1"], "error: --n-test must be 0 or more, got -1"),
    (["--n-train", "-5"], "error: --n-train must be 0 or more, got -5"),
    (["--out", ""], "error: --out is empty"),
    (["--out", "FILE"], "error: --out FILE is a file, not a directory"),
    (["--train-out", "DIR"], "error: --train-out DIR is a directory; give the file name of the train split"),
    (["--train-out", "FILE/train.jsonl"], "error: --train-out FILE is a file, not a directory"),
])
def test_cli_refuses_bad_counts_and_paths_in_one_line(args: list[str], message: str, tmp_path: Path, capsys,
                                                      monkeypatch) -> None:
    """These were tracebacks (or, for an empty --out, files in the working directory)."""
    monkeypatch.chdir(tmp_path)
    file = tmp_path / "a_file"
    file.write_text("keep")
    args = [arg.replace("FILE", str(file)).replace("DIR", str(tmp_path)) for arg in args]
    with pytest.raises(SystemExit) as exit_info:
        main(["--out", str(tmp_path / "out"), "--n-train", "2", "--n-test", "2", *args])
    err = capsys.readouterr().err
    assert exit_info.value.code == 2 and len(err.splitlines()) == 1
    assert err.startswith(message.replace("FILE", str(file)).replace("DIR", str(tmp_path)))
    assert [path.name for path in tmp_path.iterdir()] == ["a_file"]  # nothing written


def test_the_documented_command_runs_from_the_repository_root(tmp_path: Path) -> None:
    out = subprocess.run([sys.executable, "-m", "tools.synthetic", "--out", str(tmp_path), "--n-train", "3",
                          "--n-test", "2"], capture_output=True, text=True, cwd=REPO, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.startswith(f"wrote 3 train problems to {tmp_path / 'train.jsonl'} and 2 test problems")
    assert len((tmp_path / "test.jsonl").read_text(encoding="utf-8").splitlines()) == 2
