"""Continuing an interrupted ``refusion bench --tps`` run in its output folder (``--resume``).

Contract:

- :func:`run_record` is what ``run.json`` holds: everything that decides what the rows measure
  (the settings as given, ``--limit`` and ``--threads`` included; the planned entries with their
  decoder configs as data; the prompts' source, count and SHA-256) and the machine (what
  ``machine.json`` holds). A run writes it together with its CSV files, when its first row finishes.
- :func:`load_earlier` reads a folder back for ``--resume``. It only reads: every refusal is a
  UserError raised before anything in the folder changes. Refused: no run.json or bench.csv; a
  run.json that is not one this toolkit writes; settings, planned rows or a machine that differ
  from this command's (the speed-up divides a row's TPS by AR's, possibly measured by the earlier
  process, so both must come from the same machine and settings); a bench.csv or samples.csv
  with a record this toolkit would not have written, or with rows and samples that are not the
  run's planned ones in order.
- Left out, and measured again: a last record cut mid-write (the process killed while writing
  it) and the samples of a row that did not finish. :class:`Earlier` holds the finished rows and
  where each CSV file is cut to keep exactly them.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from refusion_cli.bench.machine import Machine
from refusion_cli.bench.prompts import BenchPrompt, prompts_digest
from refusion_cli.bench.report import (
    ROW_FIELDS,
    ROWS_FILE,
    RUN_FILE,
    SAMPLE_FIELDS,
    SAMPLES_FILE,
    CsvRecords,
    read_records,
    row_from_record,
)
from refusion_cli.bench.figures import describe_config
from refusion_cli.bench.runner import (BenchEntry, BenchRow, BenchSettings, measured_lengths,
                                      measuring_order)
from refusion_cli.errors import UserError

RECORD_PARTS = {"settings": dict, "prompts": dict, "entries": list, "machine": dict}  # run.json's keys and types
START_HINT = "leave --resume out to start a new run in the folder (it replaces the files once its first row finishes)"
ABSENT = object()  # a key one side of a comparison lacks


def run_record(settings: BenchSettings, entries: Sequence[BenchEntry], prompts: Sequence[BenchPrompt],
               prompts_source: str, *, limit: int | None, threads: int | None, machine: Machine) -> dict[str, Any]:
    """What run.json holds for this run, as read back from it (JSON types: lists, not tuples)."""
    record = {
        "settings": {**settings.as_dict(), "limit": limit, "threads": threads},
        "prompts": {"source": prompts_source, "count": len(prompts), "sha256": prompts_digest(prompts)},
        "entries": [entry.as_dict() for entry in entries],
        "machine": machine.as_dict(),
    }
    return json.loads(json.dumps(record))


def write_record(path: Path, record: dict[str, Any]) -> None:
    path.write_text(json.dumps(record, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")


def read_record(path: Path) -> dict[str, Any]:
    try:
        record = json.loads(path.read_text(encoding="utf-8"))
    except ValueError as exc:  # not UTF-8, not JSON
        raise UserError(f"cannot resume from {path}: it is not JSON ({exc})") from None
    if not isinstance(record, dict):
        raise UserError(f"cannot resume from {path}: it is not a JSON object")
    broken = [part for part, kind in RECORD_PARTS.items() if not isinstance(record.get(part), kind)]
    if broken:
        raise UserError(f"cannot resume from {path}: it has no valid {', '.join(broken)}")
    return record


@dataclass
class Earlier:
    """What the interrupted run measured: its finished rows, and where each CSV file is cut to keep just them."""

    rows: list[BenchRow]  # the first len(rows) planned entries, in order
    rows_bytes: int  # bench.csv's header and finished rows (CsvRows' keep)
    samples_bytes: int  # samples.csv's header and the finished rows' samples


def load_earlier(folder: Path, record: dict[str, Any], entries: Sequence[BenchEntry]) -> Earlier:
    """The finished rows of the run in ``folder``, checked to be the run ``record`` (this command's) describes."""
    for name in (RUN_FILE, ROWS_FILE):
        if not (folder / name).is_file():
            raise UserError(f"nothing to resume in {folder}: no {name}", hint=START_HINT)
    check_same_run(read_record(folder / RUN_FILE), record)
    rows_path, samples_path = folder / ROWS_FILE, folder / SAMPLES_FILE
    found_rows = read_records(rows_path, ROW_FIELDS)
    found_samples = read_records(samples_path, SAMPLE_FIELDS)
    rows = finished_rows(found_rows, rows_path, entries)
    kept = kept_samples(found_samples, samples_path, entries[:len(rows) + 1], len(rows),
                        record["prompts"]["count"], record["settings"]["repeats"])
    return Earlier(rows, found_rows.ends[len(rows)], found_samples.ends[kept])


# ---------------------------------------------------------------------------------------------
# the same run


def check_same_run(there: dict[str, Any], here: dict[str, Any]) -> None:
    """Refuse to resume when run.json (``there``) and this command (``here``) differ in settings or machine."""
    changed = differences(compared_settings(there), compared_settings(here))
    if not changed and there["entries"] != here["entries"]:  # the same options, other decoder defaults
        changed = [plan_difference(there["entries"], here["entries"])]
    if changed:
        raise UserError("--resume needs the same settings as the interrupted run: " + "; ".join(changed),
                        hint=START_HINT)
    changed = differences(there["machine"], here["machine"])
    if changed:
        raise UserError("--resume needs the same machine as the interrupted run: " + "; ".join(changed),
                        hint="its rows' speed-ups would compare timings from two machines; " + START_HINT)


def compared_settings(record: dict[str, Any]) -> dict[str, Any]:
    """The settings and the prompts (count and hash; the source is a description only). The decoders and
    lengths compare as the plan measures them (each once, AR first), so ``--decoder refusion,ar`` resumes
    a run given ``--decoder ar refusion``; a run.json without ``sweep`` or ``counts`` is a run without --sweep or
    --counts."""
    settings, prompts = dict(record["settings"]), record["prompts"]
    settings.setdefault("sweep", False)  # run.json written before --sweep existed: a run without it
    settings.setdefault("counts", False)  # likewise --counts
    decoders, lengths = settings.get("decoders"), settings.get("gen_lengths")
    if isinstance(decoders, list) and all(isinstance(name, str) for name in decoders):
        settings["decoders"] = measuring_order(decoders)
    if isinstance(lengths, list) and all(isinstance(length, int) for length in lengths):
        settings["gen_lengths"] = measured_lengths(lengths)
    return {**settings, "prompts": f"{prompts.get('count')} (sha256 {str(prompts.get('sha256'))[:12]})"}


def differences(there: dict[str, Any], here: dict[str, Any], prefix: str = "") -> list[str]:
    """``NAME X there, Y here`` for each key whose value differs; nested dicts key by key (``models.ar``)."""
    found = []
    for key in {**here, **there}:  # here's keys in order, then those only there
        before, now = there.get(key, ABSENT), here.get(key, ABSENT)
        name = prefix + key if prefix else key.replace("_", " ")
        if isinstance(before, dict) and isinstance(now, dict):
            found += differences(before, now, name + ".")
        elif before != now:
            found.append(f"{name} {shown(before)} there, {shown(now)} here")
    return found


def plan_difference(there: list[Any], here: list[dict[str, Any]]) -> str:
    if len(there) != len(here):
        return f"planned rows {len(there)} there, {len(here)} here"
    index, before, now = next((index, before, now) for index, (before, now) in enumerate(zip(there, here))
                              if before != now)
    changed = differences(before, now) if isinstance(before, dict) else ["differs"]
    return f"planned row {index + 1} ({now['label']} @ {now['gen_length']}): " + "; ".join(changed)


def shown(value: Any) -> str:
    if value is ABSENT:
        return "absent"
    if value is None:
        return "default"
    if isinstance(value, bool):
        return "on" if value else "off"
    if isinstance(value, list):
        return ",".join(shown(item) for item in value) or "none"
    if isinstance(value, dict):
        return " ".join(f"{key}={shown(item)}" for key, item in value.items()) or "none"
    return str(value)


# ---------------------------------------------------------------------------------------------
# the finished rows and their samples


def finished_rows(found: CsvRecords, path: Path, entries: Sequence[BenchEntry]) -> list[BenchRow]:
    """bench.csv's rows, which must be the first planned entries, in order."""
    if len(found.records) > len(entries):
        raise UserError(f"cannot resume from {path}: it holds {len(found.records)} rows, the run plans {len(entries)}")
    rows = []
    for number, (record, entry) in enumerate(zip(found.records, entries), 1):
        try:
            row = row_from_record(record)
        except ValueError:
            raise UserError(f"cannot resume from {path}: record {number} has a value that is not a number") from None
        planned = (entry.label, entry.model, entry.gen_length, describe_config(entry.config))
        if (row.decoder, row.model, row.gen_length, row.config) != planned:
            raise UserError(f"cannot resume from {path}: record {number} is {row.decoder} @ {row.gen_length} on "
                            f"{row.model} ({row.config}), not the planned row {number}, {planned[0]} @ {planned[2]} "
                            f"on {planned[1]} ({planned[3]})")
        rows.append(row)
    return rows


def kept_samples(found: CsvRecords, path: Path, entries: Sequence[BenchEntry], finished: int, n_prompts: int,
                 repeats: int) -> int:
    """How many of samples.csv's samples to keep: the ``finished`` rows', which come first, in the order they
    were measured. After them only samples of the next row (``entries[finished]``, unfinished) may follow."""
    planned = [(entry.label, str(entry.gen_length), str(prompt), str(repeat))
               for entry in entries for prompt in range(n_prompts) for repeat in range(repeats)]
    for number, (sample, expected) in enumerate(zip(found.records, planned), 1):
        got = (sample["decoder"], sample["gen_length"], sample["prompt"], sample["repeat"])
        if got != expected:
            raise UserError(f"cannot resume from {path}: record {number} is {sample_name(got)}, where the run has "
                            f"{sample_name(expected)}")
    kept = finished * n_prompts * repeats
    if len(found.records) > len(planned):
        raise UserError(f"cannot resume from {path}: it holds {len(found.records)} samples, more than the finished "
                        f"rows and the next one have ({len(planned)})")
    if len(found.records) < kept:
        raise UserError(f"cannot resume from {path}: it holds {len(found.records)} samples; the {finished} finished "
                        f"row(s) have {kept}")
    return kept


def sample_name(key: tuple[str, str, str, str]) -> str:
    label, length, prompt, repeat = key
    return f"{label} @ {length}, prompt {prompt}, repeat {repeat}"
