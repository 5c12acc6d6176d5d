"""`refusion eval --table1`: the paper's Table 1 run from the registry alone. Each row's decoder, checkpoint and
adapter come from ``evals/suite.yaml``, found in ``--checkpoints`` under their hub names; ``--rows`` picks rows;
a missing folder is one error line before anything loads; the summary of nine rows reads in 100 columns."""

from __future__ import annotations

import re

import pytest
from rich.console import Console

from refusion_cli.cli.evaluate import summary_view
from refusion_cli.errors import UserError
from refusion_cli.harness.manifest import hub_name, table1, table1_rows
from refusion_cli.harness.report import RunResult
from refusion_cli.harness.runner import table1_models
from refusion_cli.harness.suite import load_suite
from refusion_cli.models.checkpoint import embedded_path
from tests.harness.helpers import run_cli

_, ROWS = table1()
ROW = {row.name: row for row in ROWS}
NUMBER = re.compile(r"-|\d+\.\d\d")


def test_rows_are_picked_by_number_or_name_any_case_in_the_papers_order():
    assert table1_rows() == list(ROWS)
    assert [row.number for row in ROWS] == list(range(1, len(ROWS) + 1))
    refusion, qwen = ROW["ReFusion"], ROW["Qwen3-8B"]
    assert table1_rows(["refusion", str(qwen.number), "Qwen3-8B"]) == [qwen, refusion]
    with pytest.raises(UserError, match=rf"--rows {len(ROWS) + 1}: Table 1 has no such row; give a number or a "
                                        rf"name: 1 {ROWS[0].name}, 2 {ROWS[1].name}"):
        table1_rows([str(len(ROWS) + 1)])


def test_each_rows_model_is_its_folders_under_the_hub_names_or_its_hub_ids(tmp_path):
    d2f = ROW["LLaDA w/ D2F"]
    for folder in d2f.folders:
        (tmp_path / folder).mkdir()
    assert d2f.folders == (hub_name(d2f.checkpoint), hub_name(d2f.adapter)) == ("LLaDA-8B-Instruct",
                                                                                "D2F_LLaDA_Instruct_8B_Lora")
    assert table1_models([d2f], tmp_path) == [f"llada-d2f={tmp_path / 'LLaDA-8B-Instruct'}+"
                                              f"{tmp_path / 'D2F_LLaDA_Instruct_8B_Lora'}"]
    assert table1_models([d2f], None) == [f"llada-d2f={d2f.checkpoint}+{d2f.adapter}"]


def test_a_missing_checkpoint_folder_is_one_line_naming_the_row_and_the_folder(capsys, monkeypatch, tmp_path):
    checkpoints, qwen, refusion = tmp_path / "checkpoints", ROW["Qwen3-8B"], ROW["ReFusion"]
    (checkpoints / hub_name(qwen.checkpoint)).mkdir(parents=True)
    code, stdout, stderr = run_cli(capsys, monkeypatch, "--table1", "--checkpoints", str(checkpoints), "--rows",
                                   f"{qwen.number},{refusion.number}", "--limit", "1",
                                   "--output", str(tmp_path / "run"))
    assert code == 2 and stdout == "" and "Traceback" not in stderr
    assert stderr == (f"error: --checkpoints {checkpoints} lacks 1 folder(s) of Table 1's rows: "
                      f"{checkpoints / 'ReFusion'} for row {refusion.number} (ReFusion) (hint: put each checkpoint "
                      "and adapter there in a folder named as its hub id's last part (docs/checkpoints.md), or pick "
                      "the rows you have with --rows)")
    assert not (tmp_path / "run").exists()
    code, _, stderr = run_cli(capsys, monkeypatch, "--table1", "--checkpoints", str(tmp_path / "empty"))
    assert code == 2 and stderr.startswith(f"error: --checkpoints {tmp_path / 'empty'} does not exist")


@pytest.mark.parametrize("args, message", [
    (["--task", "gsm8k", "--rows", "1"], "error: --rows goes with --table1"),
    (["--task", "gsm8k", "--checkpoints", "."], "error: --checkpoints goes with --table1"),
    (["--table1", "--decoder", "ar"], "error: --table1 runs each row's own decoder on its own checkpoint; it takes no "
                                      "--decoder or --model"),
    ([], "error: --task is missing"),
])
def test_table1_options_are_checked_where_they_enter(args, message, capsys, monkeypatch, tmp_path):
    code, stdout, stderr = run_cli(capsys, monkeypatch, *args, "--output", str(tmp_path / "run"))
    assert code == 2 and stdout == "" and stderr.startswith(message) and stderr.count("error:") == 1


def test_rows_pick_the_rows_run_each_on_its_folder(capsys, monkeypatch, tmp_path):
    """--rows by number and by name (listed after the option); --limit 0 plans them and stops, naming each row."""
    checkpoints, qwen, refusion = tmp_path / "checkpoints", ROW["Qwen3-8B"], ROW["ReFusion"]
    checkpoints.mkdir()
    for row, embedded in ((qwen, "ar-tiny"), (refusion, "refusion-tiny")):  # the embedded models as stand-ins
        (checkpoints / hub_name(row.checkpoint)).symlink_to(embedded_path(embedded))
    code, stdout, stderr = run_cli(capsys, monkeypatch, "--table1", "--checkpoints", str(checkpoints), "--rows",
                                   str(qwen.number), refusion.name, "--task", "synthetic", "--limit", "0",
                                   "--output", str(tmp_path / "run"))
    assert code == 0, stderr
    assert stdout.splitlines() == [
        f"Table 1 row {row.number}, {row.name}: {row.decoder} on {checkpoints / hub_name(row.checkpoint)}"
        for row in (qwen, refusion)] + ["--limit 0: the data and tasks of synthetic are ready; nothing was evaluated"]


def nine_rows() -> list[RunResult]:
    """A run of every row on all seven benchmarks, with the widest numbers a cell holds (100.00 %, TPS in the
    thousands), each model a folder under its hub names as --table1 --checkpoints gives it."""
    benchmarks = [b for b in load_suite().benchmarks.values() if b.in_table1]
    return [RunResult(benchmark=b.name, title=b.title, decoder=row.decoder,
                      model="+".join(f"/checkpoints/{folder}" for folder in row.folders),
                      label=f"{row.decoder}:{row.folders[-1]}", config_hash="abc", config={}, samples=1,
                      accuracy=100.0 * (i % 2), lm_eval_accuracy=None, tps=1234.56, tpf=12.25, tokens=8, forwards=1,
                      seconds=0.01, decoded=1, resumed=0, metric="m", protocol="paper",
                      also={"exact_match,strict-match": 100.0} if b.also else {})
            for row in ROWS for i, b in enumerate(benchmarks)]


def test_the_summary_of_the_nine_rows_reads_in_100_columns():
    console = Console(width=100, record=True, color_system=None)
    tables, notes = summary_view(nine_rows())
    for renderable in [*tables, *notes]:
        console.print(renderable)
    lines = console.export_text().splitlines()
    assert max(len(line.rstrip()) for line in lines) <= 100 and "…" not in "".join(lines)
    for row in ROWS:  # its name whole, then its seven cells and Avg on the same line, in the accuracy, TPS, TPF tables
        words = [f"{row.number}", *row.name.split()]
        mine = [line.split() for line in lines if line.split()[:len(words)] == words]
        assert len(mine) == 3 and all(len(cells[len(words):]) == 8 for cells in mine), row.name
        assert all(NUMBER.fullmatch(cell) for cells in mine for cell in cells[len(words):]), row.name
    measured = [line.split() for line in lines if line.split()[:1] == ["measured"]]
    assert len(measured) == 2 * len(ROWS) and all(len(cells) == 9 for cells in measured)
    assert [line.split(".")[0] for line in lines if re.match(r"\d\. ", line)] == ["1", "2", "3", "4"]
