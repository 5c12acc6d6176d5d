"""The benchmark's files: CSV rows written as they are measured, then a Markdown report and plots.

Files under the output directory (``results/bench/`` by default; replaced by each run that
finishes at least one row, see ``refusion_cli.cli.bench.BenchRun``):

- ``bench.csv``    one row per decoder and response length (:class:`~refusion_cli.bench.runner.BenchRow`),
                   appended and flushed as each row finishes, so an interrupted run keeps its rows;
- ``samples.csv``  one row per measured decode (timings, counts, correctness, the decoded text),
                   likewise written as each decode finishes;
- ``bench.md``     the machine, the settings, the counting rule, the table, the KV-reuse ablation,
                   the decoder configs and the plots;
- ``machine.json`` the machine as data;
- ``frontier.png`` accuracy against TPS (only when prompts have targets);
- ``tps_vs_gen_length.png`` TPS and median latency against the response length (two lengths or more).
"""

from __future__ import annotations

import csv
import dataclasses
import json
from collections.abc import Sequence
from pathlib import Path
from typing import IO, Any

from refusion_cli.bench.machine import Machine
from refusion_cli.bench.runner import RECOMPUTE, BenchRow, BenchSample

ROWS_FILE = "bench.csv"
SAMPLES_FILE = "samples.csv"
REPORT_FILE = "bench.md"
MACHINE_FILE = "machine.json"
ROW_FIELDS = [f.name for f in dataclasses.fields(BenchRow)]
SAMPLE_FIELDS = [f.name for f in dataclasses.fields(BenchSample)]

COUNTING_RULE = (
    "TPS = response tokens up to and including the first EOS ÷ wall time of the decode call (batch 1, "
    "device synchronised at both ends), the same rule for every decoder; forwards = every model call; "
    "tokens/forward = tokens ÷ forwards. Each column is the mean over the row's measured decodes of the "
    "per-decode value; latency percentiles are over the decode wall times."
)


class CsvRows:
    """A CSV file written one row at a time, flushed after each row."""

    def __init__(self, path: Path, fields: Sequence[str]):
        path.parent.mkdir(parents=True, exist_ok=True)
        self.path = path
        self._handle: IO[str] = path.open("w", newline="", encoding="utf-8")
        self._writer = csv.DictWriter(self._handle, fieldnames=list(fields))
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


def ablation_ratios(rows: Sequence[BenchRow]) -> dict[int, float]:
    """gen_length -> TPS with KV reuse ÷ TPS when recomputing (rows holding both)."""
    reuse = {row.gen_length: row.tps for row in rows if row.decoder == "refusion"}
    recompute = {row.gen_length: row.tps for row in rows if row.decoder == "refusion" + RECOMPUTE}
    return {length: reuse[length] / recompute[length] for length in reuse
            if length in recompute and recompute[length] > 0}


def fmt(value: float | None, digits: int = 2, suffix: str = "") -> str:
    return "–" if value is None else f"{value:.{digits}f}{suffix}"


def percent(value: float | None) -> str:
    return "–" if value is None else f"{value * 100:.1f}%"


TABLE_HEADER = ["decoder", "model", "gen length", "TPS", "speed-up vs AR", "tokens/forward", "forwards", "tokens",
                "p50 ms", "p95 ms", "peak MiB", "accuracy"]


def table_cells(row: BenchRow) -> list[str]:
    """One row of the terminal and Markdown tables."""
    return [row.decoder, row.model, str(row.gen_length), fmt(row.tps, 1), fmt(row.speedup_vs_ar, 2, "×"),
            fmt(row.tpf), fmt(row.forwards, 1), fmt(row.tokens, 1), fmt(row.latency_p50_ms, 1),
            fmt(row.latency_p95_ms, 1), fmt(row.peak_mem_mib, 1), percent(row.accuracy)]


def machine_line(machine: Machine) -> str:
    """"NVIDIA H100 (cuda:0), CPU: ...; torch 2.x, 8 threads, dtype bfloat16"."""
    where = f"{machine.processor} ({machine.device})"
    if machine.processor != machine.cpu:
        where += f", CPU: {machine.cpu}"
    return f"{where}; torch {machine.torch}, {machine.threads} threads, dtype {machine.dtype}"


def write_machine(path: Path, machine: Machine) -> None:
    path.write_text(json.dumps(machine.as_dict(), indent=2) + "\n", encoding="utf-8")


def write_markdown(path: Path, rows: Sequence[BenchRow], machine: Machine, *, prompts: str, warmup: int,
                   repeats: int, seed: int, plots: Sequence[str], interrupted: bool = False,
                   notes: Sequence[str] = ()) -> None:
    """The human-readable report (``plots``: file names next to it; ``notes``: caveats about the run)."""
    lines = ["# Decoding speed benchmark", ""]
    if interrupted:
        lines += ["**Interrupted**: the rows below are the ones that finished.", ""]
    lines += [
        f"- Machine: {machine_line(machine)}",
        f"- Prompts: {prompts}; batch 1, {warmup} warm-up decode(s), {repeats} repeat(s), seed {seed}",
        f"- Counting rule: {COUNTING_RULE}",
        "- Speed-up vs AR: the row's TPS ÷ AR's TPS at the same response length, in the same run",
        f"- Peak memory: {machine.memory_method}, over the row's measured decodes",
        *(f"- Note: {note}" for note in notes),
        "",
        "| " + " | ".join(TABLE_HEADER) + " |",
        "|" + "---|" * len(TABLE_HEADER),
    ]
    lines += ["| " + " | ".join(table_cells(row)) + " |" for row in rows]
    ratios = ablation_ratios(rows)
    if ratios:
        measured = ", ".join(f"{ratio:.2f}× at {length} tokens" for length, ratio in sorted(ratios.items()))
        lines += ["", f"KV reuse vs recompute (refusion TPS ÷ refusion (recompute) TPS): {measured}. "
                      "The paper reports 1.16–1.33× on a GPU with Qwen3-8B."]
    configs = dict.fromkeys((row.decoder, row.config) for row in rows)
    if configs:
        lines += ["", "Decoder configs:", ""]
        lines += [f"- {decoder}: `{config}`" for decoder, config in configs]
    if plots:
        lines += [""] + [f"![{Path(name).stem}]({name})" for name in plots]
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
