"""The same documents through lm-eval's own ``hf`` model: outputs and scores set beside a `refusion eval` run's.

    python -m tools.hf_compare --run RUN --model MODEL --task gsm8k,math --protocol paper --limit 3 \\
        --data-dir DIR --output OUT

``RUN`` is the output folder of a ``refusion eval --decoder ar --model MODEL`` run with the same ``--task``,
``--protocol``, ``--limit`` and ``--data-dir``. The tasks are built as that run built them (``plan_eval``: the
same task YAMLs over the same local data); lm-eval's ``HFLM`` wraps the same loaded model and tokenizer (a GGUF
file included) and runs lm-eval's ``evaluate`` with the chat template, zero-shot and the run's response budget
(``max_gen_toks``), batch 1. For every document the response text and the headline per-sample score
(``Benchmark.metric`` under ``metric_filter``) of both are compared. Writes ``compare.json`` (every sample of
both) and ``compare.md`` (counts per benchmark and each difference) under ``--output``.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path
from typing import Any

from refusion_cli.cli.output import fail
from refusion_cli.errors import UserError
from refusion_cli.harness.journal import read_records
from refusion_cli.harness.manifest import EvalProtocol
from refusion_cli.harness.evaluation import run_task
from refusion_cli.harness.runner import EvalOptions, plan_eval
from refusion_cli.harness.suite import Benchmark
from refusion_cli.paths import check_output_dir

DECODER = "ar"


def refusion_samples(run: Path, benchmark: Benchmark) -> dict[tuple[str, int], dict[str, Any]]:
    """(lm-eval task, doc id) -> the journal line of the AR run for ``benchmark`` in ``run``."""
    files = sorted((run / "samples" / benchmark.name).glob(f"{DECODER}__*.jsonl"))  # every rank's journal
    records = {(record["subtask"], int(record["doc_id"])): record for record in read_records(files)}
    if not records:
        raise UserError(f"{run} holds no samples for {benchmark.name}",
                        hint="run refusion eval with the same --task, --protocol and --limit into that folder first")
    return records


def hf_samples(lm: Any, benchmark: Benchmark, task_dict: dict[str, Any], gen_length: int, limit: int | None,
               seed: int) -> dict[tuple[str, int], dict[str, Any]]:
    """(lm-eval task, doc id) -> lm-eval's logged sample (its filter's response and metric) for ``benchmark``."""
    evaluation = run_task(lm, benchmark, task_dict, gen_length=gen_length, limit=limit, seed=seed,
                          confirm_run_unsafe_code=True)
    samples = {}
    for task_name, logged in evaluation["samples"].items():
        for sample in logged:
            if sample["filter"] == benchmark.metric_filter:
                samples[(task_name, int(sample["doc_id"]))] = sample
    return samples


def compare(ours: dict[tuple[str, int], dict[str, Any]], theirs: dict[tuple[str, int], dict[str, Any]],
            metric: str) -> list[dict[str, Any]]:
    """One row per document: both responses, both scores, whether each is the same."""
    rows = []
    for key in sorted(set(ours) | set(theirs)):
        mine, other = ours.get(key), theirs.get(key)
        text = mine["output"] if mine else None
        hf_text = other["resps"][0][0] if other else None
        score = float(mine["score"]) if mine else None
        hf_score = float(other[metric]) if other else None
        rows.append({"task": key[0], "doc_id": key[1], "same_text": text == hf_text, "same_score": score == hf_score,
                     "score": score, "hf_score": hf_score, "first_difference": first_difference(text, hf_text),
                     "tokens": mine["tokens"] if mine else None, "output": text, "hf_output": hf_text})
    return rows


def first_difference(a: str | None, b: str | None) -> int | None:
    """The first character index where two texts differ (None when equal or one is missing)."""
    if a is None or b is None or a == b:
        return None
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def markdown(rows_by_benchmark: dict[str, list[dict[str, Any]]], protocol: str) -> str:
    lines = [f"# `refusion eval --decoder ar` against lm-eval's `hf` model, protocol `{protocol}`", "",
             "| benchmark | documents | same response | same score | accuracy (refusion / hf) |", "|---|---:|---:|---:|---|"]
    for name, rows in rows_by_benchmark.items():
        mean = lambda values: 100 * sum(values) / len(values) if values else 0.0  # noqa: E731
        ours = mean([r["score"] for r in rows if r["score"] is not None])
        theirs = mean([r["hf_score"] for r in rows if r["hf_score"] is not None])
        lines.append(f"| {name} | {len(rows)} | {sum(r['same_text'] for r in rows)} | "
                     f"{sum(r['same_score'] for r in rows)} | {ours:.1f} % / {theirs:.1f} % |")
    differing = [(name, row) for name, rows in rows_by_benchmark.items() for row in rows if not row["same_text"]]
    lines += ["", f"Responses that differ: {len(differing)}."]
    for name, row in differing:
        at = row["first_difference"]
        lines += ["", f"- {name} {row['task']} doc {row['doc_id']} (scores {row['score']} / {row['hf_score']}), "
                      f"first difference at character {at}:",
                  f"  - refusion: `{(row['output'] or '')[max(0, (at or 0) - 40):(at or 0) + 60]!r}`",
                  f"  - hf: `{(row['hf_output'] or '')[max(0, (at or 0) - 40):(at or 0) + 60]!r}`"]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--run", type=Path, required=True, help="the refusion eval output folder to compare with")
    parser.add_argument("--model", required=True, help="the checkpoint that run decoded with the AR decoder")
    parser.add_argument("--task", required=True, help="the run's --task")
    parser.add_argument("--protocol", type=EvalProtocol, choices=list(EvalProtocol), default=EvalProtocol.PAPER,
                        help="the run's --protocol")
    parser.add_argument("--limit", type=int, default=None, help="the run's --limit")
    parser.add_argument("--data-dir", type=Path, default=None, help="the run's --data-dir")
    parser.add_argument("--output", type=Path, required=True, help="folder for compare.json and compare.md")
    parser.add_argument("--seed", type=int, default=0, help="the run's --seed")
    args = parser.parse_args(argv)
    try:
        from lm_eval.models.huggingface import HFLM

        from refusion_cli.models.loading import load_model

        check_output_dir(args.output, hint="pick a folder you can write to")
        with tempfile.TemporaryDirectory(prefix="hf-compare-") as scratch:
            options = EvalOptions(tasks=args.task.split(","), decoders=[DECODER], models=[args.model],
                                  output=Path(scratch), protocol=args.protocol, limit=args.limit, data_dir=args.data_dir,
                                  confirm_run_unsafe_code=True, seed=args.seed)
            plan = plan_eval(options)
        loaded = load_model(args.model, "cpu", require_mask=False)
        lm = HFLM(pretrained=loaded.model, tokenizer=loaded.tokenizer, batch_size=1, device="cpu")
        rows = {}
        for benchmark in plan.benchmarks:
            gen_length = plan.configs[(benchmark.name, plan.runs[0].label)].gen_length
            theirs = hf_samples(lm, benchmark, plan.tasks[benchmark.name], gen_length, args.limit, args.seed)
            rows[benchmark.name] = compare(refusion_samples(args.run, benchmark), theirs, benchmark.metric)
            print(f"{benchmark.name}: {sum(r['same_text'] for r in rows[benchmark.name])} of "
                  f"{len(rows[benchmark.name])} responses the same", flush=True)
    except UserError as error:
        fail(str(error), error.hint)
    args.output.mkdir(parents=True, exist_ok=True)
    (args.output / "compare.json").write_text(json.dumps(rows, indent=1) + "\n", encoding="utf-8")
    (args.output / "compare.md").write_text(markdown(rows, args.protocol), encoding="utf-8")


if __name__ == "__main__":
    sys.exit(main())
