"""JSON lines are cut at newlines only: U+2028 / U+2029 / U+0085 inside a JSON string stay in their record."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from refusion_cli.errors import UserError
from refusion_cli.harness.suite import load_suite, load_tasks, render
from refusion_cli.jsonl import json_lines, json_objects
from tests.harness.helpers import run_cli

# a GPQA record in the hub's schema; the real file has U+2028 unescaped inside its strings
GPQA = {"Question": "Which is right?\u2028(two lines)", "Correct Answer": "right\u2029", "Incorrect Answer 1": "wrong",
        "Incorrect Answer 2": "false\u0085", "Incorrect Answer 3": "bad", "Explanation": "It is right.",
        "Subdomain": "Physics (general)", "Record ID": "rec0"}


def raw_line(record: dict) -> str:
    """The record as one JSON line with every character unescaped, as the hub's export writes it."""
    return json.dumps(record, ensure_ascii=False)


def test_line_separators_inside_strings_do_not_cut_a_record():
    text = raw_line(GPQA) + "\n" + raw_line({"Question": "second"}) + "\n"
    assert "\u2028" in text and len(text.splitlines()) > 3  # what str.splitlines() would have read
    assert [record for _, record in json_objects(text, "gpqa.jsonl")] == [GPQA, {"Question": "second"}]


def test_windows_line_ends_and_blank_lines_keep_their_line_numbers():
    text = '{"a": 1}\r\n\r\n{"a": "x\u2028y"}\r\n{"a": oops}\r\n'
    assert json_lines(text) == ['{"a": 1}', "", '{"a": "x\u2028y"}', '{"a": oops}', ""]
    with pytest.raises(UserError, match=r"data.jsonl, line 4, is not valid JSON"):
        list(json_objects(text, "data.jsonl"))


def test_refusion_eval_reads_a_gpqa_file_with_line_separators(capsys, monkeypatch, tmp_path):
    """`refusion eval --task gpqa` checks the file with this reader and builds the lm-eval task over it."""
    data = tmp_path / "data"
    (data / "gpqa").mkdir(parents=True)
    Path(data / "gpqa" / "gpqa_main.jsonl").write_text(
        "".join(raw_line({**GPQA, "Record ID": f"rec{i}"}) + "\n" for i in range(2)), encoding="utf-8")
    code, stdout, stderr = run_cli(capsys, monkeypatch, "--task", "gpqa", "--decoder", "ar", "--limit", "0",
                                   "--data-dir", str(data), "--output", str(tmp_path / "run"))
    assert code == 0, stderr
    assert stdout.splitlines() == ["--limit 0: the data and tasks of gpqa are ready; nothing was evaluated"]
    rendered = render(load_suite().benchmarks["gpqa"], tmp_path / "tasks", data_dir=data)
    [task] = load_tasks(rendered)["tasks"].values()
    assert [doc["Question"] for doc in task.eval_docs] == ["Which is right?\u2028(two lines)"] * 2
