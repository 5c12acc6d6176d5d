"""`refusion eval`: run benchmarks through lm-eval with one or more decoders; accuracy and TPS side by side.

A thin wrapper over :func:`refusion_cli.harness.runner.run_eval`: parses options, shows a progress
bar per benchmark and decoder, prints the summary tables. Without ``--output`` a run writes a new
``runs/eval-<date>-<time>/`` under the working directory, named before the run starts. Library chatter (lm-eval,
datasets, transformers progress bars and warnings) goes to ``<output>/eval.log``, not the terminal. ``--table1`` runs the
registry's Table 1 rows (``--rows``), each row's decoder on its checkpoint found under ``--checkpoints``. A run that
fails before it journals a sample removes the output folder it created (a folder it did not create is
kept: runs resume from the samples there). ``--download`` fetches missing benchmark files from the hub
while the run is planned, one line per file; ``--limit 0`` stops after planning, before the output
folder exists.
"""

from __future__ import annotations

import contextlib
import io
import os
import shutil
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any, TextIO

import typer
from rich import box
from rich.console import Group
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn
from rich.table import Table
from rich.text import Text

from refusion_cli.cli.libraries import libraries_imported
from refusion_cli.cli.options import (DECODER_NAMES, LIST_HELP, PATH_OPTION, CausalFirstOpt, CausalFixOpt, DecodersOpt,
                                      DeviceOpt, DtypeOpt, ModelsOpt, MultiValues, PresetOpt, RecheckOpt, SeedOpt,
                                      SetOpt, TrustRemoteCodeOpt, panel_option, route_stray_values, split_commas)
from refusion_cli.cli.output import console, debug_enabled, print_table
from refusion_cli.decoding.spec import PRESET_DECODER
from refusion_cli.distributed import leave_process_group
from refusion_cli.errors import UserError
from refusion_cli.harness.manifest import EvalProtocol, read_manifest, table1_rows

if TYPE_CHECKING:
    from refusion_cli.harness.runner import RunResult, Table1Selection
    from refusion_cli.harness.suite import Benchmark

WHAT = "What to run"
# the benchmarks of the registry (evals/suite.yaml), each by its short name
TASK_HELP = (f"benchmark: {', '.join(read_manifest()['benchmarks'])} (or its lm-eval name), paper (the seven of "
             "Table 1), all")
TABLE1_ROWS = len(read_manifest()["table1"]["rows"])
HOW = "Decoder settings"
WHERE = "Data and output"


def evaluate(
    task: Annotated[list[str] | None, typer.Option("--task", "-t", help=TASK_HELP + LIST_HELP + " (with --table1 "
                                                   "default: paper)", rich_help_panel=WHAT)] = None,
    decoder: Annotated[list[str] | None, panel_option(DecodersOpt, WHAT, help=f"{DECODER_NAMES}{LIST_HELP} (default: refusion)")] = None,
    model: Annotated[list[str] | None, panel_option(ModelsOpt, WHAT, "-m")] = None,
    table1: Annotated[bool, typer.Option("--table1", help="the paper's Table 1: each row's decoder on its "
                                         "checkpoint (and adapter) as evals/suite.yaml names them, on the seven "
                                         "benchmarks unless --task says otherwise", rich_help_panel=WHAT)] = False,
    checkpoints: Annotated[Path | None, typer.Option("--checkpoints", **PATH_OPTION, help="with --table1: the "
                                                     "folder holding each row's checkpoint and adapter under its "
                                                     "hub name (DIR/LLaDA-8B-Instruct, "
                                                     "DIR/D2F_LLaDA_Instruct_8B_Lora; default: the hub ids)",
                                                     rich_help_panel=WHAT)] = None,
    rows: Annotated[list[str] | None, typer.Option("--rows", help="with --table1: the rows to run, each by its "
                                                   f"number (1-{TABLE1_ROWS}) or name as evals/suite.yaml lists "
                                                   "them (default: all)" + LIST_HELP, rich_help_panel=WHAT)] = None,
    limit: Annotated[int | None, typer.Option("--limit", help="first N documents of each lm-eval task (0: check "
                                              "the data and tasks, with --download fetch the data, evaluate "
                                              "nothing)", rich_help_panel=WHAT)] = None,
    protocol: Annotated[EvalProtocol, typer.Option("--protocol", help="whose task definitions: paper (the paper's "
                                                   "prompts, answer handling and scoring) or lm-eval (the installed "
                                                   "lm-eval's own tasks)", rich_help_panel=WHAT)] = EvalProtocol.PAPER,
    preset: Annotated[str | None, panel_option(PresetOpt, HOW, help="named settings for every task, for each decoder that has them "
                      "(default: the task's preset from evals/suite.yaml, where the decoder has it)")] = None,
    set_: Annotated[list[str] | None, panel_option(SetOpt, HOW)] = None,
    batch_size: Annotated[str, typer.Option("--batch-size", help="requests decoded together (answers: batch 1's "
                                            "up to float rounding; above 1 a throughput table too), or auto: "
                                            "the largest batch that fits the memory (see --max-memory)",
                                            rich_help_panel=HOW)] = "1",
    max_memory: Annotated[str | None, typer.Option("--max-memory", help="with --batch-size auto: what the weights "
                                                   "and the decoding rows may take, e.g. 20GiB (default: a GPU's "
                                                   "free memory, or the RAM available)", rich_help_panel=HOW)] = None,
    causal_fix: Annotated[bool, panel_option(CausalFixOpt, HOW)] = False,
    causal_first: Annotated[bool, panel_option(CausalFirstOpt, HOW)] = False,
    recheck: Annotated[bool, panel_option(RecheckOpt, HOW)] = False,
    seed: Annotated[int, panel_option(SeedOpt, HOW, help="per-request generator seed and lm-eval's task seed")] = 0,
    device: Annotated[str | None, panel_option(DeviceOpt, HOW)] = None,
    dtype: Annotated[str | None, panel_option(DtypeOpt, HOW)] = None,
    trust_remote_code: Annotated[bool, panel_option(TrustRemoteCodeOpt, HOW)] = False,
    output: Annotated[Path | None, typer.Option("--output", "-o", **PATH_OPTION, help="run directory; rerunning "
                                                "into it resumes (default: a new runs/eval-<date>-<time>/ under the "
                                                "working directory)", rich_help_panel=WHERE)] = None,
    data_dir: Annotated[Path | None, typer.Option("--data-dir", **PATH_OPTION, help="folder of local benchmark "
                                                  "files, laid out as in evals/README.md (default: evals/data)",
                                                  rich_help_panel=WHERE)] = None,
    data_file: Annotated[list[str] | None, typer.Option("--data-file", help="TASK=PATH: the one local data file of "
                                                        "a task", rich_help_panel=WHERE)] = None,
    download: Annotated[bool, typer.Option("--download", help="first fetch the selected benchmarks' files missing "
                                           "from the data dir from the Hugging Face hub (files already there are "
                                           "used as they are)", rich_help_panel=WHERE)] = False,
    confirm_run_unsafe_code: Annotated[bool, typer.Option("--confirm-run-unsafe-code", help="allow HumanEval / MBPP "
                                                          "to execute model-written code (sandboxed)",
                                                          rich_help_panel=WHERE)] = False,
    allow_unjailed: Annotated[bool, typer.Option("--allow-unjailed", help="where no bubblewrap jail can be made, "
                                                 "run candidates with weaker isolation (as REFUSION_ALLOW_UNJAILED=1)",
                                                 rich_help_panel=WHERE)] = False,
    more: Annotated[list[str] | None, typer.Argument(hidden=True, show_default=False)] = None,
) -> None:
    """Evaluate decoders on the paper's benchmarks (offline, local data) and report accuracy / TPS."""
    with libraries_imported():
        from refusion_cli.harness.suite import load_suite

    suite = load_suite(protocol=protocol)
    task_names = frozenset({*suite.benchmarks, *(b.lm_eval_task for b in suite.benchmarks.values()), "paper", "all"})
    stray, selection = _table1_selection(table1, checkpoints, rows, more or [])
    decoders = split_commas(decoder) or ([] if table1 else [PRESET_DECODER])
    values = route_stray_values(stray, MultiValues(decoders, list(model or []), split_commas(set_),
                                                   tasks=split_commas(task), task_names=task_names), "refusion eval")
    if not values.tasks and not table1:
        raise UserError("--task is missing", hint=f"give a benchmark ({', '.join(suite.benchmarks)}), paper or all; "
                                                  "or --table1 for the paper's Table 1")
    # every benchmark reads local files; --download fetches them in a child process started without this
    # variable (harness/download.py, fetch_split), so this process stays offline
    os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
    if allow_unjailed:  # read where candidates run (harness/sandbox.py), in every process of the run
        from refusion_cli.harness.sandbox import ALLOW_UNJAILED_ENV

        os.environ[ALLOW_UNJAILED_ENV] = "1"
    with libraries_imported():
        from refusion_cli.harness.runner import (EvalOptions, default_output, has_results, make_output, plan_eval,
                                                 run_eval)

    if output is None and int(os.environ.get("WORLD_SIZE", "1")) > 1:  # each process would pick its own folder
        raise UserError("under accelerate launch or torchrun, give --output: every process writes to that folder")
    run_dir = output or default_output()
    options = EvalOptions(
        tasks=values.tasks or ["paper"], decoders=values.decoders, output=run_dir, models=values.models,
        overrides=values.overrides, table1=selection,
        preset=preset, limit=limit, data_dir=data_dir, data_files=list(data_file or []), download=download,
        confirm_run_unsafe_code=confirm_run_unsafe_code, device=device, dtype=dtype, seed=seed,
        trust_remote_code=trust_remote_code, batch_size=batch_size, max_memory=max_memory, causal_fix=causal_fix, causal_first=causal_first,
        recheck=recheck, protocol=protocol,
    )
    main_process = int(os.environ.get("RANK", "0")) == 0
    planning = io.StringIO()  # datasets' "Generating test split" bars and the like, for eval.log
    with _stderr_to(planning):  # every option, data file and task is checked before anything is written
        plan = plan_eval(options, suite, say=_note)
    if main_process:
        for row, checkpoint in plan.table1:
            _note(f"Table 1 row {row.number}, {row.name}: {row.decoder} on {checkpoint}")
    if limit == 0:
        if main_process:
            _note(f"--limit 0: the data and tasks of {', '.join(b.name for b in plan.benchmarks)} are ready; "
                  "nothing was evaluated")
        return
    created = make_output(run_dir)
    if output is None and main_process:
        _note(f"writing to {run_dir}/")
    if plan.sandbox is not None and main_process:
        console.print(f"[dim]{plan.sandbox}[/]", highlight=False, soft_wrap=True)
    view = EvalView() if main_process else None
    try:
        with view or contextlib.nullcontext(), _library_output(run_dir, planning.getvalue()):
            results = run_eval(options, view, plan=plan)
        leave_process_group()  # every process is done before any exits
    except (Exception, KeyboardInterrupt) as exc:
        if main_process and created and not has_results(run_dir):
            shutil.rmtree(run_dir, ignore_errors=True)  # only eval.log and tasks/: nothing to resume from
        elif main_process and isinstance(exc, KeyboardInterrupt):
            console.print(f"[yellow]interrupted[/]: finished samples are kept in {run_dir}/samples; "
                          "run the same command again to resume", highlight=False, soft_wrap=True)
        raise
    if main_process:
        _print_summary(results, run_dir)


def _table1_selection(table1: bool, checkpoints: Path | None, rows: list[str] | None,
                      stray: list[str]) -> tuple[list[str], Table1Selection | None]:
    """``--table1``'s selection, with the row numbers and names listed after ``--rows`` taken from ``stray``; the
    rest of ``stray``. ``--checkpoints`` and ``--rows`` only go with ``--table1``."""
    from refusion_cli.harness.runner import Table1Selection

    for given, option in ((checkpoints is not None, "--checkpoints"), (rows is not None, "--rows")):
        if given and not table1:
            raise UserError(f"{option} goes with --table1", hint="add --table1 to run the paper's Table 1 rows")
    if not table1:
        return stray, None
    chosen = split_commas(rows)
    if rows is not None:
        names = {key for row in table1_rows() for key in (str(row.number), row.name.lower())}
        chosen += [value for value in split_commas(stray) if value.lower() in names]
        stray = [value for value in split_commas(stray) if value.lower() not in names]
        if not chosen:
            raise UserError("--rows is empty", hint="leave --rows out for every row")
    return stray, Table1Selection(tuple(chosen), checkpoints)


def _note(text: str) -> None:
    console.print(text, highlight=False, soft_wrap=True)


@contextlib.contextmanager
def _library_output(run_dir: Path, earlier: str = ""):
    """Send what libraries write to stderr (progress bars, warnings) to <run>/eval.log, after
    ``earlier`` (what they wrote while the run was planned, before the folder existed)."""
    with (run_dir / "eval.log").open("a", encoding="utf-8") as log:
        log.write(earlier)
        with _stderr_to(log):
            yield


@contextlib.contextmanager
def _stderr_to(stream: TextIO):
    """What lm-eval, datasets, transformers and Accelerate write to stderr goes to ``stream`` instead."""
    import logging

    if debug_enabled():
        yield
        return
    loggers = [logging.getLogger(name) for name in ("lm_eval", "datasets", "transformers", "accelerate")]
    for logger in loggers:
        logger.setLevel(logging.WARNING)
    # handlers made at import hold the terminal's stderr (datasets' prints pyarrow's parse errors): use the log
    handlers = [h for logger in loggers for h in logger.handlers if type(h) is logging.StreamHandler]
    originals = [handler.stream for handler in handlers]
    with contextlib.redirect_stderr(stream):
        try:
            for handler in handlers:
                handler.stream = stream  # not setStream: that flushes the old stream, which may be closed
            yield
        finally:
            for handler, original in zip(handlers, originals):
                handler.stream = original


class EvalView:
    """Rich progress for the runner's reports (an EvalObserver), on the main process only."""

    def __init__(self) -> None:
        self.progress = Progress(
            TextColumn("[bold]{task.description}"), BarColumn(bar_width=12), MofNCompleteColumn(),
            TextColumn("acc {task.fields[accuracy]}"), TextColumn("{task.fields[tps]} tok/s"),
            TimeRemainingColumn(elapsed_when_finished=True), console=console,  # fits 80 columns
        )
        self.task: Any = None
        self.scores: list[float] = []
        self.tokens, self.seconds = 0, 0.0  # the run's totals so far: TPS as the summary counts it
        self.description = ""
        self.started = False

    def __enter__(self) -> EvalView:
        return self

    def __exit__(self, *exc: object) -> None:
        if self.started:
            self.progress.stop()

    def on_run_start(self, benchmark: Benchmark, label: str, config: Any) -> None:
        if not self.started:  # only once the run is under way: a plan error prints nothing else
            self.progress.start()
            self.started = True
        self.description = f"{benchmark.name} · {label}"
        self.scores, self.tokens, self.seconds = [], 0, 0.0

    def on_requests(self, total: int, stored: int, other_settings: int) -> None:
        if other_settings:
            self.progress.console.print(f"{self.description}: {other_settings} sample(s) here were decoded with "
                                        "other settings; they stay in samples/ but this run replaces their cell "
                                        "in the summary (another --output keeps both)", highlight=False, soft_wrap=True)
        if stored:
            self.progress.console.print(f"{self.description}: resuming, {stored} of {total} samples already done",
                                        highlight=False, soft_wrap=True)
        self.task = self.progress.add_task(self.description, total=total, completed=stored, accuracy="-", tps="-")

    def on_sample(self, record: dict[str, Any]) -> None:
        self.scores.append(record["score"])
        self.tokens += record["tokens"]
        self.seconds += record["seconds"]
        accuracy = 100 * sum(self.scores) / len(self.scores)
        self.progress.update(self.task, advance=1, accuracy=f"{accuracy:.1f}%",
                             tps=f"{self.tokens / self.seconds:,.0f}" if self.seconds > 0 else "-")

    def on_run_end(self, result: RunResult) -> None:
        if self.task is not None:
            self.progress.update(self.task, accuracy=f"{result.accuracy:.1f}%", tps=f"{result.tps:,.0f}")
        if result.prompts_cut:
            self.progress.console.print(
                f"[yellow]{self.description}: {result.prompts_cut} of {result.samples} prompt(s) were longer than the "
                f"model's positions leave room for beside a {result.config['gen_length']}-token response; their "
                "start was cut[/] (prompt_cut in the samples)", highlight=False, soft_wrap=True)
        for note in result.batch_notes:
            self.progress.console.print(f"[dim]{self.description}: {note}[/]", highlight=False, soft_wrap=True)


def summary_view(cells: list[RunResult]) -> tuple[list[Group], list[Text]]:
    """The summary's tables and numbered notes as the terminal shows them (``report.console_summary``): each
    table under its title, its columns apart by their padding alone, so Table 1's nine rows keep to one line
    each in 100 columns; numbers to the right, names and words to the left."""
    from refusion_cli.harness.report import console_summary

    summary = console_summary(cells)
    views = []
    for table in summary.tables:
        view = Table(box=box.SIMPLE_HEAD, show_edge=False, pad_edge=False, collapse_padding=True)
        for index, header in enumerate(table.headers):
            numbers = not any(character.isalpha() for row in table.rows for character in row[index])
            view.add_column(header, justify="right" if numbers else "left", no_wrap=not numbers)
        for row in table.rows:
            view.add_row(*(Text(cell) for cell in row))  # a model path with "[...]" in it is text, not markup
        views.append(Group(Text(table.title, style="bold"), view))
    return views, [Text(f"{number}. {note}") for number, note in enumerate(summary.notes, start=1)]


def _print_summary(results: list[RunResult], run_dir: Path) -> None:
    """The folder's tables (this run's cells and those earlier runs left there): Table 1's rows in narrow tables
    with numbered notes; summary.md holds every table complete, summary.csv a line per cell."""
    from refusion_cli.harness.report import CSV_FILE, MARKDOWN_FILE, METRICS_FILE, read_results

    cells = read_results(run_dir) or results
    tables, notes = summary_view(cells)
    for view in tables:
        print_table(view)
    for note in notes:  # wrapped at a terminal's width, whole lines in a file
        console.print(note, highlight=False, soft_wrap=not console.is_terminal)
    if len(cells) > len(results):
        console.print(f"{len(cells) - len(results)} cell(s) above come from earlier runs into this folder",
                      highlight=False, soft_wrap=True)
    resumed = sum(r.resumed for r in results)
    if resumed:
        console.print(f"{resumed} sample(s) were read back from earlier runs, not decoded again", highlight=False,
                      soft_wrap=True)
    console.print(f"results in {run_dir}/: {METRICS_FILE}, {CSV_FILE}, {MARKDOWN_FILE}, samples/", highlight=False,
                  soft_wrap=True)
