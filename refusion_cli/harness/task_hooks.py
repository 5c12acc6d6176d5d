"""The functions the task YAMLs of ``evals/tasks/`` name with ``!function``: per-document scoring.

Each is an lm-eval ``process_results(doc, results) -> {metric: value}`` hook; ``results`` holds the
one (filtered) generation of the document.

- ``synthetic_process_results``: exact match of the ``####`` answer against ``target``
  (``refusion_cli.tasks.synthetic.is_correct``).
- ``humaneval_process_results`` / ``mbpp_process_results``: pass@1 of one greedy answer, run in
  the project's sandbox (``refusion_cli.harness.code_tasks``) instead of lm-eval's ``code_eval``
  metric, which needs the hub. They execute model-written code: the runner asks for the user's
  confirmation (``code_tasks.require_confirmation``) before any of them can be reached.
"""

from __future__ import annotations

from typing import Any

from refusion_cli.tasks.synthetic import is_correct



def synthetic_process_results(doc: dict[str, Any], results: list[str]) -> dict[str, float]:
    return {"exact_match": float(is_correct(results[0], str(doc["target"])))}


def humaneval_process_results(doc: dict[str, Any], results: list[str]) -> dict[str, float]:
    """The answer continues the prompt's function (or restates it); its tests decide."""
    from refusion_cli.harness.code_tasks import CODE_MEMORY_MB, CODE_TIMEOUT_S, extract_code, humaneval_program
    from refusion_cli.harness.sandbox import run_candidate

    completion = extract_code(results[0], prompt=doc["prompt"])
    outcome = run_candidate(humaneval_program(doc, completion), timeout=CODE_TIMEOUT_S, memory_mb=CODE_MEMORY_MB)
    return {"pass_at_1": float(outcome.passed)}


def mbpp_process_results(doc: dict[str, Any], results: list[str]) -> dict[str, float]:
    """The task's setup code (if any), the answer's code, then the task's assert lines."""
    from refusion_cli.harness.code_tasks import CODE_MEMORY_MB, CODE_TIMEOUT_S, extract_code, mbpp_program
    from refusion_cli.harness.sandbox import run_candidate

    program = mbpp_program(extract_code(results[0]), doc["test_list"], doc.get("test_setup_code") or "")
    outcome = run_candidate(program, timeout=CODE_TIMEOUT_S, memory_mb=CODE_MEMORY_MB)
    return {"pass_at_1": float(outcome.passed)}
