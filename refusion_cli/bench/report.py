"""The benchmark's files: CSV rows written as they are measured, then a Markdown report and plots.

Files under the output directory (``results/bench/`` by default; replaced by each run that
finishes at least one row, continued by ``--resume``, see ``refusion_cli.cli.bench.BenchRun``):

- ``run.json``     what decides what the rows measure (settings, planned rows, prompts) and the
                   machine, written with the first row; ``--resume`` checks it (``resume.py``);
- ``bench.csv``    one row per decoder and response length (:class:`~refusion_cli.bench.runner.BenchRow`),
                   appended and flushed as each row finishes, so an interrupted run keeps its rows;
- ``samples.csv``  one row per measured decode (timings, counts, correctness, the decoded text),
                   likewise written as each decode finishes;
- ``bench.md``     the machine, the settings, the counting rule, the table, the KV-reuse ablation,
                   the decoder configs and the plots;
- ``machine.json`` the machine as data;
- ``frontier.png`` accuracy against TPS (only when prompts have targets; not with ``--sweep``);
- ``frontier.csv``, ``frontier_tps.png``, ``frontier_tpf.png`` (``--sweep``, prompts with targets): each
                   decoder's settings with accuracy, TPS and tokens per forward, and its Pareto fronts
                   (``refusion_cli.bench.frontier``);
- ``tps_vs_gen_length.png`` TPS and median latency against the response length (two lengths or more).

:func:`read_records` reads a CSV file back for ``--resume``: every record must be byte for byte
what :class:`CsvRows` writes for its values, except a last one cut mid-write, which is left out.
"""

from __future__ import annotations

import csv
import dataclasses
import io
import json
import types
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any, get_type_hints

from refusion_cli.bench.figures import attention_cell
from refusion_cli.bench.frontier import FRONTIER_CSV, FrontierPoint
from refusion_cli.bench.machine import Machine
from refusion_cli.bench.runner import RECOMPUTE, BenchRow, BenchSample
from refusion_cli.decoding.spec import PRESET_DECODER
from refusion_cli.errors import UserError

ROWS_FILE = "bench.csv"
SAMPLES_FILE = "samples.csv"
REPORT_FILE = "bench.md"
MACHINE_FILE = "machine.json"
RUN_FILE = "run.json"
ROW_FIELDS = [f.name for f in dataclasses.fields(BenchRow)]
SAMPLE_FIELDS = [f.name for f in dataclasses.fields(BenchSample)]

COUNTING_RULE = (
    "TPS = response tokens up to and including the first EOS ÷ wall time of the decode call (batch 1, "
    "device synchronised at both ends), the same rule for every decoder; forwards = every model call; "
    "tokens/forward = tokens ÷ forwards. Each column is the mean over the row's measured decodes of the "
    "per-decode value; latency percentiles are over the decode wall times."
)


class CsvRows:
    """A CSV file written one row at a time, flushed after each row.

    ``keep``: continue a file this class wrote, cut to its first ``keep`` bytes (its header and the
    records to keep, :attr:`CsvRecords.ends`); 0 starts the file afresh.
    """

    def __init__(self, path: Path, fields: Sequence[str], keep: int = 0):
        path.parent.mkdir(parents=True, exist_ok=True)
        self.path = path
        if keep:
            with path.open("r+b") as raw:
                raw.truncate(keep)
        self._handle: IO[str] = path.open("a" if keep else "w", newline="", encoding="utf-8")
        self._writer = csv.DictWriter(self._handle, fieldnames=list(fields))
        if not keep:
            self._writer.writeheader()
        self._handle.flush()

    def write(self, record: dict[str, Any]) -> None:
        self._writer.writerow({key: csv_value(value) for key, value in record.items()})
        self._handle.flush()

    def close(self) -> None:
        self._handle.close()

    def __enter__(self) -> CsvRows:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def csv_value(value: Any) -> Any:
    if value is None:
        return ""
    if isinstance(value, float):
        return round(value, 6)
    return value


@dataclass
class CsvRecords:
    """The records of a file :class:`CsvRows` wrote, and where each ends in it."""

    records: list[dict[str, str]]
    ends: list[int]  # bytes from the file's start: ends[0] after the header (0 when it was cut), ends[i] after record i


def csv_line(values: Sequence[str]) -> str:
    """One record as :class:`CsvRows` writes it (csv's default dialect: minimal quoting, CRLF)."""
    buffer = io.StringIO(newline="")
    csv.writer(buffer).writerow(values)
    return buffer.getvalue()


def cut_mid_write(rest: str) -> bool:
    """Whether ``rest``, the file after its last good record, is one record cut mid-write: no line end, or
    one inside a quoted value that was never closed."""
    if not rest.endswith("\r\n"):
        return True
    try:
        list(csv.reader(io.StringIO(rest, newline=""), strict=True))
    except csv.Error:
        return True
    return False


def read_records(path: Path, fields: Sequence[str]) -> CsvRecords:
    """Read back a file :class:`CsvRows` wrote with ``fields`` (a missing file reads as an empty one).

    A last record cut mid-write (the process killed while writing it; a cut header reads as no
    records) is left out. Any other record that is not exactly what CsvRows writes, or does not
    have one value per field, is a UserError naming the file and record.
    """
    data = path.read_bytes() if path.exists() else b""
    text = data.decode("utf-8", errors="surrogateescape")  # bytes of a cut character stay in the cut record
    try:
        parsed = list(csv.reader(io.StringIO(text, newline="")))
    except csv.Error as exc:
        raise UserError(f"cannot resume from {path}: it is not a CSV file ({exc})") from None
    records: list[dict[str, str]] = []
    ends: list[int] = []
    at = end = 0  # characters and bytes read so far
    for number, values in enumerate(parsed):
        line = csv_line(values)
        if not text.startswith(line, at):
            if number == len(parsed) - 1 and cut_mid_write(text[at:]):
                break
            raise UserError(f"cannot resume from {path}: {record_name(number)} is not as this toolkit writes it")
        try:
            end += len(line.encode("utf-8"))
        except UnicodeEncodeError:
            raise UserError(f"cannot resume from {path}: {record_name(number)} is not UTF-8") from None
        if number == 0 and values != list(fields):
            raise UserError(f"cannot resume from {path}: its columns are not the ones this version writes")
        if len(values) != len(fields):
            raise UserError(f"cannot resume from {path}: {record_name(number)} has {len(values)} values, "
                            f"not {len(fields)}")
        if number:
            records.append(dict(zip(fields, values)))
        at += len(line)
        ends.append(end)
    return CsvRecords(records, ends or [0])


def record_name(number: int) -> str:
    return "the header" if number == 0 else f"record {number}"


def row_from_record(record: dict[str, str]) -> BenchRow:
    """A :class:`BenchRow` from its bench.csv record (floats as rounded there); ValueError when a value does
    not parse."""
    values: dict[str, Any] = {}
    for name, hint in get_type_hints(BenchRow).items():
        kinds = getattr(hint, "__args__", (hint,))  # float | None -> (float, NoneType); float -> (float,)
        text = record.get(name, "")  # a column an earlier bench.csv lacks reads as not measured
        if text == "" and types.NoneType in kinds:
            values[name] = None  # csv_value wrote None as ""
        else:
            values[name] = next(kind for kind in kinds if kind is not types.NoneType)(text)
    return BenchRow(**values)


def ablation_ratios(rows: Sequence[BenchRow]) -> dict[int, float]:
    """gen_length -> TPS with KV reuse ÷ TPS when recomputing (rows holding both)."""
    reuse = {row.gen_length: row.tps for row in rows if row.decoder == PRESET_DECODER}
    recompute = {row.gen_length: row.tps for row in rows if row.decoder == PRESET_DECODER + RECOMPUTE}
    return {length: reuse[length] / recompute[length] for length in reuse
            if length in recompute and recompute[length] > 0}


def fmt(value: float | None, digits: int = 2, suffix: str = "") -> str:
    return "–" if value is None else f"{value:.{digits}f}{suffix}"


def percent(value: float | None) -> str:
    return "–" if value is None else f"{value * 100:.1f}%"


TABLE_HEADER = ["decoder", "model", "settings", "gen length", "batch", "TPS", "TPS min / median / max", "throughput",
                "speed-up vs AR", "tokens/forward", "positions/token", "K/V bytes copied/token", "forwards", "tokens",
                "p50 ms", "p95 ms", "peak MiB", "MiB per row", "accuracy", "hit budget"]


COUNTS_HEADER = ["syncs/step", "ops/step", "attn calls/layer", "counted positions/token", "counted K/V copied/token"]
COUNTS_RULE = ("- Counted (--counts): each row's prompts decoded once more, untimed, as the row decodes them, under "
               "a counter of torch calls (refusion_cli/bench/counts.py): host syncs (item, tolist, bool / int / float "
               "of a tensor, nonzero, boolean-mask indexing) and tensor ops outside the model's calls (each a kernel "
               "launch or a copy on a GPU) per engine step; attention calls (scaled dot-product or flex) per layer "
               "per model call, or the attention the model runs where it cannot see one; positions "
               "fed to the model (padding included) and K/V bytes written beyond the K/V of the positions fed, per "
               "generated token, for every decoder (the columns without 'counted' are the causal cache's own counts)")


def table_cells(row: BenchRow, counted: bool = False) -> list[str]:
    """One row of the Markdown table (``counted``: with the --counts columns)."""
    spread = " / ".join(fmt(tps, 1) for tps in (row.tps_min, row.tps_median, row.tps_max))
    cells = [row.decoder, row.model, row.settings, str(row.gen_length), str(row.batch_size), fmt(row.tps, 1), spread,
             fmt(row.throughput, 1), fmt(row.speedup_vs_ar, 2, "×"), fmt(row.tpf), fmt(row.positions_per_token, 2),
             fmt(row.kv_copied_per_token, 0), fmt(row.forwards, 1), fmt(row.tokens, 1),
             fmt(row.latency_p50_ms, 1), fmt(row.latency_p95_ms, 1), fmt(row.peak_mem_mib, 1),
             fmt(row.mem_per_row_mib, 1), percent(row.accuracy), percent(row.budget_share)]
    return cells + (counts_cells(row) if counted else [])


def counts_cells(row: BenchRow) -> list[str]:
    """The --counts columns of a row: syncs/step, ops/step, attention calls/layer, positions/token, K/V copied/token."""
    return [fmt(row.syncs_per_step, 2), fmt(row.ops_per_step, 1), attention_cell(row),
            fmt(row.counted_positions_per_token, 2), fmt(row.counted_kv_copied_per_token, 0)]


def is_counted(rows: Sequence[BenchRow]) -> bool:
    """Whether the rows were counted (--counts): each row counted names its model's attention."""
    return any(row.attention_implementation for row in rows)


BUDGET_WARNING_SHARE = 0.1  # rows with this share of decodes cut at the length budget, or more, are named


def budget_warning(rows: Sequence[BenchRow]) -> str | None:
    """The rows where many decodes ran to the length budget without an end token (their answers may be cut,
    their accuracy low for it); None when there are none."""
    cut = [f"{row.decoder} @ {row.gen_length} {row.budget_share * 100:.0f}%" for row in rows
           if row.budget_share >= BUDGET_WARNING_SHARE]
    if not cut:
        return None
    return (f"decodes that used the whole --gen-length without an end token: {', '.join(cut)}; their answers may "
            "be cut short (and scored wrong): give a larger --gen-length")


def machine_line(machine: Machine) -> str:
    """"NVIDIA H100 (cuda:0), CPU: ...; torch 2.x, 8 threads, dtype bfloat16"."""
    where = f"{machine.processor} ({machine.device})"
    if machine.processor != machine.cpu:
        where += f", CPU: {machine.cpu}"
    return f"{where}; torch {machine.torch}, {machine.threads} threads, dtype {machine.dtype}"


def write_machine(path: Path, machine: Machine) -> None:
    path.write_text(json.dumps(machine.as_dict(), indent=2) + "\n", encoding="utf-8")


BATCH_RULE = ("- Batches: a row of batch N decodes the prompts N at a time (a finished prompt's place goes to the next "
              "one), every prompt with the tokens of its batch-1 decode. TPS is the paper's rule at batch 1; in a batch "
              "a decode's seconds are its latency, so TPS is the per-request rate there. Throughput is the row's tokens "
              "÷ the wall time of its calls (equal to TPS at batch 1). MiB per row: peak MiB ÷ batch.")


def write_markdown(path: Path, rows: Sequence[BenchRow], machine: Machine, *, prompts: str, warmup: int,
                   repeats: int, seed: int, plots: Sequence[str], interrupted: bool = False,
                   notes: Sequence[str] = (), resumed: int = 0, frontier: Sequence[FrontierPoint] = ()) -> None:
    """The human-readable report (``plots``: file names next to it; ``notes``: caveats about the run;
    ``resumed``: how many of the rows were measured before a ``--resume`` continued the run;
    ``frontier``: a --sweep run's frontier points, as in frontier.csv)."""
    counted = is_counted(rows)
    header = TABLE_HEADER + (COUNTS_HEADER if counted else [])
    lines = ["# Decoding speed benchmark", ""]
    if interrupted:
        lines += ["**Interrupted**: the rows below are the ones that finished.", ""]
    if resumed:
        lines += [f"**Resumed**: the first {resumed} of the {len(rows)} rows were measured before this process "
                  f"continued the run (--resume); every row was measured on the same machine with the same settings, "
                  f"as recorded in {RUN_FILE} and checked by --resume.", ""]
    lines += [
        f"- Machine: {machine_line(machine)}",
        f"- Prompts: {prompts}; {warmup} warm-up call(s), {repeats} repeat(s), seed {seed}",
        f"- Counting rule: {COUNTING_RULE}",
        *([BATCH_RULE] if any(row.batch_size > 1 for row in rows) else []),
        "- Speed-up vs AR: the row's TPS ÷ AR's TPS at the same response length, in the same run",
        "- TPS min / median / max: the row's TPS in each repeat (the repeat's tokens ÷ its seconds); hit budget: "
        "the share of decodes that ran to the length budget without an end token",
        f"- Peak memory: {machine.memory_method}, over the row's measured decodes",
        *([COUNTS_RULE] if counted else []),
        *(f"- Note: {note}" for note in notes),
        *(f"- **Warning**: {warning}" for warning in [budget_warning(rows)] if warning),
        "",
        "| " + " | ".join(header) + " |",
        "|" + "---|" * len(header),
    ]
    lines += ["| " + " | ".join(table_cells(row, counted)) + " |" for row in rows]
    ratios = ablation_ratios(rows)
    if ratios:
        measured = ", ".join(f"{ratio:.2f}× at {length} tokens" for length, ratio in sorted(ratios.items()))
        lines += ["", f"KV reuse vs recompute (refusion TPS ÷ refusion (recompute) TPS): {measured}. "
                      "The paper reports 1.16–1.33× on a GPU with Qwen3-8B."]
    if frontier:
        lines += ["", f"Accuracy/speed frontier (--sweep; {FRONTIER_CSV}): every setting of each decoder at batch 1; "
                      "a point is on its decoder's front when no other setting of it at the same length is as "
                      "accurate and as fast (TPS, or tokens per forward) and better on one of the two.", "",
                  "| decoder | gen length | setting | TPS | tokens/forward | accuracy | TPS front | TPF front |",
                  "|---|---|---|---|---|---|---|---|"]
        lines += [f"| {p.decoder} | {p.gen_length} | {p.setting} | {fmt(p.tps, 1)} | {fmt(p.tpf)} | "
                  f"{percent(p.accuracy)} | {'yes' if p.on_front else ''} | {'yes' if p.on_front_tpf else ''} |"
                  for p in frontier]
    configs = dict.fromkeys((row.decoder, row.config) for row in rows)
    if configs:
        lines += ["", "Decoder configs:", ""]
        lines += [f"- {decoder}: `{config}`" for decoder, config in configs]
    if plots:
        lines += [""] + [f"![{Path(name).stem}]({name})" for name in plots]
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
