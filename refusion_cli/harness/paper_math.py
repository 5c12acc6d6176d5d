"""MATH as the paper scored it (``--protocol paper``): lm-eval 0.4.9.1's ``minerva_math``, as functions
``evals/tasks/paper/minerva_math.yaml`` names with ``!function``.

Contract: ``math_process_docs`` keeps each problem with the last boxed answer of its reference
solution, normalised; ``math_process_results`` scores an answer two ways. exact_match: the answer of
the sentence "Final Answer: The final answer is X", normalised, against that boxed answer; they are
equal when sympy finds their difference zero within ``MATH_EQUIV_TIMEOUT_S`` seconds (an answer it
cannot parse never is). math_verify: the answer against the whole reference solution. The
normalisation is Minerva's (Lewkowycz et al. 2022, appendix D) as 0.4.9.1 applies it; later lm-eval
versions normalise answers otherwise and count identical unparsable answers (matrices, tuples) as
equal. The timeout is SIGALRM, so scoring runs on the main thread only, as lm-eval's task code does.
"""

from __future__ import annotations

import functools
import re
import signal
from typing import Any

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


def unbox(boxed: str | None) -> str:
    if boxed is None:
        raise ValueError("no boxed answer")
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


@functools.lru_cache(maxsize=4096)
def parsed_latex(text: str) -> Any:
    """sympy's reading of ``text``, or None where it cannot read it. Parsing is deterministic and its
    expressions immutable, so each text is parsed once a process: "[invalidanswer]", the answer of every
    problem without a final-answer sentence, takes sympy's parser a tenth of a second. A timeout is not kept."""
    import sympy
    from sympy.parsing.latex import parse_latex
    from sympy.parsing.latex.errors import LaTeXParsingError

    try:
        return parse_latex(text)
    except (LaTeXParsingError, sympy.SympifyError, TypeError):
        return None


def math_equivalent(answer: str, gold: str) -> bool:
    """Whether sympy finds the two normalised LaTeX answers equal (an answer it cannot parse never is)."""
    import sympy

    try:
        with _Alarm(MATH_EQUIV_TIMEOUT_S):
            first = parsed_latex(answer)
            second = None if first is None else parsed_latex(gold)  # the gold is read once the answer was
            if first is None or second is None:
                return False
            try:
                difference = first - second
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
