"""The result files: the paper's Table 1 beside each paper-protocol cell, and metrics.json read back."""

from __future__ import annotations

from pathlib import Path

from refusion_cli.harness.report import PAPER_TABLE1_SOURCE, RunResult, read_results, summary_tables, write_reports


def result(benchmark: str, title: str, decoder: str, accuracy: float, tps: float, protocol: str = "paper",
           **extra) -> RunResult:
    return RunResult(benchmark=benchmark, title=title, decoder=decoder, model="ckpt", label=f"{decoder}:ckpt",
                     config_hash="abc", config={}, samples=10, accuracy=accuracy, lm_eval_accuracy=accuracy, tps=tps,
                     tpf=1.5, tokens=100, forwards=60, seconds=2.0, decoded=10, resumed=0, metric="m",
                     protocol=protocol, **extra)


def test_each_paper_cell_stands_beside_the_papers_number_for_its_decoders_row():
    results = [result("gsm8k", "GSM8K", "refusion", 80.0, 90.5), result("math", "MATH", "refusion", 50.0, 70.0),
               result("gsm8k", "GSM8K", "ar", 82.5, 30.0), result("mbpp", "MBPP", "llada", 20.0, 3.0)]
    *_, paper = summary_tables(results)  # no cell has other scores: the paper's table is the last
    assert PAPER_TABLE1_SOURCE in paper.title
    assert paper.headers == ["decoder:model vs paper row", "GSM8K", "MATH", "MBPP"]
    assert paper.rows == [
        ["refusion:ckpt vs ReFusion", "80.00 (84.91, -4.91) / 90.50 (81.24, +9.26)",
         "50.00 (54.22, -4.22) / 70.00 (81.77, -11.77)", "-"],
        ["ar:ckpt vs Qwen3-8B", "82.50 (81.96, +0.54) / 30.00 (31.20, -1.20)", "-", "-"],
        ["llada:ckpt vs LLaDA-8B-Instruct", "-", "-", "20.00 (25.60, -5.60) / 3.00 (2.97, +0.03)"],
    ]


def test_no_paper_table_for_other_protocols_or_tasks_the_paper_did_not_run():
    results = [result("gsm8k", "GSM8K", "refusion", 80.0, 90.0, protocol="lm-eval"),
               result("synthetic", "Synthetic", "refusion", 70.0, 50.0)]
    assert [table.title for table in summary_tables(results)] == ["accuracy (%) / TPS", "TPF (tokens per forward)"]


def test_metrics_json_keeps_the_protocol_and_the_other_scores(tmp_path: Path):
    cell = result("gsm8k", "GSM8K", "refusion", 80.0, 90.0, also={"exact_match,strict-match": 75.0})
    write_reports(tmp_path, [cell])
    assert read_results(tmp_path) == [cell]
    summary = (tmp_path / "summary.md").read_text(encoding="utf-8")
    assert "84.91" in summary and "| refusion:ckpt | GSM8K | exact_match,strict-match 75.00 |" in summary
