"""Table 1 in one command: ``refusion eval --task paper`` with the nine rows' decoders on the stand-ins of their
checkpoints (each in a folder named as the checkpoint or adapter), one document per task and 8-token responses.
The stand-ins are random, so what is checked is that every row runs and the summary prints the paper's nine rows,
each with its run beside the paper's numbers, not the scores."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.standins.helpers import run
from tools.standins import build_standin

REPO = Path(__file__).resolve().parents[2]
FOLDERS = {  # stand-in -> its checkpoint's (or adapter's) folder name
    "refusion": "ReFusion", "qwen3-8b": "Qwen3-8B", "llama-3-8b-instruct": "Meta-Llama-3-8B-Instruct",
    "llada-8b-instruct": "LLaDA-8B-Instruct", "dream-v0-instruct-7b": "Dream-v0-Instruct-7B",
}
ADAPTER_FOLDERS = {"d2f-llada-lora": ("D2F_LLaDA_Instruct_8B_Lora", "LLaDA-8B-Instruct"),
                   "d2f-dream-lora": ("D2F_Dream_Instruct_7B_Lora", "Dream-v0-Instruct-7B")}
RUNS = [  # (paper row, decoder, folder), in the paper's order
    ("Llama-3-8B-Instruct", "ar", "Meta-Llama-3-8B-Instruct"), ("Qwen3-8B", "ar", "Qwen3-8B"),
    ("LLaDA-8B-Instruct", "llada", "LLaDA-8B-Instruct"),
    ("LLaDA w/ Fast-dLLM", "llada-fast-dllm", "LLaDA-8B-Instruct"),
    ("LLaDA w/ D2F", "llada-d2f", "D2F_LLaDA_Instruct_8B_Lora"),
    ("Dream-7B-Instruct", "dream", "Dream-v0-Instruct-7B"),
    ("Dream w/ Fast-dLLM", "dream-fast-dllm", "Dream-v0-Instruct-7B"),
    ("Dream w/ D2F", "dream-d2f", "D2F_Dream_Instruct_7B_Lora"), ("ReFusion", "refusion", "ReFusion"),
]


@pytest.mark.slow  # `make test-all`: seven stand-ins, nine rows x seven benchmarks (about 100 s)
def test_table1_in_one_command_prints_the_nine_rows_beside_the_papers_numbers(tmp_path, monkeypatch, capsys):
    for name, folder in FOLDERS.items():
        build_standin(name, tmp_path / folder)
    for name, (folder, base) in ADAPTER_FOLDERS.items():
        build_standin(name, tmp_path / folder, base=tmp_path / base)
    decoders = list(dict.fromkeys(decoder for _, decoder, _ in RUNS))
    models = [f"{decoder}={tmp_path / folder}" for _, decoder, folder in RUNS]
    settings = ["gen_length=8", "temperature=0", "top_p=1", "refusion.slot_size=4", "refusion.block_size=8",
                "llada-d2f.block_size=8", "dream-d2f.block_size=8"]
    output = tmp_path / "table1"
    code, _, err = run(monkeypatch, capsys, "eval", "--task", "paper", "--decoder", *decoders, "--model", *models,
                       *[item for value in settings for item in ("--set", value)], "--limit", "1", "--device", "cpu",
                       "--data-dir", str(REPO / "tests" / "harness" / "paper_data"), "--confirm-run-unsafe-code",
                       "--output", str(output))
    assert code == 0, err
    cells = json.loads((output / "metrics.json").read_text())["results"]
    assert len(cells) == 9 * 7 and {cell["protocol"] for cell in cells} == {"paper"}
    summary = (output / "summary.md").read_text(encoding="utf-8")
    table = summary[summary.index("**the paper's Table 1 (arXiv 2512.13586), its nine rows"):]
    lines = [line for line in table.splitlines()[4:] if line.startswith("| ")][:9]
    assert [line.split(" | ")[:2] for line in lines] == [[f"| {row}", f"{decoder}:{folder}"]
                                                          for row, decoder, folder in RUNS]
    for line, number in zip(lines, ["(35.23, ", "(67.25, ", "(35.80, ", "(35.02, ", "(22.84, ", "(40.05, ", "(40.36, ",
                                    "(23.82, ", "(45.94, "]):  # each row's MMLU-Pro cell beside the paper's
        assert number in line.split(" | ")[2]
