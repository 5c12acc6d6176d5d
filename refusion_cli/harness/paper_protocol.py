"""The paper's evaluation protocol (``--protocol paper``): what its task files and ``eval.py`` did to
an answer, as functions the task YAMLs of ``evals/tasks/paper/`` name with ``!function``.

The paper's runs (``eval.sh`` of ML-GSAI/ReFusion, commit 7c20c12) used lm-eval 0.4.9.1 with task
files of their own and a model class (``eval.py``) that post-processed every answer. Where the
installed lm-eval (0.4.x) behaves the same, the task YAMLs use it; what differs lives here (the code
tasks' programs in :mod:`~refusion_cli.harness.paper_code`):

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
- ``math_process_docs`` / ``math_process_results``: MATH as lm-eval 0.4.9.1 scored it (Minerva's
  answer normalisation, sympy equivalence, math_verify); later versions normalise answers
  otherwise and count identical unparsable answers (matrices, tuples) as equal.
"""

from __future__ import annotations

import functools
import random
import re
import signal
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


# --- MATH: Minerva's answer normalisation and lm-eval 0.4.9.1's equivalence ------------------------

MATH_EQUIV_TIMEOUT_S = 5  # seconds sympy may spend comparing two answers
MATH_INVALID = "[invalidanswer]"
# Minerva's normalisation (Lewkowycz et al. 2022, appendix D): replacements, then removed expressions
MATH_SUBSTITUTIONS = [("an ", ""), ("a ", ""), (".$", "$"), ("\\$", ""), (r"\ ", ""), (" ", ""), ("mbox", "text"),
                      (",\\text{and}", ","), ("\\text{and}", ","), ("\\text{m}", "\\text{}")]
MATH_REMOVED = ["square", "ways", "integers", "dollars", "mph", "inches", "ft", "hours", "km", "units", "\\ldots",
                "sue", "points", "feet", "minutes", "digits", "cents", "degrees", "cm", "gm", "pounds", "meters",
                "meals", "edges", "students", "childrentickets", "multiples", "\\text{s}", "\\text{.}",
                "\\text{\ns}", "\\text{}^2", "\\text{}^3", "\\text{\n}", "\\text{}", r"\mathrm{th}", r"^\circ",
                r"^{\circ}", r"\;", r",\!", "{,}", '"', "\\dots"]


def last_boxed(text: str) -> str | None:
    """The last ``\\boxed{...}`` (or ``\\boxed x`` up to a ``$``, or ``\\fbox{...}``) of ``text``, braces balanced."""
    if "\\boxed " in text:
        return "\\boxed " + text.split("\\boxed ")[-1].split("$")[0]
    start = text.rfind("\\boxed")
    if start < 0:
        start = text.rfind("\\fbox")
        if start < 0:
            return None
    depth = 0
    for position in range(start, len(text)):
        depth += {"{": 1, "}": -1}.get(text[position], 0)
        if text[position] == "}" and depth == 0:
            return text[start:position + 1]
    return None


def unbox(boxed: str) -> str:
    if "\\boxed " in boxed:
        if not boxed.startswith("\\boxed "):
            raise ValueError(f"not a boxed answer: {boxed!r}")
        return boxed[len("\\boxed "):]
    if not (boxed.startswith("\\boxed{") and boxed.endswith("}")):
        raise ValueError(f"not a boxed answer: {boxed!r}")
    return boxed[len("\\boxed{"):-1]


def normalize_math_answer(answer: str) -> str:
    """Minerva's normalisation of a final answer, as lm-eval 0.4.9.1 applies it."""
    answer = answer.split("=")[-1]
    for before, after in MATH_SUBSTITUTIONS:
        answer = answer.replace(before, after)
    for expression in MATH_REMOVED:
        answer = answer.replace(expression, "")
    answer = re.sub(r"(.*?)(\$)(.*?)(\$)(.*)", "$\\3$", answer)
    for command in ("text", "textbf", "overline"):
        answer = re.sub(rf"(\\{command}\{{)(.*?)(\}})", "\\2", answer)
    answer = re.sub(r"(\\boxed\{)(.*)(\})", "\\2", answer)
    answer = re.sub(r"(frac)([^{])(.)", "frac{\\2}{\\3}", answer)
    answer = re.sub(r"(sqrt)([^{])", "sqrt{\\2}", answer)
    answer = answer.replace("$", "")
    if answer.replace(",", "").isdigit():
        answer = answer.replace(",", "")
    return answer


def math_process_docs(dataset: Any) -> Any:
    """Each problem with its normalised boxed answer (``answer``)."""
    return dataset.map(lambda doc: {"problem": doc["problem"], "solution": doc["solution"],
                                    "answer": normalize_math_answer(unbox(last_boxed(doc["solution"])))})


def math_doc_to_text(doc: dict[str, Any]) -> str:
    return "Problem:\n" + doc["problem"] + "\n\nSolution:"


def final_answer_sentence(text: str) -> str:
    """X of "Final Answer: The final answer is X. I hope it is correct." (the sentence may end the text)."""
    match = re.search(r"Final Answer: The final answer is(.*?). I hope it is correct.", text + "I hope it is correct.")
    return match.group(1).strip() if match else MATH_INVALID


class _Alarm:
    """Raise TimeoutError after ``seconds`` (SIGALRM; the main thread only, as lm-eval's task code)."""

    def __init__(self, seconds: int) -> None:
        self.seconds = seconds

    def _raise(self, signum: int, frame: Any) -> None:
        raise TimeoutError("timed out")

    def __enter__(self) -> None:
        signal.signal(signal.SIGALRM, self._raise)
        signal.alarm(self.seconds)

    def __exit__(self, *exc: Any) -> None:
        signal.alarm(0)


def math_equivalent(answer: str, gold: str) -> bool:
    """Whether sympy finds the two normalised LaTeX answers equal (an answer it cannot parse never is)."""
    import sympy
    from sympy.parsing.latex import parse_latex
    from sympy.parsing.latex.errors import LaTeXParsingError

    try:
        with _Alarm(MATH_EQUIV_TIMEOUT_S):
            try:
                parsed = parse_latex(answer), parse_latex(gold)
            except (LaTeXParsingError, sympy.SympifyError, TypeError):
                return False
            try:
                difference = parsed[0] - parsed[1]
            except TypeError:
                return False
            try:
                return bool(sympy.simplify(difference) == 0)
            except ValueError:
                return False
    except TimeoutError:
        return False
    except ImportError:
        raise
    except Exception:  # noqa: BLE001  (lm-eval counts any other failure as "not equal")
        return False


def math_process_results(doc: dict[str, Any], results: list[str]) -> dict[str, int]:
    """exact_match: the "Final Answer" sentence's answer against the boxed one; math_verify: the answer
    against the whole reference solution."""
    from math_verify import parse, verify

    answer = results[0]
    exact = math_equivalent(normalize_math_answer(final_answer_sentence(answer)), doc["answer"])
    return {"exact_match": int(exact), "math_verify": int(bool(verify(gold=parse(doc["solution"]), target=parse(answer))))}
