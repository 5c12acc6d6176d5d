"""The per-sample journal: one JSON line per decoded sample, appended and flushed as it is produced.

Contract:

- A journal belongs to one benchmark and one decoder + model (its *label*) in a run directory:
  ``<run>/samples/<benchmark>/<label>.jsonl``, or ``<label>.rank<r>.jsonl`` for the process of
  rank r > 0 under data parallelism (each process appends to its own file only).
- A line holds: ``key``, ``task`` (benchmark), ``subtask`` (lm-eval task), ``doc_id``, ``decoder``,
  ``model``, ``config_hash``, ``prompt``, ``output``, ``target``, ``score``, ``correct``,
  ``tokens``, ``seconds``, ``forwards``, ``tps``, ``tpf``, ``prompt_tokens``.
- ``key`` hashes the subtask, document id, request index, config hash and the request itself
  (prompt and generation keys). Opening a journal reads back every file of its label (any rank,
  so a run resumes under another process count); a request whose key is there is answered from
  the file and not decoded again. A different decoder setting, model or prompt gives other keys.
- A torn last line (the process was killed mid-write) is ignored, and cut off this process's
  own file before anything is appended to it. Nothing written is ever rewritten.
- It is the adapters' ``GenerationHook``: ``record`` scores the sample (``TaskScorer``), writes
  the line, flushes, and tells the observer.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, Protocol

from lm_eval.api.instance import Instance

from refusion_cli.harness.requests import SampleRecord
from refusion_cli.harness.scoring import SampleScore


class JournalObserver(Protocol):
    def on_requests(self, total: int, stored: int, other_settings: int) -> None:
        """A batch of ``total`` distinct requests starts; ``stored`` of them are answered from the journal;
        ``other_settings`` samples in the journal were decoded with other settings (kept, not used)."""

    def on_sample(self, record: dict[str, Any]) -> None:
        """A sample was decoded and written."""


def journal_path(directory: Path, label: str, rank: int = 0) -> Path:
    return directory / (f"{label}.jsonl" if rank == 0 else f"{label}.rank{rank}.jsonl")


def journal_files(directory: Path, label: str) -> list[Path]:
    """Every process's file of ``label`` (rank 0's first)."""
    ranks = sorted(directory.glob(f"{label}.rank*.jsonl"), key=lambda p: p.name)
    main = directory / f"{label}.jsonl"
    return ([main] if main.is_file() else []) + [p for p in ranks if p.stem.rsplit(".rank", 1)[-1].isdigit()]


def read_records(paths: list[Path]) -> Iterator[dict[str, Any]]:
    """The well-formed lines of ``paths``, in file order (a torn or foreign line is skipped, also one cut
    inside a character: its bytes read as U+FFFD make it invalid JSON)."""
    for path in paths:
        with path.open(encoding="utf-8", errors="replace") as handle:
            for line in handle:
                try:
                    record = json.loads(line)
                except json.JSONDecodeError:
                    continue
                if isinstance(record, dict) and "key" in record:
                    yield record


def request_key(request: Instance, config_hash: str) -> str:
    context, gen_kwargs = request.args
    material = [request.task_name, request.doc_id, request.idx, config_hash, context,
                json.dumps(gen_kwargs, sort_keys=True, default=str)]
    return hashlib.sha256(json.dumps(material, ensure_ascii=False).encode("utf-8")).hexdigest()[:24]


def _cut_torn_tail(path: Path) -> None:
    """Drop an unterminated last line, so that the next line starts on a line of its own."""
    if not path.is_file():
        return
    data = path.read_bytes()
    if data and not data.endswith(b"\n"):
        with path.open("r+b") as handle:
            handle.truncate(data.rfind(b"\n") + 1)


class SampleJournal:
    """The journal of one (benchmark, label); see the module docstring."""

    def __init__(self, directory: Path, *, benchmark: str, decoder: str, model: str, label: str,
                 config_hash: str, scorer: Callable[[str, dict[str, Any], str], SampleScore],
                 rank: int = 0, observer: JournalObserver | None = None) -> None:
        self.directory = directory
        self.benchmark, self.decoder, self.model, self.label = benchmark, decoder, model, label
        self.config_hash = config_hash
        self.scorer = scorer
        self.observer = observer
        directory.mkdir(parents=True, exist_ok=True)
        self.path = journal_path(directory, label, rank)
        _cut_torn_tail(self.path)
        self.stored: dict[str, dict[str, Any]] = {}
        self.other_settings = 0  # records of earlier runs with another config hash
        for record in read_records(journal_files(directory, label)):
            if record.get("config_hash") == config_hash:
                self.stored[record["key"]] = record
            else:
                self.other_settings += 1
        self.earlier = frozenset(self.stored)  # keys finished before this run started
        self.decoded = 0  # samples decoded (not read back) by this process

    # GenerationHook

    def start(self, requests: list[Instance]) -> None:
        keys = {request_key(request, self.config_hash) for request in requests}
        if self.observer is not None:
            self.observer.on_requests(len(keys), sum(key in self.stored for key in keys), self.other_settings)

    def lookup(self, request: Instance) -> str | None:
        record = self.stored.get(request_key(request, self.config_hash))
        return None if record is None else record["output"]

    def record(self, request: Instance, sample: SampleRecord) -> None:
        context, _ = request.args
        key = request_key(request, self.config_hash)
        score = self.scorer(request.task_name, request.doc, sample.text)
        stats = sample.stats
        record = {
            "key": key, "task": self.benchmark, "subtask": request.task_name, "doc_id": request.doc_id,
            "decoder": self.decoder, "model": self.model, "config_hash": self.config_hash,
            "prompt": context, "output": sample.text, "target": score.target, "score": score.score,
            "correct": score.correct, "tokens": stats.tokens, "seconds": stats.seconds, "forwards": stats.forwards,
            "tps": stats.tps, "tpf": stats.tpf, "prompt_tokens": sample.prompt_tokens, "prompt_cut": sample.prompt_cut,
        }
        if sample.batch_rows > 1:  # seconds is this row's latency; wall_share its part of the batched call's time
            record.update(batch_rows=sample.batch_rows, wall_share=sample.wall_share)
        with self.path.open("a", encoding="utf-8") as handle:
            handle.write(json.dumps(record, ensure_ascii=False) + "\n")
            handle.flush()
        self.stored[key] = record
        self.decoded += 1
        if self.observer is not None:
            self.observer.on_sample(record)
