"""The paper protocol's answer filters and multiple-choice prompts (``--protocol paper``): what the
paper's ``eval.py`` and its lm-eval 0.4.9.1 did to an answer or a document where the installed lm-eval
(0.4.x) does otherwise, as functions the task YAMLs of ``evals/tasks/paper/`` name with ``!function``.

The paper's runs (``eval.sh`` of ML-GSAI/ReFusion, commit 7c20c12) used lm-eval 0.4.9.1 with task
files of their own and a model class (``eval.py``) that post-processed every answer. Where the
installed lm-eval behaves the same, the task YAMLs use it; what differs lives here, in
:mod:`~refusion_cli.harness.paper_code` (the code tasks' programs) and in
:mod:`~refusion_cli.harness.paper_math` (MATH's scoring). The filters take lm-eval's responses (a
list per document) and return them in the same shape.

- :func:`python_blocks`: ``eval.py``'s last step, on every task: an answer holding a
  ```` ```python\\n...\\n``` ```` block is replaced by that block's content. It is the first step of
  every paper task's filters. (The steps before it — decode, cut at the first stop string, drop
  special tokens — are the adapters' own: they cut the response after EOS, decode it without
  special tokens, then cut it at the earliest stop string, which gives the same text for the
  seven tasks' stop lists.)
- :func:`lstrip_responses`: lm-eval 0.4.9.1's ``remove_whitespace`` filter (ARC-C) strips the
  start only; later versions strip both ends.
- :data:`gpqa_choice_letter`: 0.4.9.1's ``multi_choice_regex`` (GPQA ``flexible-extract``); later
  versions try the choice texts longest first, which can pick another letter.
- :func:`gpqa_process_docs`: the paper's GPQA preprocessing (bracketed text removed from the
  choices, then the four shuffled with Python's global RNG, as lm-eval's own).
- :func:`mmlu_pro_doc_to_text`: MMLU-Pro's prompt with the options as they are (later versions
  strip them).
"""

from __future__ import annotations

import functools
import random
import re
import sys
import unicodedata
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

PYTHON_BLOCK = re.compile(r"```python\n(.*?)\n```", re.DOTALL)


def first_python_block(text: str) -> str:
    """``eval.py``'s last step: the content of the first ```` ```python ```` block, else ``text``."""
    match = PYTHON_BLOCK.search(text)
    return match.group(1) if match else text


def python_blocks(resps: Iterable[list[str]], docs: list[dict[str, Any]]) -> list[list[str]]:
    """lm-eval ``custom`` filter: :func:`first_python_block` on every response."""
    return [[first_python_block(r) for r in responses] for responses in resps]


def lstrip_responses(resps: Iterable[list[str]], docs: list[dict[str, Any]]) -> list[list[str]]:
    """lm-eval 0.4.9.1's ``remove_whitespace``: leading whitespace removed."""
    return [[r.lstrip() for r in responses] for responses in resps]


@functools.cache
def _punctuation_table() -> dict[int, None]:
    return dict.fromkeys(i for i in range(sys.maxunicode) if unicodedata.category(chr(i)).startswith("P"))


@dataclass(frozen=True)
class MultiChoiceRegex:
    """lm-eval 0.4.9.1's ``multi_choice_regex`` filter: the pattern's match, else the first choice text
    found in the answer (choices in their order), else a bare letter after a colon."""

    pattern: str
    group_select: int = 0
    ignore_case: bool = False
    ignore_punctuation: bool = False
    fallback: str = "[invalid]"

    def _normalise(self, text: str) -> str:
        if self.ignore_case:
            text = text.lower()
        if self.ignore_punctuation:
            text = text.translate(_punctuation_table())
        return text

    def _find(self, regex: re.Pattern, text: str, convert: dict[str, str] | None = None) -> str:
        found = regex.findall(text)
        if not found:
            return ""
        match = found[self.group_select]
        if isinstance(match, tuple):
            match = [m for m in match if m][0]
        match = match.strip()
        return (convert or {}).get(match, match) if match else match

    def __call__(self, resps: Iterable[list[str]], docs: list[dict[str, Any]]) -> list[list[str]]:
        regex = re.compile(self.pattern)
        filtered = []
        for responses, doc in zip(resps, docs):
            letters = [chr(ord("A") + i) for i in range(len(doc["choices"]))]
            by_text = {self._normalise(c.strip()): f"({letter})" for c, letter in zip(doc["choices"], letters)}
            texts = re.compile("|".join(re.escape(self._normalise(c.strip())) for c in doc["choices"]))
            bare = re.compile(rf":[\s]*({'|'.join(letters)})")
            out = []
            for response in responses:
                match = (self._find(regex, response)
                         or self._find(texts, self._normalise(response), by_text)
                         or self._find(bare, response, {letter: f"({letter})" for letter in letters}))
                out.append(match or self.fallback)
            filtered.append(out)
        return filtered


# GPQA's flexible-extract: the last "(X)" in the answer, else a choice text, else "...: X"
gpqa_choice_letter = MultiChoiceRegex(r"(\([A-Z]\))", group_select=-1, ignore_case=True, ignore_punctuation=True)


def _gpqa_clean(text: str | None) -> str:
    if text is None:
        return " "
    text = text.strip().replace(" [title]", ". ")
    text = re.sub(r"\[.*?\]", "", text)
    return text.replace("  ", " ")


def gpqa_process_docs(dataset: Any) -> Any:
    """The paper's GPQA documents: cleaned choices, shuffled with Python's global RNG, the answer "(X)"."""

    def one(doc: dict[str, Any]) -> dict[str, Any]:
        correct = _gpqa_clean(doc["Correct Answer"])
        choices = [_gpqa_clean(doc[f"Incorrect Answer {i}"]) for i in (1, 2, 3)] + [correct]
        random.shuffle(choices)
        return {**{f"choice{i + 1}": c for i, c in enumerate(choices)}, "choices": choices,
                "answer": f"({chr(ord('A') + choices.index(correct))})"}

    return dataset.map(one)


MMLU_PRO_LETTERS = "ABCDEFGHIJ"


def mmlu_pro_doc_to_text(doc: dict[str, Any]) -> str:
    """MMLU-Pro's zero-shot prompt, the options as the data has them."""
    options = "".join(f"{letter}. {option}\n" for letter, option in zip(MMLU_PRO_LETTERS, doc["options"]))
    return f"Question:\n{doc['question']}\nOptions:\n{options}Answer: Let's think step by step."
