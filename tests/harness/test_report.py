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


TITLES = ["MMLU-Pro", "ARC-C", "GSM8K", "MATH", "GPQA", "HumanEval", "MBPP"]


def test_the_paper_table_has_its_nine_rows_each_cell_beside_the_papers_number():
    results = [result("gsm8k", "GSM8K", "refusion", 80.0, 90.5), result("math", "MATH", "refusion", 50.0, 70.0),
               result("gsm8k", "GSM8K", "ar", 82.5, 30.0), result("mbpp", "MBPP", "llada", 20.0, 3.0)]
    *_, paper = summary_tables(results)  # no cell has other scores: the paper's table is the last
    assert paper.title.startswith("the paper's Table 1 (arXiv 2512.13586), its nine rows: measured (paper, difference)")
    assert paper.headers == ["paper row", "decoder:model", *TITLES, "Avg", "the paper's TPS count"]
    assert [row[:2] for row in paper.rows] == [
        ["Llama-3-8B-Instruct", "-"], ["Qwen3-8B", "ar:ckpt"], ["LLaDA-8B-Instruct", "llada:ckpt"],
        ["LLaDA w/ Fast-dLLM", "-"], ["LLaDA w/ D2F", "-"], ["Dream-7B-Instruct", "-"], ["Dream w/ Fast-dLLM", "-"],
        ["Dream w/ D2F", "-"], ["ReFusion", "refusion:ckpt"]]
    rows = {row[0]: row for row in paper.rows}
    assert rows["ReFusion"][2:] == [
        "- (45.94) / - (52.74)", "- (89.76) / - (32.46)", "80.00 (84.91, -4.91) / 90.50 (81.24, +9.26)",
        "50.00 (54.22, -4.22) / 70.00 (81.77, -11.77)", "- (35.49) / - (64.11)", "- (78.66) / - (103.90)",
        "- (68.20) / - (92.09)", "- (65.31) / - (72.62)", "eval.py: tokens up to EOS over decode seconds, as here"]
    assert rows["Qwen3-8B"][4] == "82.50 (81.96, +0.54) / 30.00 (31.20, -1.20)"
    assert rows["LLaDA-8B-Instruct"][8] == "20.00 (25.60, -5.60) / 3.00 (2.97, +0.03)"
    assert rows["Dream w/ D2F"][2:10] == ["- (23.82) / - (56.43)", "- (85.92) / - (59.08)", "- (41.62) / - (79.20)",
                                          "- (29.98) / - (84.14)", "- (30.13) / - (49.96)", "- (50.00) / - (69.15)",
                                          "- (51.60) / - (65.59)", "- (44.72) / - (66.22)"]
    assert rows["Dream w/ D2F"][10].startswith("not published")


def test_a_run_of_all_seven_benchmarks_has_a_measured_average_beside_the_papers():
    keys = ["mmlu_pro", "arc_challenge", "gsm8k", "math", "gpqa", "humaneval", "mbpp"]
    results = [result(key, title, "refusion", 60.0 + i, 70.0 + i) for i, (key, title) in enumerate(zip(keys, TITLES))]
    *_, paper = summary_tables(results)
    [row] = [row for row in paper.rows if row[0] == "ReFusion"]
    assert row[9] == "63.00 (65.31, -2.31) / 73.00 (72.62, +0.38)"  # the cells' mean beside the printed Avg


def test_a_model_named_like_a_rows_checkpoint_stands_beside_that_row():
    llama = result("gsm8k", "GSM8K", "ar", 70.0, 40.0, model="/models/Meta-Llama-3-8B-Instruct/")
    qwen = result("gsm8k", "GSM8K", "ar", 80.0, 30.0, model="Qwen3-8B")
    other = result("gsm8k", "GSM8K", "ar", 10.0, 5.0, model="my-ar")
    *_, paper = summary_tables([llama, qwen, other])
    lines = [(row[0], row[1], row[4]) for row in paper.rows if row[1] != "-"]
    assert lines == [
        ("Llama-3-8B-Instruct", "ar:/models/Meta-Llama-3-8B-Instruct/", "70.00 (75.13, -5.13) / 40.00 (42.81, -2.81)"),
        ("Qwen3-8B", "ar:Qwen3-8B", "80.00 (81.96, -1.96) / 30.00 (31.20, -1.20)"),
        ("Qwen3-8B", "ar:my-ar", "10.00 (81.96, -71.96) / 5.00 (31.20, -26.20)")]  # the decoder's fallback row


def test_an_adapter_rows_run_is_matched_by_the_adapters_name():
    run = result("gsm8k", "GSM8K", "llada-d2f", 40.0, 80.0, model="/ckpts/D2F_LLaDA_Instruct_8B_Lora")
    *_, paper = summary_tables([run])
    [line] = [row for row in paper.rows if row[1] != "-"]
    assert line[:2] == ["LLaDA w/ D2F", "llada-d2f:/ckpts/D2F_LLaDA_Instruct_8B_Lora"]
    assert line[4] == "40.00 (39.04, +0.96) / 80.00 (82.59, -2.59)"


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
    assert "| ReFusion | refusion:ckpt | - (45.94) / - (52.74) | - (89.76) / - (32.46) | 80.00 (84.91, -4.91)" in summary
    assert "| refusion:ckpt | GSM8K | exact_match,strict-match 75.00 |" in summary
