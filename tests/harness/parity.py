"""The toolkit's side of the checks against the paper's own harness (golden files of tools/paper_parity.py).

Each benchmark's paper task YAMLs are built by ``suite.load_tasks`` and evaluated by lm-eval's
``evaluate`` (``evaluation.run_task``, as ``refusion eval`` runs a task) through the real ReFusion adapter
(``--protocol paper``): its chat template, request
preparation, end ids and answer handling (``harness.answers``). Only the decoder is scripted: for a
prompt it returns the golden file's answer ids, cut after the first of the end ids the adapter gives
it, as every decoder cuts its response (``DecodeResult.tokens``).
"""

from __future__ import annotations

import json
from collections import defaultdict
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from refusion_cli.decoding.stats import DecodeResult, DecodeStats, cut_after_eos
from refusion_cli.harness import lm_adapters
from refusion_cli.harness.manifest import EvalProtocol
from refusion_cli.harness.evaluation import configure_tasks, run_task, seed_lm_eval
from refusion_cli.harness.scoring import TaskScorer
from refusion_cli.harness.suite import load_suite, load_tasks, render
from refusion_cli.models.loading import LoadedModel

HERE = Path(__file__).parent
PAPER_DATA = HERE / "paper_data"
BENCHMARKS = ["gsm8k", "math", "mbpp", "humaneval", "arc_challenge", "gpqa", "mmlu_pro"]
# the paper's humaneval metric is lm-eval's pass_at_k ("pass@1"); the toolkit's sandboxed one is pass_at_1
METRIC_NAMES = {"pass@1": "pass_at_1"}


def golden_records(path: Path) -> dict[str, list[dict[str, Any]]]:
    """A golden file's records by benchmark."""
    by_benchmark = defaultdict(list)
    for record in json.loads(path.read_text(encoding="utf-8"))["records"]:
        by_benchmark[record["benchmark"]].append(record)
    return by_benchmark


def subtask(name: str) -> str:
    """lm-eval's name of a task, without the "group::" it gives a subtask defined inside its group's YAML
    (the toolkit's MATH subjects; the paper's are files of their own)."""
    return name.split("::")[-1]


def scripted_adapter(tokenizer: Any, answers: dict[str, list[int]]) -> lm_adapters.DecoderLM:
    """The ReFusion adapter under ``--protocol paper`` on a stand-in model (no weights are used: the
    decoder is scripted by :func:`scripted_decoding`). ``answers``: the model input text -> the answer ids."""
    model = torch.nn.Linear(1, 1)
    model.config = SimpleNamespace(max_position_embeddings=1 << 20)
    loaded = LoadedModel(model, tokenizer, mask_token_id=None, eos_token_id=tokenizer.eos_token_id,
                         pad_token_id=tokenizer.pad_token_id, family="qwen3", bidirectional=False, source="qwen3",
                         stop_token_ids=(tokenizer.eos_token_id, tokenizer.pad_token_id))
    adapter = lm_adapters.ADAPTERS["refusion"](pretrained=loaded, protocol=EvalProtocol.PAPER)
    adapter.script = {tuple(adapter.tok_encode(prompt)): ids for prompt, ids in answers.items()}
    adapter.prompts = {}  # (task, doc_id) -> the model input, kept by the evaluation
    return adapter


def scripted_decoding(adapter: lm_adapters.DecoderLM) -> Any:
    """``run_decoder`` as the adapter calls it, answering each prompt with its scripted ids."""

    def run_decoder(decoder: str, model: Any, prompts: list[list[int]], config: Any, *, eos_token_id: Any,
                    **options: Any) -> list[DecodeResult]:
        results = []
        for prompt in prompts:
            tokens = cut_after_eos(list(adapter.script.get(tuple(prompt), [])), eos_token_id)
            results.append(DecodeResult(tokens, DecodeStats(forwards=1, tokens=len(tokens), seconds=1.0)))
        return results

    return run_decoder


def toolkit_run(name: str, tokenizer: Any, answers: dict[str, list[int]], limit: int, folder: Path
                ) -> tuple[lm_adapters.DecoderLM, dict[str, Any], TaskScorer]:
    """One benchmark through the toolkit's paper tasks: every document's model input (``adapter.prompts``),
    lm-eval's evaluate over the first ``limit`` documents of each task, and the journal's scorer."""
    pytest.importorskip("math_verify", reason="MATH needs lm-eval's math extras")
    benchmark = load_suite(protocol=EvalProtocol.PAPER).benchmarks[name]
    data_file = PAPER_DATA / "humaneval" / "HumanEval.jsonl" if name == "humaneval" else None
    rendered = render(benchmark, folder, data_dir=PAPER_DATA, data_file=data_file)
    seed_lm_eval(0)  # as the runner: GPQA shuffles its choices while it is built
    task_dict = load_tasks(rendered, folder)
    adapter = scripted_adapter(tokenizer, answers)
    configure_tasks(benchmark, task_dict, benchmark.gen_length, seed=0)  # as run_task sets them, to read the prompts
    for task in task_dict["tasks"].values():
        task.build_all_requests(apply_chat_template=True, fewshot_as_multiturn=True,
                                chat_template=adapter.apply_chat_template, tokenizer_name=adapter.tokenizer_name)
        for instance in task.instances:
            adapter.prompts[(subtask(instance.task_name), instance.doc_id)] = instance.args[0]
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(lm_adapters, "run_decoder", scripted_decoding(adapter))
        evaluation = run_task(adapter, benchmark, task_dict, gen_length=benchmark.gen_length, limit=limit, seed=0,
                              confirm_run_unsafe_code=True)
    return adapter, evaluation, TaskScorer(task_dict["tasks"], benchmark.metric, benchmark.metric_filter)


class LazyRuns(dict):
    """Each benchmark's :func:`toolkit_run`, made the first time a test asks for it (so a benchmark whose tests are
    all deselected costs nothing)."""

    def __init__(self, make: Any):
        super().__init__()
        self.make = make

    def __missing__(self, name: str) -> tuple[Any, dict[str, Any], TaskScorer]:
        self[name] = made = self.make(name)
        return made


def toolkit_runs_of(golden: dict[str, list[dict[str, Any]]], tokenizer: Any, answer_ids: Any,
                    limit: dict[str, int], tmp_path_factory: Any) -> dict[str, tuple[Any, dict[str, Any], TaskScorer]]:
    """:func:`toolkit_run` for each benchmark (when first asked for), each golden record answered with
    ``answer_ids(record)``; ``limit``: documents per task for each benchmark."""
    return LazyRuns(lambda name: toolkit_run(name, tokenizer, {r["prompt"]: answer_ids(r) for r in golden[name]},
                                             limit[name], tmp_path_factory.mktemp(name)))


def single(filtered: Any) -> Any:
    """A filtered response; the paper's HumanEval filter leaves it in a one-item list (its metric takes lists)."""
    return filtered[0] if isinstance(filtered, list) and len(filtered) == 1 else filtered


def differences(name: str, records: list[dict[str, Any]], evaluation: dict[str, Any], scorer: TaskScorer,
                response_of: Any) -> list[str]:
    """Every way the toolkit's samples differ from the golden records: the response after the answer
    handling (``response_of`` the sample's), each filter's output, each metric, and the journal's score."""
    benchmark = load_suite(protocol=EvalProtocol.PAPER).benchmarks[name]
    ours = {(subtask(task), sample["doc_id"], sample["filter"]): sample
            for task, samples in evaluation["samples"].items() for sample in samples}
    found = []
    for record in records:
        where = f"{record['task']}/{record['doc_id']} {record.get('pieces', record.get('answer'))!r}"
        for filter_name, scores in record["scores"].items():
            sample = ours[(record["task"], record["doc_id"], filter_name)]
            if response_of(sample["resps"][0][0]) != record["response"]:
                found.append(f"{where}: response {sample['resps'][0][0]!r}, paper {record['response']!r}")
            if single(sample["filtered_resps"][0]) != single(record["filtered"][filter_name]):
                found.append(f"{where}: {filter_name} {sample['filtered_resps'][0]!r}, "
                             f"paper {record['filtered'][filter_name]!r}")
            for metric, value in scores.items():
                if sample[METRIC_NAMES.get(metric, metric)] != value:
                    found.append(f"{where}: {filter_name} {metric} {sample[METRIC_NAMES.get(metric, metric)]}, "
                                 f"paper {value}")
        headline = ours[(record["task"], record["doc_id"], benchmark.metric_filter)]
        if not benchmark.code:  # the same functions again; the code benchmarks' programs are not run twice
            metric = next(m for m in record["scores"][benchmark.metric_filter]
                          if METRIC_NAMES.get(m, m) == benchmark.metric)
            task = next(key for key in scorer.tasks if subtask(key) == record["task"])
            score = scorer(task, headline["doc"], headline["resps"][0][0]).score
            if score != record["scores"][benchmark.metric_filter][metric]:
                found.append(f"{where}: journal score {score}, paper {record['scores'][benchmark.metric_filter][metric]}")
    return found
