"""A model call that runs out of memory puts its rows back in the queue and the engine goes on with half as
many: every sample decoded once, equal to an uninterrupted run's; ``--batch-size auto`` and ``--max-memory``
are checked where they enter."""

from __future__ import annotations

import json

import pytest

from refusion_cli.decoding.config import ConfigError
from refusion_cli.decoding.memory import fitting_batch, parse_memory, reserve
from refusion_cli.decoding.mdm import CanvasRunner
from refusion_cli.harness import lm_adapters
from tests.memory import out_of_memory_above
from tests.harness.helpers import run_cli


def samples(output):
    (path,) = (output / "samples" / "synthetic").glob("*.jsonl")
    return [json.loads(line) for line in path.read_text().splitlines()]


def eval_args(output, *batch):
    return ["--task", "synthetic", "--decoder", "llada", "--limit", "8", "--set", "gen_length=16",
            "--device", "cpu", *batch, "--output", str(output)]


def test_a_call_out_of_memory_requeues_its_rows_and_the_samples_equal_an_uninterrupted_run(capsys, monkeypatch,
                                                                                           tmp_path):
    code, _, err = run_cli(capsys, monkeypatch, *eval_args(tmp_path / "alone", "--batch-size", "1"))
    assert code == 0, err
    failed = out_of_memory_above(monkeypatch, CanvasRunner, 2)  # a call of more than two rows does not fit
    code, _, err = run_cli(capsys, monkeypatch, *eval_args(tmp_path / "auto", "--batch-size", "auto", "--max-memory", "4GiB"))
    assert code == 0, err
    assert failed == [8, 4]  # the budget admitted all 8 requests; calls of 8 and 4 rows did not fit, 2 did
    alone, requeued = samples(tmp_path / "alone"), samples(tmp_path / "auto")
    assert sorted(r["doc_id"] for r in requeued) == sorted(r["doc_id"] for r in alone) == list(range(8))
    by_doc = {r["doc_id"]: r for r in alone}
    assert all(r["output"] == by_doc[r["doc_id"]]["output"] and r["tokens"] == by_doc[r["doc_id"]]["tokens"]
               and r["forwards"] == by_doc[r["doc_id"]]["forwards"] for r in requeued)
    assert {r["batch_rows"] for r in requeued} == {2}
    (cell,) = json.loads((tmp_path / "auto" / "metrics.json").read_text())["results"]
    assert cell["batch_size"] == 2 and cell["batch_notes"][0].startswith("batch size auto: 8 (4,096 MiB --max-memory")
    assert cell["batch_notes"][1:] == ["out of memory in a call of 8 rows: requeued them, at most 4 rows from now",
                                       "out of memory in a call of 4 rows: requeued them, at most 2 rows from now"]
    assert "batch size auto: 8" in (tmp_path / "auto" / "summary.md").read_text()


def test_lm_evals_batch_size_auto_decodes_with_the_chosen_batch():
    lm = lm_adapters.ADAPTERS["llada"].create_from_arg_string("pretrained=mdm-tiny,gen_length=16,max_memory=2GiB",
                                                               {"batch_size": "auto", "device": "cpu"})
    from lm_eval.api.instance import Instance

    requests = [Instance("generate_until", {}, (f"{i} + {i} =", {"until": []}), i) for i in range(3)]
    assert len(lm.generate_until(requests)) == 3
    assert lm.batch_notes[0].startswith("batch size auto: 3 (2,048 MiB --max-memory")
    assert {sample.batch_rows for sample in lm.samples} == {3}


@pytest.mark.parametrize("args, message", [
    (["--batch-size", "some"], "--batch-size=some: give a whole number of requests or auto"),
    (["--batch-size", "0"], "--batch-size must be at least 1, got 0"),
    (["--batch-size", "auto", "--max-memory", "lots"], "cannot read 'lots' as a memory size"),
    (["--max-memory", "2GiB"], "--max-memory bounds --batch-size auto"),
])
def test_bad_batch_options_are_one_line_and_exit_2(args, message, capsys, monkeypatch, tmp_path):
    code, _, err = run_cli(capsys, monkeypatch, *eval_args(tmp_path / "bad", *args))
    assert code == 2 and message in err and "Traceback" not in err


def test_memory_sizes_and_the_fitting_batch():
    assert [parse_memory(text) for text in ("20GiB", "500MB", "1.5G", "4096", "64 mib")] == [
        20 * 2**30, 500 * 10**6, 1_500_000_000, 4096, 64 * 2**20]
    with pytest.raises(ConfigError):
        parse_memory("-1GB")
    assert reserve(2**30) == 64 * 2**20 and reserve(100 * 2**30) == 5 * 2**30
    # (budget - weights - reserve) // row, at least 1, at most the requests
    assert fitting_batch(2**30, 100 * 2**20, 50 * 2**20, 100, "x").size == (2**30 - 164 * 2**20) // (50 * 2**20)
    assert fitting_batch(2**30, 2**30, 50 * 2**20, 100, "x").size == 1
    assert fitting_batch(2**40, 0, 1, 7, "x").size == 7
