"""The result files: the paper's Table 1 beside each paper-protocol cell, and metrics.json read back."""

from __future__ import annotations

import csv
from pathlib import Path

import pytest

from refusion_cli.harness.manifest import EvalProtocol, table1
from refusion_cli.harness.report import RunResult, console_summary, read_results, summary_tables, write_reports
from refusion_cli.harness.suite import load_suite


OWN = {"refusion": "ReFusion", "ar": "Qwen3-8B", "llada": "LLaDA-8B-Instruct"}  # a Table 1 row's checkpoint


def result(benchmark: str, title: str, decoder: str, accuracy: float, tps: float, protocol: str = "paper",
           model: str | None = None, **extra) -> RunResult:
    model = model or OWN[decoder]
    return RunResult(benchmark=benchmark, title=title, decoder=decoder, model=model, label=f"{decoder}:{model}",
                     config_hash="abc", config={}, samples=10, accuracy=accuracy, lm_eval_accuracy=accuracy, tps=tps,
                     tpf=1.5, tokens=100, forwards=60, seconds=2.0, decoded=10, resumed=0, metric="m",
                     protocol=protocol, **extra)


KEYS = ["mmlu_pro", "arc_challenge", "gsm8k", "math", "gpqa", "humaneval", "mbpp"]
TITLES = ["MMLU-Pro", "ARC-C", "GSM8K", "MATH", "GPQA", "HumanEval", "MBPP"]
SOURCE, ROWS = table1()  # the paper's numbers: the registry's, never restated here
ROW = {row.name: row for row in ROWS}


def paper(row: str, benchmark: str) -> tuple[float, float]:
    """The paper's (accuracy, TPS) of one cell, from the registry."""
    return ROW[row].cells[benchmark]


def beside(measured: tuple[float, float] | None, numbers: tuple[float, float]) -> str:
    """A cell of the complete table: ``measured (paper, difference)`` for accuracy / TPS, ``- (paper)`` unmeasured."""
    if measured is None:
        return f"- ({numbers[0]:.2f}) / - ({numbers[1]:.2f})"
    return " / ".join(f"{value:.2f} ({number:.2f}, {value - number:+.2f})" for value, number in zip(measured, numbers))


def test_the_paper_table_has_its_nine_rows_each_cell_beside_the_papers_number():
    results = [result("gsm8k", "GSM8K", "refusion", 80.0, 90.5), result("math", "MATH", "refusion", 50.0, 70.0),
               result("gsm8k", "GSM8K", "ar", 82.5, 30.0), result("mbpp", "MBPP", "llada", 20.0, 3.0)]
    *_, table = summary_tables(results)  # no cell has other scores: the paper's table is the last
    assert table.title.startswith(f"the paper's Table 1 ({SOURCE.split(', ')[0]}), its nine rows: measured (paper, "
                                  "difference)")
    assert table.headers == ["paper row", "decoder:model", *TITLES, "Avg", "the paper's TPS count"]
    ran = {"ReFusion": "refusion:ReFusion", "Qwen3-8B": "ar:Qwen3-8B", "LLaDA-8B-Instruct": "llada:LLaDA-8B-Instruct"}
    assert [row[:2] for row in table.rows] == [[row.name, ran.get(row.name, "-")] for row in ROWS]
    rows = {row[0]: row for row in table.rows}
    measured = {("gsm8k", 0): (80.0, 90.5), ("math", 0): (50.0, 70.0)}
    assert rows["ReFusion"][2:] == [beside(measured.get((key, 0)), paper("ReFusion", key)) for key in KEYS] + [
        beside(None, ROW["ReFusion"].printed_average), ROW["ReFusion"].tps_count]
    assert rows["Qwen3-8B"][4] == beside((82.5, 30.0), paper("Qwen3-8B", "gsm8k"))
    assert rows["LLaDA-8B-Instruct"][8] == beside((20.0, 3.0), paper("LLaDA-8B-Instruct", "mbpp"))
    assert rows["Dream w/ D2F"][2:10] == [beside(None, paper("Dream w/ D2F", key)) for key in KEYS] + [
        beside(None, ROW["Dream w/ D2F"].printed_average)]
    assert rows["Dream w/ D2F"][10].startswith("not published")


def test_a_run_of_all_seven_benchmarks_has_a_measured_average_beside_the_papers():
    results = [result(key, title, "refusion", 60.0 + i, 70.0 + i) for i, (key, title) in enumerate(zip(KEYS, TITLES))]
    *_, table = summary_tables(results)
    [row] = [row for row in table.rows if row[0] == "ReFusion"]
    assert row[9] == beside((63.0, 73.0), ROW["ReFusion"].printed_average)  # the cells' mean beside the printed Avg


def test_a_model_named_like_a_rows_checkpoint_stands_beside_that_row():
    llama = result("gsm8k", "GSM8K", "ar", 70.0, 40.0, model="/models/Meta-Llama-3-8B-Instruct/")
    qwen = result("gsm8k", "GSM8K", "ar", 80.0, 30.0, model="Qwen3-8B")
    other = result("gsm8k", "GSM8K", "ar", 10.0, 5.0, model="my-ar")
    grid, _, table = summary_tables([llama, qwen, other])
    lines = [(row[0], row[1], row[4]) for row in table.rows if row[1] != "-"]
    assert lines == [
        ("Llama-3-8B-Instruct", "ar:/models/Meta-Llama-3-8B-Instruct/",
         beside((70.0, 40.0), paper("Llama-3-8B-Instruct", "gsm8k"))),
        ("Qwen3-8B", "ar:Qwen3-8B", beside((80.0, 30.0), paper("Qwen3-8B", "gsm8k")))]
    assert [row[0] for row in grid.rows] == ["ar:/models/Meta-Llama-3-8B-Instruct/", "ar:Qwen3-8B", "ar:my-ar"]


def test_a_refusion_tiny_run_of_a_paper_benchmark_is_its_own_row_not_the_papers_refusion_row(tmp_path: Path):
    tiny = result("gsm8k", "GSM8K", "refusion", 0.0, 1200.0, model="refusion-tiny")
    titles = [table.title for table in summary_tables([tiny])]
    assert titles == ["accuracy (%) / TPS (each request's tokens over its own latency)", "TPF (tokens per forward)"]
    summary = console_summary([tiny])
    assert [row[0] for row in summary.tables[0].rows] == ["refusion:refusion-tiny"]
    [note] = summary.notes
    assert note.startswith("refusion-tiny: embedded model(s), trained on the synthetic task alone")
    write_reports(tmp_path, [tiny])
    assert "78.66" not in (tmp_path / "summary.md").read_text() and note in (tmp_path / "summary.md").read_text()
    [line] = csv.DictReader((tmp_path / "summary.csv").open(encoding="utf-8"))
    assert (line["label"], line["paper_row"], line["paper_accuracy"]) == ("refusion:refusion-tiny", "", "")


def test_summary_csv_is_one_tidy_table_a_line_per_decoder_and_task(tmp_path: Path):
    cells = [result("gsm8k", "GSM8K", "refusion", 80.0, 90.0, settings="slot_size=32 block_size=128", seed=0),
             result("synthetic", "Synthetic", "ar", 50.0, 9.0, model="ar-tiny")]
    write_reports(tmp_path, cells)
    header, first, second = (tmp_path / "summary.csv").read_text(encoding="utf-8").splitlines()
    assert header == ("task,protocol,decoder,model,label,settings,seed,samples,accuracy,lm_eval_accuracy,tps,"
                      "tps_sample_mean,throughput,tpf,tokens,forwards,seconds,batch_size,device,dtype,config_hash,paper_row,"
                      "paper_accuracy,paper_tps")
    refusion = paper("ReFusion", "gsm8k")
    assert first == (f"gsm8k,paper,refusion,ReFusion,refusion:ReFusion,slot_size=32 block_size=128,0,10,80.0,80.0,"
                     f"90.0,,,1.5,100,60,2.0,1,,,abc,ReFusion,{refusion[0]},{refusion[1]}")
    assert second == "synthetic,paper,ar,ar-tiny,ar:ar-tiny,,,10,50.0,50.0,9.0,,,1.5,100,60,2.0,1,,,abc,,,"


def test_an_adapter_rows_run_is_matched_by_the_adapters_name():
    run = result("gsm8k", "GSM8K", "llada-d2f", 40.0, 80.0, model="/ckpts/D2F_LLaDA_Instruct_8B_Lora")
    *_, table = summary_tables([run])
    [line] = [row for row in table.rows if row[1] != "-"]
    assert line[:2] == ["LLaDA w/ D2F", "llada-d2f:/ckpts/D2F_LLaDA_Instruct_8B_Lora"]
    assert line[4] == beside((40.0, 80.0), paper("LLaDA w/ D2F", "gsm8k"))


def test_the_registrys_table1_has_nine_rows_whose_cells_average_to_the_papers_avg_column():
    _, rows = table1()
    paper_benchmarks = {name for name, b in load_suite().benchmarks.items() if b.in_table1}
    assert len(rows) == 9 and len({row.name for row in rows}) == 9
    for row in rows:
        assert set(row.cells) == paper_benchmarks, row.name
        assert row.average == pytest.approx(row.printed_average, abs=0.005), row.name  # a mistyped cell shows here


def test_no_paper_table_for_other_protocols_or_tasks_the_paper_did_not_run():
    results = [result("gsm8k", "GSM8K", "refusion", 80.0, 90.0, protocol=EvalProtocol.LM_EVAL),
               result("synthetic", "Synthetic", "refusion", 70.0, 50.0)]
    assert [table.title for table in summary_tables(results)] == ["accuracy (%) / TPS (each request's tokens over its own latency)",
                                                                  "TPF (tokens per forward)"]


def test_metrics_json_keeps_the_protocol_and_the_other_scores(tmp_path: Path):
    cell = result("gsm8k", "GSM8K", "refusion", 80.0, 90.0, also={"exact_match,strict-match": 75.0})
    write_reports(tmp_path, [cell])
    assert read_results(tmp_path) == [cell]
    summary = (tmp_path / "summary.md").read_text(encoding="utf-8")
    cells = [beside(None, paper("ReFusion", "mmlu_pro")), beside(None, paper("ReFusion", "arc_challenge")),
             beside((80.0, 90.0), paper("ReFusion", "gsm8k"))]
    assert f"| ReFusion | refusion:ReFusion | {' | '.join(cells)} |" in summary
    assert "| refusion:ReFusion | GSM8K | exact_match,strict-match 75.00 |" in summary


def test_the_console_summary_is_table_1_with_each_run_under_its_row_and_numbered_notes():
    results = [result(key, title, "refusion", 60.0 + i, 70.0 + i) for i, (key, title) in enumerate(zip(KEYS, TITLES))]
    results += [result("gsm8k", "GSM8K", "ar", 80.0, 30.0, model="Qwen3-8B"),
                result("gsm8k", "GSM8K", "ar", 10.0, 5.0, model="/ckpts/Qwen3-8B"),
                result("gsm8k", "GSM8K", "ar", 1.0, 2.0, model="my-ar"),  # no row's checkpoint: the grid
                result("synthetic", "Synthetic", "ar", 50.0, 9.0, model="ar-tiny")]  # no row of Table 1: the grid
    summary = console_summary(results)
    grid, _, accuracy, tps, tpf = summary.tables  # the grid: accuracy / TPS, TPF
    assert [row[0] for row in grid.rows] == ["ar:my-ar", "ar:ar-tiny"]
    assert grid.headers == ["decoder:model", "GSM8K", "Synthetic", "avg"]
    assert accuracy.headers == tps.headers == tpf.headers == ["#", "row", *TITLES, "Avg"]
    refusion, qwen = ROW["ReFusion"], ROW["Qwen3-8B"]
    lines = {tuple(row[:2]): row[2:] for row in accuracy.rows}
    assert lines[(str(refusion.number), "ReFusion")] == [f"{refusion.cells[key][0]:.2f}" for key in KEYS] + [
        f"{refusion.printed_average[0]:.2f}"]
    after = accuracy.rows[[row[1] for row in accuracy.rows].index("ReFusion") + 1]
    assert after == ["", "  measured", *(f"{60.0 + i:.2f}" for i in range(7)), "63.00"]
    at = [row[1] for row in tps.rows].index("Qwen3-8B")
    assert [row[1:5] for row in tps.rows[at:at + 3]] == [
        ["Qwen3-8B", *(f"{qwen.cells[key][1]:.2f}" for key in KEYS[:3])],
        ["  measured (a)", "-", "-", "30.00"], ["  measured (b)", "-", "-", "5.00"]]
    assert len(accuracy.rows) == len(ROWS) + 3 and [row[:2] for row in tpf.rows] == [
        [str(qwen.number), "Qwen3-8B (a)"], [str(qwen.number), "Qwen3-8B (b)"], [str(refusion.number), "ReFusion"]]
    runs, average, counts = summary.notes[1:]
    assert runs == (f"The runs of the rows: {qwen.number} (a) = ar:Qwen3-8B; {qwen.number} (b) = ar:/ckpts/Qwen3-8B; "
                    f"{refusion.number} = refusion:ReFusion.")
    assert average == (f"Avg, measured minus the paper's (accuracy / TPS): {refusion.number}: "
                       f"{63.0 - refusion.printed_average[0]:+.2f} / {73.0 - refusion.printed_average[1]:+.2f}.")
    assert f"row {refusion.number}: {refusion.tps_count}" in counts


def test_the_console_summary_without_a_table_1_cell_is_the_grid():
    results = [result("synthetic", "Synthetic", "refusion", 70.0, 50.0)]
    assert console_summary(results).tables == summary_tables(results) and console_summary(results).notes == []
