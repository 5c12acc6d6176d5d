"""The suite manifest and task YAMLs: real lm-eval names, offline builds from local files, per-sample scoring."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from refusion_cli.decoding.spec import preset_config
from refusion_cli.decoding.config import PRESETS, ReFusionConfig
from refusion_cli.errors import UserError
from refusion_cli.harness.manifest import EvalProtocol
from refusion_cli.harness.runner import check_data_dir
from refusion_cli.harness.suite import check_data, lm_eval_tasks_dir, load_suite, load_tasks, render
from tests.harness.helpers import CATEGORIES, MATH_SUBJECTS

PAPER = {  # docs/algorithm.md, Presets: benchmark -> lm-eval task of the paper's table (its eval.sh)
    "mmlu_pro": "mmlu_pro", "arc_challenge": "arc_challenge_chat", "gsm8k": "gsm8k_cot", "math": "minerva_math",
    "gpqa": "gpqa_main_generative_n_shot", "humaneval": "humaneval_instruct_noprefix", "mbpp": "mbpp",
}
LM_EVAL = {**PAPER, "humaneval": "humaneval_instruct"}  # --protocol lm-eval: the installed lm-eval's own tasks
# where lm-eval 0.4.13 defines each task (indexing these folders is fast; all of lm-eval takes ~15 s)
BUILTIN_FOLDERS = {"mmlu_pro": "mmlu_pro", "arc_challenge_chat": "arc", "gsm8k_cot": "gsm8k",
                   "minerva_math": "benchmarks", "gpqa_main_generative_n_shot": "gpqa",
                   "humaneval_instruct": "humaneval", "mbpp": "mbpp"}


def write_jsonl(path: Path, rows: list[dict]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(row) + "\n" for row in rows), encoding="utf-8")


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory) -> Path:
    """Two or three rows per benchmark, with the fields of the real datasets."""
    root = tmp_path_factory.mktemp("data")
    write_jsonl(root / "gsm8k/test.jsonl", [{"question": f"What is {i} + 1?", "answer": f"{i} + 1 = {i + 1}\n#### {i + 1}"}
                                            for i in range(3)])
    write_jsonl(root / "arc_challenge/test.jsonl", [
        {"id": f"q{i}", "question": "Which one is a fruit?",
         "choices": {"text": ["apple", "rock", "car", "sky"], "label": ["A", "B", "C", "D"]}, "answerKey": "A"}
        for i in range(2)] + [
        {"id": "q5", "question": "Which one is a vegetable?",
         "choices": {"text": ["rock", "car", "sky", "sea", "leek"], "label": ["A", "B", "C", "D", "E"]},
         "answerKey": "E"},
        {"id": "q1", "question": "Which one is a number?",
         "choices": {"text": ["one", "rock", "car", "sky"], "label": ["1", "2", "3", "4"]}, "answerKey": "1"}])
    write_jsonl(root / "mmlu_pro/test.jsonl", [
        {"question_id": i, "question": f"Question {i}?", "options": ["yes", "no", "maybe", "never"], "answer": "A",
         "answer_index": 0, "cot_content": "", "category": category, "src": "test"}
        for i, category in enumerate(CATEGORIES)])
    for subject in MATH_SUBJECTS:
        write_jsonl(root / f"minerva_math/{subject}.jsonl", [
            {"problem": "What is $1+1$?", "level": "Level 1", "type": subject, "solution": "It is $\\boxed{2}$."}])
    write_jsonl(root / "gpqa/gpqa_main.jsonl", [
        {"Question": "Pick the right one.", "Correct Answer": "right", "Incorrect Answer 1": "wrong",
         "Incorrect Answer 2": "false", "Incorrect Answer 3": "bad"} for _ in range(2)])
    write_jsonl(root / "mbpp/test.jsonl", [
        {"task_id": 11, "text": "Write a function add(a, b) that adds two numbers.", "code": "def add(a, b):\n    return a + b",
         "test_list": ["assert add(1, 2) == 3", "assert add(0, 0) == 0", "assert add(-1, 1) == 0"],
         "test_setup_code": "", "challenge_test_list": []}])
    return root


def right_answer(benchmark: str, doc: dict) -> str:
    """A response each benchmark's scoring must count as correct."""
    return {
        "gsm8k": lambda: f"So the result is {doc['answer'].split('####')[-1].strip()}. The answer is "
                         f"{doc['answer'].split('####')[-1].strip()}.",
        "arc_challenge": lambda: " A",
        "mmlu_pro": lambda: "Let's think. The answer is (A).",
        "math": lambda: "Adding the two gives $\\boxed{2}$.",  # zero-shot: no "Final Answer:" sentence
        "gpqa": lambda: f"The answer is {doc['answer']}.",
        "humaneval": lambda: doc["canonical_solution"],
        "mbpp": lambda: "def add(a, b):\n    return a + b\n",
        "synthetic": lambda: f"They have {doc['target']} now.\n#### {doc['target']}",
    }[benchmark]()


def test_the_manifest_lists_the_papers_seven_benchmarks_and_the_synthetic_task():
    suite = load_suite()
    assert {name: b.lm_eval_task for name, b in suite.benchmarks.items() if b.in_table1} == PAPER
    assert {name: b.lm_eval_task for name, b in load_suite(protocol=EvalProtocol.LM_EVAL).benchmarks.items()
            if b.in_table1} == LM_EVAL
    # synthetic: one task under both protocols
    assert all(b.task_protocol == (EvalProtocol.PAPER if b.in_table1 else None) for b in suite.benchmarks.values())
    assert suite.benchmarks["gsm8k"].also == ("exact_match,strict-match",)  # both GSM8K scores, flexible heads
    assert (suite.benchmarks["math"].metric_key, suite.benchmarks["math"].also) == ("math_verify,none",
                                                                                      ("exact_match,none",))
    for name, benchmark in suite.benchmarks.items():
        assert benchmark.num_fewshot == 0 and benchmark.chat_template
        assert benchmark.gen_length == (192 if name == "synthetic" else 512)
        assert isinstance(preset_config(benchmark.preset), ReFusionConfig)
        if benchmark.in_table1:
            assert benchmark.preset in PRESETS
    assert suite.benchmarks["synthetic"].preset not in PRESETS  # the manifest's own entry, to be tuned


def test_every_lm_eval_task_of_the_manifest_exists_in_lm_eval():
    from lm_eval.tasks import TaskManager

    for task, folder in BUILTIN_FOLDERS.items():
        manager = TaskManager(include_path=lm_eval_tasks_dir() / folder, include_defaults=False)
        assert task in manager.all_tasks, f"{task} is not an lm-eval task"


def test_select_takes_short_names_lm_eval_names_paper_and_all():
    suite = load_suite()
    assert [b.name for b in suite.select(["gsm8k_cot", "gsm8k", "math"])] == ["gsm8k", "math"]
    assert [b.name for b in suite.select(["paper"])] == list(PAPER)
    assert len(suite.select(["all"])) == len(PAPER) + 1
    with pytest.raises(UserError, match="unknown task 'gsm9k'"):
        suite.select(["gsm9k"])


def test_missing_local_data_names_the_file_and_its_source(tmp_path):
    suite = load_suite()
    rendered = render(suite.benchmarks["gsm8k"], tmp_path / "tasks", data_dir=tmp_path / "empty")
    with pytest.raises(UserError) as error:
        check_data(rendered)
    assert str(tmp_path / "empty" / "gsm8k" / "test.jsonl") in str(error.value)
    assert error.value.hint.startswith("add --download to fetch it from the hub, or put openai/gsm8k, config main")
    assert "--data-file gsm8k=PATH" in error.value.hint
    math = render(suite.benchmarks["math"], tmp_path / "math", data_dir=tmp_path / "empty")
    with pytest.raises(UserError, match="6 more"):
        check_data(math)
    with pytest.raises(UserError, match="several files"):
        render(suite.benchmarks["math"], tmp_path / "math", data_file=tmp_path / "x.jsonl")


def test_data_file_replaces_the_default_location(tmp_path, data_dir):
    suite = load_suite()
    rendered = render(suite.benchmarks["gsm8k"], tmp_path / "tasks", data_file=data_dir / "gsm8k" / "test.jsonl")
    assert rendered.data_files == ((data_dir / "gsm8k" / "test.jsonl").resolve(),)
    check_data(rendered)


def test_a_data_dir_under_home_written_with_a_tilde_is_read(tmp_path, data_dir, monkeypatch):
    """``--data-dir '~/data'`` (quoted, or after ``=``, so no shell expands it) names the folder in the home."""
    monkeypatch.setenv("HOME", str(data_dir.parent))
    rendered = render(load_suite().benchmarks["gsm8k"], tmp_path / "tasks", data_dir=Path("~") / data_dir.name)
    assert rendered.data_files == ((data_dir / "gsm8k" / "test.jsonl").resolve(),)
    check_data(rendered)
    check_data_dir(Path("~") / data_dir.name, {"gsm8k": rendered})


@pytest.mark.parametrize("protocol", ["paper", "lm-eval"])
@pytest.mark.parametrize("name", ["synthetic", "gsm8k", "arc_challenge", "mmlu_pro", "gpqa", "math", "humaneval",
                                  "mbpp"])
def test_each_benchmark_builds_offline_and_scores_a_right_answer(name, protocol, data_dir, tmp_path):
    """The rendered YAML builds its lm-eval tasks from local files only, and the per-sample scorer
    (the suite's metric and filter) gives a right answer 1 and a wrong one 0."""
    from refusion_cli.harness.scoring import TaskScorer

    if name == "math":
        pytest.importorskip("math_verify", reason="MATH needs lm-eval's math extras")
    benchmark = load_suite(protocol=protocol).benchmarks[name]
    rendered = render(benchmark, tmp_path / "tasks", data_dir=data_dir)
    check_data(rendered)
    tasks = load_tasks(rendered)["tasks"]
    assert tasks and all(task.OUTPUT_TYPE == "generate_until" for task in tasks.values())
    scorer = TaskScorer(tasks, benchmark.metric, benchmark.metric_filter)
    task_name, task = next(iter(tasks.items()))
    doc = task.eval_docs[0]
    assert scorer(task_name, doc, right_answer(name, doc)).correct
    assert not scorer(task_name, doc, "I do not know.").correct


def test_math_scores_a_boxed_answer_and_the_final_answer_sentence(data_dir, tmp_path):
    pytest.importorskip("math_verify", reason="MATH needs lm-eval's math extras")
    from refusion_cli.harness.scoring import TaskScorer

    benchmark = load_suite().benchmarks["math"]
    tasks = load_tasks(render(benchmark, tmp_path / "tasks", data_dir=data_dir))["tasks"]
    scorer = TaskScorer(tasks, benchmark.metric, benchmark.metric_filter)
    name, task = next(iter(tasks.items()))
    doc = task.eval_docs[0]
    for right in ("So $1+1=\\boxed{2}$.", "Final Answer: The final answer is $2$. I hope it is correct."):
        assert scorer(name, doc, right).correct, right
    assert not scorer(name, doc, "So $1+1=\\boxed{3}$.").correct


def test_an_mmlu_pro_file_without_some_categories_names_them(tmp_path):
    from refusion_cli.errors import UserError

    write_jsonl(tmp_path / "mmlu_pro/test.jsonl", [
        {"question_id": 1, "question": "Q?", "options": ["a", "b"], "answer": "A", "answer_index": 0,
         "cot_content": "", "category": category, "src": "test"} for category in ("biology", "law")])
    rendered = render(load_suite().benchmarks["mmlu_pro"], tmp_path / "tasks", data_dir=tmp_path)
    with pytest.raises(UserError, match=r"has no records of 12 of its 14 categories \(business, chemistry, "
                                        r"computer science, .*psychology\)"):
        check_data(rendered)
