"""Result files of a run: ``metrics.json``, ``summary.csv`` (one tidy table: a line per decoder x task, a column
per measure, :data:`CSV_COLUMNS`) and ``summary.md`` (the paper's "accuracy / TPS" layout).

summary.md's layout (paper Table 1): one row per decoder + model, one column per benchmark, each cell
``accuracy / TPS`` (accuracy in %, TPS = the benchmark's generated tokens over its summed decode
seconds, as the paper counts it), an ``avg`` column
when there are several benchmarks; then the same rows and columns with TPF (tokens per forward);
then, for cells run under the paper's protocol on a row's own checkpoint, each beside the paper's own
Table 1 number for that row (the registry's Table 1, :func:`table1_row`) and the difference; then the
other scores of the same answers where a benchmark reports more than one (:attr:`RunResult.also`). A
benchmark a row did not run is ``-``. A run of another model (the embedded ones among them) stays in its
own row. :class:`RunResult` (one cell) lives here, so the result files need nothing of the run that writes
them. Nothing here prints: the files hold :func:`summary_tables`, complete; the CLI renders
:func:`console_summary`, the same cells in tables that a 100-column terminal shows unfolded, with
numbered notes.
"""

from __future__ import annotations

import csv
import dataclasses
import io
import json
from pathlib import Path
from typing import Any

from refusion_cli.harness.manifest import EvalProtocol, Table1Row, hub_name, read_manifest, table1
from refusion_cli.models.checkpoint import EMBEDDED, is_embedded
from refusion_cli.paths import write_atomically

METRICS_FILE = "metrics.json"
CSV_FILE = "summary.csv"
MARKDOWN_FILE = "summary.md"

@dataclasses.dataclass
class RunResult:
    """One cell row of the summary: a benchmark under one decoder + model."""

    benchmark: str
    title: str
    decoder: str
    model: str
    label: str
    config_hash: str
    config: dict[str, Any]
    samples: int
    accuracy: float  # mean per-sample score, in %
    lm_eval_accuracy: float | None  # lm-eval's aggregate of the same metric and filter, in %
    tps: float  # the paper's TPS: all generated tokens / all decode seconds (its eval.py: mean length / mean latency)
    tpf: float  # mean per-sample tokens per forward
    tokens: int
    forwards: int
    seconds: float
    decoded: int  # samples the main process decoded in this invocation
    resumed: int  # samples read back from earlier runs instead of being decoded
    metric: str
    lm_eval_results: dict[str, Any] = dataclasses.field(default_factory=dict)
    prompts_cut: int = 0  # samples whose prompt lost its start to fit the model's positions
    device: str = ""  # where it ran: "cpu", "cuda (<GPU name>)" (empty in a metrics.json written before this field)
    dtype: str = ""  # the model's weights, e.g. "bfloat16"
    tps_sample_mean: float | None = None  # the mean of per-sample TPS (None in a metrics.json written before it)
    batch_size: int = 1  # requests decoded together (``tps`` is still per request: tokens over each one's latency)
    throughput: float | None = None  # all tokens over the run's wall time (at batch 1: ``tps``; None: written before)
    batch_notes: list[str] = dataclasses.field(default_factory=list)  # --batch-size auto's choice and why; halvings
    protocol: str = ""  # whose task definitions ("paper", "lm-eval"; empty: the same under both, or written before)
    also: dict[str, float] = dataclasses.field(default_factory=dict)  # other scores of the same answers (lm-eval's, %)
    # a code benchmark: how its candidates ran (sandbox.Isolation.record: user, interpreter, packages, namespaces)
    sandbox: dict[str, Any] = dataclasses.field(default_factory=dict)
    settings: str = ""  # the config's fields that differ from the decoder's defaults (spec.settings_label)
    seed: int | None = None  # the run's --seed (None in a metrics.json written before this field)


@dataclasses.dataclass(frozen=True)
class Table:
    title: str
    headers: list[str]
    rows: list[list[str]]


def summary_tables(results: list[RunResult]) -> list[Table]:
    """The complete tables of summary.md: accuracy / TPS and TPF per decoder:model in the paper's
    layout, then the paper's Table 1 beside the paper-protocol cells, then the other scores of the same answers."""
    paper, other = table1_comparison(results), other_scores_table(results)
    return grid_tables(results) + [table for table in (paper, other) if table is not None]


def grid_tables(results: list[RunResult]) -> list[Table]:
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
    accuracy_rows, tpf_rows, throughput_rows = [], [], []
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
        throughput_rows.append([label, *(_number(r.throughput) if r else "-" for r in row)]
                               + (["-"] if with_avg else []))
    tables = [Table("accuracy (%) / TPS (each request's tokens over its own latency)", headers, accuracy_rows),
              Table("TPF (tokens per forward)", headers, tpf_rows)]
    batched = sorted({r.batch_size for r in results if r.batch_size > 1})
    if batched:  # a batch's own measure: the requests' tokens over the run's wall time
        tables.append(Table(f"throughput (tokens/s over the run's wall time; batch {', '.join(map(str, batched))})",
                            headers, throughput_rows))
    return tables


def other_scores_table(results: list[RunResult]) -> Table | None:
    """The other scores of the same answers (``RunResult.also``: where the paper does not say which one its
    Table 1 shows), one row per cell that has them. None when none has."""
    rows = [[result.label, result.title, ", ".join(f"{key} {value:.2f}" for key, value in result.also.items())]
            for result in results if result.also]
    return Table("other scores of the same answers (%, lm-eval's metric,filter)", ["decoder:model", "task", "scores"],
                 rows) if rows else None


def table1_row(result: RunResult) -> Table1Row | None:
    """The paper's Table 1 row ``result`` stands for: the row of its decoder whose checkpoint's (or adapter's) name
    is the run's model folder (``Meta-Llama-3-8B-Instruct``) and that has a number for its benchmark; None for a
    run of any other model, which is a row of its own."""
    _, rows = table1()
    model = hub_name(result.model).lower()
    return next((row for row in rows if row.decoder == result.decoder and result.benchmark in row.cells
                 and model in {folder.lower() for folder in row.folders}), None)


def embedded_note(results: list[RunResult]) -> str | None:
    """A note for cells of a paper benchmark decoded by an embedded model, which knows only the synthetic task."""
    _, rows = table1()
    cells = [r for r in results if is_embedded(r.model) and r.benchmark in rows[0].cells]
    if not cells:
        return None
    models = ", ".join(dict.fromkeys(r.model for r in cells))
    return (f"{models}: embedded model(s), trained on the synthetic task alone ({', '.join(EMBEDDED)}); their rows "
            "on the paper's benchmarks check the pipeline, not the paper's numbers, and stand apart from Table 1.")


def runs_by_row(results: list[RunResult]) -> dict[str, dict[str, dict[str, RunResult]]]:
    """Table 1's row name -> the label of each run that stands for it -> benchmark -> its paper-protocol cell, every
    row in the paper's order (one no run stands for maps to nothing)."""
    _, rows = table1()
    runs: dict[str, dict[str, dict[str, RunResult]]] = {row.name: {} for row in rows}
    for result in results:
        reference = table1_row(result) if result.protocol == EvalProtocol.PAPER else None
        if reference is not None:
            runs[reference.name].setdefault(result.label, {})[result.benchmark] = result
    return runs


def table1_comparison(results: list[RunResult]) -> Table | None:
    """The paper's Table 1, all nine rows in its order, with each paper-protocol cell beside the paper's number and
    the difference: ``measured (paper, +difference)`` for accuracy, then for TPS, and the Avg column likewise (a
    measured average once a run has all seven benchmarks). A row no run stands for shows the paper's numbers
    alone; a row several runs stand for has a line per run. None when no cell is under the paper's protocol."""
    source, rows = table1()
    runs = runs_by_row(results)
    if not any(runs.values()):
        return None
    benchmarks, titles = list(rows[0].cells), _titles()
    lines = []
    for row in rows:
        for label, cells in (runs[row.name] or {"-": {}}).items():
            line = [row.name, label]
            for benchmark in benchmarks:
                measured = cells.get(benchmark)
                line.append(_beside((measured.accuracy, measured.tps) if measured else None, row.cells[benchmark]))
            complete = len(cells) == len(benchmarks)
            average = (_mean([c.accuracy for c in cells.values()]), _mean([c.tps for c in cells.values()]))
            line += [_beside(average if complete else None, row.printed_average), row.tps_count]
            lines.append(line)
    return Table(f"the paper's {source.split(', ')[-1]} ({source.split(', ')[0]}), its nine rows: measured (paper, "
                 "difference), accuracy / TPS",
                 ["paper row", "decoder:model", *(titles[name] for name in benchmarks), "Avg",
                  "the paper's TPS count"], lines)


@dataclasses.dataclass(frozen=True)
class ConsoleSummary:
    """What ``refusion eval`` prints: tables narrow enough that a 100-column terminal shows each row on one line,
    and numbered notes below them. summary.md keeps the complete tables (:func:`summary_tables`)."""

    tables: list[Table]
    notes: list[str]


def console_summary(results: list[RunResult]) -> ConsoleSummary:
    """The cells that stand beside a row of the paper's Table 1 as that table, one column per benchmark and Avg:
    accuracy and TPS apart, each row's printed numbers with a line under them per run that stands for it, then
    those runs' TPF; the other cells in the grid of :func:`grid_tables`; the other scores of the same answers.
    The notes: which run is which row's, each complete run's Avg minus the paper's, how the paper counted TPS."""
    source, rows = table1()
    runs = runs_by_row(results)
    placed = {(cell.label, cell.benchmark) for by_label in runs.values() for cells in by_label.values()
              for cell in cells.values()}
    other = [table for table in [other_scores_table(results)] if table is not None]
    embedded = [note for note in [embedded_note(results)] if note is not None]
    if not placed:
        return ConsoleSummary(grid_tables(results) + other, embedded)
    benchmarks, titles = list(rows[0].cells), _titles()
    accuracy: list[list[str]] = []
    tps: list[list[str]] = []
    tpf: list[list[str]] = []
    named: list[str] = []
    differences: list[str] = []
    for row in rows:
        for table, index in ((accuracy, 0), (tps, 1)):  # the row as printed
            table.append([str(row.number), row.name, *(f"{row.cells[b][index]:.2f}" for b in benchmarks),
                          f"{row.printed_average[index]:.2f}"])
        for letter, (label, cells) in zip("abcdefghijklmnopqrstuvwxyz", runs[row.name].items()):
            mark = f" ({letter})" if len(runs[row.name]) > 1 else ""
            complete = len(cells) == len(benchmarks)
            for table, measure in ((accuracy, "accuracy"), (tps, "tps"), (tpf, "tpf")):
                values: list[float | None] = [getattr(cells[b], measure) if b in cells else None for b in benchmarks]
                # the Avg column: once all seven are in
                values.append(_mean([value for value in values if value is not None]) if complete else None)
                line = ["", f"  measured{mark}"] if measure != "tpf" else [str(row.number), row.name + mark]
                table.append(line + [_number(value) for value in values])
            named.append(f"{row.number}{mark} = {label}")
            if complete:
                measured = [_mean([getattr(c, measure) for c in cells.values()]) for measure in ("accuracy", "tps")]
                differences.append(f"{row.number}{mark}: {measured[0] - row.printed_average[0]:+.2f} / "
                                   f"{measured[1] - row.printed_average[1]:+.2f}")
    name = f"the paper's {source.split(', ')[-1]} ({source.split(', ')[0]})"
    headers = ["#", "row", *(titles[b] for b in benchmarks), "Avg"]
    tables = [Table("Table 1, accuracy (%): the paper's, then measured", headers, accuracy),
              Table("Table 1, TPS (tokens per second): the paper's, then measured", headers, tps),
              Table("TPF (tokens per forward) of the runs of Table 1's rows", headers, tpf)]
    notes = [f"Each row of {name} as the paper prints it, then under it each run that stands for it ('-': not "
             "measured). Every cell beside the paper's number with the difference: summary.md.",
             "The runs of the rows: " + "; ".join(named) + "."]
    if differences:
        notes.append("Avg, measured minus the paper's (accuracy / TPS): " + "; ".join(differences) + ".")
    batched = sorted({cell.batch_size for cell in results if (cell.label, cell.benchmark) in placed} - {1})
    notes.append(_tps_note(rows, batched))
    rest = [result for result in results if (result.label, result.benchmark) not in placed]
    return ConsoleSummary((grid_tables(rest) if rest else []) + tables + other, notes + embedded)


def _tps_note(rows: tuple[Table1Row, ...], batched: list[int]) -> str:
    """How the paper counted each row's TPS, rows that share a count together, beside the toolkit's one rule."""
    counts: dict[str, list[str]] = {}
    for row in rows:
        counts.setdefault(row.tps_count, []).append(str(row.number))
    paper = "; ".join(f"{'rows' if len(numbers) > 1 else 'row'} {', '.join(numbers)}: {count}"
                      for count, numbers in counts.items())
    here = ("measured here for every row as the response's tokens up to its end token over the decode seconds"
            if not batched else f"measured here at batch {', '.join(map(str, batched))}: each request's tokens over its "
            "latency among the batch's rows (the throughput is in its own table)")
    return f"TPS {here}; the paper's count: {paper}."


def _number(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}"


def _titles() -> dict[str, str]:
    """Each benchmark's column title, by its key."""
    return {name: entry["title"] for name, entry in read_manifest()["benchmarks"].items()}


def _beside(measured: tuple[float, float] | None, paper: tuple[float, float]) -> str:
    """``measured (paper, difference)`` for accuracy / TPS; ``- (paper)`` where nothing was measured."""
    if measured is None:
        return f"- ({paper[0]:.2f}) / - ({paper[1]:.2f})"
    return " / ".join(f"{value:.2f} ({reference:.2f}, {value - reference:+.2f})"
                      for value, reference in zip(measured, paper))


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


# summary.csv: a line per cell (decoder x model x task), a column per measure; numbers unformatted, '' for none
CSV_COLUMNS = ["task", "protocol", "decoder", "model", "label", "settings", "seed", "samples", "accuracy",
               "lm_eval_accuracy", "tps", "tps_sample_mean", "throughput", "tpf", "tokens", "forwards", "seconds",
               "batch_size", "device", "dtype", "config_hash", "paper_row", "paper_accuracy", "paper_tps"]


def summary_rows(results: list[RunResult]) -> list[dict[str, Any]]:
    """summary.csv's lines: each cell's measures, and the paper's numbers where the cell stands for a row of its
    Table 1 (a paper-protocol run of the row's own checkpoint)."""
    lines = []
    for result in results:
        row = table1_row(result) if result.protocol == EvalProtocol.PAPER else None
        paper = row.cells[result.benchmark] if row is not None else (None, None)
        values = {**dataclasses.asdict(result), "task": result.benchmark, "paper_row": row.name if row else None,
                  "paper_accuracy": paper[0], "paper_tps": paper[1]}
        lines.append({column: "" if values[column] is None else values[column] for column in CSV_COLUMNS})
    return lines


def write_reports(directory: Path, results: list[RunResult]) -> None:
    """Rewrite metrics.json, summary.csv (:func:`summary_rows`) and summary.md (:func:`summary_tables`)."""
    directory.mkdir(parents=True, exist_ok=True)
    payload = {"results": [dataclasses.asdict(result) for result in results]}
    write_atomically(directory / METRICS_FILE, json.dumps(payload, indent=2, ensure_ascii=False) + "\n")
    text = io.StringIO(newline="")
    writer = csv.DictWriter(text, CSV_COLUMNS, lineterminator="\n")
    writer.writeheader()
    writer.writerows(summary_rows(results))
    write_atomically(directory / CSV_FILE, text.getvalue())
    notes = [note for note in [embedded_note(results)] if note is not None]
    write_atomically(directory / MARKDOWN_FILE, markdown(summary_tables(results))
                     + "".join(f"\n{note}\n" for note in notes) + batch_notes_section(results))


def batch_notes_section(results: list[RunResult]) -> str:
    """summary.md's list of the batch sizes ``--batch-size auto`` chose, and why, and every halving ('' if none)."""
    lines = [f"- {result.label}, {result.title}: {'; '.join(result.batch_notes)}"
             for result in results if result.batch_notes]
    return "\n**batch sizes**\n\n" + "\n".join(lines) + "\n" if lines else ""


