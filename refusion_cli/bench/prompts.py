"""The prompts a benchmark decodes: the embedded synthetic task, or a JSONL file of the user's.

Contract of :func:`load_prompts`:

- No file: the first ``limit`` problems of the synthetic task's held-out split
  (``evals/synthetic/test.jsonl``; regenerated identically from its seed when the package is
  installed without the repository), each with its ``target`` answer.
- A file: one JSON object per line with a ``prompt`` or ``question`` field (the user turn) and
  an optional ``target`` (the expected final answer, a number, scored with the synthetic task's
  ``is_correct``); blank lines are skipped; ``limit`` keeps the first N.
- An empty file, a missing file, a directory, a line that is not a JSON object with a text
  field, a ``target`` no answer could match (not a number), or a ``limit`` below 1 is a
  :class:`UserError` naming the file and line.

:func:`prompts_digest` is what ``run.json`` records of the prompts, so that ``--resume`` decodes the same ones.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from refusion_cli.errors import UserError
from refusion_cli.jsonl import json_objects, read_text
from refusion_cli.tasks.synthetic import TEST_SEED_OFFSET, generate_problems, is_correct, read_jsonl

SYNTHETIC_TEST = Path(__file__).resolve().parents[2] / "evals" / "synthetic" / "test.jsonl"
SYNTHETIC_SEED = 0  # the seed evals/synthetic/test.jsonl was written with
TEXT_FIELDS = ("prompt", "question")


@dataclass(frozen=True)
class BenchPrompt:
    text: str  # the user turn, rendered with each model's chat template before decoding
    target: str | None  # the expected final answer, or None when the prompt is not scored


def load_prompts(path: Path | None = None, limit: int | None = None) -> list[BenchPrompt]:
    """The benchmark's prompts: ``path`` (JSONL) or the synthetic task; the first ``limit`` of them."""
    if limit is not None and limit < 1:
        raise UserError(f"--limit must be at least 1, got {limit}")
    if path is None:
        return synthetic_prompts(limit if limit is not None else 20)
    prompts = read_prompt_file(path)
    return prompts[:limit] if limit is not None else prompts


def prompts_digest(prompts: Sequence[BenchPrompt]) -> str:
    """SHA-256 (hex) of the prompts' texts and targets, in order."""
    data = json.dumps([[prompt.text, prompt.target] for prompt in prompts], ensure_ascii=False)
    return hashlib.sha256(data.encode("utf-8")).hexdigest()


def synthetic_prompts(limit: int) -> list[BenchPrompt]:
    """The first ``limit`` held-out synthetic problems (question + target)."""
    if SYNTHETIC_TEST.is_file():
        problems = read_jsonl(SYNTHETIC_TEST)[:limit]
    else:  # an installed package: the split is deterministic, regenerate it
        problems = generate_problems(limit, SYNTHETIC_SEED + TEST_SEED_OFFSET)
    return [BenchPrompt(problem["question"], problem["target"]) for problem in problems]


def read_prompt_file(path: Path) -> list[BenchPrompt]:
    if path.is_dir():
        raise UserError(f"the prompts file {path} is a directory, not a JSONL file",
                        hint="give a JSONL file, one prompt a line")
    if not path.exists():
        raise UserError(f"no such prompts file: {path}")
    if not path.is_file():
        raise UserError(f"the prompts file {path} is not a regular file", hint="give a JSONL file, one prompt a line")
    text = read_text(path, f"the prompts file {path}")
    hint = "give one JSON object per line with a 'prompt' or 'question' field"
    prompts = [prompt_of(record, path, number) for number, record in json_objects(text, str(path), hint)]
    if not prompts:
        raise UserError(f"the prompts file {path} is empty", hint=hint)
    return prompts


def prompt_of(record: dict, path: Path, number: int) -> BenchPrompt:
    name = next((name for name in TEXT_FIELDS if name in record), None)
    if name is None:
        raise UserError(f"{path}, line {number}, has no 'prompt' or 'question' field")
    text = record[name]
    if not isinstance(text, str) or not text.strip():
        raise UserError(f"{path}, line {number}: '{name}' must be a non-empty string")
    target = record.get("target")
    if target is None:
        return BenchPrompt(text, None)
    if not is_correct(str(target), str(target)):  # not a number: no answer could ever match it
        raise UserError(f"{path}, line {number}: 'target' must be a number (answers are scored by the number "
                        f"after '####', else the last number), got {json.dumps(target, ensure_ascii=False)}",
                        hint="leave 'target' out to time a prompt without scoring it")
    return BenchPrompt(text, str(target))
