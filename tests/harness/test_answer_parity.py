"""``--protocol paper`` scores unusual answers as the paper's own harness does, every metric of every filter.

``tests/harness/paper_adversarial.json`` holds what ML-GSAI/ReFusion's ``eval.py`` and its lm-eval
0.4.9.1 made, under the paper environment's pins (transformers 4.52.4, latex2sympy2_extended 1.10.2,
math-verify 0.8.0, numpy installed), of the unusual answers of ``tools/paper_answers.py`` given as
token ids in place of its decoder's output (cut after the first ``<|im_end|>``, as its decoder
stops): end tokens other than EOS inside an answer, special-token text spelled with ordinary tokens,
stop strings split by special tokens, combining marks and other Unicode, code importing numpy and
sympy, LaTeX the parsers' versions read differently, answers without EOS. Here the same answers go
through the ReFusion adapter under ``--protocol paper`` (``tests/harness/parity.py``).
"""

from __future__ import annotations

from typing import Any

import pytest

from refusion_cli.harness.paper_filters import first_python_block
from tests.harness.parity import BENCHMARKS, HERE, differences, golden_records, toolkit_runs_of
from tools.paper_answers import piece_ids

GOLDEN = HERE / "paper_adversarial.json"
LIMIT = 50  # documents per task the golden run answered (MATH: the first ten of each subject)
SCORED = {"math": 10}


@pytest.fixture(scope="module")
def golden() -> dict[str, list[dict[str, Any]]]:
    return golden_records(GOLDEN)


@pytest.fixture(scope="module")
def toolkit_runs(golden, qwen3, tmp_path_factory) -> dict[str, tuple[Any, dict[str, Any], Any]]:
    return toolkit_runs_of(golden, qwen3, lambda record: piece_ids(qwen3, record["pieces"]),
                           {name: SCORED.get(name, LIMIT) for name in BENCHMARKS}, tmp_path_factory)


# `make test-all`: the multiple-choice benchmarks' letters (their prompts are checked byte for byte by default in
# test_paper_parity.py); the number, math and code answers run by default
@pytest.mark.parametrize("name", [pytest.param(name, marks=pytest.mark.slow)
                                  if name in ("arc_challenge", "gpqa", "mmlu_pro") else name for name in BENCHMARKS])
def test_every_unusual_answer_is_scored_as_the_paper_scores_it(name, golden, toolkit_runs):
    _, evaluation, scorer = toolkit_runs[name]
    assert len(golden[name]) >= 20
    assert differences(name, golden[name], evaluation, scorer, first_python_block) == []


EXAMPLES = [  # the six classes' examples: (benchmark, pieces, the paper's headline score)
    ("arc_challenge", [{"text": " C"}, {"special": "<|endoftext|>"}, {"text": " or maybe A."}]),  # A
    ("arc_challenge", [{"text": " B<|endoftext|>."}]),  # B
    ("mmlu_pro", [{"text": "Quest"}, {"special": "<|im_start|>"}, {"text": "ion: restated. The answer is (B)."}]),  # C
    ("mmlu_pro", [{"text": "The answer is (B\u0307)."}]),  # D
    ("math", [{"text": "Thus $\\boxed{0\\%}$."}]),  # F
]


@pytest.mark.parametrize("benchmark, pieces", EXAMPLES)
def test_the_issue_examples_are_in_the_golden_file(golden, benchmark, pieces):
    """The examples of each class (E, code importing numpy, has its own answers on MBPP and HumanEval)."""
    found = [r for r in golden[benchmark] if [p for p in r["pieces"] if p != {"special": "<|im_end|>"}] == pieces]
    assert found, pieces


def test_numpy_imports_in_code_score_as_in_the_paper(golden, toolkit_runs):
    """Class E: the MBPP reference code plus ``import numpy as np`` passes in both."""
    numpy_answers = [r for r in golden["mbpp"] if "import numpy as np" in r["pieces"][0].get("text", "")]
    assert numpy_answers and all(r["scores"]["none"]["pass_at_1"] == 1.0 for r in numpy_answers)
