"""What ``refusion bench`` does once its options are checked: :class:`BenchRun` measures the rows with progress
on the terminal and writes the files; the result table and the lines beside it.

Imported when the command runs (torch and the models behind it), never for ``--help``."""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rich import box
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TaskID, TextColumn, TimeElapsedColumn
from rich.table import Table

from refusion_cli.bench.frontier import FRONTIER_CSV, frontier_points, is_sweep_entry, write_frontier_csv
from refusion_cli.bench.machine import Machine
from refusion_cli.bench.plots import (FRONTIER_FILE, FRONTIER_TPF_FILE, FRONTIER_TPS_FILE, LENGTH_FILE, plot_frontier,
                                      plot_length_sweep, plot_sweep_frontier, plotting_available)
from refusion_cli.bench.prompts import BenchPrompt
from refusion_cli.bench.report import (MACHINE_FILE, REPORT_FILE, ROW_FIELDS, ROWS_FILE, RUN_FILE, SAMPLE_FIELDS,
                                       SAMPLES_FILE, CsvRows, counts_cells, fmt, is_counted, percent, write_machine,
                                       write_markdown)
from refusion_cli.bench.resume import Earlier, write_record
from refusion_cli.bench.runner import BenchEntry, BenchRow, BenchSample, BenchSettings, run_bench
from refusion_cli.cli.output import console, err_console
from refusion_cli.decoding.registry import BASELINE
from refusion_cli.errors import UserError
from refusion_cli.models.checkpoint import Checkpoint
from refusion_cli.models.loading import LoadedModel



class BenchRun:
    """One run: progress on the terminal, rows to the CSV files, the report and plots at the end.

    The output directory is not touched until the first row finishes: an error or Ctrl-C before
    that (a model that fails to load, a decoder that does not fit its model) leaves a previous
    run's files as they were. The first finished row replaces them: the previous run's report,
    machine.json and plots are removed, run.json written, the CSV files started afresh with the
    samples so far; from then on rows and samples are written as they finish, and the report and
    plots at the end, also after an error or Ctrl-C (then marked Interrupted, from the rows that
    finished).

    A resumed run (``earlier``: the rows the interrupted one finished) measures only the entries
    after them. Its first finished row cuts the CSV files to the earlier rows and their samples
    (dropping a record cut mid-write and an unfinished row's samples) and appends from there;
    run.json, the report and the plots stay until the report is written again from all rows.
    """

    def __init__(self, settings: BenchSettings, entries: list[BenchEntry], n_prompts: int, output: Path,
                 prompts_source: str, machine: Machine, record: dict[str, Any], earlier: Earlier | None = None,
                 notes: list[str] | None = None, checkpoints: Mapping[str, Checkpoint] | None = None):
        self.settings = settings
        self.checkpoints = checkpoints  # the records resolve_models made while planning (None: resolved again)
        self.notes = notes or []  # caveats for the report (budget_notes)
        self.entries = entries
        self.n_prompts = n_prompts
        self.output = output
        self.prompts_source = prompts_source
        self.machine = machine
        self.record = record  # run.json
        self.earlier = earlier
        self.rows: list[BenchRow] = list(earlier.rows) if earlier is not None else []
        self.unwritten_samples: list[BenchSample] = []  # measured before the files were opened
        self.files: contextlib.ExitStack | None = None  # open once the first row has finished
        self.rows_csv: CsvRows | None = None
        self.samples_csv: CsvRows | None = None
        self.written: list[str] = []
        self.progress = Progress(TextColumn("[bold]{task.description}"), BarColumn(), MofNCompleteColumn(),
                                 TimeElapsedColumn(), console=console, transient=True,
                                 disable=not console.is_terminal)  # off a terminal: RowDecodes lines instead
        self.task: TaskID | None = None
        self.row_decodes = RowDecodes()  # the row's count off a terminal, as lines on stderr

    def execute(self, prompts: list[BenchPrompt]) -> None:
        """Measure the entries the run does not have yet."""
        done = len(self.rows)
        ar_tps = {entry.gen_length: row.tps for entry, row in zip(self.entries, self.rows)
                  if entry.decoder == BASELINE and entry.batch_size == 1}
        finished = False
        try:
            with self.progress:
                for row in run_bench(self.settings, prompts, entries=self.entries[done:], ar_tps=ar_tps,
                                     on_entry=self.start_entry, on_sample=self.sample_done,
                                     checkpoints=self.checkpoints):
                    self.row_done(row)
            finished = True
        except KeyboardInterrupt:
            if self.files is None and self.earlier is None:
                console.print(f"[yellow]stopped:[/] no row finished; {self.output} is untouched", highlight=False,
                              soft_wrap=True)
            elif self.files is None:
                console.print(f"[yellow]stopped:[/] no new row finished; {self.output} is untouched{RESUME_NOTE}",
                              highlight=False, soft_wrap=True)
            raise
        finally:
            if self.files is not None:
                self.files.close()
                self.write_report(interrupted=not finished)

    def open_files(self) -> None:
        """Replace the previous run's files with this run's run.json and CSV files, or cut a resumed run's CSV
        files to its earlier rows (the first row has finished)."""
        files = contextlib.ExitStack()
        earlier = self.earlier
        try:
            self.output.mkdir(parents=True, exist_ok=True)
            if earlier is None:
                for name in (REPORT_FILE, MACHINE_FILE, FRONTIER_FILE, LENGTH_FILE, FRONTIER_CSV, FRONTIER_TPS_FILE,
                             FRONTIER_TPF_FILE):
                    (self.output / name).unlink(missing_ok=True)
                write_record(self.output / RUN_FILE, self.record)
            rows_csv = files.enter_context(CsvRows(self.output / ROWS_FILE, ROW_FIELDS,
                                                   keep=earlier.rows_bytes if earlier else 0))
            samples_csv = files.enter_context(CsvRows(self.output / SAMPLES_FILE, SAMPLE_FIELDS,
                                                      keep=earlier.samples_bytes if earlier else 0))
        except OSError as exc:
            files.close()
            raise UserError(f"cannot write to --output {self.output}: {exc.strerror or exc}") from None
        self.files, self.rows_csv, self.samples_csv = files, rows_csv, samples_csv
        self.written = [ROWS_FILE, SAMPLES_FILE] if earlier else [RUN_FILE, ROWS_FILE, SAMPLES_FILE]

    def start_entry(self, entry: BenchEntry, loaded: LoadedModel) -> None:
        if self.task is not None:
            self.progress.remove_task(self.task)
        total = self.n_prompts * self.settings.repeats
        self.task = self.progress.add_task(f"{entry.label} @ {entry.gen_length}", total=total)
        self.row_decodes = RowDecodes(f"{entry.label} @ {entry.gen_length}", total)

    def sample_done(self, sample: BenchSample) -> None:
        self.unwritten_samples.append(sample)
        self.write_samples()
        if self.task is not None:
            self.progress.advance(self.task)
        if self.progress.disable and (line := self.row_decodes.advance()) is not None:
            err_console.print(line, highlight=False, soft_wrap=True)

    def write_samples(self) -> None:
        if self.samples_csv is None:
            return
        for sample in self.unwritten_samples:
            self.samples_csv.write(dataclasses.asdict(sample))
        self.unwritten_samples.clear()

    def row_done(self, row: BenchRow) -> None:
        if self.files is None:
            self.open_files()
        self.write_samples()
        assert self.rows_csv is not None
        self.rows_csv.write(row.as_dict())
        self.rows.append(row)
        self.progress.console.print(row_line(row), highlight=False, soft_wrap=True)

    def write_report(self, interrupted: bool) -> None:
        """bench.md, machine.json and the plots; with --sweep frontier.csv and the two frontier plots in place
        of frontier.png (which would give every sweep row a legend entry), and the length plot of the usual rows."""
        write_machine(self.output / MACHINE_FILE, self.machine)
        written = []
        sweep = self.settings.sweep
        points = frontier_points(self.entries, self.rows) if sweep else []
        if points:
            write_frontier_csv(self.output / FRONTIER_CSV, points)
            written.append(FRONTIER_CSV)
        usual = [row for entry, row in zip(self.entries, self.rows) if not is_sweep_entry(entry)]
        plots = []
        if plotting_available():
            if sweep:
                for name, speed in ((FRONTIER_TPS_FILE, "tps"), (FRONTIER_TPF_FILE, "tpf")):
                    if plot_sweep_frontier(points, self.output / name, speed):
                        plots.append(name)
            elif plot_frontier(self.rows, self.output / FRONTIER_FILE):
                plots.append(FRONTIER_FILE)
            if plot_length_sweep(usual, self.output / LENGTH_FILE):
                plots.append(LENGTH_FILE)
        elif self.rows:
            console.print("[yellow]matplotlib is not installed: no plots[/] (pip install matplotlib)")
        write_markdown(self.output / REPORT_FILE, self.rows, self.machine, prompts=self.prompts_source,
                       warmup=self.settings.warmup, repeats=self.settings.repeats, seed=self.settings.seed,
                       plots=plots, interrupted=interrupted, notes=self.notes,
                       resumed=len(self.earlier.rows) if self.earlier is not None else 0, frontier=points)
        self.written += [REPORT_FILE, MACHINE_FILE, *written, *plots]
        if interrupted:
            console.print(f"[yellow]stopped:[/] {len(self.rows)} finished row(s) kept in {self.output}{RESUME_NOTE}",
                          highlight=False, soft_wrap=True)


RESUME_NOTE = "; the same command with --resume continues it"


def row_line(row: BenchRow) -> str:
    speedup = f", {row.speedup_vs_ar:.2f}× AR" if row.speedup_vs_ar is not None else ""
    accuracy = f", accuracy {row.accuracy * 100:.1f}%" if row.accuracy is not None else ""
    cut = f", {row.budget_share * 100:.0f}% hit the length budget" if row.budget_share else ""
    return (f"{row.decoder} @ {row.gen_length}: {row.tps:.1f} tok/s{speedup}, {row.tpf:.2f} tokens/forward, "
            f"p50 {row.latency_p50_ms:.0f} ms{accuracy}{cut}")


@dataclass
class RowDecodes:
    """The decodes a row has done of its total; off a terminal, where no bar can redraw, a line at each quarter."""

    label: str = ""
    total: int = 0
    done: int = 0

    def advance(self) -> str | None:
        """Count a decode; the line to show when it completes a quarter of the row (not the last one: the row's
        own line follows)."""
        self.done += 1
        if self.done < self.total and self.done * 4 // self.total > (self.done - 1) * 4 // self.total:
            return f"  {self.label}: {self.done}/{self.total} decodes"
        return None


TERMINAL_HEADER = ["decoder", "len", "batch", "TPS", "min", "med", "max", "thru", "× AR", "TPF", "fwd", "tok", "p50 ms",
                   "p95 ms", "MiB", "acc", "cut"]  # min / med / max: TPS over the repeats; cut: hit the budget
# --counts
COUNTS_TERMINAL_HEADER = ["syncs/step", "ops/step", "attn calls/layer", "positions/token", "K/V copied/token"]


def result_table(rows: list[BenchRow]) -> Table:
    """The terminal table, narrower than the Markdown one: no model column (see :func:`models_line`),
    whole numbers for counts and milliseconds."""
    title = ("Decoding speed (batch 1)" if all(row.batch_size == 1 for row in rows)
             else "Decoding speed (TPS: the paper's rule at batch 1; thru: tokens / wall time)")
    table = Table(title=title, title_justify="left", box=box.SIMPLE_HEAD, padding=0,
                  show_edge=False)
    counted = is_counted(rows)
    for index, name in enumerate(TERMINAL_HEADER + (COUNTS_TERMINAL_HEADER if counted else [])):
        table.add_column(name, justify="left" if index == 0 else "right", no_wrap=True)
    for row in rows:
        table.add_row(row.decoder, str(row.gen_length), str(row.batch_size), fmt(row.tps, 1), fmt(row.tps_min, 1),
                      fmt(row.tps_median, 1), fmt(row.tps_max, 1), fmt(row.throughput, 1),
                      fmt(row.speedup_vs_ar, 2, "×"),
                      fmt(row.tpf), fmt(row.forwards, 0), fmt(row.tokens, 0), fmt(row.latency_p50_ms, 0),
                      fmt(row.latency_p95_ms, 0), fmt(row.peak_mem_mib, 1), percent(row.accuracy),
                      percent(row.budget_share), *(counts_cells(row) if counted else []))
    return table


def models_line(rows: list[BenchRow]) -> str:
    """Each decoder's checkpoint; a label starts with its decoder's name ("refusion (recompute)", "llada steps=64")."""
    return "models: " + ", ".join(dict.fromkeys(f"{row.decoder.split(' ')[0]}={row.model}" for row in rows))
