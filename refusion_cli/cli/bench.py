"""`refusion bench --tps`: decoding speed of several decoders on the same prompts, batch 1.

A thin wrapper over :mod:`refusion_cli.bench`: parses and checks every option (the output
directory included) before anything is written, shows progress and the result table with Rich,
and writes the files (run.json and the CSV rows as they are measured; Markdown and plots at the
end, also after an interruption or an error, from the rows that finished; see :class:`BenchRun`
for when a previous run's files are replaced).

``--resume`` continues the interrupted run in ``--output`` instead (:mod:`refusion_cli.bench.resume`):
the same command with ``--resume`` keeps the rows in bench.csv and their samples, measures the
planned rows that are not there, appends them, and writes the report from all rows; a run with
every row there is only reported again. It refuses (one error line, exit 2, the folder
unchanged) a folder with no run.json or bench.csv, a run.json whose settings or machine differ
from this command's, and CSV files with a record this toolkit would not have written; a last
record cut mid-write and the samples of an unfinished row are dropped and measured again.

Options that take several values accept them space-separated (``--decoder refusion ar llada``),
comma-separated (``--decoder refusion,ar``) or repeated (``--decoder refusion --decoder ar``).
Click gives an option one value, so the values after it arrive as stray arguments; each is
given back to the option its shape belongs to (see :func:`route_stray_values`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Annotated, Any

import torch
import typer
from rich import box
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TaskID, TextColumn, TimeElapsedColumn
from rich.table import Table

from refusion_cli.bench.machine import Machine
from refusion_cli.bench.frontier import FRONTIER_CSV, frontier_points, is_sweep_entry, write_frontier_csv
from refusion_cli.bench.plots import (FRONTIER_FILE, FRONTIER_TPF_FILE, FRONTIER_TPS_FILE, LENGTH_FILE, plot_frontier,
                                      plot_length_sweep, plot_sweep_frontier, plotting_available)
from refusion_cli.bench.prompts import SYNTHETIC_TEST, BenchPrompt, load_prompts
from refusion_cli.bench.report import (
    MACHINE_FILE,
    REPORT_FILE,
    ROW_FIELDS,
    ROWS_FILE,
    RUN_FILE,
    SAMPLE_FIELDS,
    SAMPLES_FILE,
    CsvRows,
    fmt,
    machine_line,
    percent,
    write_machine,
    write_markdown,
)
from refusion_cli.bench.resume import Earlier, load_earlier, run_record, write_record
from refusion_cli.bench.machine import bench_machine
from refusion_cli.bench.runner import (
    AUTO_BATCH,
    DEFAULT_DECODERS,
    DEFAULT_GEN_LENGTH,
    BenchEntry,
    BenchRow,
    BenchSample,
    BenchSettings,
    budget_notes,
    plan_entries,
    resolve_models,
    run_bench,
)
from refusion_cli.cli.options import (DECODER_NAMES, PATH_OPTION, CausalFirstOpt, CausalFixOpt, DecodersOpt, DeviceOpt,
                                      DtypeOpt, ModelsOpt, MultiValues, PresetOpt, RecheckOpt, SeedOpt, SetOpt,
                                      TrustRemoteCodeOpt, panel_option, option_values, route_stray_values, split_commas)
from refusion_cli.cli.output import console, print_table, quiet_library_output
from refusion_cli.decoding.memory import parse_memory
from refusion_cli.decoding.registry import BASELINE
from refusion_cli.decoding.spec import one_model_each, parse_decoder_options
from refusion_cli.errors import UserError
from refusion_cli.models.checkpoint import Checkpoint
from refusion_cli.models.loading import LoadedModel
from refusion_cli.paths import check_output_dir

RUN = "What to run"
MEASURE = "How to measure"
MACHINE = "Machine"


def bench(
    tps: Annotated[bool, typer.Option("--tps", help="measure decoding speed (tokens per second); the default and, "
                                      "for now, the only benchmark", rich_help_panel=RUN)] = True,
    decoder: Annotated[list[str] | None, panel_option(DecodersOpt, RUN, help=f"decoders to compare ({DECODER_NAMES}); default: "
                      f"{' '.join(DEFAULT_DECODERS)}")] = None,
    model: Annotated[list[str] | None, panel_option(ModelsOpt, RUN)] = None,
    prompts: Annotated[Path | None, typer.Option("--prompts", **PATH_OPTION, help="JSONL with a 'prompt' or "
                                                 "'question' field and an optional 'target'; default: the "
                                                 "synthetic task", rich_help_panel=RUN)] = None,
    limit: Annotated[int | None, typer.Option("--limit", help="use the first N prompts (synthetic task: 20)",
                                              rich_help_panel=RUN)] = None,
    gen_length: Annotated[list[str] | None, typer.Option("--gen-length", help=f"response length budget(s); several "
                                                         f"give a sweep (default {DEFAULT_GEN_LENGTH})",
                                                         rich_help_panel=RUN)] = None,
    batch_size: Annotated[list[str] | None, typer.Option("--batch-size", help="prompts decoded together; several "
                                                         "give a row each (default 1, the paper's setting); auto: "
                                                         "as many as the memory holds (see --max-memory); with "
                                                         "--gen-length too, give both comma-separated",
                                                         rich_help_panel=RUN)] = None,
    max_memory: Annotated[str | None, typer.Option("--max-memory", help="with --batch-size auto: what the weights "
                                                   "and rows may take, e.g. 20GiB (default: a GPU's free memory, "
                                                   "or the available RAM)", rich_help_panel=RUN)] = None,
    set_options: Annotated[list[str] | None, panel_option(SetOpt, RUN)] = None,
    preset: Annotated[str | None, panel_option(PresetOpt, RUN)] = None,
    ablation: Annotated[bool, typer.Option("--ablation/--no-ablation", help="also time ReFusion recomputing the "
                                           "KV cache (kv_reuse=False), the paper's ablation",
                                           rich_help_panel=RUN)] = True,
    causal_fix: Annotated[bool, panel_option(CausalFixOpt, RUN)] = False,
    causal_first: Annotated[bool, panel_option(CausalFirstOpt, RUN)] = False,
    recheck: Annotated[bool, panel_option(RecheckOpt, RUN)] = False,
    sweep: Annotated[bool, typer.Option("--sweep", help="also time each decoder over a grid of its parallelism "
                                        "settings, a row each (refusion: k, b, τ_slot/τ_token; llada, dream: steps "
                                        "and threshold with cache), and write frontier.csv, frontier_tps.png and "
                                        "frontier_tpf.png; --set cannot fix a swept key",
                                        rich_help_panel=RUN)] = False,
    warmup: Annotated[int, typer.Option("--warmup", help="untimed decodes before each row",
                                        rich_help_panel=MEASURE)] = 1,
    repeats: Annotated[int, typer.Option("--repeats", help="timed decodes of every prompt",
                                         rich_help_panel=MEASURE)] = 1,
    seed: Annotated[int, panel_option(SeedOpt, MEASURE, help="seed of the sampling noise (prompt i uses seed + i)")] = 0,
    output: Annotated[Path, typer.Option("--output", "-o", **PATH_OPTION, help="directory for bench.csv, "
                                         "samples.csv, bench.md, run.json and the plots",
                                         rich_help_panel=MEASURE)] = Path("results/bench"),
    resume: Annotated[bool, typer.Option("--resume", help="continue the interrupted run in --output: keep its "
                                         "finished rows, measure the others (needs the same options and machine)",
                                         rich_help_panel=MEASURE)] = False,
    device: Annotated[str | None, panel_option(DeviceOpt, MACHINE)] = None,
    dtype: Annotated[str | None, panel_option(DtypeOpt, MACHINE)] = None,
    threads: Annotated[int | None, typer.Option("--threads", help="torch CPU threads",
                                                rich_help_panel=MACHINE)] = None,
    trust_remote_code: Annotated[bool, panel_option(TrustRemoteCodeOpt, MACHINE)] = False,
    stray: Annotated[list[str] | None, typer.Argument(
        hidden=True, show_default=False, metavar="VALUES",
        help="more values of --decoder, --gen-length, --model, --set")] = None,
) -> None:
    """Compare decoders' speed (TPS, tokens per forward, latency, memory) and accuracy on the same prompts."""
    # --tps names the measurement; it is the only one so far, so it is on whether given or not
    lengths, sizes = option_values(gen_length, "--gen-length"), option_values(batch_size, "--batch-size")
    if lengths and sizes and any(value.strip().isdigit() for value in split_commas(stray)):
        raise UserError("with both --gen-length and --batch-size, give each one's values comma-separated",
                        hint="e.g. --gen-length 128,256 --batch-size 1,8,32")
    values = route_stray_values(stray or [], MultiValues(option_values(decoder, "--decoder"),
                                                         list(model or []), split_commas(set_options),
                                                         gen_lengths=lengths or sizes), "refusion bench")
    if sizes and not lengths:  # the whole numbers after --batch-size were routed with it
        sizes, values.gen_lengths = values.gen_lengths, []
    batch_sizes = tuple(parse_batch_sizes(sizes)) or (1,)
    settings = bench_settings(values, preset, batch_sizes=batch_sizes, ablation=ablation, causal_fix=causal_fix,
                              max_memory=None if max_memory is None else parse_memory(max_memory),
                              causal_first=causal_first, recheck=recheck,
                              sweep=sweep, warmup=warmup,
                              repeats=repeats, seed=seed, device=device, dtype=dtype,
                              trust_remote_code=trust_remote_code)
    decoders = settings.decoders
    prompt_list = load_prompts(prompts, limit)
    checkpoints = resolve_models(settings)  # each checkpoint once, each decoder's fit checked: nothing loads yet
    entries = plan_entries(settings, checkpoints)
    if threads is not None:
        if threads < 1:
            raise UserError(f"--threads must be >= 1, got {threads}")
        cpus = os.cpu_count() or 1
        if threads > cpus:  # torch.set_num_threads with far too many threads crashes the process
            raise UserError(f"--threads {threads} is more than this machine's {cpus} CPU threads")
        torch.set_num_threads(threads)
    check_output_dir(output, hint="give a directory for bench.csv, bench.md and the plots")
    source = (f"{len(prompt_list)} prompts from {prompts}" if prompts is not None
              else f"the first {len(prompt_list)} problems of the synthetic task "
                   f"(evals/synthetic/{SYNTHETIC_TEST.name})")
    machine = bench_machine(settings.device, settings.dtype)
    record = run_record(settings, entries, prompt_list, source, limit=limit, threads=threads, machine=machine)
    earlier = load_earlier(output, record, entries) if resume else None
    notes = budget_notes(entries) if len(set(decoders)) > 1 else []
    run = BenchRun(settings, entries, len(prompt_list), output, source, machine, record, earlier, notes,
                   checkpoints)
    if earlier is not None and len(earlier.rows) == len(entries):
        run.write_report(interrupted=False)
        console.print(f"the run in {output} is complete ({len(entries)} rows): nothing to measure; rewrote "
                      f"{', '.join(run.written)} from {ROWS_FILE}", highlight=False, soft_wrap=True)
        return
    quiet_library_output()
    for note in notes:
        console.print(f"[yellow]note:[/] {note}", highlight=False, soft_wrap=True)
    run.execute(prompt_list)
    print_table(result_table(run.rows))
    console.print(models_line(run.rows), highlight=False, soft_wrap=True)
    console.print(machine_line(run.machine), highlight=False, soft_wrap=True)
    console.print(f"[dim]wrote {', '.join(run.written)} to {output}[/]", highlight=False, soft_wrap=True)


# ---------------------------------------------------------------------------------------------
# options with several values


def bench_settings(values: MultiValues, preset: str | None, **measuring: Any) -> BenchSettings:
    """The run's settings from the options: the decoders, checkpoints, --set values and preset in the grammar
    eval and chat share (:func:`~refusion_cli.decoding.spec.parse_decoder_options`), the lengths, ``measuring``."""
    choices = parse_decoder_options(values.decoders or DEFAULT_DECODERS, values.models, values.overrides, preset)
    one_model_each(choices, "refusion bench")
    return BenchSettings(
        decoders=tuple(choice.decoder for choice in choices),
        gen_lengths=tuple(parse_lengths(values.gen_lengths) or (DEFAULT_GEN_LENGTH,)),
        models={choice.decoder: choice.model for choice in choices if choice.model is not None},
        overrides={choice.decoder: dict(choice.overrides) for choice in choices if choice.overrides},
        preset=preset, **measuring)


def parse_lengths(values: list[str], option: str = "--gen-length") -> list[int]:
    """Whole numbers of ``option`` (their range is checked by BenchSettings)."""
    lengths = []
    for value in values:
        try:
            lengths.append(int(value))
        except ValueError:
            raise UserError(f"{option} must be a positive integer, got '{value}'") from None
    return lengths


def parse_batch_sizes(values: list[str]) -> list[int | str]:
    """--batch-size's whole numbers, and ``auto`` (:data:`AUTO_BATCH`)."""
    return [AUTO_BATCH if value.strip().lower() == AUTO_BATCH else parse_lengths([value], "--batch-size")[0]
            for value in values]


# ---------------------------------------------------------------------------------------------
# the run


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
                                 disable=not console.is_terminal)  # off a terminal: the row lines only
        self.task: TaskID | None = None

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

    def sample_done(self, sample: BenchSample) -> None:
        self.unwritten_samples.append(sample)
        self.write_samples()
        if self.task is not None:
            self.progress.advance(self.task)

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
    return (f"{row.decoder} @ {row.gen_length}: {row.tps:.1f} tok/s{speedup}, {row.tpf:.2f} tokens/forward, "
            f"p50 {row.latency_p50_ms:.0f} ms{accuracy}")


TERMINAL_HEADER = ["decoder", "len", "batch", "TPS", "thru", "× AR", "TPF", "fwd", "tok", "p50 ms", "p95 ms", "MiB",
                   "acc"]


def result_table(rows: list[BenchRow]) -> Table:
    """The terminal table, narrower than the Markdown one: no model column (see :func:`models_line`),
    whole numbers for counts and milliseconds."""
    title = ("Decoding speed (batch 1)" if all(row.batch_size == 1 for row in rows)
             else "Decoding speed (TPS: the paper's rule at batch 1; thru: tokens / wall time)")
    table = Table(title=title, title_justify="left", box=box.SIMPLE_HEAD, padding=0,
                  show_edge=False)
    for index, name in enumerate(TERMINAL_HEADER):
        table.add_column(name, justify="left" if index == 0 else "right", no_wrap=True)
    for row in rows:
        table.add_row(row.decoder, str(row.gen_length), str(row.batch_size), fmt(row.tps, 1), fmt(row.throughput, 1),
                      fmt(row.speedup_vs_ar, 2, "×"),
                      fmt(row.tpf), fmt(row.forwards, 0), fmt(row.tokens, 0), fmt(row.latency_p50_ms, 0),
                      fmt(row.latency_p95_ms, 0), fmt(row.peak_mem_mib, 1), percent(row.accuracy))
    return table


def models_line(rows: list[BenchRow]) -> str:
    """Each decoder's checkpoint; a label starts with its decoder's name ("refusion (recompute)", "llada steps=64")."""
    return "models: " + ", ".join(dict.fromkeys(f"{row.decoder.split(' ')[0]}={row.model}" for row in rows))
