"""A sample's seconds are its own decode's: with a model that takes a fixed time per call, every sample of
`refusion eval` at batch 1 takes its calls' time whatever came before it, and eval's TPS is bench's on the
same prompts and settings, at any ``--limit``."""

from __future__ import annotations

import json
import time

import pytest
import transformers

from tests.bench.helpers import read_csv, run_bench_cli
from tests.harness.helpers import run_cli

CALL_SECONDS = 0.1  # each model call of the slow model sleeps this long: it dominates every timing below
SETTINGS = ["--decoder", "refusion", "--device", "cpu", "--set", "slot_size=4", "block_size=32"]


@pytest.fixture
def slow_model(monkeypatch):
    """Every Qwen3 model call takes CALL_SECONDS more (the embedded models are Qwen3)."""
    forward = transformers.Qwen3ForCausalLM.forward

    def slow_forward(self, *args, **kwargs):
        time.sleep(CALL_SECONDS)
        return forward(self, *args, **kwargs)

    monkeypatch.setattr(transformers.Qwen3ForCausalLM, "forward", slow_forward)


def eval_samples(capsys, monkeypatch, output, limit):
    code, _, err = run_cli(capsys, monkeypatch, "--task", "synthetic", "--limit", str(limit), *SETTINGS, "gen_length=32",
                           "--output", str(output))
    assert code == 0, err
    (path,) = (output / "samples" / "synthetic").glob("*.jsonl")
    return sorted((json.loads(line) for line in path.read_text().splitlines()), key=lambda r: r["doc_id"])


def eval_tps(output):
    (cell,) = json.loads((output / "metrics.json").read_text())["results"]
    return cell["tps"]


def test_each_sample_is_timed_alone_and_eval_tps_is_bench_tps_at_any_limit(slow_model, capsys, monkeypatch,
                                                                           tmp_path):
    samples = eval_samples(capsys, monkeypatch, tmp_path / "eval-6", 6)
    for sample in samples:  # its own calls' time and a little more; never the time since the run started
        own = sample["forwards"] * CALL_SECONDS
        assert own <= sample["seconds"] < own + 0.05 * sample["forwards"] + 0.2, sample
    assert samples[-1]["seconds"] < sum(s["seconds"] for s in samples[:-1])

    code, _, err = run_bench_cli(["--limit", "6", "--warmup", "1", "--gen-length", "32", *SETTINGS, "--output", str(tmp_path / "bench")],
                                 monkeypatch, capsys)
    assert code == 0, err
    rows = read_csv(tmp_path / "bench" / "bench.csv")
    (row,) = [row for row in rows if row["decoder"] == "refusion"]
    bench_samples = [s for s in read_csv(tmp_path / "bench" / "samples.csv") if s["decoder"] == "refusion"]
    # the same prompts and settings: the same decodes, token for token
    assert [int(s["tokens"]) for s in bench_samples] == [s["tokens"] for s in samples]
    assert [int(s["forwards"]) for s in bench_samples] == [s["forwards"] for s in samples]
    assert eval_tps(tmp_path / "eval-6") == pytest.approx(float(row["tps"]), rel=0.10)

    # the first two problems alone: their rate is the one they had among six, not a higher one
    first_two = eval_samples(capsys, monkeypatch, tmp_path / "eval-2", 2)
    assert [s["tokens"] for s in first_two] == [s["tokens"] for s in samples[:2]]
    among_six = sum(s["tokens"] for s in samples[:2]) / sum(s["seconds"] for s in samples[:2])
    assert eval_tps(tmp_path / "eval-2") == pytest.approx(among_six, rel=0.10)
