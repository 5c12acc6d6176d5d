"""`refusion bench --tps` end to end on tiny random checkpoints: the files, the rows, the columns.

One bench run (module fixture) serves most tests: refusion, AR and LLaDA at two lengths, two
prompts, two repeats. The checkpoints are random, so the numbers are not interesting; the
counts, the columns and the relations between them are.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pexpect
import pytest

from refusion_cli.bench.prompts import load_prompts
from refusion_cli.tasks.synthetic import is_correct
from tests.bench.helpers import bench_captured, read_csv
from tests.envs import cache_env

REPO = Path(__file__).resolve().parents[2]
LENGTHS = (16, 32)
LABELS = ("ar", "refusion", "refusion (recompute)", "llada")
N_PROMPTS, REPEATS = 2, 2


def cli_env() -> dict[str, str]:
    return {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1",
            "TOKENIZERS_PARALLELISM": "false", **cache_env()}


def refusion(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "refusion_cli", *args], capture_output=True, text=True,
                          env=cli_env(), cwd=REPO, timeout=300, stdin=subprocess.DEVNULL)


def model_args(causal: Path, bidirectional: Path) -> list[str]:
    return ["--model", f"refusion={causal}", f"ar={causal}", f"llada={bidirectional}"]


@pytest.fixture(scope="module")
def bench_run(causal_checkpoint, bidirectional_checkpoint, tmp_path_factory):
    """The run through the real entry point, in this process (a process of its own would add ~10 s of imports;
    tests/cli/test_app.py starts one), its streams captured off a terminal."""
    output = tmp_path_factory.mktemp("bench")
    out = bench_captured(["--decoder", "refusion", "ar", "llada",
                          *model_args(causal_checkpoint, bidirectional_checkpoint), "--limit", str(N_PROMPTS),
                          "--gen-length", *map(str, LENGTHS), "--warmup", "1", "--repeats", str(REPEATS),
                          "--ablation", "--output", str(output)])
    assert out.returncode == 0, out.stderr
    return out, output


def test_writes_csv_markdown_plots_and_the_machine(bench_run):
    out, output = bench_run
    for name in ("bench.csv", "samples.csv", "bench.md", "machine.json", "frontier.png", "tps_vs_gen_length.png"):
        assert (output / name).is_file(), name
    for plot in ("frontier.png", "tps_vs_gen_length.png"):
        assert (output / plot).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    report = (output / "bench.md").read_text()
    assert ("| decoder | model | settings | gen length | batch | TPS | TPS min / median / max | throughput | speed-up vs AR |"
            in report)
    assert "torch " in report and "threads" in report and "dtype float32" in report
    assert "peak resident set size" in report or "ru_maxrss" in report  # the memory method is stated
    assert "KV reuse vs recompute" in report
    for label in LABELS:
        assert f"| {label} |" in report
    assert "Decoding speed (batch 1)" in out.stdout and "refusion (recompute)" in out.stdout
    # off a terminal stdout is the row lines, then the table: no progress bar residue, no blank lines
    lines = out.stdout.splitlines()
    n_rows = len(LABELS) * len(LENGTHS)
    assert all(" @ " in line and "tok/s" in line for line in lines[:n_rows])
    assert lines[n_rows].startswith("Decoding speed (batch 1)")


def test_one_row_per_decoder_and_length_ar_first(bench_run):
    _, output = bench_run
    rows = read_csv(output / "bench.csv")
    assert [(row["decoder"], int(row["gen_length"])) for row in rows] == [
        ("ar", 16), ("ar", 32),
        ("refusion", 16), ("refusion (recompute)", 16), ("refusion", 32), ("refusion (recompute)", 32),
        ("llada", 16), ("llada", 32),
    ]
    for row in rows:
        assert int(row["prompts"]) == N_PROMPTS and int(row["decodes"]) == N_PROMPTS * REPEATS
        assert int(row["scored"]) == N_PROMPTS * REPEATS
    samples = read_csv(output / "samples.csv")
    assert len(samples) == len(rows) * N_PROMPTS * REPEATS


def test_speedup_is_tps_over_ar_tps_at_the_same_length(bench_run):
    _, output = bench_run
    rows = read_csv(output / "bench.csv")
    ar_tps = {row["gen_length"]: float(row["tps"]) for row in rows if row["decoder"] == "ar"}
    for row in rows:
        expected = float(row["tps"]) / ar_tps[row["gen_length"]]
        assert float(row["speedup_vs_ar"]) == pytest.approx(expected, rel=1e-4)
    assert all(float(row["speedup_vs_ar"]) == 1.0 for row in rows if row["decoder"] == "ar")


def test_columns_are_means_of_the_measured_decodes(bench_run):
    _, output = bench_run
    rows = read_csv(output / "bench.csv")
    samples = read_csv(output / "samples.csv")
    for row in rows:
        mine = [s for s in samples if s["decoder"] == row["decoder"] and s["gen_length"] == row["gen_length"]]
        for key, rel in (("tokens", 1e-4), ("forwards", 1e-4)):
            assert float(row[key]) == pytest.approx(sum(float(s[key]) for s in mine) / len(mine), rel=rel)
        # the row's TPS is the one counting rule (its tokens over its seconds, as eval's); the per-decode mean beside it
        assert float(row["tps"]) == pytest.approx(sum(int(s["tokens"]) for s in mine) /
                                                  sum(float(s["seconds"]) for s in mine), rel=1e-3)
        assert float(row["tps_sample_mean"]) == pytest.approx(sum(float(s["tps"]) for s in mine) / len(mine), rel=1e-3)
        seconds = sorted(float(s["seconds"]) * 1000 for s in mine)
        assert seconds[0] <= float(row["latency_p50_ms"]) <= float(row["latency_p95_ms"]) <= seconds[-1] + 1e-3
        for sample in mine:  # the DecodeStats rule, per decode
            assert float(sample["tps"]) == pytest.approx(int(sample["tokens"]) / float(sample["seconds"]), rel=1e-3)
            assert 1 <= int(sample["tokens"]) <= int(row["gen_length"])


def test_accuracy_is_is_correct_over_the_outputs(bench_run):
    _, output = bench_run
    targets = [prompt.target for prompt in load_prompts(None, N_PROMPTS)]
    samples = read_csv(output / "samples.csv")
    for row in read_csv(output / "bench.csv"):
        mine = [s for s in samples if s["decoder"] == row["decoder"] and s["gen_length"] == row["gen_length"]]
        verdicts = [is_correct(s["output"], targets[int(s["prompt"])]) for s in mine]
        assert [s["correct"] == "True" for s in mine] == verdicts
        assert float(row["accuracy"]) == pytest.approx(sum(verdicts) / len(verdicts))


def test_length_sweep_shows_cost_growing_with_length(bench_run):
    _, output = bench_run
    rows = {(row["decoder"], int(row["gen_length"])): row for row in read_csv(output / "bench.csv")}
    for length in LENGTHS:  # LLaDA decodes the whole budget, one token per step: forwards = gen_length
        assert float(rows["llada", length]["forwards"]) == length
        assert f"steps={length}" in rows["llada", length]["config"]
    assert "block_length=16" in rows["llada", 16]["config"]  # 32 does not divide 16: one block
    assert "block_length=32" in rows["llada", 32]["config"]
    for label in LABELS:
        assert float(rows[label, 32]["forwards"]) >= float(rows[label, 16]["forwards"])


@pytest.mark.parametrize("args, message", [
    (["--prompts", "EMPTY"], "is empty"),
    (["--decoder", "refusion", "beam"], "unknown decoder 'beam'"),
    (["--gen-length", "0"], "--gen-length must be a positive integer, got 0"),
])
def test_bad_input_is_one_line_and_exit_2(args, message, tmp_path, monkeypatch, capsys, causal_checkpoint,
                                          bidirectional_checkpoint):
    """Through the real entry point (in-process, for speed): one error line, exit 2, nothing written."""
    from refusion_cli.cli.app import main

    empty = tmp_path / "empty.jsonl"
    empty.write_text("\n")
    args = [str(empty) if arg == "EMPTY" else arg for arg in args]
    monkeypatch.setattr(sys, "argv", ["refusion", "bench", *args,
                                      *model_args(causal_checkpoint, bidirectional_checkpoint),
                                      "--output", str(tmp_path / "out")])
    with pytest.raises(SystemExit) as exit_info:
        main()
    assert exit_info.value.code == 2
    out = capsys.readouterr()
    errors = [line for line in out.err.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and message in " ".join(out.err.split())
    assert "Traceback" not in out.err and out.out == ""
    assert not (tmp_path / "out").exists()  # refused before anything ran


@pytest.mark.slow  # `make test-all` (16 s, a Ctrl-C to a real process); by default test_bench_resume.py checks an
# interrupted run's files and message in-process
def test_an_interrupted_bench_keeps_its_finished_rows(causal_checkpoint, tmp_path):
    output = tmp_path / "out"
    child = pexpect.spawn(sys.executable, ["-m", "refusion_cli", "bench", "--decoder", "ar", "refusion",
                                           "--model", f"ar={causal_checkpoint}", f"refusion={causal_checkpoint}",
                                           "--limit", "2", "--gen-length", "16", "640", "--warmup", "0",
                                           "--repeats", "50",  # the 640-token rows outlast the Ctrl-C
                                           "--output", str(output)],
                          env={**cli_env(), "TERM": "dumb"}, cwd=str(REPO), encoding="utf-8", timeout=120)
    child.expect(r"ar @ 16: ")
    child.sendintr()
    child.expect(pexpect.EOF)
    child.close()
    assert child.exitstatus == 130
    assert child.before.rstrip().endswith("error: interrupted") and "Traceback" not in child.before
    assert f"kept in {output}; the same command with --resume continues it" in child.before
    rows = read_csv(output / "bench.csv")
    assert rows and rows[0]["decoder"] == "ar" and rows[0]["gen_length"] == "16"
    assert len(rows) < 4
    assert "**Interrupted**" in (output / "bench.md").read_text()


@pytest.mark.slow  # `make test-all`; test_bench_sweep.py checks the variants' rows in-process by default
def test_causal_fix_adds_its_own_row_after_each_refusion_row(causal_checkpoint, tmp_path):
    out = refusion("bench", "--tps", "--decoder", "refusion", "ar", "--model", f"refusion={causal_checkpoint}",
                   f"ar={causal_checkpoint}", "--causal-fix", "--limit", "1", "--gen-length", "16",
                   "--warmup", "0", "--output", str(tmp_path))
    assert out.returncode == 0, out.stderr
    rows = read_csv(tmp_path / "bench.csv")
    assert [row["decoder"] for row in rows] == ["ar", "refusion", "refusion (causal fix)"]
    assert rows[1]["config"] == rows[2]["config"]  # the same settings, only the ablation differs
    assert all(float(row["tokens"]) > 0 and float(row["forwards"]) > 0 for row in rows)
    assert f"models: ar={causal_checkpoint}, refusion={causal_checkpoint}\n" in out.stdout  # one entry per model
