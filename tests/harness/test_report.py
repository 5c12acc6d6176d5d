"""The result files: the paper's Table 1 beside each paper-protocol cell, and metrics.json read back."""

from __future__ import annotations

from pathlib import Path

import pytest

from refusion_cli.harness.manifest import EvalProtocol, table1
from refusion_cli.harness.report import RunResult, read_results, summary_tables, write_reports
from refusion_cli.harness.suite import load_suite


def result(benchmark: str, title: str, decoder: str, accuracy: float, tps: float, protocol: str = "paper",
           model: str = "ckpt", **extra) -> RunResult:
    return RunResult(benchmark=benchmark, title=title, decoder=decoder, model=model, label=f"{decoder}:{model}",
                     config_hash="abc", config={}, samples=10, accuracy=accuracy, lm_eval_accuracy=accuracy, tps=tps,
                     tpf=1.5, tokens=100, forwards=60, seconds=2.0, decoded=10, resumed=0, metric="m",
                     protocol=protocol, **extra)


def test_each_paper_cell_stands_beside_the_papers_number_for_its_decoders_row():
    results = [result("gsm8k", "GSM8K", "refusion", 80.0, 90.5), result("math", "MATH", "refusion", 50.0, 70.0),
               result("gsm8k", "GSM8K", "ar", 82.5, 30.0), result("mbpp", "MBPP", "llada", 20.0, 3.0)]
    *_, paper = summary_tables(results)  # no cell has other scores: the paper's table is the last
    assert "arXiv 2512.13586, Table 1" in paper.title
    assert paper.headers == ["decoder:model vs paper row", "GSM8K", "MATH", "MBPP"]
    assert paper.rows == [
        ["refusion:ckpt vs ReFusion", "80.00 (84.91, -4.91) / 90.50 (81.24, +9.26)",
         "50.00 (54.22, -4.22) / 70.00 (81.77, -11.77)", "-"],
        ["ar:ckpt vs Qwen3-8B", "82.50 (81.96, +0.54) / 30.00 (31.20, -1.20)", "-", "-"],
        ["llada:ckpt vs LLaDA-8B-Instruct", "-", "-", "20.00 (25.60, -5.60) / 3.00 (2.97, +0.03)"],
    ]


def test_a_model_named_like_a_rows_checkpoint_stands_beside_that_row():
    llama = result("gsm8k", "GSM8K", "ar", 70.0, 40.0, model="/models/Meta-Llama-3-8B-Instruct/")
    qwen = result("gsm8k", "GSM8K", "ar", 80.0, 30.0, model="Qwen3-8B")
    *_, paper = summary_tables([llama, qwen])
    assert paper.rows == [
        ["ar:/models/Meta-Llama-3-8B-Instruct/ vs Llama-3-8B-Instruct", "70.00 (75.13, -5.13) / 40.00 (42.81, -2.81)"],
        ["ar:Qwen3-8B vs Qwen3-8B", "80.00 (81.96, -1.96) / 30.00 (31.20, -1.20)"]]


def test_the_registrys_table1_has_nine_rows_whose_cells_average_to_the_papers_avg_column():
    _, rows = table1()
    paper_benchmarks = {name for name, b in load_suite().benchmarks.items() if b.in_table1}
    assert len(rows) == 9 and len({row.name for row in rows}) == 9
    for row in rows:
        assert set(row.cells) == paper_benchmarks, row.name
        assert row.average == pytest.approx(row.printed_average, abs=0.005), row.name  # a mistyped cell shows here
    for decoder in {row.decoder for row in rows}:
        assert sum(row.fallback for row in rows if row.decoder == decoder) == 1, decoder


def test_no_paper_table_for_other_protocols_or_tasks_the_paper_did_not_run():
    results = [result("gsm8k", "GSM8K", "refusion", 80.0, 90.0, protocol=EvalProtocol.LM_EVAL),
               result("synthetic", "Synthetic", "refusion", 70.0, 50.0)]
    assert [table.title for table in summary_tables(results)] == ["accuracy (%) / TPS", "TPF (tokens per forward)"]


def test_metrics_json_keeps_the_protocol_and_the_other_scores(tmp_path: Path):
    cell = result("gsm8k", "GSM8K", "refusion", 80.0, 90.0, also={"exact_match,strict-match": 75.0})
    write_reports(tmp_path, [cell])
    assert read_results(tmp_path) == [cell]
    summary = (tmp_path / "summary.md").read_text(encoding="utf-8")
    assert "84.91" in summary and "| refusion:ckpt | GSM8K | exact_match,strict-match 75.00 |" in summary
