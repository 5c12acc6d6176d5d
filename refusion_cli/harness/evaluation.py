"""One lm-eval task run with one model: the settings every evaluation here shares, in one place.

Contract: :func:`run_task` evaluates a benchmark's built lm-eval tasks (``suite.load_tasks``) with any lm-eval
model (the toolkit's adapters, lm-eval's own ``hf`` model, a test's scripted one): the benchmark's shots, the
response budget ``gen_length`` as ``max_gen_toks``, the chat template when the benchmark uses one (multi-turn
few-shot), the documents up to ``limit``, every sample logged, lm-eval's RNGs seeded as ``simple_evaluate``
seeds them. ``refusion eval`` (``runner``), ``tools/hf_compare.py`` and the parity tests all call it, so
each checks the path a run takes.
"""

from __future__ import annotations

import random
from typing import Any

from refusion_cli.harness.suite import Benchmark


def seed_lm_eval(seed: int) -> None:
    """lm-eval's task code draws from Python's global RNG (GPQA shuffles its choices with it), as
    its ``simple_evaluate`` seeds it; seed it the same way so prompts, hence resume keys, repeat."""
    random.seed(seed)


def configure_tasks(benchmark: Benchmark, task_dict: dict[str, Any], gen_length: int, seed: int) -> None:
    """The benchmark's shots, the response budget and the few-shot seed, set on each of its tasks."""
    for task in task_dict["tasks"].values():
        task.set_config(key="num_fewshot", value=benchmark.num_fewshot)
        task.set_config(key="generation_kwargs", value={"max_gen_toks": gen_length}, update=True)
        task.set_fewshot_seed(seed=seed)


def run_task(lm: Any, benchmark: Benchmark, task_dict: dict[str, Any], *, gen_length: int, limit: int | None,
             seed: int, confirm_run_unsafe_code: bool) -> dict[str, Any] | None:
    """lm-eval's ``evaluate`` of ``benchmark``'s tasks with ``lm`` (None on a data-parallel rank above 0)."""
    import lm_eval.evaluator

    configure_tasks(benchmark, task_dict, gen_length, seed)
    seed_lm_eval(seed)
    return lm_eval.evaluator.evaluate(lm=lm, task_dict=task_dict, limit=limit, log_samples=True,
                                      apply_chat_template=benchmark.chat_template, fewshot_as_multiturn=True,
                                      confirm_run_unsafe_code=confirm_run_unsafe_code)
