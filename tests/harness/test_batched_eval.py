"""`refusion eval --batch-size N` gives every sample the answer of batch 1; only the timing differs."""

from __future__ import annotations

import json

import pytest

from refusion_cli.decoding.config import ConfigError
from refusion_cli.errors import UserError
from refusion_cli.harness.model_args import batch_size_value
from refusion_cli.harness.runner import EvalOptions, run_eval
from tools.same_answers import compare


def evaluate(tmp_path, name, batch_size, decoders):
    options = EvalOptions(tasks=["synthetic"], decoders=list(decoders), output=tmp_path / name,
                          overrides=["gen_length=32"], limit=6, device="cpu", batch_size=batch_size)
    return run_eval(options)


def batched_and_alone(tmp_path, decoders):
    """The same run at batch 1 and at batch 4: every sample's answer the same (tools/same_answers.py), and the
    counts; both runs' results."""
    alone, batched = evaluate(tmp_path, "b1", 1, decoders), evaluate(tmp_path, "b4", 4, decoders)
    lines = compare(tmp_path / "b1", tmp_path / "b4")
    assert len(lines) == len(decoders) and all(line.startswith("same: synthetic/") for line in lines), lines
    for one, four in zip(alone, batched):
        assert (one.accuracy, one.tokens, one.forwards, one.batch_size, four.batch_size) == (
            four.accuracy, four.tokens, four.forwards, 1, 4)
    return alone, batched


def test_a_batched_refusion_and_ar_run_has_the_answers_of_batch_1(tmp_path):
    alone, batched = batched_and_alone(tmp_path, ("refusion", "ar"))
    records = [json.loads(line) for line in (tmp_path / "b4" / "samples" / "synthetic" / "ar__ar-tiny.jsonl").open()]
    assert {r["batch_rows"] for r in records} == {4}  # 6 requests, 4 rows at most: a finished row's place is refilled
    # TPS is still per request (tokens over each one's latency); the throughput, tokens over the run's wall time,
    # is a column of its own
    assert batched[1].tps == pytest.approx(sum(r["tokens"] for r in records) / sum(r["seconds"] for r in records))
    assert batched[1].throughput == pytest.approx(sum(r["tokens"] for r in records) /
                                                  sum(r["wall_share"] for r in records))
    assert alone[1].throughput == alone[1].tps
    summary = (tmp_path / "b4" / "summary.md").read_text()
    assert "throughput (tokens/s over the run's wall time; batch 4)" in summary
    assert "throughput (" not in (tmp_path / "b1" / "summary.md").read_text()


@pytest.mark.slow  # `make test-all`; tests/decoding/test_batched.py batches LLaDA rows by default
def test_a_batched_llada_run_has_the_answers_of_batch_1(tmp_path):
    batched_and_alone(tmp_path, ("llada",))


@pytest.mark.parametrize("value, size", [(None, 1), ("1", 1), (16, 16), ("32", 32), ("auto", "auto"),
                                         ("auto:4", "auto")])
def test_lm_eval_batch_size_is_a_whole_number_or_auto(value, size):
    assert batch_size_value(value) == size


@pytest.mark.parametrize("value", ["many", "0", -2, "1.5"])
def test_a_bad_batch_size_is_refused(value):
    with pytest.raises(ConfigError, match="batch_size"):
        batch_size_value(value)
    with pytest.raises(UserError, match="--batch-size must be at least 1"):
        EvalOptions(tasks=["synthetic"], decoders=["ar"], output=None, batch_size=0)


def test_a_batched_run_resumes_from_its_journal(tmp_path):
    def ar_run(name):
        options = EvalOptions(tasks=["synthetic"], decoders=["ar"], output=tmp_path / name,
                              overrides=["gen_length=24"], limit=7, device="cpu", batch_size=3)
        return run_eval(options)

    [whole] = ar_run("whole")
    journal = tmp_path / "cut" / "samples" / "synthetic" / "ar__ar-tiny.jsonl"
    ar_run("cut")
    lines = journal.read_text().splitlines(keepends=True)
    journal.write_text("".join(lines[:4]))  # interrupted after 4 of 7 samples
    [resumed] = ar_run("cut")
    assert (resumed.resumed, resumed.decoded, resumed.samples) == (4, 3, 7)
    assert compare(tmp_path / "whole", tmp_path / "cut") == ["same: synthetic/ar__ar-tiny.jsonl (7 and 7 samples)"]
    assert (resumed.accuracy, resumed.tokens, resumed.forwards) == (whole.accuracy, whole.tokens, whole.forwards)
