"""Result files of a run: ``metrics.json`` and the paper's "accuracy / TPS" table as CSV and Markdown.

Layout (paper Table 1): one row per decoder + model, one column per benchmark, each cell
``accuracy / TPS`` (accuracy in %, TPS = the benchmark's generated tokens over its summed decode
seconds, as the paper counts it), an ``avg`` column
when there are several benchmarks; then the same rows and columns with TPF (tokens per forward).
A benchmark a row did not run is ``-``. Nothing here prints; the CLI renders :func:`summary_tables`.
"""

from __future__ import annotations

import csv
import dataclasses
import json
from pathlib import Path
from typing import TYPE_CHECKING

from refusion_cli.paths import write_atomically

if TYPE_CHECKING:
    from refusion_cli.harness.runner import RunResult

METRICS_FILE = "metrics.json"
CSV_FILE = "summary.csv"
MARKDOWN_FILE = "summary.md"


@dataclasses.dataclass(frozen=True)
class Table:
    title: str
    headers: list[str]
    rows: list[list[str]]


def summary_tables(results: list[RunResult]) -> list[Table]:
    """(accuracy / TPS table, TPF table) in the paper's layout."""
    columns: list[tuple[str, str]] = []  # (benchmark, title) in first-seen order
    labels: list[str] = []
    cells: dict[tuple[str, str], RunResult] = {}
    for result in results:
        if (result.benchmark, result.title) not in columns:
            columns.append((result.benchmark, result.title))
        if result.label not in labels:
            labels.append(result.label)
        cells[(result.label, result.benchmark)] = result
    with_avg = len(columns) > 1
    headers = ["decoder:model", *(title for _, title in columns)] + (["avg"] if with_avg else [])
    accuracy_rows, tpf_rows = [], []
    for label in labels:
        row = [cells.get((label, name)) for name, _ in columns]
        done = [r for r in row if r is not None]
        accuracy = [label, *(f"{r.accuracy:.2f} / {r.tps:.2f}" if r else "-" for r in row)]
        tpf = [label, *(f"{r.tpf:.2f}" if r else "-" for r in row)]
        if with_avg:
            complete = len(done) == len(columns)
            accuracy.append(f"{_mean([r.accuracy for r in done]):.2f} / {_mean([r.tps for r in done]):.2f}"
                            if complete else "-")
            tpf.append(f"{_mean([r.tpf for r in done]):.2f}" if complete else "-")
        accuracy_rows.append(accuracy)
        tpf_rows.append(tpf)
    batched = sorted({r.batch_size for r in results if r.batch_size > 1})
    title = ("accuracy (%) / TPS" if not batched else  # a batch's TPS is its throughput, not the paper's batch-1 rule
             f"accuracy (%) / TPS (batch {', '.join(map(str, batched))}: throughput, tokens over batched wall time)")
    return [Table(title, headers, accuracy_rows), Table("TPF (tokens per forward)", headers, tpf_rows)]


def _mean(values: list[float]) -> float:
    return sum(values) / len(values) if values else 0.0


def markdown(tables: list[Table]) -> str:
    parts = []
    for table in tables:
        lines = [f"**{table.title}**", "", "| " + " | ".join(table.headers) + " |",
                 "|" + "|".join("---" for _ in table.headers) + "|"]
        lines += ["| " + " | ".join(row) + " |" for row in table.rows]
        parts.append("\n".join(lines))
    return "\n\n".join(parts) + "\n"


def read_results(directory: Path) -> list[RunResult]:
    """The results in ``directory``'s metrics.json: every entry that has RunResult's required fields
    (fields this version does not know are dropped), none when the file is missing or not JSON."""
    from refusion_cli.harness.runner import RunResult

    try:
        payload = json.loads((directory / METRICS_FILE).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return []
    entries = payload.get("results") if isinstance(payload, dict) else None
    known = {f.name for f in dataclasses.fields(RunResult)}
    required = {f.name for f in dataclasses.fields(RunResult)
                if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING}
    return [RunResult(**{k: v for k, v in entry.items() if k in known})
            for entry in entries or [] if isinstance(entry, dict) and required <= entry.keys()]


def merge_results(earlier: list[RunResult], results: list[RunResult]) -> list[RunResult]:
    """``earlier`` with each (benchmark, decoder:model) cell that ``results`` holds replaced, new cells after.

    A folder run into several times (one decoder, then another; one task, then another) keeps
    every cell side by side; a rerun of a cell with other settings replaces that cell.
    """
    fresh = {(r.benchmark, r.label): r for r in results}
    merged = [fresh.pop((r.benchmark, r.label), r) for r in earlier]
    return merged + [r for r in results if (r.benchmark, r.label) in fresh]


def write_reports(directory: Path, results: list[RunResult]) -> None:
    """Rewrite metrics.json, summary.csv (both tables, one after the other) and summary.md."""
    directory.mkdir(parents=True, exist_ok=True)
    payload = {"results": [dataclasses.asdict(result) for result in results]}
    write_atomically(directory / METRICS_FILE, json.dumps(payload, indent=2, ensure_ascii=False) + "\n")
    tables = summary_tables(results)
    csv_path = directory / CSV_FILE
    with csv_path.with_suffix(".tmp").open("w", newline="", encoding="utf-8") as handle:
        writer = csv.writer(handle)
        for index, table in enumerate(tables):
            if index:
                writer.writerow([])
            writer.writerow([table.title])
            writer.writerow(table.headers)
            writer.writerows(table.rows)
    csv_path.with_suffix(".tmp").replace(csv_path)
    write_atomically(directory / MARKDOWN_FILE, markdown(tables))


