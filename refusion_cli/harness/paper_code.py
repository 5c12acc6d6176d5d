"""The paper protocol's code tasks (``--protocol paper``): the program a HumanEval or MBPP answer becomes
and its pass@1, as functions the task YAMLs of ``evals/tasks/paper/`` name with ``!function``.

Contract: an answer arrives after the paper's fenced-python step
(:func:`~refusion_cli.harness.paper_filters.python_blocks`) and becomes the program the paper's harness
(its own task files under lm-eval 0.4.9.1, scored by ``code_eval``) ran; that program's pass@1 comes
from the project's sandbox with the limits of :mod:`~refusion_cli.harness.code_tasks`, not from a
metric fetched from the hub. The installed lm-eval has no ``humaneval_instruct_noprefix``: its
``humaneval_instruct`` prefills the problem's prompt itself and keeps the answer up to a fence, not
cut down.

- :func:`humaneval_program`: the paper's ``humaneval_instruct_noprefix`` program: the problem's
  prompt, a newline and the answer's code up to its closing fence, cut down to what the entry
  point needs (:func:`sanitize`).
- ``mbpp_process_results`` / ``humaneval_process_results``: pass@1 in the project's sandbox of the
  program ``code_eval`` would run: the candidate, a newline, then the test code.
"""

from __future__ import annotations

import ast
from collections.abc import Iterable
from typing import Any

SANITIZE_MAX_LINES = 100  # the longest-valid-code search looks at the first 100 lines only


def _parses(code: str) -> bool:
    try:
        ast.parse(code)
    except (SyntaxError, MemoryError, ValueError):
        return False
    return True


def longest_valid_span(text: str) -> str:
    """The run of consecutive lines that parses and has the most non-blank lines (the first such run)."""
    lines = text.splitlines()[:SANITIZE_MAX_LINES]
    best, best_count = "", 0
    for start in range(len(lines)):
        for end in range(start, len(lines)):
            count = sum(1 for line in lines[start:end + 1] if line.strip())
            if count > best_count:
                snippet = "\n".join(lines[start:end + 1])
                if _parses(snippet):
                    best, best_count = snippet, count
    return best


def _names_used(node: ast.AST) -> set[str]:
    """Names and attribute names under ``node`` (neither descends further into a name or attribute)."""
    used, stack = set(), [node]
    while stack:
        for child in ast.iter_child_nodes(stack.pop()):
            if isinstance(child, ast.Name):
                used.add(child.id)
            elif isinstance(child, ast.Attribute):
                used.add(child.attr)
            else:
                stack.append(child)
    return used


def sanitize(text: str, entry_point: str | None = None) -> str:
    """The imports, then the classes, functions with a ``return`` and assignments that ``entry_point``
    reaches, of the longest parsable run of lines of ``text`` (tabs as four spaces)."""
    text = text.replace("\t", "    ").replace("\r\n", "\n").replace("\r", "\n").strip() + "\n"
    tree = ast.parse(longest_valid_span(text))
    imports: list[ast.stmt] = []
    definitions: dict[str, ast.stmt] = {}
    for node in tree.body:
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            imports.append(node)
        elif isinstance(node, ast.ClassDef):
            definitions[node.name] = node
        elif isinstance(node, ast.FunctionDef):
            if any(isinstance(n, ast.Return) for n in ast.walk(node)):
                definitions[node.name] = node
        elif isinstance(node, ast.Assign) and node.targets and isinstance(node.targets[0], ast.Name):
            definitions[node.targets[0].id] = node
    keep = set(definitions)
    if entry_point:
        uses = {name: _names_used(node) for name, node in definitions.items()}
        keep, queue = set(), [entry_point]
        while queue:
            name = queue.pop(0)
            if name not in keep:
                keep.add(name)
                queue += sorted(uses.get(name, set()) - keep)
    return "\n".join([ast.unparse(n) for n in imports]
                     + [ast.unparse(node) for name, node in definitions.items() if name in keep])


def humaneval_program(answer: str, doc: dict[str, Any]) -> str:
    """The paper's HumanEval candidate: the prompt, a newline and the answer's code, sanitized."""
    code = answer.split("```python\n", 1)[-1].split("```")[0]
    return sanitize(doc["prompt"] + "\n" + code, doc["entry_point"])


def humaneval_create_test(resps: Iterable[list[str]], docs: list[dict[str, Any]]) -> list[list[str]]:
    """lm-eval ``custom`` filter: each answer becomes :func:`humaneval_program`."""
    return [[humaneval_program(r, doc) for r in responses] for responses, doc in zip(resps, docs)]


def mbpp_tests(doc: dict[str, Any]) -> str:
    """The paper's MBPP reference: the first three assert lines (its ``doc_to_target``)."""
    return "\n".join(doc["test_list"][:3])


def _passes(program: str) -> float:
    from refusion_cli.harness.code_tasks import CODE_MEMORY_MB, CODE_TIMEOUT_S
    from refusion_cli.harness.sandbox import run_candidate

    return float(run_candidate(program, timeout=CODE_TIMEOUT_S, memory_mb=CODE_MEMORY_MB).passed)


def mbpp_test_program(candidate: str, doc: dict[str, Any]) -> str:
    """``code_eval``'s MBPP program: the candidate, a newline, the assert lines (no setup code)."""
    return candidate + "\n" + mbpp_tests(doc)


def humaneval_test_program(candidate: str, doc: dict[str, Any]) -> str:
    """``code_eval``'s HumanEval program: the sanitized candidate, a newline, the tests, ``check(entry_point)``."""
    return candidate + "\n" + f"{doc['test']}\ncheck({doc['entry_point']})"


def mbpp_process_results(doc: dict[str, Any], results: list[str]) -> dict[str, float]:
    """pass@1 of :func:`mbpp_test_program` in the sandbox."""
    return {"pass_at_1": _passes(mbpp_test_program(results[0], doc))}


def humaneval_process_results(doc: dict[str, Any], results: list[str]) -> dict[str, float]:
    """pass@1 of :func:`humaneval_test_program` in the sandbox."""
    return {"pass_at_1": _passes(humaneval_test_program(results[0], doc))}
