"""What ``refusion eval`` is asked, read before anything is planned: :class:`EvalOptions` (``--table1``:
:class:`Table1Selection`), the decoder runs they make (:class:`DecoderRun`, one per decoder, checkpoint and
ReFusion variant), Table 1's checkpoint folders, and the checks of the paths given (``--output``, ``--data-dir``,
``--data-file``). ``runner`` plans and runs the evaluation from them.
"""

from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from refusion_cli.decoding.config import ConfigError
from refusion_cli.decoding.memory import parse_memory
from refusion_cli.decoding.spec import PRESET_DECODER, DecoderChoice, parse_assignments
from refusion_cli.decoding.variants import PAPER, Variant, variant_label
from refusion_cli.errors import UserError
from refusion_cli.harness.manifest import EvalProtocol, Table1Row
from refusion_cli.harness.model_args import AUTO, batch_size_value
from refusion_cli.harness.report import METRICS_FILE, read_results
from refusion_cli.models.checkpoint import checkpoint_label
from refusion_cli.paths import fresh_run_dir

if TYPE_CHECKING:
    from refusion_cli.harness.suite import Benchmark, RenderedTask


@dataclass(frozen=True)
class Table1Selection:
    """``refusion eval --table1``: the paper's Table 1 rows, each its own decoder on its checkpoint (and adapter)
    as the registry names them (``manifest.table1``)."""

    rows: tuple[str, ...] = ()  # each a row's number or name (``--rows``); empty: all nine
    checkpoints: Path | None = None  # the folder holding each checkpoint and adapter under its hub name; None: the hub


@dataclass(frozen=True)
class EvalOptions:
    tasks: list[str]  # benchmark names as the user gave them (short, lm-eval, "paper", "all")
    decoders: list[str]  # empty with table1 (each row names its own)
    output: Path
    models: list[str] = field(default_factory=list)  # "PATH" (every decoder) or "decoder=PATH"
    overrides: list[str] = field(default_factory=list)  # "key=value" or "decoder.key=value"
    preset: str | None = None  # a preset for every benchmark, of each decoder that has it (default: the suite's)
    limit: int | None = None  # documents per lm-eval task (0: plan and check only, evaluate nothing)
    data_dir: Path | None = None
    data_files: list[str] = field(default_factory=list)  # "benchmark=PATH"
    download: bool = False  # fetch the benchmark files missing under data_dir from the hub while planning
    confirm_run_unsafe_code: bool = False
    device: str | None = None
    dtype: str | None = None
    seed: int = 0
    trust_remote_code: bool = False
    batch_size: int | str = 1  # requests decoded together (answers: batch 1's up to float rounding), or "auto"
    max_memory: str | None = None  # with batch_size "auto": what the weights and rows may take ("20GiB")
    causal_fix: bool = False  # also evaluate ReFusion with causal_fix=True (decoding.variants)
    causal_first: bool = False  # also evaluate ReFusion with causal_first=True (and both, with causal_fix)
    recheck: bool = False  # also evaluate ReFusion with recheck=True (and all three, with the other two)
    protocol: EvalProtocol = EvalProtocol.PAPER  # whose task definitions: the paper's runs or lm-eval's own
    table1: Table1Selection | None = None  # the decoders and models are Table 1's rows (None: decoders and models)

    def __post_init__(self) -> None:
        if self.table1 is not None and (self.decoders or self.models):
            raise UserError("--table1 runs each row's own decoder on its own checkpoint; it takes no --decoder or "
                            "--model", hint="pick rows with --rows, and give their folder with --checkpoints")
        try:
            object.__setattr__(self, "protocol", EvalProtocol(self.protocol))
        except ValueError:
            raise UserError(f"unknown protocol '{self.protocol}'; choose from "
                            f"{', '.join(p.value for p in EvalProtocol)}") from None
        try:
            object.__setattr__(self, "batch_size", batch_size_value(self.batch_size))
            if self.max_memory is not None:
                parse_memory(self.max_memory)
        except ConfigError as error:
            raise UserError(f"--{str(error).replace('_', '-')}") from None
        if self.max_memory is not None and self.batch_size != AUTO:
            raise UserError("--max-memory bounds --batch-size auto", hint="add --batch-size auto, or leave --max-memory out")


@dataclass(frozen=True)
class DecoderRun:
    decoder: str
    model: str
    label: str  # "decoder:model" ("refusion (recheck):model" for a variant), the summary row
    file_label: str  # the label as a file name
    choice: DecoderChoice  # the decoder options as given (preset, --set)
    variant: Variant = PAPER  # ReFusion's decoding variant (decoding.variants)

    def config(self, benchmark: Benchmark) -> Any:
        """The decoder config for one benchmark: the ``--preset`` or the benchmark's own preset, the
        benchmark's response budget, then the ``--set`` overrides."""
        return self.choice.config(benchmark.gen_length, preset=benchmark.preset)


# --- option parsing ----------------------------------------------------------------------------


def default_output() -> Path:
    """Where a run without ``--output`` writes: a fresh ``runs/eval-<date>-<time>/`` (never ``results/``)."""
    return fresh_run_dir("eval")


def decoder_runs(choices: list[DecoderChoice], variants: list[Variant] | None = None) -> list[DecoderRun]:
    """The summary row label of each decoder and its checkpoint (``decoder:model``, the checkpoint's
    :func:`~refusion_cli.models.checkpoint.checkpoint_label`). ReFusion's ``variants`` follow its own row,
    each a row of its own ("refusion (recheck):model")."""
    runs = []
    for choice in choices:
        model = choice.checkpoint
        for variant in [PAPER, *(variants or [])] if choice.decoder == PRESET_DECODER else [PAPER]:
            label = f"{variant_label(choice.decoder, variant)}:{checkpoint_label(model)}"
            runs.append(DecoderRun(choice.decoder, model, label,
                                   re.sub(r"[^A-Za-z0-9_.-]", "_", label.replace(":", "__")), choice, variant))
    return runs


def check_same_settings(output: Path, runs: list[DecoderRun], benchmarks: dict[str, Benchmark], seed: int) -> None:
    """A folder's row holds cells of one setting: every cell ``output`` already has under a label this run writes
    must have the config this run gives that cell's benchmark, and its seed; else the rerun is refused (one line)
    before anything is written, where it would replace some of the row's cells and leave the others."""
    for cell in read_results(output):
        run = next((run for run in runs if run.label == cell.label), None)
        benchmark = benchmarks.get(cell.benchmark)
        if run is None or benchmark is None:
            continue
        config = dataclasses.asdict(run.config(benchmark))
        changed = [f"{key} {cell.config[key]} there, {value} here" for key, value in config.items()
                   if key in cell.config and cell.config[key] != value]  # a field newer than the cell: its default
        if cell.seed is not None and cell.seed != seed:
            changed.append(f"seed {cell.seed} there, {seed} here")
        if changed:
            raise UserError(f"--output {output} holds {cell.label} on {cell.benchmark} with other settings "
                            f"({'; '.join(changed)}); a folder keeps one setting per row",
                            hint="give another --output (without it each run writes a new folder under runs/)")


def table1_models(rows: list[Table1Row], checkpoints: Path | None) -> list[str]:
    """Each row's ``DECODER=CHECKPOINT`` (``BASE+ADAPTER`` for an adapter row): its folders under ``checkpoints``,
    named as their hub ids' names (``DIR/LLaDA-8B-Instruct+DIR/D2F_LLaDA_Instruct_8B_Lora``), or with no folder the
    hub ids. A folder that is not there is one error naming each row that lacks one, before anything loads."""
    if checkpoints is None:
        return [f"{row.decoder}={'+'.join(name for name in (row.checkpoint, row.adapter) if name)}" for row in rows]
    root = checkpoints.expanduser()
    if not root.is_dir():
        raise UserError(f"--checkpoints {checkpoints} does not exist or is not a directory",
                        hint="give the folder that holds each row's checkpoint under its hub name")
    if "+" in str(root) and any(row.adapter for row in rows):
        raise UserError(f"--checkpoints {checkpoints}: the path holds '+', which joins a base and its adapter "
                        "(BASE+ADAPTER)", hint="move or link the folder to a path without '+'")
    missing: dict[Path, list[Table1Row]] = {}  # a folder that is not there -> the rows that need it
    for row in rows:
        for folder in row.folders:
            if not (root / folder).is_dir():
                missing.setdefault(root / folder, []).append(row)
    if missing:
        lacks = "; ".join(f"{path} for row{'s' if len(needing) > 1 else ''} "
                          f"{', '.join(str(row.number) for row in needing)} ({', '.join(row.name for row in needing)})"
                          for path, needing in missing.items())
        raise UserError(f"--checkpoints {checkpoints} lacks {len(missing)} folder(s) of Table 1's rows: {lacks}",
                        hint="put each checkpoint and adapter there in a folder named as its hub id's last part "
                             "(docs/checkpoints.md), or pick the rows you have with --rows")
    return [f"{row.decoder}={'+'.join(str(root / folder) for folder in row.folders)}" for row in rows]


def data_file_options(values: list[str], benchmarks: list[Benchmark]) -> dict[str, Path]:
    names = {b.name: b for b in benchmarks} | {b.lm_eval_task: b for b in benchmarks}
    given: dict[str, str] = {}
    for key, path in parse_assignments(values, "--data-file"):
        if key not in names:
            raise UserError(f"--data-file {key}=...: '{key}' is not one of the selected tasks ({', '.join(b.name for b in benchmarks)})")
        name = names[key].name
        if given.get(name, path) != path:
            raise UserError(f"--data-file gives {name} two files: {given[name]} and {path}")
        given[name] = path
    return {name: Path(path).expanduser() for name, path in given.items()}


def check_data_dir(data_dir: Path, rendered: dict[str, RenderedTask], download: bool = False) -> None:
    """``--data-dir`` must exist (or, with ``download``, not be a file: it is created) and hold a file
    that a selected benchmark reads."""
    root = data_dir.expanduser()
    if not root.is_dir() and not (download and not root.exists()):
        raise UserError(f"--data-dir {data_dir} does not exist or is not a directory",
                        hint="give the folder holding the benchmark files, laid out as in evals/README.md")
    if not any(root.resolve() in path.parents for task in rendered.values() for path in task.data_files):
        raise UserError(f"--data-dir {data_dir} has no effect: no selected task ({', '.join(rendered)}) reads a "
                        "file from it", hint="drop --data-dir; --data-file TASK=PATH replaces the file of one task")


def make_output(output: Path) -> bool:
    """Create the run directory; True when this call created it (so a failed run may remove it)."""
    if output.is_dir():
        return False
    try:
        output.mkdir(parents=True)
    except FileExistsError:
        return False  # another process of a data-parallel run made it first
    except OSError as exc:
        raise UserError(f"cannot create the output directory {output}: {exc.strerror}",
                        hint="pick a folder you can write to") from None
    return True


def has_results(output: Path) -> bool:
    """Whether ``output`` holds a journaled sample or a report (what a rerun resumes from)."""
    if (output / METRICS_FILE).exists():
        return True
    samples = output / "samples"
    return samples.is_dir() and any(p.is_file() and p.stat().st_size > 0 for p in samples.rglob("*"))
