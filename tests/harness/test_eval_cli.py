"""`refusion eval` end to end on tiny random checkpoints: files, counts, agreement with direct decoding,
resume after a kill, data parallelism, and one-line errors."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from refusion_cli.decoding.registry import build_config, run_decoder
from refusion_cli.harness.suite import EVALS_DIR, load_suite
from refusion_cli.models.chat import user_prompt_ids
from refusion_cli.models.loading import load_model
from refusion_cli.tasks.synthetic import is_correct, read_jsonl

REPO = Path(__file__).resolve().parents[2]
PROBLEMS = read_jsonl(EVALS_DIR / "synthetic" / "test.jsonl")


def cli_env() -> dict[str, str]:
    return {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1",
            "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false", "COLUMNS": "200",
            "HOME": os.environ.get("HOME", "/tmp")}


def refusion(*args: str, timeout: float = 300) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "refusion_cli", "eval", *args], capture_output=True, text=True,
                          env=cli_env(), cwd=REPO, timeout=timeout)


def records(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines()]


def one_journal(run_dir: Path, decoder: str) -> Path:
    [path] = (run_dir / "samples" / "synthetic").glob(f"{decoder}__*.jsonl")
    return path


def direct_outputs(checkpoint: Path, decoder: str, config, n: int) -> list[str]:
    """Decode the first n synthetic problems without lm-eval: chat prompt, decoder, seed 0."""
    loaded = load_model(str(checkpoint), "cpu", require_mask=False)
    texts = []
    for problem in PROBLEMS[:n]:
        result = run_decoder(decoder, loaded.model, user_prompt_ids(loaded.tokenizer, problem["question"]), config,
                             mask_token_id=loaded.mask_token_id, eos_token_id=loaded.eos_token_id,
                             generator=torch.Generator().manual_seed(0))
        texts.append(loaded.tokenizer.decode(result.tokens, skip_special_tokens=True))
    return texts


def test_synthetic_run_writes_every_file_and_matches_direct_decoding(causal_checkpoint, tmp_path):
    run_dir = tmp_path / "run"
    out = refusion("--task", "synthetic", "--decoder", "refusion", "ar", "--model", str(causal_checkpoint),
                   "--limit", "5", "--set", "gen_length=48", "--output", str(run_dir))
    assert out.returncode == 0, out.stderr
    assert "accuracy (%) / TPS" in out.stdout and "TPF" in out.stdout
    metrics = json.loads((run_dir / "metrics.json").read_text())["results"]
    assert [m["decoder"] for m in metrics] == ["refusion", "ar"]
    suite = load_suite()
    configs = {"refusion": build_config("refusion", {"gen_length": 48}, base=suite.preset("synthetic_tiny")),
               "ar": build_config("ar", {"gen_length": 48})}
    for metric in metrics:
        decoder = metric["decoder"]
        lines = records(one_journal(run_dir, decoder))
        assert len(lines) == metric["samples"] == 5 and sorted(r["doc_id"] for r in lines) == list(range(5))
        for line in lines:
            assert {"prompt", "output", "target", "correct", "tokens", "seconds", "forwards", "tps"} <= set(line)
        expected = direct_outputs(causal_checkpoint, decoder, configs[decoder], 5)
        assert [r["output"] for r in sorted(lines, key=lambda r: r["doc_id"])] == expected
        correct = [is_correct(text, problem["target"]) for text, problem in zip(expected, PROBLEMS)]
        assert [r["correct"] for r in sorted(lines, key=lambda r: r["doc_id"])] == correct
        assert metric["accuracy"] == pytest.approx(100 * sum(correct) / 5)
        assert metric["lm_eval_accuracy"] == pytest.approx(metric["accuracy"])  # lm-eval's own aggregate agrees
        assert metric["config"] == configs[decoder].__dict__
        assert metric["tokens"] == sum(r["tokens"] for r in lines) and metric["tps"] > 0
    table = (run_dir / "summary.md").read_text()
    assert "| decoder:model | Synthetic |" in table and f"refusion:{causal_checkpoint.name}" in table
    csv_text = (run_dir / "summary.csv").read_text()
    assert f"ar:{causal_checkpoint.name}" in csv_text and " / " in csv_text


class CountingObserver:
    def __init__(self) -> None:
        self.decoded = 0
        self.stored = 0

    def on_run_start(self, benchmark, label, config) -> None: ...

    def on_requests(self, total: int, stored: int) -> None:
        self.stored += stored

    def on_sample(self, record) -> None:
        self.decoded += 1

    def on_run_end(self, result) -> None: ...


def eval_options(checkpoint: Path, output: Path, limit: int, **changes):
    from refusion_cli.harness.runner import EvalOptions

    settings = dict(tasks=["synthetic"], decoders=["ar"], output=output, models=[str(checkpoint)], limit=limit,
                    device="cpu")
    return EvalOptions(**{**settings, **changes})


def test_a_killed_run_resumes_without_decoding_any_sample_twice(causal_checkpoint, tmp_path):
    from refusion_cli.harness.runner import run_eval

    limit, run_dir = 12, tmp_path / "killed"
    process = subprocess.Popen(
        [sys.executable, "-m", "refusion_cli", "eval", "--task", "synthetic", "--decoder", "ar", "--model",
         str(causal_checkpoint), "--limit", str(limit), "--set", "gen_length=96", "--device", "cpu",
         "--output", str(run_dir)],
        env=cli_env(), cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    journal = None
    try:
        deadline = time.monotonic() + 240
        while time.monotonic() < deadline and process.poll() is None:
            found = list((run_dir / "samples" / "synthetic").glob("ar__*.jsonl"))
            if found and found[0].read_bytes().count(b"\n") >= 3:
                journal = found[0]
                break
            time.sleep(0.02)
    finally:
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGKILL)  # the process group this test started
        process.wait()
    assert journal is not None, "the run ended before any sample was journaled"
    before = journal.read_bytes()
    finished_before = before.count(b"\n")  # a torn last line is not a finished sample
    assert 3 <= finished_before < limit, "the kill came too late to test resuming"

    observer = CountingObserver()
    [resumed] = run_eval(eval_options(causal_checkpoint, run_dir, limit, overrides=["gen_length=96"]), observer)
    assert observer.stored == finished_before and observer.decoded == limit - finished_before
    after = journal.read_bytes()
    assert after.startswith(before[: before.rfind(b"\n") + 1])  # nothing written before is lost or rewritten
    lines = records(journal)
    assert len(lines) == limit and len({r["key"] for r in lines}) == limit  # no sample decoded twice
    assert resumed.resumed == finished_before and resumed.decoded == limit - finished_before

    [fresh] = run_eval(eval_options(causal_checkpoint, tmp_path / "fresh", limit, overrides=["gen_length=96"]))
    fresh_lines = {r["doc_id"]: r for r in records(one_journal(tmp_path / "fresh", "ar"))}
    for line in lines:
        assert line["output"] == fresh_lines[line["doc_id"]]["output"]
        assert line["tokens"] == fresh_lines[line["doc_id"]]["tokens"]
    assert (resumed.samples, resumed.accuracy, resumed.tokens, resumed.forwards) == \
        (fresh.samples, fresh.accuracy, fresh.tokens, fresh.forwards)


def test_a_run_interrupted_in_process_resumes_from_its_journal(causal_checkpoint, tmp_path):
    from refusion_cli.harness.runner import run_eval

    class StopAfter(CountingObserver):
        def on_sample(self, record) -> None:
            super().on_sample(record)
            if self.decoded == 2:
                raise KeyboardInterrupt

    options = eval_options(causal_checkpoint, tmp_path / "run", 5, decoders=["refusion"], overrides=["gen_length=32"])
    with pytest.raises(KeyboardInterrupt):
        run_eval(options, StopAfter())
    observer = CountingObserver()
    [result] = run_eval(options, observer)
    assert (observer.stored, observer.decoded, result.samples, result.resumed) == (2, 3, 5, 2)
    assert len(records(one_journal(tmp_path / "run", "refusion"))) == 5
    again = CountingObserver()
    run_eval(options, again)
    assert (again.stored, again.decoded) == (5, 0)
    changed = CountingObserver()  # another decoder setting is another run: nothing is reused
    run_eval(eval_options(causal_checkpoint, tmp_path / "run", 5, decoders=["refusion"],
                          overrides=["gen_length=32", "slot_threshold=0.5"]), changed)
    assert (changed.stored, changed.decoded) == (0, 5)


def test_the_journal_drops_a_torn_line_and_reads_every_process_file(tmp_path):
    from refusion_cli.harness.journal import SampleJournal, journal_path

    directory = tmp_path / "samples"
    directory.mkdir()
    line = lambda key, digest="c": json.dumps({"key": key, "config_hash": digest, "output": key}) + "\n"  # noqa: E731
    own = journal_path(directory, "ar__m")
    own.write_text(line("k0") + line("k1") + line("old", digest="other") + '{"key": "k2", "conf')  # killed mid-write
    journal_path(directory, "ar__m", rank=1).write_text(line("k3"))
    (directory / "ar__m2.jsonl").write_text(line("x"))  # another label
    journal = SampleJournal(directory, benchmark="synthetic", decoder="ar", model="m", label="ar__m",
                            config_hash="c", scorer=lambda *args: None)
    assert set(journal.stored) == {"k0", "k1", "k3"}  # other config hashes and labels are not reused
    assert own.read_text() == line("k0") + line("k1") + line("old", digest="other")


@pytest.mark.skipif(shutil.which("accelerate", path=str(Path(sys.executable).parent)) is None,
                    reason="accelerate's launcher is not installed")
def test_two_process_data_parallel_run_equals_one_process(causal_checkpoint, tmp_path):
    from refusion_cli.harness.runner import run_eval

    args = ["--task", "synthetic", "--decoder", "ar", "--model", str(causal_checkpoint), "--limit", "5",
            "--set", "gen_length=32", "--device", "cpu"]
    launcher = [str(Path(sys.executable).parent / "accelerate"), "launch", "--multi_gpu", "--num_processes", "2",
                "--num_machines", "1", "--mixed_precision", "no", "--dynamo_backend", "no", "-m", "refusion_cli", "eval"]
    out = subprocess.run([*launcher, *args, "--output", str(tmp_path / "dp")], capture_output=True, text=True,
                         env=cli_env(), cwd=REPO, timeout=170)
    assert out.returncode == 0, out.stderr[-2000:]
    shards = sorted((tmp_path / "dp" / "samples" / "synthetic").glob("ar__*.jsonl"))
    assert len(shards) == 2  # each process journaled its own share
    parallel = {r["doc_id"]: r for shard in shards for r in records(shard)}
    [single] = run_eval(eval_options(causal_checkpoint, tmp_path / "single", 5, overrides=["gen_length=32"]))
    alone = {r["doc_id"]: r for r in records(one_journal(tmp_path / "single", "ar"))}
    assert sorted(parallel) == sorted(alone) == list(range(5))
    assert all(parallel[i]["output"] == alone[i]["output"] and parallel[i]["tokens"] == alone[i]["tokens"]
               for i in alone)
    [merged] = json.loads((tmp_path / "dp" / "metrics.json").read_text())["results"]
    assert (merged["samples"], merged["accuracy"], merged["tokens"], merged["forwards"]) == \
        (single.samples, single.accuracy, single.tokens, single.forwards)


def test_models_default_to_the_embedded_ones_and_take_per_decoder_overrides():
    from refusion_cli.harness.runner import decoder_overrides, decoder_runs

    runs = decoder_runs(["refusion", "ar", "llada", "ar"], [])
    assert [(r.decoder, r.model, r.label) for r in runs] == [
        ("refusion", "refusion-tiny", "refusion:refusion-tiny"), ("ar", "ar-tiny", "ar:ar-tiny"),
        ("llada", "mdm-tiny", "llada:mdm-tiny")]
    runs = decoder_runs(["refusion", "ar"], ["/ckpt/shared", "ar=/ckpt/qwen3"])
    assert [(r.model, r.label, r.file_label) for r in runs] == [
        ("/ckpt/shared", "refusion:shared", "refusion__shared"), ("/ckpt/qwen3", "ar:qwen3", "ar__qwen3")]
    assert decoder_overrides(["gen_length=64", "refusion.slot_size=4", "steps=16"], ["refusion", "ar", "llada"]) == {
        "refusion": {"gen_length": "64", "slot_size": "4"}, "ar": {"gen_length": "64"},
        "llada": {"gen_length": "64", "steps": "16"}}


# --- one-line errors -------------------------------------------------------------------------


def run_cli(capsys, monkeypatch, *args: str) -> tuple[int, str, str]:
    from refusion_cli.cli.app import main

    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.delenv("REFUSION_DEBUG", raising=False)
    monkeypatch.setattr(sys, "argv", ["refusion", "eval", *args])
    with pytest.raises(SystemExit) as exit_info:
        main()
    out = capsys.readouterr()
    return exit_info.value.code, out.out, " ".join(out.err.split())


@pytest.mark.parametrize("args, message", [
    (["--task", "gsm9k"], "unknown task 'gsm9k'"),
    (["--task", "synthetic", "--decoder", "refusion", "--decoder", "rnn"], "unknown decoder 'rnn'"),
    (["--task", "synthetic", "--decoder", "ar", "--set", "slot_size=8"], "no selected decoder has an option 'slot_size'"),
    (["--task", "synthetic", "--set", "slot_sise=8"], "no selected decoder has an option 'slot_sise'"),
    (["--task", "synthetic", "--set", "token_threshold=1.5"], "token_threshold must be in [0, 1]"),
    (["--task", "synthetic", "--decoder", "ar", "--set", "refusion.slot_size=8"], "'refusion' is not a selected decoder"),
    (["--task", "synthetic", "--preset", "nope"], "unknown ReFusion preset 'nope'"),
    (["--task", "humaneval", "--decoder", "ar"], "--confirm-run-unsafe-code"),
    (["--task", "synthetic", "--decoder", "ar", "--model", "/no/such/checkpoint"], "no such checkpoint directory"),
    (["--task", "synthetic", "--decoder", "dream"], "the dream decoder has no embedded model"),
])
def test_bad_input_is_one_line_and_exit_2(args, message, causal_checkpoint, capsys, monkeypatch, tmp_path):
    if "--model" not in args and "dream" not in args:
        args = [*args, "--model", str(causal_checkpoint)]
    code, stdout, stderr = run_cli(capsys, monkeypatch, *args, "--output", str(tmp_path / "run"))
    assert code == 2 and message in stderr and "Traceback" not in stderr and stdout == ""
    assert not (tmp_path / "run").exists()  # nothing is written for a run that cannot start


def test_a_benchmark_without_offline_data_says_which_file_it_needs(causal_checkpoint, capsys, monkeypatch, tmp_path):
    start = time.monotonic()
    code, stdout, stderr = run_cli(capsys, monkeypatch, "--task", "gsm8k", "--decoder", "ar", "--model",
                                   str(causal_checkpoint), "--data-dir", str(tmp_path / "nothing"),
                                   "--output", str(tmp_path / "run"))
    assert code == 2 and stdout == "" and "Traceback" not in stderr
    squeezed = "".join(stderr.split())  # Rich may fold a long path across lines
    assert f"{tmp_path / 'nothing' / 'gsm8k' / 'test.jsonl'}ismissing" in squeezed and "openai/gsm8k" in stderr
    assert time.monotonic() - start < 30 and not (tmp_path / "run").exists()
