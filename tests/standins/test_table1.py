"""Table 1 in one command: ``refusion eval --table1 --checkpoints DIR`` on the stand-ins of the rows' checkpoints and
adapters, each linked into DIR under its hub name, one document per task and 8-token responses. The rows, their
decoders, folders and the paper's numbers all come from the registry (``evals/suite.yaml``). The stand-ins are
random, so what is checked is that every row runs and the summary prints the paper's nine rows, each with its run
beside (in the files) or under (in the terminal, within 100 columns) the paper's numbers, not the scores."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from refusion_cli.harness.manifest import hub_name, table1
from tests.standins.helpers import run

REPO = Path(__file__).resolve().parents[2]
STANDIN = {  # hub id -> its stand-in (tools.standins)
    "meta-llama/Meta-Llama-3-8B-Instruct": "llama-3-8b-instruct", "Qwen/Qwen3-8B": "qwen3-8b",
    "GSAI-ML/LLaDA-8B-Instruct": "llada-8b-instruct", "Dream-org/Dream-v0-Instruct-7B": "dream-v0-instruct-7b",
    "GSAI-ML/ReFusion": "refusion", "SJTU-Deng-Lab/D2F_LLaDA_Instruct_8B_Lora": "d2f-llada-lora",
    "SJTU-DENG-Lab/D2F_Dream_Instruct_7B_Lora": "d2f-dream-lora",
}
SETTINGS = ["gen_length=8", "temperature=0", "top_p=1", "refusion.slot_size=4", "refusion.block_size=8",
            "llada-d2f.block_size=8", "dream-d2f.block_size=8"]


@pytest.mark.slow  # `make test-all`: seven stand-ins, nine rows x seven benchmarks (about 100 s)
def test_table1_in_one_command_prints_the_nine_rows_beside_the_papers_numbers(standin, tmp_path, monkeypatch,
                                                                              capsys):
    _, rows = table1()
    checkpoints = tmp_path / "checkpoints"
    checkpoints.mkdir()
    for hub_id in {hub_id for row in rows for hub_id in (row.checkpoint, row.adapter) if hub_id}:
        (checkpoints / hub_name(hub_id)).symlink_to(standin(STANDIN[hub_id]))
    output = tmp_path / "table1"
    code, out, err = run(monkeypatch, capsys, "eval", "--table1", "--checkpoints", str(checkpoints),
                         *[item for value in SETTINGS for item in ("--set", value)], "--limit", "1", "--device", "cpu",
                         "--data-dir", str(REPO / "tests" / "harness" / "paper_data"), "--confirm-run-unsafe-code",
                         "--output", str(output))
    assert code == 0, err
    cells = json.loads((output / "metrics.json").read_text())["results"]
    assert len(cells) == len(rows) * 7 and {cell["protocol"] for cell in cells} == {"paper"}
    summary = (output / "summary.md").read_text(encoding="utf-8")
    table = summary[summary.index("**the paper's Table 1 (arXiv 2512.13586), its nine rows"):]
    lines = [line for line in table.splitlines()[4:] if line.startswith("| ")][:len(rows)]
    assert [line.split(" | ")[:2] for line in lines] == [[f"| {row.name}", f"{row.decoder}:{row.folders[-1]}"]
                                                          for row in rows]
    for line, row in zip(lines, rows):  # each row's MMLU-Pro cell beside the paper's
        assert f"({row.cells['mmlu_pro'][0]:.2f}, " in line.split(" | ")[2]
    # the terminal: each row named with its decoder and folder, then its numbers on one line in 100 columns
    printed = out.splitlines()
    for row in rows:
        model = "+".join(str(checkpoints / folder) for folder in row.folders)
        assert f"Table 1 row {row.number}, {row.name}: {row.decoder} on {model}" in printed
        named = [line for line in printed if line.split()[:len(row.name.split()) + 1] == [str(row.number),
                                                                                             *row.name.split()]]
        assert len(named) == 3 and all(len(line.rstrip()) <= 100 for line in named), row.name  # accuracy, TPS, TPF
        assert all(len(re.findall(r"(?<!\S)(?:-|\d+\.\d\d)(?!\S)", line)) == 8 for line in named), row.name
    measured = [line for line in printed if line.split()[:1] == ["measured"]]
    assert len(measured) == 2 * len(rows) and all(len(line.rstrip()) <= 100 for line in measured)
